"""An unpaired stranger against real daemons on loopback (issue 8, items 1-3).

The stranger is tests/stranger_client.py: fresh keys, any 127.0.0.x source address,
yamux frames it writes itself. Every loop is bounded in count and in time.
"""
from __future__ import annotations

import os
import random
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import pytest

from conftest import run_nodes
from stranger_client import Stranger, flood_before_handshake
from waiting import wait_until
from psymesh.node.control.client import Client
from psymesh.node.control.process import DaemonProcess, pair_homes
from psymesh.protocol import ids
from psymesh.protocol.common import Error
from psymesh.protocol.errors import ErrorCode, RemoteError
from psymesh.protocol.pairing import MAX_NAMEPLATE, PairingCode, PairingJoiner, PeerInfo
from psymesh.protocol.strangers import StrangerLimits

pytestmark = pytest.mark.anyio

MiB = 1024 * 1024
RSS_BOUND = 16 * MiB
LIBP2P_OWN = ("/ipfs/id/1.0.0", "/ipfs/id/push/1.0.0", "/ipfs/ping/1.0.0")


def rss(pid: int) -> int:
    """Resident memory of a process, in bytes (/proc/PID/status VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


# ---------------------------------------------------------------------------- 1. memory


async def flood_one_connection(addr: str, peer_id: str, source: str, deadline: float) -> None:
    """One connection from a fresh key doing everything a stranger can think of, until the
    node closes it or `deadline`: pair streams announcing a 4 MiB frame and trickling its
    body, streams of unknown and of refused protocols, and data past the receive window."""
    try:
        async with Stranger.connect(addr, peer_id, source=source) as s:
            streams = [await s.open(ids.PAIR, first_data=struct.pack(">I", 4 * MiB - 1)) for _ in range(20)]
            streams += [await s.open(f"/nope/{i}") for i in range(5)]
            streams += [await s.open(p) for p in (*LIBP2P_OWN, ids.SESSION)]
            streams.append(await s.open(None, first_data=b"\x13/multistream/1.0.0\n"))  # never proposes
            chunk = os.urandom(16 * 1024)
            for _ in range(400):  # ~4 MB per stream at most, as in the report
                if s.closed.is_set() or anyio.current_time() > deadline:
                    break
                for stream in streams:
                    await stream.send(chunk)
    except Exception:  # refused at the handshake, or cut off: that is the node defending itself
        return


async def keep_flooding(flood: Callable[[float], object], deadline: float, max_rounds: int) -> None:
    for _ in range(max_rounds):
        if anyio.current_time() > deadline:
            return
        await flood(deadline)  # type: ignore[misc]


async def flood(addr: str, peer_id: str, seconds: float, on_tick: Callable[[], Awaitable[None]]) -> None:
    """`seconds` of everything at once, bounded: 16 connection loops from fresh keys on four
    source addresses (4 each: twice what the node lets in per address) and 4 keyless
    pre-handshake floods on four more; `on_tick` runs in between until the end."""
    deadline = anyio.current_time() + seconds
    with anyio.fail_after(seconds + 60):
        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(keep_flooding, lambda d, s=f"127.0.0.{1 + i % 4}": flood_one_connection(
                    addr, peer_id, s, d), deadline, 20)
            for i in range(4):  # anyone, no key: huge multistream messages before the handshake
                tg.start_soon(keep_flooding, lambda d, s=f"127.0.0.{5 + i}": flood_before_handshake(
                    addr, seconds=max(0.0, d - anyio.current_time()), source=s, announce=16_000_000),
                    deadline, 50)
            while anyio.current_time() < deadline:
                await on_tick()


async def test_a_strangers_flood_keeps_the_nodes_memory_bounded_and_a_paired_ping_answering(tmp_path: Path) -> None:
    """Many connections from fresh keys, 4 MiB frame headers with trickled bodies, unknown
    and refused protocols, data past the window, keyless pre-handshake floods: the node's
    RSS grows by less than 16 MiB during the flood and after it, a second flood adds
    nothing that stays, and a paired peer's pings keep answering throughout."""
    target = DaemonProcess(tmp_path / "target", name="target")
    friend = DaemonProcess(tmp_path / "friend", profile="phone", name="friend")
    status = await target.start()
    await friend.start()
    try:
        await pair_homes(target.home, friend.home)
        addr, peer_id, pid = status.addrs[0], status.peer_id, target.proc.pid  # type: ignore[union-attr]
        await paired_ping(friend, peer_id)
        await flood_one_connection(addr, peer_id, "127.0.0.1", anyio.current_time() + 2)  # warm up once
        before = rss(pid)
        peak, pings, afters = before, [0], []

        async def tick() -> None:  # the paired peer is served all along
            nonlocal peak
            await paired_ping(friend, peer_id)
            pings[0] += 1
            peak = max(peak, rss(pid))

        for _ in range(2):
            await flood(addr, peer_id, 12, tick)
            peak = max(peak, rss(pid))
            await wait_until(lambda: _only_friend_connected(target, friend), "the strangers' connections to close", 30)
            afters.append(rss(pid))
        print(f"\nRSS before {before / MiB:.1f} MiB, peak {peak / MiB:.1f} MiB (+{(peak - before) / MiB:.1f}), "
              f"after each flood " + ", ".join(f"{a / MiB:.1f} MiB (+{(a - before) / MiB:.1f})" for a in afters)
              + f"; {pings[0]} paired pings answered")
        assert pings[0] >= 10
        assert peak - before < RSS_BOUND, (before, peak)
        assert afters[-1] - before < RSS_BOUND, (before, afters)
        assert afters[1] - afters[0] < 4 * MiB, afters  # nothing piles up from one flood to the next
        await paired_ping(friend, peer_id)
    finally:
        await friend.stop()
        await target.stop()


async def paired_ping(friend: DaemonProcess, peer_id: str) -> None:
    """One ping from the paired peer that must be answered; its grant allows 60 a minute,
    so a `rate_limited` answer is waited out as it says (at most 5 times)."""
    for _ in range(5):
        async with friend.client() as c:
            try:
                assert (await c.ping(peer_id, count=1)).rtts_ms
                return
            except RemoteError as exc:
                assert exc.code == ErrorCode.RATE_LIMITED and exc.retry_after, exc
                await anyio.sleep(exc.retry_after)  # kept: the node (another process, its own clock) says when
    raise AssertionError("the paired peer's pings kept being refused")


async def _only_friend_connected(target: DaemonProcess, friend: DaemonProcess) -> bool:
    async with target.client() as c:
        peers = (await c.status()).connected_peers
    async with friend.client() as f:
        friend_id = (await f.status()).peer_id
    return [p.peer_id for p in peers] in ([friend_id], [])


# ---------------------------------------------------------------------------- 2. burning invites


async def burn_once(addr: str, peer_id: str, source: str, outcomes: list[str]) -> None:
    """One pairing attempt from a fresh key: a random number, random words."""
    code = PairingCode.from_bytes(random.randint(1, MAX_NAMEPLATE), os.urandom(2))
    try:
        async with Stranger.connect(addr, peer_id, source=source) as s:
            stream = await s.open(ids.PAIR)
            if not await stream.negotiated():
                outcomes.append("refused")
                return
            joiner = PairingJoiner(code, local_peer_id=s.peer_id, remote_peer_id=peer_id,
                                   info=PeerInfo(name="burner"))
            await stream.send_message(joiner.start())
            while True:
                with anyio.fail_after(10):
                    reply = await stream.receive_message()
                if reply is None or isinstance(reply, Error):
                    outcomes.append(reply.code if reply else "closed")
                    return
                for out in joiner.receive(reply):
                    await stream.send_message(out)
    except Exception as exc:  # the node closing on it is a refusal too
        outcomes.append(type(exc).__name__)


async def test_a_burning_loop_cannot_stop_the_rightful_joiner(tmp_path: Path) -> None:
    """Strangers on two other addresses keep sending pair.hello for guessed numbers with
    wrong words, a fresh key each time, while the phone joins with the real code."""
    async with run_nodes(tmp_path, "home", "phone") as nodes:
        home, phone = nodes["home"], nodes["phone"]
        addr, peer_id = home.p2p.addrs()[0], home.identity.peer_id
        outcomes: list[str] = []
        async with Client(home.home.path) as h:
            invite = await h.pair_invite(name="my-phone")

        async def burn(source: str, stop: anyio.Event) -> None:
            for _ in range(60):
                if stop.is_set():
                    return
                await burn_once(addr, peer_id, source, outcomes)

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                stop = anyio.Event()
                for source in ("127.0.0.2", "127.0.0.3"):
                    tg.start_soon(burn, source, stop)
                await wait_until(lambda: len(outcomes) >= 25, "the burners to get going", 60)
                async with Client(phone.home.path) as p:
                    paired = await p.pair_join(invite.invite)
                stop.set()
        assert paired.peer_id == peer_id
        print("\nburners' outcomes:", {o: outcomes.count(o) for o in set(outcomes)})
        assert {"rate_limited", "bad_code"} <= set(outcomes)  # tried, then held off
        assert set(outcomes) <= {"rate_limited", "bad_code", "busy"}, outcomes
        assert home.pairing.guard.running() == 0  # every run's slot came back
        async with Client(home.home.path) as h:
            assert [x.name for x in await h.peers()] == ["my-phone"]


async def test_eight_addresses_holding_every_unpaired_slot_cannot_keep_a_joiner_out(tmp_path: Path) -> None:
    """Strangers on 8 addresses hold the 16 unpaired slots (2 each) and keep reconnecting
    with fresh keys; the phone, from a 9th address, still pairs at once: it takes one slot of
    an address holding two, and the campers cannot take it back."""
    async with run_nodes(tmp_path, "home", "phone") as nodes:
        home, phone = nodes["home"], nodes["phone"]
        addr, peer_id = home.p2p.addrs()[0], home.identity.peer_id
        sources = [f"127.0.{i}.2" for i in range(1, 9)]
        async with Client(home.home.path) as h:
            invite = await h.pair_invite(name="my-phone")
        held = 0
        stop = anyio.Event()

        async def camp(source: str) -> None:  # hold a slot; once closed, try again (bounded)
            nonlocal held
            for _ in range(20):
                if stop.is_set():
                    return
                try:
                    async with Stranger.connect(addr, peer_id, source=source) as s:
                        held += 1
                        try:
                            await s.closed.wait()
                        finally:
                            held -= 1
                except Exception:
                    await anyio.sleep(0.2)

        with anyio.fail_after(90):
            async with anyio.create_task_group() as tg:
                for source in sources:
                    tg.start_soon(camp, source)
                    tg.start_soon(camp, source)
                await wait_until(lambda: held == 16, "the campers to hold all 16 slots", 60)
                started = anyio.current_time()
                async with Client(phone.home.path) as p:
                    paired = await p.pair_join(invite.invite)
                took = anyio.current_time() - started
                stop.set()
                tg.cancel_scope.cancel()
        assert paired.peer_id == peer_id
        print(f"\njoined in {took:.2f} s with 16 unpaired slots held by 8 addresses")
        assert took < 10


# ---------------------------------------------------------------------------- 3. what a stranger reaches


async def test_a_stranger_can_open_only_pairing_and_every_refusal_is_audited(tmp_path: Path) -> None:
    async with run_nodes(tmp_path, "home") as nodes:
        home = nodes["home"]
        candidates = (ids.PAIR, ids.SESSION, *LIBP2P_OWN, "/psymesh/ping/1.0.0", "/psymesh/task/1.0.0", "ls")
        opened, answered = [], {}
        async with Stranger.connect(home.p2p.addrs()[0], home.identity.peer_id, source="127.0.0.2") as s:
            for protocol in candidates:
                stream = await s.open(protocol)
                with anyio.fail_after(10):
                    if await stream.negotiated():
                        opened.append(protocol)
                        if protocol != ids.PAIR:
                            answered[protocol] = await stream.receive_message()
                    await s.frame(1, 8, stream.sid, 0)  # reset it: the node lets a stranger hold 2 streams
        assert opened == [ids.PAIR, ids.SESSION]
        # the session stream is the door's: it answers a stranger with a typed refusal, then closes
        refusal = answered[ids.SESSION]
        assert isinstance(refusal, Error) and refusal.code == ErrorCode.UNKNOWN_PEER.value
        async with Client(home.home.path) as h:
            rows = [r for r in await h.audit(denied_only=True) if r.peer_id == s.peer_id]
        assert sorted(r.protocol for r in rows) == sorted((ids.SESSION, *LIBP2P_OWN))
        assert all(r.code == "unknown_peer" for r in rows)


async def test_the_stranger_limits_are_small_by_default() -> None:
    """What all strangers together can make a node hold, from the defaults and the fixed
    per-handshake, per-stream and per-connection costs (docs/security.md has the sum):
    under 16 MiB. Connections past the cap can be in flight for at most `handshakes`."""
    from psymesh.node.net.p2p import HANDSHAKE_BYTES, MAX_NEGOTIATION_MESSAGE, MAX_PROPOSALS
    from psymesh.protocol.pairing import PAIR_MAX_FRAME

    connection_objects = 96 * 1024  # measured: ~85 KB per connection with 2 streams, both ends in process
    limits = StrangerLimits()
    per_stream = (MAX_PROPOSALS + 1) * MAX_NEGOTIATION_MESSAGE + 2 * (PAIR_MAX_FRAME + 4)  # FramedStream's reads
    per_connection = limits.buffer_bytes + limits.streams * per_stream + connection_objects
    held = limits.handshakes * HANDSHAKE_BYTES + (limits.connections + limits.handshakes) * per_connection
    assert held < RSS_BOUND, held


async def test_a_small_frame_limit_also_bounds_what_framing_reads_ahead() -> None:
    """A pairing stream's frames are at most 8 KiB, so it reads at most one frame at a time:
    a peer's surplus waits in yamux's flow control (bounded per connection), not in memory here."""
    from psymesh.node.net.framed import FramedStream
    from psymesh.protocol.channel import Channel
    from psymesh.protocol.pairing import PAIR_MAX_FRAME, PairPake

    class Recorder:
        def __init__(self, data: bytes) -> None:
            self.data, self.asked = data, []

        async def receive_some(self, max_bytes: int = 65536) -> bytes:
            self.asked.append(max_bytes)
            chunk, self.data = self.data[:max_bytes], self.data[max_bytes:]
            return chunk

        async def send_all(self, data: bytes) -> None: ...

        async def aclose(self) -> None: ...

    wire = b"".join(Channel().send(PairPake(pake=bytes(100))) for _ in range(500))
    stream = Recorder(wire)
    framed = FramedStream(stream, PAIR_MAX_FRAME)
    for _ in range(500):
        assert isinstance(await framed.receive(), PairPake)
        assert framed.channel._decoder.buffered <= 2 * (PAIR_MAX_FRAME + 4)
    assert max(stream.asked) == PAIR_MAX_FRAME + 4


async def test_malformed_hellos_do_not_use_up_an_invite(tmp_path: Path) -> None:
    """Issue 34 item 4: three (here four) `pair.hello` frames naming the invite's number with a
    `pake` that is not a SPAKE2 element are each answered `bad_request`, and no `pair.pake`:
    no code was tested, so no attempt is spent, and the phone then pairs with the invite."""
    from psymesh.protocol.pairing import PairHello

    async with run_nodes(tmp_path, "home", "phone") as nodes:
        home, phone = nodes["home"], nodes["phone"]
        addr, peer_id = home.p2p.addrs()[0], home.identity.peer_id
        async with Client(home.home.path) as h:
            invite = await h.pair_invite(name="my-phone")
        nameplate = int(invite.code.split("-")[0])
        answers = []
        with anyio.fail_after(60):
            for pake in (b"A" + bytes(32), b"A" + b"\xff" * 32, b"B" + bytes(32), b"A"):
                async with Stranger.connect(addr, peer_id, source="127.0.0.2") as s:
                    stream = await s.open(ids.PAIR)
                    assert await stream.negotiated()
                    await stream.send_message(PairHello(nameplate=nameplate, pake=pake))
                    answers.append(await stream.receive_message())
            assert all(isinstance(a, Error) and a.code == ErrorCode.BAD_REQUEST.value for a in answers), answers
            async with Client(phone.home.path) as p:
                paired = await p.pair_join(invite.invite)
        assert paired.peer_id == peer_id
