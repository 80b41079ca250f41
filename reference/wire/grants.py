"""Data-plane grants: what a cache node checks before it serves or stores a block's bytes. No I/O.

The directory decides who may read or write a block (a read lease, a write lease); the bytes move
between the holder and the location's node, which used to serve and store them for any tenant
with a valid token (issue 14: one tenant read another's committed block at a node, then overwrote
it). Now every lease the directory grants carries a **grant**, a capability the node can check
without asking anyone:

    grant = expires_ms (8 bytes, big-endian) || HMAC-SHA256(a node's grant key, canonical CBOR
            [kind, tenant, key digest, gen, epoch, location, lease, expires_ms]) || ...

``kind`` is ``"read"`` (``epoch`` 0: a read names no epoch) or ``"write"``; ``tenant`` is the
credential the lease was granted to, and the node compares it with the credential of the session
the request came on, so a grant is worth nothing to another tenant; ``expires_ms`` is the
directory's wall clock (ms since the epoch) at the grant plus the term plus epsilon -- when the
directory stops holding the lease live -- and a node accepts a read grant until ``expires_ms +
epsilon`` on its own wall clock (clocks within epsilon: the spec's assumption). A renewal brings a
new grant. A write grant is judged by its epoch instead, which it binds: the location's fence
refuses a late writer's bytes (the spec's ``fence_stale_write``, a step the trace shows), so time
adds nothing there, and a write grant does not run out.

The **grant keys** are the nodes', never a tenant's: a node's is HMAC-SHA256 of its own credential's
token (the directory holds every node's token, a node only its own), so a node can check the
grants of its own locations and forge none of another node's. A grant of the shared pool, which any
node serves, carries one MAC per node (in the order of their ids). In a deployment whose nodes share
an ``operators`` credential (the older form) there is one key, of that token.

What it does not do: a node does not learn that a lease was released or revoked before it ran
out, so a holder that stopped trusting it could still read until ``expires_ms + epsilon`` -- its
own tenant's bytes of a generation it was granted; and the fences of protocol property 2 still
refuse a write under a stale epoch.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable, Sequence

from kvcc.spec.keys import cbor_encode

from .tenants import Tenants

GRANT_EXPIRY_BYTES = 8
GRANT_MAC_BYTES = 32
GRANT_READ, GRANT_WRITE = "read", "write"
SHARED = ""  # the one key of a deployment whose nodes share a credential
_LABEL = b"kvcc data-plane grant key\x00"


def _key(token: bytes, node_id: str) -> bytes:
    return hmac.new(token, _LABEL + node_id.encode(), hashlib.sha256).digest()


def grant_keys(tenants: Tenants) -> dict[str, bytes]:
    """The directory's: node id -> that node's grant key (``SHARED`` -> the one key, when the
    nodes share an ``operators`` credential); empty when there are no node secrets."""
    if tenants.nodes:
        return {node: _key(tenants.tokens[credential], node) for credential, node in tenants.nodes.items()}
    shared = sorted(tenants.tokens[t] for t in tenants.operators)
    return {SHARED: _key(shared[0], SHARED)} if shared else {}


def node_grant_key(tenants: Tenants, credential: str, node_id: str) -> bytes | None:
    """A node's own grant key, from the credential it connects to the directory with (its own,
    or the older form's shared one); ``None`` if that credential is neither."""
    token = tenants.token(credential)
    if token is None:
        return None
    if tenants.node_of(credential) == node_id:
        return _key(token, node_id)
    if tenants.shared_node_credential(credential):
        return _key(sorted(tenants.tokens[t] for t in tenants.operators)[0], SHARED)
    return None


def _mac(key: bytes, kind: str, tenant: str, digest: bytes, gen: int, epoch: int, location: str, lease: int,
         expires_ms: int) -> bytes:  # fmt: skip
    return hmac.new(key, cbor_encode([kind, tenant, digest, gen, epoch, location, lease, expires_ms]),
                    hashlib.sha256).digest()  # fmt: skip


def sign_grant(keys: Sequence[bytes], kind: str, tenant: str, digest: bytes, gen: int, epoch: int, location: str,
               lease: int, expires_ms: int) -> bytes:  # fmt: skip
    """A grant checkable by each node whose key is in ``keys`` (one: a node's location; every
    node's: the shared pool)."""
    return expires_ms.to_bytes(GRANT_EXPIRY_BYTES, "big") + b"".join(
        _mac(k, kind, tenant, digest, gen, epoch, location, lease, expires_ms) for k in keys)  # fmt: skip


class Grants:
    """A node's check of data-plane grants under its own key: ``Grants(key, skew_ms,
    wall_ms=...)``; ``problem(grant, kind, tenant, key digest, gen, epoch, location, lease) -> str |
    None``: why the node must refuse the request, or ``None``."""

    def __init__(self, key: bytes, skew_ms: int, *, wall_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000) -> None:
        self.key = key
        self.skew_ms = skew_ms
        self.wall_ms = wall_ms

    def problem(self, grant: bytes, kind: str, tenant: str, digest: bytes, gen: int, epoch: int, location: str,
                lease: int) -> str | None:  # fmt: skip
        macs = len(grant) - GRANT_EXPIRY_BYTES
        if macs <= 0 or macs % GRANT_MAC_BYTES:
            return "no grant from the directory for this block"
        expires_ms = int.from_bytes(grant[:GRANT_EXPIRY_BYTES], "big")
        expected = _mac(self.key, kind, tenant, digest, gen, epoch, location, lease, expires_ms)
        found = False
        for at in range(GRANT_EXPIRY_BYTES, len(grant), GRANT_MAC_BYTES):
            found |= hmac.compare_digest(expected, grant[at : at + GRANT_MAC_BYTES])
        if not found:
            return f"the grant is not the directory's {kind} grant of this block, location and lease to tenant {tenant!r}"
        if kind == GRANT_READ and self.wall_ms() > expires_ms + self.skew_ms:
            return "the grant ran out"
        return None
