"""The trace validator on a sharded directory (docs/sharding.md, step 4): several directory
processes (``"directory-0"``, ``"directory-1"``, ...), each owning the keys it logged steps of,
sharing the nodes.

- A corpus trace of one directory split into two shards by chain root (each key-scoped directory
  event moved to its root's shard, each key-less one -- a restart, a declaration, a rejoin, a
  namespace's invalidation -- logged by both at once) gets the verdict of the unsplit trace.
- A shard's failure events are its own keys' alone: a declaration or a restart of shard 1 leaves
  shard 0's keys as they were (both REJECTED by a validator that takes every directory event
  for the one directory's).
- A key with steps in two shards, a read granted after the shard's own namespace invalidation
  completed, a lease id granted by two shards: REJECTED.
"""

from __future__ import annotations

import json
import os

import pytest

from kvcc.conformance.validate import (
    ACCEPTED,
    DIRECTORY_EVENTS,
    FAILURE_EVENTS,
    REJECTED,
    TraceParams,
    params_for_walk,
    render,
    validate_trace,
)
from kvcc.spec.config import ModelConfig
from kvcc.spec.model import SILENT_ACTIONS, Model

for _var, _val in (("DO_NOT_TRACK", "1"), ("VLLM_NO_USAGE_STATS", "1"), ("LMCACHE_TRACK_USAGE", "false"), ("HF_HUB_OFFLINE", "1")):
    os.environ.setdefault(_var, _val)

CORPUS = os.path.join(os.path.dirname(__file__), "corpus", "validate")
KEYED = DIRECTORY_EVENTS - FAILURE_EVENTS - {"invalidate_namespace"}  # a directory step on one key
SHARDS = 2


def resequence(events):
    """Renumber seq per log in list order and keep each log's local clock from going back."""
    seq, last = {}, {}
    out = []
    for e in events:
        e = dict(e)
        log = (e["node"], e["incarnation"])
        seq[log] = e["seq"] = seq.get(log, 0) + 1
        e["t_local_ns"] = last[log] = max(e["t_local_ns"], last.get(log, -1) + 1)
        out.append(e)
    return out


def chain_roots(events):
    """Each key's chain root, from the ``parent`` the directory logged for it."""
    parent = {}
    for e in events:
        if e.get("key") is not None and e.get("parent") is not None:
            parent.setdefault(e["key"], e["parent"])

    def root(k):
        seen = set()
        while k in parent and k not in seen:
            seen.add(k)
            k = parent[k]
        return k

    return root


def split(events, shards=SHARDS):
    """``events`` of one directory as ``shards`` shards: each key-scoped directory event logged by
    ``directory-<shard of its chain's root>`` (roots dealt out in order of first appearance),
    each key-less directory event by every shard at once (the copies one after another, at the
    same times), each log's seq renumbered. Returns the events and, for each, the index of the
    event it came from."""
    directories = {e["node"] for e in events if e["event"] in DIRECTORY_EVENTS}
    assert len(directories) == 1, directories
    (directory,) = directories
    root = chain_roots(events)
    shard_of_root = {}
    for e in events:
        if e.get("key") is not None:
            shard_of_root.setdefault(root(e["key"]), len(shard_of_root) % shards)
    out, origin = [], []
    for i, e in enumerate(events):
        if e["node"] != directory:
            out.append(dict(e))
            origin.append(i)
        elif e["event"] in KEYED and e.get("key") is not None:
            out.append(dict(e, node=f"directory-{shard_of_root[root(e['key'])]}"))
            origin.append(i)
        else:
            for s in range(shards):
                out.append(dict(e, node=f"directory-{s}"))
                origin.append(i)
    return resequence(out), origin


def _corpus_cases():
    with open(os.path.join(CORPUS, "manifest.json")) as f:
        return json.load(f)["cases"]


def _read(case):
    with open(os.path.join(CORPUS, case["file"])) as f:
        return [json.loads(line) for line in f if line.strip()]


def _splittable(case):
    """A corpus trace of one directory with more than one chain, or with key-less directory
    events: splitting it gives each shard something (a one-key trace without them is the same
    trace renamed). A trace of a sharded run is split already."""
    events = _read(case)
    if len({e["node"] for e in events if e["event"] in DIRECTORY_EVENTS}) > 1:
        return False
    root = chain_roots(events)
    roots = {root(e["key"]) for e in events if e.get("key") is not None}
    keyless = any(e["event"] in DIRECTORY_EVENTS and (e["event"] not in KEYED or e.get("key") is None) for e in events)
    return len(roots) > 1 or keyless


SPLIT_CASES = [c for c in _corpus_cases() if _splittable(c)]


def test_the_split_cases_cover_failures_cascades_and_both_verdicts():
    names = set()
    for case in SPLIT_CASES:
        names |= {e["event"] for e in _read(case) if e["event"] in DIRECTORY_EVENTS and e.get("key") is None}
    assert {"restart_directory", "declare_node_down", "restart_node", "invalidate_namespace"} <= names
    assert {c["expected"]["status"] for c in SPLIT_CASES} == {ACCEPTED, REJECTED}
    assert len(SPLIT_CASES) >= 20


@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: c["file"])
def test_a_trace_split_into_two_shards_gets_the_verdict_of_the_trace(case):
    """Two shards that restart, declare and take rejoins at the same moments, each over its own
    chains, are the one directory: the same verdict, at the same event (the one it came from)."""
    events = _read(case)
    sharded, origin = split(events)
    assert {e["node"] for e in sharded if e["event"] in DIRECTORY_EVENTS} == {f"directory-{s}" for s in range(SHARDS)}
    v = validate_trace(sharded, TraceParams(case["lease_term_ms"], case["skew_ms"]))
    got = {"status": v.status, "code": v.code, "event_index": None if v.event_index is None else origin[v.event_index]}
    assert got == case["expected"], v.reason


# ------------------------------------------------------------------------- shards acting apart
#
# Two spec behaviours of one directory each, rendered with the same seed (so the same node names,
# keys, namespaces and clocks), one on key 0 and one on key 1, merged as shard 0 and shard 1 of a
# sharded directory: each shard's directory events under its own name, lease ids interleaved
# (shard i's ids = i mod 2), the nodes' logs merged in time, and a crash both behaviours took at
# the same tick logged once.

CFG = ModelConfig(
    name="shards-test", nodes=2, parents=(-1, -1), namespaces=(0, 0), authorized=(frozenset({0}), frozenset({0})),
    tiers_per_node=1, shared_pool=True, lease_term_ticks=8, skew_ticks=1, max_epoch=2, max_lease_id=4,
    max_requests=2, max_messages=3, max_node_crashes=1, max_directory_restarts=1,
)  # fmt: skip
MODEL = Model(CFG)
A, B = 0, 1  # nodes
TIER_A, TIER_B = 0, 1  # their tiers (location ids)
SEED = 7


def walk(script):
    """``script``: ``(label, params)`` entries, a ``None`` param matching any; ``("tick", n)``."""
    s = MODEL.init_states()[0]
    out = []
    for label, params in script:
        for _ in range(params if label == "tick" else 1):
            if label == "tick":
                s2 = MODEL.tick(s)  # a tick in which nothing counts is no successor, but time all the same
                assert s2 is not None, f"step {len(out)}: time cannot pass (an urgent directory step is due)"
                out.append(("tick", (), s, s2))
                s = s2
                continue
            for lab, p, s2 in MODEL.successors(s):
                if lab == label and len(p) == len(params) and all(x is None or x == y for x, y in zip(params, p)):
                    out.append((lab, p, s, s2))
                    s = s2
                    break
            else:
                raise AssertionError(f"step {len(out)}: no successor {label}{params}")
    return render(MODEL, out, seed=SEED)


def write(n, k, loc):
    return [("begin_write", (n, k)), ("grant_write_lease", (n, k, loc)), ("start_writing", (n, k, None)),
            ("store_bytes", (n, k, loc)), ("commit_write", (n, k, None))]  # fmt: skip


def lease_of(n, k):
    return [("acquire", (n, k)), ("grant_read_lease", (n, k, None)), ("trust_read_lease", (n, k, None))]


def merge(*shards):
    """The walks as shards 0, 1, ... of one sharded directory: one merged trace and its params."""
    out = []
    crashes = set()
    for i, w in enumerate(shards):
        for tick, e in zip(ticks_of(w), w.events):
            e = dict(e, _tick=tick)
            if e["event"] == "crash":
                if (e["crashed"], e["lose_disk"]) in crashes:
                    continue  # the same crash, taken by both behaviours at the same tick: logged once
                crashes.add((e["crashed"], e["lose_disk"]))
            if e["node"] == "directory":
                e["node"] = f"directory-{i}"
            if e["lease"] is not None:
                e["lease"] = e["lease"] * len(shards) + i
            out.append(e)
    # In time, tick by tick: within a tick, each walk's events keep their order (a walk stamps
    # each event somewhere in the tick it happened in, not in order within it).
    out.sort(key=lambda e: e["_tick"])
    return resequence([{f: v for f, v in e.items() if f != "_tick"} for e in out]), params_for_walk(shards[0])


def ticks_of(w):
    """The tick each event of a rendered walk happened in."""
    out, t = [], 0
    for label, _ in w.steps:
        if label == "tick":
            t += 1
        elif label not in SILENT_ACTIONS:
            out.append(t)
    assert len(out) == len(w.events)
    return out


def verdict(events, params):
    v = validate_trace(events, params)
    return v.status, v.code, v.event_index


def index_of(events, name, node=None, nth=0):
    return [i for i, e in enumerate(events) if e["event"] == name and (node is None or e["node"] == node)][nth]


def declared_by_one_shard():
    """B writes a key in each shard to its own tier and crashes; shard 1 declares it down (its key
    voided), shard 0 does not yet and, later, grants A a read lease on B's copy of its key."""
    detect = CFG.failure_detection_ticks
    shard0 = walk(write(B, 0, TIER_B) + [("tick", 1), ("crash", (B, 0)), ("tick", detect)] + lease_of(A, 0))
    shard1 = walk(write(B, 1, TIER_B) + [("tick", 1), ("crash", (B, 0)), ("clock_forward", (-1,)), ("tick", detect - 1),
                                         ("declare_node_down", (B,))])
    return merge(shard0, shard1)


def test_a_declaration_is_its_shards_alone():
    events, params = declared_by_one_shard()
    declared, granted = index_of(events, "declare_node_down"), index_of(events, "grant_read_lease")
    assert events[declared]["node"] == "directory-1" and events[granted]["node"] == "directory-0"
    assert declared < granted and events[declared]["t_wall_ns"] < events[granted]["t_wall_ns"]
    assert verdict(events, params) == (ACCEPTED, None, None)
    # Shard 0 declaring B down too, before its grant: the grant on B's copy is then impossible.
    also = resequence(events[:granted - 1] + [dict(events[declared], node="directory-0")] + events[granted - 1:])
    assert verdict(also, params) == (REJECTED, "no_spec_step", granted + 1)


def restarted_shard():
    """A holds a read lease on each shard's key; shard 1 restarts (its lease table gone, a grace
    to wait); shard 0, just after, invalidates its key, revokes A's lease and completes."""
    shard0 = walk(write(B, 0, TIER_B) + [("tick", 1)] + lease_of(A, 0) + [
        ("tick", 5), ("invalidate", (0,)), ("drop_and_ack", (A, 0, None)), ("revoke_acked", (A, 0, None)),
        ("complete_invalidation", (0,))])  # fmt: skip
    shard1 = walk(write(B, 1, TIER_B) + lease_of(A, 1) + [("tick", 3), ("restart_directory", (None,))])
    return merge(shard0, shard1)


def test_a_restart_is_its_shards_alone():
    events, params = restarted_shard()
    restart, done = index_of(events, "restart_directory"), index_of(events, "complete_invalidation")
    assert (events[restart]["node"], events[restart]["incarnation"]) == ("directory-1", 2)
    assert events[done]["node"] == "directory-0"
    assert events[restart]["t_wall_ns"] + params.skew_ms * 2_000_000 < events[index_of(events, "invalidate")]["t_wall_ns"]
    assert verdict(events, params) == (ACCEPTED, None, None)
    # The same restart taken by shard 0 (its next events in its new incarnation): the lease it
    # forgot is never revoked, and A's acknowledgement of a revocation is impossible.
    shard0 = resequence([dict(e, node="directory-0") if i == restart else dict(e, incarnation=2)
                         if i > restart and e["node"] == "directory-0" else e for i, e in enumerate(events)])  # fmt: skip
    assert verdict(shard0, params) == (REJECTED, "no_spec_step", index_of(events, "drop_and_ack"))


def namespace_invalidated_by_shard_0():
    """A key in each shard, one namespace: shard 0 invalidates the namespace (its key) and
    completes; shard 1, which has not taken its part yet, then grants A a read lease on its key."""
    shard0 = walk(write(B, 0, TIER_B) + [("tick", 1), ("invalidate_namespace", (0,)), ("complete_invalidation", (0,))])
    shard1 = walk(write(B, 1, TIER_B) + [("tick", 4)] + lease_of(A, 1))
    return merge(shard0, shard1)


def test_a_namespace_invalidation_voids_its_shards_keys_alone():
    events, params = namespace_invalidated_by_shard_0()
    inval, granted = index_of(events, "invalidate_namespace"), index_of(events, "grant_read_lease")
    assert events[inval]["node"] == "directory-0" and events[granted]["node"] == "directory-1"
    assert events[inval]["t_wall_ns"] + params.skew_ms * 2_000_000 < events[granted]["t_wall_ns"]
    assert verdict(events, params) == (ACCEPTED, None, None)


def test_a_read_granted_after_its_shards_namespace_invalidation_is_rejected():
    """The cascade still applies within the shard: shard 0 grants a read of its key after its
    own invalidation of the key's namespace completed."""
    events, params = namespace_invalidated_by_shard_0()
    granted = index_of(events, "grant_read_lease")
    key0 = events[index_of(events, "commit_write", "directory-0")]["key"]
    acquire, grant = events[granted - 1], events[granted]
    assert acquire["event"] == "acquire"
    grant0 = dict(grant, node="directory-0", key=key0, lease=grant["lease"] + 1)  # an id of shard 0's
    bad = resequence(events[:granted - 1] + [dict(acquire, key=key0), grant0] + events[granted - 1:])
    assert verdict(bad, params) == (REJECTED, "no_spec_step", granted)


def test_a_key_with_steps_in_two_shards_is_rejected():
    events, params = restarted_shard()
    moved = index_of(events, "revoke_acked")
    assert events[moved]["node"] == "directory-0"
    bad = resequence(events[:moved] + [dict(events[moved], node="directory-1")] + events[moved + 1:])
    v = validate_trace(bad, params)
    assert (v.status, v.code, v.event_index) == (REJECTED, "key_in_two_shards", moved), v.reason
    assert "'directory-0'" in v.reason and "'directory-1'" in v.reason


def test_a_lease_id_granted_by_two_shards_is_rejected():
    events, params = declared_by_one_shard()
    writes = [i for i, e in enumerate(events) if e["event"] == "grant_write_lease"]
    first, second = (events[i] for i in writes)
    assert {first["node"], second["node"]} == {"directory-0", "directory-1"}
    # The second shard's write lease renamed to the first's id, everywhere it is named.
    reused = [dict(e, lease=first["lease"]) if e["lease"] == second["lease"] else e for e in events]
    assert verdict(reused, params) == (REJECTED, "lease_id_reused", writes[1])


def test_a_child_granted_in_another_shard_than_its_parent_is_rejected():
    """A chain lives in its root's shard: a shard that does not hold the parent COMMITTED grants
    no write under it (its own records, its own log order)."""
    case = next(c for c in _corpus_cases() if c["file"] == "core-KVCC-CORE-008.ndjson")
    events = _read(case)
    sharded, _ = split(events)
    root = chain_roots(events)
    child = next(e for e in sharded if e["event"] == "grant_write_lease" and e["parent"] is not None)
    shard = child["node"]
    other = f"directory-{1 - int(shard[-1])}"
    # The child's every directory step logged by the other shard.
    moved = resequence([dict(e, node=other) if e["node"] == shard and e.get("key") == child["key"] else e for e in sharded])
    at = next(i for i, e in enumerate(moved) if e["event"] == "grant_write_lease" and e["key"] == child["key"])
    assert root(child["key"]) != child["key"]
    assert verdict(moved, TraceParams(case["lease_term_ms"], case["skew_ms"]))[:2] == (REJECTED, "parent_not_committed")
    assert verdict(moved, TraceParams(case["lease_term_ms"], case["skew_ms"]))[2] <= at


def test_a_key_no_shard_answered_takes_the_first_shards_failures():
    """A request no directory logged a step of (a key of no shard yet): its projection holds the
    crash and the failures of the first directory to log an event, never a second copy of a
    failure another shard logged too."""
    events, params = declared_by_one_shard()
    last = events[-1]
    assert last["node"] != "directory-0" and last["node"] != "directory-1"
    lone = dict(last, event="acquire", key="ab" * 32, lease=None, gen=None, location=None, seq=last["seq"] + 1,
                t_local_ns=last["t_local_ns"] + 1, t_wall_ns=last["t_wall_ns"] + 1)  # fmt: skip
    assert verdict(events + [lone], params) == (ACCEPTED, None, None)


def test_sharded_traces_read_from_a_file_in_workers(tmp_path):
    """``validate_file`` (two passes over the file) and projections shared out between workers
    give the verdicts of ``validate_trace`` on a sharded trace."""
    import attrs

    from kvcc.conformance.validate import validate_file

    for make in (declared_by_one_shard, restarted_shard, namespace_invalidated_by_shard_0):
        events, params = make()
        path = tmp_path / f"{make.__name__}.ndjson"
        path.write_text("".join(json.dumps(e) + "\n" for e in events))
        for jobs in (1, 2):
            v = validate_file(path, attrs.evolve(params, jobs=jobs))
            assert (v.status, v.code) == (ACCEPTED, None), (make.__name__, jobs, v.reason)
    case = next(c for c in _corpus_cases() if c["file"] == "cluster-revoke-after-expiry.ndjson")
    sharded, origin = split(_read(case))
    path = tmp_path / "split.ndjson"
    path.write_text("".join(json.dumps(e) + "\n" for e in sharded))
    v = validate_file(path, TraceParams(case["lease_term_ms"], case["skew_ms"], jobs=2))
    assert {"status": v.status, "code": v.code, "event_index": origin[v.event_index]} == case["expected"]


def test_rejections_name_the_nodes_not_the_shards():
    """The spec ids of a rejection's diff map to the nodes and locations; the shards are the
    directory, no node of the model."""
    from kvcc.conformance.validate import model_names

    events, params = restarted_shard()
    names = set(model_names(events, params).values())
    assert {e["node"] for e in events if e["node"].startswith("node-")} <= names
    assert not names & {"directory-0", "directory-1"}


def test_a_wrong_shard_refusal_is_no_step_of_the_key_in_another_shard():
    """A root sent to a shard that does not own it is refused ``wrong_shard`` there, changing
    nothing (docs/sharding.md): the key's steps are still its own shard's alone. So is a lease
    refused for another reason by a shard that holds no record of the key (a child asked for
    under a parent no shard held yet, sent to the parent's own hash's shard): replayed as the
    request's loss. A grant there is a step in two shards."""
    events, params = declared_by_one_shard()
    begin = events[0]
    assert begin["event"] == "begin_write" and begin["node"] != "directory-0"
    other = next(e for e in events if e["node"] == "directory-1")

    def refused(result):
        wall, local = begin["t_wall_ns"] - 3, begin["t_local_ns"] - 3
        ask = dict(begin, t_wall_ns=wall, t_local_ns=local)
        no = dict(other, event="refuse_write_lease", key=begin["key"], gen=None, epoch=None, lease=None, result=result,
                  writer=begin["node"], parent=None, t_wall_ns=wall + 1, t_local_ns=other["t_local_ns"] - 1)  # fmt: skip
        for f in ("location", "namespace"):
            no.pop(f, None)
        give_up = dict(begin, event="abort", t_wall_ns=wall + 2, t_local_ns=local + 1)
        return resequence([ask, no, give_up] + events)

    assert verdict(refused("wrong_shard"), params) == (ACCEPTED, None, None)
    assert verdict(refused("parent_not_committed"), params) == (ACCEPTED, None, None)
    assert verdict(refused("not_absent"), params) == (ACCEPTED, None, None)


# ------------------------------------------------------------------------ the two-shard corpus

SHARD_CORPUS = os.path.join(CORPUS, "shards")


def _shard_cases():
    with open(os.path.join(SHARD_CORPUS, "manifest.json")) as f:
        return json.load(f)["cases"]


@pytest.mark.parametrize("case", _shard_cases(), ids=lambda c: c["file"])
def test_two_shard_corpus_verdicts(case):
    """The two-shard corpus (``tests/corpus/validate/shards``, ``make_shards.py``): traces of two
    directory processes, each with the verdict it must get."""
    with open(os.path.join(SHARD_CORPUS, case["file"])) as f:
        events = [json.loads(line) for line in f if line.strip()]
    assert {e["node"] for e in events if e["event"] in DIRECTORY_EVENTS} == {"directory-0", "directory-1"}
    v = validate_trace(events, TraceParams(case["lease_term_ms"], case["skew_ms"], tick_ms=case["tick_ms"], locations=case["locations"]))
    assert {"status": v.status, "code": v.code, "event_index": v.event_index} == case["expected"], v.reason


def test_the_two_shard_corpus_has_both_verdicts_and_every_shard_failure():
    cases = _shard_cases()
    assert {c["expected"]["status"] for c in cases} == {ACCEPTED, REJECTED}
    assert "key_in_two_shards" in {c["expected"]["code"] for c in cases}
    names = set()
    for case in cases:
        with open(os.path.join(SHARD_CORPUS, case["file"])) as f:
            names |= {json.loads(line)["event"] for line in f if line.strip()}
    assert {"restart_directory", "declare_node_down", "restart_node", "invalidate_namespace", "crash"} <= names
