"""Circuit relay v2 between paired peers, sans-IO: the settings and a relay's bookkeeping.

A home PC behind a NAT cannot be dialed; a paired node with a reachable address (a
friend's server, a small VPS, the office PC) can relay for it. The home PC keeps a
*reservation* at that relay; a phone that cannot dial home directly asks the relay to
*connect* it, and the relay splices one stream from each side together. Phone and home
then run their own Noise handshake over the spliced streams, so the relay forwards
ciphertext only and cannot pose as either (it would need their keys).

A relay serves only peers whose grant (the manifest it issued them) has the `relay`
capability: reservations and circuits are decided by the gate and audited like every
request (node/door/gate.py). What it allows beyond that is bounded by `RelaySettings`:

    reservations   at most `max_reservations` peers at once, each for `reservation_ttl_s`
                   (renewed by the peer before it lapses) and only while it stays connected
    circuits       at most `max_circuits` at once, `max_circuits_per_peer` into one peer,
                   `max_circuits_per_source` from one peer and `max_circuits_per_pair`
                   from one peer into one peer (so one peer with `relay` cannot take every
                   circuit into a home, nor the relay's: it gets 2 of a home's 8 and 4 of
                   the relay's 32, and the rightful peer still gets its circuit); each lives at most `circuit_duration_s` and carries at most
                   `circuit_bytes` (both directions together), then the relay resets it

libp2p's own defaults are 1 hour and 1 GiB per circuit; ours are smaller. A circuit that
ends is not an error for psymesh: the connection over it closes, the next request dials
again, and delegated tasks are exactly-once across the switch (protocol/taskflow.py).

`RelayBook` is the relay's table, told the time (`now`): the node's p2p layer asks it
before it answers a reservation or opens a circuit, and tells it when one ends.
"""

from collections import Counter
from dataclasses import dataclass, field
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field

from .errors import ErrorCode, PsymeshError

MiB = 1024 * 1024
K = TypeVar("K")
MAX_RELAYS = 4  # relays one node keeps reservations at
# The spec's protocol ids: a peer asks a relay on HOP (reserve, connect); the relay brings
# a circuit to the reserving peer on STOP.
HOP = "/libp2p/circuit/relay/0.2.0/hop"
STOP = "/libp2p/circuit/relay/0.2.0/stop"
RESERVE = "relay.reserve"  # what the gate decides and audits, once per reservation ...
CONNECT = "relay.connect"  # ... and once per circuit
# DCUtR (libp2p/specs relay/DCUtR.md): two peers joined by a circuit agree, over it, to dial
# each other at once, so that both NATs open a mapping for the other (hole punching).
DCUTR = "/libp2p/dcutr"
HOLE_PUNCH = "relay.holepunch"  # what the gate audits, once per DCUtR stream a peer opens
TAKE_CIRCUIT = "relay.stop"  # what the gate audits when a relay brings a circuit we did not reserve for


class RelaySettings(BaseModel):
    """config.toml `[relay]`."""

    model_config = ConfigDict(defer_build=True, frozen=True, extra="forbid")

    # Serve as a relay for paired peers granted `relay` (off: this node relays for nobody).
    enabled: bool = False
    # Paired peers (names or peer ids) to keep a reservation at, so that peers which cannot
    # dial this node directly reach it through them. Each must have granted us `relay`.
    relays: list[str] = Field(default_factory=list, max_length=MAX_RELAYS)
    max_reservations: int = Field(default=16, ge=1, le=1024)
    max_circuits: int = Field(default=32, ge=1, le=4096)
    max_circuits_per_peer: int = Field(default=8, ge=1, le=1024)     # into one destination
    max_circuits_per_source: int = Field(default=4, ge=1, le=1024)   # from one source
    max_circuits_per_pair: int = Field(default=2, ge=1, le=1024)     # from one source into one destination
    circuit_duration_s: int = Field(default=1800, ge=1, le=86_400)
    circuit_bytes: int = Field(default=256 * MiB, ge=MiB // 16, le=64 * 1024 * MiB)
    reservation_ttl_s: int = Field(default=900, ge=30, le=86_400)
    # How often a peer reached only through a relay is dialed directly again (its stored
    # addresses, and at once whenever it tells us new ones).
    direct_retry_s: float = Field(default=30.0, ge=1.0, le=3600.0)
    # Once a direct connection to a peer is open, its relayed one is closed as soon as it
    # carries no stream, and after this long at the latest (requests still on it then are
    # retried on the direct one: tasks are exactly-once).
    overlap_s: float = Field(default=30.0, ge=0.0, le=3600.0)
    # Hole punching (DCUtR) with a paired peer reached through a relay when both sit behind
    # NATs: off by default until more NATs than the test bed's (nftables masquerade) are known
    # to work. On: this node answers DCUtR, dials its relays from its listening port (so the
    # address a relay sees is that port's NAT mapping), and, for a peer that reached it through
    # a relay, starts the exchange itself.
    hole_punch: bool = False


@dataclass
class RelayBook:
    """A relay's reservations (peer id -> expiry) and open circuits, counted per destination,
    per source and per (source, destination)."""

    settings: RelaySettings
    reservations: dict[str, float] = field(default_factory=dict)
    circuits: Counter[str] = field(default_factory=Counter)                 # per destination
    sources: Counter[str] = field(default_factory=Counter)                  # per source
    pairs: Counter[tuple[str, str]] = field(default_factory=Counter)        # per (source, destination)

    def reserve(self, peer_id: str, now: float) -> float:
        """Reserve (or renew) for `peer_id`; returns the expiry. BUSY when full."""
        self._expire(now)
        if peer_id not in self.reservations and len(self.reservations) >= self.settings.max_reservations:
            raise PsymeshError(f"this relay holds {self.settings.max_reservations} reservations, the most it "
                               "allows", code=ErrorCode.BUSY)
        self.reservations[peer_id] = expires = now + self.settings.reservation_ttl_s
        return expires

    def drop(self, peer_id: str) -> None:
        """`peer_id`'s reservation ends (it disconnected, or lost its grant)."""
        self.reservations.pop(peer_id, None)

    def open_circuit(self, source: str, destination: str, now: float) -> None:
        """Count a circuit from `source` into `destination`: NOT_FOUND without a reservation,
        BUSY when the source's own shares are used up (checked first: they say it is the
        source's doing), then when the destination's or the relay's are. Every successful
        call is matched by one `close_circuit`."""
        self._expire(now)
        s = self.settings
        if destination not in self.reservations:
            raise PsymeshError(f"{destination} holds no reservation at this relay", code=ErrorCode.NOT_FOUND)
        if self.pairs[source, destination] >= s.max_circuits_per_pair:
            raise PsymeshError(f"you have {s.max_circuits_per_pair} circuits open to {destination} here, the most "
                               "one peer may ([relay] max_circuits_per_pair)", code=ErrorCode.BUSY)
        if self.sources[source] >= s.max_circuits_per_source:
            raise PsymeshError(f"you have {s.max_circuits_per_source} circuits open here, the most one peer may "
                               "([relay] max_circuits_per_source)", code=ErrorCode.BUSY)
        if self.circuits[destination] >= s.max_circuits_per_peer:
            raise PsymeshError(f"{destination} has {s.max_circuits_per_peer} circuits open here, the most allowed",
                               code=ErrorCode.BUSY)
        if self.circuits.total() >= s.max_circuits:
            raise PsymeshError(f"this relay carries {s.max_circuits} circuits, the most it allows",
                               code=ErrorCode.BUSY)
        self.circuits[destination] += 1
        self.sources[source] += 1
        self.pairs[source, destination] += 1

    def close_circuit(self, source: str, destination: str) -> None:
        _uncount(self.circuits, destination)
        _uncount(self.sources, source)
        _uncount(self.pairs, (source, destination))

    def _expire(self, now: float) -> None:
        for peer_id in [p for p, expires in self.reservations.items() if expires <= now]:
            del self.reservations[peer_id]


def _uncount(counter: Counter[K], key: K) -> None:
    """One fewer of `key`; keys at zero are forgotten (the book stays as small as what is open)."""
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]
