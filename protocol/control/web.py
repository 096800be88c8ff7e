"""Control messages of web queries: one `web.search` or `web.fetch`, through this node's route."""
from typing import Literal

from pydantic import Field, model_validator

from ..messages import Message
from ..web import WebFetch, WebPage, WebResults, WebSearch


class WebQueryRequest(Message):
    """Run one web query through a trusted exit: exactly one of `search` / `fetch`. `via`
    names the exit, `relay` the relay (two hops); unset, the node's `[web]` config and its
    grants decide (see node/web/router.py)."""

    type = "control.web"
    search: WebSearch | None = None
    fetch: WebFetch | None = None
    via: str | None = Field(default=None, max_length=256)
    relay: str | None = Field(default=None, max_length=256)
    hops: Literal[1, 2] | None = None

    @model_validator(mode="after")
    def _one(self) -> "WebQueryRequest":
        if (self.search is None) == (self.fetch is None):
            raise ValueError("a web query is exactly one of search or fetch")
        return self


class WebQueryReply(Message):
    """The answer (`results` for a search, `page` for a fetch), and the way it went."""

    type = "control.web_reply"
    results: WebResults | None = None
    page: WebPage | None = None
    exit: str
    relay: str | None = None
