"""`psymesh model add/list/pull` as a user runs them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from psymesh.agent.runtime.testmodel import make_tiny_gguf


def cli(home: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "psymesh", *args, "--home", str(home)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


def test_add_and_list(tmp_path: Path) -> None:
    model = make_tiny_gguf(tmp_path / "tiny.gguf")
    added = cli(tmp_path / "h", "model", "add", "tiny", str(model), "--ctx", "2048", "--threads", "1", "--json")
    assert added.returncode == 0, added.stderr
    listed = json.loads(cli(tmp_path / "h", "model", "list", "--json").stdout)
    assert [(m["name"], m["n_ctx"], m["n_threads"]) for m in listed] == [("tiny", 2048, 1)]


def test_add_refuses_what_is_not_a_gguf(tmp_path: Path) -> None:
    bogus = tmp_path / "weights.bin"
    bogus.write_bytes(b"not a model")
    r = cli(tmp_path / "h", "model", "add", "x", str(bogus), "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["error"]["code"] == "bad_request"
    missing = cli(tmp_path / "h", "model", "add", "x", str(tmp_path / "nope.gguf"), "--json")
    assert json.loads(missing.stdout)["error"]["code"] == "not_found"


def test_pull_offline_names_the_file_to_fetch_by_hand(tmp_path: Path) -> None:
    r = cli(tmp_path / "h", "model", "pull", "qvac/BotPsy-0.8B-GGUF", "--file", "Q4_K_M", "--json",
            env={"HF_ENDPOINT": "http://127.0.0.1:9"})  # nothing listens on the discard port
    assert r.returncode == 1
    err = json.loads(r.stdout)["error"]
    assert err["code"] == "unavailable"
    assert "Q4_K_M" in err["message"] and "qvac/BotPsy-0.8B-GGUF" in err["message"]
    assert "psymesh model add" in err["message"] and "Traceback" not in r.stderr
    assert err["network"] == "connect"  # the network failed us: not a refusal
    human = cli(tmp_path / "h", "model", "pull", "qvac/BotPsy-0.8B-GGUF", "--file", "Q4_K_M",
                env={"HF_ENDPOINT": "http://127.0.0.1:9"})
    [hint, line] = human.stderr.strip().splitlines()  # what it tried; then one line naming its own next step
    assert hint.startswith("fetching the Q4_K_M GGUF")
    assert human.returncode == 1 and line.startswith("network error [unavailable]: cannot reach the model hub")
    assert line.endswith(f"psymesh model add --home {tmp_path / 'h'} NAME /path/to/that.gguf")  # the home given


def test_a_phone_without_the_model_is_told_to_run_it_on_home(tmp_path: Path) -> None:
    """On a phone the model usually lives on the home PC: the hint says how to run there
    first, and only then how to add it here (a home PC is told to add it)."""
    from psymesh.node.core.home import NodeHome

    phone = tmp_path / "phone"
    NodeHome(phone).init(profile="phone", name="phone")
    r = cli(phone, "agent", "run", "hi", "--model", "botpsy", "--delegate", "never", "--json")
    assert r.returncode == 1
    message = json.loads(r.stdout)["error"]["message"]
    assert "--delegate auto" in message and "--to HOME" in message and message.index("home PC") < message.index(
        f"psymesh model add --home {phone} botpsy PATH.gguf")  # for this home: it runs as printed
    home = tmp_path / "home"
    assert cli(home, "id").returncode == 0
    r = cli(home, "agent", "run", "hi", "--model", "botpsy", "--delegate", "never", "--json")
    assert "--delegate auto" not in json.loads(r.stdout)["error"]["message"]


def test_add_reads_the_header_only_and_never_loads_the_model(tmp_path: Path) -> None:
    """`model add` takes the context from the GGUF's key-value section alone: the file here is
    cut right after that section (no tensor infos, no weights), which neither llama.cpp nor
    gguf.GGUFReader could open, and the command never imports llama.cpp."""
    model = make_tiny_gguf(tmp_path / "tiny.gguf", n_ctx_train=6144)
    data = model.read_bytes()
    cut = tmp_path / "header-only.gguf"
    cut.write_bytes(data[:data.index(b"token_embd.weight") - 8])  # the first tensor info's name, length first
    probe = ("import sys\nfrom psymesh.cli import main\n"
             "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
             "assert 'llama_cpp' not in sys.modules, 'model add imported llama_cpp'\n")
    done = subprocess.run([sys.executable, "-c", probe, "model", "add", "cut", str(cut), "--home",
                           str(tmp_path / "h"), "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["n_ctx"] == 6144  # what the header declares
    (tmp_path / "cut-short.gguf").write_bytes(data[:40])  # inside the header: a clear refusal
    r = cli(tmp_path / "h", "model", "add", "x", str(tmp_path / "cut-short.gguf"), "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["error"]["code"] == "bad_request"
    assert "ends inside its GGUF header" in json.loads(r.stdout)["error"]["message"]
