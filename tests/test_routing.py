"""The routing simulator (``kvcc.reference.routing``) and ``kvcc bench routing``: the bounds against
the figures the traces' README publishes, each policy on a hand-computed case, each baseline
against its published formula, the simulator on a hand-computed trace, and the command's output
and errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvcc import cli
from kvcc.reference.routing import policies as p
from kvcc.reference.routing import sim

TRACES = {path.name.split("_trace")[0]: path for path in sim.default_traces()}
# The traces' README: block-granular hit ratios, infinite cache and one global LRU.
README_FIGURES = {
    "conversation": {"infinite": 0.3463, 0.1: 0.2075, 0.25: 0.3012, 0.5: 0.3425},
    "synthetic": {"infinite": 0.6396, 0.1: 0.2598, 0.25: 0.4434, 0.5: 0.5888},
}
ROW_KEYS = {"trace", "nodes", "capacity", "utilisation", "policy", "hit_ratio", "bound_infinite", "bound_pooled",
            "max_mean_load", "ttft_p50", "ttft_p99", "vs_pooled"}  # fmt: skip


def view(nodes: int = 3, **fields) -> p.View:
    """A view of an idle cluster with no cache, ``fields`` overriding; prefill 10 ms, load 1 ms a block."""
    base = {name: [0] * nodes for name in ("matched", "outstanding", "queued_ms", "queued_prefill_blocks",
                                           "active_blocks", "assigned_ms", "occupancy")}  # fmt: skip
    return p.View(**{**base, **fields}, prefill_ms=10.0, load_ms=1.0)


def req(*blocks: int) -> p.Request:
    return p.Request(0.0, blocks)


# ------------------------------------------------------------------------------------- bounds


@pytest.fixture(scope="module", params=sorted(README_FIGURES))
def trace(request):
    return request.param, sim.load_trace(TRACES[request.param])


def test_bounds_reproduce_the_readme(trace):
    name, t = trace
    figures = README_FIGURES[name]
    assert round(sim.bound_infinite(t), 4) == figures["infinite"]
    for fraction in (0.1, 0.25, 0.5):
        hits = sim.pooled_hits(t, sim.capacity_blocks(t, fraction))
        assert round(sum(hits) / sim.block_refs(t), 4) == figures[fraction], fraction


def test_lru_evicts_the_least_recent_and_matches_prefixes_only():
    cache = sim.LruCache(3)
    cache.touch([1, 2, 3])
    cache.touch([1])  # 2 is now the least recent
    cache.touch([4])
    assert 2 not in cache and len(cache) == 3
    assert cache.prefix([1, 3, 4]) == 3
    assert cache.prefix([2, 3, 4]) == 0  # a cached block after a miss is not a prefix hit


# ------------------------------------------------------------------------------------- traces


def test_load_trace_reads_timestamps_and_blocks(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0, 1]}\n\n'
                    '{"timestamp": 7, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n')  # fmt: skip
    t = sim.load_trace(path)
    assert t.timestamps == (0.0, 7.0) and t.blocks == ((0, 1), (0,)) and t.span_ms == 7.0


@pytest.mark.parametrize("text, message", [
    ('{"timestamp": 0, "hash_ids": [1]}\nnot json\n', ":2: not a request"),
    ('{"timestamp": 0}\n', ":1: not a request"),
    ('{"timestamp": "0", "hash_ids": [1]}\n', ":1: timestamp is not a number"),
    ('{"timestamp": 0, "hash_ids": [1, "x"]}\n', ":1: hash_ids is not a list of integers"),
    ('{"timestamp": 5, "hash_ids": [1]}\n{"timestamp": 4, "hash_ids": [1]}\n', ":2: timestamp goes back"),
    ("\n", "no requests"),
])  # fmt: skip
def test_load_trace_rejects_malformed_input(tmp_path, text, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(sim.TraceError, match=message):
        sim.load_trace(path)


def test_load_trace_rejects_a_missing_file(tmp_path):
    with pytest.raises(sim.TraceError, match="cannot read trace"):
        sim.load_trace(tmp_path / "absent.jsonl")


# ----------------------------------------------------------------------------------- policies


def test_round_robin_cycles_from_the_seed():
    rr = p.RoundRobin(3, seed=1)
    assert [rr.choose(req(1), view()) for _ in range(4)] == [1, 2, 0, 1]


def test_consistent_hash_keeps_a_key_on_its_node_until_the_load_bound():
    ch = p.ConsistentHash(2, seed=0)
    home = ch.choose(req(42, 1), view(2))
    assert ch.choose(req(42, 9, 9), view(2)) == home  # the key is the first block only
    loads = [0, 0]
    loads[home] = 1  # bound ceil(1.25 * 2 / 2) = 2: still room
    assert ch.choose(req(42), view(2, outstanding=loads)) == home
    loads[home] = 2  # bound ceil(1.25 * 3 / 2) = 2: full, walk on
    assert ch.choose(req(42), view(2, outstanding=loads)) == 1 - home


def test_capacity_takes_the_least_queued_work_then_the_least_occupancy():
    assert p.Capacity(3).choose(req(1), view(queued_ms=[5, 3, 3], occupancy=[0, 9, 4])) == 2


def test_cache_aware_takes_the_longest_prefix_within_the_load_guard():
    ca = p.CacheAware(3, g=0.1)
    # service: node 0 2 * 10 + 2 * 1 = 22, node 1 4 * 1 = 4, node 2 4 * 10 = 40
    # assigned 100 each: guard 1.1 * (300 + 4) / 3 = 111.5; only node 1 (104) stays within, and it has the prefix
    assert ca.choose(req(1, 2, 3, 4), view(matched=[2, 4, 0], assigned_ms=[100, 100, 100])) == 1
    # guard 1.1 * (945 + 4) / 3 = 348.0: node 1 (345 + 4) is over it; node 0 (322) has the next best prefix
    assert ca.choose(req(1, 2, 3, 4), view(matched=[2, 4, 0], assigned_ms=[300, 345, 300])) == 0
    # no prefix anywhere: the least assigned work after it (110, 108, 105; all within 1.1 * 303 / 3 = 111.1),
    # whatever the queues
    assert ca.choose(req(1), view(queued_ms=[30, 5, 90], assigned_ms=[100, 98, 95])) == 2


def test_cache_aware_falls_back_to_the_least_assigned_when_every_node_is_over_the_guard():
    # guard 1.1 * (316 + 4) / 3 = 117.3: 123, 119 and 140 are all over it
    assert p.CacheAware(3, g=0.1).choose(req(1, 2, 3, 4), view(matched=[2, 4, 0], assigned_ms=[101, 115, 100])) == 2


def test_tier_cost_is_queued_work_plus_recompute_plus_load():
    # node 0: 4 * 10 = 40; node 1: 100 + 4 * 1 = 104; node 2: 0 + 3 * 10 + 1 * 1 = 31
    assert p.TierCost(3).choose(req(1, 2, 3, 4), view(matched=[0, 4, 1], queued_ms=[0, 100, 0])) == 2


def test_sglang_balanced_routes_by_match_else_to_the_smallest_tree():
    sg = p.SglangCacheAware(3)
    assert sg.choose(req(1, 2, 3), view()) == 0  # no match: smallest tree (all empty), lowest index
    assert sg.choose(req(1, 2, 9), view()) == 0  # match 2/3 > 0.3
    assert sg.choose(req(5, 6, 7, 8), view()) == 1  # no match: trees hold 4, 0, 0 blocks
    assert sg.choose(req(1, 50, 51, 52), view()) == 2  # match 1/4 <= 0.3: trees 4, 4, 0


@pytest.mark.parametrize("loads, imbalanced", [
    ([70, 5, 5], True),  # 65 > 64 and 70 > 7.5
    ([200, 130, 130], True),  # 70 > 64 and 200 > 195
    ([300, 230, 230], False),  # 70 > 64 but 300 <= 345
    ([190, 130, 130], False),  # 60 <= 64
])  # fmt: skip
def test_sglang_imbalance_rule(loads, imbalanced):
    sg = p.SglangCacheAware(3)
    sg.choose(req(1, 2), view(outstanding=[0, 0, 0]))  # node 0's tree holds the prefix
    assert sg.choose(req(1, 2), view(outstanding=loads)) == (1 if imbalanced else 0)


def test_dynamo_cost_formula():
    # node 0: max(4 - 0.75 * 4, 0) + 4 = 5; node 1: 4 + 4 = 8
    assert p.DynamoCost(2).choose(req(1, 2, 3, 4), view(2, matched=[4, 0])) == 0
    # node 0 now has 10 active blocks: 1 + 14 = 15 > 8
    assert p.DynamoCost(2).choose(req(1, 2, 3, 4), view(2, matched=[4, 0], active_blocks=[10, 0])) == 1
    # 8 blocks, all cached on node 0 (10 active blocks), node 1 with 3 prefill blocks queued: node 1 costs
    # (3 + 8) + 8 = 19; node 0 costs (8 - 8) + 18 = 18 with device credit, (8 - 6) + 18 = 20 with host credit
    wide = view(2, matched=[8, 0], active_blocks=[10, 0], queued_prefill_blocks=[0, 3])
    assert p.DynamoCost(2, tier="device").choose(req(*range(8)), wide) == 0
    assert p.DynamoCost(2, tier="host").choose(req(*range(8)), wide) == 1
    # prefill_load_scale 2 on the host credit: node 0 2 * 1 + 14 = 16, node 1 2 * 4 + 4 = 12
    assert p.DynamoCost(2, prefill_load_scale=2.0).choose(
        req(1, 2, 3, 4), view(2, matched=[4, 0], active_blocks=[10, 0])) == 1


def test_llmd_prefix_takes_the_best_score_ties_to_the_least_loaded():
    assert p.LlmdPrefix(3).choose(req(1, 2, 3), view(matched=[2, 3, 3], outstanding=[0, 5, 2])) == 2


def test_every_policy_is_registered_and_deterministic():
    t = sim.load_trace(TRACES["conversation"])
    t = sim.Trace(t.name, t.timestamps[:400], t.blocks[:400])
    runs = [[sim.simulate(t, p.POLICIES[name](4, 3), 4, 2000, 0.5, sim.Costs()) for name in p.POLICIES]
            for _ in range(2)]  # fmt: skip
    assert runs[0] == runs[1]


# ---------------------------------------------------------------------------------- simulator


def test_simulate_hand_computed():
    """Two nodes of 2 blocks each, round robin: r0 -> node 0 and r1 -> node 1 miss both blocks;
    r2 -> node 0 at 1000 ms hits the prefix (1, 2) and recomputes block 3."""
    costs = sim.Costs()
    prefill, load = costs.prefill_ms, costs.load_ms
    t = sim.Trace("hand", (0.0, 0.0, 1000.0), ((1, 2), (1, 2), (1, 2, 3)))
    r = sim.simulate(t, p.RoundRobin(2), nodes=2, capacity=4, scale=1.0, costs=costs)
    assert r["hit_ratio"] == 2 / 7
    work = [2 * prefill + 2 * load + prefill, 2 * prefill]
    assert r["max_mean_load"] == pytest.approx(max(work) / (sum(work) / 2))
    assert r["ttft_p50"] == pytest.approx(2 * prefill)  # sorted TTFTs: 2 load + 1 prefill, 2 prefill, 2 prefill
    assert r["ttft_p99"] == pytest.approx(2 * prefill)


def test_simulate_queues_fifo_per_node():
    """One node, two requests at once: the second waits for the first, and hits its blocks."""
    costs = sim.Costs()
    t = sim.Trace("fifo", (0.0, 0.0), ((1,), (1,)))
    r = sim.simulate(t, p.RoundRobin(1), nodes=1, capacity=1, scale=1.0, costs=costs)
    assert r["hit_ratio"] == 0.5
    assert r["ttft_p99"] == pytest.approx(costs.prefill_ms + costs.load_ms)


def test_time_scale_sets_utilisation_at_the_given_hits():
    costs = sim.Costs()
    t = sim.Trace("u", (0.0, 100.0), ((1, 2), (1, 2)))
    work = 2 * costs.prefill_ms + 2 * costs.load_ms
    assert sim.time_scale(t, [0, 2], nodes=2, utilisation=0.5, costs=costs) == pytest.approx(work / (2 * 0.5 * 100))


def test_run_rows_stay_under_the_infinite_bound(trace):
    _, t = trace
    rows = sim.run(t, [8], [0.25], [0.7], list(p.POLICIES))
    assert [r["policy"] for r in rows] == list(p.POLICIES)
    for r in rows:
        assert 0 < r["hit_ratio"] <= r["bound_infinite"] and r["max_mean_load"] >= 1.0


# -------------------------------------------------------------------------------- the command


@pytest.fixture
def small_trace(tmp_path) -> Path:
    path = tmp_path / "first300.jsonl"
    path.write_text("".join(TRACES["conversation"].read_text().splitlines(keepends=True)[:300]))
    return path


def test_bench_routing_json(small_trace, capsys):
    argv = ["bench", "routing", "--trace", str(small_trace), "--nodes", "2", "4", "--capacity", "0.25",
            "--utilisation", "0.7", "--json"]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) == 1
    r = json.loads(out)
    assert len(r["rows"]) == 2 * len(p.POLICIES)
    for row in r["rows"]:
        assert set(row) == ROW_KEYS
        assert row["hit_ratio"] <= row["bound_infinite"] and row["bound_pooled"] <= row["bound_infinite"]
    assert {(t["nodes"], t["capacity"], t["utilisation"]) for t in r["targets"]} == {(2, 0.25, 0.7), (4, 0.25, 0.7)}
    beats = {(x["nodes"], x["policy"]) for x in r["beats_pooled"]}
    assert beats == {(row["nodes"], row["policy"]) for row in r["rows"] if row["hit_ratio"] > row["bound_pooled"]}
    if beats:
        print("beats the pooled LRU on the first 300 requests:", sorted(beats))


def test_bench_routing_table(small_trace, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    argv = ["bench", "routing", "--trace", str(small_trace), "--nodes", "2", "--capacity", "0.5",
            "--utilisation", "0.9", "--policy", "cache_aware", "round_robin"]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "cache_aware" in out and "round_robin" in out and "target first300.jsonl N=2" in out


@pytest.mark.parametrize("args, message", [
    (["--trace", "/nonexistent/trace.jsonl"], "cannot read trace"),
    (["--capacity", "0"], "capacity must be in (0, 1]"),
    (["--capacity", "1.5"], "capacity must be in (0, 1]"),
    (["--nodes", "0"], "nodes must be at least 1"),
    (["--utilisation", "-1"], "utilisation must be positive"),
])  # fmt: skip
def test_bench_routing_bad_input(small_trace, capsys, args, message):
    argv = ["bench", "routing", "--json", *args]
    if "--trace" not in args:
        argv += ["--trace", str(small_trace)]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"kvcc bench routing: error: {message}") and captured.err.count("\n") == 1


def test_bench_routing_malformed_trace(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "hash_ids": [1]}\n{"timestamp": 1, "hash_ids": 7}\n')
    assert cli.main(["bench", "routing", "--trace", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{bad}:2: hash_ids is not a list of integers" in err


# ------------------------------------------------------------------- recorded assignments (smg)


def test_replay_follows_the_recorded_assignment_and_nothing_else():
    t = sim.Trace("hand", (0.0, 0.0, 1000.0), ((1, 2), (1, 2), (1, 2, 3)))
    replayed = sim.simulate(t, p.Replay([0, 1, 0]), nodes=2, capacity=4, scale=1.0, costs=sim.Costs())
    assert replayed == sim.simulate(t, p.RoundRobin(2), nodes=2, capacity=4, scale=1.0, costs=sim.Costs())
    with pytest.raises(ValueError, match="routed to node 2, not one of 2"):
        sim.simulate(t, p.Replay([0, 2, 0]), nodes=2, capacity=4, scale=1.0, costs=sim.Costs())
    with pytest.raises(ValueError, match="has 2 requests; the trace has more"):
        sim.simulate(t, p.Replay([0, 1]), nodes=2, capacity=4, scale=1.0, costs=sim.Costs())


def test_run_adds_a_row_per_replay_after_the_policies():
    t = sim.Trace("hand", (0.0, 0.0, 1000.0), ((1, 2), (1, 2), (1, 2, 3)))
    rows = sim.run(t, [2], [1.0], [0.7], ["round_robin"], replays={"smg:round_robin": {2: [0, 1, 0], 4: [0, 1, 2]}})
    assert [r["policy"] for r in rows] == ["round_robin", "smg:round_robin"]
    assert {k: v for k, v in rows[1].items() if k != "policy"} == {k: v for k, v in rows[0].items() if k != "policy"}
    with pytest.raises(ValueError, match="smg:x at N=2: 2 recorded requests, 3 in hand"):
        sim.run(t, [2], [1.0], [0.7], [], replays={"smg:x": {2: [0, 1]}})


def test_load_trace_limit_keeps_the_first_requests():
    t = sim.load_trace(TRACES["conversation"], limit=5)
    assert len(t.blocks) == 5 and t.blocks == sim.load_trace(TRACES["conversation"]).blocks[:5]
    with pytest.raises(ValueError, match="limit must be at least 1"):
        sim.load_trace(TRACES["conversation"], limit=0)


def test_bench_routing_limit(small_trace, capsys):
    argv = ["bench", "routing", "--trace", str(small_trace), "--nodes", "2", "--capacity", "1", "--utilisation", "0.7",
            "--policy", "round_robin", "--limit", "10", "--json"]  # fmt: skip
    assert cli.main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["limit"] == 10 and "smg" not in r
    assert r["rows"][0]["bound_infinite"] == sim.bound_infinite(sim.load_trace(small_trace, 10))


def test_bench_routing_smg_without_smg_is_an_error(small_trace, capsys, monkeypatch):
    """``--smg`` with no smg importable: one line and exit 2, never a table without its rows."""
    monkeypatch.setitem(sys.modules, "smg", None)  # find_spec("smg") is None: as if not installed
    assert cli.main(["bench", "routing", "--trace", str(small_trace), "--smg", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("kvcc bench routing: error: the smg router is not installed: pip install smg==")


# -- throughput at a TTFT bound ---------------------------------------------------------------------


def _three_lone_blocks() -> sim.Trace:
    """Three one-block requests, no block shared, evenly spaced: nothing is ever a hit."""
    return sim.Trace("three", (0.0, 1000.0, 2000.0), ((1,), (2,), (3,)))


def test_sla_point_hand_computed():
    # One node, no cache, each request one block: service 51.2 ms. Arrivals ``gap`` apart queue up
    # when gap < 51.2: the third waits for two, TTFT = 3 x 51.2 - 2 gap, the largest (the p99 of
    # three). Bound 60 ms: gap >= 46.8 ms, so at most 3 requests in 2 x 46.8 ms = 32.05 req/s.
    costs = sim.Costs()
    trace = _three_lone_blocks()
    point = sim.sla_point(trace, lambda: p.RoundRobin(1), 1, 0, [0, 0, 0], 60.0, costs)
    assert not point["capped"] and point["ttft_p99"] <= 60.0
    gap_ms = (3 * costs.prefill_ms - 60.0) / 2
    assert point["max_rps"] == pytest.approx(3 / (2 * gap_ms / 1000), rel=1e-3)


def test_sla_point_misses_a_bound_below_one_service_time_and_caps_a_loose_one():
    costs, trace = sim.Costs(), _three_lone_blocks()
    missed = sim.sla_point(trace, lambda: p.RoundRobin(1), 1, 0, [0, 0, 0], costs.prefill_ms / 2, costs)
    assert missed["max_rps"] is None and missed["utilisation"] is None
    loose = sim.sla_point(trace, lambda: p.RoundRobin(1), 1, 0, [0, 0, 0], 10 * costs.prefill_ms, costs)
    assert loose["capped"] and loose["utilisation"] == sim.SLA_UTILISATION_RANGE[1]


def test_sla_rows_carry_the_recompute_and_round_robin_baselines(trace):
    _, whole = trace
    small = sim.Trace(whole.name, whole.timestamps[:400], whole.blocks[:400])
    rows = sim.sla(small, [2], [0.5], ["cache_aware"], 30_000.0)
    by = {r["policy"]: r for r in rows}
    assert list(by) == [sim.RECOMPUTE, "round_robin", "cache_aware"]
    assert by[sim.RECOMPUTE]["hit_ratio"] == 0 and by[sim.RECOMPUTE]["vs_recompute"] == 1
    assert by["round_robin"]["vs_round_robin"] == 1
    for r in rows:
        assert r["max_rps"] is None or r["ttft_p99"] <= 30_000.0
    # Caching and routing to the cache serve more within the same bound than recomputing everything.
    assert by["cache_aware"]["hit_ratio"] > 0 and by["cache_aware"]["vs_recompute"] > 1


def test_bench_routing_sla_json(small_trace, capsys):
    argv = ["bench", "routing", "--trace", str(small_trace), "--nodes", "2", "--capacity", "0.5",
            "--utilisation", "0.7", "--policy", "cache_aware", "--sla-ms", "30000", "--json"]  # fmt: skip
    assert cli.main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["sla"]["bound"] == "p99 TTFT <= 30000 ms"
    assert [x["policy"] for x in r["sla"]["rows"]] == [sim.RECOMPUTE, "round_robin", "cache_aware"]
    assert cli.main(["bench", "routing", "--trace", str(small_trace), "--sla-ms", "0"]) == 2
    assert "--sla-ms must be positive" in capsys.readouterr().err
