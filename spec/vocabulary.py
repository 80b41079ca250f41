"""The protocol's words, written once: the actions (what a process logs and what only the
environment does), the refusal reasons, the invalidation scopes.

Everything that speaks the protocol imports them from here -- the model and its checker, the
wire, the event log, the adapter contract, the trace validator, the adapters -- so a new word is
added in one place (and the places that must then handle it fail their own checks: the model
has no step for a new action, the codec refuses an unknown scope). Standard library only, like
the rest of ``spec/``.
"""

from __future__ import annotations

# -- actions ----------------------------------------------------------------------------------------
# Every action label of the model (spec/model.py), in the checker's order, with who takes it. The
# order is part of the checker's pinned results (the swarm mode draws the labels it leaves out in
# this order): append, never reorder.
HOLDER, WRITER, DIRECTORY, LOCATION, FAILURE, ENVIRONMENT = "holder", "writer", "directory", "location", "failure", "environment"
_ACTIONS = (
    ("tick", ENVIRONMENT), ("clock_forward", ENVIRONMENT), ("clock_back", ENVIRONMENT),
    ("acquire", HOLDER), ("renew", HOLDER), ("abandon", HOLDER), ("read", HOLDER), ("release", HOLDER),
    ("begin_write", WRITER), ("abort", WRITER),
    ("grant_read_lease", DIRECTORY), ("refuse_read_lease", DIRECTORY), ("renew_lease", DIRECTORY),
    ("refuse_renewal", DIRECTORY), ("release_lease", DIRECTORY),
    ("grant_write_lease", DIRECTORY), ("refuse_write_lease", DIRECTORY), ("commit_write", DIRECTORY),
    ("reject_stale_commit", DIRECTORY),
    ("expire_write_lease", DIRECTORY), ("expire_write_lease_of_crashed", DIRECTORY),
    ("invalidate", DIRECTORY), ("invalidate_namespace", DIRECTORY), ("drop_and_ack", HOLDER),
    ("revoke_acked", DIRECTORY), ("complete_invalidation", DIRECTORY),
    ("evict", DIRECTORY), ("evict_refused", DIRECTORY),
    ("start_transfer", DIRECTORY), ("store_copy", LOCATION), ("finish_transfer", DIRECTORY),
    ("free_drained", DIRECTORY), ("cancel_transfer", DIRECTORY),
    ("trust_read_lease", HOLDER), ("trust_renewal", HOLDER), ("start_writing", WRITER),
    ("store_bytes", LOCATION), ("fence_stale_write", LOCATION), ("free_slot", LOCATION), ("fence_stale_free", LOCATION),
    ("retry_free", DIRECTORY), ("free_acked", DIRECTORY), ("declare_node_down", DIRECTORY),
    ("drop", ENVIRONMENT), ("duplicate", ENVIRONMENT),
    ("crash", FAILURE), ("restart_node", FAILURE), ("restart_directory", FAILURE),
)  # fmt: skip
ACTIONS = tuple(name for name, _ in _ACTIONS)
TAKEN_BY = dict(_ACTIONS)
# What a process logs (an event's ``event``): every action but the environment's. A failure is
# logged by the process that observes it (a rejoining node, a restarted directory) or a fault injector.
EVENTS = tuple(name for name, who in _ACTIONS if who != ENVIRONMENT)
# Time passing, clocks drifting, the network losing or duplicating a message: never logged.
ENVIRONMENT_ACTIONS = tuple(name for name, who in _ACTIONS if who == ENVIRONMENT)


def taken_by(who: str) -> frozenset[str]:
    """The actions ``who`` takes (``HOLDER``, ``WRITER``, ``DIRECTORY``, ``LOCATION``, ...)."""
    return frozenset(name for name, by in _ACTIONS if by == who)


assert len(TAKEN_BY) == len(_ACTIONS), "action names are unique"

# -- refusal reasons ----------------------------------------------------------------------------------
# What the spec's directory refuses with (LeaseRefused, CommitRejected, EvictRefused) ...
REASON_NOT_COMMITTED = "not_committed"  # no committed generation to lease (ABSENT or WRITING)
REASON_INVALIDATING = "invalidating"  # no new leases, renewals or evictions while an invalidation runs
REASON_NOT_ABSENT = "not_absent"  # begin_write on a key that has a generation
REASON_PARENT_NOT_COMMITTED = "parent_not_committed"  # prefix chains are written root first
REASON_UNAUTHORIZED = "unauthorized"  # namespace not allowed for this tenant
REASON_UNKNOWN_LEASE = "unknown_lease"  # expired, revoked, released or never granted
REASON_STALE_EPOCH = "stale_epoch"  # a commit under an epoch that is no longer the key's
REASON_LEASE_EXPIRED = "lease_expired"  # a commit after its write lease expired; a holder past its budget
REASON_LEASED = "leased"  # eviction refused: a live read lease on that location
REASON_HAS_CHILDREN = "has_children"  # eviction refused: leaves before their ancestors
REASON_RESTARTING = "restarting"  # a restarted directory's grace period: nothing is freed
REASON_NOT_FOUND = "not_found"  # eviction of a location that holds no copy the directory knows
REASON_WRONG_GENERATION = "wrong_generation"  # a copy or read of another generation than the record's
REASON_ALREADY_LEASED = "already_leased"  # the holder has a live lease on the key: renew it instead
REASON_NOT_OWNER = "not_owner"  # renewal of a lease on a copy that is no longer the owner (draining)
REASON_DRAINING_FIRST = "draining_first"  # the owner copy is the last one: the draining copy goes first
REASON_LOCATION_DOWN = "location_down"  # the copy is on a node the directory has declared down
REASON_NOT_TRANSFERABLE = "not_transferable"  # a transfer the directory did not start (not COMMITTED, one under way, another node's copy)
REASON_KEY_IDENTITY = "key_identity"  # begin_write naming another parent than the key's: its digest chains over its parent's
REASON_WRONG_SHARD = "wrong_shard"  # a root written to a shard that does not own it (docs/sharding.md: keys.shard_of)
DIRECTORY_REASONS = (
    REASON_NOT_COMMITTED, REASON_INVALIDATING, REASON_NOT_ABSENT, REASON_PARENT_NOT_COMMITTED,
    REASON_UNAUTHORIZED, REASON_UNKNOWN_LEASE, REASON_STALE_EPOCH, REASON_LEASE_EXPIRED,
    REASON_LEASED, REASON_HAS_CHILDREN, REASON_RESTARTING, REASON_NOT_FOUND, REASON_WRONG_GENERATION,
    REASON_ALREADY_LEASED, REASON_NOT_OWNER, REASON_DRAINING_FIRST, REASON_LOCATION_DOWN, REASON_NOT_TRANSFERABLE,
    REASON_KEY_IDENTITY, REASON_WRONG_SHARD,
)  # fmt: skip
# ... and what a holder, a writer or a location refuses with on its own, without the directory.
REASON_BUSY = "busy"  # this client already has a request or a write of that key under way
REASON_REVOKED = "revoked"  # the lease was revoked (or its request overtaken by a revocation)
REASON_MISS = "miss"  # a read found no valid bytes at the leased location
REASON_FENCED = "fenced"  # a location refused an operation carrying a stale epoch
REASON_NO_SPACE = "no_space"  # a location has no room for the bytes
REASON_UNREACHABLE = "unreachable"  # the location could not be reached
REASON_TOO_LARGE = "too_large"  # the block is larger than the location's slots: it never fits there
REASON_BATCH_FULL = "batch_full"  # a batched read not taken: its batch's answer was full (read it again)
LOCAL_REASONS = (REASON_BUSY, REASON_REVOKED, REASON_MISS, REASON_FENCED, REASON_NO_SPACE, REASON_UNREACHABLE,
                 REASON_TOO_LARGE, REASON_BATCH_FULL)
REASONS = DIRECTORY_REASONS + LOCAL_REASONS
assert len(set(REASONS)) == len(REASONS), "reasons are unique"

# -- invalidation scopes ------------------------------------------------------------------------------
SCOPE_KEY = "key"  # one key's generation -- and, by the cascade rule, its descendants
SCOPE_PREFIX = "prefix"  # the subtree under the last key of a prefix chain
SCOPE_NAMESPACE = "namespace"  # every key of one namespace
SCOPES = (SCOPE_KEY, SCOPE_PREFIX, SCOPE_NAMESPACE)

# -- locations ------------------------------------------------------------------------------------
LOCATION_SEPARATOR = "/"  # a location "<node>/<tier>" is a tier of <node>; one without it (the pool) is no node's


def location_host(location: str) -> str:
    """The node a location is a tier of (``"n1/dram"`` -> ``"n1"``), or the location itself when it
    names no tier (the shared pool, or a node that has one location)."""
    return location.partition(LOCATION_SEPARATOR)[0]
