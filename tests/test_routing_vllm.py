"""``kvcc bench routing --live-vllm``: a trace routed through real vLLM engines (CPU) that share a
kvcc cluster through ``KvccConnector``, the router fed by the engines' KV events. A hand-made
trace, where every hit can be counted by hand: whichever engine serves, every repeated block is
a hit (the engine's own prefix cache or kvcc's pool, which has room for every save here), and the engine's
own account of each hit is split by its connector's counters into local and kvcc. No test asserts
a measured time.

Needs the ``vllm`` extra (``bash scripts/setup.sh --with vllm``); without it the test fails naming
that command. It shares test_vllm's xdist group, so engine starts never run side by side.
"""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from kvcc.adapters.vllm import harness
from kvcc.bench import routing, routing_vllm
from kvcc.reference.routing import sim

pytestmark = pytest.mark.xdist_group("vllm-engine")


def test_every_repeated_block_is_a_hit_from_the_engine_or_from_kvcc(tmp_path):
    try:
        harness.check_installed()
    except harness.VllmNotInstalled as e:
        pytest.fail(f"the vllm extra is required (bash scripts/setup.sh --with vllm): {e}")
    # refs 4 + 6 + 3 + 5 + 4 + 6 = 28; repeated: 1-4 (request 2), 7-9 (request 5's 7-8-9, of 4),
    # 1-4 again (request 4), 1-4-5-6 (request 6): 4 + 0 + 4 + 3 + 6 = 17 hits of 28.
    requests = [[1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [7, 8, 9], [1, 2, 3, 4, 10], [7, 8, 9, 11], [1, 2, 3, 4, 5, 6]]
    path = tmp_path / "hand.jsonl"
    path.write_text("".join(json.dumps({"timestamp": 1000 * i, "hash_ids": r}) + "\n" for i, r in enumerate(requests)))
    trace = sim.load_trace(path)
    assert sim.bound_infinite(trace) == pytest.approx(17 / 28)
    # kvcc's pool at twice the trace's 11 unique blocks: 11 slots on each node, so no save is
    # refused and every block computed once can be loaded anywhere after. cache_aware's guard is
    # on the work measured so far (its engines' TTFTs), so its route varies from run to run;
    # with room for every save, the hits may not. (At 1.0, 5 slots a node, a refused save
    # turned a route that left the engine holding a prefix into 2 misses: 15/28.)
    rows = routing_vllm.run(trace, [2], [2.0], ["round_robin", "cache_aware"], workdir=tmp_path)
    by = {r["policy"]: r for r in rows}
    for r in rows:
        row = json.dumps(r, sort_keys=True)
        assert r["hit_ratio"] == pytest.approx(17 / 28), row
        assert r["local_hit_ratio"] + r["kvcc_hit_ratio"] == pytest.approx(r["hit_ratio"]), row
        assert r["requests_per_engine"] and sum(r["requests_per_engine"]) == len(requests), row
        # every block an engine computed (28 - 17) is planned for save once, and each is saved
        assert r["saves"]["blocks_planned_for_save"] == 11 and r["saves"].get("saved_blocks") == 11, row
    # Round robin (engine 0, 1, 0, 1 ...) serves request 2 on the engine that did not compute 1-4:
    # it loads them from kvcc, saved by the other engine; every later hit is in the serving
    # engine's own cache (4: 1-4 on engine 1; 3: 7-9 on engine 0; 6: 1-6 on engine 1).
    out = io.StringIO()
    routing.render_live_vllm(Console(file=out, width=250), {"block_tokens": 32, "rows": rows, "against": "bounds"})
    assert "round_robin" in out.getvalue() and "cache_aware" in out.getvalue()
    rr = by["round_robin"]
    row = json.dumps(rr, sort_keys=True)
    assert rr["kvcc_hit_ratio"] == pytest.approx(4 / 28) and rr["local_hit_ratio"] == pytest.approx(13 / 28), row
    assert rr["requests_per_engine"] == [3, 3] and rr["events_late"] == 0, row
