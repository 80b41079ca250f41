"""``kvcc bench routing --calibrate``: the simulator's per-block costs measured in the same run --
the prefill of the tiny Llama the vLLM adapter serves here (``transformers`` on this CPU) and the
reference DRAM tier's verified read of its KV block -- instead of the modelled 70B-class ones.
Needs the vllm extra (``bash scripts/setup.sh --with vllm``). No test asserts a measured figure:
only that the costs the simulator ran with are the ones measured, and how they follow from them."""

from __future__ import annotations

import json
import statistics

import pytest

from kvcc import cli
from kvcc.bench import routing
from kvcc.reference.routing import sim


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory):
    lines = sim.default_traces()[0].read_text().splitlines()[:200]
    path = tmp_path_factory.mktemp("trace") / "first200.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_calibrate_measures_the_model_and_the_tier():
    costs, measured = routing.calibrate()
    assert measured["model"] == "kvcc/tiny-llama" and len(measured["prefill_s_per_block"]) == routing.CALIBRATION_REPS
    assert costs.prefill_tokens_per_s == pytest.approx(sim.BLOCK_TOKENS / statistics.median(measured["prefill_s_per_block"]))
    # K and V, per layer and KV head, head_dim values of bfloat16
    assert costs.kv_bytes_per_token == 2 * 2 * 2 * 64 * 2 and measured["block_bytes"] == 1024 * sim.BLOCK_TOKENS
    assert costs.load_gbps == measured["dram_read_gb_per_s"] > 0 and measured["nvme_read_gb_per_s"] > 0
    assert costs.load_ms == pytest.approx(1000.0 * measured["block_bytes"] / (costs.load_gbps * 1e9))


def test_bench_routing_runs_on_the_measured_costs(small_trace, capsys):
    argv = ["bench", "routing", "--trace", str(small_trace), "--nodes", "2", "--capacity", "0.25",
            "--utilisation", "0.7", "--policy", "cache_aware", "round_robin", "--calibrate", "--json"]  # fmt: skip
    assert cli.main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    c, m = r["costs"], r["costs"]["measured"]
    assert m is not None and c["prefill_tokens_per_s"] == m["prefill_tokens_per_s"]
    assert c["prefill_ms_per_block"] == pytest.approx(1000.0 * sim.BLOCK_TOKENS / m["prefill_tokens_per_s"])
    assert c["load_gbps"] == m["dram_read_gb_per_s"]
    modelled = sim.Costs()
    assert c["prefill_ms_per_block"] != modelled.prefill_ms and c["load_ms_per_block"] != modelled.load_ms
    # the simulator ran on them: the same rows again from those costs, other rows from the modelled ones
    again = sim.Costs(prefill_tokens_per_s=c["prefill_tokens_per_s"], load_gbps=c["load_gbps"],
                      kv_bytes_per_token=c["kv_bytes_per_token"])  # fmt: skip
    args = ([small_trace], [2], [0.25], [0.7], ["cache_aware", "round_robin"])
    assert routing.measure(*args, costs=again)["rows"] == r["rows"]
    assert routing.measure(*args)["rows"] != r["rows"]


def test_a_bad_trace_is_refused_before_anything_is_measured(tmp_path, capsys, monkeypatch):
    def never():
        raise AssertionError("calibrated before the trace was read")

    monkeypatch.setattr(routing, "calibrate", never)
    assert cli.main(["bench", "routing", "--trace", str(tmp_path / "none.jsonl"), "--calibrate"]) == 2
    assert "cannot read trace" in capsys.readouterr().err
