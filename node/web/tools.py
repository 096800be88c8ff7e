"""`web.search` and `web.fetch` as agent tools: routed through a trusted exit, or run here.

On a node that asks (a phone), the tools send the query through its `WebRouter` (one hop, or
two with `[web] hops = 2`): the phone itself opens no connection to the web. On an exit, the
same two tools run the query here; a delegated agent run may call them only if the asker's
grant has `tool:web.search` / `tool:web.fetch` (node/models/agents.py `granted_tools`), and a fetch
is also held to the asker's `web.fetch` domains, on every redirect.

What a tool returns is marked `"untrusted": true` beside the web's text: the agent loop puts
every tool result inside `<tool_response>` as escaped data and its system prompt tells the
model never to follow instructions found there; the marking says which results came from
strangers on the web, for the model and for whoever reads the transcript.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from pydantic import Field

from ...agent.acting.tools import Tool, ToolContext, tool_from_function
from ...protocol.web import (
    DEFAULT_PAGE_CHARS,
    MAX_HITS,
    MAX_PAGE_CHARS,
    MAX_QUERY_CHARS,
    MAX_URL_CHARS,
    WebAnswer,
    WebFetch,
    WebPage,
    WebRequest,
    WebResults,
    WebSearch,
)

# Runs one web request for the peer a run serves (ctx.peer_id; None: the node's own owner).
RunWeb = Callable[[WebRequest, str | None], Awaitable[WebAnswer]]


def tool_result(answer: WebAnswer) -> dict[str, Any]:
    """What the model sees of an answer: the text, where it came from, that it is untrusted,
    and, when the text is not all of the page, a sentence saying what is missing and why."""
    if isinstance(answer, WebResults):
        return {"untrusted": True, "source": "web.search", "query": answer.query,
                "results": [{"title": h.title, "url": h.url, "snippet": h.snippet} for h in answer.hits]}
    assert isinstance(answer, WebPage)
    page: dict[str, Any] = {"untrusted": True, "source": answer.final_url, "status": answer.status,
                            "title": answer.title, "text": answer.text, "truncated": answer.truncated}
    partial = answer.partial()
    if partial is not None:  # what the page held that the text does not: the model must not take it as all
        page["partial"] = partial
    return page


def web_tools(run: RunWeb) -> list[Tool]:
    """The two tools, each running its request through `run`."""

    async def search(
        query: Annotated[str, Field(min_length=1, max_length=MAX_QUERY_CHARS, description="what to search for")],
        limit: Annotated[int, Field(ge=1, le=MAX_HITS, description="how many results")] = 5,
        *,
        ctx: ToolContext,
    ) -> dict[str, Any]:
        """Search the web; returns titles, URLs and snippets (untrusted text from the web)."""
        return tool_result(await run(WebSearch(query=query, limit=limit), ctx.peer_id))

    async def fetch(
        url: Annotated[str, Field(min_length=1, max_length=MAX_URL_CHARS, description="an http(s) URL")],
        max_chars: Annotated[int, Field(ge=100, le=MAX_PAGE_CHARS, description="most characters to return")]
        = DEFAULT_PAGE_CHARS,
        *,
        ctx: ToolContext,
    ) -> dict[str, Any]:
        """Fetch a web page and return its readable text (untrusted text from the web)."""
        return tool_result(await run(WebFetch(url=url, max_chars=max_chars), ctx.peer_id))

    return [tool_from_function(search, "web.search"), tool_from_function(fetch, "web.fetch")]
