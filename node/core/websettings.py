"""config.toml `[web]`: where this node's web queries go, and (`[web.exit]`) whether and how
it serves other peers' queries as an exit. Kept apart from node/web/router.py, node/web/exit.py and
node/web/search.py so the config can be read without the session machinery or an HTTP client
(node/core/home.py imports it, and every CLI command reads the config)."""

from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

MIB = 1024 * 1024
USER_AGENT = "psymesh-exit/0.1"
MediaType = Annotated[str, StringConstraints(strip_whitespace=True, to_lower=True, min_length=3, max_length=100)]


class SearchSettings(BaseModel):
    """config.toml `[web.exit.search]`: how this exit answers `web.search`.

    `url` is the SearXNG base URL (backend "searxng"), or a URL template with `{query}` and
    optionally `{limit}` (backend "json"). The `*_key` names say where a JSON API keeps its
    hits (`results_key`, dotted for nested objects: "data.items") and each hit's fields;
    SearXNG's own JSON uses results[].title/url/content and needs none of them."""

    model_config = ConfigDict(defer_build=True, extra="forbid")

    backend: Literal["none", "searxng", "ddgs", "json"] = "none"
    url: str | None = None
    results_key: str = "results"
    title_key: str = "title"
    url_key: str = "url"
    snippet_key: str = "snippet"

    @model_validator(mode="after")
    def _url_fits_backend(self) -> "SearchSettings":
        if self.backend not in ("searxng", "json"):
            return self
        if not self.url:
            raise ValueError(f"[web.exit.search] backend = {self.backend!r} needs a url")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"[web.exit.search] url must be an http(s) URL, not {self.url!r}")
        if self.backend == "json":
            if "{query}" not in self.url:
                raise ValueError("[web.exit.search] url must contain {query} for backend = 'json'")
            if "{" in parts.netloc:   # the asker's words must never choose the server
                raise ValueError("[web.exit.search] url: {query} and {limit} belong after the host")
        return self


class ExitSettings(BaseModel):
    """config.toml `[web.exit]`: whether this node serves web queries, and within what.

    Everything outside the public internet is shut unless opened here: loopback
    (`allow_loopback`, which also opens this machine's own addresses), private and other
    non-global ranges (`allow_private`: RFC 1918, CGNAT 100.64/10, ULA fc00::/7, ...).
    Link-local (169.254/16 holds cloud metadata), multicast, unspecified and reserved
    addresses are never fetched. `ports = [80, 443]` shuts every other port."""

    model_config = ConfigDict(defer_build=True, extra="forbid")

    enabled: bool = False
    allow_loopback: bool = False
    allow_private: bool = False
    ports: list[Annotated[int, Field(ge=1, le=65535)]] | None = None
    timeout_s: float = Field(default=10.0, gt=0, le=300)
    max_body_bytes: int = Field(default=2 * MIB, ge=1024, le=64 * MIB)
    # The page's text is extracted in child processes (node/web/extractor.py): at most this many
    # at once, each allowed this much memory beyond its own, handed at most max_html_bytes
    # of HTML (a longer page is cut there), all within the fetch's timeout_s.
    extractions: int = Field(default=2, ge=1, le=64)
    extract_memory_bytes: int = Field(default=128 * MIB, ge=16 * MIB, le=4096 * MIB)
    max_html_bytes: int = Field(default=1 * MIB, ge=1024, le=64 * MIB)
    max_redirects: int = Field(default=5, ge=0, le=20)
    content_types: list[MediaType] = Field(default_factory=lambda: [
        "text/html", "application/xhtml+xml", "text/plain", "application/json", "text/markdown"])
    cache_entries: int = Field(default=256, ge=0, le=100_000)
    cache_ttl_s: float = Field(default=300.0, ge=0)
    requests_per_minute: int = Field(default=120, ge=1, le=100_000)
    # the exit's HPKE key: a new one this often; the old one stays in date this much longer
    # (relays and phones move over), and its secret is deleted a replay window after that
    key_rotate_s: float = Field(default=7 * 86_400.0, ge=1.0, le=365 * 86_400.0)
    key_overlap_s: float = Field(default=3600.0, ge=0.0, le=30 * 86_400.0)
    user_agent: str = Field(default=USER_AGENT, min_length=1, max_length=200)
    search: SearchSettings = Field(default_factory=SearchSettings)


Hops = Literal[1, 2]


class WebSettings(BaseModel):
    """config.toml `[web]`: where this node's queries go; `[web.exit]`: serving them."""

    model_config = ConfigDict(defer_build=True, extra="forbid")

    via: str | None = None        # the exit (paired peer name or id); None: the one that fits
    relay: str | None = None      # the relay for two hops; None: the one that fits
    hops: Hops = 1
    timeout_s: float = Field(default=60.0, gt=0, le=600)
    exit: ExitSettings = Field(default_factory=ExitSettings)
