"""Sessions: frames authenticated per tenant and per connection, numbered per direction, in order.
No I/O.

A payload is the canonical CBOR map ``{"tenant", "seq", "re", "mac", "body"}``, and the first frame
of each direction also carries ``"nonce"`` (see the package's theory of operation for the MACs,
the session key and the order of the checks). ``Session`` holds one connection's state in both
directions; the first ``PeerViolation`` closes it for good.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import hmac
import os
from collections.abc import Mapping
from typing import Any

from attrs import frozen

from kvcc.spec.keys import CborError, cbor_decode, cbor_encode, cbor_head

from ..errors import Malformed, PeerViolation, ProtocolViolation, Replayed, Unauthorized, detached
from .codec import decode, encode, flat_map
from .frames import FrameDecoder, encode_frame
from .limits import (
    MAX_FRAME_BYTES,
    MAX_TEXT_BYTES,
    MAX_UNAUTHENTICATED_FRAME_BYTES,
    MAX_WIRE_INT,
    MIN_TOKEN_BYTES,
    SESSION_NONCE_BYTES,
)
from .messages import Error, Ping
from .tenants import Tenants, tenant_problem

class Role(enum.Enum):
    CLIENT = "client"
    SERVER = "server"


_DIRECTION = {Role.CLIENT: "c2s", Role.SERVER: "s2c"}  # the direction a role *sends* in
_PEER = {Role.CLIENT: Role.SERVER, Role.SERVER: Role.CLIENT}
_ENVELOPE_FIELDS = frozenset({"tenant", "seq", "re", "mac", "body"})
_FIRST_ENVELOPE_FIELDS = _ENVELOPE_FIELDS | {"nonce"}  # a direction's first frame
_SESSION_KEY_LABEL = b"kvcc session key\x00"


def frame_mac(key: bytes, direction: str, tenant: str, seq: int, re: int, body: bytes, nonce: bytes | None = None) -> bytes:
    """HMAC-SHA256(key, canonical CBOR [direction, tenant, seq, re, body]) -- with ``nonce``
    appended to the array for a direction's first frame, keyed by the tenant's token; every later
    frame is keyed by the session key -- streamed so that a 64 MiB body is not copied."""
    return _MacKey(key).mac(direction, tenant, seq, re, body, nonce)


def session_key(token: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """The key of every frame after the first of each direction:
    HMAC-SHA256(token, "kvcc session key\\0" || client nonce || server nonce). Both nonces are
    fresh per connection, so no frame of one connection verifies on another."""
    return hmac.new(token, _SESSION_KEY_LABEL + client_nonce + server_nonce, hashlib.sha256).digest()


class _MacKey:
    """One token's HMAC state, keyed once and copied per frame (cheaper than re-keying; cheaper
    than ``hmac.digest``'s one-shot too, measured). The CBOR head of ``[direction, tenant`` is the
    same for every frame of a session and is kept."""

    __slots__ = ("_base", "_prefixes")

    def __init__(self, token: bytes) -> None:
        self._base = hmac.new(token, digestmod=hashlib.sha256)
        self._prefixes: dict[tuple[str, str], bytes] = {}

    def mac(self, direction: str, tenant: str, seq: int, re: int, body: bytes, nonce: bytes | None = None) -> bytes:
        if nonce is not None:  # a direction's first frame: [direction, tenant, seq, re, body, nonce]
            h = self._base.copy()
            h.update(b"".join((b"\x86", cbor_encode(direction), cbor_encode(tenant), cbor_head(0, seq), cbor_head(0, re),
                               cbor_head(2, len(body)))))  # fmt: skip
            h.update(body)
            h.update(cbor_head(2, len(nonce)) + nonce)
            return h.digest()
        prefix = self._prefixes.get((direction, tenant))
        if prefix is None:
            prefix = b"\x85" + cbor_encode(direction) + cbor_encode(tenant)
            if len(self._prefixes) < 4:  # a session MACs one tenant in two directions
                self._prefixes[(direction, tenant)] = prefix
        h = self._base.copy()
        h.update(b"".join((prefix, cbor_head(0, seq), cbor_head(0, re), cbor_head(2, len(body)))))
        h.update(body)  # streamed: a 64 MiB body is not copied
        return h.digest()


# The envelope's keys in canonical order (sorted by their encodings: shorter first, then bytewise).
_ENV_RE, _ENV_MAC, _ENV_SEQ, _ENV_BODY, _ENV_NONCE, _ENV_TENANT = (
    cbor_encode(k) for k in ("re", "mac", "seq", "body", "nonce", "tenant"))  # fmt: skip
_ENV_KEYS = [_ENV_RE, _ENV_MAC, _ENV_SEQ, _ENV_BODY, _ENV_NONCE, _ENV_TENANT]
assert _ENV_KEYS == sorted(_ENV_KEYS)


def encode_envelope(tenant: str, seq: int, re: int, mac: bytes, body: bytes, nonce: bytes | None = None) -> bytes:
    """Canonical CBOR of ``{"tenant", "seq", "re", "mac", "body"}`` (and ``"nonce"`` when given),
    built directly (one copy of the body); equal to ``cbor_encode`` of that map (tested)."""
    return b"".join((
        b"\xa5" if nonce is None else b"\xa6",
        _ENV_RE, cbor_head(0, re),
        _ENV_MAC, cbor_head(2, len(mac)), mac,
        _ENV_SEQ, cbor_head(0, seq),
        _ENV_BODY, cbor_head(2, len(body)), body,
        b"" if nonce is None else _ENV_NONCE + cbor_head(2, len(nonce)) + nonce,
        _ENV_TENANT, _tenant_cbor(tenant),
    ))  # fmt: skip


@functools.lru_cache(maxsize=1024)
def _tenant_cbor(tenant: str) -> bytes:
    """``cbor_encode(tenant)``: the same few names on every frame."""
    return cbor_encode(tenant)


@frozen
class Received:
    """One message off the wire, with its envelope: ``seq`` (reply to it with ``re=seq``), ``re``
    (the seq of our frame it answers, 0 for none), and whether it was authenticated (only a
    final unauthenticated ``Error`` is ever yielded with ``authenticated=False``)."""

    msg: Any
    seq: int
    re: int
    tenant: str
    authenticated: bool = True

    @property
    def final(self) -> bool:
        """A final Error: the peer closes the connection after it."""
        return self.re == 0 and type(self.msg) is Error


class Session:
    """One connection's protocol state, both directions, without I/O.

    - ``Session.client(tenant, token)`` / ``Session.server(tenants)``;
    - ``send(msg, re=0) -> bytes``: the frame to write; ``re`` is the ``seq`` of the received
      frame this answers. Raises ``ProtocolViolation`` for an invalid message, a reply to a frame
      never received, a server send before any client frame authenticated, any send after a
      final Error was sent, or after the session failed;
    - ``send_error(code, text) -> bytes``: a final ``Error`` frame (``re = 0``), allowed in any
      state, unauthenticated when no tenant is known yet; nothing may be sent after it;
    - ``receive_data(data) -> list[Received]``: raises ``PeerViolation`` subclasses only; the
      first one closes the session (``failure``) and every later call raises it again.

    A server session accepts no frame above ``MAX_UNAUTHENTICATED_FRAME_BYTES`` until a frame
    authenticated (a larger length header is ``FrameTooLarge`` before its payload is buffered).

    State worth reading: ``tenant`` (None on a server until a frame authenticated),
    ``last_sent_seq`` (the seq of the frame ``send`` just returned: a client files its request
    under it and matches the reply's ``re``), ``last_received_seq``, ``failure``,
    ``peer_closed`` (the peer's final Error arrived), ``sent_final``.
    """

    def __init__(
        self,
        role: Role,
        *,
        tenant: str | None = None,
        token: bytes | None = None,
        tenants: Tenants | Mapping[str, bytes] | None = None,
        max_frame_bytes: int = MAX_FRAME_BYTES,
    ) -> None:
        self.role = role
        self.max_frame_bytes = max_frame_bytes
        # A server takes no frame above MAX_UNAUTHENTICATED_FRAME_BYTES until one authenticated.
        first_limit = max_frame_bytes if role is Role.CLIENT else min(max_frame_bytes, MAX_UNAUTHENTICATED_FRAME_BYTES)
        self._frames = FrameDecoder(first_limit)
        if role is Role.CLIENT:
            assert tenant is not None and token is not None, "a client session has a tenant and a token"
            problem = tenant_problem(tenant)
            if problem:
                raise ValueError(problem)
            if type(token) is not bytes or len(token) < MIN_TOKEN_BYTES:
                raise ValueError(f"a token is at least {MIN_TOKEN_BYTES} bytes")
            self.tenants = Tenants({tenant: token})
            self.tenant: str | None = tenant
        else:
            assert tenants is not None, "a server session has its tenants"
            self.tenants = tenants if isinstance(tenants, Tenants) else Tenants(tenants)
            self.tenant = None  # learned from the first authenticated frame
        self.last_sent_seq = 0
        self.last_received_seq = 0
        self.failure: PeerViolation | None = None
        self.peer_closed = False  # the peer sent its final Error
        self.sent_final = False  # we sent our final Error
        self._mac_tenant: str | None = None
        self._mac_cache: _MacKey | None = None
        # This side's fresh nonce, sent in its first frame; the session key, once both are known
        # (a server knows it from the client's first frame, a client from the server's).
        self.nonce = os.urandom(SESSION_NONCE_BYTES)
        self.peer_nonce: bytes | None = None
        self._session_mac: _MacKey | None = None

    @classmethod
    def client(cls, tenant: str, token: bytes, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> Session:
        return cls(Role.CLIENT, tenant=tenant, token=token, max_frame_bytes=max_frame_bytes)

    @classmethod
    def server(cls, tenants: Tenants | Mapping[str, bytes], *, max_frame_bytes: int = MAX_FRAME_BYTES) -> Session:
        return cls(Role.SERVER, tenants=tenants, max_frame_bytes=max_frame_bytes)

    # -- sending -------------------------------------------------------------------------------

    def send(self, msg: Any, *, re: int = 0) -> bytes:
        if self.failure is not None:
            raise ProtocolViolation(f"send on a failed session ({self.failure.code})")
        if self.sent_final:
            raise ProtocolViolation("send after our final Error")
        if self.tenant is None:
            raise ProtocolViolation("no authenticated tenant yet: a server answers, it does not speak first")
        if type(re) is not int or not 0 <= re <= self.last_received_seq:
            raise ProtocolViolation(f"re={re!r} names no frame received (last {self.last_received_seq})")
        if type(msg) is Error and re == 0:
            raise ProtocolViolation("a final Error goes through send_error")
        return self._seal(encode(msg), re, authenticated=True)

    def send_error(self, code: str, text: str = "") -> bytes:
        """A final Error frame. Text is cut to fit ``MAX_TEXT_BYTES``."""
        if self.sent_final:
            raise ProtocolViolation("a second final Error")
        text = text.encode("utf-8", "replace")[: MAX_TEXT_BYTES].decode("utf-8", "ignore")
        body = encode(Error(code, text))
        self.sent_final = True
        # Signed if it can be: a tenant known, and the session key too unless it is our first frame.
        signable = self.tenant is not None and (self.last_sent_seq == 0 or self._session_mac is not None)
        return self._seal(body, 0, authenticated=signable)

    @property
    def keyed(self) -> bool:
        """Whether the session key is known: frames after our first may be sent."""
        return self._session_mac is not None

    def _seal(self, body: bytes, re: int, *, authenticated: bool) -> bytes:
        if authenticated and self.last_sent_seq and self._session_mac is None:
            raise ProtocolViolation("no session key yet: a client sends its second frame after the server's first")
        self.last_sent_seq += 1
        seq = self.last_sent_seq
        nonce = None
        if authenticated:
            assert self.tenant is not None
            tenant = self.tenant
            if seq == 1:
                nonce = self.nonce
                mac = self._mac_key(tenant).mac(_DIRECTION[self.role], tenant, seq, re, body, nonce)
            else:
                assert self._session_mac is not None
                mac = self._session_mac.mac(_DIRECTION[self.role], tenant, seq, re, body)
        else:
            tenant, mac = "", b""
        return encode_frame(encode_envelope(tenant, seq, re, mac, body, nonce), self.max_frame_bytes)

    def _mac_key(self, tenant: str) -> _MacKey:
        if self._mac_tenant != tenant:
            token = self.tenants.token(tenant)
            assert token is not None
            self._mac_cache = _MacKey(token)
            self._mac_tenant = tenant
        assert self._mac_cache is not None
        return self._mac_cache

    # -- receiving -----------------------------------------------------------------------------

    @property
    def pending_frame_bytes(self) -> int | None:
        """The announced length of the frame partly received (see ``FrameDecoder``)."""
        return self._frames.pending_frame_bytes

    def receive_data(self, data: bytes) -> list[Received]:
        if self.failure is not None:
            raise detached(self.failure)
        try:
            self._frames.add(data)
            out = []
            while (payload := self._frames.next_frame()) is not None:
                if self.peer_closed:
                    raise Malformed("a frame after the peer's final Error")
                out.append(self._open(payload))
            return out
        except PeerViolation as violation:
            # Kept without its traceback (``detached``), and the buffered input let go: a rejected
            # connection must not pin its frames in memory.
            self.failure = detached(violation)
            self._frames.discard()
            raise

    def _open(self, payload: bytes) -> Received:
        env = flat_map(payload, len(_FIRST_ENVELOPE_FIELDS), False) if type(payload) is bytes else None
        if env is None:
            try:
                env = cbor_decode(payload, max_depth=1, max_items=len(_FIRST_ENVELOPE_FIELDS), max_string_bytes=len(payload))
            except CborError as e:
                raise Malformed(f"envelope: {e}") from None
        if type(env) is not dict or env.keys() not in (_ENVELOPE_FIELDS, _FIRST_ENVELOPE_FIELDS):
            raise Malformed(f"an envelope is a map of exactly {sorted(_ENVELOPE_FIELDS)} (and nonce in a first frame)")
        tenant, seq, re, mac, body = env["tenant"], env["seq"], env["re"], env["mac"], env["body"]
        nonce = env.get("nonce")
        if type(tenant) is not str or type(mac) is not bytes or type(body) is not bytes:
            raise Malformed("envelope field of the wrong type")
        if type(seq) is not int or type(re) is not int or not 0 < seq <= MAX_WIRE_INT or not 0 <= re <= MAX_WIRE_INT:
            raise Malformed("envelope seq and re are ints, seq from 1")

        if tenant == "" and mac == b"" and nonce is None:
            return self._open_unauthenticated(seq, re, body)

        # A direction's first frame carries its nonce and is keyed by the token; every later frame
        # is keyed by the session key of both nonces, so no frame of another connection verifies.
        if (seq == 1) != (nonce is not None):
            raise Malformed("a nonce comes in a direction's first frame, and only there")
        if nonce is not None and (type(nonce) is not bytes or len(nonce) != SESSION_NONCE_BYTES):
            raise Malformed(f"a nonce is {SESSION_NONCE_BYTES} bytes")
        token = self.tenants.token(tenant)
        if token is None:
            raise Unauthorized(f"unknown tenant {tenant[:80]!r}")
        if self.tenant is not None and tenant != self.tenant:
            raise Unauthorized(f"tenant {tenant[:80]!r} on a connection of tenant {self.tenant!r}")
        if nonce is not None:
            expected = self._mac_key(tenant).mac(_DIRECTION[_PEER[self.role]], tenant, seq, re, body, nonce)
        elif self._session_mac is None:
            raise Unauthorized(f"frame {seq} of tenant {tenant[:80]!r} before the session was keyed (a frame of "
                               "another connection?)")  # fmt: skip
        else:
            expected = self._session_mac.mac(_DIRECTION[_PEER[self.role]], tenant, seq, re, body)
        if not hmac.compare_digest(expected, mac):
            raise Unauthorized(f"bad MAC on frame {seq} of tenant {tenant[:80]!r}")
        if self.tenant is None:
            self.tenant = tenant
            self._frames.max_frame_bytes = self.max_frame_bytes  # a block may come now
        if seq != self.last_received_seq + 1:
            raise Replayed(f"frame {seq} after frame {self.last_received_seq}", seq=seq, last_seq=self.last_received_seq)
        if re > self.last_sent_seq:
            raise Malformed(f"frame {seq} answers frame {re}, which was never sent")
        msg = decode(body)
        if seq == 1 and self.role is Role.SERVER and type(msg) is not Ping:
            # Only the first frame is keyed by the token alone, and a recording of it could be
            # replayed on a new connection: it must be one whose answer gives nothing away.
            raise Unauthorized(f"a connection opens with a Ping, not {type(msg).__name__}")
        if nonce is not None:
            self.peer_nonce = nonce
            client_nonce, server_nonce = (self.nonce, nonce) if self.role is Role.CLIENT else (nonce, self.nonce)
            self._session_mac = _MacKey(session_key(token, client_nonce, server_nonce))
        self.last_received_seq = seq
        if re == 0 and type(msg) is Error:
            self.peer_closed = True
        return Received(msg, seq=seq, re=re, tenant=tenant, authenticated=True)

    def _open_unauthenticated(self, seq: int, re: int, body: bytes) -> Received:
        if self.role is Role.SERVER:
            raise Unauthorized("unauthenticated frame")
        if re != 0:
            raise Unauthorized("an unauthenticated frame other than a final Error")
        msg = decode(body)
        if type(msg) is not Error:
            raise Unauthorized(f"unauthenticated {type(msg).__name__}")
        self.peer_closed = True
        return Received(msg, seq=seq, re=0, tenant="", authenticated=False)
