"""The real SGLang router (``smg``) in front of stand-in workers (``kvcc.bench.smg_router``): every
request routed exactly once, ``round_robin`` even, ``cache_aware`` keeping shared prefixes on the
worker that holds them, nothing left running afterwards, and smg's ``cache_aware`` hit ratio
against the simulator's model of it (``sglang_cache_aware``) on the same slice.

smg must be installed (``pip install smg==1.13.0``): without it every test here fails with that
message rather than being skipped."""

from __future__ import annotations

import json
import os
import statistics
import threading
from collections import Counter

import pytest

from kvcc import cli
from kvcc.bench import smg_router
from kvcc.reference.routing import sim

SLICE = 200  # the first requests of the conversation trace: 40 of them share > 30% with an earlier one
WORKERS = 4
MODELLED_RUNS = 3


@pytest.fixture(scope="module", autouse=True)
def smg_installed() -> None:
    try:
        smg_router.require_smg()
    except smg_router.SmgError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="module")
def trace() -> sim.Trace:
    return sim.load_trace(sim.default_traces()[0], SLICE)


@pytest.fixture(scope="module")
def cache_aware(trace) -> smg_router.SmgRun:
    return smg_router.route(trace.blocks, "cache_aware", WORKERS)


@pytest.fixture(scope="module")
def cache_aware_modelled(trace) -> list[smg_router.SmgRun]:
    """smg's cache_aware with only the rules the simulator's model has (warm-up rules off), three
    runs: where it places a request that shares less than its threshold with any earlier one
    varies from run to run (ties between trees, in an order smg does not fix)."""
    return [smg_router.route(trace.blocks, "cache_aware", WORKERS, flags=smg_router.MODELLED_RULES_ONLY)
            for _ in range(MODELLED_RUNS)]  # fmt: skip


@pytest.fixture(scope="module")
def round_robin(trace) -> smg_router.SmgRun:
    return smg_router.route(trace.blocks, "round_robin", WORKERS)


def _gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_prompts_share_text_exactly_where_requests_share_blocks():
    shared = smg_router.prompt([7, 8, 9])
    assert shared.startswith(smg_router.prompt([7, 8])) and not shared.startswith(smg_router.prompt([7, 9]))
    assert len(smg_router.block_text(7).split()) == sim.BLOCK_TOKENS
    assert smg_router.block_text(7) != smg_router.block_text(8)


def test_every_request_is_routed_to_exactly_one_worker(trace, cache_aware):
    """``route`` itself checks that each request index reached exactly one stand-in; here the
    assignment covers the slice and smg registered the stand-ins through the probes they answer."""
    assert len(cache_aware.assignment) == len(trace.blocks)
    assert set(cache_aware.assignment) <= set(range(WORKERS))
    assert {"/health", "/v1/models"} <= cache_aware.probes


def test_round_robin_spreads_evenly(round_robin):
    counts = Counter(round_robin.assignment)
    assert sorted(counts) == list(range(WORKERS)) and max(counts.values()) - min(counts.values()) <= 1


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _followed(trace: sim.Trace, assignment: tuple[int, ...]) -> tuple[int, int]:
    """(followed, shared): of the requests that share more than smg's cache threshold (30%) of their
    blocks with an earlier request, how many went where an earlier request with the longest shared
    prefix went."""
    followed = shared = 0
    for i, blocks in enumerate(trace.blocks):
        common = [_common_prefix(trace.blocks[j], blocks) for j in range(i)]
        best = max(common, default=0)
        if blocks and best / len(blocks) > 0.3:
            shared += 1
            followed += assignment[i] in {assignment[j] for j in range(i) if common[j] == best}
    return followed, shared


def test_cache_aware_follows_shared_prefixes(trace, cache_aware):
    """With smg's defaults, a request sharing more than its threshold follows its prefix -- mostly:
    smg's warm-up rule (``--worker-warmup-divert-every``, default 8) diverts one cache hit in 8 to a
    thin worker. The bar is that share of diversions (runs measured 40 of 40)."""
    followed, shared = _followed(trace, cache_aware.assignment)
    print(f"smg cache_aware: {followed} of {shared} requests sharing > 30% followed their prefix")
    assert shared >= 30 and followed >= 7 / 8 * shared


def test_cache_aware_with_the_modelled_rules_always_follows(trace, cache_aware_modelled):
    """With the warm-up rules off, nothing but load may divert a request from its prefix's worker,
    and the stand-ins leave no load: every run follows every shared prefix, as the model does."""
    counts = [_followed(trace, run.assignment) for run in cache_aware_modelled]
    assert all(shared >= 30 and followed == shared for followed, shared in counts), counts


def test_a_repeated_prompt_stays_on_one_worker(trace):
    """The same prompt sent again and again, between distinct ones, lands on one worker."""
    repeated = trace.blocks[0]
    requests = [blocks for other in trace.blocks[1:17] for blocks in (repeated, other)]
    run = smg_router.route(requests, "cache_aware", WORKERS)
    assert len({run.assignment[i] for i in range(0, len(requests), 2)}) == 1


def test_nothing_is_left_running(cache_aware, cache_aware_modelled, round_robin):
    assert all(_gone(run.pid) for run in (cache_aware, *cache_aware_modelled, round_robin))
    assert not [t for t in threading.enumerate() if t.name.startswith("kvcc-stand-in")]


def test_smg_is_stopped_when_the_caller_fails():
    worker = smg_router.StandInWorker()
    try:
        with pytest.raises(RuntimeError, match="caller"):
            with smg_router.smg_router("cache_aware", [worker.url]) as (_, proc):
                raise RuntimeError("the caller failed")
    finally:
        worker.close()
    assert proc.returncode is not None and _gone(proc.pid)


def test_cache_aware_hit_ratio_against_the_simulator(trace, cache_aware_modelled, round_robin):
    """smg's assignments replayed through the simulator against the modelled router. smg runs with
    the rules the model has and no others (``MODELLED_RULES_ONLY``: its warm-up rules, which divert
    misses and one hit in 8 to workers on timers, are off; with them on, single runs measured 0.75
    to 0.92 of the model on this slice, and one fell to round robin's level). It is still not the
    model: a request sharing less than the threshold goes to the smallest tree, ties in an order
    smg does not fix, where the model sees modelled queues; what such a request hits is chance in
    both. With the rules off, 65 single runs measured 0.80 to 1.00 of the model (median 0.92; a
    third of them with the CPUs busy) and round robin is at 0.73: the median of three runs must
    beat round robin and reach 0.8 of the model. smg's round robin, replayed, must be the
    simulator's (the nodes are symmetric, so any cyclic order gives the same row, but for the
    order of a float sum)."""
    replays = {f"smg:cache_aware:{k}": {WORKERS: run.assignment} for k, run in enumerate(cache_aware_modelled)}
    replays["smg:round_robin"] = {WORKERS: round_robin.assignment}
    rows = sim.run(trace, [WORKERS], [0.25, 1.0], [0.7], ["sglang_cache_aware", "round_robin"], replays=replays)
    by = {(r["capacity"], r["policy"]): r for r in rows}
    for (capacity, policy), r in sorted(by.items()):
        print(f"F={capacity:g} {policy:20} hit {r['hit_ratio']:.4f} (infinite {r['bound_infinite']:.4f}) "
              f"max/mean {r['max_mean_load']:.3f}")  # fmt: skip
    model, rr = by[1.0, "sglang_cache_aware"]["hit_ratio"], by[1.0, "round_robin"]["hit_ratio"]
    smg = statistics.median(by[1.0, f"smg:cache_aware:{k}"]["hit_ratio"] for k in range(MODELLED_RUNS))
    assert rr < smg and smg >= 0.8 * model
    for capacity in (0.25, 1.0):
        for metric in ("hit_ratio", "max_mean_load", "ttft_p50", "ttft_p99"):
            assert by[capacity, "smg:round_robin"][metric] == pytest.approx(by[capacity, "round_robin"][metric])


def test_bench_routing_smg_rows(tmp_path, capsys):
    """``kvcc bench routing --smg`` adds a row per smg policy to every configuration, in the same run."""
    argv = ["bench", "routing", "--trace", str(sim.default_traces()[0]), "--limit", "50", "--nodes", "2",
            "--capacity", "0.5", "1", "--utilisation", "0.7", "--policy", "round_robin",
            "--smg-policy", "cache_aware", "round_robin", "--json"]  # fmt: skip
    assert cli.main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert [(x["capacity"], x["policy"]) for x in r["rows"]] == [
        (c, p) for c in (0.5, 1.0) for p in ("round_robin", "smg:cache_aware", "smg:round_robin")]
    assert [(x["policy"], x["nodes"], x["requests"]) for x in r["smg"]["runs"]] == [
        ("cache_aware", 2, 50), ("round_robin", 2, 50)]
