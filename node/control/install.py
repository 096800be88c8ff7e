"""`psymesh node install`: make the daemon start by itself, the way each platform does it.

    linux    a systemd *user* unit, ~/.config/systemd/user/psymesh.service: started at login
             (at boot too, with `loginctl enable-linger`), restarted when it fails; its
             stderr goes to journald (`journalctl --user -u psymesh`)
    macos    a launchd agent, ~/Library/LaunchAgents/org.psymesh.node.plist: started at
             login, restarted when it fails; the node logs to a rotating file in its home
    termux   a Termux:Boot script, ~/.termux/boot/psymesh: started at boot, started again when
             it fails; no wake lock for good (the daemon holds one only while work is in flight)

What is written is a pure function of (platform, python, home): `plan()` renders the file
and the commands that switch it on and off, so tests check every platform's file without
touching the system, and `--dry-run` shows exactly what would happen. `apply()` writes or
removes the file and runs the commands (given a runner), or, when the platform's service
manager is not there (no `systemctl --user`, no `launchctl`), says what to run.

Why the node logs to a file of its own under launchd and Termux but not under systemd:
journald keeps and rotates what a unit writes to stderr; launchd only appends it to a file
that grows for ever, and Termux:Boot keeps nothing. So there the daemon is started with
`--log-file` (node/core/logs.py: a size-rotated file), and the launchd/boot stderr file catches
only what happens before logging starts (a bad config, a crash at import).
"""
from __future__ import annotations

import os
import plistlib
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..core.commands import Commands
from ...protocol.errors import ErrorCode, PsymeshError

Platform = Literal["linux", "macos", "termux"]
PLATFORMS: tuple[Platform, ...] = ("linux", "macos", "termux")

SYSTEMD_UNIT = "psymesh.service"
LAUNCHD_LABEL = "org.psymesh.node"
TERMUX_SCRIPT = "psymesh"
TERMUX_SH = "/data/data/com.termux/files/usr/bin/sh"
LOG_FILE = "node.log"          # the daemon's own rotating log (launchd, Termux)
START_LOG = "service.log"      # stderr before logging starts (launchd, Termux)
RESTART_DELAY_S = 10


def detect_platform(env: Mapping[str, str], sys_platform: str, termux_dir_exists: bool) -> Platform:
    """Termux is Linux to Python, so it is told apart first: by $TERMUX_VERSION (set in every
    Termux shell) or by its app directory."""
    if env.get("TERMUX_VERSION") or termux_dir_exists:
        return "termux"
    if sys_platform == "darwin":
        return "macos"
    return "linux"


def this_platform() -> Platform:
    return detect_platform(os.environ, sys.platform, Path("/data/data/com.termux").is_dir())


Command = tuple[str, ...]


@dataclass(frozen=True)
class Plan:
    """What installing (or uninstalling) the daemon on one platform takes. Commands run in
    this order: `unload` (may fail: nothing may be loaded), write the file, `load`; and to
    uninstall: `unload`, remove the file, `forget`."""

    platform: Platform
    path: Path                       # the file written
    content: str
    mode: int                        # the file's mode
    manager: str | None              # the program that must exist to switch it on: systemctl, launchctl
    load: tuple[Command, ...] = ()   # after writing it: must succeed
    unload: tuple[Command, ...] = () # before (re)writing or removing it: may fail
    forget: tuple[Command, ...] = () # after removing it
    notes: tuple[str, ...] = ()      # what the owner should know or do by hand
    stop: str = ""                   # the command that stops the daemon it started (for this home)


def daemon_command(python: str, home: Path, *, log_file: bool) -> list[str]:
    """The daemon as the service manager runs it: in the foreground, with this python."""
    cmd = [python, "-m", "psymesh", "node", "start", "--home", str(home)]
    return cmd + ["--log-file", str(home / LOG_FILE)] if log_file else cmd


def _systemd_quote(arg: str) -> str:
    """One ExecStart word: `%` and `$` would be expanded by systemd, spaces split words."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if any(ch in arg for ch in " \t\"'\\;") or not arg:
        arg = '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return arg


def render_systemd(python: str, home: Path) -> str:
    exec_start = " ".join(_systemd_quote(a) for a in daemon_command(python, home, log_file=False))
    return "\n".join([
        "# Written by `psymesh node install`; removed by `psymesh node uninstall`.",
        "[Unit]",
        f"Description=psymesh node ({str(home).replace('%', '%%')})",
        "",
        "[Service]",
        "Type=simple",
        f"ExecStart={exec_start}",
        "Restart=on-failure",
        f"RestartSec={RESTART_DELAY_S}",
        # SIGTERM is the daemon's clean shutdown; give it time to finish what it writes.
        "TimeoutStopSec=30",
        "Environment=PYTHONUNBUFFERED=1",
        "",
        "[Install]",
        "WantedBy=default.target",
        "",
    ])


def render_launchd(python: str, home: Path) -> str:
    start_log = str(home / START_LOG)
    plist = {
        "Label": LAUNCHD_LABEL,
        "ProgramArguments": daemon_command(python, home, log_file=True),
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},  # restarted when it fails, not after `psymesh node stop`
        "ThrottleInterval": RESTART_DELAY_S,
        "ProcessType": "Background",
        "StandardOutPath": start_log,
        "StandardErrorPath": start_log,
        "EnvironmentVariables": {"PYTHONUNBUFFERED": "1"},
    }
    return plistlib.dumps(plist).decode()


def render_termux(python: str, home: Path) -> str:
    cmd = " ".join(shlex.quote(a) for a in daemon_command(python, home, log_file=True))
    return "\n".join([
        f"#!{TERMUX_SH}",
        "# Started by Termux:Boot at boot. Written by `psymesh node install`; removed by `psymesh node uninstall`.",
        "# No wake lock here: the daemon takes one (termux-wake-lock) only while work is in flight",
        "# and lets it go after (node/core/wakelock.py), so the phone's CPU may sleep the rest of the time.",
        "# Start it again when it fails (as systemd's Restart=on-failure); a clean stop ends the loop.",
        f"until {cmd} 2>>{shlex.quote(str(home / START_LOG))}; do",
        f"    sleep {RESTART_DELAY_S}",
        "done",
        "",
    ])


def plan(platform: Platform, python: str, home: Path, user_home: Path, uid: int) -> Plan:
    """Everything `node install` / `node uninstall` does on `platform`, computed, not done."""
    if platform == "linux":
        unit = user_home / ".config" / "systemd" / "user" / SYSTEMD_UNIT
        # restart, not start: a reinstall (another python, another home) takes effect now
        return Plan("linux", unit, render_systemd(python, home), 0o644, "systemctl",
                    load=(("systemctl", "--user", "daemon-reload"),
                          ("systemctl", "--user", "enable", SYSTEMD_UNIT),
                          ("systemctl", "--user", "restart", SYSTEMD_UNIT)),
                    unload=(("systemctl", "--user", "disable", "--now", SYSTEMD_UNIT),),
                    forget=(("systemctl", "--user", "daemon-reload"),),
                    notes=(f"logs: journalctl --user -u {SYSTEMD_UNIT}",
                           "to run it while you are logged out (and from boot): loginctl enable-linger $USER"))
    if platform == "macos":
        agent = user_home / "Library" / "LaunchAgents" / f"{LAUNCHD_LABEL}.plist"
        return Plan("macos", agent, render_launchd(python, home), 0o644, "launchctl",
                    load=(("launchctl", "bootstrap", f"gui/{uid}", str(agent)),),
                    unload=(("launchctl", "bootout", f"gui/{uid}/{LAUNCHD_LABEL}"),),
                    notes=(f"logs: {home / LOG_FILE} (rotated); startup errors: {home / START_LOG}",))
    script = user_home / ".termux" / "boot" / TERMUX_SCRIPT
    return Plan("termux", script, render_termux(python, home), 0o700, None, stop=Commands.of(home)("node stop"),
                notes=("install the Termux:Boot app (F-Droid) and open it once, so Android lets it run at boot",
                       f"start it now without rebooting: {script}",
                       f"logs: {home / LOG_FILE} (rotated); startup errors: {home / START_LOG}"))


Runner = Callable[[Sequence[str]], subprocess.CompletedProcess[str]]


def run_command(cmd: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=60, check=False)


def manager_available(p: Plan, which: Callable[[str], str | None], run: Runner) -> bool:
    """Whether the platform's service manager is there to talk to. `systemctl` alone is
    not enough: in a container, over ssh without a session, or as root without one, there
    is no user manager (`systemctl --user` fails to reach it)."""
    if p.manager is None or which(p.manager) is None:
        return False
    if p.manager == "systemctl":
        return run(("systemctl", "--user", "show-environment")).returncode == 0
    return True


@dataclass(frozen=True)
class Outcome:
    """What `install` / `uninstall` did: the file, the commands it ran, those it left to the
    owner (the service manager is not there), and what to know."""

    path: Path
    changed: bool                    # installed: the file was written; uninstalled: there was one to remove
    ran: tuple[Command, ...]
    to_run: tuple[Command, ...]
    notes: tuple[str, ...]


class InstallError(PsymeshError):
    """A service manager command that had to succeed failed; the message holds its output."""

    default_code = ErrorCode.UNAVAILABLE


def install(p: Plan, *, available: bool, run: Runner) -> Outcome:
    """Write the file (born with its final mode, replacing one left before), then switch it
    on when the service manager is there; else return the commands to run by hand."""
    if not available:
        _write(p)
        return Outcome(p.path, True, (), p.load, p.notes)
    unloaded = p.unload if p.path.exists() else ()  # a reinstall: stop the old one first
    notes = _try_all(unloaded, run)
    _write(p)
    _run_all(p.load, run)
    return Outcome(p.path, True, unloaded + p.load, (), notes + p.notes)


def uninstall(p: Plan, *, available: bool, run: Runner) -> Outcome:
    """Switch it off (when the service manager is there), then remove the file. Uninstalling
    what is not installed is not an error: `changed` is False."""
    present = p.path.exists()
    notes: tuple[str, ...] = ()
    if present and available:
        notes = _try_all(p.unload, run)
    p.path.unlink(missing_ok=True)
    if present and available:
        _run_all(p.forget, run)
    if p.platform == "termux":
        notes += (f"the daemon Termux:Boot started keeps running until: {p.stop}",)
    ran = p.unload + p.forget if present and available else ()
    to_run = p.unload + p.forget if present and not available else ()
    return Outcome(p.path, present, ran, to_run, notes)


def _write(p: Plan) -> None:
    p.path.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.path.with_name(p.path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, p.mode)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), p.mode)  # exactly, whatever the umask
        f.write(p.content)
    os.replace(tmp, p.path)


def _run_all(commands: Sequence[Command], run: Runner) -> None:
    for cmd in commands:
        done = run(cmd)
        if done.returncode != 0:
            raise InstallError(f"{shlex.join(cmd)} failed (exit {done.returncode}){_said(done)}")


def _try_all(commands: Sequence[Command], run: Runner) -> tuple[str, ...]:
    """Commands that may fail (stopping what may not run): their failures, as notes."""
    failed = []
    for cmd in commands:
        done = run(cmd)
        if done.returncode != 0:
            failed.append(f"{shlex.join(cmd)}: exit {done.returncode}{_said(done)} (it was not loaded?)")
    return tuple(failed)


def _said(done: subprocess.CompletedProcess[str]) -> str:
    said = (done.stderr or done.stdout or "").strip()
    return f": {said}" if said else ""
