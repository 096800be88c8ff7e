"""The phone's tools say what they act on: the simulated phone (a row in device.db) unless the
device offers a real interface on PATH (Termux:API on Android; nmcli and notify-send on a Linux
desktop), which is then driven as commands. The "device" here is executables this test writes
into a folder: real processes, run by the path the injected lookup finds, that record their
arguments and standard input and answer as the real commands do."""
from __future__ import annotations

import functools
import json
import os
import shutil
import sqlite3
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import run_nodes
from psymesh.agent.acting.builtin_tools import default_registry
from psymesh.agent.acting.device import SIMULATED, DeviceState, Phone
from psymesh.agent.acting.device_commands import detect_phone
from psymesh.agent.acting.tools import ToolContext, ToolError, ToolRegistry
from psymesh.protocol import control as c
from psymesh.protocol.errors import ErrorCode

PHONE = ToolContext(profile="phone")
DEVICE_TOOLS = {"wifi.status", "wifi.set", "storage.status", "contacts.list", "messages.list", "messages.delete",
                "messages.send", "notify.show", "calendar.list", "calendar.add", "reminders.add", "reminders.list",
                "reminders.complete"}
CONTACTS = [{"name": "Alice", "number": "+1 555 0101"}, {"name": "Bob", "number": "+1 555 0102"}]
SMS = [{"threadid": 1, "type": "inbox", "read": False, "number": "+1 555 0102", "received": "2026-12-05 08:00:00",
        "body": "Lunch?", "_id": 17}]
WIFI_ON = {"supplicant_state": "COMPLETED", "ssid": "HomeNet", "ip": "192.168.1.7"}

FAKE = '''#!{python}
import json, os, sys
stdin = "" if sys.stdin.isatty() else sys.stdin.read()
with open(os.environ.get("FAKE_LOG") or {log!r}, "a") as log:
    log.write(json.dumps({{"cmd": os.path.basename(sys.argv[0]), "args": sys.argv[1:], "stdin": stdin}}) + "\\n")
sys.stdout.write({answer!r})
sys.stderr.write({complaint!r})
sys.exit({status})
'''


class FakeDevice:
    """A folder of executables standing in for a device's commands, and the log they write."""

    def __init__(self, path: Path) -> None:
        self.bin = path / "bin"
        self.bin.mkdir()
        self.log = path / "calls.jsonl"

    def command(self, name: str, answer: object = "", *, status: int = 0, complaint: str = "") -> None:
        text = answer if isinstance(answer, str) else json.dumps(answer)
        script = self.bin / name
        script.write_text(FAKE.format(python=sys.executable, log=str(self.log), answer=text, complaint=complaint,
                                      status=status))
        script.chmod(0o755)

    def which(self, name: str) -> str | None:
        return shutil.which(name, path=str(self.bin))

    def calls(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []


@pytest.fixture
def fake(tmp_path: Path) -> FakeDevice:
    return FakeDevice(tmp_path)


@pytest.fixture
def device(tmp_path: Path) -> Iterator[DeviceState]:
    with DeviceState(tmp_path / "device.db") as d:
        yield d


def backends(reg: ToolRegistry) -> dict[str, str]:
    return {t.name: t.backend for t in reg if t.backend}


def test_the_simulated_phone_says_so_in_every_tool_it_lists(device: DeviceState) -> None:
    reg = default_registry("phone", phone=Phone.simulated(device))
    assert backends(reg) == dict.fromkeys(DEVICE_TOOLS, SIMULATED)
    specs = {s.name: s for s in reg.specs("phone")}
    for name in DEVICE_TOOLS:  # what a model and a person read first
        assert specs[name].description.startswith("(simulated: this node's device.db, not a real phone) ")
    assert specs["messages.send"].description.endswith("Send a text message to a contact (needs Wi-Fi and free "
                                                       "message storage).")
    assert "simulated" not in specs["system.info"].description and reg.get("system.info").backend == ""


@pytest.mark.anyio
async def test_a_simulated_notification_is_a_row_and_an_older_database_gains_the_table(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    DeviceState(path).close()
    with sqlite3.connect(path) as conn:  # as a v1 database was: no notifications table
        conn.execute("DROP TABLE notifications")
        conn.execute("PRAGMA user_version = 1")
    conn.close()
    with DeviceState(path) as device:
        reg = default_registry("phone", phone=Phone.simulated(device))
        shown = await reg.invoke("notify.show", {"title": "Psymesh", "text": "Home by 6"}, PHONE)
        assert [(n["title"], n["text"]) for n in device.notifications()] == [("Psymesh", "Home by 6")]
        assert shown["id"] == device.notifications()[0]["id"]
        assert device.list_messages()["total"] == 2  # the seeded messages kept, not seeded again


def test_nothing_on_path_is_the_simulated_phone(device: DeviceState, fake: FakeDevice) -> None:
    fake.command("termux-wifi-enable")  # one of Termux:API's Wi-Fi pair is not a Wi-Fi interface
    phone = detect_phone(device, fake.which)
    assert phone == Phone.simulated(device)


@pytest.mark.anyio
async def test_termux_api_on_path_drives_the_real_phone(device: DeviceState, fake: FakeDevice) -> None:
    fake.command("termux-wifi-connectioninfo", WIFI_ON)
    fake.command("termux-wifi-enable")
    fake.command("termux-contact-list", CONTACTS)
    fake.command("termux-sms-list", SMS)
    fake.command("termux-sms-send")
    fake.command("termux-notification")
    reg = default_registry("phone", phone=detect_phone(device, fake.which))
    real = {"wifi.status", "wifi.set", "contacts.list", "messages.list", "messages.send", "notify.show"}
    assert backends(reg) == {**dict.fromkeys(real, "termux-api"),
                             **dict.fromkeys({"calendar.list", "calendar.add", "reminders.add", "reminders.list",
                                              "reminders.complete"}, SIMULATED)}
    assert "messages.delete" not in reg.names()  # Termux:API cannot delete a message; the simulated store's quota
    assert "storage.status" not in reg.names()   # means nothing for real messages
    send = reg.get("messages.send")
    assert send.irreversible and send.description.endswith("(on this device, through termux-api)")

    assert await reg.invoke("wifi.status", {}, PHONE) == {"enabled": True, "connected": True, "ssid": "HomeNet"}
    assert (await reg.invoke("wifi.set", {"enabled": False}, PHONE))["enabled"] is False
    assert await reg.invoke("contacts.list", {}, PHONE) == CONTACTS
    listed = await reg.invoke("messages.list", {"folder": "inbox", "limit": 5}, PHONE)
    assert listed["messages"] == [{"id": 17, "from": "+1 555 0102", "text": "Lunch?", "at": "2026-12-05 08:00:00"}]
    text = "-n is not an option: home by 6"
    sent = await reg.invoke("messages.send", {"to": "alice", "text": text}, PHONE)
    assert sent["to"] == "Alice" and sent["number"] == "+1 555 0101"
    await reg.invoke("notify.show", {"title": "Psymesh", "text": "Home by 6"}, PHONE)

    calls = [(x["cmd"], x["args"], x["stdin"]) for x in fake.calls()]
    assert ("termux-wifi-enable", ["false"], "") in calls
    assert ("termux-sms-list", ["-t", "inbox", "-l", "5"], "") in calls
    assert ("termux-sms-send", ["-n", "+1 555 0101"], text) in calls  # the text on stdin, never read as options
    assert ("termux-notification", ["-t", "Psymesh", "-c", "Home by 6"], "") in calls
    assert device.list_messages("sent")["total"] == 0  # nothing went to the simulated store


@pytest.mark.anyio
async def test_nmcli_and_notify_send_on_a_linux_desktop(device: DeviceState, fake: FakeDevice) -> None:
    fake.command("nmcli", "enabled\n")  # `nmcli radio wifi`; the listing below is the same script's answer
    fake.command("notify-send")
    phone = detect_phone(device, fake.which)
    reg = default_registry("phone", phone=phone)
    assert {n: b for n, b in backends(reg).items() if b != SIMULATED} == {
        "wifi.status": "nmcli", "wifi.set": "nmcli", "notify.show": "notify-send"}
    assert backends(reg)["messages.send"] == SIMULATED  # no SMS on a desktop: still the simulated phone's

    await reg.invoke("wifi.set", {"enabled": False}, PHONE)
    await reg.invoke("notify.show", {"title": "-t", "text": "--help"}, PHONE)
    calls = [(x["cmd"], x["args"]) for x in fake.calls()]
    assert ("nmcli", ["radio", "wifi", "off"]) in calls
    assert ("notify-send", ["--", "-t", "--help"]) in calls  # after "--": text, not options
    assert device.wifi_status()["enabled"] is True  # the simulated phone's Wi-Fi was not the one switched


@pytest.mark.anyio
async def test_a_failing_command_is_the_tools_error_with_its_own_words(device: DeviceState,
                                                                      fake: FakeDevice) -> None:
    fake.command("nmcli", status=8, complaint="Error: NetworkManager is not running.")
    reg = default_registry("phone", phone=detect_phone(device, fake.which))
    with pytest.raises(ToolError) as err:
        await reg.invoke("wifi.status", {}, PHONE)
    assert err.value.code is ErrorCode.UNAVAILABLE
    assert "nmcli failed (exit status 8): Error: NetworkManager is not running." in str(err.value)


@pytest.mark.anyio
async def test_status_shows_which_backend_each_device_tool_uses(tmp_path: Path, fake: FakeDevice) -> None:
    from psymesh.node.control.client import Client

    fake.command("nmcli", "enabled\n")
    environ = {**os.environ, "PATH": str(fake.bin)}
    auto = {"device": "auto"}  # run_nodes keeps test phones simulated unless told
    async with run_nodes(tmp_path, "phone", "home", "kept", profiles={"phone": "phone", "kept": "phone"},
                         configs={"phone": auto, "home": auto}, environs=dict.fromkeys(("phone", "home", "kept"), environ)
                         ) as nodes:
        async with Client(nodes["phone"].home.path) as client:
            phone = await client.status()
        async with Client(nodes["home"].home.path) as client:
            home = await client.status()
        async with Client(nodes["kept"].home.path) as client:
            kept = await client.status()  # config device = "simulated": nmcli on PATH or not
    shown = {d.tool: d.backend for d in phone.device_tools}
    assert shown == {**dict.fromkeys(DEVICE_TOOLS, SIMULATED), "wifi.status": "nmcli", "wifi.set": "nmcli"}
    assert home.device_tools == []  # a home PC has no phone tools
    assert {d.tool: d.backend for d in kept.device_tools} == dict.fromkeys(DEVICE_TOOLS, SIMULATED)
    assert isinstance(phone, c.StatusReply)


def test_status_prints_the_backends_by_group() -> None:
    from psymesh.node.cli.status import device_lines

    lines = device_lines([("wifi.set", "nmcli"), ("messages.send", SIMULATED), ("wifi.status", "nmcli"),
                          ("calendar.add", SIMULATED)])
    assert lines == ["simulated: this node's device.db, not a real phone: calendar.add, messages.send",
                     "on this device, through nmcli: wifi.set, wifi.status"]
