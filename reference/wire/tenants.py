"""Credentials: who may connect, with which shared secret, and what each may do.

A session authenticates every frame under its credential's token (``session``: the envelope's
``tenant`` field names the credential). There are two kinds (issue 14):

- a **tenant** credential is a client's: it may use the namespaces ``namespaces`` gives it (every
  namespace for an ``operators`` tenant), and the directory calls ``Tenants.authorize`` on the
  namespace a request names. It may register only as a *client* (a ``Hello`` with no address, no
  locations, nothing lost) and never under a cache node's id;
- a **node** credential (``nodes``: credential name -> node id, named ``node_credential(node)``)
  is one cache node's: the directory takes a node's messages -- its ``Hello`` (address, locations,
  lost locations), ``Freed``, ``Copied``, ``Transfer``, its own ``Evict`` -- only under the
  credential bound to that very node, and only about that node's own locations. A node credential
  is never a client: the directory refuses it every client request (leases, writes, lookups,
  invalidations), and a node's data server does not accept it at all (``without_nodes``).

- an **operator** credential (``operator_names``: credential name -> operator name, named
  ``operator_credential(name)``) is a person's or a tool's that runs the deployment: it may
  invalidate and look up in every namespace (a model's blocks voided across tenants, what is
  cached where) and list the nodes, and nothing else -- it holds no lease, writes nothing, is no
  node, and a node's data server does not accept it (no bytes). ``Tenants.may_operate`` says
  which requests; the directory refuses the rest before any state changes.

A deployment that names no node credential (``nodes`` empty: the deployment files before issue 14,
whose nodes share one ``operators`` tenant) keeps the old rule for that shared credential: it may
act as any node (``shared_node_credential``). Tenants still may not.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from attrs import field, frozen

from kvcc.spec.keys import DIGEST_BYTES

from ..errors import Unauthorized
from .codec import check_digest
from .limits import MAX_TENANT_BYTES, MIN_TOKEN_BYTES
from .messages import Hello, Invalidate, ListNodes, Locate, Lookup, WaitTicket

def tenant_problem(name: Any) -> str | None:
    if type(name) is not str or not name:
        return "a tenant name is non-empty text"
    if len(name.encode("utf-8", "surrogatepass")) > MAX_TENANT_BYTES:
        return f"tenant name longer than {MAX_TENANT_BYTES} bytes"
    return None


# What an operator credential may ask the directory (``Tenants.may_operate``).
OPERATOR_REQUESTS = (Hello, Invalidate, WaitTicket, Lookup, Locate, ListNodes)

NODE_CREDENTIAL_PREFIX = "node:"  # a node's credential is named "node:<node id>"


def node_credential(node_id: str) -> str:
    """The name of ``node_id``'s own credential (the envelope's ``tenant`` field on its frames)."""
    return f"{NODE_CREDENTIAL_PREFIX}{node_id}"


OPERATOR_CREDENTIAL_PREFIX = "operator:"  # an operator's credential is named "operator:<name>"


def operator_credential(name: str) -> str:
    """The name of operator ``name``'s credential (the envelope's ``tenant`` field on its frames)."""
    return f"{OPERATOR_CREDENTIAL_PREFIX}{name}"


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


def _names(what: str) -> Callable[[Mapping[str, str]], dict[str, str]]:
    def convert(value: Mapping[str, str]) -> dict[str, str]:
        out = {}
        for credential, name in dict(value).items():
            if type(name) is not str or not name:
                raise ValueError(f"credential {credential!r}: {what} is non-empty text")
            out[credential] = name
        return out

    return convert


@frozen(eq=False)
class Tenants:
    """Who may connect (``tokens``: tenant -> shared secret, at least ``MIN_TOKEN_BYTES``) and
    which namespaces each may use (``namespaces``: tenant -> namespace digests; a tenant absent
    from it may use none)."""

    tokens: Mapping[str, bytes] = field(converter=_tokens)
    namespaces: Mapping[str, frozenset[bytes]] = field(factory=dict, converter=_namespaces)
    # Tenants that act on every namespace. Before node credentials (``nodes`` empty) the cache
    # nodes' shared identity was one, and acts as any node still. Never give it to an engine.
    operators: frozenset[str] = field(default=frozenset(), converter=frozenset)
    # Node credentials: credential name -> the one node id it may act as (its token is in
    # ``tokens``). Not tenants: no namespaces, not operators.
    nodes: Mapping[str, str] = field(factory=dict, converter=_names("a node id"))
    # Operator credentials: credential name -> operator name (its token is in ``tokens``). Not
    # tenants, not nodes: ``may_operate`` says what they may ask.
    operator_names: Mapping[str, str] = field(factory=dict, converter=_names("an operator name"))

    def __attrs_post_init__(self) -> None:
        for credential in self.nodes:
            if credential not in self.tokens:
                raise ValueError(f"node credential {credential!r} has no token")
            if credential in self.namespaces or credential in self.operators:
                raise ValueError(f"{credential!r} is a node credential: it has no namespaces and is no operator")
        for credential in self.operator_names:
            if credential not in self.tokens:
                raise ValueError(f"operator credential {credential!r} has no token")
            if credential in self.namespaces or credential in self.operators or credential in self.nodes:
                raise ValueError(f"{credential!r} is an operator credential: no tenant's, no node's")

    def token(self, tenant: str) -> bytes | None:
        return self.tokens.get(tenant)

    def node_of(self, credential: str) -> str | None:
        """The node ``credential`` is bound to, or ``None`` for a tenant's."""
        return self.nodes.get(credential)

    def operator_of(self, credential: str) -> str | None:
        """The operator ``credential`` is, or ``None`` for a tenant's or a node's."""
        return self.operator_names.get(credential)

    @staticmethod
    def may_operate(msg: Any) -> bool:
        """What an operator credential may ask the directory: invalidate and wait for it, look up,
        list the nodes, and say ``Hello`` as a client (the directory checks that it is one)."""
        return type(msg) in OPERATOR_REQUESTS

    def shared_node_credential(self, credential: str) -> bool:
        """A deployment without node credentials: its ``operators`` act as any node (the rule
        before issue 14, kept for those files; nodes are not told apart there)."""
        return not self.nodes and credential in self.operators

    def is_node_id(self, node_id: str) -> bool:
        """``node_id`` is a node's that has a credential of its own: no tenant may use it."""
        return node_id in self.nodes.values()

    def without_nodes(self) -> Tenants:
        """The tenants alone: what a node's data server accepts (nodes do not dial each other;
        operators read and write no bytes)."""
        if not self.nodes and not self.operator_names:
            return self
        return Tenants({t: k for t, k in self.tokens.items() if t not in self.nodes and t not in self.operator_names},
                       self.namespaces, operators=self.operators)  # fmt: skip

    def allows(self, tenant: str, namespace_digest: bytes) -> bool:
        # A node stores, evicts, demotes and frees every tenant's blocks; what else it may send is
        # the directory server's to refuse (it refuses a node credential every client request).
        if tenant in self.nodes or tenant in self.operator_names:
            return True  # what a node or an operator may send at all is the directory's to refuse
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
