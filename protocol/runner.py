"""The conversation between a node and one of its model runner processes, sans-IO.

A runner is a child process that holds one loaded model (llama.cpp can abort or fault
the process it runs in; the daemon must outlive that). The two talk over the child's
stdin and stdout with the project's own frames (protocol/framing.py: a 4-byte
big-endian length, then one msgpack map with `v` and `type`), one request at a time:

    node                                     runner
    runner.load {settings}          ──►
                                    ◄──      runner.ready {pid, n_ctx, n_vocab, ...}
                                             (or runner.load_failed {message}, then exit)
    runner.generate {id, prompt, ...} ──►
                                    ◄──      runner.started {id}
                                    ◄──      runner.piece {id, text}      (0..n)
    runner.cancel {id}              ──►      (any time before the end)
                                    ◄──      runner.done {id, completion, stats}
                                             or runner.failed {id, code, message}
    runner.tokenize {id, text}      ──►
                                    ◄──      runner.tokens {id, tokens}
                                    ◄──      runner.bye {reason}           (idle past keep_alive; then exit)
    (stdin closed)                  ──►      the runner exits

The runner exits by itself after `keep_alive_s` with nothing to do, and when its stdin
closes (the node stopped, or died). Whatever else ends it (SIGABRT from a C++ exception,
SIGSEGV, SIGKILL, the OOM killer) ends the request that was running, and only that
request: :class:`RunnerLink` says which (`ended()`), and a request that was sent but not
yet `started` may be sent again to a fresh runner.

This module holds the messages and :class:`RunnerLink`, the node's side of the
conversation: it frames what the node sends, checks what the runner answers against
the one request in flight, and turns the end of the process into the right outcome.
"""

from dataclasses import dataclass
from enum import Enum
from typing import Literal

from pydantic import Field

from .channel import Channel
from .errors import ErrorCode, ProtocolError
from .messages import Message

__all__ = [
    "MAX_RUNNER_FRAME",
    "Cancel",
    "Done",
    "Failed",
    "Generate",
    "Load",
    "LoadFailed",
    "Piece",
    "Ready",
    "RunnerBye",
    "RunnerLink",
    "RunnerState",
    "RunnerStats",
    "StopAfterRule",
    "Started",
    "ThinkBudgetRule",
    "Tokenize",
    "Tokens",
    "Outcome",
]

# A prompt of a 32k-token context is ~130 KB; a grammar for many tools a few hundred KB.
MAX_RUNNER_FRAME = 16 * 1024 * 1024

RunnerFinish = Literal["stop", "length", "cancelled"]


class Load(Message):
    """The first frame: what to load. `settings` is ``ModelSettings`` as JSON, opaque here."""

    type = "runner.load"
    settings: str


class Ready(Message):
    type = "runner.ready"
    pid: int
    n_ctx: int
    n_vocab: int
    chat_template: str | None = None
    eog_token_ids: tuple[int, ...] = ()
    family_tokens: tuple[str, ...] = ()  # the special tokens that tell a tool-calling family, as the vocabulary has them


class LoadFailed(Message):
    type = "runner.load_failed"
    message: str


class ThinkBudgetRule(Message):
    type = "runner.think_budget"
    tokens: int = Field(ge=1)
    close: str


class StopAfterRule(Message):
    type = "runner.stop_after"
    marker: str
    count: int = Field(1, ge=1)
    after: str | None = None


class Generate(Message):
    type = "runner.generate"
    id: int
    prompt: str
    prefix: str | None = None
    checkpoint: str | None = None
    max_tokens: int = Field(ge=1)
    grammar: str | None = None
    stop: tuple[str, ...] = ()
    temperature: float = 0.7
    top_k: int = 20
    top_p: float = 0.8
    min_p: float = 0.0
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    think_budget: ThinkBudgetRule | None = None
    stop_after: StopAfterRule | None = None


class Tokenize(Message):
    type = "runner.tokenize"
    id: int
    text: str


class Cancel(Message):
    type = "runner.cancel"
    id: int


class Started(Message):
    type = "runner.started"
    id: int


class Piece(Message):
    type = "runner.piece"
    id: int
    text: str


class RunnerStats(Message):
    """The engine's counters after a request (``WorkerStats``' fields)."""

    type = "runner.stats"
    requests: int = 0
    cancelled: int = 0
    prompt_tokens_evaluated: int = 0
    prompt_tokens_reused: int = 0
    generated_tokens: int = 0
    continuation_hits: int = 0
    snapshot_hits: int = 0
    misses: int = 0
    snapshots_saved: int = 0
    snapshots_dropped: int = 0
    state_cache_bytes: int = 0
    state_cache_entries: int = 0
    think_closes: int = 0


class Done(Message):
    type = "runner.done"
    id: int
    text: str
    tokens: int
    prompt_tokens: int
    finish_reason: RunnerFinish
    prompt_tokens_reused: int = 0
    prompt_seconds: float = 0.0
    generation_seconds: float = 0.0
    think_closed: bool = False
    stats: RunnerStats = RunnerStats()


class Tokens(Message):
    type = "runner.tokens"
    id: int
    tokens: tuple[int, ...]
    stats: RunnerStats = RunnerStats()


class Failed(Message):
    """A request the engine refused or could not run (the runner lives on)."""

    type = "runner.failed"
    id: int
    code: str
    message: str
    details: dict[str, int | float | str | None] = {}


class RunnerBye(Message):
    type = "runner.bye"
    reason: Literal["idle"] = "idle"


class RunnerState(Enum):
    LOADING = "loading"   # runner.load sent, no answer yet
    READY = "ready"       # loaded, nothing in flight
    SENT = "sent"         # a request sent, not started yet: safe to send again elsewhere
    RUNNING = "running"   # the runner started it: its end is this request's end
    GONE = "gone"         # the runner said bye, or its output ended


@dataclass(frozen=True)
class Outcome:
    """What the end of a runner's output means for the request that was in flight."""

    request_id: int | None      # the request it ends (None: nothing was in flight)
    crashed: bool               # the runner died while that request ran: it failed
    resend: bool                # the request had not started: it may go to a fresh runner
    during_load: bool           # the runner died before it was ready


class RunnerLink:
    """The node's end of one runner's conversation: frames out, checked messages in.

    One request is in flight at a time. Every message from the runner must belong to it
    (a stray id is a ProtocolError, and the node then kills the runner); `ended()` says
    what the runner's exit means for it.
    """

    def __init__(self) -> None:
        self._channel = Channel(max_frame_size=MAX_RUNNER_FRAME)
        self.state = RunnerState.LOADING
        self.in_flight: int | None = None
        self._next_id = 0

    def load(self, settings_json: str) -> bytes:
        return self._channel.send(Load(settings=settings_json))

    def request(self, make: type[Generate] | type[Tokenize], **fields: object) -> tuple[int, bytes]:
        """Frame a request; returns its id and the bytes to write."""
        if self.state is not RunnerState.READY:
            raise ProtocolError(f"runner is {self.state.value}: one request at a time", code=ErrorCode.INTERNAL)
        self._next_id += 1
        self.in_flight = self._next_id
        self.state = RunnerState.SENT
        return self._next_id, self._channel.send(make(id=self._next_id, **fields))  # type: ignore[arg-type]

    def cancel(self) -> bytes:
        if self.in_flight is None:
            return b""
        return self._channel.send(Cancel(id=self.in_flight))

    def receive_data(self, data: bytes) -> None:
        """Bytes from the runner's stdout; b"" when it closed."""
        self._channel.receive_data(data)

    def next_message(self) -> Message | None:
        """The next checked message from the runner, or None if more bytes are needed."""
        msg = self._channel.next_message()
        if msg is None:
            return None
        if isinstance(msg, (Ready, LoadFailed)):
            if self.state is not RunnerState.LOADING:
                raise ProtocolError(f"runner sent {msg.type} after loading")
            self.state = RunnerState.READY if isinstance(msg, Ready) else RunnerState.GONE
            return msg
        if isinstance(msg, RunnerBye):
            if self.state is RunnerState.RUNNING:
                raise ProtocolError("runner said bye while running a request")
            if self.state is RunnerState.READY:
                self.state = RunnerState.GONE
            # SENT: it went idle before it read our request, which stays resendable (ended())
            return msg
        if not isinstance(msg, (Started, Piece, Done, Tokens, Failed)):
            raise ProtocolError(f"unexpected {msg.type} from a runner")
        if msg.id != self.in_flight or self.state not in (RunnerState.SENT, RunnerState.RUNNING):
            raise ProtocolError(f"runner answered request {msg.id}, but {self.in_flight} is in flight")
        if isinstance(msg, Started):
            self.state = RunnerState.RUNNING
        elif isinstance(msg, (Done, Tokens, Failed)):
            self.state = RunnerState.READY
            self.in_flight = None
        elif self.state is not RunnerState.RUNNING:
            raise ProtocolError("runner sent a piece before starting the request")
        return msg

    def ended(self) -> Outcome:
        """The runner's output ended (EOF, or the node killed it): what it means."""
        state, rid = self.state, self.in_flight
        self.state, self.in_flight = RunnerState.GONE, None
        if state is RunnerState.LOADING:
            return Outcome(None, crashed=True, resend=False, during_load=True)
        if state is RunnerState.RUNNING:
            return Outcome(rid, crashed=True, resend=False, during_load=False)
        if state is RunnerState.SENT:
            return Outcome(rid, crashed=False, resend=True, during_load=False)
        return Outcome(None, crashed=False, resend=False, during_load=False)
