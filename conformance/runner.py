"""``run_conformance(factory, profiles=..., seed=...)``: run the catalogue against an adapter.

Theory of operation
-------------------
For each test of the requested profiles, in catalogue order, the runner makes a *fresh*
adapter (``factory()``), starts it on an empty work directory with the test's namespaces
(randomised from the run's seed and the test id, so a rerun with the same seed replays the same
keys), runs the workload in a worker thread and waits for it up to the test's time limit.

- The workload's ``OracleFailure`` is FAIL; ``NotSupported`` is NOT_APPLICABLE (so is a test
  needing a fault or scope the adapter does not declare: it is not started at all);
  ``AdapterError``, ``GarbageAnswer``, any other exception, and running past the time limit are
  ERROR, with the reason. On a timeout the runner calls ``adapter.stop()`` (the contract says
  that makes a hanging operation fail), gives the worker a grace period to return, and moves on:
  the suite never hangs, and ``stop()`` is called after every test whatever happened.
- The trace -- ``adapter.events()``, or the events the session inferred from the history when
  the adapter's events are ``"inferred"`` -- goes through ``validate_trace`` against the spec:
  REJECTED turns a test that would PASS into FAIL; INCONCLUSIVE is recorded with the reason,
  and such a PASS does not count toward certification (``TestResult.counts``).
- An adapter whose events are ``"native"`` must log what the suite did: an empty trace is FAIL,
  and so is a trace that leaves out (or adds) an event the session's history implies
  (``oracles.completeness_problems``: every grant, stored write, commit, served read, eviction
  and crash the suite saw must be logged, a served read or a commit exactly once, and no
  client-side event the suite saw no answer for).
- Audits (tests numbered 9xx) are evaluated after their profile's other tests from the counts
  the sessions gathered (non-vacuity).

An adapter that declares ``Capabilities.keeps_engines_up`` keeps its engines up from one test
to the next (each test's adapter still gets its own ``start`` and ``stop``; the contract says
what it must reset); the runner calls ``close_run()`` on the probe adapter once, after the last
test, however the tests ended (also when the run itself raised), and gives it
``CLOSE_RUN_GRACE_S``.

A test that was deselected (``ids=``) is SKIP. ``Report.certified`` is true when every
required test of every claimed and requested profile PASSed with its trace ACCEPTED.

A failure's message names the rule and the history index; the report keeps each test's history
(the steps that replay it) and its trace, and ``seed`` reproduces the run.
"""

from __future__ import annotations

import hashlib
import logging
import random
import shutil
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from attrs import define, field

from kvcc.spec.keys import Namespace

from . import catalogue, workloads
from .catalogue import CATALOGUE, SUITE_VERSION, TestCase
from .contract import ENGINE_PROFILE, PROFILES, Adapter, AdapterError, Capabilities, NotSupported, RunContext
from .oracles import Audit, GarbageAnswer, OracleFailure, Session, completeness_problems

PASS, FAIL, ERROR, SKIP, NOT_APPLICABLE = "PASS", "FAIL", "ERROR", "SKIP", "NOT_APPLICABLE"
STATUSES = (PASS, FAIL, ERROR, SKIP, NOT_APPLICABLE)
DEFAULT_LEASE_TERM_MS = 1000
DEFAULT_SKEW_MS = 50
DEFAULT_NODES = 3
STOP_GRACE_S = 10.0  # how long stop() and a stopped worker get before the runner moves on
EVENTS_TIMEOUT_S = 10.0
CLOSE_RUN_GRACE_S = 120.0  # how long close_run() (engines kept up across a run) gets
BLOCK_TOKENS = 16
UNDECIDED_RETRIES = 2  # more runs of a test whose trace went past the validator's bounds
# Those bounds, as the validator names them (``validate.INCONCLUSIVE_CODES``; a test checks).
VALIDATOR_BOUNDS = ("frontier_limit", "network_limit", "scope_limit")

Factory = Callable[[], Adapter]


@define
class TestResult:
    id: str
    profile: str
    status: str
    message: str = ""
    duration_s: float = 0.0
    verdict: dict = field(factory=dict)
    audit: dict = field(factory=dict)
    events: list = field(factory=list, repr=False)
    history: list = field(factory=list, repr=False)
    seed: int = 0
    attempts: int = 1  # runs of the test: more than one only after traces past the validator's bounds

    __test__ = False

    @property
    def counts(self) -> bool:
        """Whether this result counts toward certification: PASS, and the trace ACCEPTED (an
        INCONCLUSIVE verdict -- no events, validation off, a validator error -- never counts)."""
        if self.status != PASS:
            return False
        return catalogue.BY_ID[self.id].audit or self.verdict.get("status") == "ACCEPTED"

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "profile": self.profile, "status": self.status, "message": self.message,
            "counts": self.counts,
            "duration_s": round(self.duration_s, 3), "verdict": self.verdict, "audit": self.audit,
            "events": len(self.events), "history": len(self.history), "seed": self.seed, "attempts": self.attempts,
            "trace": f"traces/{self.id}.ndjson", "history_file": f"traces/{self.id}.history.json",
        }  # fmt: skip


@define
class Report:
    suite_version: str
    adapter: str
    capabilities: dict
    versions: dict
    profiles: list
    seed: int
    params: dict
    started_at: float
    finished_at: float = 0.0
    results: list = field(factory=list)

    @property
    def claimed(self) -> list[str]:
        return [p for p in self.profiles if p in self.capabilities.get("profiles", ())]

    def counts(self) -> dict[str, int]:
        return {s: sum(r.status == s for r in self.results) for s in STATUSES}

    def required_failures(self) -> list[TestResult]:
        required = catalogue.required_ids(self.claimed, self.capabilities.get("faults", ()))
        return [r for r in self.results if r.id in required and not r.counts]

    @property
    def certified(self) -> bool:
        """Every required test of every claimed, requested profile PASSed with its trace
        ACCEPTED (an audit, which has no trace of its own, by PASSing)."""
        required = catalogue.required_ids(self.claimed, self.capabilities.get("faults", ()))
        present = {r.id for r in self.results if r.counts}
        return bool(self.claimed) and required <= present and bool(self.params.get("validate", True))

    def failed_ids(self) -> set[str]:
        return {r.id for r in self.results if r.status == FAIL}

    def by_id(self) -> dict[str, TestResult]:
        return {r.id: r for r in self.results}

    def to_json(self) -> dict[str, Any]:
        return {
            "suite_version": self.suite_version, "adapter": self.adapter, "capabilities": self.capabilities,
            "versions": self.versions, "profiles": self.profiles, "claimed": self.claimed, "seed": self.seed,
            "params": self.params, "started_at": self.started_at, "finished_at": self.finished_at,
            "counts": self.counts(), "certified": self.certified,
            "results": [r.to_json() for r in self.results],
        }  # fmt: skip


# -- validation shim ---------------------------------------------------------------------------------------


def validate_events(events: list[dict], lease_term_ms: int, skew_ms: int) -> dict[str, Any]:
    """``kvcc.conformance.validate.validate_trace`` as a plain dict; INCONCLUSIVE with the reason
    when the validator is missing or fails (the validator's failure is not the adapter's)."""
    try:
        from . import validate as v
    except ImportError as e:
        return {"status": "INCONCLUSIVE", "event_index": None, "reason": f"validator unavailable: {e}", "diff": None}
    try:
        params = v.TraceParams(lease_term_ms=lease_term_ms, skew_ms=skew_ms)
        verdict = v.validate_trace(events, params)
    except Exception as e:  # noqa: BLE001 - recorded, not raised
        return {"status": "INCONCLUSIVE", "event_index": None, "reason": f"validator failed: {type(e).__name__}: {e}",
                "diff": None}  # fmt: skip
    from .names import rename_verdict  # a rejection in the adapter's own names, with the map

    return rename_verdict({
        "status": str(verdict.status),
        "event_index": getattr(verdict, "event_index", None),
        "reason": str(getattr(verdict, "reason", "") or ""),
        "code": getattr(verdict, "code", None),  # why INCONCLUSIVE (``validate.INCONCLUSIVE_CODES``)
        "diff": _jsonable(getattr(verdict, "diff", None)),
    }, events, params)  # fmt: skip


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if isinstance(value, bytes):
        return value.hex()
    return repr(value)


# -- namespaces ----------------------------------------------------------------------------------------------


def test_seed(seed: int, test_id: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{test_id}".encode()).digest()[:8], "big")


def random_namespace(rng: random.Random) -> Namespace:
    """A namespace no adapter can know in advance: model id and cache salt from the seed."""
    return Namespace(
        model_id=f"conformance/model-{rng.randrange(1 << 32):08x}",
        model_revision=f"{rng.randrange(1 << 40):010x}",
        kv_dtype=rng.choice(("bfloat16", "float16", "fp8_e4m3")),
        block_tokens=BLOCK_TOKENS,
        cache_salt=rng.randbytes(16),
    )


# -- the runner ----------------------------------------------------------------------------------------------


def run_conformance(
    factory: Factory,
    profiles: Iterable[str] | None = None,
    seed: int | None = None,
    out: str | Path | None = None,
    *,
    lease_term_ms: int = DEFAULT_LEASE_TERM_MS,
    skew_ms: int = DEFAULT_SKEW_MS,
    nodes: int = DEFAULT_NODES,
    ids: Iterable[str] | None = None,
    time_limit_s: float | None = None,
    validate: bool = True,
    progress: Callable[[str, TestCase, TestResult | None], None] | None = None,
) -> Report:
    """Run the tests of ``profiles`` (default: those the adapter claims) against adapters made
    by ``factory``; with ``out``, write the report bundle there (``kvcc.conformance.bundle``).

    ``ids`` restricts the run to those test ids (the others of the profiles are SKIP);
    ``time_limit_s`` overrides every test's limit; ``validate=False`` skips trace validation
    (verdicts INCONCLUSIVE: such a report cannot be certified). Returns the ``Report``; never raises for
    anything an adapter does.
    """
    if seed is None:
        seed = random.SystemRandom().randrange(1 << 32)
    probe = factory()
    caps = probe.capabilities()
    if not isinstance(caps, Capabilities):
        raise TypeError(f"capabilities() returned {type(caps).__name__}, not Capabilities")
    if caps.keeps_engines_up and not callable(getattr(probe, "close_run", None)):
        raise TypeError("capabilities() declares keeps_engines_up and the adapter has no close_run()")
    name = str(getattr(probe, "name", type(probe).__name__))
    if profiles is None:
        wanted = [p for p in PROFILES if p in caps.profiles or p in caps.unavailable] or list(PROFILES)
    else:
        profiles = list(profiles)
        unknown = set(profiles) - set(PROFILES)
        if unknown:
            raise ValueError(f"unknown profiles {sorted(unknown)}; known: {list(PROFILES)}")
        wanted = [p for p in PROFILES if p in profiles]
    selected = None if ids is None else set(ids)
    if selected is not None and selected - {t.id for t in CATALOGUE}:
        raise ValueError(f"unknown test ids {sorted(selected - {t.id for t in CATALOGUE})}")
    params = {"lease_term_ms": lease_term_ms, "skew_ms": skew_ms, "nodes": nodes, "time_limit_s": time_limit_s,
              "validate": validate}
    report = Report(SUITE_VERSION, name, caps.to_json(), {}, wanted, seed, params, time.time())
    workroot = Path(tempfile.mkdtemp(prefix="kvcc-conform-"))
    try:
        versions: dict = {}
        for profile in wanted:
            tests = catalogue.tests_for([profile])
            for test in tests:
                if progress:
                    progress("start", test, None)
                if selected is not None and test.id not in selected:
                    result = TestResult(test.id, test.profile, SKIP, "deselected")
                elif profile in caps.unavailable:
                    result = TestResult(test.id, test.profile, NOT_APPLICABLE, f"unavailable here: {caps.unavailable[profile]}")
                elif test.audit:
                    result = _audit(test, [r for r in report.results if r.profile == profile])
                else:
                    result = _run_until_decided(factory, caps, test, seed, workroot, lease_term_ms, skew_ms, nodes,
                                                time_limit_s, versions, validate)  # fmt: skip
                report.results.append(result)
                if progress:
                    progress("done", test, result)
        report.versions = versions or {k: str(v) for k, v in _safe_versions(probe).items()}
    finally:
        if caps.keeps_engines_up:  # the engines it kept up across the tests, whatever they did
            got = _call_with_timeout(probe.close_run, CLOSE_RUN_GRACE_S)
            if isinstance(got, BaseException):  # the report stands; the operator is told
                logging.getLogger("kvcc.conformance").warning("close_run() failed: %s: %s", type(got).__name__, got)
        shutil.rmtree(workroot, ignore_errors=True)
    report.finished_at = time.time()
    if out is not None:
        from .bundle import write_bundle

        write_bundle(report, Path(out))
    return report


def _safe_versions(adapter: Adapter) -> dict:
    try:
        return dict(adapter.versions())
    except Exception as e:  # noqa: BLE001
        return {"error": f"versions() failed: {e}"}


def _run_until_decided(factory, caps, test, seed, workroot, *rest) -> TestResult:
    """``_run_one``, run again (a fresh adapter, the same seed) while the test PASSed but its
    trace went past the validator's bounds (``VALIDATOR_BOUNDS``: too many possible
    states, messages or keys to decide), up to ``UNDECIDED_RETRIES`` times. A stalled process
    widens every interval in a trace and with them the states the validator must keep: a correct
    adapter on a loaded machine must not lose certification to that by chance (CI saw it). Only
    an ACCEPTED trace counts, so a retry can certify nothing the spec does not allow; a FAIL or a
    REJECTED trace is final. The result says how many attempts it took and why."""
    undecided: list[str] = []
    while True:
        result = _run_one(factory, caps, test, seed, workroot / f"attempt-{len(undecided) + 1}", *rest)
        result.attempts = len(undecided) + 1
        v = result.verdict
        decided = result.status != PASS or v.get("status") != "INCONCLUSIVE" or v.get("code") not in VALIDATOR_BOUNDS
        if decided or len(undecided) == UNDECIDED_RETRIES:
            break
        undecided.append(result.verdict.get("reason", ""))
    if undecided and result.counts:
        result.message = f"trace ACCEPTED on attempt {result.attempts}; before, INCONCLUSIVE: " + "; ".join(undecided)
    return result


def _run_one(factory, caps, test, seed, workroot, lease_term_ms, skew_ms, nodes, time_limit_s, versions, validate) -> TestResult:
    missing = sorted(test.faults - caps.faults) + sorted(f"scope:{s}" for s in test.scopes - caps.scopes)
    if missing:
        return TestResult(test.id, test.profile, NOT_APPLICABLE, f"needs {', '.join(missing)}")
    tseed = test_seed(seed, test.id)
    rng = random.Random(tseed)
    namespaces = tuple(random_namespace(rng) for _ in range(test.namespaces))
    foreign = random_namespace(rng)
    workdir = workroot / test.id
    workdir.mkdir(parents=True)
    ctx = RunContext(workdir, tseed, nodes=nodes, lease_term_ms=lease_term_ms, skew_ms=skew_ms, namespaces=namespaces)
    limit = time_limit_s if time_limit_s is not None else test.time_limit_s
    t0 = time.monotonic()
    state: dict[str, Any] = {}
    try:
        adapter = factory()
    except Exception as e:  # noqa: BLE001
        return TestResult(test.id, test.profile, ERROR, f"factory failed: {type(e).__name__}: {e}", seed=tseed)
    session_box: list[Session] = []

    def work() -> None:
        try:
            adapter.start(ctx)
            state["started"] = True
            if not versions:
                versions.update({k: str(v) for k, v in _safe_versions(adapter).items()})
            s = Session(adapter, rng, namespaces, foreign, tuple(adapter.nodes()), lease_term_ms, skew_ms,
                        infer=caps.events == "inferred")  # fmt: skip
            session_box.append(s)
            workloads.BODIES[test.body](s)
            state["status"] = PASS
        except OracleFailure as e:
            state["status"], state["message"] = FAIL, str(e)
        except NotSupported as e:
            state["status"], state["message"] = NOT_APPLICABLE, f"not supported: {e.op}"
        except AdapterError as e:
            state["status"], state["message"] = ERROR, f"adapter error: {e.reason}"
        except GarbageAnswer as e:
            state["status"], state["message"] = ERROR, f"garbage answer: {e}"
        except BaseException as e:  # noqa: BLE001 - any other failure of the adapter is ERROR
            tb = traceback.format_exception(type(e), e, e.__traceback__)
            state["status"], state["message"] = ERROR, f"{type(e).__name__}: {e}\n{''.join(tb[-3:])}"

    worker = threading.Thread(target=work, name=f"kvcc-conform-{test.id}", daemon=True)
    worker.start()
    worker.join(limit)
    timed_out = worker.is_alive()
    if timed_out:
        if session_box:
            session_box[0].stopped.set()
    _call_with_timeout(adapter.stop, STOP_GRACE_S)
    if timed_out:
        worker.join(STOP_GRACE_S)
        after = state.get("message", "")
        state["status"] = ERROR
        state["message"] = f"timed out after {limit:g} s" + (f"; after stop(): {after}" if after else "")
        if worker.is_alive():
            state["message"] += "; the workload did not return after stop()"
    session = session_box[0] if session_box else None
    events: list = []
    if session is not None and session.infer:
        events = list(session.inferred)
    elif state.get("started"):
        got = _call_with_timeout(adapter.events, EVENTS_TIMEOUT_S)
        if isinstance(got, list):
            events = got
        elif state.get("status") == PASS:
            state["status"], state["message"] = ERROR, f"events() answered {type(got).__name__}, not a list"
    status, message = state.get("status", ERROR), state.get("message", "")
    native = session is not None and not session.infer
    if native and status == PASS and not events:
        # The adapter said it logs its protocol events and logged none: saying nothing must not
        # pass (docs/protocol.md: a verdict that could not be reached never counts as a pass).
        status, message = FAIL, "the adapter declares native events and its trace is empty"
    elif native and status == PASS:
        # Every operation the suite performed must be in the adapter's own log, and nothing the
        # suite did not do: a trace that leaves events out would validate vacuously.
        # An engine's own clients act beside the suite's (profile engine): only the suite's count.
        gaps = completeness_problems(session.history, events, own_leases_only=test.profile == ENGINE_PROFILE)
        if gaps:
            status = FAIL
            message = f"TraceComplete: {len(gaps)} event(s) missing or extra in the native trace: " + "; ".join(gaps[:5])
    if not validate:
        verdict = {"status": "INCONCLUSIVE", "event_index": None, "reason": "validation off", "diff": None}
    elif not events:
        verdict = {"status": "INCONCLUSIVE", "event_index": None, "reason": "no events", "diff": None}
    else:
        verdict = validate_events(events, lease_term_ms, skew_ms)
    if verdict["status"] == "REJECTED" and status == PASS:
        status = FAIL
        message = f"trace REJECTED at event {verdict['event_index']}: {verdict['reason']}"
    elif verdict["status"] != "ACCEPTED" and status == PASS:
        message = f"does not count: trace {verdict['status']} ({verdict['reason']})"
    return TestResult(
        test.id, test.profile, status, message, time.monotonic() - t0, verdict,
        session.audit.to_json() if session else {}, events, list(session.history) if session else [], tseed,
    )  # fmt: skip


def _call_with_timeout(fn: Callable[[], Any], timeout_s: float) -> Any:
    """Call ``fn`` in a daemon thread; its result, the exception it raised, or None on timeout."""
    box: list = []

    def call() -> None:
        try:
            box.append(fn())
        except BaseException as e:  # noqa: BLE001
            box.append(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(timeout_s)
    return box[0] if box else None


AUDIT_RULES: dict[str, tuple[tuple[str, int], ...]] = {
    "KVCC-CORE-900": (("remote_hits", 1),),
    "KVCC-LEASE-900": (("refused_evictions_leased", 1), ("fenced_writes", 1)),
    "KVCC-INVAL-900": (("invalidations_by_ack", 1),),
    "KVCC-TIER-900": (("evictions", 1),),
    "KVCC-FAULT-900": (("invalidations_by_expiry", 1),),
    "KVCC-LOAD-900": (("remote_hits", 1), ("evictions", 1)),
}
assert set(AUDIT_RULES) == {t.id for t in CATALOGUE if t.audit}


def _audit(test: TestCase, results: list[TestResult]) -> TestResult:
    ran = [r for r in results if r.status in (PASS, FAIL)]
    if not ran:
        return TestResult(test.id, test.profile, NOT_APPLICABLE, "no test of the profile ran")
    total = Audit()
    for r in ran:
        total.add(Audit(**r.audit))
    short = [f"{name} = {getattr(total, name)} < {least}" for name, least in AUDIT_RULES[test.id] if getattr(total, name) < least]
    status = FAIL if short else PASS
    message = "; ".join(short)
    failed = [r.id for r in ran if r.status == FAIL]
    if short and failed:
        # A FAIL stops its test at the first failed check: the counts it would have added after
        # that are missing, so this shortfall may be only a knock-on of those failures.
        message += (f" (counted over the tests that ran; {', '.join(failed)} FAILed and stopped early, so this may be "
                    f"only a knock-on: fix {'it' if len(failed) == 1 else 'them'} first)")
    return TestResult(test.id, test.profile, status, message, audit=total.to_json())
