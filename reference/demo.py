"""The demo workload ``kvcc cluster up`` runs: every protocol path once, on real processes.

Two engines (clients ``engine-a`` and ``engine-b``) share one namespace:

1. ``engine-a`` writes two prompts' block chains (they share a prefix); the directory places each
   block on a node by rendezvous hashing, so the chain spreads over the cluster;
2. ``engine-b`` looks the prompt up (longest cached prefix), takes a read lease on every block
   and reads each from the node holding it -- leased reads from peers -- and checks the bytes;
3. ``engine-a`` invalidates the prompt from its third block on while ``engine-b`` still holds
   leases there: the directory revokes them, ``engine-b`` drops and acknowledges, the ticket
   completes by acknowledgement, and the lookup now stops before the invalidated prefix;
4. eviction: a leased block is refused (``leased``), a block with cached children is refused
   (``has_children``: leaves go first), an unleased leaf is evicted;
5. a stale writer: a write lease whose holder sits out its term is fenced at commit.

``run_demo(cluster)`` returns the steps as rows (step, what, outcome) for printing and tests.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

from kvcc.spec.keys import Namespace, chain_keys
from kvcc.spec.vocabulary import REASON_NOT_ABSENT

from .client import Refused

DEMO_NAMESPACE = Namespace("demo-model", "rev-1", "bfloat16", 16, cache_salt=b"demo")
PROMPT_BLOCKS = 6


def _block(key: Any, size: int) -> bytes:
    seed = hashlib.sha256(key.digest).digest()
    return (seed * (size // len(seed) + 1))[:size]


def run_demo(cluster: Any, block_bytes: int | None = None) -> list[tuple[str, str, str]]:
    size = min(block_bytes or cluster.block_bytes, cluster.block_bytes)
    ns = DEMO_NAMESPACE
    rows: list[tuple[str, str, str]] = []
    a = cluster.client("engine-a")
    b = cluster.client("engine-b")
    tokens_a = list(range(PROMPT_BLOCKS * ns.block_tokens))
    tokens_b = tokens_a[: 2 * ns.block_tokens] + [t + 10_000 for t in range(2 * ns.block_tokens)]
    keys_a, keys_b = chain_keys(ns, tokens_a), chain_keys(ns, tokens_b)

    # 1. writes
    placed: dict[str, int] = {}
    for keys in (keys_a, keys_b):
        parent = None
        for key in keys:
            out = a.put(ns, key, parent, _block(key, size))
            if isinstance(out, Refused) and out.reason != REASON_NOT_ABSENT:  # the shared prefix exists
                raise RuntimeError(f"demo write refused: {out}")
            parent = key
    hit = a.lookup(ns, keys_a)
    for loc in hit.locations:
        placed[loc] = placed.get(loc, 0) + 1
    rows.append(("write", f"engine-a wrote {len(set(keys_a) | set(keys_b))} blocks ({size} B each)",
                 "placed on " + ", ".join(f"{loc}: {n}" for loc, n in sorted(placed.items()))))  # fmt: skip

    # 2. leased reads from peers
    hit = b.lookup(ns, keys_a)
    leases = []
    good = 0
    for key in keys_a[: hit.blocks]:
        lease = b.acquire(ns, key)
        assert not isinstance(lease, Refused), lease
        leases.append(lease)
        data = b.read(lease)
        good += data == _block(key, size)
    rows.append(("lookup+read", f"engine-b: longest cached prefix {hit.blocks}/{len(keys_a)} blocks",
                 f"{good}/{hit.blocks} leased reads from {len(set(hit.locations))} nodes returned the committed bytes"))

    # 3. invalidate a prefix under live leases
    started = time.monotonic()
    ticket = a.invalidate(ns, "prefix", keys_a[2])
    done = a.wait(ticket, 10.0)
    took_ms = (time.monotonic() - started) * 1000
    after = b.lookup(ns, keys_a)
    stale = b.read(leases[3])
    rows.append(("invalidate", f"engine-a invalidated the prefix from block 3 on (ticket {ticket.id}, "
                 f"{ticket.keys} blocks)",
                 f"{'completed' if done else 'PENDING'} in {took_ms:.0f} ms (leases revoked and acked: "
                 f"{b.client.stats['revoked']}); lookup now {after.blocks} blocks; read under a revoked "
                 f"lease: {stale.reason if isinstance(stale, Refused) else 'SERVED (bug)'}"))  # fmt: skip
    for lease in leases[:2]:
        b.release(lease)

    # 4. eviction
    lease0 = b.acquire(ns, keys_b[3])
    leaf_loc = lease0.location
    refused_leased = a.evict(keys_b[3], leaf_loc)
    b.release(lease0)
    root_loc = a.lookup(ns, keys_b).locations[0]
    refused_children = a.evict(keys_b[0], root_loc)
    evicted = a.evict(keys_b[3], leaf_loc)
    rows.append(("evict", "evict a leased leaf / a block with children / an unleased leaf",
                 f"{_outcome(refused_leased)} / {_outcome(refused_children)} / {_outcome(evicted)}"))

    # 5. writers that outlive their write leases: one paused before its bytes left (they are
    # fenced where the data lives), one paused between its bytes and its commit (the directory
    # rejects the late commit); both keys are rewritten meanwhile by engine-b, whose bytes stay.
    key, key2 = chain_keys(ns, [7] * ns.block_tokens)[0], chain_keys(ns, [8] * ns.block_tokens)[0]
    stale = a.begin_write(ns, key, None)
    stale2 = a.begin_write(ns, key2, None)
    assert not isinstance(stale, Refused) and not isinstance(stale2, Refused), (stale, stale2)
    a.write_bytes(stale2, os.urandom(size))  # landed; the commit is what is late
    time.sleep((cluster.lease_term_ms + 3 * cluster.skew_ms) / 1000)  # engine-a "pauses"
    for k in (key, key2):
        fresh = b.begin_write(ns, k, None)  # writable again, under a higher epoch
        assert not isinstance(fresh, Refused), fresh
        b.write_bytes(fresh, _block(k, size))
        if k == key:
            stored = a.write_bytes(stale, os.urandom(size))  # the paused writer wakes up
        b.commit(fresh)
    committed = a.commit(stale2)
    intact = True
    for k in (key, key2):
        lease = b.acquire(ns, k)
        intact &= not isinstance(lease, Refused) and b.read(lease) == _block(k, size)
    rows.append(("fencing", f"engine-a pauses past two write leases (epoch {stale.epoch}); engine-b rewrites both "
                 f"(epoch {fresh.epoch}); engine-a wakes, writes one and commits the other",
                 f"stale bytes: {'STORED (bug)' if stored is None else stored.reason}; stale commit: "
                 f"{_outcome(committed)}; readers see engine-b's bytes: {intact}"))  # fmt: skip
    return rows


def _outcome(x: Any) -> str:
    return f"refused ({x.reason})" if isinstance(x, Refused) else type(x).__name__.lower()
