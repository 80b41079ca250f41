"""Deliberately broken protocols, each of which a named property must catch.

A checker that catches no bug proves nothing. Each mutant switches on one bug flag of ``Model``
(a line of the protocol that is dropped or changed), names the configuration to check it in and
the property that must report it. ``kvcc mutants`` fails unless every mutant is caught by exactly
the property it names.
"""

from __future__ import annotations

from attrs import frozen


@frozen
class Mutant:
    name: str
    bugs: tuple[str, ...]
    expected_property: str
    config: str
    text: str


MUTANTS: dict[str, Mutant] = {
    m.name: m
    for m in (
        Mutant("no-fencing", ("no_fencing",), "FencingHolds", "small",
               "storage accepts bytes and frees under any epoch: a paused writer overwrites a newer commit"),
        Mutant("late-commit-accepted", ("late_commit_accepted",), "CommittedBytesIntact", "small",
               "the directory commits a write without checking its lease and epoch"),
        Mutant("invalidation-ignores-leases", ("invalidation_ignores_leases",), "DirectoryDataAgreement", "small",
               "an invalidation (a rewrite) completes without waiting for leases to be acked or expire"),
        Mutant("holder-ignores-skew", ("holder_ignores_skew",), "LeaseKnownToDirectory", "small",
               "a holder trusts its lease for the full term instead of term - epsilon"),
        Mutant("holder-counts-from-receipt", ("holder_counts_from_receipt",), "RequestEndsInTime", "small",
               "a holder counts its lease from the grant's arrival, not from sending the request: it keeps no clock while it waits"),
        Mutant("renew-revives-expired", ("renew_revives_expired",), "RenewalNeverRevives", "renewal",
               "the directory renews a lease that already expired"),
        Mutant("evict-under-lease", ("evict_under_lease",), "DirectoryDataAgreement", "small",
               "eviction ignores live read leases"),
        Mutant("evict-parent-first", ("evict_parent_first",), "PrefixClosed", "chain",
               "eviction takes a parent while its child is still cached"),
        Mutant("lease-id-reuse", ("lease_id_reuse_after_restart",), "LeaseIdsFresh", "restart",
               "a restarted directory starts lease ids from 1 again"),
        Mutant("grant-during-invalidation", ("grant_during_invalidation",), "LeasesGrantedOnlyOnCommitted", "small",
               "the directory grants read leases on a key that is being invalidated"),
        Mutant("restart-without-grace", ("restart_without_grace",), "LeaseKnownToDirectory", "restart",
               "a restarted directory frees copies before the longest lease it may have issued expired"),
        Mutant("ack-before-drop", ("ack_before_drop",), "NoReadAfterAck", "small",
               "a holder acknowledges a revocation but keeps trusting its lease"),
        Mutant("invalidate-without-cascade", ("invalidate_without_cascade",), "PrefixClosed", "chain",
               "invalidating a key leaves its descendants committed"),
        Mutant("invalidation-waits-for-acks", ("invalidation_waits_for_acks",), "InvalidationCompletesInTime", "small",
               "an invalidation waits for every acknowledgement and never completes by expiry"),
        Mutant("no-namespace-check", ("no_namespace_check",), "NamespaceIsolation", "tenants",
               "the directory grants leases without checking the tenant's namespaces"),
        Mutant("write-lease-never-expires", ("write_lease_never_expires",), "WriteLeaseEndsInTime", "small",
               "a write lease whose holder vanished is never expired"),
        # One per property that no mutant above reaches first, in the configuration whose scope
        # lets it fail (``tiny``'s single writer checks ``second-write-grant`` clean).
        Mutant("second-write-grant", ("second_write_grant",), "OneWriterPerGeneration", "race",
               "the directory grants a second write lease on a key that is already WRITING"),
        Mutant("transfer-keeps-epoch", ("transfer_keeps_epoch",), "OneOwnerPerEpoch", "demote",
               "a promotion or demotion copies the block under the epoch it already has"),
        Mutant("epoch-not-recorded", ("epoch_not_recorded",), "EpochsBoundFences", "tiny",
               "the directory grants a write under epoch + 1 without recording the new epoch"),
        Mutant("epochs-not-durable", ("epochs_not_durable",), "EpochMonotonic", "restart",
               "a restarted directory forgot every key's epoch (kept in memory, not in its log)"),
        Mutant("completion-ignores-grace", ("completion_ignores_grace",), "NoDirtyRead", "restart",
               "a restarted directory completes an invalidation during its grace period, under a lease it forgot"),
        Mutant("grant-names-draining-copy", ("grant_names_draining_copy",), "NoReclaimUnderLease", "demote",
               "a read grant points the holder at the copy being drained, which the directory then frees"),
        Mutant("lost-copy-ends-generation", ("lost_copy_ends_generation",), "NoStaleRead", "tiering",
               "a node that rejoined without its disk makes the directory move to the key's next generation at once"),
        Mutant("write-survives-rejoin", ("write_survives_rejoin",), "LostCopyVoidedOnRejoin", "failover",
               "a node that rejoins leaves a write in progress to it open: its commit, already on its way, commits bytes "
               "the node lost"),
        # Progress and deletion (issue 8, section 3): each caught by its bounded-response property.
        Mutant("deadline-ignores-lag", ("deadline_ignores_lag",), "InvalidationCompletesInTime", "lagging",
               "the invalidation deadline argued with the directory's clock running ahead only (term + epsilon): a lagging clock breaks it"),
        Mutant("free-not-retried", ("free_not_retried",), "DeletionReachesEverywhere", "tiny",
               "the directory sends each Free once: a lost Free orphans the bytes forever"),
        Mutant("ended-write-not-freed", ("ended_write_not_freed",), "DeletionReachesEverywhere", "tiny",
               "a write lease that expires (or a write an invalidation aborts) leaves its bytes in their slot"),
        Mutant("late-bytes-after-free", ("late_bytes_after_free",), "DeletionReachesEverywhere", "tiny",
               "a slot takes bytes under an epoch it already freed: a paused writer's bytes land after their Free"),
        Mutant("silent-refusal", ("silent_refusal",), "RequestAnswered", "tiny",
               "the directory refuses a lease request without telling the requester"),
        Mutant("holder-never-times-out", ("holder_never_times_out",), "RequestEndsInTime", "tiny",
               "a holder waits for the answer to a lost request forever"),
        Mutant("revoke-keeps-pending-acquire", ("revoke_keeps_pending_acquire",), "NoReadAfterAck", "tiny",
               "a holder acks a revocation that overtook its grant, then trusts the grant when it arrives"),
        Mutant("no-failure-detector", ("no_failure_detector",), "CrashedOwnerWritableInTime", "failover",
               "the directory never declares a crashed node down: its owner copies stay COMMITTED, leased and unwritable"),
        # A restart that waits only for the leases outstanding (issue 14): the horizon it takes.
        Mutant("horizon-forgets-grace", ("horizon_forgets_grace",), "LeaseKnownToDirectory", "mirrored",
               "a directory restarted during its grace takes its horizon from its (empty) lease table alone: the leases an "
               "earlier incarnation granted are forgotten twice"),
        Mutant("horizon-short-by-a-tick", ("horizon_short_by_a_tick",), "LeaseKnownToDirectory", "mirrored",
               "a restarted directory waits one tick less than its longest mirrored lease may still run"),
        Mutant("writer-never-gives-up", ("writer_never_gives_up",), "Deadlock", "tiny",
               "a writer without a timeout waits forever for the answer to a lost BeginWrite: nothing can happen any more"),
    )
}
