"""The daemon's control socket as a client finds it: where it is, and the checks that it is our
own daemon's before a byte is sent (requests carry secrets: an invite string is a bearer
credential). Shared by the SDK (client.py, on anyio) and the one-shot client (oneshot.py,
blocking): a socket file owned by us, in a directory only we may enter, and (on Linux, BSD and
macOS) a listening process that runs as us. Not root either: psymesh never runs a daemon as one
user for another user's home, so a root-owned listener is not ours.

Standard library only (with core/paths.py and core/commands.py): `psymesh status` loads this and no event loop.
"""
from __future__ import annotations

import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

from ..core.commands import spell_command
from ..core.paths import SOCKET_DIR_ADVICE, check_private_dir, os_error, socket_peer
from ...protocol.errors import ErrorCode, PsymeshError


class DaemonNotRunning(PsymeshError):
    default_code = ErrorCode.UNAVAILABLE


class NotOurDaemon(PsymeshError):
    """Something other than our own daemon holds the control socket path; nothing was sent to it."""

    default_code = ErrorCode.FORBIDDEN


@dataclass(frozen=True)
class ControlSocket:
    path: Path   # the socket
    home: Path   # the home it serves, for the advice in errors

    def not_running(self, reason: str) -> DaemonNotRunning:
        return DaemonNotRunning(f"no psymesh daemon is listening at {self.path} ({reason}); "
                                f"start one with: {spell_command('node start', home=str(self.home))}")

    def _not_ours(self, why: str) -> NotOurDaemon:
        return NotOurDaemon(f"{self.path} is not your daemon's control socket ({why}); nothing was sent "
                            "to it. Stop whatever made it (it may be impersonating your daemon) or remove it, "
                            f"then start your own: {spell_command('node start', home=str(self.home))}")

    def check_file(self) -> None:
        """Before connecting: a socket, owned by us, in a directory only we may enter."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            raise self.not_running("no socket there") from None
        except OSError as exc:
            raise os_error(exc, self.path) from None
        check_private_dir(self.path.parent, "the control socket's directory", SOCKET_DIR_ADVICE)
        if not stat.S_ISSOCK(st.st_mode):
            raise self._not_ours("it is not a socket")
        if st.st_uid != os.geteuid():
            raise self._not_ours(f"it belongs to uid {st.st_uid}, not to you (uid {os.geteuid()})")

    def check_listener(self, sock: socket.socket) -> None:
        """After connecting, before sending: the listening process must run as us."""
        peer = socket_peer(sock)
        if peer is not None and peer[0] != os.geteuid():
            raise self._not_ours(f"the process listening on it (pid {peer[1] or '?'}) runs as uid {peer[0]}, "
                                 f"not as you (uid {os.geteuid()})")

    def connect_blocking(self) -> socket.socket:
        """A blocking connection to the daemon, checked both ways (oneshot.py)."""
        self.check_file()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(self.path))
            self.check_listener(sock)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            raise self.not_running(exc.strerror or str(exc)) from None
        except BaseException:
            sock.close()
            raise
        return sock
