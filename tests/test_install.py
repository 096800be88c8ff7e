"""`psymesh node install` / `uninstall`: each platform's file rendered and checked without
touching the system (systemd-analyze verify where it exists, plistlib, sh -n), the install
and uninstall steps with a recording runner, and the command itself in a HOME of its own
with no service manager on PATH (so it writes the file and says what to run)."""
from __future__ import annotations

import json
import os
import plistlib
import shlex
import shutil
import stat
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from psymesh.node.control import install as svc

HOME = Path("/home/ann/psy home/100%$HOME")  # a space, a % and a $: each must reach the daemon as is


def daemon_args(home: Path, *, log_file: bool) -> list[str]:
    args = [sys.executable, "-m", "psymesh", "node", "start", "--home", str(home)]
    return args + ["--log-file", str(home / "node.log")] if log_file else args


def test_the_platform_is_termux_by_its_variable_or_its_directory_else_by_sys_platform() -> None:
    assert svc.detect_platform({"TERMUX_VERSION": "0.118.0"}, "linux", False) == "termux"
    assert svc.detect_platform({}, "linux", True) == "termux"
    assert svc.detect_platform({}, "darwin", False) == "macos"
    assert svc.detect_platform({}, "linux", False) == "linux"


def test_the_systemd_unit_runs_this_python_on_this_home_and_restarts_on_failure(tmp_path: Path) -> None:
    unit = svc.render_systemd(sys.executable, HOME)
    lines = unit.splitlines()
    [exec_start] = [line.removeprefix("ExecStart=") for line in lines if line.startswith("ExecStart=")]
    # systemd's quoting is the shell's double quotes; then %% and $$ stand for % and $
    assert [a.replace("%%", "%").replace("$$", "$") for a in shlex.split(exec_start)] == daemon_args(HOME, log_file=False)
    assert "Restart=on-failure" in lines and "WantedBy=default.target" in lines
    assert not any("StandardOutput" in line or "--log-file" in line for line in lines)  # journald keeps stderr
    if shutil.which("systemd-analyze") is None:
        return  # the tool is missing here: the rendering is checked above, the verification skipped
    path = tmp_path / svc.SYSTEMD_UNIT
    path.write_text(unit)
    done = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "psymesh.service" not in done.stderr, done.stderr  # no warning about our unit either
    broken = tmp_path / "broken.service"
    broken.write_text(unit.replace("Restart=on-failure", "Restart=sometimes"))
    assert "sometimes" in subprocess.run(["systemd-analyze", "verify", str(broken)], capture_output=True,
                                         text=True, timeout=60).stderr  # verify does read what we wrote


def test_the_launchd_agent_parses_and_logs_into_the_home() -> None:
    agent = plistlib.loads(svc.render_launchd(sys.executable, HOME).encode())
    assert agent["Label"] == svc.LAUNCHD_LABEL
    assert agent["ProgramArguments"] == daemon_args(HOME, log_file=True)
    assert agent["RunAtLoad"] is True and agent["KeepAlive"] == {"SuccessfulExit": False}
    assert agent["StandardOutPath"] == agent["StandardErrorPath"] == str(HOME / svc.START_LOG)


def test_the_termux_boot_script_takes_no_wake_lock_for_good_and_restarts_the_daemon(tmp_path: Path) -> None:
    script = svc.render_termux(sys.executable, HOME)
    assert script.startswith(f"#!{svc.TERMUX_SH}\n")
    commands = [line.strip() for line in script.splitlines() if not line.lstrip().startswith("#")]
    assert "termux-wake-lock" not in commands  # the daemon holds one only while work is in flight
    [loop] = [line for line in script.splitlines() if line.startswith("until ")]
    command = shlex.split(loop.removeprefix("until ").split(" 2>>")[0])
    assert command == daemon_args(HOME, log_file=True)
    path = tmp_path / "boot.sh"
    path.write_text(script)
    assert subprocess.run(["sh", "-n", str(path)], capture_output=True, timeout=30).returncode == 0


class Recorder:
    """A service manager that says yes (or no, to the commands in `fail`), and remembers."""

    def __init__(self, fail: Sequence[str] = ()) -> None:
        self.ran: list[tuple[str, ...]] = []
        self.fail = fail

    def __call__(self, cmd: Sequence[str]) -> subprocess.CompletedProcess[str]:
        self.ran.append(tuple(cmd))
        failed = any(word in cmd for word in self.fail)
        return subprocess.CompletedProcess(list(cmd), 1 if failed else 0, "", "Unit not loaded" if failed else "")


def test_install_writes_the_file_then_loads_it_and_uninstall_unloads_then_removes(tmp_path: Path) -> None:
    plan = svc.plan("linux", sys.executable, HOME, tmp_path, uid=1000)
    run = Recorder()
    done = svc.install(plan, available=True, run=run)
    assert plan.path == tmp_path / ".config/systemd/user/psymesh.service"
    assert plan.path.read_text() == plan.content and stat.S_IMODE(plan.path.stat().st_mode) == 0o644
    assert run.ran == list(plan.load) == list(done.ran) and done.to_run == ()
    assert run.ran[-1] == ("systemctl", "--user", "restart", "psymesh.service")

    run = Recorder(fail=["disable"])  # a reinstall: the old one is stopped first, and may not be running
    svc.install(plan, available=True, run=run)
    assert run.ran == list(plan.unload + plan.load)

    run = Recorder(fail=["disable"])
    done = svc.uninstall(plan, available=True, run=run)
    assert not plan.path.exists() and done.changed
    assert run.ran == list(plan.unload + plan.forget)
    assert any("disable" in note for note in done.notes)  # said, not fatal
    assert not svc.uninstall(plan, available=True, run=Recorder()).changed  # nothing left: fine

    with pytest.raises(svc.InstallError, match="enable"):
        svc.install(plan, available=True, run=Recorder(fail=["enable"]))


def test_without_the_service_manager_the_file_is_written_and_the_commands_are_handed_over(tmp_path: Path) -> None:
    plan = svc.plan("macos", sys.executable, HOME, tmp_path, uid=501)
    done = svc.install(plan, available=False, run=Recorder(fail=["launchctl"]))
    assert done.ran == () and done.to_run == (("launchctl", "bootstrap", "gui/501", str(plan.path)),)
    assert svc.manager_available(plan, which=lambda name: None, run=Recorder()) is False
    linux = svc.plan("linux", sys.executable, HOME, tmp_path, uid=501)
    no_user_manager = Recorder(fail=["show-environment"])
    assert svc.manager_available(linux, which=lambda name: f"/usr/bin/{name}", run=no_user_manager) is False
    assert svc.manager_available(linux, which=lambda name: f"/usr/bin/{name}", run=Recorder()) is True


def cli(env_home: Path, node_home: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The command in a HOME of its own, with nothing on PATH: no systemctl, no launchctl."""
    empty = env_home / "empty-path"
    empty.mkdir(exist_ok=True)
    environ = {k: v for k, v in os.environ.items() if k not in ("TERMUX_VERSION", "PSYMESH_HOME")}
    environ.update(HOME=str(env_home), PATH=str(empty), **env)
    return subprocess.run([sys.executable, "-m", "psymesh", "node", *args, "--home", str(node_home), "--json"],
                          capture_output=True, text=True, timeout=60, env=environ)


@pytest.mark.skipif(sys.platform == "darwin", reason="renders this machine's platform: Linux")
def test_the_command_installs_and_uninstalls_in_a_home_of_its_own(tmp_path: Path) -> None:
    node_home = tmp_path / "node"
    dry = cli(tmp_path, node_home, "install", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    shown = json.loads(dry.stdout)
    unit = tmp_path / ".config/systemd/user/psymesh.service"
    assert shown["path"] == str(unit) and shown["dry_run"] and not unit.exists() and not node_home.exists()
    assert f"--home {node_home}" in shown["content"]

    done = cli(tmp_path, node_home, "install", "--user")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["path"] == str(unit) and unit.read_text() == shown["content"]
    assert result["ran"] == [] and ["systemctl", "--user", "enable", "psymesh.service"] in result["to_run"]
    assert stat.S_IMODE(node_home.stat().st_mode) == 0o700  # the home is made, private, for the service

    gone = cli(tmp_path, node_home, "uninstall")
    assert gone.returncode == 0, gone.stderr
    assert json.loads(gone.stdout)["changed"] is True and not unit.exists()
    assert json.loads(cli(tmp_path, node_home, "uninstall").stdout)["changed"] is False

    termux = cli(tmp_path, node_home, "install", TERMUX_VERSION="0.118.0")
    assert termux.returncode == 0, termux.stderr
    script = tmp_path / ".termux/boot/psymesh"
    assert json.loads(termux.stdout)["path"] == str(script)
    assert stat.S_IMODE(script.stat().st_mode) == 0o700
    assert shlex.join(daemon_args(node_home.resolve(), log_file=True)) in script.read_text()
    assert json.loads(cli(tmp_path, node_home, "uninstall", TERMUX_VERSION="0.118.0").stdout)["changed"]
    assert not script.exists()


def test_with_a_log_file_the_daemon_logs_there_rotated_by_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    from psymesh.node.core import logs

    root = logging.getLogger()
    saved = (root.handlers[:], root.level, logging.getLogger("psymesh").level)
    monkeypatch.setattr(logs, "LOG_FILE_BYTES", 400)
    try:
        logs.setup_logging(log_file=tmp_path / "node.log")
        for i in range(20):
            logging.getLogger("psymesh.node").info("line %d of the test", i)
        for handler in root.handlers:
            handler.close()
    finally:
        root.handlers[:], level, psymesh_level = saved
        root.setLevel(level)
        logging.getLogger("psymesh").setLevel(psymesh_level)
    assert "line 19 of the test" in (tmp_path / "node.log").read_text()
    assert (tmp_path / "node.log.1").exists() and not (tmp_path / f"node.log.{logs.LOG_FILE_KEEP + 1}").exists()
