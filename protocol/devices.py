"""What a phone's device tools act through, as `control.status_reply.device_tools` names it
(docs/protocol.md): ``simulated`` (the node's simulated phone in its device.db: nothing real is
sent or switched), or the command family that drives the real device (``termux-api``,
``nmcli``, ``notify-send``). Plain strings and no imports, so `psymesh status` can word them
without loading pydantic."""

SIMULATED = "simulated"


def backend_note(backend: str) -> str:
    """What a device tool of `backend` really acts on, in words (tool descriptions, `status`, `agent run`)."""
    return "simulated: this node's device.db, not a real phone" if backend == SIMULATED else \
        f"on this device, through {backend}"
