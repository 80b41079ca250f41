"""Model configurations: the finite scope the checker explores.

A configuration fixes how many nodes, keys and locations exist, the lease term and the clock-skew
bound in ticks, and the budgets that keep the state space finite (epochs, lease ids, faults,
messages in flight). Every budget is a *scope bound*, in the TLC sense of a state constraint:
behaviours that would exceed it are not explored. The manifest (``manifest.json``) pins the
distinct-state count and verdict each configuration must produce.
"""

from __future__ import annotations

import json
from importlib import resources

from attrs import field, frozen

# Bytes encode the model state, so every value the state holds must stay below this bound.
STATE_VALUE_LIMIT = 256


@frozen
class ModelConfig:
    """The scope of one model-checking run.

    ``parents[k]`` is the parent key of key ``k`` (-1 for a root): a prefix chain or tree.
    ``namespaces[k]`` is the namespace of key ``k``; ``authorized[n]`` the namespaces node ``n``'s
    tenant may use. Locations are ``tiers_per_node`` local tiers on each node, then (if
    ``shared_pool``) one shared-pool location that every node can write to and that no node crash
    takes down.
    """

    name: str
    nodes: int
    parents: tuple[int, ...]
    namespaces: tuple[int, ...]
    authorized: tuple[frozenset[int], ...]
    tiers_per_node: int = 1
    shared_pool: bool = True
    tiering: bool = False  # ownership transfer between locations (promotion / demotion)
    writes_to_pool_only: bool = False  # new blocks are written to the shared pool, not node tiers
    writers: tuple[int, ...] | None = None  # nodes that write blocks (None: all)
    readers: tuple[int, ...] | None = None  # nodes that take read leases (None: all)
    lease_term_ticks: int = 2
    skew_ticks: int = 1  # epsilon: the bound on clock offsets between any two clocks
    max_epoch: int = 2
    max_lease_id: int = 3
    max_requests: int = 2  # lease requests (acquire or renew) per node
    max_messages: int = 2
    max_duplications: int = 0
    max_node_crashes: int = 1
    max_directory_restarts: int = 1
    symmetry: bool = False
    # The directory's clock may fall behind true time (by at most epsilon in all) instead of
    # running ahead: the direction that is harmless for safety but harmful for progress (a slow
    # directory clock expires leases late), so the bounded-response deadlines are checked under it.
    directory_clock_lags: bool = False
    # The directory mirrors its leases durably (reference: etcd's bucketed lease markers), so a
    # restarted directory waits only until the longest lease it forgot may have run out
    # (``Model.lease_horizon``), not the full ``restart_grace_ticks``.
    mirrored_leases: bool = False
    description: str = ""
    extra: dict = field(factory=dict, eq=False, hash=False)

    def __attrs_post_init__(self) -> None:
        assert self.nodes >= 1
        keys = len(self.parents)
        assert keys >= 1
        assert len(self.namespaces) == keys
        assert len(self.authorized) == self.nodes
        for key, parent in enumerate(self.parents):
            # Parents come first: a key's hash chains over its parent's, so a parent exists earlier.
            assert -1 <= parent < key, (key, parent)
            if parent >= 0:
                assert self.namespaces[parent] == self.namespaces[key], "a chain stays in one namespace"
        assert self.lease_term_ticks > self.skew_ticks >= 0, "a holder must keep a positive budget"
        assert self.tiers_per_node >= 1
        assert self.max_lease_id + 2 < STATE_VALUE_LIMIT
        assert self.max_epoch + 1 < STATE_VALUE_LIMIT
        assert self.locations + 1 < STATE_VALUE_LIMIT
        assert self.directory_lease_ticks + self.skew_ticks < STATE_VALUE_LIMIT
        if self.symmetry:
            assert len(self.symmetric_permutations()) > 1, "symmetry needs two interchangeable nodes"

    @property
    def keys(self) -> int:
        return len(self.parents)

    @property
    def locations(self) -> int:
        return self.nodes * self.tiers_per_node + (1 if self.shared_pool else 0)

    @property
    def pool_location(self) -> int:
        """The shared pool's location id, or -1 when the configuration has none."""
        return self.nodes * self.tiers_per_node if self.shared_pool else -1

    @property
    def holder_budget_ticks(self) -> int:
        """How long a holder trusts a lease, on its own clock, counted from sending the request."""
        return self.lease_term_ticks - self.skew_ticks

    @property
    def directory_lease_ticks(self) -> int:
        """How long the directory treats a lease as live, on its own clock: expiry + epsilon."""
        return self.lease_term_ticks + self.skew_ticks

    @property
    def restart_grace_ticks(self) -> int:
        """How long a restarted directory frees nothing: the longest lease it may have issued,
        plus the skew it may have accumulated on its own clock since."""
        return self.directory_lease_ticks + self.skew_ticks

    @property
    def invalidation_deadline_ticks(self) -> int:
        """Bounded response: an invalidation completes within this many true ticks of starting.

        A live lease lasts at most ``directory_lease_ticks`` on the directory's clock, which is at
        most ``skew_ticks`` behind true time; each directory restart adds a grace period, also
        measured on the directory's clock.
        """
        one_lease = self.directory_lease_ticks + self.skew_ticks
        one_grace = self.restart_grace_ticks + self.skew_ticks
        return one_lease + self.max_directory_restarts * one_grace

    @property
    def failure_detection_ticks(self) -> int:
        """How long, on the directory's clock, the directory may take to declare a crashed node
        down: a node's registration is a lease of one term, which a live node keeps renewing."""
        return self.lease_term_ticks

    @property
    def failover_deadline_ticks(self) -> int:
        """Bounded response (P4): a COMMITTED key whose owner's node crashed is writable again
        within this many true ticks: detection (on a clock that may lag), then an invalidation."""
        return self.failure_detection_ticks + self.skew_ticks + self.invalidation_deadline_ticks

    @property
    def write_lease_deadline_ticks(self) -> int:
        """Bounded response: a write lease ends (commit, abort or expiry) within this many true
        ticks of its grant -- the same terms as an invalidation: a lease as the directory counts
        it, a lagging directory clock, a grace period per directory restart."""
        return self.invalidation_deadline_ticks

    @property
    def request_deadline_ticks(self) -> int:
        """Bounded response: a holder's lease request ends -- granted, refused, or given up by the
        holder's timeout when its request or the answer was lost -- within this many true ticks.
        The timeout is the holder budget on the holder's clock, which may fall epsilon behind."""
        return self.holder_budget_ticks + self.skew_ticks

    @property
    def deletion_deadline_ticks(self) -> int:
        """Bounded response for deletion: how many true ticks a location that is up may hold an
        ended generation's bytes with no Free on its way, while the directory could send one. The
        model's directory retries before time passes (0); a deployment's bound is that plus, per
        lost attempt, its retry interval and message delay."""
        return 0

    def role(self, node: int) -> tuple[bool, bool, frozenset[int]]:
        """What tells a node apart in the model: whether it writes, whether it reads, and the
        namespaces its tenant may use. Two nodes with one role are interchangeable."""
        writes = self.writers is None or node in self.writers
        reads = self.readers is None or node in self.readers
        return writes, reads, self.authorized[node]

    def symmetric_permutations(self) -> tuple[tuple[int, ...], ...]:
        """The node permutations that map every node to one with the same role (the identity
        first): the symmetry group the checker may reduce by."""
        from itertools import permutations

        roles = [self.role(n) for n in range(self.nodes)]
        return tuple(
            perm for perm in permutations(range(self.nodes)) if all(roles[perm[n]] == roles[n] for n in range(self.nodes))
        )

    def children(self, key: int) -> tuple[int, ...]:
        return tuple(k for k, p in enumerate(self.parents) if p == key)

    def descendants(self, key: int) -> tuple[int, ...]:
        """``key`` and every key whose chain passes through it, parents before children."""
        found = [key]
        for k in range(key + 1, self.keys):
            if self.parents[k] in found:
                found.append(k)
        return tuple(found)

    def location_node(self, location: int) -> int:
        """The node a location lives on, or -1 for the shared pool."""
        if location == self.pool_location:
            return -1
        return location // self.tiers_per_node

    def write_targets(self, node: int) -> tuple[int, ...]:
        """Where ``node`` may be told to write a new block: its own tiers or the shared pool."""
        pool = (self.pool_location,) if self.shared_pool else ()
        if self.writes_to_pool_only:
            assert pool, "writes_to_pool_only needs a shared pool"
            return pool
        local = tuple(range(node * self.tiers_per_node, (node + 1) * self.tiers_per_node))
        return local + pool


def _all(nodes: int, namespaces: int = 1) -> tuple[frozenset[int], ...]:
    return tuple(frozenset(range(namespaces)) for _ in range(nodes))


# Scopes are kept small on purpose: each is a few seconds to a minute of exhaustive search in
# CPython. Roles (``writers``, ``readers``) cut the interleavings that only repeat a scenario with
# the nodes swapped, but a property about two nodes in one role (two writers, two holders) cannot
# fail where only one node has that role: ``race``, ``holders`` and ``trio`` give a role to two
# nodes. ``race`` reduces by symmetry (its two writers are interchangeable). ``holders`` does not:
# an invalidation sends its Revokes in node order and a full network loses the later ones, so
# swapping the two readers is not a symmetry of the model's steps (a reduced search reached 209,393
# of the 213,031 orbits of its reachable states, and fewer with two workers). Every configuration
# keeps its roles, ``medium`` included.
_ONE_KEY = dict(nodes=2, parents=(-1,), namespaces=(0,), authorized=_all(2))
_ROLES = dict(writes_to_pool_only=True, writers=(0,), readers=(1,))

CONFIGS: dict[str, ModelConfig] = {
    cfg.name: cfg
    for cfg in (
        ModelConfig(
            name="tiny", **_ONE_KEY, **_ROLES, max_epoch=1, max_lease_id=2, max_requests=1,
            max_node_crashes=0, max_directory_restarts=0,
            description="a writer, a reader, one key in the shared pool; for fast property tests",
        ),
        ModelConfig(
            name="small", **_ONE_KEY, **_ROLES, max_epoch=2, max_lease_id=3, max_requests=1,
            max_node_crashes=1, max_directory_restarts=0,
            description="a writer and a reader on one pooled key, two write generations, a node crash; seconds",
        ),
        ModelConfig(
            name="restart", **_ONE_KEY, **_ROLES, max_epoch=1, max_lease_id=3, max_requests=1,
            max_node_crashes=0, max_directory_restarts=1,
            description="a directory restart while leases are out",
        ),
        ModelConfig(
            name="renewal", **_ONE_KEY, **_ROLES, max_epoch=1, max_lease_id=2, max_requests=2,
            max_node_crashes=0, max_directory_restarts=0,
            description="a reader that renews its lease",
        ),
        ModelConfig(
            name="chain", nodes=2, parents=(-1, 0), namespaces=(0, 0), authorized=_all(2), **_ROLES,
            max_epoch=1, max_lease_id=3, max_requests=1, max_node_crashes=0, max_directory_restarts=0,
            description="a 2-block prefix chain: cascading invalidation, leaves evicted first",
        ),
        ModelConfig(
            name="tenants", nodes=2, parents=(-1, -1), namespaces=(0, 1),
            authorized=(frozenset({0}), frozenset({0, 1})), writes_to_pool_only=True, writers=(1,), readers=(0,),
            max_epoch=1, max_lease_id=2, max_requests=1, max_node_crashes=0, max_directory_restarts=0,
            description="two tenants' namespaces; node 0 is authorised for one of them only",
        ),
        ModelConfig(
            name="tiering", **_ONE_KEY, writers=(0,), readers=(1,), tiering=True, max_epoch=2,
            max_lease_id=2, max_requests=1, max_node_crashes=1, max_directory_restarts=0,
            description="a block moved between a node's tier and the pool: ownership transfer, draining",
        ),
        ModelConfig(
            name="race", **_ONE_KEY, writes_to_pool_only=True, readers=(), max_epoch=2, max_lease_id=3,
            max_requests=1, max_node_crashes=0, max_directory_restarts=0, symmetry=True,
            description="two writers race on one pooled key (no readers: the write path alone)",
        ),
        ModelConfig(
            name="holders", nodes=3, parents=(-1,), namespaces=(0,), authorized=_all(3), writes_to_pool_only=True,
            writers=(0,), readers=(1, 2), max_epoch=1, max_lease_id=3, max_requests=1, max_node_crashes=0,
            max_directory_restarts=0,
            description="a writer and two readers: one invalidation waits on two holders",
        ),
        ModelConfig(
            name="dup", **_ONE_KEY, **_ROLES, max_epoch=1, max_lease_id=2, max_requests=1, max_messages=3,
            max_duplications=1, max_node_crashes=0, max_directory_restarts=0,
            description="three messages in flight, one of them duplicated",
        ),
        ModelConfig(
            # Four lease ids: the parent's write, the child's, the child's read lease, and the
            # parent's rewrite (with three, ParentRewrittenUnderCachedChild is unreachable: 6,402,613
            # states searched).
            name="rewrite", nodes=2, parents=(-1, 0), namespaces=(0, 0), authorized=_all(2), **_ROLES,
            max_epoch=2, max_lease_id=4, max_requests=1, max_node_crashes=0, max_directory_restarts=0,
            description="a parent rewritten while a holder still trusts its child; namespace and key invalidations race",
        ),
        ModelConfig(
            name="demote", **_ONE_KEY, tiers_per_node=2, shared_pool=False, tiering=True, writers=(0,), readers=(1,),
            max_epoch=2, max_lease_id=2, max_requests=1, max_node_crashes=0, max_directory_restarts=0,
            description="a block demoted between two tiers of one node, read remotely while it drains",
        ),
        ModelConfig(
            name="trio", nodes=3, parents=(-1,), namespaces=(0,), authorized=_all(3), shared_pool=False, tiering=True,
            writers=(0,), readers=(2,), max_epoch=2, max_lease_id=2, max_requests=1, max_node_crashes=1,
            max_directory_restarts=0,
            description="three nodes: an owner crashes while its previous copy drains on a second under a third's lease",
        ),
        ModelConfig(
            name="lagging", **_ONE_KEY, **_ROLES, max_epoch=1, max_lease_id=2, max_requests=1,
            max_node_crashes=0, max_directory_restarts=0, directory_clock_lags=True,
            description="tiny with a directory clock that falls behind: the bounded-response deadlines under the clock direction that delays them",
        ),
        ModelConfig(
            name="failover", **_ONE_KEY, writers=(0,), readers=(1,), max_epoch=1, max_lease_id=2, max_requests=1,
            max_node_crashes=1, max_directory_restarts=0,
            description="a writer that owns its block on its own tier crashes: the failure detector, failover, frees reaching a node when it is back",
        ),
        ModelConfig(
            name="mirrored", **_ONE_KEY, **_ROLES, max_epoch=1, max_lease_id=3, max_requests=1,
            max_node_crashes=0, max_directory_restarts=2, mirrored_leases=True,
            description="restart with the leases mirrored: two directory restarts, each waiting only for the leases outstanding",
        ),
        ModelConfig(
            name="medium", **_ONE_KEY, **_ROLES, max_epoch=2, max_lease_id=4, max_requests=2,
            max_node_crashes=1, max_directory_restarts=1,
            description="small plus renewals and a directory restart; minutes; used by the benchmark",
        ),
    )
}


def get_config(name: str) -> ModelConfig:
    try:
        return CONFIGS[name]
    except KeyError:
        raise KeyError(f"unknown model configuration {name!r}; known: {', '.join(CONFIGS)}") from None


def load_manifest() -> dict:
    """The pinned distinct-state counts and verdicts, keyed by configuration name, each with its
    ``mode``: ``exhaustive`` (every state; the count must match) or ``sampled`` (a scope too large
    to exhaust in CI, checked by ``checker.swarm`` with the pinned ``swarm`` walks instead), and
    its ``set``: ``fast`` (the default: together about 9 minutes on two idle cores) or ``full``
    (a configuration that alone takes longer; ``kvcc check --all`` and CI run both sets)."""
    text = resources.files(__package__).joinpath("manifest.json").read_text()
    return json.loads(text)
