"""An explicit-state model checker: breadth-first over fingerprints.

- States are ``bytes``; the visited set stores only a 64-bit fingerprint per state (Python's
  ``hash`` of the bytes, an integer), which is what keeps memory near 100 bytes per state. The
  chance that two distinct states share a fingerprint is estimated and reported, as TLC does.
- Breadth-first order makes the first violation found a shortest one. To print it, the checker
  explores again up to that depth, this time remembering each state's predecessor, and replays the
  path: the common case (no violation) pays nothing for counterexamples.
- Optional node-symmetry reduction (``ModelConfig.symmetry``): states are fingerprinted in a
  canonical node order. It is sound for the safety properties; progress here is bounded response
  (a safety property too), so it stays sound for those.
- Per-action coverage, deadlock detection (a state with no successor at all), and every
  ``sometimes`` reported reached or not.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from itertools import permutations

from attrs import define, field

from .config import ModelConfig
from .layout import MESSAGE_WIDTH, M_COPIED, M_COPY, M_FREE, M_GRANT_READ, M_GRANT_WRITE, M_RENEW, M_WRITE_BYTES
from .model import Model
from .properties import INVARIANTS, TRANSITION_PROPERTIES, Invariant, TransitionProperty, applicable_sometimes

# Every action label the model can produce; an action never taken is reported as uncovered.
ACTIONS = (
    "tick", "clock_forward", "clock_back",
    "acquire", "renew", "read", "release",
    "begin_write", "abort",
    "grant_read_lease", "refuse_read_lease", "renew_lease", "refuse_renewal", "release_lease",
    "grant_write_lease", "refuse_write_lease", "commit_write", "reject_stale_commit",
    "expire_write_lease", "expire_write_lease_of_crashed",
    "invalidate", "invalidate_namespace", "drop_and_ack", "revoke_acked", "complete_invalidation",
    "evict", "evict_refused",
    "start_transfer", "store_copy", "finish_transfer", "free_drained", "cancel_transfer",
    "trust_read_lease", "trust_renewal", "start_writing",
    "store_bytes", "fence_stale_write", "free_slot", "fence_stale_free",
    "drop", "duplicate", "crash", "restart_node", "restart_directory",
)


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
    violation: Violation | None = None
    deadlocks: int = 0
    collision_probability: float = 0.0
    truncated: bool = False

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
            "properties": self.properties,
            "coverage": self.coverage,
            "uncovered_actions": [a for a in ACTIONS if self.coverage.get(a, 0) == 0],
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
        for perm in permutations(range(cfg.nodes)):
            if list(perm) == list(range(cfg.nodes)):
                continue
            loc_perm = [perm[loc // T] * T + loc % T if model.loc_node[loc] >= 0 else loc for loc in range(cfg.locations)]
            node_map = bytes([0] + [p + 1 for p in perm] + list(range(cfg.nodes + 1, 256)))
            loc_map = bytes([0] + [lp + 1 for lp in loc_perm] + list(range(cfg.locations + 1, 256)))
            # gather[i]: which variable of the original lands at position i of the image.
            gather = list(range(L.fixed))
            for n in range(cfg.nodes):
                m = perm[n]
                for grid in (L.h_id, L.h_loc, L.h_gen, L.h_left, L.p_kind, L.p_id, L.p_left,
                             L.w_stage, L.wr_id, L.wr_gen, L.wr_epoch, L.wr_loc):
                    for k in range(cfg.keys):
                        gather[grid[m][k]] = grid[n][k]
                gather[L.up[m]] = L.up[n]
                gather[L.off[m]] = L.off[n]
                gather[L.req[m]] = L.req[n]
                for k in range(cfg.keys):
                    for grid in (L.r_id, L.r_loc, L.r_left):
                        gather[grid[k][m]] = grid[k][n]
            for loc in range(cfg.locations):
                lp = loc_perm[loc]
                for grid in (L.s_status, L.s_gen, L.s_epoch, L.fence):
                    for k in range(cfg.keys):
                        gather[grid[lp][k]] = grid[loc][k]
            remap: list[tuple[int, bytes]] = []
            for k in range(cfg.keys):
                remap += [(L.owner[k], loc_map), (L.moving[k], loc_map), (L.draining[k], loc_map), (L.writer[k], node_map)]
                for n in range(cfg.nodes):
                    remap.append((L.r_loc[k][n], loc_map))
                    remap.append((L.h_loc[n][k], loc_map))
                    remap.append((L.wr_loc[n][k], loc_map))
            self.perms.append((gather, remap, node_map, loc_map))

    def _image(self, s: bytes, gather, remap, node_map: bytes, loc_map: bytes) -> bytes:
        b = bytearray(s[i] for i in gather)
        for i, vmap in remap:
            b[i] = vmap[b[i]]
        msgs = []
        for j in range(self.fixed, len(s), MESSAGE_WIDTH):
            m = bytearray(s[j : j + MESSAGE_WIDTH])
            kind = m[0]
            if kind in (M_FREE, M_COPY, M_COPIED):
                m[3] = loc_map[m[3]]
                if kind == M_COPY:
                    m[4] = loc_map[m[4]]
            else:
                m[1] = node_map[m[1]]
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
        self.sometimes = applicable_sometimes(model.cfg)
        self.max_states = max_states
        self.progress = progress
        self.symmetry = Symmetry(model) if model.cfg.symmetry else None

    def fingerprint(self, s: bytes) -> int:
        if self.symmetry is not None:
            s = self.symmetry.canonical(s)
        return hash(s)

    def run(self, mutant: str | None = None) -> CheckResult:
        m = self.model
        started = time.perf_counter()
        seen: set[int] = set()
        # Without symmetry the fingerprint is the built-in hash: no Python call per state.
        fingerprint = self.fingerprint if self.symmetry is not None else hash
        invariants = self.invariants
        tprops = self.transition_properties
        state_sometimes = [sm for sm in self.sometimes if sm.reached_state is not None]
        step_sometimes = [sm for sm in self.sometimes if sm.reached_step is not None]
        reached: set[str] = set()
        coverage: Counter[str] = Counter()
        violation: Violation | None = None
        deadlocks = 0
        generated = 0
        truncated = False

        frontier: list[bytes] = []
        for s in m.init_states():
            fp = fingerprint(s)
            if fp not in seen:
                seen.add(fp)
                frontier.append(s)
                for inv in invariants:
                    if not inv.holds(m, s):
                        violation = Violation(inv.name, "invariant", 0)
        depth = 0
        while frontier and violation is None:
            nxt: list[bytes] = []
            for s in frontier:
                steps = m.successors(s)
                if not steps:
                    deadlocks += 1
                    violation = Violation("Deadlock", "deadlock", depth)
                    break
                generated += len(steps)
                for action, params, t in steps:
                    coverage[action] += 1
                    for tp in tprops:
                        if not tp.holds(m, s, action, params, t):
                            violation = Violation(tp.name, "transition", depth + 1)
                            break
                    if violation is not None:
                        break
                    if step_sometimes:
                        hit = [sm for sm in step_sometimes if sm.reached_step(m, s, action, params, t)]
                        if hit:
                            reached.update(sm.name for sm in hit)
                            step_sometimes = [sm for sm in step_sometimes if sm.name not in reached]
                    fp = fingerprint(t)
                    if fp in seen:
                        continue
                    seen.add(fp)
                    nxt.append(t)
                    for inv in invariants:
                        if not inv.holds(m, t):
                            violation = Violation(inv.name, "invariant", depth + 1)
                            break
                    if violation is not None:
                        break
                    if state_sometimes:
                        hit = [sm for sm in state_sometimes if sm.reached_state(m, t)]
                        if hit:
                            reached.update(sm.name for sm in hit)
                            state_sometimes = [sm for sm in state_sometimes if sm.name not in reached]
                if violation is not None:
                    break
                if self.max_states is not None and len(seen) >= self.max_states:
                    truncated = True
                    break
            if truncated:
                break
            frontier = nxt
            if nxt:
                depth += 1
            if self.progress is not None:
                self.progress(depth, len(seen), len(frontier))
        seconds = time.perf_counter() - started

        properties: dict[str, str] = {}
        for prop in invariants + tprops:
            properties[prop.name] = "violated" if violation is not None and violation.property == prop.name else "holds"
        for sm in self.sometimes:
            properties[sm.name] = "reached" if sm.name in reached else "unreached"
        exhausted = violation is None and not truncated
        ok = exhausted and all(properties[sm.name] == "reached" for sm in self.sometimes)
        if violation is not None:
            violation.trace = self.shortest_trace(violation)
        n = len(seen)
        return CheckResult(
            config=m.cfg.name,
            mutant=mutant,
            ok=ok,
            distinct_states=n,
            generated_states=generated,
            depth=depth,
            seconds=seconds,
            properties=properties,
            coverage=dict(sorted(coverage.items())),
            violation=violation,
            deadlocks=deadlocks,
            collision_probability=n * n / 2.0**65,
            truncated=truncated,
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


def check(cfg: ModelConfig, mutant: str | None = None, max_states: int | None = None, progress=None) -> CheckResult:
    """Check one configuration (with one mutant's bugs, if named)."""
    from .mutants import MUTANTS

    bugs: Iterable[str] = ()
    if mutant is not None:
        bugs = MUTANTS[mutant].bugs
    model = Model(cfg, bugs)
    return Checker(model, max_states=max_states, progress=progress).run(mutant=mutant)
