"""The spec's holder, sans-IO: what one process trusts of its read leases, and when it stops.

Theory of operation
-------------------
A holder (the spec's ``h_*`` variables: one slot per key) trusts a read lease from when it *sent*
the request that got it, for ``holder_budget(term, epsilon)`` on its own clock
(``kvcc.spec.rules``): whatever the directory's clock or the network did, the directory keeps
the lease live for ``term + epsilon`` from the grant, which is later (docs/protocol.md: leases).
``Holder`` keeps that trust table and makes every decision the spec's holder makes; it does no
I/O, reads no clock (every method that needs the time takes ``now_ns`` on the holder's clock)
and logs nothing. Its callers -- the client (``kvcc.reference.client``), the suite's in-process
kit (``kvcc.conformance.testing``) and the Mooncake adapter -- send the messages and log the
spec actions the answers name:

- ``may_acquire``: one lease per key, and one request per key at a time: a trusted lease is
  renewed, never acquired again (``already_leased``); a request under way makes another wait
  (``busy``); a lease past its budget is forgotten first.
- ``acquiring`` / ``renewing`` then ``answered``: a request is pending until its answer. A
  revocation that overtakes it ends it (``revoked``): the answer then counts for nothing -- a
  grant it carries is never trusted and a refusal is not an ``abandon`` (the spec's
  ``drop_and_ack`` already ended the request).
- ``granted`` / ``renewed``: the budget counts from the send time of the request that got it.
- ``trusted``: the lease is this holder's and its budget is not spent (a spent one is dropped).
- ``revoked``: drop first (every lease of the revoked generation, not only the one named: after a
  directory restart the revoked lease may be another grant of it), then the caller acknowledges
  (flush-then-ack).
- ``release``: stop trusting; the directory is told only if the lease was still trusted (one past
  the budget, revoked or released is already gone here, and the directory lets it expire).
"""

from __future__ import annotations

from attrs import define, evolve

from kvcc.spec.keys import BlockKey
from kvcc.spec.rules import holder_budget
from kvcc.spec.vocabulary import (
    REASON_ALREADY_LEASED,
    REASON_BUSY,
    REASON_LEASE_EXPIRED,
    REASON_UNKNOWN_LEASE,
)


@define(frozen=True)
class Trust:
    """One trusted read lease (the spec's h_id, h_loc, h_gen and h_left of one key)."""

    key: BlockKey
    lease: int
    gen: int
    epoch: int
    location: str
    term_ms: int
    sent_ns: int  # when the request that (re)started the budget was sent, on the holder's clock
    until_ns: int  # sent_ns + the holder budget: trusted while now < until_ns
    grant: bytes = b""  # the directory's data-plane grant for the reads (kvcc.reference.wire.grants)


class Holder:
    """``Holder(skew_ms)``: one process's trust table (see the module docstring)."""

    def __init__(self, skew_ms: int) -> None:
        self.skew_ms = skew_ms
        self._trusts: dict[BlockKey, Trust] = {}
        self._pending: dict[BlockKey, int] = {}  # key -> the acquire under way
        self._renewing: dict[BlockKey, int] = {}  # key -> the renewal under way
        self._cancelled: set[int] = set()  # requests a revocation ended before their answer

    def budget_ns(self, term_ms: int) -> int:
        return holder_budget(term_ms, self.skew_ms) * 1_000_000

    def held(self, key: BlockKey) -> Trust | None:
        """The lease recorded for ``key``, trusted or not (no clock read)."""
        return self._trusts.get(key)

    def leases(self) -> dict[BlockKey, Trust]:
        return dict(self._trusts)

    def trusted(self, key: BlockKey, lease: int, now_ns: int) -> Trust | None:
        """``lease`` on ``key`` if this holder trusts it now; a spent one is dropped."""
        trust = self._trusts.get(key)
        if trust is None or trust.lease != lease:
            return None
        if now_ns >= trust.until_ns:
            del self._trusts[key]
            return None
        return trust

    def busy(self, key: BlockKey) -> bool:
        return key in self._pending or key in self._renewing

    # -- acquire ---------------------------------------------------------------------------------

    def may_acquire(self, key: BlockKey, now_ns: int) -> str | None:
        """``None`` if a new read lease on ``key`` may be asked for now, else the refusal."""
        trust = self._trusts.get(key)
        if trust is not None:
            if now_ns < trust.until_ns:
                return REASON_ALREADY_LEASED
            del self._trusts[key]  # past its own budget: trusted no more
        return REASON_BUSY if self.busy(key) else None

    def acquiring(self, key: BlockKey, request: int) -> None:
        self._pending[key] = request

    def gave_up(self, key: BlockKey, request: int, *, sent_ns: int, term_ms: int, now_ns: int) -> bool:
        """Whether the answer to ``request`` (sent at ``sent_ns``) comes after the request's own
        budget ran out -- then the holder had given the request up (spec: a pending request's
        budget runs out; the grant or renewal that still comes is ignored, ``ignore_stale_grant``
        / ``ignore_stale_renewal``, never logged): it is over here, and the caller trusts nothing
        of it. A grant trusted past that point is a step the spec never takes (a loaded machine
        answered 200 ms late: core-inferred, KVCC-TIER-004 and KVCC-INVAL-013 REJECTED)."""
        if now_ns < sent_ns + self.budget_ns(term_ms):
            return False
        self.answered(key, request)
        return True

    def granted(
        self, key: BlockKey, request: int, *, lease: int, gen: int, epoch: int, location: str, term_ms: int, sent_ns: int,
        grant: bytes = b"",
    ) -> Trust | None:
        """The grant answering acquire ``request`` (sent at ``sent_ns``), now trusted -- or
        ``None`` if a revocation ended the request first (never trusted)."""
        if not self.answered(key, request):
            return None
        trust = self._trusts[key] = Trust(key, lease, gen, epoch, location, term_ms, sent_ns,
                                          sent_ns + self.budget_ns(term_ms), grant)  # fmt: skip
        return trust

    # -- renew -----------------------------------------------------------------------------------

    def may_renew(self, key: BlockKey, lease: int, now_ns: int) -> Trust | str:
        """The trusted lease to renew, or the refusal: not held (``unknown_lease``), past the
        holder's budget (``lease_expired``: renewing would revive a lease the directory may have
        let go of -- acquire anew), a request of the key under way (``busy``)."""
        trust = self._trusts.get(key)
        if trust is None or trust.lease != lease:
            return REASON_UNKNOWN_LEASE
        if self.trusted(key, lease, now_ns) is None:
            return REASON_LEASE_EXPIRED
        return REASON_BUSY if self.busy(key) else trust

    def renewing(self, key: BlockKey, request: int) -> None:
        self._renewing[key] = request

    def renewed(self, key: BlockKey, request: int, *, lease: int, term_ms: int, sent_ns: int,
                grant: bytes | None = None) -> Trust | None:  # fmt: skip
        """The renewal answering ``request`` (sent at ``sent_ns``): the budget counts again from
        the send time (never shorter than before) -- ``None`` if the lease is no longer trusted
        here (revoked, released or dropped while the renewal was out)."""
        if not self.answered(key, request):
            return None
        trust = self._trusts.get(key)
        if trust is None or trust.lease != lease:
            return None
        trust = self._trusts[key] = evolve(
            trust, term_ms=term_ms, sent_ns=sent_ns, until_ns=max(trust.until_ns, sent_ns + self.budget_ns(term_ms)),
            grant=trust.grant if grant is None else grant,
        )
        return trust

    # -- answers, revocations, release ---------------------------------------------------------

    def answered(self, key: BlockKey, request: int) -> bool:
        """Request ``request`` on ``key`` got its answer: ``False`` if a revocation ended it first
        (the answer counts for nothing: no trust, no ``abandon``)."""
        if self._pending.get(key) == request:
            del self._pending[key]
        if self._renewing.get(key) == request:
            del self._renewing[key]
        if request in self._cancelled:
            self._cancelled.discard(request)
            return False
        return True

    def revoked(self, key: BlockKey, lease: int, gen: int) -> Trust | None:
        """A revocation of ``lease`` (generation ``gen``) of ``key`` arrived: the lease of that
        generation is dropped (returned; ``None`` if none was trusted) and the requests of the
        key under way are over. The caller acknowledges after this returns."""
        for pending in (self._pending.pop(key, None), self._renewing.pop(key, None)):
            if pending is not None:
                self._cancelled.add(pending)
        trust = self._trusts.get(key)
        if trust is not None and (trust.lease == lease or trust.gen == gen):
            del self._trusts[key]
            return trust
        return None

    def release(self, key: BlockKey, lease: int, now_ns: int) -> Trust | None:
        """Stop trusting ``lease``: the lease if the directory should be told (it was still
        trusted), else ``None``."""
        trust = self._trusts.get(key)
        if trust is None or trust.lease != lease:
            return None
        del self._trusts[key]
        return trust if now_ns < trust.until_ns else None

    def forget(self) -> None:
        """The process crashed: every lease and every request under way is gone."""
        self._trusts.clear()
        self._pending.clear()
        self._renewing.clear()
        self._cancelled.clear()
