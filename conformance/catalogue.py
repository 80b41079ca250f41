"""The catalogue of conformance tests: stable ids, RFC 2119 text, the property each checks.

Theory of operation
-------------------
Every test has an id that never changes meaning (``KVCC-<AREA>-<NNN>``; a changed requirement
gets a new id and the old one is retired, never reused), the suite version that added it, one
profile (``core``, ``leases``, ``invalidation``, ``tiering``, ``faults``, ``load``) and a
``required`` flag: certifying a profile needs every required test of it to PASS. The text is a
requirement in RFC 2119 words; ``properties`` name the spec's properties
(``kvcc.spec.properties``) and ``design`` the docs/protocol.md numbers the test observes.

``body`` names the function in ``kvcc.conformance.workloads`` that runs the test; every test's
trace is then validated against the spec (``kvcc.conformance.validate``). Tests numbered 9xx
are *audits*: they run no workload of their own but check the counts gathered over the other
tests of their profile (non-vacuity: a cache that never caches, never evicts or never fences
would satisfy every safety property vacuously). They count what the tests that ran (PASS or
FAIL) gathered up to where each stopped: a FAIL stops its test at the first failed check, so an
audit failing next to another test's failure may be only its knock-on.

``covers`` names the rules (``kvcc.conformance.testing`` known-bad adapters' ``BROKEN_RULE``)
whose violation the test is designed to detect. The suite's own tests assert that each
known-bad adapter fails exactly the tests covering its rule.

``docs/conformance.md`` is generated from this module (``kvcc conform --catalogue-md``).
"""

from __future__ import annotations

import re

from attrs import field, frozen

from .contract import FAULTS, OPTIONAL_FAULTS, PROFILES, SCOPES

SUITE_VERSION = "0.1.0"
TEST_ID_RE = re.compile(r"KVCC-(CORE|LEASE|INVAL|TIER|FAULT|LOAD|ENGINE)-[0-9]{3}")
ENGINE_TIME_LIMIT_S = 300.0  # engines start within the test (about half a minute each on two cores)
DEFAULT_TIME_LIMIT_S = 60.0

RULES = (
    "read_after_invalidation", "fencing", "evict_under_lease", "caching", "eviction", "lease_ids",
    "early_completion", "holder_expiry", "trace_complete", "torn_write",
)  # fmt: skip


@frozen
class TestCase:
    id: str
    title: str
    text: str  # RFC 2119
    profile: str
    properties: tuple[str, ...]
    design: str
    body: str
    since: str = SUITE_VERSION
    required: bool = True
    time_limit_s: float = DEFAULT_TIME_LIMIT_S
    faults: frozenset[str] = field(default=frozenset(), converter=frozenset)
    scopes: frozenset[str] = field(default=frozenset({"key"}), converter=frozenset)
    namespaces: int = 1  # authorised namespaces the test needs
    covers: frozenset[str] = field(default=frozenset(), converter=frozenset)
    audit: bool = False

    __test__ = False  # not a pytest test class

    def __attrs_post_init__(self) -> None:
        assert TEST_ID_RE.fullmatch(self.id), self.id
        assert self.profile in PROFILES, self.profile
        assert self.faults <= set(FAULTS), self.faults
        assert self.scopes <= set(SCOPES), self.scopes
        assert self.covers <= set(RULES), self.covers
        assert self.time_limit_s > 0

    def to_json(self) -> dict[str, object]:
        return {
            "id": self.id, "title": self.title, "text": self.text, "profile": self.profile,
            "properties": list(self.properties), "design": self.design, "since": self.since,
            "required": self.required, "time_limit_s": self.time_limit_s, "faults": sorted(self.faults),
            "scopes": sorted(self.scopes), "audit": self.audit,
        }  # fmt: skip


T = TestCase
CATALOGUE: tuple[TestCase, ...] = (
    # -- core -----------------------------------------------------------------------------------------
    T("KVCC-CORE-001", "Lookup finds the longest committed prefix",
      "Lookup MUST count the blocks of a chain that are COMMITTED, from the first, and MUST stop at the first "
      "block that is not; it MUST NOT count blocks of a chain whose parent links differ.",
      "core", ("PrefixClosed",), "10", "lookup_prefix"),
    T("KVCC-CORE-002", "One writer per key and generation",
      "Of concurrent begin_write requests for one ABSENT key from every node, exactly one MUST be granted; the "
      "others MUST be refused (not_absent). A second begin_write on a COMMITTED key MUST be refused.",
      "core", ("OneWriterPerGeneration", "OneOwnerPerEpoch"), "1", "one_writer", covers={"trace_complete", "caching"}),
    T("KVCC-CORE-003", "A remote read under lease returns the committed bytes",
      "A node holding a read lease on a block committed by another node MUST read exactly the committed bytes.",
      "core", ("CommittedBytesIntact", "DirectoryDataAgreement"), "3,4,9", "remote_read",
      covers={"caching", "trace_complete"}),
    T("KVCC-CORE-004", "No lease before commit",
      "A read lease MUST NOT be granted on a key that is WRITING, before or after its bytes are stored; it MUST "
      "be refused (not_committed) until the commit.",
      "core", ("NoDirtyRead", "LeasesGrantedOnlyOnCommitted"), "3", "no_dirty_read"),
    T("KVCC-CORE-005", "Chains are written root first",
      "begin_write of a block whose parent is not COMMITTED MUST be refused (parent_not_committed).",
      "core", ("PrefixClosed",), "10", "prefix_order"),
    T("KVCC-CORE-006", "Namespaces are isolated",
      "A request in a namespace the tenant is not authorised for MUST be refused (unauthorized) and lookup in "
      "it MUST count 0 blocks; the same tokens in another namespace MUST yield other keys.",
      "core", ("NamespaceIsolation",), "11", "namespace_isolation"),
    T("KVCC-CORE-007", "An aborted write frees the key",
      "After a writer aborts, the key MUST become writable again no later than the write lease term plus "
      "epsilon, under a higher epoch.",
      "core", ("OneWriterPerGeneration", "EpochMonotonic"), "1,2", "abort_frees", covers={"trace_complete", "caching"}),
    T("KVCC-CORE-008", "Concurrent chains on every node",
      "Under concurrent writers and readers on every node, every read MUST return exactly the committed bytes "
      "of its generation or a refusal, and prefixes MUST stay closed.",
      "core", ("CommittedBytesIntact", "PrefixClosed", "OneWriterPerGeneration"), "1,3,4,10", "concurrent_chains",
      covers={"caching", "trace_complete"}),
    T("KVCC-CORE-900", "Audit: leased hits are served",
      "A core run MUST show reads served under lease by a node other than the writer (a cache that never "
      "caches fails).", "core", ("RemoteReadUnderLease",), "non-vacuity", "audit", audit=True, covers={"caching"}),
    # -- leases ---------------------------------------------------------------------------------------
    T("KVCC-LEASE-001", "Lease ids are never reused",
      "Every read and write lease granted in a run MUST carry an id never granted before in that run.",
      "leases", ("LeaseIdsFresh",), "8", "lease_ids_unique"),
    T("KVCC-LEASE-002", "A released lease is dead",
      "After release, renewing the lease MUST be refused and reading under it MUST be refused.",
      "leases", ("RenewalNeverRevives",), "8", "released_lease"),
    T("KVCC-LEASE-003", "A holder stops at its own deadline",
      "A holder MUST NOT read under a lease after requested_at + term - epsilon on its clock, measured from "
      "when it sent the request; renewing such a lease MUST be refused.",
      "leases", ("LeaseKnownToDirectory", "RenewalNeverRevives"), "8", "holder_deadline",
      covers={"holder_expiry", "trace_complete", "caching"}),
    T("KVCC-LEASE-004", "No eviction under a live lease",
      "Evicting a copy under a live read lease MUST be refused (leased); once the lease is released, evicting "
      "it MUST succeed.",
      "leases", ("NoReclaimUnderLease",), "5", "evict_under_lease", covers={"evict_under_lease", "eviction"}),
    T("KVCC-LEASE-005", "A stale writer is fenced",
      "Bytes written under an epoch below the location's fence MUST be refused (fenced) and MUST NOT change "
      "the committed block; a commit under a superseded write lease MUST be refused.",
      "leases", ("FencingHolds", "EpochMonotonic", "CommittedBytesIntact"), "2", "stale_writer",
      covers={"fencing", "caching", "trace_complete"}),
    T("KVCC-LEASE-006", "Renewal extends a live lease",
      "Renewing a live lease MUST extend the holder's deadline from when the renewal was sent; a read after the "
      "first deadline and before the renewed one MUST be served. Once released, the key MUST be leased again by "
      "the same holder; a release after the holder's own deadline MUST NOT be a release of a trusted lease.",
      "leases", ("RenewalNeverRevives",), "8", "renewal_extends", covers={"caching", "trace_complete"}),
    T("KVCC-LEASE-900", "Audit: refused evictions and fenced writes",
      "A leases run MUST show an eviction refused because of a lease and a stale write refused by a fence.",
      "leases", ("RefusedEvictionOfLeasedBlock", "FencedStaleWrite"), "non-vacuity", "audit", audit=True,
      covers={"evict_under_lease", "fencing", "caching"}),
    # -- invalidation ---------------------------------------------------------------------------------
    T("KVCC-INVAL-001", "Invalidation with holders",
      "While an invalidation runs no lease MUST be granted on its keys; it MUST complete once every holder "
      "acknowledged; after completion no holder MUST read the old generation, and the key MUST be writable "
      "again under a higher generation whose bytes are then read exactly.",
      "invalidation", ("NoStaleRead", "NoReadAfterAck", "LeasesGrantedOnlyOnCommitted"), "6,7",
      "invalidate_with_holders", covers={"read_after_invalidation", "caching", "trace_complete"}),
    T("KVCC-INVAL-002", "Invalidating a key voids its descendants",
      "Invalidating a block MUST invalidate every block chained under it; lookup MUST then count 0 and none of "
      "them MUST be leased.",
      "invalidation", ("PrefixClosed", "NoStaleRead"), "6,10", "cascade", covers={"trace_complete", "caching"}),
    T("KVCC-INVAL-003", "Prefix-scoped invalidation",
      "Invalidating with scope prefix MUST void the subtree under the key and MUST leave its ancestors "
      "COMMITTED.", "invalidation", ("PrefixClosed",), "6,10", "prefix_scope", scopes={"prefix"},
      covers={"trace_complete", "caching"}),
    T("KVCC-INVAL-004", "Namespace-scoped invalidation",
      "Invalidating a namespace MUST void every block of it and MUST NOT touch another namespace.",
      "invalidation", ("NamespaceIsolation", "NoStaleRead"), "6,11", "namespace_scope", scopes={"namespace"},
      namespaces=2, covers={"trace_complete", "caching"}),
    T("KVCC-INVAL-005", "An empty invalidation completes",
      "Invalidating a key that was never written MUST complete promptly and MUST NOT create a block.",
      "invalidation", ("InvalidationCompletesInTime",), "progress", "empty_invalidation"),
    T("KVCC-INVAL-900", "Audit: invalidations completed by acknowledgement",
      "An invalidation run MUST show an invalidation with live holders that completed before their leases "
      "could expire.", "invalidation", ("InvalidationCompletedByAcks",), "non-vacuity", "audit", audit=True,
      covers={"caching"}),
    # -- tiering --------------------------------------------------------------------------------------
    T("KVCC-TIER-001", "Leaves are evicted before their ancestors",
      "Evicting a block whose child is cached MUST be refused (has_children); evicting the child and then the "
      "parent MUST succeed, and lookup MUST then count neither.",
      "tiering", ("PrefixClosed",), "10", "leaves_first", covers={"eviction"}),
    T("KVCC-TIER-002", "An evicted block can be written again",
      "After eviction a key MUST be writable again and its new bytes MUST be read back exactly by another node.",
      "tiering", ("CommittedBytesIntact", "EpochMonotonic"), "2,4", "rewrite_after_evict",
      covers={"eviction", "caching", "trace_complete"}),
    T("KVCC-TIER-003", "Evicting what a node does not hold changes nothing",
      "Evicting a key the node holds no copy of MUST be refused and MUST NOT change lookup.",
      "tiering", ("DirectoryDataAgreement",), "9", "evict_absent", covers={"trace_complete", "caching", "eviction"}),
    T("KVCC-TIER-900", "Audit: evictions happen",
      "A tiering run MUST show at least one eviction (a cache that never evicts fails).",
      "tiering", ("Eviction",), "non-vacuity", "audit", audit=True, covers={"eviction"}),
    # -- faults ---------------------------------------------------------------------------------------
    T("KVCC-FAULT-001", "A paused holder delays invalidation until its lease expires",
      "An invalidation whose holder is paused MUST NOT complete before the holder's own deadline, and MUST "
      "complete within term + 2 epsilon (plus delay); the resumed holder MUST NOT read the old generation.",
      "faults", ("NoStaleRead", "InvalidationCompletesInTime"), "6,progress", "paused_holder",
      faults={"pause", "resume"}, covers={"early_completion", "trace_complete", "caching"}),
    T("KVCC-FAULT-002", "A crashed owner hands over",
      "Reads of a killed node's blocks MUST NOT return other bytes; once it restarts without its memory, a "
      "block the directory still vouches for (its disk came back) MUST read back exactly, its keys MUST become "
      "writable again (after an invalidation, where the block survived) and the new bytes MUST be read exactly.",
      "faults", ("CommittedBytesIntact", "DirectoryDataAgreement"), "4,9", "crash_handoff",
      faults={"kill", "restart"}, covers={"caching", "trace_complete", "torn_write"}),
    T("KVCC-FAULT-003", "Lease ids survive a directory restart",
      "A restarted directory MUST NOT grant a lease id granted before the restart, and MUST NOT grant a "
      "conflicting write while a lease of its previous incarnation may be live.",
      "faults", ("LeaseIdsFresh", "LeaseKnownToDirectory"), "8,12", "directory_restart",
      faults={"restart_directory"}, covers={"lease_ids", "trace_complete", "caching", "early_completion"}),
    T("KVCC-FAULT-004", "Clock skew within epsilon is safe",
      "With a holder's clock offset by up to epsilon, every read MUST return the committed bytes or a refusal, "
      "and the holder MUST stop trusting no later than its skewed deadline.",
      "faults", ("LeaseKnownToDirectory", "CommittedBytesIntact"), "8", "clock_skew", faults={"skew_clock"},
      covers={"holder_expiry", "trace_complete", "caching"}),
    T("KVCC-FAULT-900", "Audit: invalidations completed by expiry",
      "A faults run MUST show an invalidation that completed by lease expiry.",
      "faults", ("InvalidationCompletedByExpiry",), "non-vacuity", "audit", audit=True,
      covers={"early_completion", "caching"}),
    # -- load -----------------------------------------------------------------------------------------
    T("KVCC-LOAD-001", "Mixed concurrent load",
      "Under a concurrent mix of writes, reads, invalidations and evictions on every node, every read MUST "
      "return the committed bytes or a refusal, no read MUST follow a completed invalidation of its "
      "generation, and the trace MUST validate.",
      "load", ("CommittedBytesIntact", "NoStaleRead", "NoReclaimUnderLease"), "3,4,5,6", "mixed_load",
      scopes={"key"}),
    T("KVCC-LOAD-900", "Audit: the load run cached",
      "A load run MUST show leased hits and evictions.", "load", ("RemoteReadUnderLease", "Eviction"),
      "non-vacuity", "audit", audit=True),
    # -- engine ---------------------------------------------------------------------------------------
    # Each test checks its own non-vacuity (it requires the loads it is about to have happened).
    T("KVCC-ENGINE-001", "A prefix one engine computed is reused by another, output unchanged",
      "After engine A computed a prompt, its full blocks MUST be committed (a save lost to a write lease that "
      "ran out is made again: A forgets the prompt and serves it again, up to three times), and the same "
      "prompt in another "
      "namespace (another tenant's cache salt) MUST load none of them; engine B, which never saw the prompt, "
      "and A once it forgot it, MUST load every one of them, and their greedy outputs (tokens and top "
      "log-probabilities) MUST equal the output computed without the cache.",
      "engine", ("CommittedBytesIntact", "DirectoryDataAgreement"), "3,4,9", "engine_prefix_reuse",
      namespaces=2, time_limit_s=ENGINE_TIME_LIMIT_S),
    T("KVCC-ENGINE-002", "After a namespace invalidation no engine uses the old KV",
      "Once an invalidation of the engines' namespace completed (a tenant deleted, a model revision "
      "rewritten), no engine MUST load any block of it: a prompt served again on every engine MUST load "
      "nothing and MUST give the output computed without the cache.",
      "engine", ("NoStaleRead", "InvalidationCompletesInTime"), "5,6", "engine_namespace_invalidation",
      scopes={"namespace"}, namespaces=2, time_limit_s=ENGINE_TIME_LIMIT_S),
    T("KVCC-ENGINE-003", "An engine killed mid-save leaves no partial block",
      "When an engine is killed while it computes and saves a prompt, what it committed MUST be a prefix of "
      "whole blocks; another engine MUST load exactly that prefix and recompute the rest, with the output "
      "computed without the cache.",
      "engine", ("CommittedBytesIntact", "PrefixClosed"), "4,9,10", "engine_killed_mid_save",
      namespaces=2, time_limit_s=ENGINE_TIME_LIMIT_S),
    T("KVCC-ENGINE-004", "A paused engine does not load under leases that expired",
      "An engine paused while it serves a prompt from the cache, for longer than a lease term plus epsilon, "
      "while the prompt's blocks are invalidated and rewritten, MUST NOT use bytes read under an expired or "
      "revoked lease once it resumes: its output MUST be the one computed without the cache.",
      "engine", ("NoStaleRead", "LeaseKnownToDirectory"), "2,5,8", "engine_paused_leases_expire",
      namespaces=2, time_limit_s=ENGINE_TIME_LIMIT_S),
    T("KVCC-ENGINE-005", "The engines' index agrees with the directory after an engine restart",
      "The deployment's view of what each engine holds, built from what the engines announce, MUST forget "
      "what a restarted engine held once the new process announces anything, and every prompt block it then "
      "says the engine holds MUST be committed.",
      "engine", ("DirectoryDataAgreement",), "9", "engine_index_after_restart",
      namespaces=2, time_limit_s=ENGINE_TIME_LIMIT_S),
)
del T

BY_ID = {t.id: t for t in CATALOGUE}
assert len(BY_ID) == len(CATALOGUE), "test ids are unique"
assert {t.profile for t in CATALOGUE} == set(PROFILES), "every profile has tests"


def tests_for(profiles) -> list[TestCase]:
    """The tests of ``profiles`` in catalogue order (a profile's audit after its other tests)."""
    wanted = set(profiles)
    return [t for t in CATALOGUE if t.profile in wanted]


def required_ids(profiles, faults=None) -> set[str]:
    """The required tests of ``profiles``. A test that needs an optional fault (``OPTIONAL_FAULTS``)
    is required only of an adapter that declares it: ``faults``, its declared faults (None: all)."""
    declared = None if faults is None else frozenset(faults)
    return {t.id for t in tests_for(profiles)
            if t.required and (declared is None or t.faults & OPTIONAL_FAULTS <= declared)}


def _requirement(t: TestCase) -> str:
    optional = sorted(t.faults & OPTIONAL_FAULTS)
    if not t.required:
        return "optional"
    return f"required of an adapter that declares {', '.join(optional)}" if optional else "required"


def _protocol_citation(design: str) -> str:
    """A test's ``design`` as the document cites it: numbers as protocol properties ("protocol
    properties 6,10"), words ("progress", "non-vacuity") as sections of docs/protocol.md."""
    parts = design.split(",")
    numbers = [p for p in parts if p.isdigit()]
    cited = [f"protocol {'property' if len(numbers) == 1 else 'properties'} {','.join(numbers)}"] if numbers else []
    cited += [f"docs/protocol.md {p}" for p in parts if not p.isdigit()]
    return "; ".join(cited)


def catalogue_markdown() -> str:
    """The conformance document, generated (``kvcc conform --catalogue-md``)."""
    lines = [
        "# kvcc conformance tests",
        "",
        f"Suite version {SUITE_VERSION}. Generated from `conformance/catalogue.py` by "
        "`kvcc conform --catalogue-md`; do not edit by hand.",
        "",
        "The key words MUST, MUST NOT, SHOULD and MAY are to be read as in RFC 2119. A profile is certified "
        "when every required test of it PASSes with its trace ACCEPTED by the validator (`kvcc certify verify` "
        "re-validates them): a trace that is missing, empty, incomplete against the suite's own history, or "
        "INCONCLUSIVE never counts (a test whose trace went past the validator's bounds runs again, at most "
        "twice, and counts only once a trace is ACCEPTED). Tests numbered 9xx are audits over the counts of their profile's other tests "
        "that ran (PASS or FAIL): a test that FAILs stops at its first failed check, so the counts it would have "
        "added after it are missing, and an audit that fails in a run where another test of its profile failed "
        "may be only a knock-on: fix that test first (the audit's message names it).",
        "",
        "| profile | tests | required |",
        "|---|---|---|",
    ]
    for p in PROFILES:
        ts = tests_for([p])
        lines.append(f"| {p} | {len(ts)} | {sum(t.required for t in ts)} |")
    for p in PROFILES:
        lines += ["", f"## Profile `{p}`", ""]
        for t in tests_for([p]):
            needs = []
            if t.faults:
                needs.append("faults: " + ", ".join(sorted(t.faults)))
            if t.scopes != {"key"}:
                needs.append("scopes: " + ", ".join(sorted(t.scopes)))
            lines += [
                f"### {t.id}: {t.title}",
                "",
                t.text,
                "",
                f"- properties: {', '.join(t.properties)} ({_protocol_citation(t.design)})",
                f"- since {t.since}; {_requirement(t)}; time limit {t.time_limit_s:g} s"
                + (f"; needs {'; '.join(needs)}" if needs else ""),
                "",
            ]
    return "\n".join(lines).rstrip() + "\n"


# -- tests added for the suite's mutation score (kvcc.conformance.mutation): each one fails mutants of
# the reference that the tests above let through. Each goes before its profile's audit (an audit
# counts the tests run before it).

_MUTATION_TESTS: tuple[TestCase, ...] = (
    TestCase("KVCC-CORE-009", "A block belongs to the namespace it was written in",
             "For a tenant authorised for two namespaces, lookup under one MUST NOT count blocks written under the "
             "other, acquire of such a block through the other namespace MUST be refused, and begin_write MUST "
             "refuse a parent of another namespace and a known key named through the other namespace; acquire of a "
             "never-written key in a namespace the tenant may "
             "not use MUST be refused (unauthorized).",
             "core", ("NamespaceIsolation", "PrefixClosed"), "10,11", "namespace_bound",
             namespaces=2, covers={"caching", "trace_complete"}),
    TestCase("KVCC-CORE-010", "No lease on a key nobody wrote",
             "Acquire of a key that was never written MUST be refused, and lookup MUST NOT count it; releasing a "
             "lease a second time MUST be harmless.",
             "core", ("LeasesGrantedOnlyOnCommitted", "NoDirtyRead"), "3", "never_written"),
    TestCase("KVCC-LEASE-007", "A renewed lease protects its copy until the renewed expiry",
             "After a renewal, evicting the leased copy MUST be refused (leased) past the first lease's expiry and "
             "before the renewed one; once the renewed lease has expired, evicting it MUST succeed.",
             "leases", ("NoReclaimUnderLease", "RenewalNeverRevives"), "5,8", "renewal_protects",
             covers={"evict_under_lease", "eviction"}),
    TestCase("KVCC-LEASE-008", "A writer past its write lease is refused",
             "A writer whose bytes are stored but whose write lease expired (term plus epsilon) before it commits "
             "MUST have its commit refused; lookup MUST NOT find the block, and another node MUST be able to write "
             "the key.",
             "leases", ("OneWriterPerGeneration", "WriteLeaseEndsInTime", "NoDirtyRead"), "1,3", "late_commit"),
    TestCase("KVCC-INVAL-006", "Invalidation names the key's own namespace",
             "Invalidating a key through another namespace the tenant is authorised for MUST NOT void it: lookup "
             "MUST still count it and reads MUST return its bytes; once it is invalidated in its own namespace, "
             "begin_write of it through the other namespace MUST be refused, and of its child named as a root "
             "there refused `unauthorized` (or `wrong_shard` by a shard not owning that root), never `key_identity`, "
             "which would tell the other namespace the key exists.",
             "invalidation", ("NamespaceIsolation", "NoStaleRead"), "6,11", "invalidate_other_namespace",
             namespaces=2, covers={"caching", "trace_complete"}),
    TestCase("KVCC-INVAL-007", "Invalidation while a block is only being written",
             "Invalidating a key, or a namespace, whose only block is still being written MUST complete; the write "
             "MAY then commit, and a read MUST return exactly what was committed.",
             "invalidation", ("NoDirtyRead", "InvalidationCompletesInTime"), "3,6", "invalidate_during_write",
             scopes={"key", "namespace"}, covers={"caching", "trace_complete"}),
    TestCase("KVCC-INVAL-008", "A ticket counts the blocks it voids",
             "The ticket of an invalidation MUST count the COMMITTED blocks it voids: a block and its committed "
             "descendants for a key, every committed block of the namespace for a namespace.",
             "invalidation", ("InvalidationCompletesInTime",), "6", "ticket_counts", scopes={"key", "namespace"}),
    TestCase("KVCC-FAULT-005", "A lease survives a directory restart",
             "After a directory restart, renewing and releasing a lease granted before it MUST be answered "
             "(granted or refused; ignored), and evicting the copy it protects MUST be refused while that lease "
             "may be live.",
             "faults", ("NoReclaimUnderLease", "LeaseKnownToDirectory"), "5,12", "lease_across_restart",
             faults={"restart_directory"}, covers={"eviction"}),
    TestCase("KVCC-FAULT-007", "An invalidation survives a directory restart",
             "A wait on an invalidation blocked by a paused holder MUST time out (answer not completed) while the "
             "holder's lease is live; if the directory then restarts, the invalidation MUST still complete, no "
             "earlier than that holder's lease could expire, and the resumed holder MUST NOT read the old generation.",
             "faults", ("NoStaleRead", "InvalidationCompletesInTime"), "6,12", "restart_during_invalidation",
             faults={"pause", "resume", "restart_directory"}, covers={"early_completion"}),
    TestCase("KVCC-FAULT-006", "A restarted node works like a new one",
             "A node that read a block under a lease and released it, took another lease on it, then was killed and "
             "restarted without its memory, MUST be able to acquire and read exactly the bytes written after its "
             "restart; a block the directory still vouches for after the restart (its disk came back) MUST read "
             "back exactly first.",
             "faults", ("CommittedBytesIntact", "LeaseKnownToDirectory"), "4,9", "restarted_node",
             faults={"kill", "restart"}, covers={"caching", "trace_complete", "torn_write"}),
)


def _append(extra: tuple[TestCase, ...]) -> None:
    """Add a block of tests to ``CATALOGUE`` and ``BY_ID``, each before its profile's audit (audits
    come last in a profile)."""
    global CATALOGUE
    out = list(CATALOGUE)
    for t in extra:
        assert t.id not in BY_ID, f"test ids are unique: {t.id}"
        at = next((i for i, u in enumerate(out) if u.profile == t.profile and u.audit), len(out))
        out.insert(at, t)
        BY_ID[t.id] = t
    CATALOGUE = tuple(out)


_append(_MUTATION_TESTS)


# -- deletion reaches everywhere (KVCC-INVAL-009) ---------------------------------------------------
# Appended as one block: the rule, the test, placed before its profile's audit (audits come last).
RULES = RULES + ("deletion",)
_DELETION = TestCase(
    "KVCC-INVAL-009", "Deletion reaches every location",
    "Once a generation ended -- an invalidation completed, a write was aborted or its write lease expired -- "
    "every location that stored its bytes MUST free them within the adapter's declared free bound "
    "(`Capabilities.free_bound_ms`, default 8000 ms: the reference retries an unacknowledged free after 1 s, "
    "doubling up to 8 s) plus one lease term, counted from the end the suite saw (for a write, from its grant "
    "plus the term and twice epsilon), and an adapter with native events MUST log it (`free_slot`, or "
    "`fence_stale_free` under an epoch at least the stored one). A lost free MUST be sent again. An adapter "
    "that declares `Capabilities.frees_acknowledged` MUST also show each free settled: the directory's "
    "`free_acked` for it, within the same bound. With inferred "
    "events the suite sees no location and checks only that the generations are gone from the directory.",
    "invalidation", ("DeletionReachesEverywhere",), "progress", "deletion_reaches_everywhere",
    time_limit_s=DEFAULT_TIME_LIMIT_S, covers={"deletion"},
)  # fmt: skip
_append((_DELETION,))
del _DELETION


# -- tiers: reclaimed space, late and corrupt bytes, fences after a restart (KVCC-TIER-004/005, KVCC-FAULT-010..012)
# Appended as one block, each test before its profile's audit (audits come last).
_TIER_TESTS = (
    TestCase("KVCC-TIER-004", "Evicted space is reused",
             "A node MUST keep taking blocks while it evicts them: 640 blocks written one after another on one "
             "node (some of 1 and of 4096 bytes), each committed, read back exactly by another node and evicted, "
             "MUST all be stored and evicted: the space a block held MUST be reusable once it is evicted and no "
             "reader is copying it, and MUST NOT be reused while the block lives: a block written and read before "
             "them MUST read back exactly after them.",
             "tiering", ("CommittedBytesIntact", "Eviction"), "4,5", "space_reclaimed",
             time_limit_s=180.0, covers={"caching", "eviction", "trace_complete"}),
    TestCase("KVCC-TIER-005", "Bytes of an expired write stay deleted",
             "Bytes sent under a write lease that expired, after the key was written again under a higher epoch "
             "by another node, MUST NOT land once the location freed that generation (their epoch is at or below "
             "the one it freed: the trace is judged by the location's freed epoch), a commit under that grant MUST "
             "be refused, and the key's block MUST read back exactly. (With inferred events no late bytes are sent: "
             "the suite sees no location.)",
             "tiering", ("FencingHolds", "DeletionReachesEverywhere", "CommittedBytesIntact"), "2,4,progress",
             "late_bytes_stay_deleted", covers={"caching", "trace_complete"}),
    TestCase("KVCC-FAULT-010", "Corrupt bytes at rest are a miss",
             "Once one byte of a committed block is damaged where it is stored (any of the first 96 bytes of what "
             "the location keeps to vouch for it, or a byte of the payload: the `corrupt` fault), a read of it "
             "under a lease MUST be refused (miss) and MUST NOT return bytes, also when the block was read before it "
             "was damaged; evicting the copy MUST succeed and the key MUST then take new bytes that are read back "
             "exactly.",
             "faults", ("CommittedBytesIntact",), "4", "corrupt_is_a_miss", faults={"corrupt"},
             covers={"caching", "eviction", "trace_complete"}),
    TestCase("KVCC-FAULT-011", "A restarted node fences bytes sent before its crash",
             "Bytes a node's writer sent under a write lease that then expired, landing at that node after it was "
             "killed and restarted without its memory, once the key was written again under a higher epoch, MUST be "
             "refused (the restarted location takes its fences back from the directory) and MUST NOT change the "
             "key's block, which MUST read back exactly. (With inferred events no late bytes are sent: the suite "
             "sees no location.)",
             "faults", ("FencingHolds", "EpochMonotonic", "CommittedBytesIntact"), "2,4", "fenced_after_restart",
             faults={"kill", "restart"}, covers={"fencing", "caching", "trace_complete"}),
    TestCase("KVCC-FAULT-012", "A free owed to a restarted node is judged by what it holds now",
             "A free owed to a node that was down when its block's generation ended, reaching it after it restarted "
             "without its memory and after the key was written again under a higher epoch -- elsewhere, or by "
             "that node itself -- MUST be refused by the restarted location as stale and MUST NOT free the newer "
             "block (the trace is validated against the fence it took back from the directory and the block it "
             "holds), and the key's new block MUST read back exactly.",
             "faults", ("FencingHolds", "CommittedBytesIntact"), "2,4,progress", "free_after_restart",
             faults={"kill", "restart"}, covers={"caching", "trace_complete"}),
)  # fmt: skip
_append(_TIER_TESTS)
del _TIER_TESTS


# -- one request per client, grants of one node, timers under load, overlapping invalidations, paused and
# dead nodes -------------------------------------------------------------------------------------------
# Appended as one block, each test before its profile's audit: tests that fail mutants of the
# in-process deployment the tests above let through (kvcc.conformance.mutation).
_CLIENTS_AND_FAULTS: tuple[TestCase, ...] = (
    TestCase("KVCC-CORE-011", "A writer has one write of a key at a time",
             "A node's second begin_write of a key it is writing MUST be refused and MUST NOT disturb the first "
             "write, whose bytes MUST then commit and be read exactly; an abort after the commit MUST change "
             "nothing. Once a node's unused write lease ran out, its next begin_write of the key MUST be granted "
             "(within a few terms) under a higher epoch.",
             "core", ("OneWriterPerGeneration", "EpochMonotonic", "WriteLeaseEndsInTime"), "1,2",
             "one_write_per_writer", covers={"caching", "trace_complete"}),
    TestCase("KVCC-CORE-012", "A write grant commits only for its writer",
             "A write grant presented on behalf of another node than the one it was granted to MUST NOT commit "
             "(refused, or AdapterError); the writer's own bytes under it MUST then commit and be read exactly.",
             "core", ("OneWriterPerGeneration", "CommittedBytesIntact"), "1,4", "grant_of_another_node",
             covers={"caching", "trace_complete"}),
    TestCase("KVCC-LEASE-009", "A holder has one lease of a key at a time",
             "A holder's second acquire of a key it trusts a lease on MUST be refused and MUST NOT disturb that "
             "lease; once the lease ran out, the holder's acquire MUST be granted (within a few terms), reading and "
             "renewing under the old lease MUST be refused, and releasing the old lease MUST NOT end the new one.",
             "leases", ("LeaseIdsFresh", "RenewalNeverRevives", "LeaseKnownToDirectory"), "8",
             "one_lease_per_holder", covers={"caching", "trace_complete"}),
    TestCase("KVCC-LEASE-010", "Leases run out on time while others are granted",
             "While another node keeps writing, leasing and releasing other keys, an unused write lease MUST run out "
             "(another node MUST be granted the key within a few terms) and an unreleased read lease MUST run out "
             "(evicting its copy MUST succeed within a few terms).",
             "leases", ("WriteLeaseEndsInTime", "NoReclaimUnderLease"), "5,8", "expiry_under_churn", covers={"eviction"}),
    TestCase("KVCC-FAULT-013", "Overlapping invalidations across a directory restart",
             "A second invalidation of a key already INVALIDATING MUST count it (ticket keys 1) and, like the first, "
             "MUST NOT complete before a paused holder's lease could expire, across a directory restart; a ticket "
             "that completed before the restart MUST still be complete after it.",
             "faults", ("NoStaleRead", "InvalidationCompletesInTime"), "6,12", "overlapping_invalidations",
             faults={"pause", "resume", "restart_directory"}, covers={"early_completion"}),
    TestCase("KVCC-FAULT-008", "A paused node answers nothing; a killed one serves nothing",
             "Operations naming a paused node (acquire, write_bytes, invalidate) MUST NOT answer while it is paused "
             "(they block until it resumes, or fail with AdapterError); an invalidation waiting on its lease MUST "
             "complete within a wait of a few terms; a killed node MUST NOT be granted a lease (its operations fail "
             "with AdapterError or are refused) until it restarts. (With inferred events the suite runs one "
             "operation at a time and makes no call on the paused node.)",
             "faults", ("NoStaleRead", "InvalidationCompletesInTime", "CommittedBytesIntact"), "4,6,progress", "idle_nodes",
             faults={"pause", "resume", "kill", "restart"}, covers={"caching", "trace_complete"}),
    TestCase("KVCC-FAULT-009", "Dead nodes take no part in an invalidation",
             "An invalidation of a block whose holder was killed MUST complete once the holder restarted, and one "
             "of a block whose only copy's node was killed MUST complete, with no event of a dead incarnation; once "
             "the nodes are back, both keys MUST be written and read again.",
             "faults", ("NoStaleRead", "InvalidationCompletesInTime", "CommittedBytesIntact"), "4,6,9",
             "dead_nodes_in_invalidation", faults={"kill", "restart"}, covers={"caching", "trace_complete"}),
)  # fmt: skip
_append(_CLIENTS_AND_FAULTS)


# -- a write across its writer's restart, frees held back by a directory restart's grace
# (KVCC-FAULT-014/015) ---------------------------------------------------------------------------------
# Appended as one block, each test before its profile's audit: tests that fail mutants of the
# in-process deployment's restart and free retries (kvcc.conformance.mutation) the tests above let through.
_GRACE_FREES = (
    TestCase("KVCC-FAULT-014", "Frees held back by a directory restart leave when its grace ends",
             "Writes granted right after a directory restart whose leases run out unused, some inside the restart "
             "grace (while the directory frees nothing), MUST have their bytes freed once the grace ended: every "
             "location that stored them MUST free them within the deletion bound of KVCC-INVAL-009 counted from the "
             "write's grant, and an adapter with native events MUST log it. With inferred events the suite sees no "
             "location and checks only that the generations are gone from the directory.",
             "faults", ("DeletionReachesEverywhere",), "progress", "freed_after_grace",
             faults={"restart_directory"}, covers={"deletion"}),
    TestCase("KVCC-FAULT-015", "A writer's restart ends its write, which is never committed",
             "A write whose bytes were stored and whose writer is then killed and restarted without its memory "
             "MUST NOT be committed afterwards: its commit MUST be refused (the node's rejoin ends every write in "
             "progress to it, and a commit already on its way would publish bytes the node lost); another node's "
             "begin_write MUST be granted, under a higher epoch, once the node rejoined or the write lease ran out "
             "(within a few terms), and the new block MUST read back exactly on the restarted node.",
             "faults", ("OneWriterPerGeneration", "EpochMonotonic", "WriteLeaseEndsInTime", "CommittedBytesIntact",
                        "LostCopyVoidedOnRejoin"),
             "1,2,4", "write_across_writer_restart", faults={"kill", "restart"}, covers={"caching", "trace_complete"}),
)  # fmt: skip
_append(_GRACE_FREES)


# -- a revocation that finds its holder no longer trusting, an invalidation through a foreign namespace
# (KVCC-INVAL-011/012) ------------------------------------------------------------------------------
# Appended as one block, each test before its profile's audit: tests that fail mutants of the
# in-process deployment (kvcc.conformance.mutation) the tests above let through.
_LATE_REVOKES = (
    TestCase("KVCC-INVAL-011", "A revocation reaching a holder that stopped trusting is acknowledged",
             "An invalidation of a block whose holder's own deadline passed (it read past it and no longer trusts "
             "the lease) while the directory still held the lease live MUST complete; no read under the old lease "
             "may then return bytes, and the key MUST then take new bytes that the same holder reads exactly.",
             "invalidation", ("NoStaleRead", "InvalidationCompletesInTime", "CommittedBytesIntact"), "6,8",
             "revoke_after_holder_deadline", covers={"caching", "trace_complete"}),
    TestCase("KVCC-INVAL-012", "An invalidation through a foreign namespace voids nothing",
             "An invalidation in a namespace the tenant is not authorised for -- of a key of its own namespace named "
             "through it, or (where supported) of the whole namespace -- MUST void nothing and MUST answer a ticket "
             "of 0 keys that is complete at once; the block MUST stay committed and be read back exactly.",
             "invalidation", ("NamespaceIsolation", "CommittedBytesIntact"), "11", "invalidate_foreign_namespace",
             scopes={"key"}, covers={"caching", "trace_complete"}),
)  # fmt: skip
_append(_LATE_REVOKES)


# -- overwrites, and rewrites racing readers (KVCC-CORE-013, KVCC-INVAL-013) -------------------------
# Appended as one block, each test before its profile's audit. The store a real system gets wrong
# here keeps a key's first bytes for good (write-once, content-addressed: ``WriteOnceAdapter``).
RULES = RULES + ("overwrite",)
_OVERWRITES = (
    TestCase("KVCC-CORE-013", "A committed key is not overwritten in place",
             "begin_write of a key that holds committed bytes MUST be refused as not absent (`not_absent`), by its "
             "writer and by any other node, and the block MUST still read back exactly. Once an invalidation of the "
             "key completed, new bytes of the same size written as its next generation -- by the node whose "
             "location held the old bytes, then by another -- MUST read back exactly on every node, under a higher "
             "generation each time; a write that succeeds and keeps the old bytes fails. Once invalidated again, "
             "begin_write naming another parent than the key was written under MUST be refused (`key_identity`: "
             "a key's digest chains over its parent's), likewise by a node that never wrote the key (only the "
             "directory knows its parent: a native trace MUST log that refusal).",
             "core", ("OneWriterPerGeneration", "CommittedBytesIntact", "EpochMonotonic"), "1,2,4", "overwrite_refused",
             covers={"overwrite", "caching", "trace_complete"}),
    TestCase("KVCC-INVAL-013", "Rewrites racing readers",
             "A key invalidated and rewritten with new bytes of the same size, six times by the nodes in turn, while "
             "three readers spread over the nodes keep acquiring, reading and releasing it: every read that returns "
             "bytes MUST return exactly the bytes of the generation its lease names -- never a mix of two, never a "
             "generation not committed, never one whose invalidation had completed when the read started -- and a "
             "refusal is allowed. Each generation MUST be read by some reader within four terms of its commit, and "
             "the last MUST read back exactly.",
             "invalidation", ("NoStaleRead", "NoDirtyRead", "CommittedBytesIntact"), "3,4,6", "rewrite_racing_readers",
             covers={"overwrite", "caching", "trace_complete"}),
)  # fmt: skip
_append(_OVERWRITES)


# -- a commit racing an invalidation (KVCC-INVAL-014) -------------------------------------------------
# What a directory gets wrong that updates a key's record by read-modify-write with no revision
# check: an invalidation landing inside a commit is undone when the commit writes its record back
# (``CommitLostUpdateAdapter``). Only a race shows it: every sequential test sees whole commits.
RULES = RULES + ("commit_race",)
_COMMIT_RACES = (
    TestCase("KVCC-INVAL-014", "A commit racing an invalidation",
             "A fresh block's commit and an invalidation of its key, sent together from two nodes nine times with "
             "the invalidation starting from just before to well after the commit, MUST each end as one of the two "
             "orders: the invalidation counted the block (its ticket's keys) and, once it completed, no node is "
             "granted the block and lookup does not count it; or it did not count it and a commit that was accepted "
             "reads back exactly on another node. An invalidation MUST NOT count a block whose commit was refused.",
             "invalidation", ("NoStaleRead", "NoDirtyRead", "CommittedBytesIntact", "InvalidationCompletesInTime"),
             "3,4,6", "commit_racing_invalidation", covers={"commit_race", "caching", "trace_complete"}),
)  # fmt: skip
_append(_COMMIT_RACES)


RULES = RULES + ("data_plane_grant",)
_DATA_PLANE = (
    TestCase("KVCC-FAULT-016", "An outsider gets no bytes at a location",
             "A location MUST serve or store a block's bytes only for the principal the directory granted them "
             "to (protocol property 13): an outsider -- another tenant, where the deployment has tenants -- asking "
             "the location directly (the `intrude` operation) for a committed block's bytes or to overwrite them, "
             "while a reader holds a live lease on it, and to store its own bytes under a writer's live write "
             "grant, MUST be refused whether it presents no grant, a forged one or the owner's own grant taken off "
             "the wire; the block MUST then read back exactly for its reader, and the writer's bytes MUST land, "
             "commit and read back exactly.",
             "faults", ("CommittedBytesIntact", "NamespaceIsolation"), "4,11,13", "outsider_refused_at_the_location",
             faults={"intrude"}, covers={"data_plane_grant", "caching", "trace_complete"}),
)  # fmt: skip
_append(_DATA_PLANE)


RULES = RULES + ("overload",)
_OVERLOAD = (
    TestCase("KVCC-TIER-006", "Overload is refused cleanly and loses no committed block",
             "Every node writing at once twice what the deployment declares it holds (`Capabilities.capacity_bytes`, "
             "in blocks of `block_bytes`), each write MUST be stored and committed or refused with a reason, never "
             "an error; the overload MUST show (writes refused, or blocks no longer found: evicted through the "
             "directory); and every block committed during it that the directory still grants MUST read back "
             "exactly: a location that drops a block to make room without telling the directory loses a "
             "committed block. An adapter that declares no capacity gets this test NOT_APPLICABLE and cannot "
             "certify for tiering.",
             "tiering", ("CommittedBytesIntact", "DirectoryDataAgreement", "NoReclaimUnderLease"), "4,5,9",
             "overload_refused_cleanly", time_limit_s=300.0, covers={"overload", "caching", "trace_complete"}),
)  # fmt: skip
_append(_OVERLOAD)


# -- a node killed while a block's bytes land (KVCC-FAULT-017) ---------------------------------------
# What a store gets wrong that acknowledges a block before all of it is on its medium (write-behind)
# and keeps what did land across a crash: a torn block, vouched for by the directory, served after the
# restart (``TornWriteAdapter``). Only a crash after a write shows it: KVCC-FAULT-002 and -006 kill a node
# right after writing to it too; this test also kills it while the bytes are on their way.
_KILLED_MID_WRITE = (
    TestCase("KVCC-FAULT-017", "A node killed mid-write exposes no partial block",
             "The node holding a fresh block's location (or, for a location on no node, the writer) is killed -- "
             "while the block's bytes are being written, at several offsets after `write_bytes` started, and right "
             "after the block's commit was accepted -- then restarted. Afterwards every read of the key on every "
             "node that returns bytes MUST return exactly the block's bytes, and only if its commit was accepted: "
             "never part of them, zeros or bytes of no commit; and the key MUST take a new block, written by "
             "another node, within the bound of a write lease (after an invalidation, where the first block "
             "survived), which MUST read back exactly. The write that the kill cut short MAY fail or be refused. "
             "With inferred events the suite kills only between calls.",
             "faults", ("CommittedBytesIntact", "NoDirtyRead", "WriteLeaseEndsInTime", "LostCopyVoidedOnRejoin"),
             "1,4,12", "killed_mid_write", time_limit_s=300.0, faults={"kill", "restart"},
             covers={"torn_write", "caching", "trace_complete"}),
)  # fmt: skip
_append(_KILLED_MID_WRITE)

# -- a crashed owner (P4) ---------------------------------------------------------------------------
# No other test leaves a node down: each restarts its node at once. A directory with no failure
# detector (a crashed owner's key unwritable until the node comes back, if it ever does) passed
# them all; and one that declares the node down must log it, which the validator checks for time.
_CRASHED_OWNER = (
    TestCase("KVCC-FAULT-018", "A crashed owner's block is given up while its node stays down",
             "A committed block whose owner copy is on a node (not a shared location) that is killed and stays "
             "down: the directory MUST declare the node down and void the block within its failure-detection time "
             "(a lease term) plus the invalidation bound, so that another node's begin_write of the key is granted "
             "within a few terms while the node is still down, and the new block MUST read back exactly -- on the "
             "writer before the node restarts, and on the restarted node after. Another node's block MUST keep being "
             "served, exactly, throughout; the free of the voided block owed to the node MUST reach it once it is "
             "back, within the free bound plus a term (native traces); a block the node writes once back MUST be "
             "served after a directory restart too. Before all this, the node killed and restarted at once MUST "
             "NOT be declared down: a block it writes once back MUST still be served a detection time later. "
             "A block owned at a shared location "
             "MUST instead keep being served, exactly, while the node is down.",
             "faults", ("CrashedOwnerWritableInTime", "CrashedOwnerDeclaredDown", "CommittedBytesIntact"),
             "4,progress", "crashed_owner_failover", faults={"kill", "restart"},
             covers={"caching", "trace_complete", "deletion", "lease_ids"}),
)  # fmt: skip
_append(_CRASHED_OWNER)


# -- an invalidation racing a tier transfer (KVCC-TIER-007) ------------------------------------------
# What a directory gets wrong that drops a transfer under way when an invalidation voids its key:
# the copy lands at the destination after the generation ended and nothing frees it
# (``ForgetsTransferAdapter``). Only a race shows it: a transfer that finished first is freed
# with the owner, and one the invalidation came before was never started.
RULES = RULES + ("transfer_race",)
_TRANSFER_RACES = (
    TestCase("KVCC-TIER-007", "An invalidation racing a tier transfer leaves no copy at either end",
             "A committed block's tier transfer (the `move` operation) and an invalidation of its key, sent "
             "together from two nodes ten times with the invalidation starting from just before to well after "
             "the transfer, then once after a transfer finished -- whose destination MUST first serve the block's "
             "exact bytes, a lease on whose source held across it MUST still read them, and whose source MUST free "
             "them within the deletion bound once that lease is released, then once more with no reader, asked twice in a "
             "row -- the second `move` MUST be refused, the source MUST be freed within the deletion bound by the "
             "transfer's own end, and once the block moved on again, a `move` under the first grant MUST be refused "
             "unless the block came back to its location, and a `move` under a grant on a generation invalidated and written again since MUST be refused (a transfer whose destination is paused as it starts MUST "
             "finish once it resumes, one whose destination on another node is killed as it starts MUST leave the block "
             "served by its source -- also when that node stays down until declared down, after which, once it is back, "
             "a new `move` of the block MUST start and its copy become the one read -- and a `move` under a grant whose node was killed MUST fail with AdapterError): once each invalidation completed, lookup MUST NOT count the block and no node may be "
             "granted it, and within the deployment's deletion bound every location that held that generation -- "
             "the source and, wherever the copy landed, the destination -- MUST free it: a copy landing after the "
             "invalidation is fenced or freed, never kept. (Only an adapter with native events declares `move`.)",
             "tiering", ("NoStaleRead", "CommittedBytesIntact", "NoReclaimUnderLease", "DeletionReachesEverywhere"),
             "2,4,5,9,progress",
             "invalidation_racing_transfer", faults={"move"},
             covers={"transfer_race", "deletion", "caching", "trace_complete", "overwrite"}),
)  # fmt: skip
_append(_TRANSFER_RACES)
