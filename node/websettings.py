"""config.toml `[web]`: where this node's web queries go, and (`[web.exit]`) whether and how
it serves other peers' queries as an exit. Kept apart from node/web.py so the config can be
read without the session and database machinery (node/home.py imports it)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from psymesh.node.webexit import ExitSettings

Hops = Literal[1, 2]


class WebSettings(BaseModel):
    """config.toml `[web]`: where this node's queries go; `[web.exit]`: serving them."""

    model_config = ConfigDict(extra="forbid")

    via: str | None = None        # the exit (paired peer name or id); None: the one that fits
    relay: str | None = None      # the relay for two hops; None: the one that fits
    hops: Hops = 1
    timeout_s: float = Field(default=60.0, gt=0, le=600)
    exit: ExitSettings = Field(default_factory=ExitSettings)
