"""Deletion reaches everywhere, and a crashed owner's keys come back -- on real processes.

A ``LocalCluster`` (a directory process, cache-node processes with an NVMe tier, which survives
a kill -9 with its bytes) and clients in this process. What a node still holds is asked of the
node itself, with no lease (``raw_read``): the bytes its tier would serve for (key, generation).

- (a) a ``Free`` sent while its node is down is lost on the wire; the directory keeps the free
  in its durable to-free set, across its own restart, and sends it again until the node
  acknowledges: the ended generation's bytes leave the node once it is back;
- (b) a write that was given up (its write lease expired) leaves no bytes in its slot: the
  directory frees the slot's epoch;
- (c) a COMMITTED key whose owner node is killed stops being leased once the directory knows
  the node is down, and becomes writable again (on another node) once the leases on its lost
  copy were acknowledged or ran out;
- (d) an invalidation racing a tier transfer (issue 14): whichever lands first, once the
  invalidation completes neither the source tier nor the transfer's destination serves the
  voided generation, nothing finds or leases it, and the trace is ACCEPTED;
- (e) a committed copy whose bytes fail their checksum at rest: the read misses, the node reports
  the lost copy (``Lost``), and the directory voids the key with its subtree, which is then
  written again.

Nothing asserts how long anything took: each check waits (up to ``UNTIL_S``, never reached
unless broken) for a state to be reached.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from kvcc.reference.client import Refused
from kvcc.reference.cluster import ENGINE_TENANT, LocalCluster
from kvcc.reference.transport import Client
from kvcc.reference.wire import BytesRead, Committed, ReadBytes, ReadRefused
from kvcc.spec.keys import Namespace, chain_keys
from kvcc.spec.vocabulary import REASON_INVALIDATING, REASON_LOCATION_DOWN, REASON_NOT_ABSENT, REASON_NOT_COMMITTED

QUIET_ENV = {"DO_NOT_TRACK": "1", "VLLM_NO_USAGE_STATS": "1", "LMCACHE_TRACK_USAGE": "false", "HF_HUB_OFFLINE": "1"}
for _k, _v in QUIET_ENV.items():
    os.environ.setdefault(_k, _v)

sys.path.insert(0, str(Path(__file__).parent))
from fault_client import payload  # noqa: E402
from test_faults import no_process_left_behind, until  # noqa: E402,F401 (the fixture is autouse)

NS = Namespace("deletion-model", "r1", "bfloat16", 4, cache_salt=b"deletion")
TERM_MS = 1000
SKEW_MS = 50
BLOCK_BYTES = 64 << 10
NODE_TIER = "nvme=8MiB"  # durable: a killed node comes back with its bytes (and no torch import)
UNTIL_S = 30.0


def cluster(tmp_path, **kw) -> LocalCluster:
    kw.setdefault("tiers", (NODE_TIER,))
    kw.setdefault("block_bytes", BLOCK_BYTES)
    kw.setdefault("lease_term_ms", TERM_MS)
    kw.setdefault("skew_ms", SKEW_MS)
    return LocalCluster(tmp_path / "cluster", namespaces=[NS], **kw)


def raw_read(cl: LocalCluster, node: str, key, gen: int, tier: str = "nvme") -> bytes | None:
    """What ``node``'s ``tier`` would serve for (key, gen), asked with no lease at all."""

    async def go():
        async with Client("127.0.0.1", int(cl.procs[node].info["port"]), ENGINE_TENANT, cl.engine_token) as c:
            location = f"{node}/{tier}"
            return await c.request(ReadBytes("probe", key, 1, location, gen, cl.read_grant(location, key, gen)))

    reply = asyncio.run(go())
    if type(reply) is ReadRefused:
        return None
    assert type(reply) is BytesRead, reply
    return reply.data


def registered(c, node: str) -> bool:
    return node in c.refresh_nodes()


def events_of(cl: LocalCluster, name: str, key) -> list[dict]:
    return [e for e in cl.events() if e["event"] == name and e["key"] == key.hex]


# -- (a) a lost Free ------------------------------------------------------------------------------------


def test_a_free_lost_to_a_killed_node_reaches_it_after_it_and_the_directory_restart(tmp_path):
    with cluster(tmp_path, nodes=1) as cl:
        a = cl.client("a")
        key = chain_keys(NS, [1] * NS.block_tokens)[0]
        data = payload("doomed", BLOCK_BYTES)
        assert isinstance(a.put(NS, key, None, data), Committed)
        gen = a.acquire(NS, key)
        assert not isinstance(gen, Refused)
        a.release(gen)
        assert raw_read(cl, "n1", key, gen.gen) == data
        cl.kill("n1")
        # The invalidation completes (no lease is live) and frees n1/nvme: that Free is lost.
        assert a.wait(a.invalidate(NS, "key", key), UNTIL_S)
        # The directory restarts on its log: the to-free set must survive it.
        cl.restart_directory()
        cl.restart("n1")  # same disk: the doomed bytes are still there
        until("n1 registered again", lambda: registered(a, "n1"))
        until("the invalidated generation's bytes left n1", lambda: raw_read(cl, "n1", key, gen.gen) is None)
        # The block is gone for readers inside the tier's free; the node logs it once that returns.
        until("the node logged the free", lambda: events_of(cl, "free_slot", key))


# -- (b) a write given up -------------------------------------------------------------------------------


def test_b_bytes_of_a_write_whose_lease_expired_are_freed(tmp_path):
    with cluster(tmp_path, nodes=1) as cl:
        w = cl.client("w")
        key = chain_keys(NS, [2] * NS.block_tokens)[0]
        wl = w.begin_write(NS, key, None)
        assert not isinstance(wl, Refused) and wl.location == "n1/nvme", wl
        data = payload("abandoned", BLOCK_BYTES)
        assert w.write_bytes(wl, data) is None
        assert raw_read(cl, "n1", key, wl.gen) == data, "the bytes landed"
        w.abort(wl)  # never committed: the write lease expires at the directory
        until("the write lease expired", lambda: events_of(cl, "expire_write_lease", key))
        until("the abandoned write's bytes left n1", lambda: raw_read(cl, "n1", key, wl.gen) is None)
        assert w.acquire(NS, key) == Refused(REASON_NOT_COMMITTED)
        # The slot is usable again and the next generation is untouched by the free.
        fresh = until("writable again", lambda: _grant(w, key))
        assert fresh.epoch > wl.epoch and fresh.gen > wl.gen
        again = payload("fresh", BLOCK_BYTES)
        assert w.write_bytes(fresh, again) is None and isinstance(w.commit(fresh), Committed)
        assert raw_read(cl, "n1", key, fresh.gen) == again


def _grant(c, key, parent=None):
    wl = c.begin_write(NS, key, parent)
    if isinstance(wl, Refused):
        assert wl.reason == REASON_NOT_ABSENT, wl
        return None
    return wl


# -- (c) a crashed owner ----------------------------------------------------------------------------------


def test_c_a_killed_owners_keys_stop_being_leased_and_become_writable_elsewhere(tmp_path):
    with cluster(tmp_path, nodes=2) as cl:
        owner, other = cl.client("n1.engine"), cl.client("n2.engine")  # writes land on the home node
        until("both nodes registered", lambda: registered(owner, "n1") and registered(owner, "n2"))
        key = chain_keys(NS, [3] * NS.block_tokens)[0]
        data = payload("owned-by-n1", BLOCK_BYTES)
        assert isinstance(owner.put(NS, key, None, data), Committed)
        lease = other.acquire(NS, key)
        assert not isinstance(lease, Refused) and lease.location == "n1/nvme", lease
        assert other.read(lease) == data
        other.release(lease)
        cl.kill("n1")

        refusals = (REASON_LOCATION_DOWN, REASON_INVALIDATING, REASON_NOT_COMMITTED)

        def refused():
            got = other.acquire(NS, key)
            if isinstance(got, Refused):
                assert got.reason in refusals, got
                return got
            other.release(got)
            return None

        first = until("no more leases on the dead owner's copy", refused)
        fresh = until("the dead owner's key is writable again", lambda: _grant(other, key))
        assert fresh.location == "n2/nvme", fresh
        assert fresh.gen > lease.gen and fresh.epoch > lease.epoch
        new = payload("rewritten-on-n2", BLOCK_BYTES)
        assert other.write_bytes(fresh, new) is None and isinstance(other.commit(fresh), Committed)
        got = other.acquire(NS, key)
        assert not isinstance(got, Refused) and got.location == "n2/nvme"
        assert other.read(got) == new
        other.release(got)
        print(f"first refusal after the kill: {first.reason}")
        # n1 comes back with its disk: the lost copy's generation is freed there too.
        cl.restart("n1")
        until("n1 registered again", lambda: registered(other, "n1"))
        until("the voided generation's bytes left n1", lambda: raw_read(cl, "n1", key, lease.gen) is None)


# -- (d) an invalidation racing a tier transfer -----------------------------------------------------------

TRANSFER_RACE_OFFSETS_S = (0.0, 0.001, 0.002, 0.004, 0.008, 0.016)  # the invalidation after the transfer


def test_d_an_invalidation_racing_a_tier_transfer_leaves_no_copy_at_either_end(tmp_path):
    from test_identities import _ask  # a request under a node's own credential (only nodes move blocks)

    from kvcc.conformance.validate import ACCEPTED, TraceParams, validate_trace
    from kvcc.reference.wire import Lookup, Transfer, TransferRefused, TransferStarted

    with cluster(tmp_path, nodes=1, tiers=("dram=8MiB", "nvme=8MiB")) as cl:
        w = cl.client("n1.engine")  # co-located with n1: its blocks land on n1's DRAM
        outcomes = []
        for i, offset_s in enumerate(TRANSFER_RACE_OFFSETS_S):
            key = chain_keys(NS, [40 + i] * NS.block_tokens)[0]
            data = payload(f"moving-{i}", BLOCK_BYTES)
            assert isinstance(w.put(NS, key, None, data), Committed)
            lease = w.acquire(NS, key)
            assert not isinstance(lease, Refused) and lease.location == "n1/dram", lease
            w.release(lease)
            moved: list = []
            go = threading.Barrier(2)

            def move(key=key):
                go.wait()
                moved.append(_ask(cl, "n1", Transfer("n1", key, 0, "n1/dram", "n1/nvme")))

            mover = threading.Thread(target=move)
            mover.start()
            go.wait()
            time.sleep(offset_s)
            done = w.wait(w.invalidate(NS, "key", key), UNTIL_S)
            mover.join()
            assert done, "the invalidation did not complete"
            assert type(moved[0]) in (TransferStarted, TransferRefused), moved
            outcomes.append(type(moved[0]).__name__)
            # Once complete: nothing finds or leases the voided generation, and neither end of the
            # transfer serves its bytes (a Copy landing after the destination's free is fenced there).
            assert _ask(cl, ENGINE_TENANT, Lookup(NS.digest(), (key,))).blocks_matched == 0
            got = w.acquire(NS, key)
            assert isinstance(got, Refused), got
            for tier in ("dram", "nvme"):
                until(f"the voided generation's bytes left n1/{tier} (round {i})",
                      lambda tier=tier, key=key: raw_read(cl, "n1", key, lease.gen, tier) is None)  # fmt: skip
        print(f"transfers: {outcomes}")
        events = sorted(cl.events(), key=lambda e: (e["t_wall_ns"], e["node"], e["seq"]))
        verdict = validate_trace(events, TraceParams(TERM_MS, SKEW_MS, locations={"n1/dram": "n1", "n1/nvme": "n1"}))
        assert verdict.status == ACCEPTED, verdict.to_json()


# -- (e) a copy lost at rest ------------------------------------------------------------------------------


def _damage_at_rest(cl: LocalCluster, node: str, data: bytes) -> None:
    """Invert one byte in the middle of ``data`` where ``node``'s NVMe slabs hold it (as a failing
    medium would, telling no one)."""
    for slab in sorted((cl.workdir / "state" / node / "nvme").glob("slab-*.kvs")):
        raw = slab.read_bytes()
        at = raw.find(data)
        if at >= 0:
            fd = os.open(slab, os.O_WRONLY)
            try:
                pos = at + len(data) // 2
                os.pwrite(fd, bytes([raw[pos] ^ 0xFF]), pos)
                os.fsync(fd)
            finally:
                os.close(fd)
            return
    raise AssertionError(f"{node}'s slabs do not hold the block")


def test_e_a_copy_lost_at_rest_is_voided_with_its_subtree_and_written_again(tmp_path):
    """A committed block whose bytes fail their checksum at rest: a leased read misses (never
    other bytes), the node reports the lost copy, and the directory voids the key with its
    subtree -- lookups stop finding it and it takes new bytes -- where before every lookup found
    it, every read missed and every rewrite was refused ``not_absent``."""
    from kvcc.conformance.validate import ACCEPTED, TraceParams, validate_trace

    with cluster(tmp_path, nodes=2) as cl:
        w, r = cl.client("n1.engine"), cl.client("n2.engine")
        parent, child = chain_keys(NS, list(range(100, 100 + 2 * NS.block_tokens)))
        data = payload("lost-at-rest", BLOCK_BYTES)
        assert isinstance(w.put(NS, parent, None, data), Committed)
        assert isinstance(w.put(NS, child, parent, payload("its-child", BLOCK_BYTES)), Committed)
        assert r.lookup(NS, [parent, child]).blocks == 2
        _damage_at_rest(cl, "n1", data)
        lease = r.acquire(NS, parent)
        assert not isinstance(lease, Refused), lease
        got = r.read(lease)
        assert isinstance(got, Refused) and got.reason == "miss", got
        r.release(lease)
        until("the directory voided the lost copy and its subtree", lambda: r.lookup(NS, [parent, child]).blocks == 0)
        new = payload("written-again", BLOCK_BYTES)
        until("the key takes new bytes", lambda: isinstance(w.put(NS, parent, None, new), Committed))
        lease = r.acquire(NS, parent)
        assert not isinstance(lease, Refused) and lease.gen > 0, lease
        assert r.read(lease) == new
        r.release(lease)
        events = sorted(cl.events(), key=lambda e: (e["t_wall_ns"], e["node"], e["seq"]))
        assert [e for e in events if e["event"] == "invalidate" and e.get("lost") == "n1/nvme"]
        locations = {"n1/nvme": "n1", "n2/nvme": "n2"}
        verdict = validate_trace(events, TraceParams(TERM_MS, SKEW_MS, locations=locations))
        assert verdict.status == ACCEPTED, verdict.to_json()
