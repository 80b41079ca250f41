"""The performance suite (``kvcc bench suite``) on the reference adapter: real processes on
loopback, so apart from ``test_bench_suite.py``'s in-process checks."""

from __future__ import annotations

from dataclasses import replace

from kvcc.bench import suite

SMALL = replace(suite.PROFILES["quick"], ops_per_client=20, chain_len=4, sizes=(4 << 10, 64 << 10),
                bandwidth_reps=2, invalidation_reps=2, trace_requests=30)  # fmt: skip


def test_invalidation_by_expiry_on_the_reference(tmp_path):
    """The reference pauses a holder by freezing its node and its client's loop. The paused holder
    is the first node, and the reference adapter waited for the ticket through the first node's
    client -- the frozen one -- so the wait ended in a timeout (the full profile's invalidation
    workload was an error). It waits through a running node's client now."""
    from kvcc.adapters.reference import reference

    profile = replace(SMALL, holders=(0, 1), invalidation_reps=1, expiry=True)
    out = suite.run_workload(suite.invalidation, reference, profile, 5, tmp_path / "work", lambda text: None)
    assert out["status"] == "ok", out.get("traceback", out)
    (expiry,) = [r for r in out["rows"] if r["mode"] == "expiry"]
    assert expiry["grants"] == 1 and expiry["ticket_keys"] == 1
