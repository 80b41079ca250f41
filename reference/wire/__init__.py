"""The wire: messages, their canonical CBOR codec, frames and authenticated sessions. No I/O.

One module per job, each importable on its own; this package re-exports their public names, so
``kvcc.reference.wire.X`` is the one way the rest of kvcc names them:

- ``limits``: every size and count, and the relations between them, asserted at import;
- ``messages``: the message classes and the codes (refusal reasons, scopes, error codes);
- ``codec``: ``check_message``, ``encode``, ``decode``;
- ``frames``: ``encode_frame``, ``FrameDecoder``;
- ``tenants``: ``Tenants``, tokens, namespace authorisation and node credentials;
- ``session``: ``Session``, ``Received``, the MAC and the envelope.

Theory of operation
-------------------
Three layers, each a pure function of bytes in and bytes out (h11-style: the caller owns the
socket, the clock and the event loop; ``kvcc.reference.transport`` is one such caller).

1. **Messages** are frozen attrs values, one class per protocol noun. Their kind names are the
   spec's message names (``spec/layout.py``: ``Acquire`` ... ``Copied``) plus the replies and
   client-facing requests the spec abstracts away. ``encode(msg)`` is the canonical CBOR of
   ``{"kind": <class name>, <field>: <value>, ...}`` (``kvcc.spec.keys.cbor_encode``); block keys
   travel as their 32-byte digests. ``decode(body)`` accepts exactly what ``encode`` produces:
   unknown kind, missing or extra field, wrong type or a value out of range raises ``Malformed``.
   Each field's wire type follows from its annotation (``codec.WIRE_TYPES``), checked at import.

2. **Frames**: ``[4-byte big-endian length][payload]``. ``FrameDecoder`` takes bytes in any
   chunking and returns whole payloads; a length header above its limit raises ``FrameTooLarge``
   before a byte of that frame is buffered. Limits: ``MAX_FRAME_BYTES`` (64 MiB of block data
   plus ``MAX_CONTROL_FRAME_BYTES`` of headroom) for connections that carry block bytes (nodes,
   locations); ``MAX_CONTROL_FRAME_BYTES`` (4 MiB, enough for a ``Lookup`` of the longest prompt)
   for connections that carry only control messages (the directory) -- the receiver chooses. A
   server takes nothing above ``MAX_UNAUTHENTICATED_FRAME_BYTES`` (64 KiB) before a frame of the
   connection authenticated: clients open each connection with a ``Ping``.

3. **Sessions** authenticate frames per tenant and per connection. A payload is the canonical
   CBOR map ``{"tenant", "seq", "re", "mac", "body"}``: ``body`` is an encoded message, ``seq``
   numbers the frames of one connection and direction from 1 with no gaps, ``re`` is the ``seq``
   of the peer's frame this one answers (0: answers nothing). The first frame of each direction
   also carries ``"nonce"``, 16 fresh random bytes, and is keyed by the token:

       mac = HMAC-SHA256(tenant token, canonical CBOR [direction, tenant, 1, re, body, nonce])

   and every later frame, both ways, by the session key of both nonces:

       key = HMAC-SHA256(tenant token, "kvcc session key\\0" || client nonce || server nonce)
       mac = HMAC-SHA256(key, canonical CBOR [direction, tenant, seq, re, body])

   A client's first frame must be a ``Ping`` (a server refuses any other as ``Unauthorized``),
   and a client sends nothing more until the server's first frame (its ``Pong``) brought the
   server's nonce (``Session.keyed``). So no frame of one connection verifies on another: a
   recorded conversation replayed on a new connection gets its ``Pong`` and nothing else.

   with ``direction`` = ``"c2s"`` or ``"s2c"``. The design brief's MAC covers ``[tenant, seq,
   body]``; ``re`` is added because replies are pipelined and must name their request, and the
   direction because one token serves both directions, so a frame reflected back to its sender
   must not verify. Checks, in order: a well-formed envelope (else ``Malformed``), a known tenant,
   the same tenant as earlier frames on this connection and a MAC that verifies in constant time
   (else ``Unauthorized``), ``seq`` exactly one above the last (else ``Replayed``: a replayed,
   reordered or deleted frame), ``re`` naming a frame we sent, then the body (``Malformed``).

   The first ``PeerViolation`` closes the session for good: ``receive_data`` raises it again on
   any later input and changes nothing (h11's invariant: garbage only ever produces the peer's
   error, never another exception, never a message after it). A chunk of input that contains a
   violation yields nothing, not even the good frames before it: the connection is being torn
   down and their answers could not be sent anyway.

   An ``Error`` frame with ``re == 0`` is *final*: its sender closes the connection after it. A
   server that fails a connection before it knows the tenant (garbage, unknown tenant, bad MAC,
   too many connections) cannot sign, so it sends its final ``Error`` unauthenticated (tenant
   ``""``, empty MAC); a client accepts an unauthenticated frame only if it is such a final Error.
   Forging one can only close a connection, which anyone on the path can do with a TCP reset.

   Known limit: the MAC authenticates frames, it does not hide them, and a recorded opening
   ``Ping`` can be replayed (it is answered with a ``Pong``, nothing more). Run over TLS (or a
   tunnel) where the network is not trusted.

``Tenants`` holds each tenant's token and the namespace digests it may use; ``authorize`` raises
``Unauthorized`` for any other namespace (protocol property 11). The directory calls it. It also
holds the node credentials, each bound to one node id (``node_credential``): the directory takes a
node's messages only under that node's own credential, and no client request under one (issue 14);
and the operator credentials (``operator_credential``), which invalidate and look up in every
namespace and do nothing else.
"""

from __future__ import annotations

from .codec import check_message, decode, encode
from .frames import FrameDecoder, encode_frame
from .limits import (
    FRAME_HEADER_BYTES,
    HEARTBEAT_INTERVAL_MS,
    MAC_BYTES,
    MAX_BATCH_DATA_BYTES,
    MAX_BATCH_ITEMS,
    MAX_BLOCK_BYTES,
    MAX_CODE_BYTES,
    MAX_CONTROL_FRAME_BYTES,
    MAX_FRAME_BYTES,
    MAX_ID_BYTES,
    MAX_LOOKUP_KEYS,
    MAX_MESSAGE_FIELDS,
    MAX_TENANT_BYTES,
    MAX_TEXT_BYTES,
    MAX_UNAUTHENTICATED_FRAME_BYTES,
    MAX_WAIT_TICKET_MS,
    MAX_WIRE_INT,
    MIN_TOKEN_BYTES,
    SESSION_NONCE_BYTES,
)
from .messages import (
    BATCH_DIRECTORY_KINDS,
    BATCH_NODE_KINDS,
    CODE_RE,
    ERROR_BUSY,
    ERROR_IDLE,
    ERROR_INTERNAL,
    ERROR_SHUTDOWN,
    ERROR_TIMEOUT,
    MESSAGE_TYPES,
    SPEC_MESSAGES,
    Acquire,
    Batch,
    Batched,
    BeginWrite,
    BytesRead,
    BytesStored,
    Code,
    Commit,
    CommitRejected,
    Committed,
    Copied,
    Copy,
    CopyFailed,
    Error,
    Evict,
    Evicted,
    EvictRefused,
    Fenced,
    Free,
    Freed,
    Hello,
    Invalidate,
    InvalidationCompleted,
    InvalidationPending,
    InvalidationStarted,
    LeaseRefused,
    LeaseReleased,
    LeaseRenewed,
    ListNodes,
    Located,
    Locate,
    Lost,
    Lookup,
    Message,
    NodeList,
    Noted,
    Ping,
    Pong,
    PrefixFound,
    ReadBytes,
    ReadLeaseGranted,
    ReadRefused,
    Release,
    Renew,
    Revoke,
    RevokeAcked,
    Transfer,
    TransferRefused,
    TransferStarted,
    WaitTicket,
    Welcome,
    WriteBytes,
    WriteLeaseGranted,
    kind_of,
)
from .session import Received, Role, Session, encode_envelope, frame_mac, session_key
from .tenants import NODE_CREDENTIAL_PREFIX, OPERATOR_CREDENTIAL_PREFIX, Tenants, node_credential, operator_credential
