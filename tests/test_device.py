"""The simulated phone: its rules, its tools and the wifi-off/inbox-full scenario,
on a real SQLite file that is reopened to prove state persists."""
from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from psymesh.agent.acting.builtin_tools import default_registry
from psymesh.agent.acting.device import (
    MESSAGE_RESERVE_BYTES,
    NO_NETWORK,
    STORAGE_FULL,
    DeviceState,
    Phone,
    wifi_off_inbox_full,
)
from psymesh.agent.acting.tools import ToolContext, ToolError, ToolRegistry
from psymesh.protocol.errors import ErrorCode

NOW = datetime(2025, 6, 2, 9, 30)


def clock() -> datetime:
    return NOW


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "device.db"


@pytest.fixture
def phone(db_path: Path) -> Iterator[tuple[DeviceState, ToolRegistry]]:
    device = DeviceState(db_path, clock=clock)
    yield device, default_registry("phone", phone=Phone.simulated(device))
    device.close()


PHONE = ToolContext(profile="phone")


@pytest.mark.anyio
async def test_scenario_send_needs_wifi_and_free_space(phone: tuple[DeviceState, ToolRegistry], db_path: Path) -> None:
    device, reg = phone
    fillers = wifi_off_inbox_full(device)
    assert len(fillers) >= 2
    status = await reg.invoke("storage.status", {}, PHONE)
    assert status["messages"]["full"] is True and status["messages"]["free_bytes"] == 0
    send = {"to": "alice", "text": "Running 10 minutes late"}

    with pytest.raises(ToolError) as err:
        await reg.invoke("messages.send", send, PHONE)
    assert err.value.code is ErrorCode.UNAVAILABLE and err.value.message.startswith(NO_NETWORK)

    assert await reg.invoke("wifi.set", {"enabled": True}, PHONE) == {"enabled": True, "connected": True,
                                                                      "ssid": "HomeNet"}
    with pytest.raises(ToolError) as err:
        await reg.invoke("messages.send", send, PHONE)
    assert err.value.message.startswith(STORAGE_FULL)
    with pytest.raises(ToolError, match=STORAGE_FULL):  # receiving is blocked too
        device.receive_message("Bob", "are you there?")

    inbox = await reg.invoke("messages.list", {"limit": 100}, PHONE)
    biggest = max(inbox["messages"], key=lambda m: m["size_bytes"])
    assert biggest["attachment"].endswith(".mp4") and biggest["id"] in fillers
    deleted = await reg.invoke("messages.delete", {"ids": [biggest["id"], 99999]}, PHONE)
    assert deleted["deleted"] == [biggest["id"]] and deleted["not_found"] == [99999]
    assert deleted["freed_bytes"] == biggest["size_bytes"] and deleted["storage"]["full"] is False

    sent = await reg.invoke("messages.send", send, PHONE)
    assert sent["to"] == "Alice" and sent["size_bytes"] == len(send["text"])
    device.close()

    # Everything survives reopening the database.
    with DeviceState(db_path, clock=clock) as again:
        assert again.wifi_status()["enabled"] is True
        assert again.list_messages("sent")["messages"][0]["text"] == send["text"]
        assert biggest["id"] not in [m["id"] for m in again.list_messages("inbox", 100)["messages"]]
        assert again.storage_status()["messages"]["count"] == inbox["total"] - 1 + 1


def test_state_persists_and_seed_runs_once(db_path: Path) -> None:
    with DeviceState(db_path, clock=clock) as device:
        seeded = device.list_messages()["total"]
        assert seeded == 2 and device.wifi_status()["enabled"]
        device.set_wifi(False)
        device.add_event("Dentist", NOW + timedelta(days=1), 45)
        device.add_reminder("Buy milk", NOW + timedelta(hours=2))
    with DeviceState(db_path, clock=clock) as device:
        assert device.list_messages()["total"] == seeded      # not seeded twice
        assert device.wifi_status() == {"enabled": False, "connected": False, "ssid": None}
        assert device.list_events((NOW + timedelta(days=1)).date())["events"][0]["title"] == "Dentist"
        assert device.list_reminders()["reminders"][0]["text"] == "Buy milk"


def test_newer_schema_is_refused(db_path: Path) -> None:
    DeviceState(db_path).close()
    with sqlite3.connect(db_path) as conn:
        conn.execute("PRAGMA user_version = 99")
    conn.close()
    with pytest.raises(ToolError) as err:
        DeviceState(db_path)
    assert err.value.code is ErrorCode.UNSUPPORTED_VERSION


def test_open_connection_is_accepted_and_left_open() -> None:
    conn = sqlite3.connect(":memory:", check_same_thread=False)
    with DeviceState(conn, clock=clock) as device:
        device.set_wifi(False)
    assert conn.execute("SELECT value FROM settings WHERE key = 'wifi_enabled'").fetchone()[0] == "false"
    conn.close()


@pytest.mark.anyio
async def test_messages_rules(phone: tuple[DeviceState, ToolRegistry]) -> None:
    device, reg = phone
    with pytest.raises(ToolError) as err:
        await reg.invoke("messages.send", {"to": "Zed", "text": "hi"}, PHONE)
    assert err.value.code is ErrorCode.NOT_FOUND and "Alice" in err.value.message
    with pytest.raises(ToolError, match="at most 2000 characters"):
        await reg.invoke("messages.send", {"to": "Bob", "text": "x" * 2001}, PHONE)
    with pytest.raises(ToolError, match="either ids"):
        await reg.invoke("messages.delete", {}, PHONE)
    with pytest.raises(ToolError, match="either ids"):
        await reg.invoke("messages.delete", {"ids": [1], "older_than_days": 3}, PHONE)

    old = device._insert_message("inbox", "Sam", "old news", at=NOW - timedelta(days=40))
    out = await reg.invoke("messages.delete", {"older_than_days": 30}, PHONE)
    assert out["deleted"] == [old]
    assert [m["from"] for m in (await reg.invoke("messages.list", {}, PHONE))["messages"]] == ["Bob", "Mom"]

    # Near-full counts as full: a message store with less than the reserve left takes nothing.
    device.configure(message_quota_bytes=device.storage_status()["messages"]["used_bytes"]
                     + MESSAGE_RESERVE_BYTES - 1)
    with pytest.raises(ToolError, match=STORAGE_FULL):
        await reg.invoke("messages.send", {"to": "Bob", "text": "ok"}, PHONE)
    device.configure(message_quota_bytes=50 * 1024**2)
    assert (await reg.invoke("messages.send", {"to": "Bob", "text": "ok"}, PHONE))["id"] > 0


@pytest.mark.anyio
async def test_calendar_and_reminders(phone: tuple[DeviceState, ToolRegistry]) -> None:
    device, reg = phone
    first = await reg.invoke("calendar.add", {"title": "Standup", "start": "2025-06-02T10:00",
                                              "duration_min": 30}, PHONE)
    assert first["overlaps"] == [] and first["start"] == "2025-06-02T10:00:00"
    clash = await reg.invoke("calendar.add", {"title": "Call Mom", "start": "2025-06-02 10:15"}, PHONE)
    assert clash["overlaps"] == ["Standup"]
    later = await reg.invoke("calendar.add", {"title": "Gym", "start": "2025-06-02T10:30"}, PHONE)
    assert later["overlaps"] == ["Call Mom"]  # Standup ends exactly at 10:30
    await reg.invoke("calendar.add", {"title": "Tomorrow", "start": "2025-06-03T08:00"}, PHONE)
    today = await reg.invoke("calendar.list", {}, PHONE)  # defaults to the device's today
    assert today["day"] == "2025-06-02"
    assert [e["title"] for e in today["events"]] == ["Standup", "Call Mom", "Gym"]
    with pytest.raises(ToolError, match="start"):
        await reg.invoke("calendar.add", {"title": "x", "start": "next tuesday"}, PHONE)

    r = await reg.invoke("reminders.add", {"text": "Water plants", "at": "2025-06-02T18:00"}, PHONE)
    await reg.invoke("reminders.add", {"text": "Pay rent", "at": "2025-06-01T09:00"}, PHONE)
    listed = await reg.invoke("reminders.list", {}, PHONE)
    assert [x["text"] for x in listed["reminders"]] == ["Pay rent", "Water plants"]
    done = await reg.invoke("reminders.complete", {"id": r["id"]}, PHONE)
    assert done["done"] is True
    assert [x["text"] for x in (await reg.invoke("reminders.list", {}, PHONE))["reminders"]] == ["Pay rent"]
    assert len((await reg.invoke("reminders.list", {"include_done": True}, PHONE))["reminders"]) == 2
    with pytest.raises(ToolError) as err:
        await reg.invoke("reminders.complete", {"id": 999}, PHONE)
    assert err.value.code is ErrorCode.NOT_FOUND


def test_phone_tool_set_and_flags(phone: tuple[DeviceState, ToolRegistry]) -> None:
    device, reg = phone
    assert reg.names() == ["calendar.add", "calendar.list", "contacts.list", "messages.delete", "messages.list",
                           "messages.send", "notify.show", "reminders.add", "reminders.complete", "reminders.list",
                           "storage.status", "system.info", "wifi.set", "wifi.status"]
    irreversible = sorted(s.name for s in reg.specs("phone") if s.irreversible)
    assert irreversible == ["messages.delete", "messages.send"]
    assert "messages.send" not in default_registry("home", phone=Phone.simulated(device))  # phone tools stay on phones
