"""Tenants: who may connect, with which shared secret, and which namespaces each may use.

A session authenticates every frame under its tenant's token (``session``); the directory then
calls ``Tenants.authorize`` on the namespace a request names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attrs import field, frozen

from kvcc.spec.keys import DIGEST_BYTES

from ..errors import Unauthorized
from .codec import check_digest
from .limits import MAX_TENANT_BYTES, MIN_TOKEN_BYTES

def tenant_problem(name: Any) -> str | None:
    if type(name) is not str or not name:
        return "a tenant name is non-empty text"
    if len(name.encode("utf-8", "surrogatepass")) > MAX_TENANT_BYTES:
        return f"tenant name longer than {MAX_TENANT_BYTES} bytes"
    return None


def _tokens(value: Mapping[str, bytes]) -> dict[str, bytes]:
    out = {}
    for tenant, token in dict(value).items():
        problem = tenant_problem(tenant)
        if problem:
            raise ValueError(problem)
        if type(token) is not bytes or len(token) < MIN_TOKEN_BYTES:
            raise ValueError(f"tenant {tenant!r}: a token is at least {MIN_TOKEN_BYTES} bytes")
        out[tenant] = token
    return out


def _namespaces(value: Mapping[str, Any]) -> dict[str, frozenset[bytes]]:
    out = {}
    for tenant, digests in dict(value).items():
        ds = frozenset(digests)
        if any(check_digest(d) for d in ds):
            raise ValueError(f"tenant {tenant!r}: namespace digests are {DIGEST_BYTES} bytes")
        out[tenant] = ds
    return out


@frozen(eq=False)
class Tenants:
    """Who may connect (``tokens``: tenant -> shared secret, at least ``MIN_TOKEN_BYTES``) and
    which namespaces each may use (``namespaces``: tenant -> namespace digests; a tenant absent
    from it may use none)."""

    tokens: Mapping[str, bytes] = field(converter=_tokens)
    namespaces: Mapping[str, frozenset[bytes]] = field(factory=dict, converter=_namespaces)
    # Tenants that act on every namespace: the cache nodes' own identity (a node evicts and
    # demotes whatever it stores). Never give it to an engine.
    operators: frozenset[str] = field(default=frozenset(), converter=frozenset)

    def token(self, tenant: str) -> bytes | None:
        return self.tokens.get(tenant)

    def allows(self, tenant: str, namespace_digest: bytes) -> bool:
        return tenant in self.operators or namespace_digest in self.namespaces.get(tenant, frozenset())

    def authorize(self, tenant: str, namespace_digest: bytes) -> None:
        """Raise ``Unauthorized`` unless ``tenant`` may use the namespace (protocol property 11)."""
        if not self.allows(tenant, namespace_digest):
            raise Unauthorized(
                f"tenant {tenant[:80]!r} may not use namespace {bytes(namespace_digest).hex()[:16]}…",
                tenant=tenant[:80],
            )

    def authorize_message(self, tenant: str, msg: Any) -> None:
        """``authorize`` the namespace a message names, if it names one."""
        ns = getattr(msg, "namespace", None)
        if ns is not None:
            self.authorize(tenant, ns)
