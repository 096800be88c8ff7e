"""libp2p mDNS with `zeroconf`: announce this node on the LAN and hear the others.

The record format is discovery/records.py (sans-IO); this module is the IO around it.
zeroconf runs its sockets on its own thread (its own asyncio loop) and calls browser
handlers on another thread of its own; the node runs on trio. So zeroconf is only ever
touched from worker threads (`anyio.to_thread`), a handler only reads zeroconf's cache
(its thread-safe copying accessors) and parses there, and hands the result to trio with
`TrioToken.run_sync_soon`, which never blocks the handler's thread, into a bounded
channel (a flood of announcements is dropped, not queued). Nothing of zeroconf or of
its threads leaves this module.

mDNS runs only on the interfaces whose addresses the node announces: those it listens
on, loopback excluded (a node listening on 127.0.0.1 only, the default, announces
nothing and hears nothing, and says so once). The address list is checked every
`check_s`: when it changes (DHCP, roaming, a cable), the old announcement is withdrawn
(goodbye packets) and a new one, under a new random instance name, is made on the
interfaces of the new addresses, so peers follow without waiting for record expiry.
"""
from __future__ import annotations

import logging
import socket
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import anyio.abc
import trio
from zeroconf import DNSText, IPVersion, ServiceBrowser, ServiceInfo, ServiceStateChange, Zeroconf, current_time_millis

from .records import SERVICE_TYPE, Announcement, advertised, encode_txt, instance_label, parse_announcement

log = logging.getLogger("psymesh.discovery")

ADDRESS_CHECK_S = 5.0   # how often the node's own addresses are compared with what it announces
CLOSE_TIMEOUT_S = 3.0   # withdrawing an announcement (goodbye packets) and closing the sockets
MAX_PENDING = 64        # announcements handed to trio and not yet taken: past it they are dropped
MAX_INSTANCES = 1024    # instance names remembered (rust-libp2p uses a new one per response)
OPEN_RETRY_MAX_S = 60.0


@dataclass(frozen=True)
class Seen:
    """A node announced itself (or refreshed or changed its announcement)."""

    announcement: Announcement


@dataclass(frozen=True)
class Left:
    """The last instance a node announced was withdrawn or expired."""

    peer_id: str


MdnsEvent = Seen | Left


@dataclass(frozen=True)
class _Announced:
    instance: str
    announcement: Announcement


@dataclass(frozen=True)
class _Withdrawn:
    instance: str


class Mdns:
    def __init__(self, peer_id: str, host_addrs: Callable[[], list[str]], *, check_s: float = ADDRESS_CHECK_S) -> None:
        self.peer_id = peer_id
        self._host_addrs = host_addrs
        self.check_s = check_s
        self.announced: list[str] = []  # what this node announces (or is registering) now; empty: nothing

    async def run(self, on_event: Callable[[MdnsEvent], None], *,
                  task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Announce and browse until cancelled; `on_event` is called on the trio thread for
        every node seen or gone (this node's own announcement included: the caller skips it)."""
        send, receive = trio.open_memory_channel[_Announced | _Withdrawn](MAX_PENDING)
        token = trio.lowlevel.current_trio_token()

        def deliver(item: _Announced | _Withdrawn) -> None:  # on the trio thread, never raises
            try:
                send.send_nowait(item)
            except trio.WouldBlock:
                log.debug("mDNS: %d announcements waiting; dropped one", MAX_PENDING)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                pass

        def on_change(zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
            """zeroconf's browser thread: read the instance's TXT records, parse, hand over."""
            item: _Announced | _Withdrawn
            if state_change is ServiceStateChange.Removed:
                item = _Withdrawn(name)
            else:
                now = current_time_millis()
                texts = [r.text for r in zeroconf.cache.entries_with_name(name)
                         if isinstance(r, DNSText) and not r.is_expired(now)]
                announcement = parse_announcement(texts)
                if announcement is None:
                    return
                item = _Announced(name, announcement)
            try:
                token.run_sync_soon(deliver, item)
            except trio.RunFinishedError:
                pass

        async with anyio.create_task_group() as tg:
            tg.start_soon(self._hand_over, receive, on_event)
            task_status.started()
            with send:
                await self._announce(on_change)

    async def _hand_over(self, receive: trio.MemoryReceiveChannel[_Announced | _Withdrawn],
                         on_event: Callable[[MdnsEvent], None]) -> None:
        """Instances become peers here: a peer is gone when its last instance is."""
        instances: OrderedDict[str, str] = OrderedDict()
        async with receive:
            async for item in receive:
                if isinstance(item, _Announced):
                    instances.pop(item.instance, None)
                    instances[item.instance] = item.announcement.peer_id
                    while len(instances) > MAX_INSTANCES:
                        instances.popitem(last=False)
                    on_event(Seen(item.announcement))
                else:
                    peer_id = instances.pop(item.instance, None)
                    if peer_id is not None and peer_id not in instances.values():
                        on_event(Left(peer_id))

    async def _announce(self, on_change: Callable[[Zeroconf, str, str, ServiceStateChange], None]) -> None:
        """One zeroconf session per address list: open, hold while the addresses hold, close."""
        said_nothing = False
        failures = 0
        while True:
            addrs = advertised(self._host_addrs(), self.peer_id)
            ipv4s = sorted({a.split("/")[2] for a in addrs if a.startswith("/ip4/")})
            if not ipv4s:
                if not said_nothing:
                    log.warning("mdns is on, but this node listens on no LAN address, so it announces nothing and "
                                "hears nothing; listen on one, e.g. listen = [\"/ip4/0.0.0.0/tcp/4001\"]")
                    said_nothing = True
                await anyio.sleep(self.check_s)
                continue
            said_nothing = False
            self.announced = addrs
            try:
                # Shielded: a session that opened is closed below even if the node stops meanwhile
                # (registering probes the name for ~2 s; the stop waits that long at most).
                with anyio.CancelScope(shield=True):
                    session = await anyio.to_thread.run_sync(_Session.open, ipv4s, addrs, on_change)
            except Exception as exc:  # zeroconf's errors (sockets, multicast membership) at its boundary
                self.announced = []
                delay = min(OPEN_RETRY_MAX_S, self.check_s * 2 ** failures)
                failures += 1
                log.warning("mDNS could not start on %s (%s); retrying in %.0f s", ", ".join(ipv4s), exc, delay)
                await anyio.sleep(delay)
                continue
            failures = 0
            log.info("mDNS: announcing %s", " ".join(addrs))
            try:
                while advertised(self._host_addrs(), self.peer_id) == addrs:
                    await anyio.sleep(self.check_s)
                log.info("mDNS: this node's addresses changed; announcing again")
            finally:
                self.announced = []
                with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_TIMEOUT_S):
                    await anyio.to_thread.run_sync(session.close, abandon_on_cancel=True)


class _Session:
    """One zeroconf instance bound to `ipv4s`, announcing one instance and browsing (blocking calls)."""

    def __init__(self, zc: Zeroconf, browser: ServiceBrowser) -> None:
        self.zc = zc
        self.browser = browser

    @classmethod
    def open(cls, ipv4s: list[str], addrs: list[str],
             on_change: Callable[[Zeroconf, str, str, ServiceStateChange], None]) -> _Session:
        zc = Zeroconf(interfaces=ipv4s, ip_version=IPVersion.V4Only)
        browser: ServiceBrowser | None = None
        try:
            browser = ServiceBrowser(zc, SERVICE_TYPE, handlers=[on_change])  # first: it hears while we probe
            label = instance_label()
            port = int(addrs[0].split("/")[4])  # DNS-SD wants an SRV record; libp2p readers use the TXT strings
            zc.register_service(ServiceInfo(SERVICE_TYPE, f"{label}.{SERVICE_TYPE}", port=port,
                                            properties=encode_txt(addrs), server=f"{label}.p2p.local.",
                                            addresses=[socket.inet_aton(ip) for ip in ipv4s]))
        except BaseException:
            if browser is not None:
                browser.cancel()
            zc.close()
            raise
        return cls(zc, browser)

    def close(self) -> None:
        """Stop browsing, withdraw the announcement (goodbye packets), close the sockets."""
        self.browser.cancel()
        self.zc.close()
