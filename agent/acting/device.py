"""The phone profile's tools, and the simulated phone in SQLite they act on where the device offers
nothing real, so agent scenarios run the same on any machine.

The tools (Wi-Fi, storage, messages, contacts, calendar, reminders, notifications) act
through a :class:`Phone`: one backend per job. Each backend is either the simulated phone
(:class:`DeviceState`, its ``backend`` named ``"simulated"``) or the real device's commands
(device_commands.py: Termux:API on Android, nmcli and notify-send on a Linux desktop,
picked at start by what is on PATH). A tool says which in its description and in
``Tool.backend``, so neither a person reading the tool list nor a model mistakes a row
written to device.db for a message sent.

The simulated phone is one SQLite database holding settings and the user's data. Its rules
are the ones a real phone enforces and a small model must learn to work around: nothing is
sent without a network ("no network: wifi is off"), and a full message store blocks both
sending and receiving ("storage full: free space first") until messages are deleted. State
survives reopening the database, so a scenario can be set up, run, and inspected afterwards.

Times are the device's local wall-clock time, stored as naive ISO-8601 text
(``YYYY-MM-DDTHH:MM:SS``), which sorts chronologically as text.
"""
from __future__ import annotations

import json
import math
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import date, datetime, timedelta
from pathlib import Path
from dataclasses import dataclass
from typing import Annotated, Any, Literal, NotRequired, Protocol, TypedDict

from pydantic import Field

from .tools import ToolError, ToolRegistry
from ...protocol.devices import SIMULATED, backend_note
from ...protocol.errors import ErrorCode

__all__ = [
    "MESSAGE_RESERVE_BYTES",
    "NO_NETWORK",
    "PHONE_PROFILES",
    "SIMULATED",
    "STORAGE_FULL",
    "DeviceState",
    "Phone",
    "register_device_tools",
    "wifi_off_inbox_full",
]

PHONE_PROFILES = frozenset({"phone"})
NO_NETWORK = "no network: wifi is off"
STORAGE_FULL = "storage full: free space first"
#: Free room the message store needs to take any message (send or receive): a
#: phone refuses new messages when nearly full, not only when a message won't fit.
MESSAGE_RESERVE_BYTES = 16 * 1024
MAX_MESSAGE_CHARS = 2000
_PREVIEW_CHARS = 80
_SCHEMA_VERSION = 2

_NOTIFICATIONS = """
CREATE TABLE notifications (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    text TEXT NOT NULL,
    at TEXT NOT NULL
);
"""
_SCHEMA = """
CREATE TABLE settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);   -- JSON values
CREATE TABLE contacts (name TEXT PRIMARY KEY COLLATE NOCASE, number TEXT NOT NULL);
CREATE TABLE messages (
    id INTEGER PRIMARY KEY,
    folder TEXT NOT NULL CHECK (folder IN ('inbox', 'sent')),
    contact TEXT NOT NULL,
    text TEXT NOT NULL,
    attachment TEXT,
    size INTEGER NOT NULL CHECK (size >= 0),   -- text plus attachment, bytes
    at TEXT NOT NULL
);
CREATE INDEX messages_by_time ON messages (folder, at);
CREATE TABLE events (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    start TEXT NOT NULL,
    duration_min INTEGER NOT NULL CHECK (duration_min > 0)
);
CREATE INDEX events_by_start ON events (start);
CREATE TABLE reminders (
    id INTEGER PRIMARY KEY,
    text TEXT NOT NULL,
    at TEXT NOT NULL,
    done INTEGER NOT NULL DEFAULT 0
);
""" + _NOTIFICATIONS

_DEFAULT_SETTINGS: dict[str, Any] = {
    "wifi_enabled": True,
    "wifi_ssid": "HomeNet",                      # the saved network Wi-Fi joins when on
    "storage_total_bytes": 64 * 1024**3,
    "storage_other_bytes": 41 * 1024**3,         # apps, photos, system
    "message_quota_bytes": 50 * 1024**2,         # the messages app's share of storage
}
_DEFAULT_CONTACTS = [("Alice", "+1 555 0101"), ("Bob", "+1 555 0102"), ("Mom", "+1 555 0103"),
                     ("Sam", "+1 555 0104")]


# --------------------------------------------------------------------------- the seam


class WifiState(TypedDict):
    enabled: bool
    connected: bool
    ssid: str | None


class Contact(TypedDict):
    name: str
    number: str


class SentMessage(TypedDict):
    to: str
    size_bytes: int
    sent_at: str
    id: NotRequired[int]        # the simulated store's id
    number: NotRequired[str]    # the number a real message went to


class MessagePage(TypedDict):
    folder: str
    messages: list[dict[str, Any]]  # each: id, from (inbox) or to (sent), text, at; size_bytes, attachment
    total: NotRequired[int]         # in the folder (the simulated store knows it; Termux:API does not say)


class Notice(TypedDict):
    title: str
    text: str
    shown_at: str
    id: NotRequired[int]        # the simulated store's id


class WifiBackend(Protocol):
    backend: str

    def wifi_status(self) -> WifiState: ...

    def set_wifi(self, enabled: bool) -> WifiState: ...


class MessagesBackend(Protocol):
    backend: str

    def contacts(self) -> list[Contact]: ...

    def list_messages(self, folder: str = "inbox", limit: int = 20) -> MessagePage: ...

    def send_message(self, to: str, text: str) -> SentMessage: ...


class NotifyBackend(Protocol):
    backend: str

    def notify(self, title: str, text: str) -> Notice: ...


def _iso(dt: datetime) -> str:
    return dt.isoformat(timespec="seconds")


def _local(dt: datetime) -> datetime:
    """A naive local time; aware inputs are converted to the device's zone first."""
    return dt.astimezone().replace(tzinfo=None) if dt.tzinfo is not None else dt


class DeviceState:
    """The simulated phone. Opens (and on first use creates and seeds) its database.
    Every one of its jobs is a backend named :data:`SIMULATED`.

    Give a path, or an open connection (then it must be usable from the threads that
    call the tools: open it with ``check_same_thread=False``). Sync tools run on
    worker threads, so every access is serialized with a lock.
    """

    def __init__(self, path_or_conn: str | Path | sqlite3.Connection, *,
                 clock: Callable[[], datetime] = datetime.now) -> None:
        if isinstance(path_or_conn, sqlite3.Connection):
            self._conn, self._owned = path_or_conn, False
        else:
            self._conn, self._owned = sqlite3.connect(path_or_conn, check_same_thread=False), True
        self._conn.row_factory = sqlite3.Row
        self._lock = threading.RLock()
        self._clock = clock
        self._setup()

    backend = SIMULATED

    # ------------------------------------------------------------------ plumbing

    def _setup(self) -> None:
        with self._tx() as db:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > _SCHEMA_VERSION:
                raise ToolError(f"device database schema v{version} is newer than this psymesh (v{_SCHEMA_VERSION})",
                                code=ErrorCode.UNSUPPORTED_VERSION)
            if version == 0:
                db.executescript("BEGIN;" + _SCHEMA + f"PRAGMA user_version = {_SCHEMA_VERSION};")
                db.executemany("INSERT INTO settings VALUES (?, ?)",
                               [(k, json.dumps(v)) for k, v in _DEFAULT_SETTINGS.items()])
                db.executemany("INSERT INTO contacts VALUES (?, ?)", _DEFAULT_CONTACTS)
                now = self.now()
                self._insert_message("inbox", "Bob", "Lunch tomorrow at 12?", at=now - timedelta(hours=3), db=db)
                self._insert_message("inbox", "Mom", "Call me when you can", at=now - timedelta(days=1), db=db)
            elif version == 1:  # v2 added notifications
                db.executescript("BEGIN;" + _NOTIFICATIONS + f"PRAGMA user_version = {_SCHEMA_VERSION};")

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One transaction under the lock: committed on success, rolled back on error."""
        with self._lock, self._conn:
            yield self._conn

    def now(self) -> datetime:
        return _local(self._clock()).replace(microsecond=0)

    def close(self) -> None:
        if self._owned:
            self._conn.close()

    def __enter__(self) -> DeviceState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _get(self, key: str) -> Any:
        with self._lock:
            return json.loads(self._conn.execute("SELECT value FROM settings WHERE key = ?", (key,)).fetchone()[0])

    def _set(self, key: str, value: Any) -> None:
        with self._tx() as db:
            db.execute("INSERT INTO settings VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                       (key, json.dumps(value)))

    def configure(self, **settings: Any) -> None:
        """Change simulation settings (`storage_total_bytes`, `message_quota_bytes`, ...)."""
        unknown = set(settings) - set(_DEFAULT_SETTINGS)
        if unknown:
            raise ValueError(f"unknown device settings: {', '.join(sorted(unknown))}")
        for key, value in settings.items():
            self._set(key, value)

    def _insert_message(self, folder: str, contact: str, text: str, *, attachment: str | None = None,
                        attachment_bytes: int = 0, at: datetime | None = None,
                        db: sqlite3.Connection | None = None) -> int:
        """Store a message unchecked (callers enforce the rules), in `db`'s open transaction if given."""
        if db is None:
            with self._tx() as db:
                return self._insert_message(folder, contact, text, attachment=attachment,
                                            attachment_bytes=attachment_bytes, at=at, db=db)
        size = len(text.encode()) + attachment_bytes
        cur = db.execute("INSERT INTO messages (folder, contact, text, attachment, size, at) VALUES (?,?,?,?,?,?)",
                         (folder, contact, text, attachment, size, _iso(_local(at or self.now()))))
        return int(cur.lastrowid or 0)

    # ------------------------------------------------------------------ wifi

    def wifi_status(self) -> WifiState:
        enabled = bool(self._get("wifi_enabled"))
        return {"enabled": enabled, "connected": enabled, "ssid": self._get("wifi_ssid") if enabled else None}

    def set_wifi(self, enabled: bool) -> WifiState:
        self._set("wifi_enabled", bool(enabled))
        return self.wifi_status()

    # ------------------------------------------------------------------ storage

    def storage_status(self) -> dict[str, Any]:
        with self._lock:
            count, used = self._conn.execute("SELECT count(*), coalesce(sum(size), 0) FROM messages").fetchone()
        total, other, quota = (self._get(k) for k in ("storage_total_bytes", "storage_other_bytes",
                                                      "message_quota_bytes"))
        room = max(0, min(quota - used, total - other - used))
        return {
            "total_bytes": total,
            "used_bytes": other + used,
            "free_bytes": max(0, total - other - used),
            "messages": {"count": count, "used_bytes": used, "quota_bytes": quota, "free_bytes": room,
                         "full": room < MESSAGE_RESERVE_BYTES},
        }

    def _require_room(self, size: int) -> None:
        room = self.storage_status()["messages"]["free_bytes"]
        if room < max(size, MESSAGE_RESERVE_BYTES):
            raise ToolError(f"{STORAGE_FULL} (the message store has {room} bytes free; "
                            "delete messages, largest or oldest first, to make room)", code=ErrorCode.CONFLICT)

    # ------------------------------------------------------------------ contacts and messages

    def contacts(self) -> list[Contact]:
        with self._lock:
            rows = self._conn.execute("SELECT name, number FROM contacts ORDER BY name").fetchall()
        return [Contact(name=r["name"], number=r["number"]) for r in rows]

    def _contact(self, name: str) -> str:
        with self._lock:
            row = self._conn.execute("SELECT name FROM contacts WHERE name = ?", (name.strip(),)).fetchone()
        if row is None:
            known = ", ".join(c["name"] for c in self.contacts())
            raise ToolError(f"no contact named {name!r} (contacts: {known})", code=ErrorCode.NOT_FOUND)
        return str(row["name"])

    def list_messages(self, folder: str = "inbox", limit: int = 20) -> MessagePage:
        who = "from" if folder == "inbox" else "to"
        with self._lock:
            rows = self._conn.execute(
                "SELECT * FROM messages WHERE folder = ? ORDER BY at DESC, id DESC LIMIT ?", (folder, limit)).fetchall()
            total = self._conn.execute("SELECT count(*) FROM messages WHERE folder = ?", (folder,)).fetchone()[0]
        messages = []
        for r in rows:
            text = r["text"] if len(r["text"]) <= _PREVIEW_CHARS else r["text"][:_PREVIEW_CHARS] + "..."
            item = {"id": r["id"], who: r["contact"], "text": text, "size_bytes": r["size"], "at": r["at"]}
            if r["attachment"]:
                item["attachment"] = r["attachment"]
            messages.append(item)
        return MessagePage(folder=folder, total=total, messages=messages)

    def delete_messages(self, ids: list[int] | None = None, older_than_days: int | None = None) -> dict[str, Any]:
        if (ids is None) == (older_than_days is None):
            raise ToolError("give either ids (a list of message ids) or older_than_days, not both or neither")
        with self._tx() as db:
            if ids is not None:
                wanted = sorted(set(ids))
                marks = ",".join("?" * len(wanted))
                rows = db.execute(f"SELECT id, size FROM messages WHERE id IN ({marks})", wanted).fetchall()
            else:
                cutoff = _iso(self.now() - timedelta(days=older_than_days or 0))
                rows = db.execute("SELECT id, size FROM messages WHERE at < ?", (cutoff,)).fetchall()
                wanted = [r["id"] for r in rows]
            found = [r["id"] for r in rows]
            db.executemany("DELETE FROM messages WHERE id = ?", [(i,) for i in found])
        return {"deleted": found, "not_found": sorted(set(wanted) - set(found)),
                "freed_bytes": sum(r["size"] for r in rows), "storage": self.storage_status()["messages"]}

    def send_message(self, to: str, text: str) -> SentMessage:
        """Send `text` to a contact. Needs Wi-Fi, and room in the message store for the copy."""
        contact = self._contact(to)
        if not self._get("wifi_enabled"):
            raise ToolError(f"{NO_NETWORK} (turn Wi-Fi on with wifi.set)", code=ErrorCode.UNAVAILABLE)
        size = len(text.encode())
        with self._lock:  # check and store atomically
            self._require_room(size)
            message_id = self._insert_message("sent", contact, text)
        return SentMessage(id=message_id, to=contact, size_bytes=size, sent_at=_iso(self.now()))

    def receive_message(self, sender: str, text: str, *, attachment: str | None = None,
                        attachment_bytes: int = 0) -> int:
        """Simulate an incoming message (scenario setup). Refused offline or when full."""
        if not self._get("wifi_enabled"):
            raise ToolError(NO_NETWORK, code=ErrorCode.UNAVAILABLE)
        with self._lock:
            self._require_room(len(text.encode()) + attachment_bytes)
            return self._insert_message("inbox", sender, text, attachment=attachment,
                                        attachment_bytes=attachment_bytes)

    # ------------------------------------------------------------------ calendar

    def list_events(self, day: date | None = None) -> dict[str, Any]:
        day = day or self.now().date()
        start = datetime.combine(day, datetime.min.time())
        with self._lock:
            rows = self._conn.execute("SELECT * FROM events WHERE start >= ? AND start < ? ORDER BY start, id",
                                      (_iso(start), _iso(start + timedelta(days=1)))).fetchall()
        return {"day": day.isoformat(), "events": [dict(r) for r in rows]}

    def add_event(self, title: str, start: datetime, duration_min: int = 30) -> dict[str, Any]:
        start = _local(start).replace(microsecond=0)
        end = start + timedelta(minutes=duration_min)
        with self._tx() as db:
            # Overlap: an event that starts before this one ends and ends after it starts.
            overlaps = [r["title"] for r in db.execute(
                "SELECT title, start, duration_min FROM events WHERE start < ? ORDER BY start", (_iso(end),))
                if datetime.fromisoformat(r["start"]) + timedelta(minutes=r["duration_min"]) > start]
            cur = db.execute("INSERT INTO events (title, start, duration_min) VALUES (?, ?, ?)",
                             (title, _iso(start), duration_min))
        return {"id": cur.lastrowid, "title": title, "start": _iso(start), "duration_min": duration_min,
                "overlaps": overlaps}

    # ------------------------------------------------------------------ reminders

    def add_reminder(self, text: str, at: datetime) -> dict[str, Any]:
        at = _local(at).replace(microsecond=0)
        with self._tx() as db:
            cur = db.execute("INSERT INTO reminders (text, at) VALUES (?, ?)", (text, _iso(at)))
        return {"id": cur.lastrowid, "text": text, "at": _iso(at), "done": False}

    def list_reminders(self, include_done: bool = False) -> dict[str, Any]:
        query = "SELECT * FROM reminders" + ("" if include_done else " WHERE done = 0") + " ORDER BY at, id"
        with self._lock:
            rows = self._conn.execute(query).fetchall()
        return {"reminders": [{**dict(r), "done": bool(r["done"])} for r in rows]}

    def complete_reminder(self, reminder_id: int) -> dict[str, Any]:
        with self._tx() as db:
            row = db.execute("SELECT * FROM reminders WHERE id = ?", (reminder_id,)).fetchone()
            if row is None:
                raise ToolError(f"no reminder with id {reminder_id} (see reminders.list)", code=ErrorCode.NOT_FOUND)
            db.execute("UPDATE reminders SET done = 1 WHERE id = ?", (reminder_id,))
        return {**dict(row), "done": True}

    # ------------------------------------------------------------------ notifications

    def notify(self, title: str, text: str) -> Notice:
        """Record a notification (a real phone would show it)."""
        at = _iso(self.now())
        with self._tx() as db:
            cur = db.execute("INSERT INTO notifications (title, text, at) VALUES (?, ?, ?)", (title, text, at))
        return Notice(id=int(cur.lastrowid or 0), title=title, text=text, shown_at=at)

    def notifications(self) -> list[Notice]:
        with self._lock:
            rows = self._conn.execute("SELECT * FROM notifications ORDER BY id").fetchall()
        return [Notice(id=r["id"], title=r["title"], text=r["text"], shown_at=r["at"]) for r in rows]


@dataclass(frozen=True)
class Phone:
    """What the phone's tools act through, one backend per job. `device` (the simulated
    phone) always holds storage, the calendar and reminders, for which neither Termux:API
    nor a Linux desktop offers a command; messages.delete and storage.status are offered
    only while messages are the simulated phone's too (Termux:API cannot delete a message,
    and the message store's quota is the simulation's)."""

    device: DeviceState
    wifi: WifiBackend
    messages: MessagesBackend
    notify: NotifyBackend

    @classmethod
    def simulated(cls, device: DeviceState) -> Phone:
        return cls(device=device, wifi=device, messages=device, notify=device)


# --------------------------------------------------------------------------- scenarios


def wifi_off_inbox_full(device: DeviceState, *, chunk_bytes: int = 4 * 1024**2) -> list[int]:
    """Turn Wi-Fi off and fill the message store with old video messages.

    Sending then fails until *both* Wi-Fi is turned on and some messages are
    deleted; any one filler message frees enough room. Returns the filler ids.
    """
    device.set_wifi(False)
    room = device.storage_status()["messages"]["free_bytes"]
    if room <= 0:
        return []
    parts = max(1, math.ceil(room / chunk_bytes))
    senders = [c["name"] for c in device.contacts()]
    now = device.now()
    ids = []
    for i in range(parts):
        size = room // parts + (room % parts if i == parts - 1 else 0)
        caption = f"Video from the trip, part {i + 1}"
        ids.append(device._insert_message(
            "inbox", senders[i % len(senders)], caption, attachment=f"video_{i + 1:02d}.mp4",
            attachment_bytes=size - len(caption.encode()), at=now - timedelta(days=30 + 7 * i)))
    return ids


# --------------------------------------------------------------------------- tools

Folder = Literal["inbox", "sent"]
ContactName = Annotated[str, Field(min_length=1, max_length=64, description="contact name, e.g. Alice")]
MessageText = Annotated[str, Field(min_length=1, max_length=MAX_MESSAGE_CHARS)]
MessageIds = Annotated[list[int], Field(min_length=1, max_length=1000, description="message ids to delete")]
Days = Annotated[int, Field(ge=0, le=36500, description="delete messages older than this many days")]
Title = Annotated[str, Field(min_length=1, max_length=200)]
Duration = Annotated[int, Field(ge=1, le=24 * 60, description="length in minutes")]
ReminderText = Annotated[str, Field(min_length=1, max_length=500)]
Limit = Annotated[int, Field(ge=1, le=100, description="most messages to show, newest first")]
NoticeTitle = Annotated[str, Field(min_length=1, max_length=100)]
NoticeText = Annotated[str, Field(min_length=1, max_length=500)]


def described(summary: str, backend: str) -> str:
    """A device tool's description, saying first (simulated) or last what it really acts on."""
    note = backend_note(backend)
    return f"({note}) {summary}" if backend == SIMULATED else f"{summary} ({note})"


def register_device_tools(registry: ToolRegistry, phone: Phone) -> None:
    """Register the phone profile's tools, each acting through its backend in `phone`."""

    def tool(name: str, backend: str, *,
             irreversible: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
            summary = (func.__doc__ or "").strip().splitlines()[0]
            return registry.tool(name, description=described(summary, backend), irreversible=irreversible,
                                 profiles=PHONE_PROFILES, backend=backend)(func)
        return decorate

    device, wifi, messages = phone.device, phone.wifi, phone.messages

    @tool("wifi.status", wifi.backend)
    def wifi_status() -> WifiState:
        """Show whether Wi-Fi is on and which network it is connected to."""
        return wifi.wifi_status()

    @tool("wifi.set", wifi.backend)
    def wifi_set(enabled: bool) -> WifiState:
        """Turn Wi-Fi on (true) or off (false)."""
        return wifi.set_wifi(enabled)

    if messages is device:
        @tool("storage.status", SIMULATED)
        def storage_status() -> dict[str, Any]:
            """Show free storage, and whether the message store is full."""
            return device.storage_status()

        @tool("messages.delete", SIMULATED, irreversible=True)
        def messages_delete(ids: MessageIds | None = None, older_than_days: Days | None = None) -> dict[str, Any]:
            """Delete messages by id, or all messages older than some days, to free space."""
            return device.delete_messages(ids, older_than_days)

    @tool("contacts.list", messages.backend)
    def contacts_list() -> list[Contact]:
        """List the contacts messages can be sent to."""
        return messages.contacts()

    @tool("messages.list", messages.backend)
    def messages_list(folder: Folder = "inbox", limit: Limit = 20) -> MessagePage:
        """List messages with their ids, newest first."""
        return messages.list_messages(folder, limit)

    @tool("messages.send", messages.backend, irreversible=True)
    def messages_send(to: ContactName, text: MessageText) -> SentMessage:
        """Send a text message to a contact (needs Wi-Fi and free message storage)."""
        return messages.send_message(to, text)

    @tool("notify.show", phone.notify.backend)
    def notify_show(title: NoticeTitle, text: NoticeText) -> Notice:
        """Show a notification on the phone's screen."""
        return phone.notify.notify(title, text)

    @tool("calendar.list", SIMULATED)
    def calendar_list(day: date | None = None) -> dict[str, Any]:
        """List the calendar events of a day (today if no day is given)."""
        return device.list_events(day)

    @tool("calendar.add", SIMULATED)
    def calendar_add(title: Title, start: datetime, duration_min: Duration = 30) -> dict[str, Any]:
        """Add an event to the calendar."""
        return device.add_event(title, start, duration_min)

    @tool("reminders.add", SIMULATED)
    def reminders_add(text: ReminderText, at: datetime) -> dict[str, Any]:
        """Set a reminder for a date and time."""
        return device.add_reminder(text, at)

    @tool("reminders.list", SIMULATED)
    def reminders_list(include_done: bool = False) -> dict[str, Any]:
        """List reminders (open ones, unless include_done is true)."""
        return device.list_reminders(include_done)

    @tool("reminders.complete", SIMULATED)
    def reminders_complete(id: Annotated[int, Field(ge=1)]) -> dict[str, Any]:
        """Mark a reminder as done."""
        return device.complete_reminder(id)
