"""An explicit-state model checker: breadth-first over fingerprints.

- States are ``bytes``; the visited set stores only a 64-bit fingerprint per state (Python's
  ``hash`` of the bytes, an integer), which is what keeps memory near 100 bytes per state. The
  chance that two distinct states share a fingerprint is estimated and reported, as TLC does.
- Breadth-first order makes the first violation found a shortest one. To print it, the checker
  explores again up to that depth, this time remembering each state's predecessor, and replays the
  path: the common case (no violation) pays nothing for counterexamples.
- Optional node-symmetry reduction (``ModelConfig.symmetry``): states are fingerprinted, and
  assigned to a worker, in a canonical node order (the least image over the permutations that keep
  every node's role: writer, reader, tenant), so one state per orbit is kept however many workers.
  It needs the permutations to be symmetries of the model's steps (``holders`` does without).
  It is sound for the safety properties; progress here is bounded response (a safety property
  too), so it stays sound for those.
- Per-action coverage, deadlock detection (a state with no successor at all), and every
  ``sometimes`` reported reached or not.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable

from attrs import define, field

from .config import ModelConfig
from .layout import LOCATION_MESSAGES, MESSAGE_WIDTH, M_COPY, M_GRANT_READ, M_GRANT_WRITE, M_RENEW, M_WRITE_BYTES
from .model import SILENT_ACTIONS, Model
from .properties import INVARIANTS, SOMETIMES, TRANSITION_PROPERTIES, Invariant, TransitionProperty, scope_exemptions
from .vocabulary import ACTIONS

# Every label a step can carry: the model's actions (``vocabulary.ACTIONS``: what an implementation logs, and the
# environment's) and the deliveries a receiver ignores, each with its reason (``SILENT_ACTIONS``:
# from outside they look like a loss, in the model they are steps of their own). Coverage is
# counted over all of them.
LABELS = ACTIONS + tuple(sorted(SILENT_ACTIONS - set(ACTIONS)))


def _roles(cfg: ModelConfig) -> tuple[int, int]:
    writers = cfg.nodes if cfg.writers is None else len(cfg.writers)
    readers = cfg.nodes if cfg.readers is None else len(cfg.readers)
    return writers, readers


def actions_outside_scope(cfg: ModelConfig) -> dict[str, str]:
    """The action labels a configuration cannot produce, each with the argument why. Every other
    label must be covered by its search, and a label argued away here that is covered after all
    fails the check: the argument was wrong."""
    why: dict[str, str] = {}

    def outside(labels: str, reason: str) -> None:
        for label in labels.split():
            assert label in LABELS, label
            why.setdefault(label, reason)

    writers, readers = _roles(cfg)
    if readers == 0:
        outside("acquire renew abandon read release grant_read_lease refuse_read_lease renew_lease refuse_renewal "
                "release_lease drop_and_ack revoke_acked evict_refused trust_read_lease trust_renewal "
                "ignore_stale_grant ignore_stale_renewal clock_back",
                "no node takes read leases (a holder's lease is the only timer on a node's clock)")
    if cfg.max_requests < 2:
        outside("renew renew_lease refuse_renewal trust_renewal ignore_stale_renewal",
                "one lease request per node (max_requests 1): a renewal would be the second")
    if not cfg.tiering:
        outside("start_transfer store_copy finish_transfer free_drained cancel_transfer ignore_stale_copied "
                "copy_failed fence_stale_copy", "blocks never move between locations (tiering off)")
    if cfg.max_node_crashes == 0:
        outside("crash restart_node expire_write_lease_of_crashed write_to_down_location free_at_down_location "
                "declare_node_down", "no node crashes, so every location is always up")
    if cfg.max_directory_restarts == 0:
        outside("restart_directory", "the directory never restarts")
    if cfg.max_duplications == 0:
        outside("duplicate", "messages are never duplicated")
    if all(cfg.namespaces.count(ns) < 2 for ns in cfg.namespaces):
        outside("invalidate_namespace", "no namespace has two keys: invalidate(namespace) is invalidate(key)")
    if cfg.writes_to_pool_only and not cfg.tiering:
        outside("write_to_down_location free_at_down_location",
                "every block is written to the shared pool and never moves, and no crash takes the pool down")
    if cfg.max_epoch < 2 and not cfg.tiering:
        outside("fence_stale_free", "one epoch per key and no transfers: every Free carries the epoch its slot holds")
    if cfg.directory_clock_lags:
        outside("clock_forward", "the directory's clock falls behind instead of running ahead")
    return why


@define
class Violation:
    property: str
    kind: str  # "invariant", "transition" or "deadlock"
    depth: int
    trace: list[dict] = field(factory=list)  # filled in by ``shortest_trace``


@define
class CheckResult:
    config: str
    mutant: str | None
    ok: bool
    distinct_states: int
    generated_states: int
    depth: int
    seconds: float
    properties: dict[str, str]  # name -> "holds" / "violated" / "reached" / "unreached"
    coverage: dict[str, int]
    # ``sometimes`` and action labels argued out of scope (name -> why), and those of them the
    # search reached or covered all the same: a refuted argument fails the check.
    exempt_sometimes: dict[str, str] = field(factory=dict)
    exempt_actions: dict[str, str] = field(factory=dict)
    refuted: list[str] = field(factory=list)
    violation: Violation | None = None
    deadlocks: int = 0
    collision_probability: float = 0.0
    truncated: bool = False
    workers: int = 1
    visited_bytes: int = 0
    peak_rss_bytes: int = 0  # summed over workers; each worker's includes the parent's pages

    @property
    def uncovered_actions(self) -> list[str]:
        """Labels neither covered nor argued out of this configuration's scope."""
        return [a for a in LABELS if self.coverage.get(a, 0) == 0 and a not in self.exempt_actions]

    @property
    def states_per_second(self) -> float:
        return self.distinct_states / self.seconds if self.seconds > 0 else float("inf")

    def to_json(self) -> dict:
        return {
            "ok": self.ok,
            "config": self.config,
            "mutant": self.mutant,
            "distinct_states": self.distinct_states,
            "generated_states": self.generated_states,
            "depth": self.depth,
            "seconds": round(self.seconds, 3),
            "states_per_second": round(self.states_per_second, 1),
            "collision_probability": self.collision_probability,
            "deadlocks": self.deadlocks,
            "truncated": self.truncated,
            "workers": self.workers,
            "visited_bytes_per_state": round(self.visited_bytes / self.distinct_states, 1) if self.distinct_states else 0,
            "properties": self.properties,
            "coverage": self.coverage,
            "uncovered_actions": self.uncovered_actions,
            "exempt_sometimes": self.exempt_sometimes,
            "exempt_actions": self.exempt_actions,
            "refuted_exemptions": self.refuted,
            "unknown_actions": sorted(set(self.coverage) - set(LABELS)),
            "violation": None
            if self.violation is None
            else {
                "property": self.violation.property,
                "kind": self.violation.kind,
                "depth": self.violation.depth,
                "steps": len(self.violation.trace) - 1 if self.violation.trace else 0,
                "trace": self.violation.trace,
            },
        }


class Symmetry:
    """Canonical node order: the smallest of the state's images under every node permutation."""

    def __init__(self, model: Model) -> None:
        cfg, L = model.cfg, model.L
        self.fixed = L.fixed
        self.perms: list[tuple[list[int], list[tuple[int, bytes]], bytes, bytes]] = []
        T = cfg.tiers_per_node
        # Only permutations that keep every node's role (writer, reader, tenant): swapping a
        # writer with a reader would map a reachable state to one the model cannot reach.
        for perm in cfg.symmetric_permutations():
            if list(perm) == list(range(cfg.nodes)):
                continue
            loc_perm = [perm[loc // T] * T + loc % T if model.loc_node[loc] >= 0 else loc for loc in range(cfg.locations)]
            # Records store a node as node + 1 (0: none); a message stores the node itself.
            node_map = bytes([0] + [p + 1 for p in perm] + list(range(cfg.nodes + 1, 256)))
            msg_node_map = bytes(list(perm) + list(range(cfg.nodes, 256)))
            loc_map = bytes([0] + [lp + 1 for lp in loc_perm] + list(range(cfg.locations + 1, 256)))
            # gather[i]: which variable of the original lands at position i of the image.
            gather = list(range(L.fixed))
            for n in range(cfg.nodes):
                m = perm[n]
                for grid in (L.h_id, L.h_loc, L.h_gen, L.h_left, L.p_kind, L.p_id, L.p_left,
                             L.p_age, L.read_lost, L.write_lost, L.acked,
                             L.w_stage, L.wr_id, L.wr_gen, L.wr_epoch, L.wr_loc):
                    for k in range(cfg.keys):
                        gather[grid[m][k]] = grid[n][k]
                for per_node in (L.up, L.off, L.req, L.detect_left, L.known_down):
                    gather[per_node[m]] = per_node[n]
                for k in range(cfg.keys):
                    for grid in (L.r_id, L.r_loc, L.r_left):
                        gather[grid[k][m]] = grid[k][n]
            for loc in range(cfg.locations):
                lp = loc_perm[loc]
                for grid in (L.s_status, L.s_gen, L.s_epoch, L.fence, L.freed, L.orphan_age, L.to_free):
                    for k in range(cfg.keys):
                        gather[grid[lp][k]] = grid[loc][k]
            remap: list[tuple[int, bytes]] = []
            for k in range(cfg.keys):
                remap += [(L.owner[k], loc_map), (L.moving[k], loc_map), (L.draining[k], loc_map), (L.writer[k], node_map)]
                for n in range(cfg.nodes):
                    remap.append((L.r_loc[k][n], loc_map))
                    remap.append((L.h_loc[n][k], loc_map))
                    remap.append((L.wr_loc[n][k], loc_map))
            self.perms.append((gather, remap, msg_node_map, loc_map))

    def _image(self, s: bytes, gather, remap, msg_node_map: bytes, loc_map: bytes) -> bytes:
        b = bytearray(s[i] for i in gather)
        for i, vmap in remap:
            b[i] = vmap[b[i]]
        msgs = []
        for j in range(self.fixed, len(s), MESSAGE_WIDTH):
            m = bytearray(s[j : j + MESSAGE_WIDTH])
            kind = m[0]
            if kind in LOCATION_MESSAGES:
                m[3] = loc_map[m[3]]
                if kind == M_COPY:
                    m[4] = loc_map[m[4]]
            else:
                m[1] = msg_node_map[m[1]]
                if kind in (M_RENEW, M_GRANT_READ, M_GRANT_WRITE, M_WRITE_BYTES):
                    m[4] = loc_map[m[4]]
            msgs.append(bytes(m))
        msgs.sort()
        return bytes(b) + b"".join(msgs)

    def canonical(self, s: bytes) -> bytes:
        best = s
        for perm in self.perms:
            img = self._image(s, *perm)
            if img < best:
                best = img
        return best


class Checker:
    """Breadth-first exploration of one model, checking every property of ``properties``."""

    def __init__(
        self,
        model: Model,
        invariants: Iterable[Invariant] = INVARIANTS,
        transition_properties: Iterable[TransitionProperty] = TRANSITION_PROPERTIES,
        max_states: int | None = None,
        progress: Callable[[int, int, int], None] | None = None,
    ) -> None:
        self.model = model
        self.invariants = tuple(invariants)
        self.transition_properties = tuple(transition_properties)
        # Every ``sometimes`` is watched, the exempt ones too: reaching one refutes its exemption.
        self.sometimes = SOMETIMES
        self.exempt_sometimes = scope_exemptions(model.cfg)
        self.exempt_actions = actions_outside_scope(model.cfg)
        self.max_states = max_states
        self.progress = progress
        self.symmetry = Symmetry(model) if model.cfg.symmetry else None

    def _read_masks(self):
        """Bit masks of the variable groups each invariant reads (``Invariant.reads``) and each
        state ``sometimes`` reads (``Sometimes.reads``); all groups where none are declared."""
        groups = self.model.L.groups
        bits = {name: 1 << i for i, name in enumerate(groups)}
        messages_bit = 1 << len(groups)
        bits["messages"] = messages_bit
        everything = (messages_bit << 1) - 1
        group_slices = [(bits[name], sl) for name, sl in groups.items()]

        def mask(reads: tuple[str, ...]) -> int:
            m = 0
            for name in reads:
                m |= bits[name]
            return m or everything

        invariants = [(inv, mask(inv.reads)) for inv in self.invariants]
        sometimes = [(sm, mask(sm.reads)) for sm in self.sometimes if sm.reached_state is not None]
        return group_slices, messages_bit, invariants, sometimes

    def fingerprint(self, s: bytes) -> int:
        if self.symmetry is not None:
            s = self.symmetry.canonical(s)
        return hash(s)

    def run(self, mutant: str | None = None, workers: int = 1) -> CheckResult:
        """Explore every reachable state; with ``workers > 1``, in that many forked processes,
        each owning the fingerprints ``fp % workers == worker`` and exchanging the successors
        it finds for the others, one breadth-first level at a time."""
        m = self.model
        started = time.perf_counter()
        if workers > 1:
            outcome = _run_parallel(self, workers)
        else:
            explorer = _Explorer(self)
            frontier = explorer.start()
            depth = 0
            truncated = False
            while frontier and explorer.violation is None:
                nxt, _ = explorer.expand(frontier, depth)
                if explorer.violation is not None:
                    break
                frontier = nxt
                if nxt:
                    depth += 1
                if self.progress is not None:
                    self.progress(depth, len(explorer.seen), len(frontier))
                if self.max_states is not None and len(explorer.seen) >= self.max_states and frontier:
                    truncated = True
                    break
            outcome = _Outcome.of(explorer, depth, truncated)
            outcome.peak_rss_bytes = _maxrss_bytes()
        seconds = time.perf_counter() - started

        violation = outcome.violation
        properties: dict[str, str] = {}
        for prop in self.invariants + self.transition_properties:
            properties[prop.name] = "violated" if violation is not None and violation.property == prop.name else "holds"
        for sm in self.sometimes:
            # An exempt sometimes not reached is listed in ``exempt_sometimes`` (with why), not here.
            if sm.name in outcome.reached:
                properties[sm.name] = "reached"
            elif sm.name not in self.exempt_sometimes:
                properties[sm.name] = "unreached"
        refuted = sorted(name for name in self.exempt_sometimes if name in outcome.reached)
        refuted += sorted(a for a in self.exempt_actions if outcome.coverage.get(a, 0) > 0)
        unknown = set(outcome.coverage) - set(LABELS)
        assert not unknown, f"labels missing from ACTIONS and SILENT_ACTIONS: {sorted(unknown)}"
        exhausted = violation is None and not outcome.truncated
        uncovered = [a for a in LABELS if outcome.coverage.get(a, 0) == 0 and a not in self.exempt_actions]
        ok = exhausted and "unreached" not in properties.values() and not refuted and not uncovered
        if violation is not None:
            violation.trace = self.shortest_trace(violation)
        n = outcome.distinct
        return CheckResult(
            config=m.cfg.name,
            mutant=mutant,
            ok=ok,
            distinct_states=n,
            generated_states=outcome.generated,
            depth=outcome.depth,
            seconds=seconds,
            properties=properties,
            coverage=dict(sorted(outcome.coverage.items())),
            violation=violation,
            deadlocks=outcome.deadlocks,
            collision_probability=n * n / 2.0**65,
            truncated=outcome.truncated,
            workers=workers,
            visited_bytes=outcome.visited_bytes,
            peak_rss_bytes=outcome.peak_rss_bytes,
            exempt_sometimes=dict(self.exempt_sometimes),
            exempt_actions=dict(self.exempt_actions),
            refuted=refuted,
        )

    # ------------------------------------------------------------------ counterexamples

    def _violates(self, violation: Violation, pre: bytes | None, action: str, params: tuple, post: bytes) -> bool:
        m = self.model
        if violation.kind == "invariant":
            prop = next(p for p in self.invariants if p.name == violation.property)
            return not prop.holds(m, post)
        if violation.kind == "transition" and pre is not None:
            prop = next(p for p in self.transition_properties if p.name == violation.property)
            return not prop.holds(m, pre, action, params, post)
        if violation.kind == "deadlock":
            return not m.successors(post)
        return False

    def shortest_trace(self, violation: Violation) -> list[dict]:
        """Explore again, remembering predecessors, until the violation reappears; return the
        path from an initial state as steps of (action, params, changed variables)."""
        m = self.model
        fingerprint = self.fingerprint
        parent: dict[int, tuple[int, bytes, str, tuple] | None] = {}
        frontier: list[bytes] = []
        found: tuple[bytes, str, tuple, bytes | None] | None = None
        for s in m.init_states():
            parent.setdefault(fingerprint(s), None)
            frontier.append(s)
            if self._violates(violation, None, "init", (), s):
                found = (s, "init", (), None)
        depth = 0
        while found is None and frontier and depth < violation.depth:
            nxt = []
            for s in frontier:
                fs = fingerprint(s)
                for action, params, t in m.successors(s):
                    if self._violates(violation, s, action, params, t):
                        found = (t, action, params, s)
                        break
                    ft = fingerprint(t)
                    if ft not in parent:
                        parent[ft] = (fs, s, action, params)
                        nxt.append(t)
                if found is not None:
                    break
            frontier = nxt
            depth += 1
        assert found is not None, "a violation seen once must be found again"
        # Walk back to an initial state, then print forward.
        last, action, params, pre = found
        path: list[tuple[str, tuple, bytes]] = [(action, params, last)]
        cursor = pre
        while cursor is not None:
            link = parent[fingerprint(cursor)]
            if link is None:
                path.append(("init", (), cursor))
                break
            _, prev, act, prm = link
            path.append((act, prm, cursor))
            cursor = prev
        path.reverse()
        L = m.L
        steps = []
        previous: bytes | None = None
        for i, (act, prm, state) in enumerate(path):
            if previous is None:
                changes = {k: ("", v) for k, v in L.variables(state).items()}
                for msg in L.messages(state):
                    changes[f"net: {L.message_text(msg)}"] = ("-", "in flight")
            else:
                changes = L.diff(previous, state)
            steps.append({"step": i, "action": act, "params": list(prm), "changes": {k: list(v) for k, v in changes.items()}})
            previous = state
        return steps


@define
class _Outcome:
    distinct: int
    generated: int
    depth: int
    deadlocks: int
    coverage: Counter
    reached: set
    violation: Violation | None
    truncated: bool
    visited_bytes: int
    peak_rss_bytes: int = 0

    @classmethod
    def of(cls, ex: "_Explorer", depth: int, truncated: bool) -> "_Outcome":
        return cls(len(ex.seen), ex.generated, depth, ex.deadlocks, ex.coverage, ex.reached,
                   ex.violation, truncated, ex.visited_bytes())


class _Explorer:
    """One process's share of the search: the fingerprints it owns (all of them when alone),
    what it has reached and covered, and the expansion of one breadth-first level."""

    def __init__(self, checker: Checker, worker: int = 0, workers: int = 1) -> None:
        self.checker = checker
        self.m = checker.model
        self.worker, self.workers = worker, workers
        # Without symmetry the fingerprint is the built-in hash: no Python call per state.
        self.fingerprint = checker.fingerprint if checker.symmetry is not None else hash
        # The state ``sometimes`` not yet reached, each with the mask of the groups it reads: a
        # new state is asked only where one of them changed from its parent, on which every
        # pending one was false (``Sometimes.reads``; all groups if it declares none).
        self.group_slices, self.messages_bit, self.invariant_masks, self.state_sometimes = checker._read_masks()
        self.everything = (self.messages_bit << 1) - 1
        # action -> the step ``sometimes`` not yet reached that may fire on it
        self.step_sometimes: dict[str, list] = {}
        for sm in checker.sometimes:
            if sm.reached_step is not None:
                for action in sm.on_actions or LABELS:
                    self.step_sometimes.setdefault(action, []).append(sm)
        self.seen: set[int] = set()
        self.reached: set[str] = set()
        self.coverage: Counter[str] = Counter()
        self.violation: Violation | None = None
        self.deadlocks = 0
        self.generated = 0

    @property
    def partition(self) -> tuple[slice, slice]:
        """What decides which worker owns a state: the directory's records and the storage
        slots. Most steps (messages, clocks, holders) leave both alone, so most successors stay
        with the worker that found them and never cross a pipe."""
        groups = self.m.L.groups
        return groups["records"], groups["slots"]

    def owner(self, s: bytes) -> int:
        """The worker that owns ``s``: under symmetry, decided on its canonical form, so that
        every state of one orbit has one owner (else two workers would each keep the orbit)."""
        if self.workers == 1:
            return 0
        if self.checker.symmetry is not None:
            s = self.checker.symmetry.canonical(s)
        a, b = self.partition
        return hash(s[a] + s[b]) % self.workers

    def visited_bytes(self) -> int:
        """Memory held by the visited set: the table plus one integer per fingerprint."""
        sample = next(iter(self.seen), 0)
        return sys.getsizeof(self.seen) + len(self.seen) * sys.getsizeof(sample)

    def start(self) -> list[bytes]:
        frontier = []
        for s in self.m.init_states():
            fp = self.fingerprint(s)
            if self.owner(s) == self.worker:
                self.admit(fp, s, self.everything, -1, frontier)
        return frontier

    def admit(self, fp: int, t: bytes, changed: int, depth: int, nxt: list[bytes]) -> None:
        """A state this process owns was reached: keep it if new, and check it."""
        if fp in self.seen:
            return
        self.seen.add(fp)
        nxt.append(t)
        m = self.m
        # Every invariant held on the parent: re-evaluate only those that read a group that
        # changed (``changed`` is a bit mask of ``Layout.groups`` plus the network).
        for inv, mask in self.invariant_masks:
            if mask & changed and not inv.holds(m, t):
                self.violation = Violation(inv.name, "invariant", depth + 1)
                return
        if self.state_sometimes:
            hit = [sm for sm, mask in self.state_sometimes if mask & changed and sm.reached_state(m, t)]
            if hit:
                self.reached.update(sm.name for sm in hit)
                self.state_sometimes = [(sm, mask) for sm, mask in self.state_sometimes if sm.name not in self.reached]

    def absorb(self, batch: list[tuple[int, bytes]], depth: int, nxt: list[bytes]) -> None:
        """States found by another process for this one, each with its changed-groups mask."""
        fingerprint = self.fingerprint
        for changed, t in batch:
            assert self.owner(t) == self.worker
            self.admit(fingerprint(t), t, changed, depth, nxt)
            if self.violation is not None:
                return

    def expand(self, frontier: list[bytes], depth: int, send=None) -> tuple[list[bytes], list]:
        """Generate every successor of ``frontier``; keep those this process owns, hand the
        others to ``send`` in batches (or return them)."""
        m, checker = self.m, self.checker
        tprops = checker.transition_properties
        watch = m.L.step_watch
        fixed = m.L.fixed
        group_slices, messages_bit = self.group_slices, self.messages_bit
        workers, worker = self.workers, self.worker
        coverage = self.coverage
        step_sometimes = self.step_sometimes
        max_states = checker.max_states
        part_a, part_b = self.partition
        part_hash = hash
        # Under symmetry a state's fingerprint and owner are both its canonical form's.
        canonical = None if checker.symmetry is None else checker.symmetry.canonical
        nxt: list[bytes] = []
        # outboxes[w]: states found for worker w, each with the mask of groups that changed.
        outboxes: list[list[tuple[int, bytes]]] = [[] for _ in range(workers)]
        for s in frontier:
            steps = m.successors(s)
            if not steps:
                self.deadlocks += 1
                self.violation = Violation("Deadlock", "deadlock", depth)
                break
            self.generated += len(steps)
            for action, params, t in steps:
                coverage[action] += 1
                pending = step_sometimes.get(action)
                if pending:
                    for sm in [sm for sm in pending if sm.reached_step(m, s, action, params, t)]:
                        self.reached.add(sm.name)
                        for waiting in step_sometimes.values():
                            if sm in waiting:
                                waiting.remove(sm)
                if t is s:
                    continue  # a self-loop (a read, a refused eviction): nothing changes
                # Step properties read only ``step_watch`` (and ticks): skip them when it is
                # unchanged.
                if action == "tick" or s[watch] != t[watch]:
                    for tp in tprops:
                        if not tp.holds(m, s, action, params, t):
                            self.violation = Violation(tp.name, "transition", depth + 1)
                            break
                    if self.violation is not None:
                        break
                if canonical is not None:
                    c = canonical(t)
                    fp = part_hash(c)
                    owner = worker if workers == 1 else part_hash(c[part_a] + c[part_b]) % workers
                elif workers == 1 or (s[part_a] == t[part_a] and s[part_b] == t[part_b]):
                    fp = part_hash(t)
                    owner = worker  # ``s`` is this worker's, and so is everything like it
                else:
                    fp = part_hash(t)
                    owner = part_hash(t[part_a] + t[part_b]) % workers
                if owner == worker and fp in self.seen:
                    continue
                changed = 0
                for bit, sl in group_slices:
                    if s[sl] != t[sl]:
                        changed |= bit
                if s[fixed:] != t[fixed:]:
                    changed |= messages_bit
                if owner == worker:
                    self.admit(fp, t, changed, depth, nxt)
                    if self.violation is not None:
                        break
                else:
                    box = outboxes[owner]
                    box.append((changed, t))
                    if len(box) >= _BATCH and send is not None:
                        send(owner, box)
                        outboxes[owner] = []
            if self.violation is not None:
                break
            if workers == 1 and max_states is not None and len(self.seen) >= max_states:
                break
        return nxt, outboxes


def _maxrss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# States handed to another worker are sent in batches of this many.
_BATCH = 20_000


def _worker_main(checker: Checker, worker: int, workers: int, peers: dict, control) -> None:
    """One forked worker: expand its frontier level by level, exchanging states with its peers
    through pipes (a thread drains incoming pipes so that two senders never block each other)."""
    import queue
    import signal
    import threading

    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a worker dies of SIGTERM, whatever its parent does

    explorer = _Explorer(checker, worker, workers)
    inbox: queue.Queue = queue.Queue()

    def drain(conn) -> None:
        while True:
            try:
                item = conn.recv()
            except EOFError:
                return
            inbox.put(item)
            if item == "exit":
                return

    for conn in peers.values():
        threading.Thread(target=drain, args=(conn,), daemon=True).start()

    def send(owner: int, batch: list) -> None:
        peers[owner].send(batch)

    frontier = explorer.start()
    depth = 0
    while True:
        nxt, outboxes = explorer.expand(frontier, depth, send)
        for owner, box in enumerate(outboxes):
            if box and owner != worker:
                send(owner, box)
        for conn in peers.values():
            conn.send("end")
        ended = 0
        while ended < len(peers):
            item = inbox.get()
            if item == "end":
                ended += 1
            elif explorer.violation is None:
                explorer.absorb(item, depth, nxt)
        control.send((len(explorer.seen), len(nxt), explorer.violation is not None))
        if control.recv() != "go":
            break
        frontier = nxt
        depth += 1
    control.send(
        {
            "distinct": len(explorer.seen),
            "generated": explorer.generated,
            "deadlocks": explorer.deadlocks,
            "coverage": dict(explorer.coverage),
            "reached": explorer.reached,
            "violation": None if explorer.violation is None else (
                explorer.violation.property, explorer.violation.kind, explorer.violation.depth),
            "visited_bytes": explorer.visited_bytes(),
            "peak_rss_bytes": _maxrss_bytes(),
        }
    )
    for conn in peers.values():
        conn.send("exit")


def _run_parallel(checker: Checker, workers: int) -> _Outcome:
    import multiprocessing

    ctx = multiprocessing.get_context("fork")  # workers inherit the model and the hash secret
    links = {}
    for a in range(workers):
        for b in range(a + 1, workers):
            links[(a, b)], links[(b, a)] = ctx.Pipe()
    controls, procs = [], []
    for w in range(workers):
        mine, theirs = ctx.Pipe()
        peers = {v: links[(w, v)] for v in range(workers) if v != w}
        proc = ctx.Process(target=_worker_main, args=(checker, w, workers, peers, theirs), daemon=True)
        proc.start()
        controls.append(mine)
        procs.append(proc)
    depth = 0
    truncated = False
    try:
        while True:
            reports = [c.recv() for c in controls]
            distinct = sum(r[0] for r in reports)
            frontier = sum(r[1] for r in reports)
            violated = any(r[2] for r in reports)
            if frontier and not violated:
                depth += 1
            if checker.progress is not None:
                checker.progress(depth, distinct, frontier)
            over = checker.max_states is not None and distinct >= checker.max_states and frontier > 0
            truncated = over and not violated
            go = frontier > 0 and not violated and not over
            for c in controls:
                c.send("go" if go else "stop")
            if not go:
                break
        finals = [c.recv() for c in controls]
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    coverage: Counter = Counter()
    reached: set = set()
    violation = None
    for f in finals:
        coverage.update(f["coverage"])
        reached |= f["reached"]
        if f["violation"] is not None and (violation is None or f["violation"][2] < violation.depth):
            violation = Violation(*f["violation"])
    outcome = _Outcome(
        distinct=sum(f["distinct"] for f in finals),
        generated=sum(f["generated"] for f in finals),
        depth=depth,
        deadlocks=sum(f["deadlocks"] for f in finals),
        coverage=coverage,
        reached=reached,
        violation=violation,
        truncated=truncated,
        visited_bytes=sum(f["visited_bytes"] for f in finals),
        peak_rss_bytes=sum(f["peak_rss_bytes"] for f in finals),
    )
    return outcome


# How often a swarm walk takes an unseen successor when there is one.
_SWARM_NOVELTY = 0.9
# The share of action labels each swarm walk leaves out (while anything else is enabled).
_SWARM_LEAVE_OUT = 0.5


def swarm(model: Model, seeds: int, depth: int, max_states: int, first_seed: int = 0) -> CheckResult:
    """Sampled checking for a scope too large to exhaust: ``seeds`` random walks of at most
    ``depth`` steps each (seeded, so a run is reproducible), until ``max_states`` distinct states
    were seen. Every invariant is checked on every state and every step property on every step
    a walk takes; coverage and ``sometimes`` are counted over all successors it looked at. A
    violation found is real (its walk is the counterexample, not necessarily the shortest); a
    clean run proves nothing about the states it did not visit, and says so: ``truncated``."""
    import random

    checker = Checker(model)
    m = model
    started = time.perf_counter()
    seen: set[int] = set()
    coverage: Counter[str] = Counter()
    reached: set[str] = set()
    state_sms = [sm for sm in checker.sometimes if sm.reached_state is not None]
    step_sms = [sm for sm in checker.sometimes if sm.reached_step is not None]
    violation: Violation | None = None
    generated = deepest = deadlocks = 0
    for seed in range(first_seed, first_seed + seeds):
        rng = random.Random(seed)
        # Swarm verification (Groce et al.): each walk leaves out a random part of the actions
        # (a walk that never drops a message or lets time pass gets far down the happy path).
        left_out = {a for a in LABELS if rng.random() < _SWARM_LEAVE_OUT}
        (s,) = m.init_states()
        path: list[tuple[str, tuple, bytes]] = [("init", (), s)]
        for step in range(depth):
            steps = m.successors(s)
            if not steps:
                deadlocks += 1
                violation = Violation("Deadlock", "deadlock", step)
                break
            generated += len(steps)
            for action, params, t in steps:
                coverage[action] += 1
                for sm in step_sms:
                    if sm.name not in reached and (not sm.on_actions or action in sm.on_actions) and sm.reached_step(m, s, action, params, t):
                        reached.add(sm.name)
            # Prefer a successor no walk has seen yet (most of the time): uniform walks keep
            # re-treading the few states near the initial one.
            allowed = [step for step in steps if step[0] not in left_out] or steps
            fresh = [step for step in allowed if step[2] is not s and checker.fingerprint(step[2]) not in seen]
            action, params, t = rng.choice(fresh if fresh and rng.random() < _SWARM_NOVELTY else allowed)
            path.append((action, params, t))
            bad = next((tp.name for tp in checker.transition_properties if not tp.holds(m, s, action, params, t)), None)
            kind = "transition"
            if bad is None:
                bad, kind = next((inv.name for inv in checker.invariants if not inv.holds(m, t)), None), "invariant"
            if bad is not None:
                violation = Violation(bad, kind, step + 1, _walk_trace(m, path))
                break
            seen.add(checker.fingerprint(t))
            reached.update(sm.name for sm in state_sms if sm.name not in reached and sm.reached_state(m, t))
            deepest = max(deepest, step + 1)
            s = t
        if violation is not None or len(seen) >= max_states:
            break
    properties = {p.name: "violated" if violation is not None and violation.property == p.name else "holds"
                  for p in checker.invariants + checker.transition_properties}
    for sm in checker.sometimes:
        if sm.name in reached or sm.name not in checker.exempt_sometimes:
            properties[sm.name] = "reached" if sm.name in reached else "unreached"
    refuted = sorted(n for n in checker.exempt_sometimes if n in reached)
    refuted += sorted(a for a in checker.exempt_actions if coverage.get(a, 0) > 0)
    uncovered = [a for a in LABELS if coverage.get(a, 0) == 0 and a not in checker.exempt_actions]
    ok = violation is None and "unreached" not in properties.values() and not refuted and not uncovered
    return CheckResult(
        config=m.cfg.name, mutant=None, ok=ok, distinct_states=len(seen), generated_states=generated,
        depth=deepest, seconds=time.perf_counter() - started, properties=properties,
        coverage=dict(sorted(coverage.items())), violation=violation, deadlocks=deadlocks,
        collision_probability=len(seen) ** 2 / 2.0**65, truncated=True,
        exempt_sometimes=dict(checker.exempt_sometimes), exempt_actions=dict(checker.exempt_actions), refuted=refuted,
    )


def _walk_trace(m: Model, path: list[tuple[str, tuple, bytes]]) -> list[dict]:
    L = m.L
    steps = []
    previous: bytes | None = None
    for i, (act, prm, state) in enumerate(path):
        changes = {k: ("", v) for k, v in L.variables(state).items()} if previous is None else L.diff(previous, state)
        steps.append({"step": i, "action": act, "params": list(prm), "changes": {k: list(v) for k, v in changes.items()}})
        previous = state
    return steps


def check(
    cfg: ModelConfig, mutant: str | None = None, max_states: int | None = None, progress=None, workers: int = 1
) -> CheckResult:
    """Check one configuration (with one mutant's bugs, if named)."""
    from .mutants import MUTANTS

    bugs: Iterable[str] = ()
    if mutant is not None:
        bugs = MUTANTS[mutant].bugs
    model = Model(cfg, bugs)
    return Checker(model, max_states=max_states, progress=progress).run(mutant=mutant, workers=workers)
