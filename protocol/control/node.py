"""Control messages about this node: status, doctor, ping, shutdown, the HTTP faces it serves
(`serve`), the dashboard (`ui`), its model runners (`model ps`), its MCP servers (`mcp list`) and
the nodes it discovered."""
from typing import Literal

from pydantic import Field

from ..dialback import DialBackReply
from ..messages import Message
from .common import View


class StatusRequest(Message):
    type = "control.status"


class ConnectedPeer(Message):
    type = "control.connected_peer"
    peer_id: str
    addrs: list[str] = Field(default_factory=list)
    name: str | None = None  # its name here, if it is a paired peer


class ConfirmedAddr(View):
    """An address of ours a paired peer dialed back (`psymesh doctor`, protocol/dialback.py):
    the IP it saw us at, and a port we listen on, reachable from where it is."""

    addr: str
    by: str        # the peer's id
    by_name: str   # its name here
    at: float      # when (Unix seconds)


class Reachability(View):
    """How peers can reach this node: at the addresses it listens on (`direct`; from where
    they route), at ones a peer proved by dialing back (`confirmed`), through relays that
    hold a reservation for it (`relayed`). All empty: only by connections it opens itself."""

    direct: list[str] = Field(default_factory=list)
    confirmed: list[ConfirmedAddr] = Field(default_factory=list)
    relayed: list[str] = Field(default_factory=list)


class DeviceTool(View):
    """A phone tool and what it acts through: ``simulated`` (the simulated phone in the node's
    device.db: nothing real is sent or switched), or the device's own interface it runs as
    commands (``termux-api``, ``nmcli``, ``notify-send``): protocol/devices.py."""

    tool: str
    backend: str


class StatusReply(Message):
    type = "control.status_reply"
    peer_id: str
    fingerprint: str
    name: str
    profile: str
    version: str
    addrs: list[str]
    uptime_s: float
    connected_peers: list[ConnectedPeer] = Field(default_factory=list)
    listen: list[str] = Field(default_factory=list)  # config `listen`, as configured (port 0: any)
    reachability: Reachability = Field(default_factory=Reachability)
    device_tools: list[DeviceTool] = Field(default_factory=list)  # a phone's tools, picked at start


class DoctorRequest(Message):
    """What the running daemon sees for `psymesh doctor`: its listen addresses, and each
    paired peer probed now (reachable? by which path? its clock? can it dial us back?),
    all within `timeout_s`."""

    type = "control.doctor"
    timeout_s: float = Field(default=10.0, gt=0, le=60)
    dialback: bool = True


ConnectionPath = Literal["direct", "relayed"]


class PeerDiagnosis(View):
    """One paired (not revoked) peer, probed by the daemon."""

    peer_id: str
    name: str
    reachable: bool
    path: ConnectionPath | None = None  # how the connection to it goes
    rtt_ms: float | None = None
    clock_skew_s: float | None = None  # its clock minus ours (>0: it runs ahead); None: not measured
    error: str = ""                    # why it is unreachable, or why a probe failed
    dialback: DialBackReply | None = None  # None: not asked (unreachable, or it refused)
    dialback_error: str = ""           # why it would not dial back (e.g. its grant to us has no room)
    dialback_refused: bool = False     # it answered, refusing (`dialback_error` is its reason), not silence


class DoctorReply(Message):
    type = "control.doctor_reply"
    listen: list[str]                  # config `listen`
    addrs: list[str]                   # what the daemon listens on now
    reachability: Reachability
    peers: list[PeerDiagnosis] = Field(default_factory=list)


class PingRequest(Message):
    """Ping a peer over the encrypted channel. `peer` is a multiaddr ending /p2p/<id>, or a known peer id/name."""

    type = "control.ping"
    peer: str = Field(min_length=1, max_length=1024)
    count: int = Field(default=4, ge=1, le=1000)
    payload_size: int = Field(default=32, ge=0, le=65536)


class PingReply(Message):
    type = "control.ping_reply"
    peer_id: str
    rtts_ms: list[float]
    connect_ms: float
    min_ms: float
    median_ms: float
    max_ms: float


class ShutdownRequest(Message):
    """Ask the daemon to stop cleanly (same as SIGTERM)."""

    type = "control.shutdown"


class ServeRequest(Message):
    """Turn an endpoint on in the running daemon (`psymesh serve openai|a2a` while the
    daemon runs): the bridge's `[serve.SECTION]` settings from config.toml, with these
    over them. It stays on until the daemon stops (config.toml says whether it comes back)."""

    type = "control.serve"
    section: Literal["openai", "a2a"]
    host: str | None = None
    port: int | None = Field(default=None, ge=0, le=65535)
    # The key is the daemon's, as at start (node/bridges/apikey.py): never carried here.
    api_key_file: str | None = None


class ServeReply(Message):
    type = "control.serve_reply"
    url: str              # where it listens (the A2A agent's JSON-RPC URL; the OpenAI base without /v1)
    already: bool = False  # it was on already (these settings changed nothing)


class UiRequest(Message):
    """Start the dashboard in the running daemon if it is not running (a phone starts it
    only on demand), and say where it is: `psymesh ui`."""

    type = "control.ui"
    port: int | None = Field(default=None, ge=0, le=65535)  # not running yet: listen here, not at [ui] port


class UiReply(Message):
    type = "control.ui_reply"
    url: str        # http://HOST:PORT
    login_url: str  # http://NAME.localhost:PORT/login?code=CODE: signs a browser in once, within 60 s
    token_source: str  # where the bearer token for scripts is kept (its file, or the environment variable)


class ModelsPsRequest(Message):
    """The node's models as their runner processes stand: `psymesh model ps`."""

    type = "control.models_ps"


class ModelShare(View):
    """One part of a split model: this node's layers, or a worker's (`model ps`)."""

    where: str                  # "this node", or the worker's name
    peer_id: str | None = None  # None: this node
    layers: int = 0
    memory_mb: int | None = None  # the worker's budget for this node (None: no cap)
    link: str = ""              # local, direct, relayed; or "left out: WHY"
    weights_mb: int = 0         # about how much of the model's file this part holds, in MB


class LoadedModel(View):
    """One registered model's runner. `loaded` False: no process holds it now (never used,
    or gone after `keep_alive_s` idle, or after a crash); the next request loads it."""

    name: str
    path: str
    loaded: bool
    pid: int | None = None
    rss_bytes: int | None = None
    n_ctx: int = 0
    state_cache_bytes: int = 0      # saved model states the runner holds (state reuse)
    idle_s: float | None = None     # since its last request ended; None: never used, or busy now
    jobs_served: int = 0
    crashes: int = 0                # in a row, since its last request that succeeded
    keep_alive_s: float | None = None
    pending: int = 0                # requests queued or running
    running: bool = False           # the runner has started one of them (it is decoding now)
    tool_family: str | None = None  # how it calls tools: qwen35, hermes, llama3, mistral, or none (cannot)
    split: list[str] = Field(default_factory=list)     # the workers it is split across (names), if any
    shares: list[ModelShare] = Field(default_factory=list)  # as last loaded: this node's layers, each worker's


class ModelsPsReply(Message):
    type = "control.models_ps_reply"
    models: list[LoadedModel] = Field(default_factory=list)


class WorkerRequest(Message):
    """`psymesh worker start|stop|status`: lending this node's compute to split models."""

    type = "control.worker"
    action: Literal["start", "stop", "status"] = "status"


class WorkerReply(Message):
    type = "control.worker_reply"
    running: bool
    pid: int | None = None
    isolation: str | None = None    # netns (a network namespace of its own) or shared-loopback
    rpc: str | None = None          # llama.cpp RPC protocol version, e.g. 7.0.0
    build: str | None = None
    memory_mb: int | None = None
    threads: int | None = None
    serving: str | None = None      # the owner whose model it computes now
    serving_since: float | None = None
    bytes_in: int = 0
    bytes_out: int = 0
    streams_served: int = 0
    last_end: str = ""
    error: str = ""
    granted: list[str] = Field(default_factory=list)  # paired peers granted compute.rpc


class McpStatusRequest(Message):
    """The MCP servers the running daemon mounted, up or down: `psymesh mcp list`."""

    type = "control.mcp_status"


class McpServerState(View):
    """One `[[mcp]]` server as the daemon runs it. `problem`: why it is down (while it is);
    `log`: where a command's stderr goes (<home>/mcp-NAME.log; None for a URL)."""

    name: str
    up: bool
    tools: list[str] = Field(default_factory=list)  # local names, mcp.NAME.*
    problem: str = ""
    restarts: int = 0
    log: str | None = None


class McpStatusReply(Message):
    type = "control.mcp_status_reply"
    servers: list[McpServerState] = Field(default_factory=list)


class DiscoverRequest(Message):
    """Nodes this node has seen on the LAN (mDNS) or reached at a static address, paired or
    not. `wait_s`: listen that many seconds more first (a daemon just started has heard little)."""

    type = "control.discover"
    wait_s: float = Field(default=0.0, ge=0.0, le=60.0)


class SeenNode(View):
    """A node seen on the network. Its peer id and addresses are what it announced: the
    fingerprint is for a person to compare with `psymesh id` on the device before pairing,
    and pairing proves the key."""

    peer_id: str
    fingerprint: str | None = None   # None: not an Ed25519 peer id (another libp2p implementation)
    addrs: list[str] = Field(default_factory=list)
    source: Literal["mdns", "static"]
    first_seen: float
    last_seen: float
    paired: bool = False             # paired and not revoked
    name: str | None = None          # the paired peer's name


class DiscoverReply(Message):
    type = "control.discover_reply"
    mdns: bool                                            # config `mdns`
    announced: list[str] = Field(default_factory=list)    # what this node announces now (mDNS)
    static_peers: int = 0                                 # config `static_peers` entries
    nodes: list[SeenNode] = Field(default_factory=list)   # most recently seen first
