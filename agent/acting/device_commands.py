"""The real device behind the phone's tools, where it offers an interface: Termux:API's
``termux-*`` commands on Android, ``nmcli`` and ``notify-send`` on a Linux desktop.

:func:`detect_phone` picks, for each job of a :class:`~.device.Phone` (Wi-Fi, messages,
notifications), the first real interface whose commands are all on PATH, and the
simulated phone for the rest. What is on PATH is a function the caller gives
(``shutil.which`` by default), and the commands run by the path it found, so a test
puts executables of its own in a folder and looks there.

Each command runs as a child process (no shell; text that could read as an option goes on
stdin or after ``--``) and is given `timeout_s` to answer; one that fails, times out or
answers something unreadable is the tool's error (UNAVAILABLE, with the command's own
words), never the node's.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar, Protocol, TypeVar

from .device import Contact, DeviceState, MessagePage, Notice, Phone, SentMessage, WifiState
from .tools import ToolError
from ...protocol.errors import ErrorCode

__all__ = ["COMMAND_TIMEOUT_S", "Commands", "Which", "detect_phone"]

Which = Callable[[str], "str | None"]  # a command's name -> its path, or None (shutil.which)
COMMAND_TIMEOUT_S = 20.0  # Termux:API asks Android, which may first ask the person for a permission
MAX_CONTACTS = 500        # contacts.list's answer stays a size a model can read
_STDERR_CHARS = 300


def _now() -> str:
    return datetime.now().replace(microsecond=0).isoformat()


@dataclass(frozen=True)
class Commands:
    """Device commands found on PATH, by name, and how long each may take."""

    paths: dict[str, str]
    timeout_s: float = COMMAND_TIMEOUT_S

    @classmethod
    def find(cls, which: Which, names: Sequence[str], timeout_s: float = COMMAND_TIMEOUT_S) -> Commands | None:
        """The commands `names`, if every one of them is on PATH."""
        paths = {n: which(n) for n in names}
        found = {n: p for n, p in paths.items() if p}
        return cls(found, timeout_s) if len(found) == len(names) else None

    def run(self, name: str, *args: str, stdin: str | None = None) -> str:
        """The command's standard output, or ToolError UNAVAILABLE saying why there is none."""
        try:
            done = subprocess.run([self.paths[name], *args], input=stdin, capture_output=True, text=True,
                                  stdin=subprocess.DEVNULL if stdin is None else None,
                                  timeout=self.timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise ToolError(f"{name} did not answer within {self.timeout_s:g} s", code=ErrorCode.UNAVAILABLE) from None
        except OSError as exc:
            raise ToolError(f"cannot run {name}: {exc.strerror}", code=ErrorCode.UNAVAILABLE) from None
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip()[-_STDERR_CHARS:]
            raise ToolError(f"{name} failed (exit status {done.returncode}){': ' + said if said else ''}",
                            code=ErrorCode.UNAVAILABLE)
        return done.stdout

    def json(self, name: str, *args: str) -> Any:
        out = self.run(name, *args)
        try:
            return json.loads(out)
        except ValueError:
            raise ToolError(f"{name} answered something that is not JSON: {out.strip()[:_STDERR_CHARS]!r}",
                            code=ErrorCode.UNAVAILABLE) from None


# --------------------------------------------------------------------------- Termux:API (Android)

TERMUX = "termux-api"


@dataclass(frozen=True)
class TermuxWifi:
    NEEDS: ClassVar[tuple[str, ...]] = ("termux-wifi-connectioninfo", "termux-wifi-enable")
    commands: Commands
    backend: str = TERMUX

    def wifi_status(self) -> WifiState:
        # Android reports the supplicant's state, not the radio's: off reads as one of these.
        info = self.commands.json("termux-wifi-connectioninfo")
        state = str(info.get("supplicant_state", "")) if isinstance(info, dict) else ""
        connected = state == "COMPLETED"
        ssid = info.get("ssid") if connected and isinstance(info, dict) else None
        return WifiState(enabled=connected or state not in ("", "UNINITIALIZED", "INTERFACE_DISABLED"),
                         connected=connected, ssid=str(ssid) if ssid else None)

    def set_wifi(self, enabled: bool) -> WifiState:
        self.commands.run("termux-wifi-enable", "true" if enabled else "false")
        return {**self.wifi_status(), "enabled": enabled}  # joining a network takes a while


@dataclass(frozen=True)
class TermuxMessages:
    NEEDS: ClassVar[tuple[str, ...]] = ("termux-contact-list", "termux-sms-list", "termux-sms-send")
    commands: Commands
    backend: str = TERMUX

    def contacts(self) -> list[Contact]:
        found = self.commands.json("termux-contact-list")
        return [Contact(name=str(c["name"]), number=str(c["number"])) for c in found if isinstance(c, dict)
                and c.get("name") and c.get("number")][:MAX_CONTACTS] if isinstance(found, list) else []

    def list_messages(self, folder: str = "inbox", limit: int = 20) -> MessagePage:
        found = self.commands.json("termux-sms-list", "-t", folder, "-l", str(limit))
        who = "from" if folder == "inbox" else "to"
        messages = [{"id": m.get("_id"), who: m.get("sender") or m.get("number"), "text": m.get("body", ""),
                     "at": m.get("received")} for m in (found if isinstance(found, list) else []) if isinstance(m, dict)]
        return MessagePage(folder=folder, messages=messages)

    def send_message(self, to: str, text: str) -> SentMessage:
        contacts = self.contacts()
        match = next((c for c in contacts if c["name"].casefold() == to.strip().casefold()), None)
        if match is None:
            known = ", ".join(c["name"] for c in contacts[:50]) + (", ..." if len(contacts) > 50 else "")
            raise ToolError(f"no contact named {to!r} (contacts: {known})", code=ErrorCode.NOT_FOUND)
        # the text on stdin: as an argument, one starting with "-" would read as an option
        self.commands.run("termux-sms-send", "-n", match["number"], stdin=text)
        return SentMessage(to=match["name"], number=match["number"], size_bytes=len(text.encode()), sent_at=_now())


@dataclass(frozen=True)
class TermuxNotify:
    NEEDS: ClassVar[tuple[str, ...]] = ("termux-notification",)
    commands: Commands
    backend: str = TERMUX

    def notify(self, title: str, text: str) -> Notice:
        self.commands.run("termux-notification", "-t", title, "-c", text)
        return Notice(title=title, text=text, shown_at=_now())


# --------------------------------------------------------------------------- a Linux desktop


@dataclass(frozen=True)
class NmcliWifi:
    NEEDS: ClassVar[tuple[str, ...]] = ("nmcli",)
    commands: Commands
    backend: str = "nmcli"

    def wifi_status(self) -> WifiState:
        enabled = self.commands.run("nmcli", "radio", "wifi").strip() == "enabled"
        ssid = None
        if enabled:  # terse lines ACTIVE:SSID, a ':' inside the SSID escaped as '\:'
            for line in self.commands.run("nmcli", "-t", "-f", "ACTIVE,SSID", "device", "wifi", "list",
                                          "--rescan", "no").splitlines():
                active, _, name = line.partition(":")
                if active == "yes":
                    ssid = name.replace("\\:", ":")
                    break
        return WifiState(enabled=enabled, connected=ssid is not None, ssid=ssid)

    def set_wifi(self, enabled: bool) -> WifiState:
        self.commands.run("nmcli", "radio", "wifi", "on" if enabled else "off")
        return self.wifi_status()


@dataclass(frozen=True)
class NotifySend:
    NEEDS: ClassVar[tuple[str, ...]] = ("notify-send",)
    commands: Commands
    backend: str = "notify-send"

    def notify(self, title: str, text: str) -> Notice:
        self.commands.run("notify-send", "--", title, text)
        return Notice(title=title, text=text, shown_at=_now())


B = TypeVar("B", covariant=True)


class _Real(Protocol[B]):
    """A real backend's class: the commands it needs, and how it is made from them."""

    NEEDS: ClassVar[tuple[str, ...]]

    def __call__(self, commands: Commands) -> B: ...


def _first(which: Which, timeout_s: float, simulated: B, *kinds: _Real[B]) -> B:
    for kind in kinds:
        commands = Commands.find(which, kind.NEEDS, timeout_s)
        if commands is not None:
            return kind(commands)
    return simulated


def detect_phone(device: DeviceState, which: Which = shutil.which, *,
                 timeout_s: float = COMMAND_TIMEOUT_S) -> Phone:
    """The phone's backends on this machine: for each job the first real interface whose
    commands `which` finds (Termux:API before a desktop's), else the simulated `device`."""
    return Phone(device=device,
                 wifi=_first(which, timeout_s, device, TermuxWifi, NmcliWifi),
                 messages=_first(which, timeout_s, device, TermuxMessages),
                 notify=_first(which, timeout_s, device, TermuxNotify, NotifySend))
