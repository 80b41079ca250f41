"""The wire's messages: one frozen class per protocol noun, and the codes their fields carry.

Kind names are the spec's message names (``spec/layout.py``: ``Acquire`` ... ``Copied``) plus the
replies and client-facing requests the spec abstracts away. Every field's annotation names its wire
type (``codec``), checked at import. No behaviour here beyond ``kind_of``: encoding and checking
are the codec's.
"""

from __future__ import annotations

import re
from typing import Any, NewType, Union

from attrs import frozen

from kvcc.spec.keys import BlockKey, Epoch, Generation, LeaseId, LocationId, NamespaceDigest, NodeId

from ..errors import ProtocolViolation
from .limits import MAX_CODE_BYTES

# -- vocabulary of codes ------------------------------------------------------------------------------

Code = NewType("Code", str)  # a stable machine-readable word: [a-z][a-z0-9_]*, at most 64 bytes
CODE_RE = re.compile(rf"[a-z][a-z0-9_]{{0,{MAX_CODE_BYTES - 1}}}")
# Refusal reasons and Invalidate.scope are the protocol's words (``kvcc.spec.vocabulary``). Servers
# may use other reasons that fit ``Code``; those are the ones the spec's refusals name.

# Error.code values sent by the transport itself (PeerViolation codes are also used verbatim).
ERROR_BUSY = "busy"  # too many connections
ERROR_IDLE = "idle"  # closed after the idle timeout
ERROR_TIMEOUT = "timeout"  # the handler did not answer within the request timeout
ERROR_INTERNAL = "internal"  # the handler failed: a bug on the server's side
ERROR_SHUTDOWN = "shutdown"  # the server is closing

# -- messages ----------------------------------------------------------------------------------------
#
# Field order and names follow spec/layout.py's message tuples where the spec has the message.
# ``node`` is the node a request comes from, or the node a reply or directive is addressed to;
# ``location`` names one tier of one node (or the shared pool). Lease terms travel as durations:
# clocks differ, so a holder counts ``term_ms`` from when it *sent* its request and stops trusting
# at ``term_ms - epsilon`` on its own clock (docs/protocol.md: leases); the directory keeps the lease live
# for ``term_ms + epsilon`` on its clock from the grant.


# Read leases: node <-> directory (M_ACQUIRE, M_RENEW, M_GRANT_READ, M_RENEWED, M_RELEASE).
@frozen
class Acquire:
    """Ask for a read lease on ``key``; ``request`` is a fresh number the answer echoes."""

    node: NodeId
    key: BlockKey
    namespace: NamespaceDigest
    request: int


@frozen
class Renew:
    node: NodeId
    key: BlockKey
    lease: LeaseId
    location: LocationId
    request: int


@frozen
class ReadLeaseGranted:
    node: NodeId
    key: BlockKey
    lease: LeaseId
    location: LocationId
    gen: Generation
    epoch: Epoch
    term_ms: int
    request: int
    grant: bytes = b""  # the directory's data-plane grant (wire/grants.py); b"": none


@frozen
class LeaseRenewed:
    node: NodeId
    key: BlockKey
    lease: LeaseId
    term_ms: int
    request: int
    grant: bytes = b""  # the directory's data-plane grant (wire/grants.py); b"": none


@frozen
class LeaseRefused:
    """Answer to Acquire, Renew or BeginWrite: no lease, and why (``REASON_*``)."""

    node: NodeId
    key: BlockKey
    request: int
    reason: Code


@frozen
class Release:
    node: NodeId
    key: BlockKey
    lease: LeaseId


@frozen
class LeaseReleased:
    node: NodeId
    key: BlockKey
    lease: LeaseId


# Writes (M_BEGIN_WRITE, M_GRANT_WRITE, M_WRITE_BYTES, M_COMMIT).
@frozen
class BeginWrite:
    """Ask for the write lease of ``key`` (ABSENT, its ``parent`` COMMITTED, or None at the root)."""

    node: NodeId
    key: BlockKey
    namespace: NamespaceDigest
    parent: BlockKey | None
    request: int


@frozen
class WriteLeaseGranted:
    node: NodeId
    key: BlockKey
    lease: LeaseId
    location: LocationId
    gen: Generation
    epoch: Epoch
    term_ms: int
    request: int
    grant: bytes = b""  # the directory's data-plane grant (wire/grants.py); b"": none


@frozen
class WriteBytes:
    """Writer -> location: the block's bytes, tagged with the epoch the location fences on."""

    node: NodeId
    key: BlockKey
    lease: LeaseId
    location: LocationId
    gen: Generation
    epoch: Epoch
    data: bytes
    grant: bytes = b""  # the directory's data-plane grant (wire/grants.py); b"": none


@frozen
class BytesStored:
    location: LocationId
    key: BlockKey
    gen: Generation
    epoch: Epoch


@frozen
class Commit:
    node: NodeId
    key: BlockKey
    lease: LeaseId
    gen: Generation
    epoch: Epoch


@frozen
class Committed:
    node: NodeId
    key: BlockKey
    lease: LeaseId
    gen: Generation
    epoch: Epoch


@frozen
class CommitRejected:
    node: NodeId
    key: BlockKey
    lease: LeaseId
    reason: Code


# Revocation (M_REVOKE, M_ACK).
@frozen
class Revoke:
    """Directory -> holder: drop your copy and trust in ``lease``, then acknowledge."""

    node: NodeId
    key: BlockKey
    lease: LeaseId
    gen: Generation


@frozen
class RevokeAcked:
    node: NodeId
    key: BlockKey
    lease: LeaseId


# The data plane at a location (M_FREE, M_COPY, M_COPIED) and remote reads.
@frozen
class Free:
    """Directory -> location: drop the key's block unless the location's fence is above
    ``epoch``; then acknowledge with ``Freed``. Sent again until acknowledged."""

    location: LocationId
    key: BlockKey
    epoch: Epoch


@frozen
class Freed:
    """Location -> directory (one-way, answered ``Noted``): the ``Free`` under ``epoch`` was
    carried out -- the block is gone, was not there, or the fence showed a later epoch there
    (whose bytes are not this free's to drop)."""

    location: LocationId
    key: BlockKey
    epoch: Epoch


@frozen
class Copy:
    """Directory -> destination location: copy generation ``gen`` from ``source``, under ``epoch``."""

    location: LocationId
    key: BlockKey
    source: LocationId
    gen: Generation
    epoch: Epoch


@frozen
class Copied:
    location: LocationId
    key: BlockKey
    epoch: Epoch


@frozen
class Lost:
    """A location's node -> directory: a read under a grant found no valid bytes of generation
    ``gen`` of ``key`` at ``location`` (gone, or failing its checksum). If that copy is the
    generation's owner, the directory voids the key (docs/protocol.md §8, a lost copy); otherwise
    it ignores the report. One-way (answered ``Noted``)."""

    node: NodeId
    key: BlockKey
    location: LocationId
    gen: Generation


@frozen
class CopyFailed:
    location: LocationId
    key: BlockKey
    reason: Code


@frozen
class Fenced:
    """A location refused WriteBytes, Free or Copy: ``epoch`` is below its ``fence``."""

    location: LocationId
    key: BlockKey
    epoch: Epoch
    fence: Epoch


@frozen
class ReadBytes:
    """Holder -> location: the bytes of ``gen``, under read lease ``lease``."""

    node: NodeId
    key: BlockKey
    lease: LeaseId
    location: LocationId
    gen: Generation
    grant: bytes = b""  # the directory's data-plane grant (wire/grants.py); b"": none


@frozen
class BytesRead:
    location: LocationId
    key: BlockKey
    gen: Generation
    epoch: Epoch
    data: bytes


@frozen
class ReadRefused:
    node: NodeId
    key: BlockKey
    location: LocationId
    reason: Code


# Client-facing: lookup, invalidation, eviction.
@frozen
class Lookup:
    """Longest cached prefix: ``keys`` are a prompt's chain keys, root first."""

    namespace: NamespaceDigest
    keys: tuple[BlockKey, ...]


@frozen
class PrefixFound:
    """The first ``blocks_matched`` keys are COMMITTED; ``locations[i]`` owns key ``i``."""

    namespace: NamespaceDigest
    blocks_matched: int
    locations: tuple[LocationId, ...]


@frozen
class Locate:
    """Which of ``keys`` does this directory hold a record of, in any phase and any namespace? A
    sharded directory's client asks every shard at once about a key it has never seen (a key not
    a root: ``Lookup`` walks a chain from its root, so it finds no child alone; docs/sharding.md),
    and sends the request where the key's record is, which decides it as the one directory would
    -- also a request naming the key under another namespace, which must be refused there, not
    granted by a shard that never saw the key. Read-only: no lease, no event, nothing changes.
    ``namespace``: one the tenant may use; any other is told nothing but that (``Located``)."""

    namespace: NamespaceDigest
    keys: tuple[BlockKey, ...]


@frozen
class Located:
    """``known[i]``: 2 if this directory holds a record of ``keys[i]`` of the ``Locate`` in the
    ``Locate``'s namespace, 1 if it holds one in another namespace, 0 if none. (A digest is the
    client's to choose: another tenant may have made a record of it in another shard, and the
    key's own shard is the one with its record in this namespace.) ``authorized``: 1 if the tenant
    may use the ``Locate``'s namespace; 0: it may not, and ``known`` is all zeros (a request there
    is refused ``unauthorized`` by any directory, the client's own answer)."""

    namespace: NamespaceDigest
    known: tuple[int, ...]
    authorized: int


@frozen
class Invalidate:
    """Void a generation: ``scope`` is ``"key"`` or ``"prefix"`` (with ``key``) or
    ``"namespace"`` (``key`` None). Answered at once by InvalidationStarted."""

    namespace: NamespaceDigest
    scope: Code
    key: BlockKey | None


@frozen
class InvalidationStarted:
    """``keys``: how many keys the invalidation voided (0: nothing was cached under the scope)."""

    ticket: int
    keys: int


@frozen
class WaitTicket:
    """Wait up to ``timeout_ms`` (at most ``MAX_WAIT_TICKET_MS``) for an invalidation."""

    ticket: int
    timeout_ms: int


@frozen
class InvalidationCompleted:
    ticket: int


@frozen
class InvalidationPending:
    ticket: int


@frozen
class Evict:
    """Node -> directory: may I drop my copy of ``key`` at ``location``?"""

    node: NodeId
    key: BlockKey
    location: LocationId


@frozen
class Evicted:
    node: NodeId
    key: BlockKey
    location: LocationId


@frozen
class EvictRefused:
    node: NodeId
    key: BlockKey
    location: LocationId
    reason: Code


# Membership and tiering: node/client <-> directory.
@frozen
class Hello:
    """Node or client -> directory, first on every connection: who is on this connection (the
    directory pushes the directives for ``node`` -- ``Revoke``, ``Free``, ``Copy`` -- on it), its
    ``incarnation`` (higher after every restart), where its data server listens (``address``
    "host:port", "" for a client without one), the ``locations`` it serves and those of them that
    came back empty after a restart (``lost``)."""

    node: NodeId
    incarnation: int
    address: str
    locations: tuple[LocationId, ...]
    lost: tuple[LocationId, ...]


@frozen
class Welcome:
    """Directory -> a node that said Hello. After a restart (a new ``incarnation``) it carries the
    fences the node must restore: for every key owned at (or moving to) one of its locations, the
    key's epoch, which bounds every epoch ever issued for it (``rules.restored_fence``).
    ``term_ms`` is the lease term the directory grants: a holder knows its budget before its first
    grant, so it gives up a request no later than the budget (the spec's pending timer)."""

    node: NodeId
    incarnation: int
    fence_keys: tuple[BlockKey, ...]
    fence_epochs: tuple[int, ...]
    term_ms: int


@frozen
class ListNodes:
    nonce: int


@frozen
class NodeList:
    """The nodes that said Hello with a data address, and those addresses ("host:port")."""

    nodes: tuple[NodeId, ...]
    addresses: tuple[NodeId, ...]


@frozen
class Transfer:
    """Node -> directory: move the owner copy of ``key`` -- generation ``gen``, at ``source`` --
    to ``destination`` (promotion or demotion between tiers: an ownership transfer under
    ``epoch + 1``). Refused (``not_found``) unless that generation is the key's, owned at
    ``source``: a node whose view is stale (the key rewritten, or moved, since it looked) moves
    nothing it did not mean to."""

    node: NodeId
    key: BlockKey
    gen: Generation
    source: LocationId
    destination: LocationId


@frozen
class TransferStarted:
    key: BlockKey
    destination: LocationId
    epoch: Epoch


@frozen
class TransferRefused:
    key: BlockKey
    destination: LocationId
    reason: Code


@frozen
class Noted:
    """The directory took a one-way message (``RevokeAcked``, ``Copied``, ``Freed``): the
    transport answers every request, and this answer says only that it arrived."""

    what: Code


# Batches (issue 13: a serving engine asks about whole chains, not single blocks).
@frozen
class Batch:
    """Many requests in one frame, answered by one ``Batched`` whose ``replies[i]`` answers
    ``items[i]``. The receiver takes the items in order, each exactly as if it had come alone --
    its own checks, its own spec step and events, its own reply -- so a batch adds no protocol
    step: the spec's per-key rules hold for every item. It first checks that it takes every
    item (a kind it batches, sent under a credential that may send it): one it does not take
    refuses the whole batch, before any item changes state. Which kinds: the directory takes
    ``BATCH_DIRECTORY_KINDS``, a node ``BATCH_NODE_KINDS``; never a ``Batch``."""

    items: tuple[Message, ...]


@frozen
class Batched:
    replies: tuple[Message, ...]


# Generic.
@frozen
class Error:
    """Something failed. As a reply (``re`` > 0) it answers one request; with ``re == 0`` it is
    final: the sender closes the connection after it."""

    code: Code
    text: str


@frozen
class Ping:
    nonce: int


@frozen
class Pong:
    nonce: int


_ALL = (
    Acquire, Renew, ReadLeaseGranted, LeaseRenewed, LeaseRefused, Release, LeaseReleased,
    BeginWrite, WriteLeaseGranted, WriteBytes, BytesStored, Commit, Committed, CommitRejected,
    Revoke, RevokeAcked,
    Free, Freed, Copy, Copied, Lost, CopyFailed, Fenced, ReadBytes, BytesRead, ReadRefused,
    Lookup, PrefixFound, Locate, Located, Invalidate, InvalidationStarted, WaitTicket, InvalidationCompleted,
    InvalidationPending, Evict, Evicted, EvictRefused,
    Hello, Welcome, ListNodes, NodeList, Transfer, TransferStarted, TransferRefused, Noted,
    Batch, Batched, Error, Ping, Pong,
)  # fmt: skip

Message = Union[_ALL]  # type: ignore[valid-type]
MESSAGE_TYPES: dict[str, type] = {cls.__name__: cls for cls in _ALL}
# The messages the spec models (spec/layout.py MESSAGE_NAMES), by the same names.
SPEC_MESSAGES = (
    "Acquire", "Renew", "ReadLeaseGranted", "LeaseRenewed", "Release", "BeginWrite",
    "WriteLeaseGranted", "WriteBytes", "Commit", "Revoke", "RevokeAcked", "Free", "Copy", "Copied",
    "LeaseRefused", "Freed",
)  # fmt: skip
assert set(SPEC_MESSAGES) <= set(MESSAGE_TYPES)
# What a Batch may hold: at the directory, lease requests, commits and lookups (a chain's leases
# taken, renewed and given back, many writes begun or committed, many prefixes looked up, in one
# round trip); at a node, reads and writes (many blocks' bytes in one round trip).
BATCH_DIRECTORY_KINDS = (Acquire, Renew, Release, BeginWrite, Commit, Lookup)
BATCH_NODE_KINDS = (ReadBytes, WriteBytes)


def kind_of(msg: Any) -> str:
    """The wire kind name of a message (its class name); ``ProtocolViolation`` for a non-message."""
    name = type(msg).__name__
    if MESSAGE_TYPES.get(name) is not type(msg):
        raise ProtocolViolation(f"not a wire message: {type(msg).__name__}")
    return name
