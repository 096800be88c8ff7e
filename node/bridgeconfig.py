"""config.toml sections of the bridges to other ecosystems (docs/bridges.md):

    [serve.openai]             an OpenAI-compatible HTTP endpoint (node/openai_api.py)
    enabled = true
    host = "127.0.0.1"
    port = 8080
    api_key_file = "/home/me/.config/psymesh-openai.key"

    [serve.a2a]                the node's agent as an A2A agent (node/a2a_api.py)
    enabled = true
    host = "127.0.0.1"
    port = 8081
    api_key_file = "/home/me/.config/psymesh-a2a.key"

    [[mcp]]                    an MCP server whose tools join this node's (node/mcp_tools.py)
    name = "files"
    command = ["python", "/opt/mcp/files_server.py"]     # stdio; or
    # url = "http://127.0.0.1:8000/mcp"                  # streamable HTTP

Kept apart from the services themselves so that loading a config (every CLI command
does) imports pydantic only, not an HTTP server or the MCP SDK.
"""

import ipaddress
from pathlib import Path
from typing import ClassVar, Self

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from psymesh.protocol.errors import ErrorCode, PsymeshError

_SERVER_NAME = r"^[a-z][a-z0-9_]{0,23}$"  # one segment of a tool name (agent/tools.py TOOL_NAME_RE)


def is_loopback(host: str) -> bool:
    """Whether `host` names only this machine (then no one else can connect)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class KeyedServe(BaseModel):
    """An HTTP face of the node with a bearer key: off unless enabled, bound to loopback
    by default; another host needs a key (the daemon refuses to start without one)."""

    model_config = ConfigDict(defer_build=True, extra="forbid")
    SECTION: ClassVar[str]  # its config.toml table, for messages

    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)  # 0: any free port (logged at start)
    api_key_file: str | None = None  # a file holding the key; clients send `Authorization: Bearer KEY`
    # Set by `psymesh serve ... --api-key` for one run; never written to config.toml.
    api_key: SecretStr | None = Field(default=None, exclude=True, repr=False)

    def key(self) -> str | None:
        """The API key clients must present, or None (then no Authorization is asked)."""
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        if self.api_key_file is None:
            return None
        path = Path(self.api_key_file).expanduser()
        try:
            key = path.read_text().strip()
        except OSError as exc:
            raise PsymeshError(f"[{self.SECTION}] api_key_file {path}: {exc.strerror or exc}",
                               code=ErrorCode.BAD_REQUEST) from None
        if not key:
            raise PsymeshError(f"[{self.SECTION}] api_key_file {path} is empty", code=ErrorCode.BAD_REQUEST)
        return key

    def check(self) -> str | None:
        """The key, after refusing a setup that would open the node to the network."""
        key = self.key()
        if key is None and not is_loopback(self.host):
            raise PsymeshError(f"[{self.SECTION}] host {self.host} is reachable from other machines: set an API key "
                               "(api_key_file, or --api-key) or bind to 127.0.0.1", code=ErrorCode.BAD_REQUEST)
        return key


class OpenAIServe(KeyedServe):
    """`[serve.openai]`: whoever reaches the port can run this node's models and the
    models of every home that granted it."""

    SECTION: ClassVar[str] = "serve.openai"

    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024, le=64 * 1024 * 1024)


class A2AServe(KeyedServe):
    """`[serve.a2a]`: whoever reaches the port (with the key) can run this node's agent
    with this node's tools (irreversible ones refused: node/a2a_api.py)."""

    SECTION: ClassVar[str] = "serve.a2a"

    port: int = Field(default=8081, ge=0, le=65535)
    # The URL the agent card names, when clients reach the node by another name than
    # host:port (a LAN name, a reverse proxy). Default: http://HOST:PORT as bound.
    public_url: str | None = Field(default=None, pattern=r"^https?://")
    max_runtime_s: float = Field(default=600.0, gt=0, le=86400)  # one agent run's deadline


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
