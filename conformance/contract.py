"""The adapter contract: what an implementation exposes to the conformance suite.

Theory of operation
-------------------
The suite (``kvcc.conformance.runner``) drives a cache deployment -- a directory and cache
nodes, real processes or in-process objects -- through an ``Adapter``. The adapter is a thin
translation layer: every method names the *node* whose client performs the operation, so the
suite can run a workload of several nodes reading, writing, invalidating and evicting at once
(from several threads: every method must be thread-safe) and inject faults into one node.

What the suite judges is *behaviour*, not return codes. After every test it takes the protocol
events of the run (``Adapter.events()``, NDJSON records in the ``kvcc.reference.events``
format, or -- for an adapter that cannot log them -- events the suite infers from the
operation history it saw) and replays them through the spec (``kvcc.conformance.validate``).
``docs/events.md`` says, for each method below, which events a native adapter logs, by which
process and when; ``examples/minimal_adapter.py`` is a complete deployment written to it.
Per-test oracles then check what the spec cannot see from the trace alone (that a read
returned exactly the committed bytes, that an invalidation ticket completed), and audits check
that the run was not vacuous (leased hits served, evictions refused, stale writes fenced).

Values crossing the contract are frozen attrs classes (below), and two from ``kvcc.spec.keys``:

- ``Namespace``: everything that makes the KV of the same tokens differ -- model id and revision,
  KV dtype, tokens per block, layout, tensor- and pipeline-parallel shard, LoRA adapter -- and the
  tenant's cache salt. ``ns.digest()`` is SHA-256 over its canonical CBOR (32 bytes). A tenant is
  authorised for whole namespaces (``RunContext.namespaces``).
- ``BlockKey``: the identity of one block, ``key.digest`` (32 bytes), SHA-256 over the canonical
  CBOR of ``[namespace digest, parent key's digest or null, [the block's token ids]]``; a chain
  of keys is one prompt's prefix, each key chained on its *parent*, the first on ``None`` (a
  *root*). A key's *children* are the keys chained on it, its *descendants* (its prefix subtree)
  their children and so on. ``key.hex`` is its text form (64 lowercase hex digits). The suite
  builds keys with ``kvcc.spec.keys.chain_keys``; an adapter only passes them through.

The directory's record of a key moves ``ABSENT -> WRITING -> COMMITTED -> INVALIDATING ->
ABSENT`` (generation + 1); a write lease that expires and an evicted last copy also return it to
ABSENT at generation + 1. A refusal the client gives on its own, without asking the directory
(``busy``, ``already_leased``, ``lease_expired`` of a lease it no longer trusts, ``not_found`` for
a commit with no bytes stored), sends and logs nothing (``docs/events.md``, "Local refusals").
Where this contract and the spec (``spec/model.py``, ``spec/rules.py``)
could be read differently, the spec is right and the contract is to be fixed. Refusals are values
(``Refused(reason)``), not exceptions: a refusal is an allowed protocol outcome. Exceptions are
for what is *not* a protocol outcome:

- ``NotSupported(op)``: the adapter did not declare that operation or fault in
  ``capabilities()``; the suite marks tests that need it NOT_APPLICABLE (or SKIP).
- ``AdapterError(reason)``: the infrastructure broke (a process died, a connection was refused,
  an answer could not be parsed). The suite marks the test ERROR with the reason and the trace
  so far, calls ``stop()`` and continues with a fresh adapter.

Any other exception, a wrong return type, or a method that does not return within the test's
time limit is also ERROR. Wrong *data* (bytes other than the committed ones, a lease the
directory never granted) is FAIL.

Lease timing (docs/protocol.md "Leases"): a grant carries ``term_ms`` and ``requested_at_ns``, the
adapter's ``time.monotonic_ns()`` when it *sent* the request. A holder trusts the lease until
``requested_at_ns + term_ms - skew_ms`` on its own clock and never later; the directory treats
it as live for ``term_ms + skew_ms`` after it granted (or renewed) it, on the directory's clock.
Two directory timers are urgent (the spec lets no time pass while they are due): a write lease
expires, and an invalidation whose last lease ran out completes, when due -- not when the next
request happens to arrive.

Standard library, attrs and ``kvcc.spec`` only.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal

from attrs import field, frozen, validators

from kvcc.spec.keys import BlockKey, Namespace
from kvcc.spec.vocabulary import REASONS, SCOPES

# -- vocabulary ------------------------------------------------------------------------------------

PROFILES = ("core", "leases", "invalidation", "tiering", "faults", "load", "engine")
# What only a serving engine shows (``Adapter.complete`` and the other engine methods): claimed only
# by an adapter that runs engines; the others run without it.
ENGINE_PROFILE = "engine"
CACHE_PROFILES = tuple(p for p in PROFILES if p != ENGINE_PROFILE)
FAULTS = ("kill", "restart", "pause", "resume", "skew_clock", "restart_directory", "corrupt", "intrude", "move")
CORRUPT_REGIONS = ("payload", "header")  # what ``Adapter.corrupt`` damages of a stored block
# What an intruder presents to a location (``Adapter.intrude``): no grant, a forged one, the owner's.
INTRUSIONS = ("absent", "forged", "stolen")
# Faults no profile needs: a test that needs one is required only of an adapter that declares it.
OPTIONAL_FAULTS = frozenset({"corrupt", "intrude", "move"})
EVENT_SOURCES = ("native", "inferred")
ENGINE_VOCAB = 512  # the engine tests' prompts use token ids 3 .. ENGINE_VOCAB - 1
LEASE_MODES = ("enforced", "advisory", "none")

# Refusal reasons: the protocol's words (``kvcc.spec.vocabulary``: the directory's, and the ones a
# holder, writer or location gives on its own, such as "miss" and "fenced").

# Deletion reaches everywhere (docs/protocol.md progress). The longest a location that is up may keep an
# ended generation's bytes once the generation ended, unless an adapter declares its own
# (``Capabilities.free_bound_ms``): the reference directory sends a free at once and, while
# unacknowledged, again after 1 s, the wait doubling up to 8 s, so a free reaches a reachable
# location within 8 s plus a message delay (``kvcc.reference.directory.core``
# ``FREE_RETRY_MAX_MS_DEFAULT``).
FREE_BOUND_MS_DEFAULT = 8_000


def deletion_deadline_ms(term_ms: int, skew_ms: int, free_bound_ms: int) -> tuple[int, int]:
    """The deletion bound, as the suite checks it: ``(after_end, after_write_grant)``. A location
    must have freed an ended generation's bytes within ``after_end`` ms of the generation's end
    as the suite saw it (a completed invalidation, an abort) -- the free bound plus one lease
    term of message delay -- and the bytes of a write whose lease expired within
    ``after_write_grant`` ms of the write grant's answer: the directory holds a write lease live
    until term + epsilon after the grant, plus epsilon for its clock, then the same bound."""
    after_end = free_bound_ms + term_ms
    return after_end, term_ms + 2 * skew_ms + after_end


REASON_MAX_CHARS = 64
DETAIL_MAX_CHARS = 4096


# -- errors ----------------------------------------------------------------------------------------


class ContractError(Exception):
    """Base of the errors an adapter raises through the contract."""


class NotSupported(ContractError):
    """The operation or fault ``op`` is not among the adapter's declared capabilities."""

    def __init__(self, op: str) -> None:
        super().__init__(op)
        self.op = op


class AdapterError(ContractError):
    """The infrastructure under the adapter broke: a process died, a connection was refused or
    reset, an answer could not be parsed. ``reason`` says which, in words."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# -- values ----------------------------------------------------------------------------------------


def _nonneg_int(instance, attribute, value) -> None:
    if type(value) is not int or value < 0:
        raise ValueError(f"{attribute.name} is an int >= 0, got {value!r}")


def _text(instance, attribute, value) -> None:
    if type(value) is not str or not value:
        raise ValueError(f"{attribute.name} is non-empty text, got {value!r}")


def _key(instance, attribute, value) -> None:
    if not isinstance(value, BlockKey):
        raise TypeError(f"{attribute.name} is a BlockKey, got {type(value).__name__}")


def _subset(allowed: tuple[str, ...]):
    def check(instance, attribute, value) -> None:
        if not isinstance(value, frozenset):
            raise TypeError(f"{attribute.name} is a frozenset")
        bad = value - set(allowed)
        if bad:
            raise ValueError(f"{attribute.name}: unknown {sorted(bad)}; allowed {list(allowed)}")

    return check


def _one_of(allowed: tuple[str, ...]):
    def check(instance, attribute, value) -> None:
        if value not in allowed:
            raise ValueError(f"{attribute.name} is one of {list(allowed)}, got {value!r}")

    return check


@frozen
class Capabilities:
    """What an adapter can do and what it claims.

    - ``profiles``: the profiles it claims (``PROFILES``); certification requires every required
      test of each to PASS.
    - ``faults``: the fault operations it implements (``FAULTS``); a test needing another is
      NOT_APPLICABLE.
    - ``scopes``: invalidation scopes it implements (``SCOPES``).
    - ``events``: ``"native"`` if ``events()`` returns the deployment's protocol events
      (``docs/events.md`` says which, per method), ``"inferred"`` if it returns ``None`` and the
      suite infers them from the history.
    - ``leases``: ``"enforced"`` (the system refuses to free leased bytes), ``"advisory"``
      (leases are tracked but not enforced) or ``"none"``.
    - ``free_bound_ms``: the deletion bound the deployment promises (docs/protocol.md progress: deletion
      reaches everywhere): every location that held a generation MUST free its bytes -- and,
      with native events, log ``free_slot`` (or ``fence_stale_free`` when a later epoch already
      replaced them) -- within this many ms of the generation ending (an invalidation
      completing, a write aborted or its write lease expired), plus a message delay, while the
      location is up, even when frees are lost on the way (a lost free MUST be sent again).
      Default ``FREE_BOUND_MS_DEFAULT`` (what the reference directory's retry schedule meets).
    - ``frees_acknowledged``: the deployment's locations answer each free (``Freed``) and its
      directory logs ``free_acked`` (docs/events.md, "Owed frees"), as the reference does. The
      suite then requires every free to settle within the deletion bound: a location that freed
      the bytes but whose free the directory never saw acknowledged FAILs KVCC-INVAL-009 (the
      directory would send it again forever). Default ``False``: only the bytes are checked.
    - ``capacity_bytes`` and ``block_bytes``: the bytes the deployment's locations hold together
      (every tier of every node, and a shared pool) and the largest block a location takes. The
      suite's overload test (KVCC-TIER-006) writes twice the capacity in blocks of ``block_bytes``
      (at most ``OVERLOAD_MAX_BLOCKS`` of them); an adapter that declares no capacity (0) gets it
      NOT_APPLICABLE and cannot certify for tiering. ``block_bytes`` 0: 4096.
    - ``slot_bytes``: a location keeps every block in a slot of this many bytes, whatever its
      size (the reference's tiers); 0 (the default): a block takes its own size. The performance
      suite counts the capacity in blocks of ``max(size, slot_bytes)`` for its pooled bound.
    - ``unavailable``: profiles the deployment cannot run where the suite runs, each with the
      reason and what runs it instead (SGLang's engine profile on a machine without CUDA, where no
      SGLang server runs). Never claimed: a run of the adapter's profiles lists every test of them
      NOT_APPLICABLE with that reason, without starting anything, so the report says what was not
      shown and why rather than leaving it out.
    - ``keeps_engines_up``: the adapter keeps its engines (profile ``engine``) up across the
      tests of a run instead of starting them per test, and resets them between tests. It
      weakens nothing a test may assume: at the start of each test, every engine is up and
      healthy (one a previous test killed, paused or restarted is repaired, or started again),
      its prefix cache is empty, no save of an earlier test is still in flight (they settled, or
      the engine was killed, before that test's deployment stopped), the adapter's view of its
      KV events is fresh, and it talks only to this test's deployment, with client identities,
      event logs and counters of its own. The adapter then has ``close_run()``, which the
      runner calls once, after the run's last test, whatever the tests did (failed, errored,
      timed out); it stops the engines. Default ``False``: each test's ``start``/``stop`` is the
      engines' whole life.
    - ``notes``: free text for the report.
    """

    profiles: frozenset[str] = field(converter=frozenset, validator=_subset(PROFILES))
    faults: frozenset[str] = field(default=frozenset(), converter=frozenset, validator=_subset(FAULTS))
    scopes: frozenset[str] = field(default=frozenset({"key"}), converter=frozenset, validator=_subset(SCOPES))
    events: Literal["native", "inferred"] = field(default="inferred", validator=_one_of(EVENT_SOURCES))
    leases: Literal["enforced", "advisory", "none"] = field(default="enforced", validator=_one_of(LEASE_MODES))
    notes: str = ""
    free_bound_ms: int = field(default=FREE_BOUND_MS_DEFAULT, validator=_nonneg_int)
    frees_acknowledged: bool = field(default=False, validator=validators.instance_of(bool))
    capacity_bytes: int = field(default=0, validator=_nonneg_int)
    block_bytes: int = field(default=0, validator=_nonneg_int)
    slot_bytes: int = field(default=0, validator=_nonneg_int)
    unavailable: Mapping[str, str] = field(factory=dict, converter=lambda m: dict(sorted(dict(m).items())), hash=False)
    keeps_engines_up: bool = field(default=False, validator=validators.instance_of(bool))

    def __attrs_post_init__(self) -> None:
        if "move" in self.faults and self.events != "native":
            raise ValueError("declaring move needs native events: a transfer's copy lands out of the suite's sight")
        _subset(PROFILES)(self, type(self).__attrs_attrs__.unavailable, frozenset(self.unavailable))
        if self.profiles & set(self.unavailable):
            raise ValueError(f"a profile is claimed or unavailable, not both: {sorted(self.profiles & set(self.unavailable))}")
        for profile, why in self.unavailable.items():
            if not isinstance(why, str) or not why.strip():
                raise ValueError(f"unavailable[{profile!r}]: say why, in words")

    def to_json(self) -> dict[str, object]:
        return {
            "profiles": sorted(self.profiles),
            "faults": sorted(self.faults),
            "scopes": sorted(self.scopes),
            "events": self.events,
            "leases": self.leases,
            "notes": self.notes,
            "free_bound_ms": self.free_bound_ms,
            "frees_acknowledged": self.frees_acknowledged,
            "capacity_bytes": self.capacity_bytes,
            "block_bytes": self.block_bytes,
            "slot_bytes": self.slot_bytes,
            **({"unavailable": dict(self.unavailable)} if self.unavailable else {}),
            **({"keeps_engines_up": True} if self.keeps_engines_up else {}),
        }


@frozen
class RunContext:
    """What ``Adapter.start`` needs to bring a deployment up for one test.

    - ``workdir``: an empty directory the adapter may use (data, logs, sockets); the suite
      deletes it afterwards unless the report keeps it.
    - ``seed``: the test's seed (the adapter may use it for its own randomness).
    - ``nodes``: how many cache nodes (>= 1).
    - ``lease_term_ms``, ``skew_ms``: the lease term the directory grants and the clock bound
      epsilon; the suite's oracles and the validator use the same values. The defaults, 1000 and
      50, are ``kvcc conform``'s (``--lease-term-ms``, ``--skew-ms``).
    - ``namespaces``: the tenant namespaces the deployment must authorise; any other namespace
      must be refused (``Refused("unauthorized")``).
    """

    workdir: Path
    seed: int = field(validator=_nonneg_int)
    nodes: int = field(default=2)
    lease_term_ms: int = field(default=1000)  # the CLI's default (runner.DEFAULT_LEASE_TERM_MS)
    skew_ms: int = field(default=50)
    namespaces: tuple[Namespace, ...] = field(default=(), converter=tuple)

    @nodes.validator
    def _check_nodes(self, attribute, value) -> None:
        if type(value) is not int or value < 1:
            raise ValueError(f"nodes is an int >= 1, got {value!r}")

    @lease_term_ms.validator
    def _check_term(self, attribute, value) -> None:
        if type(value) is not int or value < 1:
            raise ValueError(f"lease_term_ms is an int >= 1, got {value!r}")

    @skew_ms.validator
    def _check_skew(self, attribute, value) -> None:
        if type(value) is not int or value < 0 or 2 * value >= self.lease_term_ms:
            raise ValueError(f"skew_ms is an int >= 0 and below half the lease term, got {value!r}")


@frozen
class WriteGrant:
    """A write lease: the right of ``node`` to fill ``key`` (generation ``gen``) at ``location``
    under fencing token ``epoch``, for ``term_ms`` from ``requested_at_ns`` (adapter's
    ``time.monotonic_ns()`` when it sent the request)."""

    node: str = field(validator=_text)
    key: BlockKey = field(validator=_key)
    gen: int = field(validator=_nonneg_int)
    epoch: int = field(validator=_nonneg_int)
    lease: int = field(validator=_nonneg_int)
    location: str = field(validator=_text)
    term_ms: int = field(validator=_nonneg_int)
    requested_at_ns: int = field(validator=_nonneg_int)

    def trusted_until_ns(self, skew_ms: int) -> int:
        """The holder's own deadline: requested_at + term - skew (docs/protocol.md "Leases")."""
        return self.requested_at_ns + (self.term_ms - skew_ms) * 1_000_000


@frozen
class ReadGrant:
    """A read lease: the right of ``node`` to read ``key`` generation ``gen`` at ``location``
    (whose epoch is ``epoch``) for ``term_ms`` from ``requested_at_ns``."""

    node: str = field(validator=_text)
    key: BlockKey = field(validator=_key)
    gen: int = field(validator=_nonneg_int)
    epoch: int = field(validator=_nonneg_int)
    lease: int = field(validator=_nonneg_int)
    location: str = field(validator=_text)
    term_ms: int = field(validator=_nonneg_int)
    requested_at_ns: int = field(validator=_nonneg_int)

    def trusted_until_ns(self, skew_ms: int) -> int:
        """The holder's own deadline: requested_at + term - skew (docs/protocol.md "Leases")."""
        return self.requested_at_ns + (self.term_ms - skew_ms) * 1_000_000


@frozen
class Stored:
    """``write_bytes`` put the bytes at the grant's location (not yet visible: commit does that)."""


@frozen
class Committed:
    """``commit`` published the block: it is COMMITTED at generation ``gen`` under ``epoch``."""

    gen: int = field(validator=_nonneg_int)
    epoch: int = field(validator=_nonneg_int)


@frozen
class Evicted:
    """``evict`` dropped the node's copy of the block."""


@frozen
class Moving:
    """``move`` started a tier transfer of the block from ``source`` to ``destination`` (location
    ids, as grants name them) under fencing token ``epoch``; its copy lands on its own."""

    source: str = field(validator=_text)
    destination: str = field(validator=_text)
    epoch: int = field(validator=_nonneg_int)


@frozen
class Refused:
    """An allowed refusal, with a reason from ``REASONS`` where one fits and free ``detail``."""

    reason: str = field()
    detail: str = ""

    @reason.validator
    def _check_reason(self, attribute, value) -> None:
        if type(value) is not str or not value or len(value) > REASON_MAX_CHARS:
            raise ValueError(f"reason is non-empty text of at most {REASON_MAX_CHARS} chars, got {value!r:.80}")


@frozen
class Completion:
    """An engine's greedy completion of a prompt (``Adapter.complete``): the generated token ids,
    each one's top log-probabilities (``(token id, logprob)`` pairs, as the engine reports them:
    two runs of one prompt that computed the same KV give exactly the same ones), and how the
    prompt's KV was had: ``cached_tokens`` prompt tokens the engine did not compute (from its own
    prefix cache or loaded), of which ``loaded_blocks`` whole blocks were loaded from the cache
    deployment, and ``load_errors`` blocks it set out to load but recomputed."""

    tokens: tuple[int, ...] = field(converter=tuple)
    logprobs: tuple[tuple[tuple[str, float], ...], ...] = field(converter=tuple)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    loaded_blocks: int = 0
    load_errors: int = 0  # blocks the engine set out to load and recomputed instead (a refused or failed read)

    def differs_from(self, other: Completion) -> str:
        """Why this output is not ``other``'s ("" when it is): other tokens, or at some step a
        log-probability of a candidate both list that is not exactly equal, or a best candidate
        the other does not list (a near tie may swap the last listed candidates). Exactly: the
        KV an engine loads is the KV it computed, and its arithmetic over it is the same (a load
        that lost every K of a random-weight model moves a log-probability by only ~2e-4)."""
        if self.tokens != other.tokens:
            return f"tokens {list(self.tokens)} != {list(other.tokens)}"
        if len(self.logprobs) != len(other.logprobs):
            return f"{len(self.logprobs)} steps of log-probabilities != {len(other.logprobs)}"
        for step, (a, b) in enumerate(zip(self.logprobs, other.logprobs)):
            mine, theirs = dict(a), dict(b)
            common = mine.keys() & theirs.keys()
            if mine and theirs and (max(mine, key=mine.get) not in common or max(theirs, key=theirs.get) not in common):
                return f"step {step}: best candidates differ ({mine} against {theirs})"
            for tok in sorted(common):
                if mine[tok] != theirs[tok]:
                    return f"step {step}, candidate {tok!r}: log-probability {mine[tok]} != {theirs[tok]}"
        return ""


@frozen
class InvalidationTicket:
    """Handle on a started invalidation: ``id`` (adapter-chosen, unique per run) and how many
    ``keys`` it covers (0 if nothing was committed under the scope)."""

    id: int = field(validator=_nonneg_int)
    keys: int = field(validator=_nonneg_int)


# -- the adapter -------------------------------------------------------------------------------------


class Adapter(abc.ABC):
    """One deployment of a cache layer, as the conformance suite sees it.

    Every method is synchronous and must be thread-safe: the suite calls them concurrently
    from several threads, each acting as one node's client. Every method except ``stop`` may
    raise ``AdapterError`` when the infrastructure breaks; every operation not declared in
    ``capabilities()`` raises ``NotSupported``. No method may block longer than the longest
    lease term plus a few seconds: the suite's watchdog turns a hang into ERROR.
    """

    name: str = "adapter"

    # -- lifecycle ---------------------------------------------------------------------------

    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """The profiles claimed and the operations supported.

        Must: return the same value for the adapter's whole life; be callable before ``start``.
        Must not: claim a profile whose tests need operations it raises ``NotSupported`` for.
        """

    @abc.abstractmethod
    def start(self, ctx: RunContext) -> None:
        """Bring a fresh, empty deployment up: a directory with ``ctx.lease_term_ms`` and
        ``ctx.skew_ms``, ``ctx.nodes`` cache nodes, tenants authorised for ``ctx.namespaces``.

        Must: return only when every node answers; start from empty state (no block of an
        earlier run visible); put every file it writes under ``ctx.workdir``.
        Must not: reuse processes or state of another ``start`` -- except, with
        ``Capabilities.keeps_engines_up``, the run's engines, reset as that field says.
        Raises: ``AdapterError`` if the deployment does not come up (after cleaning up what it
        started).
        """

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop every process and thread the adapter started and release its ports.

        Must: succeed after any error, after a partial ``start``, when called twice, and when
        called from another thread while an operation hangs (making that operation fail).
        Must not: raise (log and swallow instead); leave a process behind (with
        ``Capabilities.keeps_engines_up``, the engines excepted: ``close_run`` stops them).
        """

    def close_run(self) -> None:
        """The run-end hook of an adapter that declares ``Capabilities.keeps_engines_up``: stop
        what it kept up across the run's tests (its engines). The runner calls it once, on an
        adapter made by the run's factory, after the last test, whatever the tests did.

        Must: succeed when nothing was kept up, and when called twice. Must not: raise.
        The default does nothing.
        """
        return None

    @abc.abstractmethod
    def nodes(self) -> Sequence[str]:
        """The node ids of the running deployment, stable from ``start`` to ``stop`` (a
        restarted node keeps its id)."""

    @abc.abstractmethod
    def versions(self) -> Mapping[str, str]:
        """Name -> version of the adapter and of every system under it (for ``run_info.json``)."""

    # -- data plane: writes ------------------------------------------------------------------

    @abc.abstractmethod
    def lookup(self, node: str, ns: Namespace, keys: Sequence[BlockKey]) -> int:
        """How many blocks of ``keys`` (a chain, root first) are COMMITTED, counting from the
        first: the longest committed prefix, as the directory sees it.

        Must: count a key only if every key before it counts, it is COMMITTED in ``ns``, and its
        recorded parent is the key before it (``None`` for the first: a chain starts at a root);
        refuse nothing (an unauthorised namespace counts 0). Must not: take or change any lease;
        log any event (``lookup`` is no step of the spec).
        """

    @abc.abstractmethod
    def begin_write(self, node: str, ns: Namespace, key: BlockKey, parent: BlockKey | None) -> WriteGrant | Refused:
        """Ask the directory for the write lease of ABSENT ``key`` (whose chain parent is
        ``parent``, ``None`` for a root block), to be filled at a location of ``node``.

        Must: grant at most one write lease per key and generation (protocol property 1), with an
        epoch one above the key's previous epoch (property 2) and a lease id never used before
        (property 8); refuse, in this order, ``unauthorized`` for a namespace not in
        ``RunContext.namespaces`` (or a key recorded under another namespace), ``key_identity``
        if the key was written before under another parent (a key's digest chains over its
        parent's, ``kvcc.spec.keys``: one key under two parents is a forged or broken key, and a
        grant would move it to another chain -- even once it is ABSENT again), ``not_absent``
        if the key is not ABSENT (WRITING, COMMITTED or INVALIDATING), ``parent_not_committed``
        if the parent is not COMMITTED in the same namespace. A shard of a sharded directory
        (docs/sharding.md) refuses ``wrong_shard`` before all of these: a root (``parent``
        ``None``) whose chain another shard owns (``kvcc.spec.keys.shard_of``).
        Must not: make the key readable before ``commit``; refuse for a restarted directory's
        grace period (the spec grants writes of ABSENT keys during it: no lease it forgot can be
        on an ABSENT key).
        """

    @abc.abstractmethod
    def write_bytes(self, grant: WriteGrant, data: bytes) -> Stored | Refused:
        """Store ``data`` at ``grant.location`` under ``grant.epoch``.

        Must: refuse ``fenced`` when the location has seen a higher epoch for the key (property
        2): the location stores bytes only under an epoch at least its fence (the highest epoch
        it stored for the key), whatever the writer or the directory believe -- bytes of an
        aborted or expired grant still land if no higher epoch came first. May refuse
        ``lease_expired`` when the writer's own deadline (``grant.trusted_until_ns(skew_ms)``)
        has passed: a local refusal, nothing sent, nothing lands, no event logged; the write
        stays in progress at the writer and its ``commit`` is then refused ``not_found``
        (docs/events.md, "Local refusals"). A grant's bytes are sent
        once: a second call with the same grant lands nothing new and logs nothing (answer
        ``Refused("busy")``, or ``Stored()`` again for the same bytes).
        Must not: overwrite bytes under a live read lease (property 5) or committed bytes
        (property 4).
        """

    @abc.abstractmethod
    def commit(self, grant: WriteGrant) -> Committed | Refused:
        """Publish the block written under ``grant``: WRITING -> COMMITTED.

        Must: refuse ``unknown_lease`` when the key is not WRITING under this very write lease
        (it expired, was voided by an invalidation, or another writer has the key now),
        ``stale_epoch`` under another epoch, ``lease_expired`` once the write lease ran out (the
        late writer is fenced); refuse ``not_found``, without asking the directory and logging
        nothing, a grant whose bytes were not stored by ``write_bytes``, that was aborted or
        fenced, or whose commit the directory refused: the spec's writer sends its one commit
        when its bytes landed. A second call for a grant already answered ``Committed`` sends
        nothing and logs nothing; it answers ``Committed`` again (the same generation and
        epoch, as the reference client and the suite's kit do) or ``not_found`` -- either is
        correct, as the spec has no second commit to judge.
        Must not: publish bytes that were not all stored.
        """

    @abc.abstractmethod
    def abort(self, grant: WriteGrant) -> None:
        """The writer gives up its write. This is the writer's step alone (spec: ``abort``):
        the directory is not told, the key stays WRITING until the write lease expires
        (``lease_term_ms + skew_ms`` after the grant, on the directory's clock), and then it is
        ABSENT at generation + 1, writable again under a higher epoch (KVCC-CORE-007).
        Must not: free the key at once (the spec has no such step: a trace where a new write is
        granted before the old write lease expired is REJECTED). Idempotent; never raises for an
        already expired or unknown grant. The suite may still call ``write_bytes`` with an
        aborted grant: bytes that were in flight when the writer gave up, which the location
        must judge by their epoch; ``commit`` with it must be refused. Bytes stored under an
        aborted or expired write MUST be freed within ``capabilities().free_bound_ms`` of the
        write lease's expiry, as for an invalidation (KVCC-INVAL-009)."""

    # -- data plane: reads -------------------------------------------------------------------

    @abc.abstractmethod
    def acquire(self, node: str, ns: Namespace, key: BlockKey) -> ReadGrant | Refused:
        """A read lease on one location holding COMMITTED ``key`` for ``node``'s client.

        Must: refuse ``unauthorized`` outside the tenant's namespaces, or for a key recorded
        under another namespace (property 11), ``not_committed`` for an ABSENT or WRITING key,
        ``invalidating`` while an invalidation covers it, ``already_leased`` while the directory
        holds a live read lease of this node on the key (one lease per node and key: a holder
        renews it); use a lease id never used before, read or write (property 8).
        Must not: point the lease at a location that does not hold the bytes (property 9).
        """

    @abc.abstractmethod
    def renew(self, grant: ReadGrant) -> ReadGrant | Refused:
        """Extend a live read lease. The lease keeps its id: the new grant is ``grant`` with a
        new ``requested_at_ns`` (the renewal's send time) and ``term_ms``; same ``lease``,
        ``gen``, ``epoch``, ``location``.

        Must: refuse ``lease_expired`` (without asking the directory, logging nothing) once the
        holder's own deadline passed or it released the lease or acked its revocation; at the
        directory, in this order (``spec.rules.may_renew``): ``unknown_lease`` unless this node
        has a live lease under this id, then ``invalidating`` / ``not_committed`` unless the key
        is COMMITTED, then ``not_owner`` for a lease on a copy that is no longer the owner
        (draining after a transfer). The directory counts the renewed
        lease live for ``term + skew`` from the renewal; the holder trusts it for
        ``term - skew`` from when it sent the renewal.
        Must not: revive such a lease (property 8).
        """

    @abc.abstractmethod
    def read(self, grant: ReadGrant) -> bytes | Refused:
        """The bytes of the leased block.

        Must: return exactly the committed bytes (property 4) or a refusal (``miss``,
        ``lease_expired``, ``invalidating``, ``unknown_lease``); refuse once the holder's own
        deadline ``grant.trusted_until_ns(skew_ms)`` has passed, and once the holder acked an
        invalidation of that generation (property 7).
        Must not: return other bytes, partial bytes, or bytes of another generation.
        """

    @abc.abstractmethod
    def release(self, grant: ReadGrant) -> None:
        """End a read lease early. Idempotent; never raises for an expired or unknown lease."""

    # -- invalidation and eviction -----------------------------------------------------------

    @abc.abstractmethod
    def invalidate(self, node: str, ns: Namespace, scope: str, key: BlockKey | None) -> InvalidationTicket:
        """Start invalidating: with ``scope="key"`` or ``"prefix"``, ``key`` and its whole prefix
        subtree (every descendant, on every branch; its ancestors are untouched); with
        ``"namespace"`` (``key`` None), every key of ``ns``. ``"key"`` and ``"prefix"`` are
        one operation in the spec (``invalidate`` always voids the subtree: a parent's copy
        cannot outlive its children's meaning); both names exist for callers that speak of one
        block or of a prompt's prefix.

        Must: if the root (for a namespace: some key of it) is COMMITTED, at once move every
        covered COMMITTED key to INVALIDATING (no new lease or renewal) and revoke its leases,
        and abort every covered write in progress (WRITING -> ABSENT at generation + 1: its
        commit is then refused); tell holders to drop and ack; complete each key only when
        every lease on it was acked or released or ran out (``term + skew`` from grant or
        renewal on the directory's clock, property 6), then free its copies and move it to
        ABSENT at generation + 1. If the root is not COMMITTED nothing is voided: the ticket
        waits only for covered keys already INVALIDATING (``keys`` 0 if none). The ticket's
        ``keys`` counts the covered keys voided by this call (COMMITTED ones now INVALIDATING and
        WRITING ones aborted) plus those already INVALIDATING. Covered keys complete in any
        order (each on its own leases). An aborted write gets no ``expire_write_lease`` later.
        A namespace not in ``RunContext.namespaces``, or a key recorded under another namespace:
        void nothing, log nothing, return a ticket of 0 keys.
        Every location that held a voided generation MUST free its bytes within
        ``capabilities().free_bound_ms`` of the completion (plus a message delay), logging
        ``free_slot`` / ``fence_stale_free`` with native events, even when frees are lost
        (docs/protocol.md progress: deletion reaches everywhere; KVCC-INVAL-009).
        Raises: ``NotSupported`` for a scope not in ``capabilities().scopes``.
        """

    @abc.abstractmethod
    def wait_invalidation(self, ticket: InvalidationTicket, timeout_s: float) -> bool:
        """Block until the invalidation completes (True) or ``timeout_s`` passes (False).

        Must: return True only after completion as defined in ``invalidate``; return promptly
        for a completed ticket.
        """

    @abc.abstractmethod
    def evict(self, node: str, ns: Namespace, key: BlockKey) -> Evicted | Refused:
        """Drop ``node``'s copy of ``key`` as a tier would under memory pressure.

        Must: refuse ``not_found`` (no event) for a namespace not in ``RunContext.namespaces``
        or a key recorded under another namespace; then, in this order, ``not_committed`` /
        ``invalidating`` unless the key is COMMITTED; ``not_found`` when ``node`` does not hold a copy the directory knows of (the
        owner, or a copy draining after a transfer); ``restarting`` during a restarted
        directory's grace period; ``has_children`` unless every child key is ABSENT at the
        directory -- a child WRITING, COMMITTED or INVALIDATING blocks its parent wherever the
        child's copy lives (leaves before ancestors, property 10); ``leased`` while a live read
        lease names that copy (property 5). Evicting the owner copy ends the generation: the key
        is ABSENT at generation + 1.
        Must not: free bytes a live lease points at.
        """

    # -- faults ------------------------------------------------------------------------------

    def kill(self, node: str) -> None:
        """Crash ``node`` (kill -9): its memory and unsynced state are gone; its leases simply
        stop being renewed. Raises ``NotSupported`` unless ``"kill"`` is declared."""
        raise NotSupported("kill")

    def restart(self, node: str) -> None:
        """Restart a killed ``node`` with a new incarnation; it rejoins empty or with its disk.
        Raises ``NotSupported`` unless ``"restart"`` is declared."""
        raise NotSupported("restart")

    def pause(self, node: str) -> None:
        """Stop ``node`` (SIGSTOP) without killing it; operations naming it block or fail.
        Raises ``NotSupported`` unless ``"pause"`` is declared."""
        raise NotSupported("pause")

    def resume(self, node: str) -> None:
        """Continue a paused ``node`` (SIGCONT). It must discover that its leases expired.
        Raises ``NotSupported`` unless ``"resume"`` is declared."""
        raise NotSupported("resume")

    def skew_clock(self, node: str, offset_ms: int) -> None:
        """Offset ``node``'s clock by ``offset_ms`` (|offset| <= skew_ms keeps within the spec's
        assumption). Raises ``NotSupported`` unless ``"skew_clock"`` is declared."""
        raise NotSupported("skew_clock")

    def restart_directory(self) -> None:
        """Crash and restart the directory from its durable log (records and the lease-id
        high-water mark survive, the lease table does not); for ``lease_term_ms + 2 * skew_ms``
        it must then free nothing -- no eviction, no completed invalidation, no freed copy --
        since a lease it forgot may still be trusted, and a WRITING key's writer keeps as long
        (property 12).
        Raises ``NotSupported`` unless ``"restart_directory"`` is declared."""
        raise NotSupported("restart_directory")

    def corrupt(self, node: str, key: BlockKey, region: str, offset: int) -> None:
        """Damage ``node``'s stored copy of ``key`` at rest, as a failing medium would, telling the
        deployment nothing: invert every bit of one byte of the copy's ``region`` -- ``"payload"``,
        the block's bytes, or ``"header"``, what the location stores beside them to vouch for
        them (a header, a checksum, an index entry kept with the bytes; the payload again where it
        keeps nothing) -- at ``offset`` modulo the region's size. The suite needs it to check that
        corrupt bytes at rest become a miss, never other bytes (property 4), and that the key can
        be written again; only an adapter that can reach its locations' storage declares it.
        Does nothing when ``node`` holds no copy of ``key`` (a read then misses anyway). Raises
        ``NotSupported`` unless ``"corrupt"`` is declared, ``ValueError`` for a region not in
        ``CORRUPT_REGIONS`` or a negative offset, ``AdapterError`` when ``node`` is down."""
        raise NotSupported("corrupt")

    def intrude(self, grant: ReadGrant | WriteGrant, how: str, data: bytes | None = None) -> bytes | Stored | Refused:
        """Act as an outsider at the data plane: as a principal the directory did not grant
        ``grant`` to (another tenant's credential, where the deployment has tenants), ask the
        location ``grant`` names directly -- not through a holder or writer -- to serve
        ``grant.key``'s bytes (``data`` None) or to store ``data`` as them (the grant's generation,
        and epoch for a write grant), presenting ``how`` (``INTRUSIONS``): ``"absent"``, no grant;
        ``"forged"``, the grant's proof altered; ``"stolen"``, the owner's own grant as it crossed
        the wire. Returns what the location answered: the bytes, ``Stored``, or ``Refused`` (a
        location that authorises its data plane refuses each, protocol property 13, and stores
        nothing). Logs no event: a refused request is no step of the spec. The suite needs it to
        check tenant isolation where bytes live; only an adapter whose locations a caller can
        reach directly declares it. Raises ``NotSupported`` unless ``"intrude"`` is declared,
        ``ValueError`` for a ``how`` not in ``INTRUSIONS``, ``AdapterError`` when the location is
        down."""
        raise NotSupported("intrude")

    def move(self, grant: ReadGrant) -> Moving | Refused:
        """Start a tier transfer of the block ``grant`` names -- ``grant.key`` at generation
        ``grant.gen``, whose copy is at ``grant.location`` -- to another location of the
        deployment, as the location's own tiering would (a demotion or a promotion; docs/protocol.md,
        transfers): an ownership transfer under ``epoch + 1`` whose copy lands at the destination
        after this returns, the old copy draining until its leases end. ``grant`` may have been
        released: it only names the block. Returns ``Moving`` once the directory started the
        transfer, ``Refused`` when it did not (the key is not COMMITTED at that generation any
        more, a transfer or an invalidation of it is under way, the copy is no longer at
        ``grant.location``). Logs the deployment's own events of the transfer (``start_transfer``,
        ``store_copy``, ``finish_transfer``...). The suite needs it to race an invalidation
        against a transfer; only an adapter that can make its tiering move one block, and whose
        events are native, declares it (``Capabilities`` refuses it with inferred events).
        Raises ``NotSupported`` unless ``"move"`` is declared, ``AdapterError`` when the
        location's node is down."""
        raise NotSupported("move")

    # -- engines (profile "engine") ---------------------------------------------------------
    #
    # An adapter that claims the ``engine`` profile runs two or more serving engines on the
    # deployment (its cache), named by ``engines()``, and implements every method below; each
    # other adapter leaves them. A test's prompts are token ids of the engines' vocabulary from 3
    # to ``ENGINE_VOCAB`` - 1; a prompt of test namespace ``ns`` is served under that namespace's
    # tenant (the engines key it apart from every other namespace's, e.g. with ``ns.cache_salt``
    # as the request's cache salt), so a test sees no block it did not cause.

    def engines(self) -> Sequence[str]:
        """The engines' names (empty: the adapter runs none)."""
        return []

    def engine_keys(self, ns: Namespace, tokens: Sequence[int]) -> tuple[Namespace, list[BlockKey]]:
        """The namespace and the keys under which the engines store and look up the full blocks
        of prompt ``tokens`` of test namespace ``ns`` (the contract's other methods take them)."""
        raise NotSupported("engine_keys")

    def complete(self, engine: str, ns: Namespace, tokens: Sequence[int], max_tokens: int) -> Completion:
        """A greedy completion of ``max_tokens`` tokens by ``engine`` of prompt ``tokens`` in test
        namespace ``ns``, using and filling the cache as the engine does. ``AdapterError`` when
        the engine is down or failed the request."""
        raise NotSupported("complete")

    def forget(self, engine: str) -> None:
        """``engine`` drops its own prefix cache and no KV of it survives in the engine's memory
        to be reused by accident (a block it loads must come from the cache deployment)."""
        raise NotSupported("forget")

    def kill_engine(self, engine: str) -> None:
        """Crash ``engine`` (kill -9 of every process of it), wherever it is in a request."""
        raise NotSupported("kill_engine")

    def restart_engine(self, engine: str) -> None:
        """Start a killed (or running: kill it first) ``engine`` afresh; it returns once the engine serves."""
        raise NotSupported("restart_engine")

    def pause_engine(self, engine: str) -> None:
        """Stop every process of ``engine`` (SIGSTOP), wherever it is in a request."""
        raise NotSupported("pause_engine")

    def resume_engine(self, engine: str) -> None:
        """Continue a paused ``engine`` (SIGCONT)."""
        raise NotSupported("resume_engine")

    def pause_engine_reading(self, engine: str, timeout_s: float) -> bool:
        """Stop every process of ``engine`` (SIGSTOP) while it holds a read lease it took to load
        a block: granted, not yet read under, not released. ``True`` once so paused; ``False``
        (not paused) if it took no such lease within ``timeout_s``. An adapter may slow its
        engines' loads to make the moment reachable."""
        raise NotSupported("pause_engine_reading")

    def engine_index(self, engine: str, ns: Namespace) -> set[BlockKey]:
        """The keys (of test namespace ``ns``'s engine namespace) that the deployment's view of
        ``engine``'s own prefix cache -- built from what the engine announces, e.g. its KV events
        -- says the engine holds now, once that view caught up with what the engine announced."""
        raise NotSupported("engine_index")

    # -- trace -------------------------------------------------------------------------------

    @abc.abstractmethod
    def events(self) -> list[dict] | None:
        """All protocol events of every component since ``start`` (``kvcc.reference.events``
        records: per ``(node, incarnation)`` seq from 1 rising by one), or ``None`` when
        ``capabilities().events == "inferred"``: the suite then infers the adapter-side events
        from the history of operations it performed. ``docs/events.md`` lists what each method
        logs.

        Must: include events of killed incarnations; keep each log in ``seq`` order and merge
        the logs in an order consistent with causality (a request before its answer: one lock
        in process, ``t_wall_ns`` across processes); be callable after ``stop``.
        """


AdapterFactory = Callable[[], Adapter]  # what --adapter names: a zero-argument callable

__all__ = [
    "CACHE_PROFILES", "CORRUPT_REGIONS", "ENGINE_PROFILE", "ENGINE_VOCAB", "Completion", "FAULTS", "INTRUSIONS", "OPTIONAL_FAULTS", "FREE_BOUND_MS_DEFAULT", "PROFILES", "REASONS", "SCOPES", "Adapter", "AdapterError", "AdapterFactory", "Capabilities", "Committed", "Moving",
    "ContractError", "Evicted", "InvalidationTicket", "NotSupported", "ReadGrant", "Refused", "RunContext",
    "Stored", "WriteGrant", "deletion_deadline_ms",
]  # fmt: skip
