"""The sans-IO holder (``kvcc.reference.holder``) that the client, the suite's kit and the Mooncake
adapter share: its budget, its one slot per key, drop-then-ack and requests a revocation ended.
Times are the holder's own clock, passed in: no test sleeps."""

from __future__ import annotations

from kvcc.reference.holder import Holder
from kvcc.spec.keys import BlockKey
from kvcc.spec.vocabulary import REASON_ALREADY_LEASED, REASON_BUSY, REASON_LEASE_EXPIRED, REASON_UNKNOWN_LEASE

KEY = BlockKey(b"k" * 32)
MS = 1_000_000
TERM_MS, SKEW_MS = 1000, 50


def _granted(h: Holder, sent_ns: int = 0, request: int = 1, lease: int = 7, gen: int = 1):
    h.acquiring(KEY, request)
    return h.granted(KEY, request, lease=lease, gen=gen, epoch=1, location="n1/dram", term_ms=TERM_MS, sent_ns=sent_ns)


def test_a_lease_is_trusted_for_term_minus_skew_from_the_send_time():
    h = Holder(SKEW_MS)
    sent = 5 * MS
    trust = _granted(h, sent_ns=sent)
    assert trust is not None and trust.until_ns == sent + (TERM_MS - SKEW_MS) * MS
    assert h.trusted(KEY, 7, trust.until_ns - 1) == trust
    assert h.trusted(KEY, 7, trust.until_ns) is None  # spent: dropped
    assert h.held(KEY) is None


def test_one_slot_per_key():
    h = Holder(SKEW_MS)
    assert h.may_acquire(KEY, 0) is None
    h.acquiring(KEY, 1)
    assert h.may_acquire(KEY, 0) == REASON_BUSY
    h.granted(KEY, 1, lease=7, gen=1, epoch=1, location="n1/dram", term_ms=TERM_MS, sent_ns=0)
    assert h.may_acquire(KEY, 0) == REASON_ALREADY_LEASED
    assert h.may_acquire(KEY, (TERM_MS - SKEW_MS) * MS) is None  # a spent lease is forgotten first
    assert h.held(KEY) is None


def test_a_revocation_drops_the_generation_and_ends_requests_under_way():
    h = Holder(SKEW_MS)
    _granted(h, lease=7, gen=3)
    assert h.revoked(KEY, 99, 3) is not None  # another lease of the same generation: dropped too
    assert h.held(KEY) is None
    h.acquiring(KEY, 2)
    assert h.revoked(KEY, 8, 4) is None
    # The answer to the ended request counts for nothing: never trusted, no abandon.
    assert h.granted(KEY, 2, lease=8, gen=4, epoch=1, location="n1/dram", term_ms=TERM_MS, sent_ns=0) is None
    assert h.held(KEY) is None and not h.busy(KEY) and h.may_acquire(KEY, 0) is None
    h.acquiring(KEY, 3)
    assert h.answered(KEY, 3)  # a refusal of a live request: the caller logs abandon


def test_a_revocation_of_another_generation_keeps_the_lease():
    h = Holder(SKEW_MS)
    _granted(h, lease=7, gen=3)
    assert h.revoked(KEY, 5, 2) is None
    assert h.held(KEY) is not None


def test_renewal_counts_from_its_send_time_and_never_shortens():
    h = Holder(SKEW_MS)
    first = _granted(h, sent_ns=0)
    assert h.may_renew(KEY, 8, 0) == REASON_UNKNOWN_LEASE
    assert h.may_renew(KEY, 7, 0) == first
    h.renewing(KEY, 2)
    assert h.may_renew(KEY, 7, 0) == REASON_BUSY
    renewed = h.renewed(KEY, 2, lease=7, term_ms=TERM_MS, sent_ns=100 * MS)
    assert renewed is not None and renewed.until_ns == 100 * MS + (TERM_MS - SKEW_MS) * MS
    h.renewing(KEY, 3)
    again = h.renewed(KEY, 3, lease=7, term_ms=100, sent_ns=200 * MS)  # a shorter term: the budget stays
    assert again is not None and again.until_ns == renewed.until_ns
    assert h.may_renew(KEY, 7, again.until_ns) == REASON_LEASE_EXPIRED


def test_a_renewal_overtaken_by_a_revocation_is_not_trusted():
    h = Holder(SKEW_MS)
    _granted(h)
    h.renewing(KEY, 2)
    h.revoked(KEY, 7, 1)
    assert h.renewed(KEY, 2, lease=7, term_ms=TERM_MS, sent_ns=0) is None
    assert h._cancelled == set()


def test_an_answer_after_the_request_budget_is_given_up_and_ends_the_request():
    """``gave_up``: an answer that comes once the request's own budget (term - epsilon from its
    send time) ran out is ignored, and the request is over -- the key takes a new request; one
    that comes a nanosecond earlier is taken."""
    h = Holder(SKEW_MS)
    budget = h.budget_ns(TERM_MS)
    assert budget == (TERM_MS - SKEW_MS) * MS
    h.acquiring(KEY, 1)
    assert not h.gave_up(KEY, 1, sent_ns=10 * MS, term_ms=TERM_MS, now_ns=10 * MS + budget - 1)
    assert h.busy(KEY), "an answer in time leaves the request to its caller"
    assert h.gave_up(KEY, 1, sent_ns=10 * MS, term_ms=TERM_MS, now_ns=10 * MS + budget)
    assert not h.busy(KEY) and h.may_acquire(KEY, 10 * MS + budget) is None
    _granted(h, request=2)
    h.renewing(KEY, 3)
    assert h.gave_up(KEY, 3, sent_ns=0, term_ms=TERM_MS, now_ns=budget)
    assert not h.busy(KEY), "a renewal given up is over too"


def test_a_renewal_of_a_lease_no_longer_held_is_not_trusted():
    """``renewed``: a renewal answered for a lease the holder no longer holds (released, or
    replaced by another lease on the key) gives no trust, and changes none."""
    h = Holder(SKEW_MS)
    _granted(h)
    h.renewing(KEY, 2)
    assert h.release(KEY, 7, 0) is not None
    assert h.renewed(KEY, 2, lease=7, term_ms=TERM_MS, sent_ns=0) is None
    assert h.held(KEY) is None
    other = _granted(h, request=3, lease=9)
    h.renewing(KEY, 4)
    assert h.renewed(KEY, 4, lease=7, term_ms=TERM_MS, sent_ns=100 * MS) is None
    assert h.held(KEY) == other


def test_a_renewal_carries_its_new_data_plane_grant_or_keeps_the_old():
    """A renewal's answer may carry a new data-plane grant (the token a location checks): the
    trust takes it; one without keeps the grant it had."""
    h = Holder(SKEW_MS)
    h.acquiring(KEY, 1)
    h.granted(KEY, 1, lease=7, gen=1, epoch=1, location="n1/dram", term_ms=TERM_MS, sent_ns=0, grant=b"first")
    h.renewing(KEY, 2)
    kept = h.renewed(KEY, 2, lease=7, term_ms=TERM_MS, sent_ns=10 * MS)
    assert kept is not None and kept.grant == b"first"
    h.renewing(KEY, 3)
    fresh = h.renewed(KEY, 3, lease=7, term_ms=TERM_MS, sent_ns=20 * MS, grant=b"second")
    assert fresh is not None and fresh.grant == b"second"


def test_release_tells_the_directory_only_of_a_trusted_lease():
    h = Holder(SKEW_MS)
    _granted(h)
    assert h.release(KEY, 8, 0) is None and h.held(KEY) is not None  # not this lease
    assert h.release(KEY, 7, 0) is not None and h.held(KEY) is None
    _granted(h, request=2)
    assert h.release(KEY, 7, (TERM_MS - SKEW_MS) * MS) is None  # spent: the directory lets it expire
    assert h.held(KEY) is None


def test_forget_is_a_crash():
    h = Holder(SKEW_MS)
    _granted(h)
    h.acquiring(BlockKey(b"j" * 32), 5)
    h.forget()
    assert h.leases() == {} and not h.busy(BlockKey(b"j" * 32))
