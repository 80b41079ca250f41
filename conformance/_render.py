"""Spec walks rendered as protocol event logs: traces the spec itself produced.

``events_from_spec_walk(cfg, seed, steps)`` takes a seeded random walk over ``Model.successors``
and writes every step a process would log as one event in the reference format
(``kvcc.reference.events``), with real-looking ids: node and location names, 32-byte block keys
chained under real namespaces, lease ids that are not the spec's, nanosecond timestamps inside
the tick the step happened in, one ``(node, incarnation)`` log per process with contiguous
``seq`` (a restarted node or directory starts a new incarnation). Environment steps are not
logged; they only move time. The trace validator must ACCEPT every such trace: it is the
validator's (and the conformance suite oracle's) self-test.

Refusals the model makes only because a scope bound ran out (no lease id or epoch left) are not
protocol behaviour; the walk never takes them.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from attrs import frozen

from kvcc.spec import rules
from kvcc.spec.config import ModelConfig, get_config
from kvcc.spec.keys import BlockKey, Namespace
from kvcc.spec.layout import FULL, LOST, MESSAGE_WIDTH
from kvcc.spec.model import SILENT_ACTIONS, Model

DIRECTORY = "directory"
POOL = "pool"
FAULTS = "faults"  # the fault injector's log: it records the crashes it causes
_SILENT = SILENT_ACTIONS


@frozen
class RenderedWalk:
    """A spec walk and its trace. ``steps``: every spec step taken, ``(label, params)``;
    ``events``: the logged ones, in the walk's order; ``locations``: location -> host node (None:
    the pool); ``lease_term_ms``/``skew_ms``: the configuration's, at ``tick_ms`` per tick."""

    config: ModelConfig
    steps: tuple[tuple[str, tuple], ...]
    events: tuple[dict, ...]
    locations: dict
    tick_ms: int
    lease_term_ms: int
    skew_ms: int


def _budget_refusal(m: Model, s: bytes, label: str, params: tuple) -> bool:
    """A refusal the rules would not make: only a scope bound of the model said no."""
    L, cfg = m.L, m.cfg
    if label == "refuse_read_lease":
        n, k = params
        return rules.may_grant_read(s[L.phase[k]], m.allowed[n][k], s[L.r_id[k][n]] != 0) is None
    if label == "refuse_write_lease":
        n, k = params
        parent = cfg.parents[k]
        return rules.may_begin_write(s[L.phase[k]], None if parent < 0 else s[L.phase[parent]], m.allowed[n][k]) is None
    return False


def spec_walk(m: Model, seed: int, steps: int, tick_weight: float = 0.3) -> list[tuple[str, tuple, bytes, bytes]]:
    """A seeded random walk of at most ``steps`` steps: ``(label, params, pre, post)``."""
    rng = random.Random(seed)
    s = m.init_states()[0]
    out = []
    for _ in range(steps):
        succ = [st for st in m.successors(s) if not _budget_refusal(m, s, st[0], st[1])]
        if not succ:
            break
        weights = [tick_weight if st[0] == "tick" else (0.3 if st[0] in ("drop", "crash", "restart_directory") else 1.0) for st in succ]
        label, params, post = rng.choices(succ, weights)[0]
        out.append((label, params, s, post))
        s = post
    return out


class _Renderer:
    def __init__(self, m: Model, seed: int, tick_ms: int) -> None:
        self.m, self.L, self.cfg = m, m.L, m.cfg
        rng = random.Random(seed ^ 0x5EED)
        self.rng = rng
        self.tick_ns = tick_ms * 1_000_000
        self.names = [f"node-{chr(97 + n)}{rng.randrange(100)}" for n in range(self.cfg.nodes)]
        self.locs = []
        self.hosts: dict[str, str | None] = {}
        for loc in range(self.cfg.locations):
            host = self.cfg.location_node(loc)
            name = POOL if host < 0 else f"{self.names[host]}/tier{loc % self.cfg.tiers_per_node}"
            self.locs.append(name)
            self.hosts[name] = None if host < 0 else self.names[host]
        spaces = sorted(set(self.cfg.namespaces))
        self.ns = {i: Namespace(f"model-{i}", f"rev{rng.randrange(10)}", "bfloat16", 16, cache_salt=rng.randbytes(4)) for i in spaces}
        keys: list[BlockKey] = []
        for k, parent in enumerate(self.cfg.parents):
            tokens = [rng.randrange(32000) for _ in range(16)]
            keys.append(BlockKey.chain(self.ns[self.cfg.namespaces[k]], keys[parent] if parent >= 0 else None, tokens))
        self.keys = [k.hex for k in keys]
        self.lease_base = rng.randrange(1, 1000)
        self.lease_step = rng.randrange(1, 5)
        self.incarnation: dict[str, int] = {n: 1 for n in [*self.names, DIRECTORY, POOL, FAULTS]}
        self.seq: dict[tuple[str, int], int] = {}
        self.local: dict[str, int] = {n: rng.randrange(10**12) for n in self.incarnation}
        self.last_local: dict[tuple[str, int], int] = {}
        self.wall0 = 1_700_000_000_000_000_000 + rng.randrange(10**12)
        self.T = 0
        self.events: list[dict] = []

    def lease(self, spec_id: int) -> int:
        assert spec_id > 0
        return self.lease_base + spec_id * self.lease_step

    def emit(self, process: str, event: str, key: int | None = None, gen=None, epoch=None, lease=None, result="ok", **extra: Any) -> None:
        inc = self.incarnation[process]
        log = (process, inc)
        seq = self.seq[log] = self.seq.get(log, 0) + 1
        offset = self.rng.randrange(self.tick_ns)  # somewhere inside the current tick
        true_ns = self.T * self.tick_ns + offset
        local = max(self.local[process] + true_ns, self.last_local.get(log, -1) + 1)
        self.last_local[log] = local
        record = {
            "node": process, "incarnation": inc, "seq": seq, "t_local_ns": local,
            "t_wall_ns": self.wall0 + true_ns, "event": event, "key": None if key is None else self.keys[key],
            "gen": gen, "epoch": epoch, "lease": None if lease is None else self.lease(lease), "result": result,
        }  # fmt: skip
        record.update(extra)
        self.events.append(record)

    def delivered(self, pre: bytes, post: bytes) -> bytes:
        L = self.L
        old = [pre[i : i + MESSAGE_WIDTH] for i in range(L.fixed, len(pre), MESSAGE_WIDTH)]
        for i in range(L.fixed, len(post), MESSAGE_WIDTH):
            m = post[i : i + MESSAGE_WIDTH]
            if m in old:
                old.remove(m)
        assert len(old) == 1, old
        return old[0]

    def host(self, loc: int) -> str:
        h = self.hosts[self.locs[loc]]
        return POOL if h is None else h

    def render(self, label: str, p: tuple, s: bytes, s2: bytes) -> None:
        L, N, LOC = self.L, self.names, self.locs
        if label == "tick":
            self.T += 1
            return
        if label in _SILENT:
            return
        if label in ("acquire", "begin_write", "abort", "abandon"):
            self.emit(N[p[0]], label, p[1])
        elif label in ("renew", "release"):
            n, k = p
            self.emit(N[n], label, k, lease=s[L.h_id[n][k]])
        elif label == "read":
            n, k, loc = p
            gen = s[L.h_gen[n][k]]
            ok = s[L.s_status[loc][k]] == FULL and s[L.s_gen[loc][k]] == gen
            self.emit(N[n], "read", k, gen=gen, lease=s[L.h_id[n][k]], result="ok" if ok else ("lost" if s[L.s_status[loc][k]] == LOST else "error"), location=LOC[loc])
        elif label in ("trust_read_lease", "trust_renewal", "drop_and_ack"):
            n, k, lease = p
            extra = {}
            gen = None
            if label == "trust_read_lease":
                extra["location"] = LOC[s2[L.h_loc[n][k]] - 1]
                gen = s2[L.h_gen[n][k]]
            self.emit(N[n], label, k, gen=gen, lease=lease, **extra)
        elif label == "start_writing":
            n, k, lease = p
            self.emit(N[n], label, k, gen=s2[L.wr_gen[n][k]], epoch=s2[L.wr_epoch[n][k]], lease=lease, location=LOC[s2[L.wr_loc[n][k]] - 1])
        elif label == "grant_read_lease":
            n, k, lease = p
            self.emit(DIRECTORY, label, k, gen=s[L.gen[k]], epoch=s[L.epoch[k]], lease=lease, holder=N[n], location=LOC[s2[L.r_loc[k][n]] - 1])
        elif label == "refuse_read_lease":
            n, k = p
            reason = rules.may_grant_read(s[L.phase[k]], self.m.allowed[n][k], s[L.r_id[k][n]] != 0)
            self.emit(DIRECTORY, label, k, gen=s[L.gen[k]], epoch=s[L.epoch[k]], result=reason, holder=N[n])
        elif label in ("renew_lease", "refuse_renewal", "release_lease", "revoke_acked"):
            n, k, lease = p
            self.emit(DIRECTORY, label, k, gen=s[L.gen[k]], epoch=s[L.epoch[k]], lease=lease, holder=N[n], result="ok" if label != "refuse_renewal" else "refused")
        elif label == "grant_write_lease":
            n, k, loc = p
            parent = self.cfg.parents[k]
            self.emit(
                DIRECTORY, label, k, gen=s2[L.gen[k]], epoch=s2[L.epoch[k]], lease=s2[L.w_id[k]], writer=N[n], location=LOC[loc],
                parent=self.keys[parent] if parent >= 0 else None, namespace=self.ns[self.cfg.namespaces[k]].digest().hex(),
            )  # fmt: skip
        elif label == "refuse_write_lease":
            n, k = p
            parent = self.cfg.parents[k]
            reason = rules.may_begin_write(s[L.phase[k]], None if parent < 0 else s[L.phase[parent]], self.m.allowed[n][k])
            self.emit(DIRECTORY, label, k, gen=s[L.gen[k]], epoch=s[L.epoch[k]], result=reason, writer=N[n], parent=self.keys[parent] if parent >= 0 else None)
        elif label in ("commit_write", "reject_stale_commit"):
            n, k, lease = p
            msg = self.delivered(s, s2)
            self.emit(DIRECTORY, label, k, gen=s2[L.gen[k]], epoch=msg[6], lease=lease, writer=N[n], result="ok" if label == "commit_write" else "rejected")
        elif label in ("expire_write_lease", "expire_write_lease_of_crashed"):
            (k,) = p
            self.emit(DIRECTORY, label, k, gen=s[L.gen[k]], epoch=s[L.epoch[k]], lease=s[L.w_id[k]], writer=N[s[L.writer[k]] - 1])
        elif label == "invalidate":
            (k,) = p
            self.emit(DIRECTORY, label, k, gen=s[L.gen[k]], epoch=s[L.epoch[k]])
        elif label == "invalidate_namespace":
            (ns,) = p
            self.emit(DIRECTORY, label, None, namespace=self.ns[ns].digest().hex())
        elif label == "complete_invalidation":
            (k,) = p
            self.emit(DIRECTORY, label, k, gen=s[L.gen[k]], epoch=s[L.epoch[k]])
        elif label in ("evict", "evict_refused", "start_transfer", "finish_transfer"):
            k, loc = p
            self.emit(DIRECTORY, label, k, gen=s[L.gen[k]], epoch=s2[L.epoch[k]], location=LOC[loc], result="ok" if label != "evict_refused" else "leased")
        elif label == "free_drained":
            (k,) = p
            self.emit(DIRECTORY, label, k, gen=s[L.gen[k]], epoch=s[L.epoch[k]], location=LOC[s[L.draining[k]] - 1])
        elif label == "cancel_transfer":
            (k,) = p
            self.emit(DIRECTORY, label, k, gen=s[L.gen[k]], epoch=s[L.epoch[k]])
        elif label in ("retry_free", "free_acked"):
            k, loc = p
            self.emit(DIRECTORY, label, k, epoch=s[L.to_free[loc][k]], location=LOC[loc])
        elif label in ("store_bytes", "fence_stale_write"):
            n, k, loc = p
            msg = self.delivered(s, s2)
            self.emit(self.host(loc), label, k, gen=msg[5], epoch=msg[6], lease=msg[3], writer=N[n], location=LOC[loc], result="ok" if label == "store_bytes" else "fenced")
        elif label == "store_copy":
            k, loc = p
            msg = self.delivered(s, s2)
            self.emit(self.host(loc), label, k, gen=msg[5], epoch=msg[6], location=LOC[loc])
        elif label in ("free_slot", "fence_stale_free"):
            k, loc = p
            msg = self.delivered(s, s2)
            self.emit(self.host(loc), label, k, epoch=msg[6], location=LOC[loc], result="ok" if label == "free_slot" else "fenced")
        elif label == "crash":
            n, lose = p
            self.emit(FAULTS, "crash", crashed=N[n], lose_disk=bool(lose))
        elif label == "restart_node":
            (n,) = p
            lost = [
                LOC[loc] for loc in range(self.cfg.locations)
                if self.cfg.location_node(loc) == n and any(s[L.s_status[loc][k]] == LOST for k in range(self.cfg.keys))
            ]  # fmt: skip
            self.incarnation[N[n]] += 1  # the node's new process, which re-registered
            self.emit(DIRECTORY, label, rejoined=N[n], lost=lost)
        elif label == "declare_node_down":
            (n,) = p
            self.emit(DIRECTORY, label, down=N[n])
        elif label == "restart_directory":
            self.incarnation[DIRECTORY] += 1
            self.emit(DIRECTORY, label)
        else:
            raise AssertionError(f"no rendering for spec action {label!r}")


class ScriptError(ValueError):
    """A scripted step that no successor of the current state matches."""


def scripted_walk(m: Model, script: Sequence[tuple]) -> list[tuple[str, tuple, bytes, bytes]]:
    """Follow ``script``: each entry ``(label, params)`` or ``(label, params, pick)`` takes the
    successor with that label, those params (``None``: any) and, if given, ``pick(pre, post)``
    true. ``("tick", n)`` takes ``n`` ticks."""
    s = m.init_states()[0]
    out = []
    for entry in script:
        label, params = entry[0], entry[1]
        pick = entry[2] if len(entry) > 2 else None
        repeat = params if label == "tick" else 1
        for _ in range(repeat):
            for lab, p, s2 in m.successors(s):
                if lab == label and (label == "tick" or params is None or p == params) and (pick is None or pick(s, s2)):
                    out.append((lab, p, s, s2))
                    s = s2
                    break
            else:
                raise ScriptError(f"step {len(out)}: no successor {label}{params} from this state")
    return out


def render(m: Model, walk: Sequence[tuple[str, tuple, bytes, bytes]], seed: int = 0, tick_ms: int = 100) -> RenderedWalk:
    """Render a walk (``spec_walk`` or ``scripted_walk``) of ``m`` as the processes' logs."""
    r = _Renderer(m, seed, tick_ms)
    for label, p, s, s2 in walk:
        r.render(label, p, s, s2)
    cfg = m.cfg
    return RenderedWalk(
        config=cfg, steps=tuple((lab, p) for lab, p, _, _ in walk), events=tuple(r.events), locations=dict(r.hosts),
        tick_ms=tick_ms, lease_term_ms=cfg.lease_term_ticks * tick_ms, skew_ms=cfg.skew_ticks * tick_ms,
    )  # fmt: skip


def events_from_spec_walk(
    cfg: ModelConfig | str, seed: int, steps: int = 60, *, tick_ms: int = 100, bugs: Sequence[str] = ()
) -> RenderedWalk:
    """Walk ``cfg`` (a configuration or its name) for ``steps`` seeded random steps and render the
    trace every process would have logged. ``bugs``: mutant flags, to produce traces that a
    correct validator must reject."""
    if isinstance(cfg, str):
        cfg = get_config(cfg)
    m = Model(cfg, bugs)
    return render(m, spec_walk(m, seed, steps), seed, tick_ms)
