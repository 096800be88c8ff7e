"""config.toml sections of the bridges to other ecosystems (docs/bridges.md):

    [serve.openai]             an OpenAI-compatible HTTP endpoint (node/bridges/openai.py)
    enabled = true
    host = "127.0.0.1"
    port = 8080
    # api_key_file = "/home/me/.config/psymesh-openai.key"   # default: <home>/openai.key
    # allowed_hosts = ["desk.lan"]                           # Host names besides loopback and host

    [serve.a2a]                the node's agent as an A2A agent (node/bridges/a2a.py)
    enabled = true
    host = "127.0.0.1"
    port = 8081
    # api_key_file = "/home/me/.config/psymesh-a2a.key"      # default: <home>/a2a.key

    [ui]                       the local dashboard (node/control/dashboard.py; on by default for a home)
    enabled = true
    host = "127.0.0.1"
    port = 8765

    [[mcp]]                    an MCP server whose tools join this node's (node/bridges/mcp.py)
    name = "files"
    command = ["python", "/opt/mcp/files_server.py"]     # stdio; or
    # url = "http://127.0.0.1:8000/mcp"                  # streamable HTTP

Kept apart from the services themselves so that loading a config (every CLI command
does) imports pydantic only, not an HTTP server or the MCP SDK.
"""

from typing import ClassVar, Self
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, model_validator

_SERVER_NAME = r"^[a-z][a-z0-9_]{0,23}$"  # one segment of a tool name (agent/acting/tools.py TOOL_NAME_RE)


class KeyedServe(BaseModel):
    """A local HTTP face of the node: off unless enabled, bound to loopback by default, and
    always behind a bearer key (node/bridges/apikey.py: from the environment, the file named here,
    or `<home>/KEY_FILE`, created 0600 when the face is first enabled) and the checks of
    node/bridges/httpguard.py (Host allow-list, no cross-site Origin, JSON bodies)."""

    model_config = ConfigDict(defer_build=True, extra="forbid")
    SECTION: ClassVar[str]   # its config.toml table, for messages
    KEY_FILE: ClassVar[str]  # the key's file in the node home when api_key_file is not set
    KEY_ENV: ClassVar[str]   # the environment variable that, when set, holds the key

    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)  # 0: any free port (logged at start)
    # A file holding the key (mode 0600: refused if others may read it); clients send
    # `Authorization: Bearer KEY`. Default: <home>/KEY_FILE.
    api_key_file: str | None = None
    # Host names (besides localhost, loopback addresses and `host`) clients may put in the
    # Host header, e.g. "desk.lan" for a LAN bind: any other name is refused (DNS rebinding).
    allowed_hosts: list[str] = Field(default_factory=list)
    # A request body's bytes, at most: more is refused 413 while it streams in, never held.
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024, le=64 * 1024 * 1024)

    def host_names(self) -> list[str]:
        """The names a client may reach this face by, besides loopback (httpguard.AllowedHosts)."""
        return [self.host, *self.allowed_hosts]


class OpenAIServe(KeyedServe):
    """`[serve.openai]`: whoever holds the key can run this node's models and the models of
    every home that granted it."""

    SECTION: ClassVar[str] = "serve.openai"
    KEY_FILE: ClassVar[str] = "openai.key"
    KEY_ENV: ClassVar[str] = "PSYMESH_OPENAI_API_KEY"


class A2AServe(KeyedServe):
    """`[serve.a2a]`: whoever holds the key can run this node's agent
    with this node's tools (irreversible ones refused: node/bridges/a2a.py)."""

    SECTION: ClassVar[str] = "serve.a2a"
    KEY_FILE: ClassVar[str] = "a2a.key"
    KEY_ENV: ClassVar[str] = "PSYMESH_A2A_API_KEY"

    port: int = Field(default=8081, ge=0, le=65535)
    # The URL the agent card names, when clients reach the node by another name than
    # host:port (a LAN name, a reverse proxy). Default: http://HOST:PORT as bound.
    public_url: str | None = Field(default=None, pattern=r"^https?://")
    max_runtime_s: float = Field(default=600.0, gt=0, le=86400)  # one agent run's deadline

    def host_names(self) -> list[str]:
        """Also the host of `public_url`: the name the card tells clients to use."""
        names = super().host_names()
        if self.public_url is not None:
            host = urlsplit(self.public_url).hostname
            if host:
                names.append(host)
        return names


class UiServe(KeyedServe):
    """`[ui]`: the dashboard (node/control/dashboard.py), a local web page for pairing, grants,
    approvals and activity. Its key is the bearer token for scripts; a browser signs in with
    the one-use link `psymesh ui` opens (node/control/uisessions.py). `enabled` unset: on for the home profile, off on a phone (where
    `psymesh ui` starts it on demand, so an idle phone pays nothing for it)."""

    SECTION: ClassVar[str] = "ui"
    KEY_FILE: ClassVar[str] = "ui.key"
    KEY_ENV: ClassVar[str] = "PSYMESH_UI_TOKEN"

    enabled: bool | None = None  # type: ignore[assignment]  # None: the profile decides
    port: int = Field(default=8765, ge=0, le=65535)
    max_body_bytes: int = Field(default=64 * 1024, ge=1024, le=64 * 1024 * 1024)  # a form: a letter, a grant

    def on_for(self, profile: str) -> bool:
        return self.enabled if self.enabled is not None else profile == "home"


class ServeSettings(BaseModel):
    """`[serve]`: HTTP faces of this node for apps that speak another ecosystem's API (OpenAI, A2A)."""

    model_config = ConfigDict(defer_build=True, extra="forbid")

    openai: OpenAIServe = Field(default_factory=OpenAIServe)
    a2a: A2AServe = Field(default_factory=A2AServe)


class McpServerConfig(BaseModel):
    """One `[[mcp]]` entry: an MCP server mounted as tools `mcp.NAME.*` (grant them to a
    peer as `tool:mcp.NAME.*`). Exactly one of `command` (stdio: the node starts it and
    restarts it with backoff when it dies) and `url` (streamable HTTP)."""

    model_config = ConfigDict(defer_build=True, extra="forbid")

    name: str = Field(pattern=_SERVER_NAME)
    command: list[str] | None = Field(default=None, min_length=1)
    url: str | None = Field(default=None, pattern=r"^https?://")
    env: dict[str, str] = Field(default_factory=dict)  # added to a minimal environment (HOME, PATH, ...)
    cwd: str | None = None
    call_timeout_s: float = Field(default=60.0, gt=0, le=3600)
    probe_s: float = Field(default=10.0, gt=0, le=3600)        # how often a quiet server is checked
    restart_min_s: float = Field(default=1.0, gt=0, le=3600)   # backoff after a failure: doubles up to...
    restart_max_s: float = Field(default=60.0, gt=0, le=86400)

    @model_validator(mode="after")
    def _one_transport(self) -> Self:
        if (self.command is None) == (self.url is None):
            raise ValueError(f"[[mcp]] {self.name}: give exactly one of command (stdio) and url (streamable HTTP)")
        return self
