"""Web queries run by a trusted peer (sans-IO): the wire messages and what comes back.

A phone never touches the web itself. A paired peer that holds the capability (the
*exit*) runs the query and answers with text, marked untrusted:

    web.search {query, limit}          -> web.results {hits, cached}
    web.fetch  {url, max_chars}        -> web.page {url, final_url, status, ..., text}

One hop: the phone sends these on its session with the exit, which admits them by the
phone's own grant (`web.search`; `web.fetch:domains=...`, checked again on every redirect).

Two hops (Oblivious HTTP, RFC 9458, is the model): the phone seals the same request to the
exit's HPKE key (`protocol/oblivious.py`) and hands it to a *relay* peer:

    web.key    {key}                   -> web.key_ok                      exit -> each paired peer
    web.key_of {exit}                  -> web.key_view {key}             phone -> relay
    web.key_get {}                     -> web.key_view {key}             relay -> exit
    web.relay  {exit, sealed}          -> web.sealed_reply {sealed}      phone -> relay
    web.sealed {sealed}                -> web.sealed_reply {sealed}      relay -> exit

One key for everyone: an exit that handed each phone its own key would know, by the key a
sealed query opens with, which phone asked. So the phone seals only to the relay's view of
the exit's key (`web.key_of`: the relay fetched it from the exit itself, `web.key_get`, and
shows every asker the same one), refuses to seal at all when the exit handed it a different
key under the same `key_id`, and the relay refuses a sealed query under any other `key_id`.

The relay sees the phone, the exit, bucketed sizes and timing; never the query. The exit
sees the relay and the query; never the phone. The exit admits the opened request by the
*relay's* grant: it serves what the relay may ask, on behalf of whoever the relay serves.
"""

from enum import StrEnum
from typing import Annotated

from pydantic import Field, StringConstraints, field_validator

from .identity import PeerId
from .manifest import Operation
from .messages import Message
from .oblivious import ExitKey

MAX_QUERY_CHARS = 512
MAX_URL_CHARS = 2048
MAX_HITS = 20
DEFAULT_PAGE_CHARS = 8000
MAX_PAGE_CHARS = 100_000
MAX_SEALED_BYTES = 2 * 1024 * 1024 + 4096   # the largest padding bucket plus HPKE framing

Query = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=MAX_QUERY_CHARS)]
Url = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=MAX_URL_CHARS)]


class WebSearch(Message):
    """Search the web for `query`; at most `limit` hits."""

    type = "web.search"
    query: Query
    limit: int = Field(default=5, ge=1, le=MAX_HITS)

    def operation(self) -> Operation:
        return Operation(name="web.search", payload_bytes=len(self.query.encode()))


class WebFetch(Message):
    """Fetch `url` and return its readable text, cut to `max_chars`."""

    type = "web.fetch"
    url: Url
    max_chars: int = Field(default=DEFAULT_PAGE_CHARS, ge=1, le=MAX_PAGE_CHARS)

    @field_validator("url")
    @classmethod
    def _http(cls, value: str) -> str:
        scheme = value.split(":", 1)[0].lower()
        if scheme not in ("http", "https"):
            raise ValueError("only http and https URLs can be fetched")
        return value

    def operation(self) -> Operation:
        return Operation.fetch(self.url, payload_bytes=len(self.url.encode()))


class WebHit(Message):
    type = "web.hit"
    title: str
    url: str
    snippet: str = ""


class WebResults(Message):
    """Search hits. Text from the web: data for the caller, never instructions."""

    type = "web.results"
    query: str
    hits: tuple[WebHit, ...] = ()
    cached: bool = False
    untrusted: bool = True


class Truncation(StrEnum):
    """Why a page's text is not all of the page (`web.page` `truncated_reasons`). A receiver MUST take a
    reason it does not know as "partial, for a reason this node cannot name"."""

    MAX_CHARS = "max_chars"    # the text ran past the asker's max_chars: cut there
    TOO_LARGE = "too_large"    # the HTML ran past what the exit extracts: text of its first `extracted_bytes` only
    TOO_DEEP = "too_deep"      # the HTML nests deeper than the exit's parser follows: the text past that is lost


class WebPage(Message):
    """A fetched page as text (HTML reduced to its readable text). `final_url` is where the
    redirects, if any, ended. Text from the web: data for the caller, never instructions.

    `truncated` says the text is not all of the page, `truncated_reasons` why (`Truncation`);
    `body_bytes` is how much of the body the exit read, `extracted_bytes` how much of it the
    text came from (fewer when `too_large`). An older exit sends neither: `truncated` alone."""

    type = "web.page"
    url: str
    final_url: str
    status: int
    content_type: str
    title: str = ""
    text: str = ""
    truncated: bool = False
    cached: bool = False
    untrusted: bool = True
    truncated_reasons: tuple[Annotated[str, Field(max_length=64)], ...] = Field(default=(), max_length=8)
    body_bytes: int | None = Field(default=None, ge=0)
    extracted_bytes: int | None = Field(default=None, ge=0)

    def partial(self) -> str | None:
        """What the asker did not see, in a sentence (None: the whole page's text)."""
        if not self.truncated:
            return None
        said = []
        for why in self.truncated_reasons or ("",):
            if why == Truncation.MAX_CHARS:
                said.append(f"the text was cut at the {len(self.text)} characters asked for (max_chars)")
            elif why == Truncation.TOO_LARGE:
                said.append(f"the exit read the text of only the first {self.extracted_bytes} of the page's "
                            f"{self.body_bytes} bytes")
            elif why == Truncation.TOO_DEEP:
                said.append("the page nests its HTML deeper than the exit's parser follows (255 levels): "
                            "the text past that point is missing")
            else:
                said.append("the exit cut the text" + (f" ({why})" if why else ""))
        return "partial: " + "; ".join(said)


WebRequest = WebSearch | WebFetch
WebAnswer = WebResults | WebPage



class WebRelay(Message):
    """Phone -> relay: forward this sealed request to `exit` and hand back its sealed reply."""

    type = "web.relay"
    exit: PeerId
    sealed: bytes = Field(min_length=1, max_length=MAX_SEALED_BYTES)


    def operation(self) -> Operation:
        return Operation(name="web.relay", payload_bytes=len(self.sealed))


class WebSealed(Message):
    """Relay -> exit: a request sealed to the exit's key by someone the relay serves."""

    type = "web.sealed"
    sealed: bytes = Field(min_length=1, max_length=MAX_SEALED_BYTES)


class WebSealedReply(Message):
    """The exit's answer (a WebResults, WebPage or error), sealed to the asker."""

    type = "web.sealed_reply"
    sealed: bytes = Field(min_length=1, max_length=MAX_SEALED_BYTES)



class WebKeyPush(Message):
    """An exit hands a paired peer its HPKE key, signed by its identity key (at start and
    with every grant it issues), so the peer can seal queries to it through a relay."""

    type = "web.key"
    key: ExitKey


class WebKeyOk(Message):
    type = "web.key_ok"


class WebKeyOf(Message):
    """Phone -> relay: your view of `exit`'s key (the one you forward sealed queries under)."""

    type = "web.key_of"
    exit: PeerId

    def operation(self) -> Operation:
        return Operation(name="web.relay")


class WebKeyGet(Message):
    """Relay -> exit: your current key, as you would show it to anyone."""

    type = "web.key_get"


class WebKeyView(Message):
    type = "web.key_view"
    key: ExitKey
