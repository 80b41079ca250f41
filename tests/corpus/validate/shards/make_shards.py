"""Build the trace validator's two-shard corpus (docs/sharding.md, step 4): traces of a sharded
directory (``"directory-0"``, ``"directory-1"``), each with the verdict it must get.

    python tests/corpus/validate/shards/make_shards.py

- ``split-<case>``: a corpus trace of one directory (``../manifest.json``) split into two shards
  by chain root (``tests/test_validate_shards.py``, ``split``): the verdict of the unsplit trace;
- ``declared-by-one-shard``, ``restarted-shard``, ``namespace-invalidated-by-shard-0``: two spec
  behaviours of one directory over disjoint keys, merged as two shards (a shard's declaration,
  restart or namespace invalidation is its own keys' alone): ACCEPTED;
- ``key-in-two-shards``: a key's directory steps logged by both shards: REJECTED.

``manifest.json`` records per case the file, the lease term and epsilon, where it came from and
the verdict (status, code, event index). ``tests/test_validate_shards.py`` checks every case.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))  # tests/

import test_validate_shards as shards  # noqa: E402

from kvcc.conformance.validate import validate_trace  # noqa: E402

SPLIT = ("cluster-directory-restarts.ndjson", "cluster-revoke-after-expiry.ndjson", "reference-KVCC-INVAL-004.ndjson",
         "reference-FAULT-009-unlogged-host.ndjson")  # fmt: skip


def main() -> None:
    cases = []

    def add(name, events, params, origin):
        (HERE / name).write_text("".join(json.dumps(e, separators=(",", ":")) + "\n" for e in events))
        v = validate_trace(events, params)
        cases.append({"file": name, "lease_term_ms": params.lease_term_ms, "skew_ms": params.skew_ms,
                      "tick_ms": params.tick_ms, "locations": params.locations, "origin": origin,
                      "expected": {"status": v.status, "code": v.code, "event_index": v.event_index}})  # fmt: skip

    by_file = {c["file"]: c for c in shards._corpus_cases()}
    for file in SPLIT:
        case = by_file[file]
        events, _ = shards.split(shards._read(case))
        add(f"split-{file}", events, shards.TraceParams(case["lease_term_ms"], case["skew_ms"]),
            f"../{file} split into two shards by chain root (each key-less directory event logged by both)")
    for make in (shards.declared_by_one_shard, shards.restarted_shard, shards.namespace_invalidated_by_shard_0):
        events, params = make()
        add(make.__name__.replace("_", "-") + ".ndjson", events, params, f"tests/test_validate_shards.py, {make.__name__}: "
            + " ".join((make.__doc__ or "").split()))
    events, params = shards.restarted_shard()
    moved = shards.index_of(events, "revoke_acked")
    bad = shards.resequence(events[:moved] + [dict(events[moved], node="directory-1")] + events[moved + 1 :])
    add("key-in-two-shards.ndjson", bad, params, "restarted-shard.ndjson with shard 0's revoke_acked logged by shard 1")
    (HERE / "manifest.json").write_text(json.dumps({"cases": cases}, indent=1) + "\n")


if __name__ == "__main__":
    main()
