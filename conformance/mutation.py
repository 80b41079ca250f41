"""The suite's own mutation score: how many broken implementations the conformance suite lets through.

Theory of operation
-------------------
A conformance suite that certifies every implementation proves nothing. This module measures the
suite the way mutation testing measures a test suite: it breaks the in-process reference deployment
(``kvcc.conformance.testing.CoreAdapter``) at one decision point at a time, runs the suite on each
broken deployment, and counts how many the suite refuses to certify.

- **Targets** (``TARGETS``): the modules the in-process deployment runs, each restricted to the
  functions that deployment can reach: the directory core (``reference/directory/core.py``: every
  guard and state update, and the call sites of the spec's rules -- the rules themselves,
  ``spec/rules.py``, are not mutated, because the trace validator replays the spec through the same
  rules: a mutant there would change the oracle together with the implementation); the holder,
  writer and location logic of ``CoreAdapter`` (``conformance/testing.py``), the holder it shares with
  the client (``reference/holder.py``) and the host of its directory (``reference/directory/host.py``:
  the durable commit, the logged steps and the directives in order); the slot-tier logic
  its DRAM tiers run (``reference/tiers/base.py``, ``reference/tiers/dram.py``). What a target
  leaves out is listed with the reason (``Target.skip``): code the in-process deployment never runs
  (a transfer given up, the ``WaitTicket`` message, other tiers' hooks).
- **Operators** (``OPERATORS``), applied by an AST walk of each target function, each a textual
  splice of the one node it changes (so a mutant's diff is one line and its line numbers are the
  original's): ``negate-cond``, ``cond-true``, ``cond-false`` on the tests of ``if``, ``while`` and
  conditional expressions; ``not-drop``; ``boolop-swap`` (``and``/``or``) and ``boolop-drop`` (one
  operand of a compound condition dropped); ``cmp-swap`` (``<``/``<=``, ``>``/``>=``, ``==``/``!=``,
  ``is``/``is not``, ``in``/``not in``); ``const-off`` (an integer constant below
  ``CONST_LIMIT`` plus or minus one); ``stmt-drop`` (a state update: an assignment to an attribute,
  an item or a rebound name, an augmented assignment, ``del``, a call made for its effect, such as
  ``.add``, ``.discard``, ``.pop``, an emitted event or an appended effect); ``return-early`` (a
  procedure returns before its first statement); ``return-negate`` (a boolean result negated).
  ``assert`` statements are not mutated: they are the reference's self-checks, not decisions --
  negating one is killed by any test that reaches it, dropping one is equivalent wherever the
  spec's invariants hold (the model checker's business), and neither measures the suite.
- **Identity.** A mutant's ``id`` is ``<module>:<line>:<operator>:<ordinal>`` (ordinal: among the
  mutants of that operator on that line); its ``fingerprint`` names it by content (module,
  function, operator, the code before and after, occurrence), so that the reviewed list of
  equivalent mutants survives edits elsewhere in the file.
- **Runs.** Each mutant runs in a fresh process forked from a zygote that has preloaded the heavy
  third-party modules (torch, numpy) and the suite itself, but none of the targets: an import hook
  (``_MutantFinder``) serves every target from the snapshot taken when the run started, the
  mutated source in place of its module (edits on disk during a run change nothing), then the
  process runs ``run_conformance`` on
  ``core_factory`` with the given profiles and seed, stopping at the first required test that does
  not PASS. Killed: the suite does not certify (a required test FAILs or ERRORs, including the
  runner's own per-test time limit), or the mutant crashes the process, or it runs past the
  per-mutant timeout (counted as killed and reported apart under ``timeouts``: a deployment that
  hangs cannot be certified). Survived: the suite certifies the broken deployment.
- **Selection** (as PIT and mutmut do). Two baseline runs with every function of the targets
  instrumented (``_Reach``: a call naming the function first in its body) record which test ran
  which function; a mutant then runs only the tests that ran its function in either, and every
  other test is taken to end as in the baseline -- it must: its run is the baseline's until it
  enters the mutated function, which it never does -- including for the profiles' audits, which
  count over both. Checked before any mutant runs: each half of the tests, run alone on the
  unmutated deployment, certifies (no test depends on one before it); otherwise, and with
  ``--whole-suite``, every mutant runs every test. A mutant of a function no baseline test ran
  runs every test. A kill is confirmed by its selection run again up to the killing test.
- **Equivalents.** A survivor that no conformance test could ever tell from the reference (its
  behaviour, as an adapter, is the reference's) is recorded, with a one-line argument, in
  ``conformance/mutation_equivalents.json``; score = killed / (mutants - equivalent survivors). An
  entry that is killed or matches no mutant is reported (``stale_equivalents``): the list is
  reviewed, never trusted.
- **Baseline.** The unmutated deployment is run first through the same machinery and must certify;
  otherwise no mutant's verdict means anything and the run stops.

``kvcc conform --mutation-score [--json] [--jobs N] [--limit N] [--module NAME ...]`` prints ``mutants``, ``killed``,
``survivors``, ``equivalent`` and ``score``; exit 0 when the score reaches ``TARGET_SCORE``.
``--module NAME`` (repeatable) mutates only the targets whose module name contains NAME: the
score is then theirs alone.
"""

from __future__ import annotations

import ast
import difflib
import hashlib
import importlib.abc
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from attrs import field, frozen

TARGET_SCORE = 0.95
CONST_LIMIT = 1000  # integer constants mutated by const-off: |c| below this (unit factors are not decisions)
DEFAULT_PROFILES = ("core", "leases", "invalidation", "tiering", "faults")
DEFAULT_SEED = 3
DEFAULT_LEASE_TERM_MS = 200  # short terms, as tests/test_conformance.py runs the kit: most tests wait a few terms
DEFAULT_SKEW_MS = 20
TEST_TIME_LIMIT_S = 20.0  # the runner's per-test limit for a mutant (its tests take a few terms)
MUTANT_TIMEOUT_S = 180.0  # a whole mutant run; past it the process is killed and the mutant counted killed
DEFAULT_JOBS = 2
EQUIVALENTS_FILE = Path(__file__).with_name("mutation_equivalents.json")
PRELOAD = ("torch", "numpy", "xxhash", "attrs", "rich")
# The suite, imported once per zygote: none of these imports a target (the zygote asserts it).
SUITE_MODULES = ("kvcc.conformance.runner", "kvcc.conformance.validate")

OPERATORS = (
    "negate-cond", "cond-true", "cond-false", "not-drop", "boolop-swap", "boolop-drop", "cmp-swap",
    "const-off", "stmt-drop", "return-early", "return-negate",
)  # fmt: skip

_CMP_SWAP: dict[type, type] = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In,
}  # fmt: skip


# -- targets ---------------------------------------------------------------------------------------------


@frozen
class Target:
    """One module to mutate. ``only``: the top-level names (classes or functions) whose code is
    mutated (None: all); ``skip``: qualified names left out, each with the reason."""

    module: str
    only: frozenset[str] | None = field(default=None, converter=lambda v: None if v is None else frozenset(v))
    skip: tuple[tuple[str, str], ...] = ()

    @property
    def short(self) -> str:
        return self.module.removeprefix("kvcc.")

    def path(self) -> Path:
        return Path(_origin(self.module))

    def wants(self, qualname: str) -> bool:
        top = qualname.split(".")[0]
        if self.only is not None and top not in self.only:
            return False
        skipped = {name for name, _ in self.skip}
        parts = qualname.split(".")
        return not any(".".join(parts[:i]) in skipped for i in range(1, len(parts) + 1))


def _origin(module: str) -> str:
    """The file a module is imported from (without importing it)."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    return spec.origin


_NO_CANCEL = ("no caller gives a transfer up: the reference's nodes and the kit keep one pending until its Copied, "
              "an invalidation, or the destination's node rejoining or declared down ends it")
_NO_DISCONNECT = ("only the reference server's watchdog reads it (a lost connection); the in-process deployment's "
                  "failure detector is CoreHost's, one lease term after a kill")
TARGETS: tuple[Target, ...] = (
    Target("kvcc.reference.directory.core", skip=(
        ("DirectoryCore.cancel_transfer", _NO_CANCEL),
        ("DirectoryCore.copy_lost", "only a reference node reports a lost copy (Lost, after a granted read missed); the "
                                    "kit's damaged copies (its corrupt fault) are evicted by KVCC-FAULT-010 itself"),
        ("DirectoryCore._abandon_transfer", _NO_CANCEL + " (its callers: cancel_transfer; node_down, for a record "
                                            "moving to the node declared down, and node_rejoined, for one moving to the "
                                            "rejoining node: no test moves a block to a node that then stays down a term)"),
        ("DirectoryCore._mirror", "only a directory on etcd mirrors its leases (lease_mirror_bucket_ms); the kit's "
                                  "directory restarts on the full grace (tests/test_directory_core.py tests the mirror)"),
        ("Ticket.completed_by", "reporting (how an invalidation ended); the deployment never reads it"),
        ("Record.phase_name", "reporting; the deployment never reads it"),
        ("DirectoryCore.children", "a reader for tests and tools; the core walks its index directly"),
        ("DirectoryCore.pending_frees", "a reader for tests and tools; the deployment never calls it"),
        ("Send.due", "only the reference server reads it (its log stamps a step after the decision); the kit logs "
                     "and delivers every Revoke in the step that made it"),
        ("DirectoryCore.ticket_status", "only the WaitTicket message calls it; the kit reads tickets directly"),
        ("DirectoryCore.locate", "only the Locate message calls it (a sharded directory's client; the in-process "
                                 "deployment has one directory); tests/test_directory_core.py and tests/test_sharded_client.py test it"),
        ("DirectoryCore.next_deadline_ms", "a wake-up hint: the kit's ticker wakes every TICK_IDLE_MS whatever it says, "
                                           "and every entry point first lets time pass (a late tick only delays)"),
        ("DirectoryCore.check_invariants", "a debugging check that tests call, not the deployment"),
        ("DirectoryConfig.disconnect_detection_ms", _NO_DISCONNECT),
        ("DirectoryCore.check_request", "only the directory server's batch path calls it (a batch's Lookup items "
                                        "checked before any item is taken); the in-process deployment has no batches"),
        ("DirectoryConfig.directory_view_ms", "a derived figure for callers; the core does not use it"),
        ("DirectoryConfig.holder_budget_ms", "a derived figure for callers; the core does not use it"),
        ("DirectoryConfig.invalidation_deadline_ms", "a derived figure for callers; the core does not use it"),
        ("_positive", "configuration validation; the suite passes a fixed, valid configuration"),
        ("DirectoryConfig.__attrs_post_init__", "configuration validation; the suite passes a valid one"),
    )),  # fmt: skip
    Target("kvcc.conformance.testing", only={"CoreAdapter"}, skip=(
        *((f"CoreAdapter.{name}", "the kit's lifecycle and plumbing (logs, clocks, timers), not the deployment's logic")
          for name in ("__init__", "capabilities", "versions", "start", "stop", "nodes", "events", "_new_core",
                       "_clock_ns", "_new_log", "_new_node", "_new_tier", "_now_ms", "_node_now_ns", "_next_request",
                       "_check_running", "_tick_loop", "_fault", "_after_copy_delay", "_run_due")),
        *((f"CoreAdapter.{name}", "fault injection: the environment the suite controls, not the deployment")
          for name in ("kill", "_crash_medium", "pause", "skew_clock", "corrupt")),
    )),  # fmt: skip
    Target("kvcc.reference.holder", skip=(
        ("Holder.may_renew", "the client's renewal check; the kit checks a renewal's lease with trusted"),
        ("Holder.held", "read only by the known-bad kits (trusts-expired); the deployment never calls it"),
        ("Holder.leases", "a reader for tests and tools; the deployment never calls it"),
        ("Holder.forget", "called by the kit's kill only (fault injection), whose node is replaced, with a new "
                          "holder, on restart: nothing reads the forgotten holder again"),
    )),  # fmt: skip
    Target("kvcc.reference.directory.host", skip=(
        ("CoreHost.__init__", "construction; the kit passes its commit and emit"),
        ("CoreHost.due", "the Mooncake adapter's timer asks it; the kit's ticker ticks at every wake"),
        ("CoreHost.wait_s", "a wake-up hint: the kit's ticker wakes at least every TICK_IDLE_MS whatever it says, "
                            "and every entry point first lets time pass (a late tick only delays)"),
        *((f"CoreHost.{name}", "the journaled path: only the directory server journals its steps (_StepJournal); "
                               "the kit's host has no journal, so record never takes it")
          for name in ("prepare", "_record_journaled")),
    )),  # fmt: skip
    Target("kvcc.reference.tiers.base", only={"SlotTier", "Tier", "Header", "decode_header", "block_checksum",
                                               "piece_digests", "combine_digests", "copy_checksum"}, skip=(
        ("Tier.read_many", "no caller in the in-process deployment"),
        ("SlotTier.contains", "no caller in the in-process deployment"),
        ("SlotTier.keys", "no caller in the in-process deployment"),
        ("SlotTier.blocks", "no caller in the in-process deployment"),
        ("SlotTier.lru", "no caller in the in-process deployment (the kit picks no victims)"),
        ("SlotTier.lost", "no caller in the in-process deployment"),
        ("SlotTier.used_bytes", "no caller in the in-process deployment"),
        ("SlotTier.capacity_bytes", "no caller in the in-process deployment"),
        ("SlotTier._persist_fences", "a durable tiers' hook; DRAM keeps nothing"),
        ("SlotTier._prepare_source", "overridden by DramTier"),
        ("SlotTier._prepare_sink", "tensor and buffer plumbing for callers other than the kit"),
        ("SlotTier.__init__", "construction with the kit's fixed sizes"),
        ("Header.with_flags", "used by the NVMe tier only"),
        ("Tier.__enter__", "no caller in the in-process deployment"),
        ("Tier.__exit__", "no caller in the in-process deployment"),
    )),  # fmt: skip
    Target("kvcc.reference.tiers.dram", only={"DramTier"}, skip=(
        ("DramTier.__init__", "construction with the kit's fixed sizes"),
        ("DramTier._prepare_source", "tensor plumbing: the kit writes bytes"),
        ("DramTier.damage", "fault injection (the kit's corrupt): the environment the suite controls"),
        ("DramTier._load_split", "opt-in split reads (split_reads=True), which the kit's tiers never enable; "
                                 "tests/test_tiers.py checks them (every piece verified before anything is copied)"),
    )),  # fmt: skip
)


# -- mutants ---------------------------------------------------------------------------------------------


@frozen
class Mutant:
    """One mutant: the original ``source`` of ``module`` with bytes ``start:end`` replaced by
    ``replacement`` (UTF-8 offsets)."""

    module: str
    function: str
    line: int
    operator: str
    ordinal: int
    before: str
    after: str
    start: int
    end: int
    replacement: str
    occurrence: int = 0  # among mutants of this module with the same (function, operator, before, after)

    @property
    def id(self) -> str:
        return f"{self.module.removeprefix('kvcc.')}:{self.line}:{self.operator}:{self.ordinal}"

    @property
    def fingerprint(self) -> str:
        text = "\x00".join((self.module, self.function, self.operator, self.before, self.after, str(self.occurrence)))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def source(self, original: bytes) -> str:
        return (original[: self.start] + self.replacement.encode() + original[self.end:]).decode()

    def diff(self, original: bytes, path: str) -> str:
        a = original.decode().splitlines(keepends=True)
        b = self.source(original).splitlines(keepends=True)
        return "".join(difflib.unified_diff(a, b, f"a/{path}", f"b/{path}", n=1))

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "fingerprint": self.fingerprint, "module": self.module, "function": self.function,
                "line": self.line, "operator": self.operator, "before": self.before, "after": self.after}  # fmt: skip


class _Offsets:
    """(line, column) of the AST -- columns are UTF-8 byte offsets -- to byte offsets in the file."""

    def __init__(self, source: bytes) -> None:
        self.starts = [0]
        for line in source.splitlines(keepends=True):
            self.starts.append(self.starts[-1] + len(line))

    def span(self, node: ast.AST) -> tuple[int, int]:
        return (self.starts[node.lineno - 1] + node.col_offset, self.starts[node.end_lineno - 1] + node.end_col_offset)


class _Mutator(ast.NodeVisitor):
    def __init__(self, target: Target, source: bytes) -> None:
        self.target = target
        self.source = source
        self.offsets = _Offsets(source)
        self.stack: list[str] = []
        self.rebound: list[set[str]] = []
        self.out: list[tuple[str, int, str, str, str, int, int, str]] = []

    # bookkeeping

    _in_function = False  # inside a wanted function (the walk enters only those)

    def _add(self, op: str, node: ast.AST, replacement: str, at: ast.AST | None = None) -> None:
        where = at or node
        a, b = self.offsets.span(where)
        before = " ".join(self.source[a:b].decode().split())
        after = " ".join(replacement.split())
        if before == after:
            return
        self.out.append((".".join(self.stack), where.lineno, op, before, after, a, b, replacement))

    def _expr(self, op: str, node: ast.expr, new: ast.expr | str) -> None:
        text = new if isinstance(new, str) else ast.unparse(new)
        self._add(op, node, f"({text})")

    # scopes

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.stack.append(node.name)
        outer = self._in_function
        self._in_function = True
        names = {a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)}
        counts: dict[str, int] = {}
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                counts[sub.id] = counts.get(sub.id, 0) + 1
        self.rebound.append(names | {n for n, c in counts.items() if c > 1})
        if self.target.wants(".".join(self.stack)):
            self._return_early(node)
            for stmt in node.body:
                self.visit(stmt)
        self.rebound.pop()
        self._in_function = outer
        self.stack.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def _return_early(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        returns = [n for n in ast.walk(node) if isinstance(n, ast.Return)]
        is_gen = any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in ast.walk(node))
        if is_gen or any(r.value is not None and not (isinstance(r.value, ast.Constant) and r.value.value is None)
                         for r in returns):  # fmt: skip
            return
        body = node.body
        first = body[1] if (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                            and isinstance(body[0].value.value, str) and len(body) > 1) else body[0]  # fmt: skip
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
            return  # a docstring alone (an abstract hook)
        if all(isinstance(stmt, ast.Assert) for stmt in body[body.index(first):]):
            return  # self-checks only: returning early is dropping asserts (see the module docstring)
        a, _ = self.offsets.span(first)
        indent = " " * first.col_offset
        self.out.append((".".join(self.stack), first.lineno, "return-early", "", "return", a, a, f"return\n{indent}"))

    # statements

    def visit_Assert(self, node: ast.Assert) -> None:
        return  # self-checks, not decisions (see the module docstring)

    def visit_If(self, node: ast.If) -> None:
        self._cond(node.test, loop=False)
        self.generic_visit(node)

    def visit_While(self, node: ast.While) -> None:
        self._cond(node.test, loop=True)
        self.generic_visit(node)

    def visit_IfExp(self, node: ast.IfExp) -> None:
        self._cond(node.test, loop=False)
        self.generic_visit(node)

    def _cond(self, test: ast.expr, loop: bool) -> None:
        if not self._in_function:
            return
        if isinstance(test, ast.Name) and test.id == "TYPE_CHECKING":
            return
        self._expr("negate-cond", test, f"not ({ast.unparse(test)})")
        if not loop:
            self._expr("cond-true", test, "True")
        self._expr("cond-false", test, "False")

    def visit_Assign(self, node: ast.Assign) -> None:
        if self._in_function and any(self._is_state(t) for t in node.targets):
            self._add("stmt-drop", node, "pass")
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if self._in_function and node.value is not None and self._is_state(node.target):
            self._add("stmt-drop", node, "pass")
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        if self._in_function:
            self._add("stmt-drop", node, "pass")
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        if self._in_function:
            self._add("stmt-drop", node, "pass")
        self.generic_visit(node)

    def visit_Expr(self, node: ast.Expr) -> None:
        if self._in_function and isinstance(node.value, ast.Call):
            self._add("stmt-drop", node, "pass")
        self.generic_visit(node)

    def visit_Return(self, node: ast.Return) -> None:
        v = node.value
        if self._in_function and v is not None:
            if isinstance(v, ast.Constant) and isinstance(v.value, bool):
                self._expr("return-negate", v, repr(not v.value))
            elif isinstance(v, (ast.Compare, ast.BoolOp)) or (isinstance(v, ast.UnaryOp) and isinstance(v.op, ast.Not)):
                self._expr("return-negate", v, f"not ({ast.unparse(v)})")
        self.generic_visit(node)

    def _is_state(self, target: ast.expr) -> bool:
        if isinstance(target, (ast.Attribute, ast.Subscript)):
            return True
        if isinstance(target, ast.Name):
            return target.id in self.rebound[-1]
        if isinstance(target, (ast.Tuple, ast.List)):
            return any(self._is_state(e) for e in target.elts)
        return False

    # expressions

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        return  # messages, not decisions

    def visit_Slice(self, node: ast.Slice) -> None:
        return  # byte ranges of copies and messages; their bounds are covered by the checksums

    def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
        if self._in_function and isinstance(node.op, ast.Not):
            self._expr("not-drop", node, node.operand)
        self.generic_visit(node)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        if self._in_function:
            other = ast.Or() if isinstance(node.op, ast.And) else ast.And()
            self._expr("boolop-swap", node, ast.BoolOp(other, node.values))
            for i in range(len(node.values)):
                rest = node.values[:i] + node.values[i + 1:]
                self._expr("boolop-drop", node, rest[0] if len(rest) == 1 else ast.BoolOp(node.op, rest))
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        if self._in_function:
            for i, op in enumerate(node.ops):
                swapped = _CMP_SWAP.get(type(op))
                if swapped is not None:
                    ops = list(node.ops)
                    ops[i] = swapped()
                    self._expr("cmp-swap", node, ast.Compare(node.left, ops, node.comparators))
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        v = node.value
        if self._in_function and type(v) is int and abs(v) < CONST_LIMIT:
            for new in (v + 1, v - 1):
                self._add("const-off", node, f"({new})")


def generate(targets: Sequence[Target] = TARGETS) -> list[Mutant]:
    """Every mutant of ``targets``, in file order, duplicates (same mutated source) dropped."""
    mutants: list[Mutant] = []
    for target in targets:
        source = target.path().read_bytes()
        tree = ast.parse(source)
        m = _Mutator(target, source)
        for stmt in tree.body:
            m.visit(stmt)
        seen: set[bytes] = set()
        ordinals: dict[tuple[int, str], int] = {}
        occurrences: dict[tuple[str, str, str, str], int] = {}
        for function, line, op, before, after, a, b, replacement in sorted(m.out, key=lambda r: (r[5], r[6], r[2], r[7])):
            new = source[:a] + replacement.encode() + source[b:]
            digest = hashlib.sha256(new).digest()
            if new == source or digest in seen:
                continue
            seen.add(digest)
            ordinal = ordinals[(line, op)] = ordinals.get((line, op), -1) + 1
            occ = occurrences[(function, op, before, after)] = occurrences.get((function, op, before, after), -1) + 1
            mutants.append(Mutant(target.module, function, line, op, ordinal, before, after, a, b, replacement, occ))
    return mutants


# -- running one mutant ---------------------------------------------------------------------------------------


class _MutantFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every target module from ``sources`` (name -> (source, origin file)): the snapshot
    taken when the run started, one of them mutated. Tracebacks name the original files."""

    def __init__(self, sources: dict[str, tuple[str, str]], reach: Callable[[str], None] | None = None) -> None:
        self.sources = sources
        self.reach = reach  # with it, every function of a target names itself to it when it runs

    def find_spec(self, fullname, path, target=None):  # noqa: ANN001 - the importlib protocol
        if fullname not in self.sources:
            return None
        return importlib.util.spec_from_loader(fullname, self, origin=self.sources[fullname][1])

    def create_module(self, spec):  # noqa: ANN001
        return None

    def exec_module(self, module) -> None:  # noqa: ANN001
        text, origin = self.sources[module.__name__]
        module.__file__ = origin
        if self.reach is None:
            exec(compile(text, origin, "exec"), module.__dict__)
            return
        module.__dict__[_REACHED] = self.reach
        exec(compile(_Reach(module.__name__).visit(ast.parse(text)), origin, "exec"), module.__dict__)


_REACHED = "__kvcc_reached__"


class _Reach(ast.NodeTransformer):
    """Puts ``__kvcc_reached__("<module>:<function>")`` first in every function body (after its
    docstring), the function named as ``Mutant.function`` names it; line numbers are kept."""

    def __init__(self, module: str) -> None:
        self.module = module
        self.stack: list[str] = []

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.ClassDef:
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()
        return node

    def visit_FunctionDef(self, node):  # noqa: ANN001, ANN201 - FunctionDef or AsyncFunctionDef
        self.stack.append(node.name)
        self.generic_visit(node)
        name = reach_name(self.module, ".".join(self.stack))
        self.stack.pop()
        call = ast.Expr(ast.Call(ast.Name(_REACHED, ast.Load()), [ast.Constant(name)], []))
        first = node.body[0]
        docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
        node.body.insert(1 if docstring else 0, ast.fix_missing_locations(ast.copy_location(call, first)))
        return node

    visit_AsyncFunctionDef = visit_FunctionDef


def reach_name(module: str, function: str) -> str:
    return f"{module}:{function}"


class _Stop(Exception):
    """Raised from the runner's progress hook at the first required test that did not PASS."""


@frozen
class RunParams:
    profiles: tuple[str, ...] = DEFAULT_PROFILES
    seed: int = DEFAULT_SEED
    lease_term_ms: int = DEFAULT_LEASE_TERM_MS
    skew_ms: int = DEFAULT_SKEW_MS
    test_time_limit_s: float = TEST_TIME_LIMIT_S
    mutant_timeout_s: float = MUTANT_TIMEOUT_S


def _suite_verdict(params: RunParams, ids: Sequence[str] | None = None, given: dict[str, dict] | None = None,
                   reached: dict[str, set[str]] | None = None) -> dict[str, Any]:
    """Run the suite on the in-process deployment as this process has it; stop at the first
    required test that does not PASS. ``{"certified": bool, "test", "status", "message"}``.

    ``ids``: only these tests run (none of them an audit); every other test is taken to end as it
    did in the baseline (``given``: test id -> its ``status`` and ``audit`` there), which is what it
    does when it never reaches the mutated function, and the profiles' audits are counted over
    both. ``reached``: filled with test id -> the functions of the targets that test ran
    (``reach_name``), when the targets are instrumented (``_Reach``)."""
    from . import catalogue, runner, testing

    required = catalogue.required_ids(params.profiles)
    chosen = None if ids is None else set(ids)
    assert chosen is None or given is not None, "a selection needs the baseline's results"
    first: dict[str, Any] = {}
    results: dict[str, dict] = {}

    def on(event: str, test, result) -> None:  # noqa: ANN001 - the runner's progress hook
        if event == "start" and reached is not None:
            _REACHING[0] = reached.setdefault(test.id, set())
        if event != "done" or (chosen is not None and test.id not in chosen):
            return
        results[test.id] = {"status": result.status, "audit": result.audit}
        if test.id in required and result.status != runner.PASS:
            first.update(test=test.id, status=result.status, message=result.message[:300])
            raise _Stop

    try:
        rep = runner.run_conformance(testing.core_factory, params.profiles, params.seed,
                                     lease_term_ms=params.lease_term_ms, skew_ms=params.skew_ms,
                                     time_limit_s=params.test_time_limit_s, ids=ids, progress=on)  # fmt: skip
    except _Stop:
        return {"certified": False, **first}
    if chosen is not None:
        for test in catalogue.tests_for(params.profiles):
            if not test.audit or test.id not in required:
                continue
            counted = [runner.TestResult(t.id, t.profile, **(results[t.id] if t.id in chosen else given[t.id]))
                       for t in catalogue.tests_for([test.profile]) if not t.audit]  # fmt: skip
            r = runner._audit(test, counted)
            if r.status != runner.PASS:
                return {"certified": False, "test": r.id, "status": r.status, "message": r.message[:300]}
        return {"certified": True}
    if not rep.certified:
        bad = rep.required_failures()
        r = bad[0] if bad else None
        return {"certified": False, "test": r and r.id, "status": r and r.status, "message": r and r.message[:300]}
    return {"certified": True, "results": results}


_REACHING: list[set[str]] = [set()]  # where the instrumented targets record: the running test's set


def _reach(name: str) -> None:
    _REACHING[0].add(name)


def _run_forked(job: dict[str, Any], timeout_s: float, snapshot: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """Fork a fresh process for ``job``, run it there, and return its verdict (the zygote's side)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(r)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        try:
            params = RunParams(**{**job["params"], "profiles": tuple(job["params"]["profiles"])})
            sources = dict(snapshot)
            if job["module"] is not None:
                compile(job["source"], job["origin"], "exec")  # a splice that does not parse is no mutant
                sources[job["module"]] = (job["source"], job["origin"])
            assert not [m for m in sources if m in sys.modules], "a target was imported before its snapshot"
            reached: dict[str, set[str]] | None = {} if job.get("reach") else None
            sys.meta_path.insert(0, _MutantFinder(sources, _reach if reached is not None else None))
            verdict = _suite_verdict(params, job.get("ids"), job.get("given"), reached)
            if reached is not None:
                verdict["reached"] = {t: sorted(names) for t, names in reached.items()}
        except SyntaxError as e:
            verdict = {"certified": False, "test": None, "status": "INVALID", "message": f"SyntaxError: {e}"[:300]}
        except BaseException as e:  # noqa: BLE001 - a mutant that breaks the import or the runner is killed
            verdict = {"certified": False, "test": None, "status": "CRASH", "message": f"{type(e).__name__}: {e}"[:300]}
        os.write(w, json.dumps(verdict, default=str).encode())
        os._exit(0)  # the daemon threads of a broken deployment must not keep the process alive
    os.close(w)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    timed_out = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        ready, _, _ = select.select([r], [], [], min(left, 1.0))
        if ready:
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    os.close(r)
    if timed_out:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    if timed_out:
        return {"certified": False, "status": "TIMEOUT", "message": f"ran past {timeout_s:g} s"}
    try:
        return json.loads(b"".join(chunks))
    except ValueError:
        return {"certified": False, "status": "CRASH", "message": f"the process died (wait status {status})"}


def _serve() -> None:
    """A zygote: preload the heavy third-party modules and the suite itself (never a target), take
    the targets' snapshot (the first line on stdin), then for each job line fork a fresh process
    that runs it, and answer its verdict as one line. Every mutant of a run therefore meets the
    same suite and the same unmutated targets, whatever is edited on disk meanwhile."""
    for name in (*PRELOAD, *SUITE_MODULES):
        if importlib.util.find_spec(name) is not None:
            __import__(name)
    assert not [t.module for t in TARGETS if t.module in sys.modules], "a target was imported by the zygote"
    snapshot = {name: (text, origin) for name, (text, origin) in json.loads(sys.stdin.readline()).items()}
    for line in sys.stdin:
        job = json.loads(line)
        t0 = time.monotonic()
        verdict = _run_forked(job, job["params"]["mutant_timeout_s"], snapshot)
        verdict["duration_s"] = round(time.monotonic() - t0, 2)
        sys.stdout.write(json.dumps({"key": job["key"], **verdict}) + "\n")
        sys.stdout.flush()


class _Zygote:
    def __init__(self, snapshot: dict[str, tuple[str, str]]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from kvcc.conformance.mutation import _serve; _serve()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1,
        )  # fmt: skip
        self.job: dict[str, Any] | None = None
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(snapshot) + "\n")
        self.proc.stdin.flush()

    def send(self, job: dict[str, Any]) -> None:
        self.job = job
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@frozen
class Outcome:
    fingerprint: str
    killed: bool
    timed_out: bool
    test: str | None
    status: str | None
    message: str
    duration_s: float
    extra: dict = field(factory=dict, eq=False, repr=False)  # a baseline's ``reached`` and ``results``


def run_all(
    jobs_in: Sequence[tuple[str, str | None, str | None, str | None]],
    params: RunParams,
    jobs: int = DEFAULT_JOBS,
    on_done: Callable[[Outcome], None] | None = None,
    options: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Outcome]:
    """Run each ``(key, module, source, origin)`` (module None: the unmutated deployment) in a
    fresh process, ``jobs`` at a time. ``options``: key -> what that job adds to its run: ``ids``
    and ``given`` (a selection, ``_suite_verdict``), ``reach`` (instrument the targets)."""
    p = {"profiles": list(params.profiles), "seed": params.seed, "lease_term_ms": params.lease_term_ms,
         "skew_ms": params.skew_ms, "test_time_limit_s": params.test_time_limit_s,
         "mutant_timeout_s": params.mutant_timeout_s}  # fmt: skip
    options = options or {}
    pending = [{"key": k, "module": m, "source": s, "origin": o, "params": p, **options.get(k, {})}
               for k, m, s, o in jobs_in]  # fmt: skip
    pending.reverse()
    out: dict[str, Outcome] = {}
    snapshot = {t.module: (t.path().read_text(encoding="utf-8"), str(t.path())) for t in TARGETS}
    zygotes = [_Zygote(snapshot) for _ in range(max(1, min(jobs, len(pending))))]
    try:
        for z in zygotes:
            if pending:
                z.send(pending.pop())
        while any(z.job is not None for z in zygotes):
            busy = {z.proc.stdout: z for z in zygotes if z.job is not None}
            ready, _, _ = select.select(list(busy), [], [])
            for stream in ready:
                z = busy[stream]
                line = stream.readline()
                job = z.job
                assert job is not None
                if line:
                    v = json.loads(line)
                else:  # the zygote itself died: the job counts as a crash; start a new one
                    v = {"key": job["key"], "certified": False, "status": "CRASH", "message": "the zygote died",
                         "duration_s": 0.0}  # fmt: skip
                    z.close()
                    zygotes[zygotes.index(z)] = z = _Zygote(snapshot)
                z.job = None
                o = Outcome(v["key"], not v["certified"], v.get("status") == "TIMEOUT", v.get("test"), v.get("status"),
                            v.get("message") or "", v.get("duration_s", 0.0),
                            {k: v[k] for k in ("reached", "results") if k in v})  # fmt: skip
                out[o.fingerprint] = o
                if on_done:
                    on_done(o)
                if pending:
                    z.send(pending.pop())
    finally:
        for z in zygotes:
            z.close()
    return out


# -- the score --------------------------------------------------------------------------------------------------


def load_equivalents(path: Path = EQUIVALENTS_FILE) -> dict[str, dict[str, str]]:
    """fingerprint -> entry (``why`` is the one-line argument)."""
    if not path.is_file():
        return {}
    entries = json.loads(path.read_text(encoding="utf-8"))
    out = {}
    for e in entries:
        assert e.get("why"), f"an equivalent mutant needs its argument: {e}"
        out[e["fingerprint"]] = e
    return out


def pick(mutants: Sequence[Mutant], limit: int | None) -> list[Mutant]:
    """At most ``limit`` mutants, evenly spread over the list (every target and operator)."""
    if limit is None or limit >= len(mutants):
        return list(mutants)
    if limit <= 0:
        return []
    step = len(mutants) / limit
    return [mutants[int(i * step)] for i in range(limit)]


def mutation_score(
    params: RunParams = RunParams(),
    jobs: int = DEFAULT_JOBS,
    limit: int | None = None,
    targets: Sequence[Target] = TARGETS,
    mutants: Sequence[Mutant] | None = None,
    equivalents: dict[str, dict[str, str]] | None = None,
    progress: Callable[[str, int, int, Outcome], None] | None = None,
    previous: dict[str, Any] | None = None,
    confirm_kills: bool = True,
    select: bool = True,
) -> dict[str, Any]:
    """Generate the mutants, run the baseline and every (selected) mutant; the score as a dict.

    With ``confirm_kills`` every mutant the suite did not certify is run once more, and counts as
    killed only if it is not certified again: the suite's timing tests run at a 200 ms term, and on
    a loaded machine one can fail an unbroken deployment now and then (seen: KVCC-CORE-007 and
    KVCC-LEASE-010 "killing" mutants that survive every run alone). A kill that does not repeat is
    reported (``unconfirmed_kills``) and counts as a survivor.

    With ``previous`` (the JSON of an earlier full run), only the mutants that survived it and are
    not (now) reviewed equivalent, and those it did not have, are run; the ones it killed are carried over as
    killed (``carried``), its equivalent ones as alive. Sound while the suite only grew stricter
    since: say so when quoting the score."""
    t0 = time.monotonic()
    every = list(mutants) if mutants is not None else generate(targets)
    chosen = pick(every, limit)
    eq = load_equivalents() if equivalents is None else equivalents
    origins = {m: _origin(m) for m in {m.module for m in chosen}}
    sources = {m: Path(origin).read_bytes() for m, origin in origins.items()}
    # The baseline, twice, its targets instrumented: which test runs which function (the union of
    # the two runs, so that a path taken only now and then is not missed).
    bases = run_all([("baseline", None, None, None), ("baseline-2", None, None, None)], params, jobs,
                    options={"baseline": {"reach": True}, "baseline-2": {"reach": True}})  # fmt: skip
    base = next((b for b in bases.values() if b.killed), bases["baseline"])  # the first that failed, if one did
    reached: dict[str, set[str]] = {}
    for b in bases.values():
        for test_id, names in b.extra.get("reached", {}).items():
            reached.setdefault(test_id, set()).update(names)
    given = bases["baseline"].extra.get("results", {})
    options: dict[str, dict[str, Any]] = {}
    selection: dict[str, Any] = {"by_reach": select}
    if select and not base.killed:
        # Sound only if a test's verdict does not depend on which tests ran before it in the
        # process: check it on the unmutated deployment, each half of the tests alone.
        from . import catalogue

        order = [t for t in given if t in reached and not catalogue.BY_ID[t].audit]
        if order:
            halves = {"half-1": order[0::2], "half-2": order[1::2]}
            checks = run_all([(k, None, None, None) for k in halves], params, jobs,
                             options={k: {"ids": ids, "given": given} for k, ids in halves.items()})  # fmt: skip
            broken = {k: f"{o.test} {o.status}: {o.message[:200]}" for k, o in checks.items() if o.killed}
        else:
            broken = {"reach": "the baseline ran no test"}
        selection["halves_certified"] = not broken
        if broken:
            selection.update(by_reach=False, why=f"the unmutated deployment fails with a selection: {broken}")
        else:
            for m in chosen:
                name = reach_name(m.module, m.function)
                ids = [t for t in order if name in reached[t]]
                if ids:  # else no baseline test ran it: the whole suite runs
                    options[m.fingerprint] = {"ids": ids, "given": given}
            sizes = [len(options[m.fingerprint]["ids"]) if m.fingerprint in options else len(order) for m in chosen]
            selection.update(tests=len(order), mean_tests_run=round(sum(sizes) / max(1, len(sizes)), 1),
                             reached_by_no_test=sum(m.fingerprint not in options for m in chosen))  # fmt: skip
    result: dict[str, Any] = {
        "params": {"profiles": list(params.profiles), "seed": params.seed, "lease_term_ms": params.lease_term_ms,
                   "skew_ms": params.skew_ms, "test_time_limit_s": params.test_time_limit_s,
                   "mutant_timeout_s": params.mutant_timeout_s, "jobs": jobs, "limit": limit},
        "baseline": {"certified": not base.killed, "test": base.test, "status": base.status, "message": base.message,
                     "duration_s": base.duration_s},
        "generated": len(every),
        "selection": selection,
    }  # fmt: skip
    if base.killed:
        result.update(mutants=0, killed=0, survivors=[], equivalent=0, score=None,
                      error="the unmutated deployment does not certify: no mutant's verdict means anything")  # fmt: skip
        return result
    by_fp = {m.fingerprint: m for m in chosen}
    assert len(by_fp) == len(chosen), "mutant fingerprints are unique"
    carried: set[str] = set()
    if previous is not None:
        if previous.get("params", {}).get("limit") is not None:
            raise ValueError("--rerun needs the JSON of a full run (no --limit)")
        # Alive before and reviewed equivalent (then or since): carried as alive, not run again.
        still_equivalent = {e["fingerprint"] for e in previous.get("equivalent_mutants", [])}
        still_equivalent |= {e["fingerprint"] for e in previous["survivors"] if e["fingerprint"] in eq}
        survived = {e["fingerprint"] for e in previous["survivors"]} - still_equivalent
        seen = set(previous.get("fingerprints") or by_fp)  # runs before this field: the same mutants
        invalid_before = {fp for fp, m in by_fp.items() if m.id in set(previous.get("invalid", []))}
        survived |= invalid_before  # not run before: run now (and set apart again if still invalid)
        carried = {fp for fp in by_fp if fp in seen and fp not in survived | still_equivalent}
        carried_alive = {fp for fp in by_fp if fp in still_equivalent}
        result["rerun_of"] = {"mutants": previous.get("mutants"), "killed": previous.get("killed"),
                              "score": previous.get("score"), "elapsed_s": previous.get("elapsed_s")}  # fmt: skip
    else:
        carried_alive = set()
    to_run = [m for m in chosen if m.fingerprint not in carried | carried_alive]
    done = [0]

    def on_done(o: Outcome) -> None:
        done[0] += 1
        if progress:
            progress(by_fp[o.fingerprint].id, done[0], len(to_run), o)

    outcomes = run_all([(m.fingerprint, m.module, m.source(sources[m.module]), origins[m.module]) for m in to_run],
                       params, jobs, on_done, options)  # fmt: skip
    unconfirmed: list[dict[str, Any]] = []
    if confirm_kills:
        # Every kill again (an INVALID splice needs no second look): a kill that does not repeat
        # was the machine's, not the suite's.
        again = [m for m in to_run if outcomes[m.fingerprint].killed and outcomes[m.fingerprint].status != "INVALID"]
        # With a selection, its tests up to the one that killed it (those after it never ran;
        # the ones before it run too, as a kill may need what they left in the process).
        confirm = {}
        for m in again:
            o = options.get(m.fingerprint)
            killer = outcomes[m.fingerprint].test
            ids = o["ids"][: o["ids"].index(killer) + 1] if o and killer in o["ids"] else None
            confirm[m.fingerprint] = {**o, "ids": ids} if ids else (o or {})
        second = run_all([(m.fingerprint, m.module, m.source(sources[m.module]), origins[m.module]) for m in again],
                         params, jobs, None, confirm)  # fmt: skip
        for m in again:
            first, o = outcomes[m.fingerprint], second[m.fingerprint]
            if not o.killed:
                unconfirmed.append({"id": m.id, "fingerprint": m.fingerprint, "test": first.test, "status": first.status,
                                    "message": first.message[:160]})  # fmt: skip
                outcomes[m.fingerprint] = Outcome(m.fingerprint, False, False, None, "UNCONFIRMED",
                                                  f"killed once ({first.test} {first.status}), not again", first.duration_s)  # fmt: skip
    for fp in carried:
        outcomes[fp] = Outcome(fp, True, False, None, "CARRIED", "killed by the run this one reruns", 0.0)
    for fp in carried_alive:
        outcomes[fp] = Outcome(fp, False, False, None, "CARRIED", "equivalent in the run this one reruns", 0.0)
    invalid = [m for m in chosen if outcomes[m.fingerprint].status == "INVALID"]
    chosen = [m for m in chosen if outcomes[m.fingerprint].status != "INVALID"]
    killed = [m for m in chosen if outcomes[m.fingerprint].killed]
    alive = [m for m in chosen if not outcomes[m.fingerprint].killed]
    equivalent = [m for m in alive if m.fingerprint in eq]
    survivors = [m for m in alive if m.fingerprint not in eq]
    chosen_fps = {m.fingerprint for m in chosen}
    every_fps = {m.fingerprint for m in every}
    stale = [{"fingerprint": fp, "why": "killed: not equivalent", **eq[fp]} for fp in eq
             if fp in chosen_fps and outcomes[fp].killed]  # fmt: skip
    # An entry of a module this run did not mutate (--module) is not judged here.
    mutated = {t.short for t in targets}
    stale += [{"fingerprint": fp, "why": "matches no mutant", **eq[fp]} for fp in eq
              if fp not in every_fps and eq[fp].get("id", "").split(":")[0] in mutated]  # fmt: skip
    denominator = len(chosen) - len(equivalent)

    def entry(m: Mutant, with_diff: bool = True) -> dict[str, Any]:
        o = outcomes[m.fingerprint]
        d = m.to_json()
        if with_diff:
            d["diff"] = m.diff(sources[m.module], str(Path(*m.module.split(".")[1:])) + ".py")
        if o.killed:
            d["killed_by"] = {"test": o.test, "status": o.status, "message": o.message[:160]}
        d["duration_s"] = o.duration_s
        return d

    by_op: dict[str, dict[str, int]] = {}
    for m in chosen:
        s = by_op.setdefault(m.operator, {"mutants": 0, "killed": 0})
        s["mutants"] += 1
        s["killed"] += outcomes[m.fingerprint].killed
    by_module: dict[str, dict[str, int]] = {}
    for m in chosen:
        s = by_module.setdefault(m.module, {"mutants": 0, "killed": 0})
        s["mutants"] += 1
        s["killed"] += outcomes[m.fingerprint].killed
    kills_by_test: dict[str, int] = {}
    for m in killed:
        t = outcomes[m.fingerprint].test or outcomes[m.fingerprint].status or "?"
        kills_by_test[t] = kills_by_test.get(t, 0) + 1
    result.update(
        mutants=len(chosen),
        killed=len(killed),
        survivors=[entry(m) for m in survivors],
        equivalent=len(equivalent),
        score=round(len(killed) / denominator, 4) if denominator else None,
        target=TARGET_SCORE,
        invalid=[m.id for m in invalid],
        timeouts=sum(outcomes[m.fingerprint].timed_out for m in chosen),
        crashes=sum(outcomes[m.fingerprint].status == "CRASH" for m in chosen),
        equivalent_mutants=[{**entry(m, with_diff=False), "why": eq[m.fingerprint]["why"]} for m in equivalent],
        stale_equivalents=stale,
        by_operator=by_op,
        by_module=by_module,
        kills_by_test=dict(sorted(kills_by_test.items())),
        carried=len(carried),
        unconfirmed_kills=unconfirmed,
        fingerprints=sorted(m.fingerprint for m in chosen),
        skipped={t.module: dict(t.skip) for t in targets},
        elapsed_s=round(time.monotonic() - t0, 1),
    )
    return result


# -- the command -------------------------------------------------------------------------------------------------


def select_targets(names: Sequence[str] | None) -> tuple[Target, ...]:
    """The targets whose module name contains one of ``names`` (None: every target); a name that
    matches none is an error, not an empty run."""
    if not names:
        return TARGETS
    unknown = [n for n in names if not any(n in t.module for t in TARGETS)]
    if unknown:
        raise ValueError(f"--module {', '.join(unknown)} names no target (targets: {', '.join(t.short for t in TARGETS)})")
    return tuple(t for t in TARGETS if any(n in t.module for n in names))


def cmd_mutation_score(args: Any) -> int:
    """``kvcc conform --mutation-score [--json] [--jobs N] [--limit N] [--seed N] [--profile P ...]
    [--rerun PREV.json] [--module NAME ...]``."""
    from rich.console import Console
    from rich.markup import escape

    params = RunParams(
        profiles=tuple(args.profile) if args.profile else DEFAULT_PROFILES,
        seed=DEFAULT_SEED if args.seed is None else args.seed,
        lease_term_ms=args.lease_term_ms or DEFAULT_LEASE_TERM_MS,
        skew_ms=DEFAULT_SKEW_MS if args.skew_ms is None else args.skew_ms,
    )  # fmt: skip
    # No emoji codes: an id such as "core:100:cond-true:0" holds ":100:", which rich would print
    # as an emoji, and the ids are what one searches the progress for. Mutant text is escaped.
    console = Console(stderr=True, highlight=False, emoji=False)

    def progress(mutant_id: str, i: int, n: int, o: Outcome) -> None:
        mark = "[green]killed[/]" if o.killed else "[bold red]survived[/]"
        console.print(f"{i:4}/{n} {mark} {escape(mutant_id)} {o.duration_s:6.1f}s {escape(o.test or '')} {o.status or ''}")

    try:
        targets = select_targets(getattr(args, "module", None))
    except ValueError as e:
        console.print(f"kvcc conform: error: {e}")
        return 2
    previous = None
    if getattr(args, "rerun", None):
        previous = json.loads(Path(args.rerun).read_text(encoding="utf-8"))
    res = mutation_score(params, jobs=max(1, args.jobs or DEFAULT_JOBS), limit=args.limit, progress=progress,
                         previous=previous, targets=targets, select=not getattr(args, "whole_suite", False))  # fmt: skip
    if args.json:
        print(json.dumps(res, default=str))
    else:
        out = Console(highlight=False, emoji=False)
        for s in res["survivors"]:
            out.print(f"[bold red]SURVIVOR[/] {escape(s['id'])} ({escape(s['function'])}): "
                      f"{escape(repr(s['before']))} -> {escape(repr(s['after']))}")
        for s in res.get("stale_equivalents", []):
            out.print(f"[yellow]STALE EQUIVALENT[/] {s['fingerprint']}: {escape(s['why'])}")
        for s in res.get("unconfirmed_kills", []):
            out.print(f"[yellow]UNCONFIRMED KILL[/] {escape(s['id'])}: {s['test']} {s['status']} once, certified when run again")
        out.print(f"mutants {res['mutants']}  killed {res['killed']}  survivors {len(res['survivors'])}  "
                  f"equivalent {res['equivalent']}  score {res['score']}  (target {TARGET_SCORE}; "
                  f"{res.get('elapsed_s')} s)")  # fmt: skip
        if res.get("error"):
            out.print(f"[bold red]{res['error']}[/]")
    score = res.get("score")
    return 0 if score is not None and score >= TARGET_SCORE and not res.get("stale_equivalents") else 1


def summary_line(mutants: Iterable[Mutant]) -> str:
    counts: dict[str, int] = {}
    for m in mutants:
        counts[m.module] = counts.get(m.module, 0) + 1
    return ", ".join(f"{k.removeprefix('kvcc.')}: {v}" for k, v in counts.items())
