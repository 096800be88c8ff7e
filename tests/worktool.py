"""A slow tool for tests that kill, cut or reroute daemons mid-task: `testwork.work(tag, ms)`,
installed as a `psymesh.tools` plugin (a dist-info on PYTHONPATH) for the daemons a test
starts. Each run logs `start TAG PID` and `done TAG PID`, so a test counts runs exactly."""
from __future__ import annotations

import textwrap
from collections import Counter
from pathlib import Path

import pytest

TOOL_NAME = "testwork.work"
LOG_ENV = "PSYMESH_TEST_TOOL_LOG"

PLUGIN = '''
import os
import time

from psymesh.agent.acting.tools import ToolContext, tool_from_function


def work(tag: str, ms: int = 400, *, ctx: ToolContext) -> dict:
    """Busy for `ms` milliseconds; logs its start and finish so tests can count runs."""
    def log(what: str) -> None:
        with open(os.environ["PSYMESH_TEST_TOOL_LOG"], "a") as f:
            f.write(f"{what} {tag} {os.getpid()}\\n")
    log("start")
    end = time.monotonic() + ms / 1000
    while time.monotonic() < end:
        ctx.check()
        time.sleep(0.01)  # a tool that takes time is the behaviour under test
    log("done")
    return {"tag": tag, "pid": os.getpid()}


TOOL = tool_from_function(work, "testwork.work")
'''


@pytest.fixture
def tool_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Install the plugin for daemons started by this test; the log of its runs."""
    site = tmp_path / "site"
    dist = site / "testwork_tool-1.0.dist-info"
    dist.mkdir(parents=True)
    (site / "testwork_tool.py").write_text(textwrap.dedent(PLUGIN))
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: testwork-tool\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[psymesh.tools]\ntestwork = testwork_tool:TOOL\n")
    log = tmp_path / "tool-runs.log"
    log.touch()
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv(LOG_ENV, str(log))
    return log


def tool_runs(log: Path) -> Counter[str]:
    """How many times each `start TAG` / `done TAG` happened, whatever the process."""
    return Counter(" ".join(line.split()[:2]) for line in log.read_text().splitlines())


def unfinished_runs(log: Path, pid: int) -> Counter[str]:
    """Runs the process `pid` started and has not finished (tag -> how many)."""
    lines = [line.split() for line in log.read_text().splitlines()]
    started = Counter(tag for what, tag, by in lines if what == "start" and by == str(pid))
    done = Counter(tag for what, tag, by in lines if what == "done" and by == str(pid))
    return started - done
