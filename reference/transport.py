"""TCP transport: an asyncio server and client around ``wire.Session``.

Theory of operation
-------------------
Every connection carries one ``wire.Session`` (framing, per-tenant authentication, replay
protection); this module only moves its bytes and schedules work.

*Requests and replies are pipelined.* A client may have up to ``max_in_flight`` requests
outstanding on one connection; each request is a frame with its own ``seq``, and its reply is the
frame whose ``re`` equals that ``seq``. The server runs one handler task per request, so replies
come back in completion order, and a slow request (a ``WaitTicket`` long-poll) never holds up a
fast one (a lease renewal) on the same connection. A reply that arrives after its request timed
out is dropped with a reason (``Client.stats["stale_replies"]``): late answers are network
weather, and the protocol's request numbers already make them harmless.

*Server.* ``handler(tenant, msg) -> reply`` is awaited for every request, with the connection's
authenticated tenant. A server whose requests mostly complete without waiting (the directory)
may also pass ``handler_now(tenant, msg) -> reply | DEFER | Future``: it is called first, in the read
loop, and a reply it returns is sent at once -- no task, no timer -- a future's once it resolves
(within the request timeout, holding a slot, like a handler task), while ``DEFER`` hands the
request to ``handler`` as above (for a request that must wait: a ``WaitTicket``). It must never
block; it sees ``current_connection`` and raises as ``handler`` does, with the same outcome. Limits, all named and units last: ``max_connections`` (beyond it a
connection gets a final ``Error("busy")``), ``request_timeout_ms`` (a handler still running then
is cancelled and the request answered with ``Error("timeout")``; handlers must therefore be
cancellation-safe), ``idle_timeout_ms`` (a connection with nothing received and nothing in flight
for that long gets ``Error("idle")`` and is closed), ``max_frame_bytes`` (pass
``wire.MAX_CONTROL_FRAME_BYTES`` for a control-only service such as the directory, so that no
peer can make it buffer 64 MiB), and ``max_in_flight_per_connection`` (beyond it the server stops
reading that connection: back-pressure, not an error). ``Ping`` is answered with ``Pong`` by the
transport itself (``answer_ping``), never reaching the handler: the raw baseline for benchmarks.

A ``PeerViolation`` -- from the session (garbage, bad MAC, replay, oversized frame) or raised by
the handler (e.g. ``Tenants.authorize``) -- is answered with a final ``Error(code, detail)`` and the
connection is closed; a violation found by the session never reaches the handler, and nothing
after it on that connection is processed. Any other exception from the handler is our bug: it is
logged and answered with ``Error("internal")``, and the connection stays up.

*Pushes.* A server may send a message unasked on a connection (``re`` = 0, not an ``Error``):
a handler keeps ``current_connection.get()`` and later calls its ``push(msg)`` (``False`` once
the connection is going away: the message is lost, as the network may lose any). The directory
pushes ``Revoke``, ``Free`` and ``Copy`` this way on the connection a node or client said
``Hello`` on. A client given ``on_push`` has it called, in its read loop, with each pushed
message; without one, pushes are counted as stale replies and dropped.

*Client.* ``await client.request(msg, timeout_ms=...)`` connects on first use and reconnects after
any failure (the next request opens a new connection, with a new session). It never resends a
request by itself: when a request fails with ``ConnectionFailed`` it may or may not have been
processed; the caller retries, and the protocol's request numbers make that safe. A timeout raises
``TimeoutError_`` naming the request; the connection stays up for the others. An ``Error`` reply
is returned like any other reply; a *final* ``Error`` from the server fails every outstanding
request with ``ConnectionFailed(code=<its code>)``.

*TLS.* A ``TlsConfig`` (a deployment file's ``"tls"`` section, ``kvcc.reference.serve``) given to
``Server`` and ``Client`` puts every connection under TLS (1.2 at least; 1.3 is what two of ours
negotiate): the server presents ``cert``, a client verifies it against ``ca`` and the name it
dialled (or ``server_name``), and with ``require_client_cert`` the server verifies the client's in
turn (mutual TLS). The server accepts TLS connections itself (``Server._accept``), so that a
handshake is a connection not authenticated yet like any other: it spends the connection's
``handshake_timeout_ms`` (one deadline from accept to the first authenticated frame) and counts
against ``max_unauthenticated`` (one more closes the oldest handshake). The frames, MACs and limits
are the same inside TLS; TLS adds confidentiality and server (optionally client) identity, the MAC
still says which tenant. A server refuses to *listen* beyond loopback without TLS (``TlsRequired``)
unless the deployment says ``{"mode": "off"}``; plaintext on loopback is unchanged, byte for byte.
A client whose handshake fails (an untrusted certificate or name, a plaintext server) gets
``ConnectionFailed(code="tls")`` saying why; one a server closes before any answer (a plaintext
client of a TLS server; under TLS 1.3, a client certificate refused after the client's side of the
handshake ended) gets ``"eof"`` or ``"reset"``, its message naming that as a likely cause.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ipaddress
import logging
import socket
import ssl
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
from attrs import frozen

from .errors import ConnectionFailed, PeerViolation, ProtocolViolation, TimeoutError_
from .wire import (
    ERROR_BUSY,
    ERROR_IDLE,
    ERROR_INTERNAL,
    ERROR_SHUTDOWN,
    ERROR_TIMEOUT,
    MAX_FRAME_BYTES,
    MAX_WAIT_TICKET_MS,
    Error,
    Ping,
    Pong,
    Received,
    Session,
    Tenants,
    check_message,
    kind_of,
)

log = logging.getLogger("kvcc.transport")

# The server connection a handler is answering for (set around every handler call): a handler
# that needs to push to that peer later (the directory's Revoke, Free, Copy) keeps it.
current_connection: contextvars.ContextVar[_ServerConnection | None] = contextvars.ContextVar(
    "kvcc_transport_connection", default=None
)  # the annotation is text (PEP 563): _ServerConnection is defined below

# -- limits -------------------------------------------------------------------------------------
MAX_CONNECTIONS_DEFAULT = 256
MAX_IN_FLIGHT_PER_CONNECTION_DEFAULT = 64
SERVER_REQUEST_TIMEOUT_MS_DEFAULT = 40_000  # above the longest WaitTicket
CLIENT_REQUEST_TIMEOUT_MS_DEFAULT = 45_000  # above the server's, so the server's answer wins
CONNECT_TIMEOUT_MS_DEFAULT = 5_000
IDLE_TIMEOUT_MS_DEFAULT = 300_000
CLOSE_TIMEOUT_MS = 1_000  # how long a closing connection waits for its last frames to leave
READ_CHUNK_BYTES = 256 << 10
LISTEN_BACKLOG = 100  # asyncio.start_server's
ACCEPT_RETRY_MS = 100  # after a failed accept (out of descriptors): how long before the next


@frozen
class ServerLimits:
    """What a server spends on peers that have not proved who they are, and on slow ones.

    - ``max_connections``: beyond it a new connection gets a final ``Error("busy")``.
    - ``handshake_timeout_ms``: a connection that has not authenticated a frame by then is closed
      (``Error("idle")``); until then it may send nothing above ``MAX_UNAUTHENTICATED_FRAME_BYTES``.
    - ``max_unauthenticated``: connections not authenticated yet; one more closes the oldest (so a
      flood of idle sockets delays a legitimate peer by one round trip, never locks it out).
    - ``max_connections_per_tenant``: authenticated connections of one tenant; beyond it the new one
      gets ``Error("busy")`` (one tenant cannot take every connection).
    - ``frame_grace_ms`` and ``min_transfer_bytes_per_s``: a frame begun must be whole within
      ``frame_grace_ms + its length / min_transfer_bytes_per_s`` (a slow sender, one byte at a time,
      is closed with ``Error("idle")``; a 64 MiB block has 74 s by default). Replies likewise: a
      connection takes one reply at a time into its buffer, and a peer that does not read what
      is there within that deadline is closed (it cannot grow the server's memory by not reading).
    """

    max_connections: int = MAX_CONNECTIONS_DEFAULT
    handshake_timeout_ms: int = 5_000
    max_unauthenticated: int = 32
    max_connections_per_tenant: int = 192
    frame_grace_ms: int = 10_000
    min_transfer_bytes_per_s: int = 1 << 20

    def __attrs_post_init__(self) -> None:
        for name in ("max_connections", "handshake_timeout_ms", "max_unauthenticated", "max_connections_per_tenant", "frame_grace_ms",
                     "min_transfer_bytes_per_s"):  # fmt: skip
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"transport limit {name} must be a positive int, got {value!r}")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ServerLimits:
        """From a deployment file's ``"transport"`` section (``kvcc.reference.serve``)."""
        unknown = set(raw) - set(attrs.fields_dict(cls))
        if unknown:
            raise ValueError(f"unknown transport limits {sorted(unknown)} (known: {sorted(attrs.fields_dict(cls))})")
        return cls(**dict(raw))


# -- TLS ------------------------------------------------------------------------------------------
TLS_MODE_ON = "on"
TLS_MODE_OFF = "off"  # plaintext, said explicitly: the only way to listen beyond loopback without TLS
TLS_MIN_VERSION = ssl.TLSVersion.TLSv1_2  # no maximum: two of ours negotiate 1.3
ERROR_CODE_TLS = "tls"  # ConnectionFailed.code of a failed TLS handshake or a refused TLS session
LOOPBACK_NAMES = ("localhost",)  # names taken as loopback without resolving them


class TlsConfigError(ValueError):
    """The TLS settings are wrong: an unknown key or mode, a file missing or unreadable, a key that
    does not match its certificate. Raised before anything listens or connects."""


class TlsRequired(TlsConfigError):
    """A server was asked to listen beyond loopback without TLS and without the deployment saying
    ``"tls": {"mode": "off"}``: it refuses to start."""


def is_loopback(host: str | None) -> bool:
    """``host`` names only this machine: a loopback address (127.0.0.0/8, ::1) or ``localhost``.
    Anything else -- ``0.0.0.0``, ``""``/``None`` (every interface), any other name -- is beyond
    loopback; names are not resolved (a name that resolves elsewhere tomorrow is not loopback)."""
    if not host:
        return False
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_listen(host: str | None, tls: TlsConfig | None) -> None:
    """Raise ``TlsRequired`` if a server may not listen on ``host`` with ``tls`` (see ``TlsConfig``)."""
    if tls is None and not is_loopback(host):
        raise TlsRequired(
            f"refusing to listen on {host or 'every interface'!r} without TLS: beyond loopback a deployment "
            'needs a "tls" section with cert, key and ca, or says "tls": {"mode": "off"} to serve plaintext'
        )


@frozen
class TlsConfig:
    """A deployment's TLS settings (its file's ``"tls"`` section); every server and client of the
    deployment takes the same one.

    - ``mode``: ``"on"`` (the default: every connection under TLS) or ``"off"`` (plaintext, said
      explicitly; needed to listen beyond loopback without TLS). No section at all is plaintext on
      loopback only.
    - ``cert``, ``key``: the server's certificate chain and private key (PEM). Required when on.
    - ``ca``: the CA certificates (PEM) a client verifies the server's certificate against -- and,
      with ``require_client_cert``, the server the client's. Required when on.
    - ``require_client_cert``: mutual TLS; a client without a certificate ``ca`` signed is refused.
    - ``client_cert``, ``client_key``: what a client presents (default: ``cert`` and ``key`` when
      ``require_client_cert``, none otherwise).
    - ``server_name``: the name a client checks the server's certificate for (default: the host
      it dialled, e.g. ``127.0.0.1`` against an IP SAN).

    Files are read when a context is first asked for (``server_context``, ``client_context``,
    ``check``), and the context is kept. Errors: ``TlsConfigError``.
    """

    mode: str = TLS_MODE_ON
    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    require_client_cert: bool = False
    client_cert: str | None = None
    client_key: str | None = None
    server_name: str | None = None
    _contexts: dict[str, ssl.SSLContext] = attrs.field(factory=dict, init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.mode not in (TLS_MODE_ON, TLS_MODE_OFF):
            raise TlsConfigError(f"tls mode must be {TLS_MODE_ON!r} or {TLS_MODE_OFF!r}, got {self.mode!r}")
        if type(self.require_client_cert) is not bool:
            raise TlsConfigError(f"tls require_client_cert must be true or false, got {self.require_client_cert!r}")
        paths = ("cert", "key", "ca", "client_cert", "client_key", "server_name")
        for name in paths:
            value = getattr(self, name)
            if value is not None and (type(value) is not str or not value):
                raise TlsConfigError(f"tls {name} must be a non-empty string, got {value!r}")
        if self.mode == TLS_MODE_OFF:
            given = [n for n in paths if getattr(self, n) is not None] + ["require_client_cert"] * self.require_client_cert
            if given:
                raise TlsConfigError(f"tls mode 'off' with {given}: either serve TLS or say off, not both")
            return
        missing = [n for n in ("cert", "key", "ca") if getattr(self, n) is None]
        if missing:
            raise TlsConfigError(f"tls is on but {missing} not given (cert, key: the server's; ca: what clients verify)")
        if (self.client_cert is None) != (self.client_key is None):
            raise TlsConfigError("tls client_cert and client_key go together")

    @property
    def on(self) -> bool:
        return self.mode == TLS_MODE_ON

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, base: str | Path | None = None) -> TlsConfig:
        """From a deployment file's ``"tls"`` section; relative paths are taken from ``base`` (the
        file's directory)."""
        if not isinstance(raw, Mapping):
            raise TlsConfigError(f"the tls section must be an object, got {raw!r}")
        known = [f.name.lstrip("_") for f in attrs.fields(cls) if f.init]
        unknown = set(raw) - set(known)
        if unknown:
            raise TlsConfigError(f"unknown tls settings {sorted(unknown)} (known: {sorted(known)})")
        values = dict(raw)
        if base is not None:
            for name in ("cert", "key", "ca", "client_cert", "client_key"):
                if isinstance(values.get(name), str) and values[name]:
                    values[name] = str(Path(base) / values[name])  # an absolute path stays as it is
        return cls(**values)

    def check(self) -> None:
        """Read every file now (server and client side): a bad setting fails here, before any
        state changes, not at the first connection."""
        if self.on:
            self.server_context()
            self.client_context()

    def server_context(self) -> ssl.SSLContext:
        assert self.on, "a plaintext deployment has no TLS context"
        ctx = self._contexts.get("server")
        if ctx is None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.minimum_version = TLS_MIN_VERSION
            assert self.cert is not None and self.key is not None and self.ca is not None
            _load_chain(ctx, self.cert, self.key, "")
            if self.require_client_cert:
                _load_ca(ctx, self.ca)
                ctx.verify_mode = ssl.CERT_REQUIRED
            ctx = self._contexts.setdefault("server", ctx)
        return ctx

    def client_context(self) -> ssl.SSLContext:
        assert self.on, "a plaintext deployment has no TLS context"
        ctx = self._contexts.get("client")
        if ctx is None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the chain and the host name
            ctx.minimum_version = TLS_MIN_VERSION
            assert self.ca is not None
            _load_ca(ctx, self.ca)
            if self.client_cert is not None:
                assert self.client_key is not None
                _load_chain(ctx, self.client_cert, self.client_key, "client_")
            elif self.require_client_cert:
                assert self.cert is not None and self.key is not None
                _load_chain(ctx, self.cert, self.key, "")
            ctx = self._contexts.setdefault("client", ctx)
        return ctx

    def server_hostname(self, host: str) -> str:
        """The name a client checks the server's certificate for when it dials ``host``."""
        return self.server_name or host


def _readable(path: str, setting: str) -> None:
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise TlsConfigError(f"tls {setting} {path}: {e.strerror or e}") from None


def _load_chain(ctx: ssl.SSLContext, cert: str, key: str, prefix: str) -> None:
    _readable(cert, f"{prefix}cert")
    _readable(key, f"{prefix}key")
    try:
        ctx.load_cert_chain(cert, key)
    except ssl.SSLError as e:
        raise TlsConfigError(f"tls {prefix}cert {cert} and {prefix}key {key}: not a PEM certificate and its "
                             f"matching private key ({e.reason or e})") from None  # fmt: skip


def _load_ca(ctx: ssl.SSLContext, ca: str) -> None:
    _readable(ca, "ca")
    try:
        ctx.load_verify_locations(cafile=ca)
    except ssl.SSLError as e:
        raise TlsConfigError(f"tls ca {ca}: no PEM CA certificate in it ({e.reason or e})") from None


async def _listen(host: str, port: int) -> list[socket.socket]:
    """Listening sockets on every address ``host`` resolves to (as ``asyncio.start_server``), all on
    one port: the first one's when ``port`` is 0."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if len(socks) > 1:
                address = (address[0], socks[0].getsockname()[1], *address[2:])
            sock.bind(address)
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks


def _tls_context(tls: TlsConfig | None, side: str) -> ssl.SSLContext | None:
    if tls is None or not tls.on:
        return None
    return tls.server_context() if side == "server" else tls.client_context()


assert MAX_WAIT_TICKET_MS < SERVER_REQUEST_TIMEOUT_MS_DEFAULT < CLIENT_REQUEST_TIMEOUT_MS_DEFAULT
assert CONNECT_TIMEOUT_MS_DEFAULT < CLIENT_REQUEST_TIMEOUT_MS_DEFAULT

Handler = Callable[[str, Any], Awaitable[Any]]
ImmediateHandler = Callable[[str, Any], Any]


class _Defer:
    """``handler_now``'s answer for "not now: await ``handler`` for this one"."""

    def __repr__(self) -> str:
        return "DEFER"


DEFER: Any = _Defer()


async def _close_writer(writer: asyncio.StreamWriter) -> None:
    """Close, letting already-written frames leave (bounded by ``CLOSE_TIMEOUT_MS``)."""
    writer.close()
    with contextlib.suppress(Exception, asyncio.CancelledError):
        async with asyncio.timeout(CLOSE_TIMEOUT_MS / 1000):
            await writer.wait_closed()


# -- server ---------------------------------------------------------------------------------------


class _ServerConnection:
    def __init__(self, server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.server = server
        self.reader = reader
        self.writer = writer
        self.session = Session.server(server.tenants, max_frame_bytes=server.max_frame_bytes)
        self.slots = asyncio.Semaphore(server.max_in_flight_per_connection)
        self.handlers: set[asyncio.Task] = set()
        self.closing = False
        self.linger_timer: asyncio.TimerHandle | None = None
        self.last_input = 0.0  # loop time of the last bytes received
        self.idle_timer: asyncio.TimerHandle | None = None
        self.peer = writer.get_extra_info("peername")
        self.on_close: list[Callable[[_ServerConnection], None]] = []
        self.authenticated = False  # a frame of this connection authenticated (``session.tenant``)
        self.handshake_timer: asyncio.TimerHandle | None = None
        self.frame_timer: asyncio.TimerHandle | None = None
        self.frame_started = 0.0  # loop time the frame partly received began (with ``frame_timer``)
        self.frame_length = 0  # its announced length when the timer was set (0: header not whole)
        self.write_lock = asyncio.Lock()  # one reply at a time, each only once the last has left

    @property
    def tenant(self) -> str | None:
        return self.session.tenant

    @property
    def closed(self) -> bool:
        return self.closing

    def push(self, msg: Any) -> bool:
        """Send ``msg`` unasked (``re`` = 0) to the peer; ``False`` if the connection is going
        away (the message is lost, as the network may lose any: the protocol copes)."""
        if self.closing:
            return False
        try:
            frame = self.session.send(msg, re=0)
            self.writer.write(frame)
        except (ConnectionError, OSError, RuntimeError):
            return False
        self.server.stats["pushes"] += 1
        return True

    async def run(self) -> None:
        server = self.server
        loop = asyncio.get_running_loop()
        self.last_input = loop.time()
        # One timer per connection, moved lazily (``_idle_check``), not a timeout per read.
        self.idle_timer = loop.call_at(self.last_input + server.idle_timeout_ms / 1000, self._idle_check)
        accepted_at = server._accepted_at.pop(self.reader, self.last_input)  # under TLS: before its handshake
        self.handshake_timer = loop.call_at(accepted_at + server.limits.handshake_timeout_ms / 1000, self._handshake_check)
        try:
            while True:
                # While closing, keep reading (and discarding) until the peer closes or the
                # linger timer aborts the transport (``fail``): closing a socket with unread
                # input sends a reset, which can destroy our final Error before the peer reads
                # it (a "lingering close").
                data = await self.reader.read(READ_CHUNK_BYTES)
                if not data:
                    return  # the peer closed, or the linger time is up
                if self.closing:
                    continue  # discarded: nothing after a final Error is processed
                try:
                    received = self.session.receive_data(data)
                except PeerViolation as violation:
                    server.stats["peer_violations"] += 1
                    log.info("peer violation from %s: %s", self.peer, violation)
                    self.fail(violation.code, violation.detail)
                    continue
                # Progress is whole frames, not bytes: a peer that trickles a frame does not keep
                # its connection alive (``_frame_check``).
                if received:
                    self.last_input = loop.time()
                    if not self.authenticated and self.session.tenant is not None and not self._authenticated():
                        continue
                self._watch_frame(loop, bool(received))
                answered = False  # replies written from this loop: drain once below
                for r in received:
                    if r.final:
                        log.info("peer %s closed with %s: %s", self.peer, r.msg.code, r.msg.text)
                        return
                    server.stats["requests"] += 1
                    if server.answer_ping and type(r.msg) is Ping:
                        self.reply(Pong(r.msg.nonce), r.seq)
                        answered = True
                        continue
                    pending = None
                    if server.handler_now is not None:
                        reply = self.handle_now(r)
                        if self.closing:
                            break  # the handler found a violation: nothing after it is processed
                        if isinstance(reply, asyncio.Future):
                            pending = reply  # answered once it resolves, as a handler task's
                        elif reply is not DEFER:
                            self.reply(reply, r.seq)
                            answered = True
                            continue
                    await self.slots.acquire()  # back-pressure: stop reading while full
                    if self.closing:
                        self.slots.release()
                        if pending is not None:
                            pending.cancel()
                        break
                    task = asyncio.create_task(self.handle(r, pending))
                    self.handlers.add(task)
                    task.add_done_callback(self.handlers.discard)
                if answered:
                    await self.writer.drain()  # a peer that never reads cannot grow our buffer
        except (ConnectionError, OSError) as e:
            log.info("connection from %s lost: %s", self.peer, e)
        finally:
            self.closing = True
            for callback in self.on_close:
                try:
                    callback(self)
                except Exception:
                    log.exception("on_close callback failed")
            for timer in (self.idle_timer, self.handshake_timer, self.frame_timer):
                if timer is not None:
                    timer.cancel()
            self.server._unauthenticated.pop(self, None)
            await _close_writer(self.writer)
            if self.linger_timer is not None:
                self.linger_timer.cancel()

    async def _drained(self) -> bool:
        """Wait until what we wrote has left (below the transport's high-water mark); a peer that
        does not take it within ``frame_grace_ms`` plus its size at ``min_transfer_bytes_per_s``
        does not read its replies: the connection fails. ``False`` if it is gone."""
        if self.closing:
            return False
        limits = self.server.limits
        pending = self.writer.transport.get_write_buffer_size()
        try:
            async with asyncio.timeout(limits.frame_grace_ms / 1000 + pending / limits.min_transfer_bytes_per_s):
                await self.writer.drain()
        except TimeoutError:
            self.server.stats["slow_readers"] += 1
            self.fail(ERROR_IDLE, "the peer did not read its replies in time (below the minimum transfer rate)")
            return False
        except (ConnectionError, OSError):
            return False
        return not self.closing

    def _authenticated(self) -> bool:
        """The connection's first frame authenticated: it counts against its tenant's quota now,
        not against the unauthenticated; ``False`` if the quota is full (the connection fails)."""
        self.authenticated = True
        server = self.server
        server._unauthenticated.pop(self, None)
        if self.handshake_timer is not None:
            self.handshake_timer.cancel()
        tenant = self.session.tenant
        assert tenant is not None
        count = server._per_tenant.get(tenant, 0) + 1
        server._per_tenant[tenant] = count
        self.on_close.append(lambda conn: server._tenant_closed(tenant))
        if count > server.limits.max_connections_per_tenant:
            server.stats["refused_tenant_quota"] += 1
            self.fail(ERROR_BUSY, f"more than {server.limits.max_connections_per_tenant} connections of tenant {tenant!r}")
            return False
        return True

    def _handshake_check(self) -> None:
        if not self.closing and not self.authenticated:
            self.server.stats["handshake_timeouts"] += 1
            self.fail(ERROR_IDLE, f"no authenticated frame within {self.server.limits.handshake_timeout_ms} ms")

    def _watch_frame(self, loop: asyncio.AbstractEventLoop, new_frame: bool) -> None:
        """Time the frame partly received, if any: one begun since the last whole frame gets
        ``frame_grace_ms`` plus its length at ``min_transfer_bytes_per_s`` (the grace alone
        while its length header is not whole; re-timed from its start once it is)."""
        pending = self.session.pending_frame_bytes
        if pending is None:
            if self.frame_timer is not None:
                self.frame_timer.cancel()
                self.frame_timer = None
            return
        if self.frame_timer is not None and not new_frame and (self.frame_length or not pending):
            return  # the same frame, still on its way: its deadline stands
        if self.frame_timer is not None:
            self.frame_timer.cancel()
        if self.frame_timer is None or new_frame:
            self.frame_started = loop.time()
        limits = self.server.limits
        self.frame_length = pending
        deadline = self.frame_started + limits.frame_grace_ms / 1000 + pending / limits.min_transfer_bytes_per_s
        self.frame_timer = loop.call_at(deadline, self._frame_check)

    def _frame_check(self) -> None:
        self.frame_timer = None
        if not self.closing and self.session.pending_frame_bytes is not None:
            self.server.stats["slow_frames"] += 1
            self.fail(ERROR_IDLE, "a frame did not arrive whole in time (below the minimum transfer rate)")

    def _idle_check(self) -> None:
        """The idle timer: nothing received and nothing in flight for ``idle_timeout_ms`` ends the
        connection with ``Error("idle")``; input since moves the timer on, and a connection still
        busy with a request is looked at again a full period later."""
        if self.closing:
            return
        loop = asyncio.get_running_loop()
        idle_s = self.server.idle_timeout_ms / 1000
        now = loop.time()
        if now < self.last_input + idle_s:
            self.idle_timer = loop.call_at(self.last_input + idle_s, self._idle_check)
        elif self.handlers:
            self.idle_timer = loop.call_at(now + idle_s, self._idle_check)  # busy, not idle
        else:
            self.fail(ERROR_IDLE, f"nothing received for {self.server.idle_timeout_ms} ms")

    def fail(self, code: str, detail: str) -> None:
        """Send a final Error and half-close; ``run`` then discards input until the peer closes
        (or ``CLOSE_TIMEOUT_MS``) and closes. Nothing more is processed or answered."""
        if self.closing:
            return
        self.closing = True
        loop = asyncio.get_running_loop()
        with contextlib.suppress(ProtocolViolation, ConnectionError, OSError, RuntimeError):
            self.writer.write(self.session.send_error(code, detail))
            if self.writer.can_write_eof():
                self.writer.write_eof()  # the peer reads our Error, then EOF
        # However ``run`` is waiting (maybe on a long idle read), the connection ends by then.
        self.linger_timer = loop.call_later(CLOSE_TIMEOUT_MS / 1000, self.writer.transport.abort)

    def reply(self, msg: Any, re: int) -> None:
        if self.closing:
            return  # the connection is going away; the peer will see ConnectionFailed
        try:
            frame = self.session.send(msg, re=re)
        except ProtocolViolation as e:
            log.error("invalid reply %r: %s", msg, e)
            self.server.stats["handler_errors"] += 1
            frame = self.session.send(Error(ERROR_INTERNAL, "the server built an invalid reply"), re=re)
        # send() and write() with no await between: frames leave in seq order.
        self.writer.write(frame)

    def handle_now(self, r: Received) -> Any:
        """``server.handler_now`` on one request: its reply, ``DEFER``, or (after a violation,
        the connection failing) ``DEFER`` with ``closing`` set. Outcomes as in ``handle``."""
        server = self.server
        handler_now = server.handler_now
        assert handler_now is not None and self.session.tenant is not None
        token = current_connection.set(self)
        try:
            return handler_now(self.session.tenant, r.msg)
        except PeerViolation as violation:
            server.stats["peer_violations"] += 1
            log.info("handler found a peer violation from %s: %s", self.peer, violation)
            self.fail(violation.code, violation.detail)
            return DEFER
        except Exception:
            log.exception("handler failed on %s", kind_of(r.msg))
            server.stats["handler_errors"] += 1
            return Error(ERROR_INTERNAL, f"the server failed on {kind_of(r.msg)}")
        finally:
            current_connection.reset(token)

    async def handle(self, r: Received, pending: asyncio.Future | None = None) -> None:
        """Run ``server.handler`` on one request (or wait for ``pending``, the future of the reply
        ``handler_now`` answered with) within the request timeout, and write its reply."""
        server = self.server
        try:
            current_connection.set(self)  # copied into the handler's context
            task = pending if pending is not None else asyncio.create_task(server.handler(self.session.tenant, r.msg))
            try:
                done, _ = await asyncio.wait({task}, timeout=server.request_timeout_ms / 1000)
            except asyncio.CancelledError:
                task.cancel()  # the server is closing: the handler goes too
                raise
            if not done:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                server.stats["timeouts"] += 1
                reply: Any = Error(ERROR_TIMEOUT, f"{kind_of(r.msg)} not answered within {server.request_timeout_ms} ms")
            else:
                try:
                    reply = task.result()
                except PeerViolation as violation:
                    server.stats["peer_violations"] += 1
                    log.info("handler found a peer violation from %s: %s", self.peer, violation)
                    self.fail(violation.code, violation.detail)
                    return
                except Exception:
                    log.exception("handler failed on %s", kind_of(r.msg))
                    server.stats["handler_errors"] += 1
                    reply = Error(ERROR_INTERNAL, f"the server failed on {kind_of(r.msg)}")
            # One reply at a time, each written only once the one before has left (drain: below
            # the transport's high-water mark): a peer that never reads holds at most one reply
            # in our buffer, not one per request in flight -- and is dropped once it has not
            # taken it within the frame deadline (``_drained``).
            async with self.write_lock:
                if await self._drained():
                    self.reply(reply, r.seq)
            await self._drained()
        finally:
            self.slots.release()


class Server:
    """``Server(handler, tenants, *, host="127.0.0.1", port=0, ..., limits=None, tls=None)``;
    ``await server.start()`` (or ``async with``), then ``server.port`` is the bound port; ``await
    server.close()`` stops listening, sends each connection a final ``Error("shutdown")``, cancels
    connections and running handlers, and returns when they are gone. ``tls``: a ``TlsConfig``
    (on: every connection under TLS; off: plaintext, anywhere); ``None``: plaintext, on loopback
    only (``start`` raises ``TlsRequired`` beyond it)."""

    def __init__(
        self,
        handler: Handler,
        tenants: Tenants | Mapping[str, bytes],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_connections: int | None = None,
        request_timeout_ms: int = SERVER_REQUEST_TIMEOUT_MS_DEFAULT,
        idle_timeout_ms: int = IDLE_TIMEOUT_MS_DEFAULT,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        max_in_flight_per_connection: int = MAX_IN_FLIGHT_PER_CONNECTION_DEFAULT,
        answer_ping: bool = True,
        handler_now: ImmediateHandler | None = None,
        limits: ServerLimits | None = None,
        tls: TlsConfig | None = None,
    ) -> None:
        self.limits = limits if limits is not None else ServerLimits()
        self.tls = tls  # None: plaintext, and only on loopback (``check_listen``)
        if max_connections is not None:
            self.limits = attrs.evolve(self.limits, max_connections=max_connections)
        assert request_timeout_ms > 0 and idle_timeout_ms > 0
        assert 0 < max_frame_bytes <= MAX_FRAME_BYTES and max_in_flight_per_connection > 0
        self.handler = handler
        self.handler_now = handler_now
        self.tenants = tenants if isinstance(tenants, Tenants) else Tenants(tenants)
        self.host = host
        self._port = port
        self.max_connections = self.limits.max_connections
        self.request_timeout_ms = request_timeout_ms
        self.idle_timeout_ms = idle_timeout_ms
        self.max_frame_bytes = max_frame_bytes
        self.max_in_flight_per_connection = max_in_flight_per_connection
        self.answer_ping = answer_ping
        self.stats = {"connections": 0, "refused_busy": 0, "requests": 0, "peer_violations": 0,
                      "handler_errors": 0, "timeouts": 0, "pushes": 0, "handshake_timeouts": 0,
                      "evicted_unauthenticated": 0, "refused_tenant_quota": 0, "slow_frames": 0, "slow_readers": 0,
                      "tls_handshake_failures": 0}  # fmt: skip
        self._unauthenticated: dict[_ServerConnection, None] = {}  # oldest first
        self._per_tenant: dict[str, int] = {}  # authenticated connections per tenant
        self._server: asyncio.base_events.Server | None = None
        self._connections: dict[asyncio.Task, _ServerConnection] = {}
        self._orphans: set[asyncio.Task] = set()  # handlers still running after their connection ended
        self._closing = False
        # Under TLS (``_accept``): the listening sockets, their accept loops, the connections still
        # in their TLS handshake (oldest first), and when each connection was accepted (its
        # handshake deadline runs from then).
        self._listeners: list[socket.socket] = []
        self._acceptors: list[asyncio.Task] = []
        self._handshaking: dict[asyncio.Task, None] = {}
        self._accepted_at: weakref.WeakKeyDictionary[asyncio.StreamReader, float] = weakref.WeakKeyDictionary()

    @property
    def port(self) -> int:
        assert self._server is not None or self._listeners, "start() first"
        return self._port

    @property
    def connection_count(self) -> int:
        return len(self._connections)

    async def start(self) -> Server:
        """Listen. Raises ``TlsRequired`` (beyond loopback without TLS), ``TlsConfigError`` (the
        TLS files), ``OSError`` (the address) -- before anything listens."""
        check_listen(self.host, self.tls)
        ctx = _tls_context(self.tls, "server")
        if ctx is None:
            self._server = await asyncio.start_server(self._on_connect, self.host, self._port, limit=READ_CHUNK_BYTES)
            self._port = self._server.sockets[0].getsockname()[1]
            return self
        # Under TLS we accept ourselves (``asyncio.start_server(ssl=...)`` would run handshakes
        # we cannot see: they would hold no slot and could not be closed to make room).
        self._listeners = await _listen(self.host, self._port)
        self._port = self._listeners[0].getsockname()[1]
        self._acceptors = [asyncio.create_task(self._accept(sock, ctx)) for sock in self._listeners]
        return self

    async def _accept(self, sock: socket.socket, ctx: ssl.SSLContext) -> None:
        """Accept TLS connections on ``sock``: each handshake is a task that counts as a connection
        not authenticated yet (one more than ``max_unauthenticated`` closes the oldest handshake,
        else the oldest connection waiting to authenticate), and must end by the handshake deadline.
        A connection whose handshake succeeded goes on as a plaintext one does (``_on_connect``)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as e:  # out of descriptors, say: the listener itself stays
                if self._closing:
                    return
                log.warning("accept on %s failed: %s", self.host, e)
                await asyncio.sleep(ACCEPT_RETRY_MS / 1000)
                continue
            if self._closing:
                conn.close()
                continue
            if len(self._handshaking) + len(self._unauthenticated) >= self.limits.max_unauthenticated:
                self.stats["evicted_unauthenticated"] += 1
                if self._handshaking:
                    oldest_handshake = next(iter(self._handshaking))
                    del self._handshaking[oldest_handshake]  # gone now, though its task ends later
                    oldest_handshake.cancel()  # closes its socket
                else:
                    oldest = next(iter(self._unauthenticated))
                    self._unauthenticated.pop(oldest)
                    oldest.fail(ERROR_BUSY, f"more than {self.limits.max_unauthenticated} connections not authenticated")
            task = asyncio.create_task(self._handshake(conn, ctx, loop.time()))
            self._handshaking[task] = None
            task.add_done_callback(self._handshake_done)

    def _handshake_done(self, task: asyncio.Task) -> None:
        self._handshaking.pop(task, None)

    async def _handshake(self, conn: socket.socket, ctx: ssl.SSLContext, accepted_at: float) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=READ_CHUNK_BYTES, loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader, self._on_connect, loop=loop)
        self._accepted_at[reader] = accepted_at
        deadline_s = self.limits.handshake_timeout_ms / 1000
        peer = None
        with contextlib.suppress(OSError):
            peer = conn.getpeername()
        try:
            async with asyncio.timeout(deadline_s):
                # The loop's own handshake timeout is only a backstop; the transport owns ``conn``
                # from here, and closes it if the handshake fails or is cancelled.
                await loop.connect_accepted_socket(lambda: protocol, conn, ssl=ctx,
                                                   ssl_handshake_timeout=deadline_s + CLOSE_TIMEOUT_MS / 1000)  # fmt: skip
        except TimeoutError:
            self.stats["handshake_timeouts"] += 1
            log.info("TLS handshake from %s not done within %d ms", peer, self.limits.handshake_timeout_ms)
        except asyncio.CancelledError:
            pass  # closed to make room for a newer connection, or the server is closing
        except (OSError, ssl.SSLError) as e:
            # A plaintext client, an untrusted or missing client certificate, a peer gone: the
            # peer sees the TLS alert or the close; nothing of it reached a handler.
            self.stats["tls_handshake_failures"] += 1
            log.info("TLS handshake from %s failed: %s", peer, e)

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Connections already failed (lingering for their last frames) hold no slot.
        if self._closing or sum(not c.closing for c in self._connections.values()) >= self.max_connections:
            self.stats["refused_busy"] += 1
            refusal = Session.server(self.tenants).send_error(
                ERROR_SHUTDOWN if self._closing else ERROR_BUSY,
                "the server is closing" if self._closing else f"more than {self.max_connections} connections",
            )
            with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                writer.write(refusal)
                if writer.can_write_eof():
                    writer.write_eof()
                async with asyncio.timeout(CLOSE_TIMEOUT_MS / 1000):
                    while await reader.read(READ_CHUNK_BYTES):
                        pass  # lingering close, as in _ServerConnection.run
            await _close_writer(writer)
            return
        task = asyncio.current_task()
        assert task is not None
        conn = _ServerConnection(self, reader, writer)
        self._connections[task] = conn
        if len(self._unauthenticated) >= self.limits.max_unauthenticated:
            oldest = next(iter(self._unauthenticated))
            self._unauthenticated.pop(oldest)
            self.stats["evicted_unauthenticated"] += 1
            oldest.fail(ERROR_BUSY, f"more than {self.limits.max_unauthenticated} connections not authenticated")
        self._unauthenticated[conn] = None
        self.stats["connections"] += 1
        try:
            await conn.run()
        except asyncio.CancelledError:
            if not self._closing:
                raise
            # close() cancelled a connection that did not end by itself: that is the shutdown
            # asked for, not an error (asyncio would log a cancelled connection task).
        finally:
            self._connections.pop(task, None)
            # Handlers left running after the connection ended finish on their own (their
            # replies are dropped); close() cancels them.
            for t in conn.handlers:
                if not t.done():
                    self._orphans.add(t)
                    t.add_done_callback(self._orphans.discard)

    def _tenant_closed(self, tenant: str) -> None:
        left = self._per_tenant.get(tenant, 0) - 1
        if left > 0:
            self._per_tenant[tenant] = left
        else:
            self._per_tenant.pop(tenant, None)

    async def close(self) -> None:
        self._closing = True
        if self._server is not None:
            self._server.close()
        # (A handshake closed to make room is out of ``_handshaking`` already, and ends by itself.)
        for t in (*self._acceptors, *self._handshaking):
            t.cancel()
        await asyncio.gather(*self._acceptors, *self._handshaking, return_exceptions=True)
        for sock in self._listeners:
            sock.close()
        tasks = list(self._connections)
        handlers = [t for conn in self._connections.values() for t in conn.handlers]
        handlers += list(self._orphans)
        for t in handlers:
            t.cancel()
        for conn in self._connections.values():
            conn.fail(ERROR_SHUTDOWN, "the server is closing")  # its reader sees EOF and ends
        await asyncio.gather(*handlers, return_exceptions=True)
        if tasks:
            _, stragglers = await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT_MS / 1000)
            for t in stragglers:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CLOSE_TIMEOUT_MS / 1000):
                    await self._server.wait_closed()

    async def __aenter__(self) -> Server:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# -- client ----------------------------------------------------------------------------------------


class _ClientConnection:
    def __init__(self, client: Client, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.client = client
        self.reader = reader
        self.writer = writer
        self.session = Session.client(client.tenant, client.token, max_frame_bytes=client.max_frame_bytes)
        self.pending: dict[int, asyncio.Future] = {}
        self.failure: ConnectionFailed | None = None
        self.received = False  # any bytes from the server on this connection
        self.reader_task = asyncio.create_task(self.read_loop())

    def _eof_detail(self) -> str:
        return "the server closed the connection" + self._unanswered_hint()

    def lost(self, e: OSError) -> ConnectionFailed:
        return ConnectionFailed(f"connection lost: {e}{self._unanswered_hint()}", code="reset")

    def _unanswered_hint(self) -> str:
        if self.received:
            return ""
        # Closed before a byte came back: a TLS server closes a plaintext client so (it cannot
        # read its frames), and a mutual-TLS server a client whose certificate it refused.
        hint = "it went away, or it is serving TLS and this client is not" if self.client.tls is None else (
            "it went away, or it refused this client's certificate")  # fmt: skip
        return f" before answering ({hint})"

    async def read_loop(self) -> None:
        try:
            while True:
                data = await self.reader.read(READ_CHUNK_BYTES)
                if not data:
                    self.fail(ConnectionFailed(self._eof_detail(), code="eof"))
                    return
                self.received = True
                try:
                    received = self.session.receive_data(data)
                except PeerViolation as violation:
                    log.warning("server %s:%s broke the protocol: %s", self.client.host, self.client.port, violation)
                    with contextlib.suppress(ProtocolViolation, ConnectionError, OSError, RuntimeError):
                        self.writer.write(self.session.send_error(violation.code, violation.detail))
                    self.fail(ConnectionFailed(f"the server broke the protocol: {violation.detail}", code=violation.code))
                    return
                for r in received:
                    if r.final:
                        self.fail(ConnectionFailed(f"the server ended the connection: {r.msg.text}", code=r.msg.code))
                        return
                    if r.re == 0 and self.client.on_push is not None:
                        self.client.stats["pushes"] += 1
                        self.client.on_push(r.msg)
                        continue
                    future = self.pending.pop(r.re, None)
                    if future is None or future.done():
                        # An answer to a request that timed out (or an unsolicited push, which
                        # this client does not take): stale, not a violation.
                        self.client.stats["stale_replies"] += 1
                        continue
                    future.set_result(r.msg)
        except ssl.SSLError as e:
            # Under TLS 1.3 the server checks our certificate after our handshake ended: its
            # refusal arrives here, as an alert.
            where = f"{self.client.host}:{self.client.port}"
            self.fail(ConnectionFailed(f"the server at {where} ended the TLS session: {_tls_reason(e)}", code=ERROR_CODE_TLS))
        except (ConnectionError, OSError) as e:
            self.fail(self.lost(e))
        except asyncio.CancelledError:
            self.fail(ConnectionFailed("the client closed the connection", code="closed"))
            raise
        finally:
            self.writer.close()

    def fail(self, error: ConnectionFailed) -> None:
        if self.failure is None:
            self.failure = error
        for future in self.pending.values():
            if not future.done():
                future.set_exception(self.error())
        self.pending.clear()

    def error(self) -> ConnectionFailed:
        """A fresh exception per failed request (one instance raised in many tasks would tangle
        their tracebacks)."""
        assert self.failure is not None
        return ConnectionFailed(self.failure.detail, code=self.failure.code)


def _tls_reason(e: ssl.SSLError) -> str:
    """What a TLS failure says, without the C source location (``(_ssl.c:1006)``)."""
    if isinstance(e, ssl.SSLCertVerificationError):
        return f"the server's certificate is not trusted: {e.verify_message} (check the deployment's tls ca)"
    if e.reason == "WRONG_VERSION_NUMBER":
        return "the server did not answer in TLS (wrong version number): is it serving plaintext?"
    return e.reason.replace("_", " ").lower() if e.reason else str(e)


def _forget(future: asyncio.Future) -> None:
    """Retrieve an answer no one waits for (so a failed one is not logged as never retrieved)."""
    if not future.cancelled():
        future.exception()


class Client:
    """``Client(host, port, tenant, token, *, timeout_ms=..., connect_timeout_ms=...,
    max_frame_bytes=..., max_in_flight=..., on_push=None, tls=None)``. ``await request(msg,
    timeout_ms=None) -> reply``; ``await ping()`` -> round-trip seconds; ``await close()``; also an
    async context manager. ``tls``: a ``TlsConfig`` that is on connects under TLS.

    Raises from ``request``: ``TimeoutError_`` (the request, or the connect, took too long),
    ``ConnectionFailed`` (could not connect; the connection broke or was ended by the server while
    the request was outstanding, ``code`` saying why -- ``"tls"`` when the TLS handshake or session
    failed; or the server broke the protocol, ``code`` being that violation's code),
    ``ProtocolViolation`` (``msg`` is not a valid message). The constructor raises
    ``TlsConfigError`` (the TLS files).
    """

    def __init__(
        self,
        host: str,
        port: int,
        tenant: str,
        token: bytes,
        *,
        timeout_ms: int = CLIENT_REQUEST_TIMEOUT_MS_DEFAULT,
        connect_timeout_ms: int = CONNECT_TIMEOUT_MS_DEFAULT,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        max_in_flight: int = MAX_IN_FLIGHT_PER_CONNECTION_DEFAULT,
        on_push: Callable[[Any], None] | None = None,
        tls: TlsConfig | None = None,
    ) -> None:
        assert timeout_ms > 0 and connect_timeout_ms > 0 and max_in_flight > 0
        Session.client(tenant, token)  # validates tenant and token now, not at first use
        self.tls = tls if tls is not None and tls.on else None  # None: plaintext
        self._ssl = _tls_context(self.tls, "client")  # its files read now, not at first use
        self.host = host
        self.port = port
        self.tenant = tenant
        self.token = token
        self.timeout_ms = timeout_ms
        self.connect_timeout_ms = connect_timeout_ms
        self.max_frame_bytes = max_frame_bytes
        self.max_in_flight = max_in_flight
        self.on_push = on_push  # called (in the read loop: must not block) with each pushed message
        self.stats = {"connects": 0, "requests": 0, "timeouts": 0, "stale_replies": 0, "pushes": 0}
        self._conn: _ClientConnection | None = None
        self._connect_lock = asyncio.Lock()
        self._slots = asyncio.Semaphore(max_in_flight)
        self._closed = False

    @property
    def connected(self) -> bool:
        return self._conn is not None and self._conn.failure is None

    async def connect(self) -> None:
        """Connect now (``request`` does it on demand)."""
        await self._connection()

    async def _connection(self) -> _ClientConnection:
        conn = self._conn
        if conn is not None and conn.failure is None and conn.session.keyed:
            return conn
        async with self._connect_lock:
            conn = self._conn
            if conn is not None and conn.failure is None and conn.session.keyed:
                return conn
            if self._closed:
                raise ConnectionFailed("the client is closed", code="closed")
            where = f"{self.host}:{self.port}"
            try:
                async with asyncio.timeout(self.connect_timeout_ms / 1000):
                    if self.tls is None:
                        reader, writer = await asyncio.open_connection(self.host, self.port, limit=READ_CHUNK_BYTES)
                    else:
                        reader, writer = await asyncio.open_connection(
                            self.host, self.port, limit=READ_CHUNK_BYTES, ssl=self._ssl,
                            server_hostname=self.tls.server_hostname(self.host),
                            ssl_handshake_timeout=self.connect_timeout_ms / 1000)  # fmt: skip
            except TimeoutError:
                raise TimeoutError_(f"connect to {where}", self.connect_timeout_ms) from None
            except ssl.SSLError as e:
                raise ConnectionFailed(f"TLS handshake with {where} failed: {_tls_reason(e)}", code=ERROR_CODE_TLS) from e
            except OSError as e:
                if self.tls is not None and isinstance(e, ConnectionError) and not isinstance(e, ConnectionRefusedError):
                    raise ConnectionFailed(f"TLS handshake with {where} failed: the server closed the connection "
                                           f"({e or type(e).__name__}; is it serving TLS?)", code=ERROR_CODE_TLS) from e  # fmt: skip
                raise ConnectionFailed(f"connect to {where}: {e}", code="refused") from e
            conn = self._conn = _ClientConnection(self, reader, writer)
            self.stats["connects"] += 1
            # Every connection opens with a Ping: it authenticates the session before anything
            # larger than MAX_UNAUTHENTICATED_FRAME_BYTES (a block) may follow, and its Pong --
            # the server's first frame -- brings the server's nonce: every later frame is keyed
            # by both nonces (the session key), so nothing else may leave before it is back.
            opening = asyncio.get_running_loop().create_future()
            opening.add_done_callback(_forget)
            frame = conn.session.send(Ping(0))
            conn.pending[conn.session.last_sent_seq] = opening
            writer.write(frame)
            try:
                async with asyncio.timeout(self.connect_timeout_ms / 1000):
                    await asyncio.shield(opening)
            except TimeoutError:
                conn.fail(ConnectionFailed(f"{where} did not answer the opening Ping", code="timeout"))
                conn.reader_task.cancel()  # and the socket closes
                raise TimeoutError_(f"the opening Ping to {where}", self.connect_timeout_ms) from None
            return conn

    async def request(self, msg: Any, *, timeout_ms: int | None = None) -> Any:
        check_message(msg)  # our bug, before anything is sent
        if timeout_ms is None:
            timeout_ms = self.timeout_ms
        kind = kind_of(msg)
        self.stats["requests"] += 1
        try:
            async with asyncio.timeout(timeout_ms / 1000):
                async with self._slots:
                    conn = await self._connection()
                    future = asyncio.get_running_loop().create_future()
                    frame = conn.session.send(msg)
                    seq = conn.session.last_sent_seq
                    conn.pending[seq] = future
                    try:
                        conn.writer.write(frame)
                        await conn.writer.drain()
                        return await future
                    except (ConnectionError, OSError) as e:
                        conn.fail(conn.lost(e))
                        raise conn.error() from None
                    finally:
                        conn.pending.pop(seq, None)
        except TimeoutError_:
            raise
        except TimeoutError:
            self.stats["timeouts"] += 1
            raise TimeoutError_(f"{kind} request to {self.host}:{self.port}", timeout_ms) from None

    async def ping(self, nonce: int = 0, *, timeout_ms: int | None = None) -> float:
        """One Ping round trip; returns its duration in seconds."""
        start = time.perf_counter()
        reply = await self.request(Ping(nonce), timeout_ms=timeout_ms)
        if type(reply) is not Pong or reply.nonce != nonce:
            raise ConnectionFailed(f"Ping answered with {reply!r}", code="unexpected_reply")
        return time.perf_counter() - start

    async def close(self) -> None:
        self._closed = True
        conn = self._conn
        if conn is not None:
            conn.reader_task.cancel()
            with contextlib.suppress(BaseException):
                await conn.reader_task
            await _close_writer(conn.writer)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
