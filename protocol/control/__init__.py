"""Messages of the local control API (Unix socket in the node home; same frames as the wire).

The control API is how the CLI and scripts drive their own daemon. Every request
gets exactly one reply (or an `error`), except streaming requests, which say so.

Replies are typed all the way down: a list in a reply holds `View`s (a peer, an audit
row, a task, an offer) with named, typed fields, so the SDK hands out attributes and
the CLI prints them without guessing shapes; `--json` prints their `model_dump`.

An `error` reply for a failure of the network (the daemon could not reach a peer, or
lost it mid-request) says so in `details["network"]` (see `error_reply`), so the SDK
raises it as the NetworkError it was, apart from refusals (RemoteError).

The catalogue (one frozen model per request and reply, 72 classes), which the SDK and the control
server share, is one module per group of commands: node.py (status, doctor, ping, serve, ui, model ps,
discover), trust.py (pairing, peers, grants, audit), tasks.py, messaging.py (letters, asks, groups),
web.py; common.py what they share. Each is imported on first use of one of its names
(`control.StatusReply`; `psymesh --help` imports none): `psymesh status` builds node.py's dozen
models, not the 72, nor the letters',
tasks' and web's own protocol modules, which cost it more than the rest of its start-up (issue 22
item 13). `_GROUPS` is that table; tests/test_cli_startup.py checks it names every model once.
"""
from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers see: every name, as if imported here
    from .common import *  # noqa: F403
    from .messaging import *  # noqa: F403
    from .node import *  # noqa: F403
    from .tasks import *  # noqa: F403
    from .trust import *  # noqa: F403
    from .web import *  # noqa: F403

# group module -> the names it defines
_GROUPS: dict[str, tuple[str, ...]] = {
    "common": ("View", "PeerAway", "Ok", "error_reply"),
    "node": ("StatusRequest", "ConnectedPeer", "ConfirmedAddr", "Reachability", "DeviceTool", "StatusReply",
             "DoctorRequest", "ConnectionPath", "PeerDiagnosis", "DoctorReply", "PingRequest",
             "PingReply", "ShutdownRequest", "ServeRequest", "ServeReply", "UiRequest", "UiReply",
             "ModelsPsRequest", "ModelShare", "LoadedModel", "ModelsPsReply", "WorkerRequest", "WorkerReply",
             "McpStatusRequest", "McpServerState",
             "McpStatusReply", "DiscoverRequest", "SeenNode",
             "DiscoverReply"),
    "trust": ("PairInviteRequest", "PairInviteReply", "PairJoinRequest", "PairedReply",
              "PeersRequest", "PeerView", "PeersReply", "GrantRequest", "check_limit_changes",
              "RevokeRequest", "PeerReply", "AuditRequest", "AuditRow", "AuditReply"),
    "tasks": ("TaskSubmitRequest", "TaskSubmitted", "TaskWatchRequest", "TaskWaitRequest", "TaskCancelRequest",
              "TaskListRequest", "SubmittedTaskView", "ExecutingTaskView", "TaskListReply",
              "TaskInputRequest", "OffersRequest", "Offer", "OffersReply", "task_summary", "SUMMARY_CHARS"),
    "messaging": ("GroupName", "SentLetter", "InboxLetter", "MsgSendRequest", "MsgSentReply",
                  "MsgStatusRequest", "MsgInboxRequest", "MsgAskRequest", "MsgAnswerReply",
                  "GroupMember", "GroupView", "GroupCreateRequest", "GroupAddRequest",
                  "GroupRemoveRequest", "GroupListRequest", "GroupReply", "GroupsReply",
                  "GroupSendRequest", "GroupSentReply"),
    "web": ("WebQueryRequest", "WebQueryReply"),
}
_WHERE = {name: group for group, names in _GROUPS.items() for name in names}


def __getattr__(name: str) -> Any:
    group = _WHERE.get(name)
    if group is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{group}"), name)


__all__ = list(_WHERE)
