"""Where each variable of the model state lives.

The checker stores millions of states, so a state is a ``bytes`` value: a fixed part with one byte
per variable, followed by the messages in flight, each ``MESSAGE_WIDTH`` bytes, sorted (the network
is a multiset). ``Layout`` names every position, so transitions read as ``s[L.phase[k]]`` and a
counterexample prints as ``record[k1].phase: COMMITTED -> INVALIDATING``.

Encodings: ids, nodes and locations that may be absent are stored plus one, with 0 meaning none
(``NO_LOCATION``, ``NO_NODE``, lease id 0). Generations, epochs and tick counters are stored as they
are. Every value stays below 256; ``ModelConfig`` asserts the bounds that make that true.
"""

from __future__ import annotations

from .config import ModelConfig

# Record phases (docs/protocol.md: ABSENT -> WRITING -> COMMITTED -> INVALIDATING -> ABSENT, generation + 1).
ABSENT, WRITING, COMMITTED, INVALIDATING = range(4)
PHASE_NAMES = ("ABSENT", "WRITING", "COMMITTED", "INVALIDATING")

# What a storage slot (one key at one location) holds.
EMPTY, FULL, LOST = range(3)
SLOT_NAMES = ("EMPTY", "FULL", "LOST")

# A writer's progress on one key.
W_NONE, W_REQUESTED, W_BYTES_SENT = range(3)
WRITER_NAMES = ("NONE", "REQUESTED", "BYTES_SENT")

# A holder's outstanding lease request.
P_NONE, P_ACQUIRE, P_RENEW = range(3)
PENDING_NAMES = ("NONE", "ACQUIRE", "RENEW")

NO_LOCATION = 0  # stored as location + 1
NO_NODE = 0  # stored as node + 1
NO_LEASE = 0  # lease ids start at 1

# Messages: (kind, node, key, four payload fields named per kind in ``MESSAGE_FIELDS``). ``node`` is
# the sender of a request or the addressee of a reply; data-plane messages (free, copy, copied,
# freed) address a location in their first field.
MESSAGE_WIDTH = 7
(
    M_ACQUIRE,  # node -> directory: acquire a read lease, request a        (n, k, req)
    M_RENEW,  # node -> directory: renew lease a at location b, request c (n, k, id, loc+1, req)
    M_GRANT_READ,  # directory -> node: lease a on loc b, gen c, answering request d
    M_RENEWED,  # directory -> node: lease a renewed, answering request d
    M_RELEASE,  # node -> directory: done with lease a                      (n, k, id)
    M_BEGIN_WRITE,  # node -> directory: let me write key k                 (n, k)
    M_GRANT_WRITE,  # directory -> node: write lease a, loc b, gen c, epoch d
    M_WRITE_BYTES,  # writer n -> location b: bytes of gen c under epoch d, lease a
    M_COMMIT,  # node -> directory: commit lease a under epoch d            (n, k, id, -, -, epoch)
    M_REVOKE,  # directory -> node: drop lease a (of gen c) and acknowledge (n, k, id, -, gen)
    M_ACK,  # node -> directory: lease a dropped                            (n, k, id)
    M_FREE,  # directory -> location a: free key k's slot, epoch d
    M_COPY,  # directory -> location a: copy gen c from location b, epoch d
    M_COPIED,  # location a -> directory: copy landed under epoch d
    M_REFUSE,  # directory -> node: request a refused; b = REFUSED_WRITE for a BeginWrite
    M_FREED,  # location a -> directory: key k's slot holds nothing under epoch d any more
) = range(1, 17)
REFUSED_READ, REFUSED_WRITE = 0, 1  # what a LeaseRefused answers (field b): Acquire/Renew, or BeginWrite
MESSAGE_NAMES = {
    M_ACQUIRE: "Acquire",
    M_RENEW: "Renew",
    M_GRANT_READ: "ReadLeaseGranted",
    M_RENEWED: "LeaseRenewed",
    M_RELEASE: "Release",
    M_BEGIN_WRITE: "BeginWrite",
    M_GRANT_WRITE: "WriteLeaseGranted",
    M_WRITE_BYTES: "WriteBytes",
    M_COMMIT: "Commit",
    M_REVOKE: "Revoke",
    M_ACK: "RevokeAcked",
    M_FREE: "Free",
    M_COPY: "Copy",
    M_COPIED: "Copied",
    M_REFUSE: "LeaseRefused",
    M_FREED: "Freed",
}
# Messages that address a location in field ``a`` (the others address a node in field ``node``).
LOCATION_MESSAGES = frozenset((M_FREE, M_COPY, M_COPIED, M_FREED))


# What each kind carries in its four payload fields (positions 3 to 6 of the message), by name
# ("-": unused, always 0). A ``location`` or ``source`` is stored as location + 1; ``what`` is
# REFUSED_READ or REFUSED_WRITE. The constructors below are the only writers of these positions.
MESSAGE_FIELDS = {
    M_ACQUIRE: ("request", "-", "-", "-"),
    M_RENEW: ("lease", "location", "request", "-"),
    M_GRANT_READ: ("lease", "location", "gen", "request"),
    M_RENEWED: ("lease", "-", "-", "request"),
    M_RELEASE: ("lease", "-", "-", "-"),
    M_BEGIN_WRITE: ("-", "-", "-", "-"),
    M_GRANT_WRITE: ("lease", "location", "gen", "epoch"),
    M_WRITE_BYTES: ("lease", "location", "gen", "epoch"),
    M_COMMIT: ("lease", "-", "-", "epoch"),
    M_REVOKE: ("lease", "-", "gen", "-"),
    M_ACK: ("lease", "-", "-", "-"),
    M_FREE: ("location", "-", "-", "epoch"),
    M_COPY: ("location", "source", "gen", "epoch"),
    M_COPIED: ("location", "-", "-", "epoch"),
    M_REFUSE: ("request", "what", "-", "-"),
    M_FREED: ("location", "-", "-", "epoch"),
}
assert set(MESSAGE_FIELDS) == set(MESSAGE_NAMES)


def message(kind: int, node: int = 0, key: int = 0, *fields: int) -> bytes:
    """A message from its kind, node, key and payload fields in ``MESSAGE_FIELDS`` order (the raw
    packer: the model uses the named constructors below)."""
    return bytes((kind, node, key, *fields, *(0,) * (4 - len(fields))))


# One constructor per kind, its parameters named as in ``MESSAGE_FIELDS`` (``loc1``: location + 1).
def acquire_msg(node: int, key: int, request: int) -> bytes:
    return bytes((M_ACQUIRE, node, key, request, 0, 0, 0))


def renew_msg(node: int, key: int, lease: int, loc1: int, request: int) -> bytes:
    return bytes((M_RENEW, node, key, lease, loc1, request, 0))


def grant_read_msg(node: int, key: int, lease: int, loc1: int, gen: int, request: int) -> bytes:
    return bytes((M_GRANT_READ, node, key, lease, loc1, gen, request))


def renewed_msg(node: int, key: int, lease: int, request: int) -> bytes:
    return bytes((M_RENEWED, node, key, lease, 0, 0, request))


def release_msg(node: int, key: int, lease: int) -> bytes:
    return bytes((M_RELEASE, node, key, lease, 0, 0, 0))


def begin_write_msg(node: int, key: int) -> bytes:
    return bytes((M_BEGIN_WRITE, node, key, 0, 0, 0, 0))


def grant_write_msg(node: int, key: int, lease: int, loc1: int, gen: int, epoch: int) -> bytes:
    return bytes((M_GRANT_WRITE, node, key, lease, loc1, gen, epoch))


def write_bytes_msg(node: int, key: int, lease: int, loc1: int, gen: int, epoch: int) -> bytes:
    return bytes((M_WRITE_BYTES, node, key, lease, loc1, gen, epoch))


def commit_msg(node: int, key: int, lease: int, epoch: int) -> bytes:
    return bytes((M_COMMIT, node, key, lease, 0, 0, epoch))


def revoke_msg(node: int, key: int, lease: int, gen: int) -> bytes:
    return bytes((M_REVOKE, node, key, lease, 0, gen, 0))


def ack_msg(node: int, key: int, lease: int) -> bytes:
    return bytes((M_ACK, node, key, lease, 0, 0, 0))


def free_msg(key: int, loc1: int, epoch: int) -> bytes:
    return bytes((M_FREE, 0, key, loc1, 0, 0, epoch))


def copy_msg(key: int, loc1: int, source1: int, gen: int, epoch: int) -> bytes:
    return bytes((M_COPY, 0, key, loc1, source1, gen, epoch))


def copied_msg(key: int, loc1: int, epoch: int) -> bytes:
    return bytes((M_COPIED, 0, key, loc1, 0, 0, epoch))


def refuse_msg(node: int, key: int, request: int, what: int) -> bytes:
    return bytes((M_REFUSE, node, key, request, what, 0, 0))


def freed_msg(key: int, loc1: int, epoch: int) -> bytes:
    return bytes((M_FREED, 0, key, loc1, 0, 0, epoch))


class Layout:
    """Byte positions of every state variable for one configuration."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.names: list[str] = []
        N, K, LOCS = cfg.nodes, cfg.keys, cfg.locations

        def var(name: str) -> int:
            self.names.append(name)
            return len(self.names) - 1

        # Directory: durable per-key records ...
        self.phase = [var(f"record[k{k}].phase") for k in range(K)]
        self.gen = [var(f"record[k{k}].gen") for k in range(K)]
        self.owner = [var(f"record[k{k}].owner") for k in range(K)]
        self.moving = [var(f"record[k{k}].moving_to") for k in range(K)]
        self.draining = [var(f"record[k{k}].draining") for k in range(K)]
        self.writer = [var(f"record[k{k}].writer") for k in range(K)]
        self.w_id = [var(f"record[k{k}].write_lease") for k in range(K)]
        # ... the frees it owes: per location, the epoch of a Free not yet acknowledged (0: none).
        # Durable: a restarted directory still owes them (docs/protocol.md: deletion reaches everywhere).
        self.to_free = [[var(f"record[k{k}].to_free[l{loc}]") for k in range(K)] for loc in range(LOCS)]
        # ... volatile lease timers and read-lease table ...
        self.w_left = [var(f"record[k{k}].write_lease_left") for k in range(K)]
        # ... and its own clock, restart grace and lease-id counter.
        self.dir_off = var("directory.clock_offset")
        self.grace = var("directory.restart_grace_left")
        self.next_id = var("directory.next_lease_id")
        # Its failure detector, per node: time left before a silent node is declared down (runs
        # from the crash, on the directory's clock), and whether it has been.
        self.detect_left = [var(f"directory.detect_down_left[n{n}]") for n in range(N)]
        self.known_down = [var(f"directory.declared_down[n{n}]") for n in range(N)]
        # Ghosts (bounded response, history): they never decide a step, properties read them.
        # True ticks since the key entered its phase, while WRITING or INVALIDATING.
        self.phase_age = [var(f"ghost.phase_age[k{k}]") for k in range(K)]
        self.inval_age = self.phase_age  # the name the proofs and the reference mapping use
        # True ticks a COMMITTED or INVALIDATING key's owner copy has been on a node that is down.
        self.owner_down_age = [var(f"ghost.owner_down_for[k{k}]") for k in range(K)]
        # True ticks a slot held an ended generation's bytes, at an up location, while no Free it
        # would take was on its way and the directory could have sent one.
        self.orphan_age = [[var(f"ghost.orphaned_for[l{loc},k{k}]") for k in range(K)] for loc in range(LOCS)]
        # Nodes.
        self.up = [var(f"node[n{n}].up") for n in range(N)]
        self.off = [var(f"node[n{n}].clock_offset") for n in range(N)]
        self.req = [var(f"node[n{n}].last_request") for n in range(N)]
        # Holder side, per node and key: the trusted lease and the outstanding request.
        self.h_id = [[var(f"holder[n{n},k{k}].lease") for k in range(K)] for n in range(N)]
        self.h_loc = [[var(f"holder[n{n},k{k}].location") for k in range(K)] for n in range(N)]
        self.h_gen = [[var(f"holder[n{n},k{k}].gen") for k in range(K)] for n in range(N)]
        self.h_left = [[var(f"holder[n{n},k{k}].trust_left") for k in range(K)] for n in range(N)]
        self.p_kind = [[var(f"holder[n{n},k{k}].pending") for k in range(K)] for n in range(N)]
        self.p_id = [[var(f"holder[n{n},k{k}].pending_request") for k in range(K)] for n in range(N)]
        self.p_left = [[var(f"holder[n{n},k{k}].pending_budget") for k in range(K)] for n in range(N)]
        # Ghosts per node and key: true ticks the pending request has waited; whether a message
        # of the pending read request's exchange (the request or its answer) or of the write
        # request's was lost; whether the node acknowledged a revocation of the key's current
        # generation.
        self.p_age = [[var(f"ghost.pending_for[n{n},k{k}]") for k in range(K)] for n in range(N)]
        self.read_lost = [[var(f"ghost.read_request_lost[n{n},k{k}]") for k in range(K)] for n in range(N)]
        self.write_lost = [[var(f"ghost.write_request_lost[n{n},k{k}]") for k in range(K)] for n in range(N)]
        self.acked = [[var(f"ghost.acked_generation[n{n},k{k}]") for k in range(K)] for n in range(N)]
        # Writer side, per node and key.
        self.w_stage = [[var(f"writer[n{n},k{k}].stage") for k in range(K)] for n in range(N)]
        self.wr_id = [[var(f"writer[n{n},k{k}].lease") for k in range(K)] for n in range(N)]
        self.wr_gen = [[var(f"writer[n{n},k{k}].gen") for k in range(K)] for n in range(N)]
        self.wr_epoch = [[var(f"writer[n{n},k{k}].epoch") for k in range(K)] for n in range(N)]
        self.wr_loc = [[var(f"writer[n{n},k{k}].location") for k in range(K)] for n in range(N)]
        # The step properties read only what lies between here and the end of the read-lease
        # table (``step_watch``): record epochs, storage slots and the directory's lease table.
        self.epoch = [var(f"record[k{k}].epoch") for k in range(K)]
        # Storage slots, per location and key, with the fence (highest epoch seen there).
        self.s_status = [[var(f"slot[l{loc},k{k}].status") for k in range(K)] for loc in range(LOCS)]
        self.s_gen = [[var(f"slot[l{loc},k{k}].gen") for k in range(K)] for loc in range(LOCS)]
        self.s_epoch = [[var(f"slot[l{loc},k{k}].epoch") for k in range(K)] for loc in range(LOCS)]
        self.fence = [[var(f"slot[l{loc},k{k}].fence") for k in range(K)] for loc in range(LOCS)]
        # The highest epoch freed here: bytes under it or below that land late are refused.
        self.freed = [[var(f"slot[l{loc},k{k}].freed_epoch") for k in range(K)] for loc in range(LOCS)]
        # The directory's read-lease table (volatile: lost when the directory restarts).
        self.r_id = [[var(f"lease[k{k},n{n}].id") for n in range(N)] for k in range(K)]
        self.r_loc = [[var(f"lease[k{k},n{n}].location") for n in range(N)] for k in range(K)]
        self.r_left = [[var(f"lease[k{k},n{n}].left") for n in range(N)] for k in range(K)]
        # Fault budgets (scope bounds).
        self.crashes_left = var("budget.node_crashes")
        self.restarts_left = var("budget.directory_restarts")
        self.dups_left = var("budget.duplications")

        self.fixed = len(self.names)

        # Contiguous blocks, so that a property can skip work with one C-level slice compare.
        def block(grid) -> slice:
            flat = sorted(i for row in grid for i in (row if isinstance(row, list) else [row]))
            assert flat == list(range(flat[0], flat[-1] + 1)), "a block must be contiguous"
            return slice(flat[0], flat[-1] + 1)

        self.epoch_block = block(self.epoch)
        self.fence_block = block(self.fence)
        self.slot_epoch_block = block(self.s_epoch)
        self.lease_id_block = block(self.r_id)
        self.lease_left_block = block(self.r_left)
        self.holder_block = block(self.h_id)
        # Every variable that holds a lease id: the directory's write and read leases, what
        # holders trust, what writers write under.
        self.lease_id_blocks = (block(self.w_id), block(self.r_id), block(self.h_id), block(self.wr_id))
        self.step_watch = slice(self.epoch[0], self.r_left[-1][-1] + 1)
        # Variable groups, each contiguous: an invariant names the groups it reads, and the
        # checker re-evaluates it on a new state only when one of them changed from the parent
        # state (where every invariant already held). "messages" is the network.
        self.groups: dict[str, slice] = {
            "records": slice(self.phase[0], self.w_left[-1] + 1),
            "directory": slice(self.dir_off, self.orphan_age[-1][-1] + 1),
            "nodes": slice(self.up[0], self.req[-1] + 1),
            "holders": slice(self.h_id[0][0], self.acked[-1][-1] + 1),
            "writers": slice(self.w_stage[0][0], self.wr_loc[-1][-1] + 1),
            "epochs": block(self.epoch),
            "slots": slice(self.s_status[0][0], self.freed[-1][-1] + 1),
            "leases": slice(self.r_id[0][0], self.r_left[-1][-1] + 1),
            "budgets": slice(self.crashes_left, self.dups_left + 1),
        }
        covered = sorted(i for sl in self.groups.values() for i in range(sl.start, sl.stop))
        assert covered == list(range(self.fixed)), "the groups partition the fixed part"

        # Counters that run down with one clock, and what to clear when one reaches zero.
        # Each entry: (counter index, indices zeroed on expiry).
        self.directory_timers: list[tuple[int, tuple[int, ...]]] = [(self.grace, ())]
        self.directory_timers += [(self.detect_left[n], ()) for n in range(N)]
        for k in range(K):
            self.directory_timers.append((self.w_left[k], ()))
            for n in range(N):
                self.directory_timers.append((self.r_left[k][n], (self.r_id[k][n], self.r_loc[k][n])))
        self.node_timers: list[list[tuple[int, tuple[int, ...]]]] = []
        for n in range(N):
            timers = []
            for k in range(K):
                timers.append((self.h_left[n][k], (self.h_id[n][k], self.h_loc[n][k], self.h_gen[n][k])))
                # A request whose budget ran out is given up (the holder's timeout); its ghosts go.
                timers.append((self.p_left[n][k], (self.p_kind[n][k], self.p_id[n][k], self.p_age[n][k], self.read_lost[n][k])))
            self.node_timers.append(timers)

    # -- decoding helpers used by reports and tests -------------------------------------------

    def value_text(self, index: int, value: int) -> str:
        name = self.names[index]
        if name.endswith(".phase"):
            return PHASE_NAMES[value]
        if name.endswith(".status"):
            return SLOT_NAMES[value]
        if name.endswith(".stage"):
            return WRITER_NAMES[value]
        if name.endswith(".pending"):
            return PENDING_NAMES[value]
        if name.endswith((".owner", ".moving_to", ".draining", ".location")):
            return "-" if value == NO_LOCATION else f"l{value - 1}"
        if name.endswith(".writer"):
            return "-" if value == NO_NODE else f"n{value - 1}"
        if name.endswith(".up"):
            return "up" if value else "down"
        return str(value)

    def messages(self, state: bytes) -> list[bytes]:
        return [state[i : i + MESSAGE_WIDTH] for i in range(self.fixed, len(state), MESSAGE_WIDTH)]

    @staticmethod
    def message_text(msg: bytes) -> str:
        """``WriteBytes(from=n0, k0, lease=1, to=l0, gen=1, epoch=1)``, ``Free(l1, k0, epoch=2)``:
        the fields of ``MESSAGE_FIELDS`` by name; a data move's locations as ``to=`` and ``from=``."""
        kind, node, key = msg[0], msg[1], msg[2]
        moves = kind in (M_WRITE_BYTES, M_COPY)
        parts = [] if kind in LOCATION_MESSAGES else [f"from=n{node}" if moves else f"n{node}"]
        parts.append(f"k{key}")
        for name, value in zip(MESSAGE_FIELDS[kind], msg[3:]):
            if name == "location" and moves:
                parts.append(f"to=l{value - 1}")
            elif name == "location":  # a location message names its location first
                parts.insert(0 if kind in LOCATION_MESSAGES else len(parts), f"l{value - 1}")
            elif name == "source":
                parts.append(f"from=l{value - 1}")
            elif name == "what":
                parts.append("write" if value == REFUSED_WRITE else "read")
            elif name != "-":
                parts.append(f"{name}={value}")
        return f"{MESSAGE_NAMES[kind]}({', '.join(parts)})"

    def variables(self, state: bytes) -> dict[str, str]:
        """Every fixed variable by name, as text (messages separately)."""
        return {name: self.value_text(i, state[i]) for i, name in enumerate(self.names)}

    def diff(self, before: bytes, after: bytes) -> dict[str, tuple[str, str]]:
        """The variables that differ, as ``name -> (before, after)``, messages included."""
        changed = {
            self.names[i]: (self.value_text(i, before[i]), self.value_text(i, after[i]))
            for i in range(self.fixed)
            if before[i] != after[i]
        }
        old, new = self.messages(before), self.messages(after)
        for m in old:
            if old.count(m) > new.count(m):
                changed[f"net: {self.message_text(m)}"] = ("in flight", "gone")
        for m in new:
            if new.count(m) > old.count(m):
                changed[f"net: {self.message_text(m)}"] = ("-", "in flight")
        return changed
