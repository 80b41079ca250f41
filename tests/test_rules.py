"""The decision rules (spec/rules.py): one vocabulary with the layout, the configurations and the
wire, the truth tables the model relies on, and the layering that lets every layer import them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hypothesis import given
from hypothesis import strategies as st

from kvcc.spec import layout, rules, vocabulary
from kvcc.spec.config import CONFIGS

REPO = Path(__file__).resolve().parents[1]
phases = st.sampled_from(rules.PHASES)
ids = st.integers(0, 5)


def test_phases_are_the_layouts():
    assert (layout.ABSENT, layout.WRITING, layout.COMMITTED, layout.INVALIDATING) == rules.PHASES
    assert layout.PHASE_NAMES == rules.PHASE_NAMES


def test_every_reason_fits_the_wires_code():
    from kvcc.reference import wire
    from kvcc.spec.vocabulary import REASONS

    for reason in REASONS:
        assert wire.CODE_RE.fullmatch(reason), f"{reason!r} does not fit the wire's Code"


def test_configurations_derive_their_limits_from_the_rules():
    for cfg in CONFIGS.values():
        term, eps = cfg.lease_term_ticks, cfg.skew_ticks
        assert cfg.holder_budget_ticks == rules.holder_budget(term, eps)
        assert cfg.directory_lease_ticks == rules.directory_view(term, eps)
        assert cfg.restart_grace_ticks == rules.restart_grace(term, eps)
        assert cfg.invalidation_deadline_ticks == rules.invalidation_deadline(term, eps, cfg.max_directory_restarts)


@given(term=st.integers(1, 10**9), eps=st.integers(0, 10**9), sent=st.integers(0, 10**12), delay=st.integers(0, 10**9))
def test_holder_trust_ends_before_the_directory_forgets(term, eps, sent, delay):
    """The timing argument of docs/protocol.md (leases): a holder counting from sending, on a clock up to
    eps behind, stops trusting before a directory counting from the (later) grant, on a clock up
    to eps ahead, stops treating the lease as live."""
    if eps >= term:
        eps = term - 1
    granted = sent + delay  # true time; the grant never precedes the request
    holder_stops_true = rules.holder_trusts_until(sent, term, eps) + eps  # holder clock behind by eps
    directory_stops_true = rules.lease_expires_at(granted, term, eps) - eps  # directory clock ahead by eps
    assert holder_stops_true <= directory_stops_true
    assert rules.restart_grace(term, eps) >= rules.directory_view(term, eps) + eps


@given(phase=phases, authorized=st.booleans(), has=st.booleans())
def test_may_grant_read(phase, authorized, has):
    reason = rules.may_grant_read(phase, authorized, has)
    assert (reason is None) == (authorized and phase == rules.COMMITTED and not has)
    if not authorized:
        assert reason == vocabulary.REASON_UNAUTHORIZED
    elif phase == rules.INVALIDATING:
        assert reason == vocabulary.REASON_INVALIDATING


@given(phase=phases, live=st.booleans(), entry=ids, lease=ids, loc=ids, owner=ids)
def test_may_renew_never_revives(phase, live, entry, lease, loc, owner):
    reason = rules.may_renew(phase, live, entry, lease, loc, owner)
    assert (reason is None) == (live and entry == lease and phase == rules.COMMITTED and loc == owner)
    if not live:
        assert reason == vocabulary.REASON_UNKNOWN_LEASE


@given(phase=phases, parent=st.one_of(st.none(), phases), authorized=st.booleans())
def test_may_begin_write(phase, parent, authorized):
    reason = rules.may_begin_write(phase, parent, authorized)
    ok = authorized and phase == rules.ABSENT and parent in (None, rules.COMMITTED)
    assert (reason is None) == ok


@given(phase=phases, wid=ids, lease=ids, repoch=ids, epoch=ids, live=st.booleans())
def test_may_commit(phase, wid, lease, repoch, epoch, live):
    reason = rules.may_commit(phase, wid, lease, repoch, epoch, live)
    assert (reason is None) == (phase == rules.WRITING and wid == lease and repoch == epoch and live)
    if phase == rules.WRITING and wid == lease and repoch != epoch:
        assert reason == vocabulary.REASON_STALE_EPOCH
    if phase == rules.WRITING and wid == lease and repoch == epoch and not live:
        assert reason == vocabulary.REASON_LEASE_EXPIRED


@given(epoch=ids, fence=ids)
def test_fencing(epoch, fence):
    assert rules.fence_accepts(epoch, fence) == (epoch >= fence)
    restored = rules.restored_fence(fence, epoch)
    assert restored == max(fence, epoch)
    if fence <= epoch:  # the directory's epoch bounds every fence (EpochsBoundFences)
        assert rules.fence_accepts(epoch, restored)  # the directory's epoch passes the restored fence
    assert not rules.fence_accepts(epoch - 1, restored)  # anything older never does
    assert rules.next_epoch(epoch) > epoch


@given(phase=phases, grace=st.booleans(), live=st.integers(0, 3))
def test_invalidation_completes_only_without_live_leases(phase, grace, live):
    done = rules.may_complete_invalidation(phase, grace, live)
    assert done == (phase == rules.INVALIDATING and not grace and live == 0)


def test_invalidation_step():
    assert rules.invalidation_step(rules.COMMITTED) == rules.INVALIDATE_START
    assert rules.invalidation_step(rules.WRITING) == rules.INVALIDATE_ABORT_WRITE
    assert rules.invalidation_step(rules.ABSENT) is None
    assert rules.invalidation_step(rules.INVALIDATING) is None


@given(phase=phases, known=st.booleans(), leaves=st.booleans(), leased=st.booleans(), grace=st.booleans(), last=st.booleans())
def test_may_evict(phase, known, leaves, leased, grace, last):
    reason = rules.may_evict(phase, known, leaves, leased, grace, last)
    assert (reason is None) == (phase == rules.COMMITTED and known and leaves and not leased and not grace and not last)
    if phase == rules.COMMITTED and known and not grace and leaves and leased:
        assert reason == vocabulary.REASON_LEASED
    if phase == rules.COMMITTED and known and not grace and not leaves:
        assert reason == vocabulary.REASON_HAS_CHILDREN


def test_transfer_rules():
    C = rules.COMMITTED
    assert rules.may_start_transfer(C, False, False)
    assert not rules.may_start_transfer(C, True, False)
    assert not rules.may_start_transfer(C, False, True)
    assert not rules.may_start_transfer(rules.INVALIDATING, False, False)
    assert rules.may_finish_transfer(C, "l1", "l1", 3, 3)
    assert not rules.may_finish_transfer(C, "l1", "l1", 3, 2)
    assert not rules.may_finish_transfer(C, "l1", "l2", 3, 3)
    assert rules.may_free_drained(False, False)
    assert not rules.may_free_drained(True, False)
    assert not rules.may_free_drained(False, True)


@pytest.mark.parametrize("name", ["rules", "vocabulary"])
def test_rules_import_only_the_standard_library(name):
    """The rules and the words are vocabulary: every layer imports them, so they import nothing of
    kvcc's (the rules only the words, ``vocabulary`` nothing at all)."""
    tree = ast.parse((REPO / "spec" / f"{name}.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                assert (name, node.level, node.module) == ("rules", 1, "vocabulary"), "no other relative imports"
                continue
            imported.add((node.module or "").split(".")[0])
    assert imported <= {"__future__"}, imported


def test_the_model_calls_the_rules():
    """Every guard of the model goes through a rule: each rule the model imports is called there."""
    src = (REPO / "spec" / "model.py").read_text()
    for name in (
        "may_grant_read", "may_renew", "may_release", "may_ack_revoke", "may_begin_write", "may_commit",
        "write_lease_must_expire", "slot_accepts", "free_takes", "restored_fence", "invalidation_step",
        "may_complete_invalidation", "may_evict", "may_start_transfer", "may_finish_transfer",
        "may_free_drained", "lost_copy_invalidates", "next_epoch", "holder_budget", "directory_view",
        "restart_grace", "invalidation_deadline", "write_lease_deadline", "request_deadline",
        "failover_deadline", "owe_free", "free_acknowledged", "may_retry_free", "free_retry_due",
        "restored_freed_epoch", "down_owner_invalidates",
    ):  # fmt: skip
        assert f"{name}(" in src, name


# -- progress and deletion (issue 8, section 3) ------------------------------------------------------


def test_configurations_derive_their_progress_bounds_from_the_rules():
    for cfg in CONFIGS.values():
        term, eps, restarts = cfg.lease_term_ticks, cfg.skew_ticks, cfg.max_directory_restarts
        assert cfg.write_lease_deadline_ticks == rules.write_lease_deadline(term, eps, restarts)
        assert cfg.request_deadline_ticks == rules.request_deadline(term, eps)
        assert cfg.failover_deadline_ticks == rules.failover_deadline(term, eps, restarts, cfg.failure_detection_ticks)


@given(term=st.integers(1, 10**6), eps=st.integers(0, 10**6), restarts=st.integers(0, 3))
def test_deadlines_cover_a_lagging_directory_clock(term, eps, restarts):
    """A lease the directory counts for ``directory_view`` on a clock that falls ``eps`` behind
    lasts ``directory_view + eps`` true time: the deadlines are at least that."""
    if eps >= term:
        eps = term - 1
    one_lease_true = rules.directory_view(term, eps) + eps
    assert rules.invalidation_deadline(term, eps, restarts) >= one_lease_true
    assert rules.write_lease_deadline(term, eps, restarts) >= one_lease_true
    # The holder's timeout runs on a clock up to eps behind.
    assert rules.request_deadline(term, eps) == rules.holder_budget(term, eps) + eps
    assert rules.failover_deadline(term, eps, restarts, term) >= term + rules.invalidation_deadline(term, eps, restarts)


@given(phase=phases, authorized=st.booleans(), has=st.booleans(), down=st.booleans())
def test_no_lease_on_a_copy_declared_down(phase, authorized, has, down):
    reason = rules.may_grant_read(phase, authorized, has, down)
    if down and reason is None:
        raise AssertionError("a lease was granted on a copy whose node is declared down")
    if not down:
        assert reason == rules.may_grant_read(phase, authorized, has)
    if down and authorized and phase == rules.COMMITTED:
        assert reason == vocabulary.REASON_LOCATION_DOWN


@given(epoch=ids, fence=ids, freed=ids)
def test_a_slot_refuses_bytes_of_an_epoch_it_freed(epoch, fence, freed):
    accepts = rules.slot_accepts(epoch, fence, freed)
    assert not (accepts and epoch <= freed), "late bytes of a freed epoch landed"
    assert not (accepts and not rules.fence_accepts(epoch, fence)), "fencing is kept"
    if freed < fence:
        assert accepts == rules.fence_accepts(epoch, fence)  # a freed epoch below the fence adds nothing


@given(epoch=ids, fence=ids, full=st.booleans(), slot_epoch=ids)
def test_a_free_deletes_older_bytes_and_never_newer_ones(epoch, fence, full, slot_epoch):
    takes = rules.free_takes(epoch, fence, full, slot_epoch)
    if full:
        assert takes == (slot_epoch <= epoch)  # even under a fence raised without new bytes
    else:
        assert takes == rules.fence_accepts(epoch, fence)


@given(owed=ids, epoch=st.integers(1, 5), acked=ids, up=st.booleans(), pending=st.booleans())
def test_owed_frees(owed, epoch, acked, up, pending):
    after = rules.owe_free(owed, epoch)
    assert after >= owed and after >= epoch and after in (owed, epoch)
    assert rules.free_acknowledged(after, acked) == (acked >= after)
    assert not rules.free_acknowledged(0, acked), "nothing owed, nothing to settle"
    assert rules.may_retry_free(owed, up) == (owed != 0 and up)
    # Due implies allowed; a Free or its Freed on its way makes it allowed but not due.
    assert rules.free_retry_due(owed, up, pending) == (rules.may_retry_free(owed, up) and not pending)


@given(freed=ids, wanted=st.booleans(), epoch=ids)
def test_a_rejoining_node_restores_what_it_freed(freed, wanted, epoch):
    restored = rules.restored_freed_epoch(freed, wanted, epoch)
    assert restored >= freed, "never forgets a freed epoch it still has"
    assert restored == (freed if wanted else max(freed, epoch))


@given(phase=phases, on_down=st.booleans())
def test_a_down_owner_voids_only_committed_keys(phase, on_down):
    assert rules.down_owner_invalidates(phase, on_down) == (phase == rules.COMMITTED and on_down)


@given(phase=phases, w=ids, lease=ids, rec=ids, epoch=ids, live=st.booleans(), down=st.booleans())
def test_no_commit_or_transfer_onto_a_node_declared_down(phase, w, lease, rec, epoch, live, down):
    reason = rules.may_commit(phase, w, lease, rec, epoch, live, down)
    assert not (down and reason is None)
    if not down:
        assert reason == rules.may_commit(phase, w, lease, rec, epoch, live)
    assert not (down and rules.may_finish_transfer(phase, w, lease, rec, epoch, down))
