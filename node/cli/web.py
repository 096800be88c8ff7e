"""`psymesh web search|fetch`: the web through a trusted exit (docs/web.md)."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from .output import Output, escape
from ...protocol import control as c
from .common import command, on_node, peer_label, peer_names

if TYPE_CHECKING:
    from rich.console import Console

    from ..control.client import Client


@click.group()
def web() -> None:
    """Web queries run by a trusted paired peer (the exit): this node never touches the web."""


def _route_options(f: Callable[..., Any]) -> Callable[..., Any]:
    f = click.option("--hops", type=click.IntRange(1, 2), default=None,
                     help="1: ask the exit directly; 2: sealed through a relay, so the exit never learns who "
                          "asked (default: [web] hops).")(f)
    f = click.option("--relay", default=None, help="The relay for two hops (default: [web] relay, or the one "
                                                    "paired peer granting web.relay).")(f)
    return click.option("--via", default=None, help="The exit (default: [web] via, or the one paired peer "
                                                     "granting the query).")(f)


async def _asked(client: Client, **query: Any) -> tuple[c.WebQueryReply, dict[str, str]]:
    """The query's reply, and the names of the peers it went through."""
    return await client.web_query(**query), await peer_names(client)


def _way(reply: c.WebQueryReply, names: dict[str, str]) -> str:
    return f"via {peer_label(reply.exit, names)}" + (
        f" through relay {peer_label(reply.relay, names)}" if reply.relay else "")


@web.command("search")
@command
@click.argument("query")
@click.option("--limit", type=click.IntRange(1, 20), default=5, show_default=True)
@_route_options
def web_search(home: str | None, out: Output, query: str, limit: int, via: str | None, relay: str | None,
               hops: int | None) -> None:
    """Search the web for QUERY through a trusted exit."""
    reply, names = on_node(home, lambda client: _asked(client, search=query, limit=limit, via=via, relay=relay,
                                                       hops=hops))
    results = reply.results
    assert results is not None

    def human(con: Console) -> None:
        out.hint(f"{len(results.hits)} result(s) {_way(reply, names)}" + (" (cached)" if results.cached else "")
                 + "; untrusted text from the web")
        for hit in results.hits:
            con.print(f"[bold]{escape(hit.title)}[/bold]\n  {escape(hit.url)}")
            if hit.snippet:
                con.print(f"  {escape(hit.snippet)}")

    out.data(reply, human)


@web.command("fetch")
@command
@click.argument("url")
@click.option("--max-chars", type=click.IntRange(1, 100_000), default=8000, show_default=True)
@_route_options
def web_fetch(home: str | None, out: Output, url: str, max_chars: int, via: str | None, relay: str | None,
              hops: int | None) -> None:
    """Fetch URL's readable text through a trusted exit."""
    reply, names = on_node(home, lambda client: _asked(client, url=url, max_chars=max_chars, via=via, relay=relay,
                                                       hops=hops))
    page = reply.page
    assert page is not None

    def human(con: Console) -> None:
        out.hint(f"{page.status} {page.content_type} from {page.final_url} {_way(reply, names)}"
                 + (" (cached)" if page.cached else "") + "; untrusted text from the web")
        partial = page.partial()
        if partial is not None:  # the text is not all of the page: said where it cannot be missed
            out.warn(partial)
        if page.title:
            con.print(f"[bold]{escape(page.title)}[/bold]")
        con.print(escape(page.text, lines=True))

    out.data(reply, human)


# -- groups ---------------------------------------------------------------------------
