"""The private link between the server's frontend and its engine process.

Two ZMQ sockets (requests to the engine, per-step outputs back) on ``ipc://`` paths in a
directory made for this start (``tempfile.mkdtemp``: mode 0700, removed at shutdown), both
bound by the frontend as CURVE servers. The engine process receives the frontend's public
key and a keypair of its own only as spawn arguments (pickled over the spawn pipe: never
argv, the environment or a file), and a ZAP handler accepts that one client key. A local
process that finds the paths (root can enter a 0700 directory) cannot complete a handshake,
so it neither receives requests nor injects messages, and a second server never talks to
another's engine: each start has its own paths and keys.
"""

from __future__ import annotations

import hmac
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.auth.thread import ThreadAuthenticator

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineLink:
    """What the engine process needs to connect; a spawn argument, never written anywhere."""

    to_engine: str  # the frontend's PUSH: requests, aborts, control commands
    from_engine: str  # the frontend's PULL: step outputs, replies, start-up result
    server_key: bytes  # the frontend's public key (z85)
    public_key: bytes  # the engine's keypair (z85)
    secret_key: bytes = field(repr=False)

    def connect(self, ctx: zmq.Context, kind: int, endpoint: str) -> zmq.Socket:
        """A socket of ``kind`` connected to ``endpoint`` as this link's CURVE client."""
        sock = ctx.socket(kind)
        sock.curve_serverkey = self.server_key
        sock.curve_publickey = self.public_key
        sock.curve_secretkey = self.secret_key
        sock.connect(endpoint)
        return sock


class _OneClientKey:
    """ZAP credentials check: only the engine's public key completes a handshake."""

    def __init__(self, key: bytes) -> None:
        self.key = key

    def callback(self, domain: str, key: bytes) -> bool:
        if hmac.compare_digest(key, self.key):
            return True
        logger.warning("refused a connection to the engine link from an unknown CURVE key")
        return False


class LinkServer:
    """The frontend's side of the link: its directory, keys, ZAP handler, asyncio context
    and bound sockets (``out`` to the engine, ``inp`` from it). ``close`` releases all of it."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="atom-engine-")
        self.ctx = zmq.asyncio.Context()
        self._auth: ThreadAuthenticator | None = None
        self._sockets: list[zmq.Socket] = []
        self._closed = False
        try:
            server_public, server_secret = zmq.curve_keypair()
            engine_public, engine_secret = zmq.curve_keypair()
            # The ZAP handler runs in a thread of its own: handshakes do not wait on the
            # event loop, and it is bound before the sockets, so no handshake skips it.
            self._auth = ThreadAuthenticator(self.ctx)
            self._auth.start()
            self._auth.configure_curve_callback("*", _OneClientKey(engine_public))
            self.link = EngineLink(
                f"ipc://{os.path.join(self.dir, 'to-engine')}",
                f"ipc://{os.path.join(self.dir, 'from-engine')}",
                server_public, engine_public, engine_secret,
            )
            self.out = self._bind(zmq.PUSH, self.link.to_engine, server_secret)
            self.inp = self._bind(zmq.PULL, self.link.from_engine, server_secret)
        except BaseException:
            self.close()
            raise

    def _bind(self, kind: int, endpoint: str, secret: bytes) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(kind)
        self._sockets.append(sock)
        sock.curve_server = True
        sock.curve_secretkey = secret
        sock.bind(endpoint)
        return sock

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sock in self._sockets:
            sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()  # returns once the sockets are closed and their files unlinked
        shutil.rmtree(self.dir)
