"""``kvcc bench routing --live``: a trace routed through a local kvcc cluster (a directory and N
cache nodes, processes on loopback, one cluster per replay). Hand-computed cases: hits are what the
cluster's pool holds whichever node serves (kvcc's nodes are one pool), every byte read back is
checked, a full node evicts by kvcc's rules and goes on. No test asserts a measured time."""

from __future__ import annotations

import json

import pytest

from kvcc import cli
from kvcc.bench import routing_live
from kvcc.reference.routing import sim

LIVE_KEYS = {"trace", "nodes", "capacity", "utilisation", "policy", "requests", "bound_infinite", "bound_pooled",
             "vs_pooled", "hit_ratio", "local_share", "max_mean_load", "ttft_p50", "ttft_p99", "cache_ms_p50",
             "write_ms_p50", "evictions", "refused_writes", "write_refusals", "evict_refusals", "gone",
             "parents_rewritten", "written"}  # fmt: skip


def _trace(tmp_path, requests):
    path = tmp_path / "hand.jsonl"
    path.write_text("".join(json.dumps({"timestamp": 1000 * i, "hash_ids": r}) + "\n" for i, r in enumerate(requests)))
    return sim.load_trace(path)


def test_hits_are_the_pools_whichever_node_serves(tmp_path):
    # refs 3 + 4 + 1 + 2 + 10 x 1 = 20; hits 0, then 1-2-3 (3), 0, then 1-2 (2), then none: 5 of 20,
    # on one node or two (15 unique blocks: 7 a node of two; the one-block requests after the hits
    # are leaves a full node evicts to make room)
    trace = _trace(tmp_path, [[1, 2, 3], [1, 2, 3, 4], [5], [1, 2]] + [[900 + i] for i in range(10)])
    rows = routing_live.run(trace, [1, 2], [1.0], [0.5], ["round_robin", "cache_aware"], sim.Costs())
    assert len(rows) == 4 and all(set(r) == LIVE_KEYS for r in rows)
    for r in rows:
        assert r["hit_ratio"] == pytest.approx(0.25) and r["bound_infinite"] == pytest.approx(0.25), r
        assert r["refused_writes"] == 0 and r["written"] == 15 and r["vs_pooled"] == pytest.approx(1.0)
    assert all(r["local_share"] == 1.0 for r in rows if r["nodes"] == 1)
    # round robin on two nodes serves requests 2 and 4 on the node that did not write 1-2-3: every
    # hit is a read from the other node, which the pool serves all the same
    (rr,) = [r for r in rows if r["nodes"] == 2 and r["policy"] == "round_robin"]
    assert rr["local_share"] == 0.0


def test_a_full_node_makes_room_and_goes_on(tmp_path):
    # 12 chains of 6 fresh blocks through one node holding 12 (then 0-1-2 again): 72 commits into 12
    # slots, so blocks were evicted -- by the node making room, or by the engine
    requests = [[100 * i + j for j in range(6)] for i in range(12)] + [[0, 1, 2]]
    trace = _trace(tmp_path, requests)
    (r,) = routing_live.run(trace, [1], [12 / 72], [0.5], ["round_robin"], sim.Costs())
    assert r["refused_writes"] == 0 and r["written"] >= 72, r
    assert r["hit_ratio"] <= r["bound_infinite"]


def test_bench_routing_live_json(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "hash_ids": [1, 2, 10 + i]}) + "\n" for i in range(8)))
    argv = ["bench", "routing", "--trace", str(trace), "--nodes", "2", "--capacity", "1", "--utilisation", "0.5",
            "--policy", "cache_aware", "--live", "--json"]  # fmt: skip
    assert cli.main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    (row,) = r["live"]["rows"]
    assert row["requests"] == 8 and row["hit_ratio"] == pytest.approx(14 / 24)  # 1 and 2 hit after the first
    assert r["live"]["block_bytes"] == routing_live.BLOCK_BYTES


def test_a_block_written_again_elsewhere_is_one_entry():
    """A node made room by evicting a block (the engines are not told), and another engine wrote it
    again: the engines' bookkeeping keeps the new copy only, children counted once."""
    from kvcc.spec.keys import chain_keys

    a, b = routing_live._Engine(node="n1", client=None), routing_live._Engine(node="n2", client=None)
    pool = routing_live._Pool()
    root, child = chain_keys(routing_live.NS, list(range(2 * sim.BLOCK_TOKENS)))
    pool.add(a, root, None)
    pool.add(a, child, root)
    pool.add(b, child, root)  # child evicted from n1 behind the engines' backs, written again on n2
    assert list(a.lru) == [root] and list(b.lru) == [child]
    assert pool.location[child] == "n2/dram" and pool.children[root] == 1
    pool.remove(child)
    assert pool.children[root] == 0 and not b.lru


def test_room_is_made_before_a_write_and_a_chain_longer_than_a_node_stops_at_its_size(tmp_path):
    """An engine makes room on its node before it writes (as an LRU cache does before it inserts),
    never after a refusal: a write the node refused would hold its block WRITING for a lease term.
    A chain of 6 on a node of 4: the chain's own blocks are never evicted to fit the rest, so 1-4
    are written and the write stops, typed ``no_room``; 1-4 then hit, and the unrelated chains that
    follow evict the leaf 4 first (the directory lets leaves go before their parents)."""
    trace = _trace(tmp_path, [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5], [7], [8], [1, 2, 3, 4]])
    (r,) = routing_live.run(trace, [1], [4 / 8 + 0.01], [0.5], ["round_robin"], sim.Costs())
    assert r["write_refusals"] == {"no_room": 2} and r["refused_writes"] == 2, r
    # hits: 0, then 1-4 (4), 0, 0, then 1-2 (the leaves 4, then 3, made room for 7 and 8): 6 of 17;
    # evictions: 4, 3, then 7 and 8 to write 3-4 again under 1-2
    assert r["hit_ratio"] == pytest.approx(6 / 17) and r["evictions"] == 4, r
