"""The protocol's decision rules, written once, as small pure functions on plain values.

Theory of operation
-------------------
Every guard of the protocol -- may this read lease be granted, may this commit land, may this
invalidation complete -- is a function here of plain ints, bools and strings. Two callers share
them:

- ``spec/model.py``, the model the checker explores, reads its arguments out of a packed bytes
  state with bounded counters (lease "time left" counts down to zero);
- the reference directory (``kvcc.reference.directory.core``), reads them out of attrs records
  and a lease table with absolute expiry times on the directory's clock.

So what the checker proved about a guard is a property of the very function the reference runs.
What stays with each caller is only how it *obtains* the arguments (a byte at an offset, a field of
a record) and what it does with the answer (a successor state, a reply and effects).

Conventions:

- A rule that can refuse returns ``None`` to allow, else a refusal reason: one of the
  ``REASON_*`` codes below, the words a ``LeaseRefused``, ``CommitRejected`` or ``EvictRefused``
  carries on the wire. When several reasons apply, the first one checked is returned; the order
  is part of the rule (callers and logs may rely on it), the model only looks at ``is None``.
- A rule that cannot refuse (it decides *whether* something happens) returns a bool.
- Mutants (``spec/mutants.py``) are not here: a mutant flag in ``model.py`` bypasses or alters
  the call at the line it breaks, so the rule itself is always the correct one.
- Times are in whatever unit the caller counts (ticks in the model, milliseconds in the
  reference); the time rules only add and compare.

Standard library only: this module is part of the vocabulary every layer imports.
"""

from __future__ import annotations

# -- the clock bound --------------------------------------------------------------------------------
# Epsilon, the bound on clock skew every deployment assumes (docs/protocol.md 4), when none is
# configured: the directory's (``DirectoryConfig.skew_ms``) and a node's for the grants it checks.
SKEW_MS_DEFAULT = 500

# -- phases ---------------------------------------------------------------------------------------
# A record's phase (docs/protocol.md: ABSENT -> WRITING -> COMMITTED -> INVALIDATING -> ABSENT, gen + 1).
# The values are the model's bytes (``spec/layout.py`` names them too; ``model.py`` asserts that
# both agree).
ABSENT, WRITING, COMMITTED, INVALIDATING = range(4)
PHASE_NAMES = ("ABSENT", "WRITING", "COMMITTED", "INVALIDATING")
PHASES = (ABSENT, WRITING, COMMITTED, INVALIDATING)
# Phases in which a generation is readable by those who already hold a lease on it.
READABLE_PHASES = (COMMITTED, INVALIDATING)

# -- refusal reasons ------------------------------------------------------------------------------
# The protocol's words (``vocabulary``): the reasons the rules give.
from .vocabulary import (  # noqa: E402
    REASON_ALREADY_LEASED,
    REASON_DRAINING_FIRST,
    REASON_HAS_CHILDREN,
    REASON_INVALIDATING,
    REASON_LEASE_EXPIRED,
    REASON_LEASED,
    REASON_LOCATION_DOWN,
    REASON_NOT_ABSENT,
    REASON_NOT_COMMITTED,
    REASON_NOT_FOUND,
    REASON_NOT_OWNER,
    REASON_PARENT_NOT_COMMITTED,
    REASON_RESTARTING,
    REASON_STALE_EPOCH,
    REASON_UNAUTHORIZED,
    REASON_UNKNOWN_LEASE,
)

# -- time -----------------------------------------------------------------------------------------
# docs/protocol.md (leases): clocks differ by at most epsilon. A holder stops trusting a lease at
# ``term - epsilon`` on its own clock, counted from when it *sent* the request; the directory
# treats it as live until ``term + epsilon`` on its clock, counted from the grant. Between the two
# lie at least the 2 epsilon by which the two clocks may disagree.


def holder_budget(term: int, eps: int) -> int:
    """How long a holder trusts a lease on its own clock, from sending the request (glossary)."""
    assert term > eps >= 0, "a holder must keep a positive budget"
    return term - eps


def directory_view(term: int, eps: int) -> int:
    """How long the directory treats a lease as live on its own clock, from the grant."""
    assert term > eps >= 0
    return term + eps


def restart_grace(term: int, eps: int) -> int:
    """How long a restarted directory frees nothing: the longest lease it may have issued
    (``directory_view``), plus the skew its own clock may have gathered since."""
    return directory_view(term, eps) + eps


def restart_grace_within(term: int, eps: int, horizon: int | None) -> int:
    """How long a restarted directory frees nothing when it knows ``horizon``: the longest any
    lease it forgot may still run, on its own clock (the leases its predecessors granted, and
    the grace a predecessor was still in when it stopped: that covers leases older still).
    ``None`` -- no mirror of the leases: the full ``restart_grace``. Never longer than that,
    which covers every lease that could have been granted."""
    full = restart_grace(term, eps)
    if horizon is None:
        return full
    assert horizon >= 0
    return min(full, horizon)


def invalidation_deadline(term: int, eps: int, restarts: int) -> int:
    """Bounded response: an invalidation completes within this much *true* time of starting.

    A live lease lasts at most ``directory_view`` on the directory's clock, which runs at most
    ``eps`` behind true time; each directory restart in between adds a grace period, also
    measured on the directory's clock."""
    assert restarts >= 0
    one_lease = directory_view(term, eps) + eps
    one_grace = restart_grace(term, eps) + eps
    return one_lease + restarts * one_grace


def write_lease_deadline(term: int, eps: int, restarts: int) -> int:
    """Bounded response: a write lease ends (commit, abort, expiry) within this much true time of
    its grant. It lives ``directory_view`` on the directory's clock, which may lag ``eps``; a
    directory restart re-arms it for a grace period (the writer may still hold it): the same
    terms as ``invalidation_deadline``."""
    return invalidation_deadline(term, eps, restarts)


def request_deadline(term: int, eps: int) -> int:
    """Bounded response: a holder's lease request ends -- granted, refused, or given up when its
    budget runs out (the answer to a lost message) -- within this much true time of being sent.
    The budget runs on the holder's clock, which may lag ``eps``."""
    return holder_budget(term, eps) + eps


def failover_deadline(term: int, eps: int, restarts: int, detection: int) -> int:
    """Bounded response (P4): a COMMITTED key whose owner's node crashed is writable again (ABSENT)
    within this much true time: the failure detector declares the node down within ``detection``
    on the directory's clock (which may lag ``eps``), then the key is invalidated like any other
    and completes within ``invalidation_deadline``."""
    return detection + eps + invalidation_deadline(term, eps, restarts)


def lease_expires_at(granted_at: int, term: int, eps: int) -> int:
    """The directory-clock time a lease (or renewal) granted at ``granted_at`` stops being live."""
    return granted_at + directory_view(term, eps)


def holder_trusts_until(sent_at: int, term: int, eps: int) -> int:
    """The holder-clock time a holder that *sent* its request at ``sent_at`` stops trusting."""
    return sent_at + holder_budget(term, eps)


def lease_live(now: int, expires_at: int) -> bool:
    """A lease (read or write) is live strictly before its expiry on the directory's clock. In the
    model ``now`` is 0 and ``expires_at`` the ticks left: a counter at zero has expired."""
    return now < expires_at


# -- read leases ----------------------------------------------------------------------------------


def may_grant_read(phase: int, authorized: bool, holder_has_live_lease: bool, owner_down: bool = False) -> str | None:
    """Acquire: a read lease only on a COMMITTED generation (protocol properties 3, 6), only in a namespace the
    requester's tenant may use (protocol property 11), one lease per holder and key (it renews that one), and
    never on a copy whose node the directory has declared down (``owner_down``: a lease there
    could not be read, and would hold the key's failover up for a whole term)."""
    if not authorized:
        return REASON_UNAUTHORIZED
    if phase != COMMITTED:
        return REASON_INVALIDATING if phase == INVALIDATING else REASON_NOT_COMMITTED
    if owner_down:
        return REASON_LOCATION_DOWN
    if holder_has_live_lease:
        return REASON_ALREADY_LEASED
    return None


def may_renew(
    phase: int, entry_live: bool, entry_id: int, lease_id: int, lease_location: object, owner: object
) -> str | None:
    """Renew: extend only a *live* lease under its own id (protocol property 8: renewal never revives one that
    expired, was released or revoked), only on a COMMITTED key (no extension once an invalidation
    began), and only on the owner copy (a lease on a draining copy runs out so the copy can go).

    ``entry_live``/``entry_id``: the directory's own live entry for this holder and key, if any."""
    if not entry_live or entry_id != lease_id:
        return REASON_UNKNOWN_LEASE
    if phase != COMMITTED:
        return REASON_INVALIDATING if phase == INVALIDATING else REASON_NOT_COMMITTED
    if lease_location != owner:
        return REASON_NOT_OWNER
    return None


def may_release(entry_id: int, lease_id: int) -> bool:
    """Release ends the directory's entry only if it names that very lease: a late Release of an
    earlier lease never ends a later one."""
    return entry_id == lease_id


def may_ack_revoke(phase: int, entry_id: int, lease_id: int) -> bool:
    """An acknowledged revocation ends the entry it names, while the invalidation that revoked it
    runs. (Holders drop their trust *before* acking: flush-then-ack.)"""
    return phase == INVALIDATING and entry_id == lease_id


# -- writes ---------------------------------------------------------------------------------------


def may_begin_write(phase: int, parent_phase: int | None, authorized: bool) -> str | None:
    """BeginWrite: only an ABSENT key (a key names immutable content; a rewrite is the next
    generation), only under a COMMITTED parent (``None``: a root) so that prefix chains are
    written root first (protocol property 10), only in an authorised namespace (protocol property 11)."""
    if not authorized:
        return REASON_UNAUTHORIZED
    if phase != ABSENT:
        return REASON_NOT_ABSENT
    if parent_phase is not None and parent_phase != COMMITTED:
        return REASON_PARENT_NOT_COMMITTED
    return None


def next_epoch(epoch: int) -> int:
    """Every ownership change (write grant, transfer) takes a fresh epoch: the fencing token."""
    return epoch + 1


def may_commit(
    phase: int, write_lease_id: int, lease_id: int, record_epoch: int, epoch: int, write_lease_live: bool,
    location_down: bool = False,
) -> str | None:
    """Commit: only the current write lease of a WRITING key, under the key's current epoch, before
    that lease expired (docs/protocol.md: a writer that paused past its lease is fenced, never published),
    and not onto a location whose node the directory has declared down: a commit in flight when
    its node crashed would publish a copy nobody can read and no failover voids (found by the
    checker: CrashedOwnerWritableInTime). The write lease then expires and its bytes are freed."""
    if phase != WRITING or write_lease_id != lease_id:
        return REASON_UNKNOWN_LEASE
    if record_epoch != epoch:
        return REASON_STALE_EPOCH
    if not write_lease_live:
        return REASON_LEASE_EXPIRED
    if location_down:
        return REASON_LOCATION_DOWN
    return None


def write_lease_must_expire(phase: int, write_lease_live: bool) -> bool:
    """A WRITING key whose write lease ran out goes back to ABSENT (next generation), at once:
    the key is writable again, the late writer fenced by the next grant's epoch."""
    return phase == WRITING and not write_lease_live


# -- fencing (at a location) ------------------------------------------------------------------------


def fence_accepts(epoch: int, fence: int) -> bool:
    """A slot accepts bytes, a free or a copy only under an epoch at least its fence (protocol property 2)."""
    return epoch >= fence


def slot_accepts(epoch: int, fence: int, freed_epoch: int) -> bool:
    """A slot stores bytes (a write or a copy) only under an epoch at least its fence (protocol property 2)
    and above the highest epoch freed there: bytes of a generation already deleted here that land
    late (a paused writer, a slow copy) are refused, or deletion would not stay done."""
    return fence_accepts(epoch, fence) and epoch > freed_epoch


def restored_fence(fence: int, record_epoch: int) -> int:
    """A node that rejoins (maybe without its disk, fences and all) takes the directory's epoch as
    a floor: it bounds every epoch ever issued for the key, so no message from before the crash
    can land."""
    return record_epoch if fence < record_epoch else fence


def restored_freed_epoch(freed_epoch: int, wanted_here: bool, record_epoch: int) -> int:
    """A node that rejoins (maybe without its disk, and the record of what it freed with it) takes
    the key's epoch as freed at each of its locations where the directory wants no bytes of the
    key (not its owner, draining copy or transfer destination; every location when the key is
    ABSENT): nothing written there under that epoch or below is wanted, so bytes that land late
    (a paused writer, a cancelled transfer's copy) are refused. (Found by the checker:
    DeletionReachesEverywhere, bytes landing on a disk that lost the record of their Free.)"""
    if not wanted_here and record_epoch > freed_epoch:
        return record_epoch
    return freed_epoch


# -- invalidation -----------------------------------------------------------------------------------

INVALIDATE_START = "start"  # COMMITTED -> INVALIDATING: revoke every lease, wait, then free
INVALIDATE_ABORT_WRITE = "abort_write"  # WRITING -> ABSENT (gen + 1): the commit will find it gone


def invalidation_step(phase: int) -> str | None:
    """What invalidating one key (of a key's subtree or a namespace) does to it; ``None``: nothing
    (ABSENT has nothing to void, INVALIDATING is under way already)."""
    if phase == COMMITTED:
        return INVALIDATE_START
    if phase == WRITING:
        return INVALIDATE_ABORT_WRITE
    return None


def may_complete_invalidation(phase: int, in_grace: bool, live_leases: int) -> bool:
    """An invalidation completes -- its copies are freed, the generation ends -- only when every
    lease on it was acknowledged or expired (protocol property 6; Gray & Cheriton's write rule), and never
    during a restarted directory's grace: it cannot know who still trusts a lease it forgot.

    ``live_leases``: how many read leases on the key are live (a bool says whether any is)."""
    return phase == INVALIDATING and not in_grace and not live_leases


# -- deletion ---------------------------------------------------------------------------------------
# docs/protocol.md (progress): deletion reaches everywhere. Whenever a generation ends (an invalidation
# completes, a write lease expires, a write is aborted by an invalidation) or a copy is let go (a
# drained copy, a cancelled transfer's destination), the directory *owes* a Free to each location
# that may hold the bytes: it records (key, location) -> epoch in a durable to-free set, sends the
# Free, and re-sends it until the location answers ``Freed``. A location answers every Free it
# receives while up: it frees the slot (fence permitting) or it has already seen a newer epoch.
# Zero in the to-free set means nothing owed (epochs of written bytes start at 1).


def free_takes(epoch: int, fence: int, slot_full: bool, slot_epoch: int) -> bool:
    """Does a Free under ``epoch`` empty the slot? It deletes bytes stored under that epoch or an
    older one, and never bytes of a newer one (protocol property 2: a lower epoch never destroys what a higher
    one wrote). The slot's own epoch decides, not only its fence: a fence raised without new bytes
    (a node that rejoins takes the directory's epoch as its fence) must not make an ended
    generation's bytes undeletable. (Found by the checker: DeletionReachesEverywhere.) An empty
    slot takes it, to remember the epoch freed, only if its fence would."""
    if slot_full:
        return slot_epoch <= epoch
    return fence_accepts(epoch, fence)


def owe_free(owed_epoch: int, epoch: int) -> int:
    """The to-free entry after owing a Free under ``epoch``: one Free under the highest epoch owed
    covers every lower one (a location frees whatever its fence lets that epoch free)."""
    assert epoch >= 1, "bytes are written under epochs from 1"
    return epoch if epoch > owed_epoch else owed_epoch


def free_acknowledged(owed_epoch: int, freed_epoch: int) -> bool:
    """A ``Freed`` settles the entry if it answers a Free at least as recent as the one owed."""
    return owed_epoch != 0 and freed_epoch >= owed_epoch


def may_retry_free(owed_epoch: int, location_up: bool) -> bool:
    """Re-send an owed Free to a location that is up. The retry is the directory's timer: it cannot
    tell a lost Free (or Freed) from a slow one, so it may re-send either way; it must re-send
    when neither is on its way (``free_retry_due``)."""
    return owed_epoch != 0 and location_up


def free_retry_due(owed_epoch: int, location_up: bool, answer_pending: bool) -> bool:
    """The retry timer is due: a Free is owed to an up location and neither it nor its ``Freed``
    is on its way (one was lost, or a down location swallowed it). The model fires it before time
    passes."""
    return may_retry_free(owed_epoch, location_up) and not answer_pending


# -- eviction and transfer ------------------------------------------------------------------------


def may_evict(
    phase: int,
    is_owner_or_draining: bool,
    children_all_absent: bool,
    leased_here: bool,
    in_grace: bool,
    owner_while_draining: bool = False,
) -> str | None:
    """Evict: a node may drop a COMMITTED copy the directory knows of (the owner or a draining
    one), never during restart grace, leaves before their ancestors (protocol property 10), never under a
    live read lease on that location (protocol property 5), and the owner copy last (while a draining copy
    exists, that one goes first). The order of the checks is the order of the reasons."""
    if phase != COMMITTED:
        return REASON_INVALIDATING if phase == INVALIDATING else REASON_NOT_COMMITTED
    if not is_owner_or_draining:
        return REASON_NOT_FOUND
    if in_grace:
        return REASON_RESTARTING
    if not children_all_absent:
        return REASON_HAS_CHILDREN
    if leased_here:
        return REASON_LEASED
    if owner_while_draining:
        return REASON_DRAINING_FIRST
    return None


def may_start_transfer(phase: int, moving: bool, draining: bool) -> bool:
    """Promotion / demotion moves the owner copy of a COMMITTED key, one transfer at a time: not
    while a copy is moving, nor while the previous owner still drains."""
    return phase == COMMITTED and not moving and not draining


def may_finish_transfer(
    phase: int, moving_to: object, location: object, record_epoch: int, epoch: int, location_down: bool = False
) -> bool:
    """A ``Copied`` finishes the transfer it answers -- to the location the key is moving to,
    under the epoch the transfer took -- and nothing else (a stale or duplicated Copied); never
    onto a node declared down since (the transfer is then cancelled)."""
    return phase == COMMITTED and moving_to == location and record_epoch == epoch and not location_down


def may_free_drained(in_grace: bool, leased_here: bool) -> bool:
    """The previous owner's copy is freed once its leases drained, never during restart grace."""
    return not in_grace and not leased_here


def down_owner_invalidates(phase: int, owner_on_down_node: bool) -> bool:
    """When the directory declares a node down (its failure detector: no heartbeat for
    ``failure_detection_ticks``), every COMMITTED key whose owner copy is there is voided (with its
    subtree): nobody can read it, and a rewrite elsewhere needs the key ABSENT. Leases on it are
    revoked and expire, so the key is writable again within ``failover_deadline``."""
    return phase == COMMITTED and owner_on_down_node


def lost_copy_invalidates(phase: int, is_owner: bool, lost: bool) -> bool:
    """A node that rejoins without the disk holding a COMMITTED key's owner copy voids the key (and
    its subtree) like any invalidation: others may still trust leases on it, so it becomes
    writable again only once those were acknowledged or expired. A write in progress to the
    rejoining node is aborted whether or not its bytes survived (the node cannot say which writes
    landed before the crash): its commit, which may already be on its way, is refused. Taken, it
    could commit bytes the node lost, leaving a key that every lookup finds, every read misses and
    nobody can write again (found by the checker, ``LostCopyVoidedOnRejoin``; issue 14)."""
    return is_owner and (phase == WRITING or (phase == COMMITTED and lost))
