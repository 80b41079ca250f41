"""Benchmark: live fuzzing of a running reference deployment (``kvcc bench fuzz``).

What runs
---------
A real deployment on loopback (``LocalCluster``: a directory process and two cache-node
processes, each on a free port; the engine tenant and the nodes' operator tenant, whose tokens
this process knows; metrics on). A known state is committed first: ``SETUP_BLOCKS`` blocks of one
chain, all but the last through the real client, the last through a raw session whose frames are
kept (the recorded frames that attack 6 replays). Then, for ``--seconds``, seeded rounds attack
the directory's port and each node's data port. Every attack is its own connection (a flood:
many), and every round does each kind ``ATTACKS_PER_KIND`` times against every target at once,
beside a legitimate ``Ping`` per target (the probe: served while under attack), then floods one
target (alone: it fills the server's connection table):

1. **random**: 1 .. 4096 random bytes, half of them behind a length header that frames them
   exactly (so the server decodes them rather than waiting for the rest).
2. **mutated**: frames built with the project's own encoder, then broken: bit flips anywhere in
   the frame; truncations (header kept: the server waits; header rewritten: a short frame); a
   body with a *valid* MAC (``frame_mac``: the tenant's real token) whose message is broken --
   two fields' values swapped, a field out of range (-1, 2**63, an id or digest of the wrong
   length), a field of the wrong type, an unknown kind, a field missing or extra, a CBOR bomb
   (nesting ``BOMB_DEPTH`` deep, a string, array or map declaring 2**63 items, indefinite
   lengths, a tower of tags); envelopes broken (seq 0, seq not an int, a reply to a frame never
   sent, an unknown tenant, one tenant's name under another's MAC, a frame MACed for the other
   direction, no tenant and no MAC at all). Every broken body is first checked here to be
   refused by ``codec.decode``: none is a valid message by accident.
3. **oversized**: a header announcing 2**32-1 bytes; a header announcing the limit plus one,
   its body streamed until the server answers; once per target and run, an authenticated
   message just over a message limit after an authenticated ``Ping`` (a ``Lookup`` of
   ``MAX_LOOKUP_KEYS + 1`` keys at the directory; a ``WriteBytes`` of ``MAX_BLOCK_BYTES + 1``
   bytes at a node); and, after the
   last round, ``BURST_FRAMES`` frames of exactly the limit (4 MiB at the directory, 68 MiB at
   a node) holding garbage, each after an authenticated ``Ping`` (a server reads nothing above
   ``MAX_UNAUTHENTICATED_FRAME_BYTES`` before a frame authenticated), at every target at once.
4. **slow**: a valid ``Ping`` frame a byte every ``SLOW_BYTE_INTERVAL_S`` (it must still be
   answered); a header, then silence; half a valid frame, then silence; random bytes, a byte at
   a time.
5. **flood**: ``FLOOD_CONNECTIONS`` connections (the server's ``MAX_CONNECTIONS_DEFAULT`` and
   more) opened and held idle, unauthenticated, for ``FLOOD_HOLD_S``; then closed, and the time
   until a legitimate client connects and is answered is ``flood_recovery_ms``.
6. **replay**: the recorded frames on a new connection: a whole recorded conversation (its
   opening ``Ping`` is answered, and nothing after it: every later frame was keyed by the old
   connection's session key, so it is refused as ``unauthorized`` and the write -- ``BeginWrite``
   and ``Commit``, ``WriteBytes`` -- changes nothing), a later frame of one alone (refused: no
   session key), its first frame twice (``replayed``).

An attack's outcome is ``typed_error`` (a final ``Error`` came back: its code is counted),
``answered`` (replies that are not a final ``Error``), ``closed`` (the server closed without a
typed error), ``no_answer`` (nothing within ``ANSWER_WAIT_S``: a frame announced and not
finished, which the server waits for until its idle timeout) or ``garbled`` (bytes that are not
a frame the server may send).

Invariants (exit 1 names each one broken)
-----------------------------------------
- no crash: every process still runs, and no log holds a traceback;
- no state change: the directory's durable log (its SQLite tables, read-only), its count of log
  commits and each node's blocks and bytes per tier are what they were before the attacks, and
  the real client reads back exactly the committed blocks (same generation, same bytes);
- memory bounded: each process's ``VmRSS`` grew by at most ``RSS_GROWTH_LIMIT_BYTES``;
- no garbled answer, no ``internal`` error, no broken input answered as if valid, every probe
  answered, no recorded conversation answered past its opening Ping, and every flood recovered
  within ``FLOOD_RECOVERY_DEADLINE_S``.

Exit code: 0 all held, 1 an invariant broke (or the deployment did not start), 2 bad input.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import random
import sqlite3
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from kvcc.reference.client import Refused
from kvcc.reference.cluster import ENGINE_TENANT, NODE_TENANT, ClusterError, LocalCluster
from kvcc.reference.errors import KvccError, PeerViolation
from kvcc.reference.transport import MAX_CONNECTIONS_DEFAULT, Client
from kvcc.reference.wire import (
    MAX_BLOCK_BYTES,
    MAX_CONTROL_FRAME_BYTES,
    MAX_FRAME_BYTES,
    MAX_LOOKUP_KEYS,
    MAX_UNAUTHENTICATED_FRAME_BYTES,
    SESSION_NONCE_BYTES,
    BeginWrite,
    Commit,
    Committed,
    Evict,
    FrameDecoder,
    Invalidate,
    ListNodes,
    Lookup,
    Ping,
    Pong,
    ReadBytes,
    Release,
    Session,
    WaitTicket,
    WriteBytes,
    decode,
    encode,
    encode_envelope,
    encode_frame,
    frame_mac,
    session_key,
)
from kvcc.spec.keys import BlockKey, Namespace, cbor_decode, cbor_encode, chain_keys

DEFAULT_SECONDS = 10
DEFAULT_SEED = 1
NODES = 2
SETUP_BLOCKS = 4
BLOCK_TOKENS = 4
BLOCK_BYTES = 4096
TIERS = ("dram=1MiB", "nvme=4MiB")
LEASE_TERM_MS, SKEW_MS = 1000, 50
CLIENT_ID = "fuzz-setup"

KINDS = ("random", "mutated", "oversized", "slow", "flood", "replay")
OUTCOMES = ("typed_error", "answered", "closed", "no_answer", "garbled")
ATTACKS_PER_KIND = 3  # connections of each kind per target per round (the flood aside)
ANSWER_WAIT_S = 0.5  # how long an attack waits for the server's answer
SLOW_BYTE_INTERVAL_S = 0.004
EXPECT_WAIT_S = 3.0  # how long an attack waits for an answer it must get (a loaded machine is slow)
STREAM_CHUNK_BYTES = 256 << 10
BURST_FRAMES = 4  # frames of exactly the limit sent to each target at once, at the end
BURST_WAIT_S = 20.0  # 4 x 68 MiB through a loaded machine's loopback
BOMB_DEPTH = 100_000
FLOOD_CONNECTIONS = MAX_CONNECTIONS_DEFAULT + 16  # past the server's limit: the rest get "busy"
FLOOD_HOLD_S = 0.3
FLOOD_RECOVERY_DEADLINE_S = 5.0
PROBE_TIMEOUT_MS = 5_000
RSS_GROWTH_LIMIT_BYTES = 64 << 20
SETTLE_S = 0.5  # after the attacks, before memory and state are read: closing connections end


class FuzzError(Exception):
    """The deployment could not be set up (not a broken invariant)."""


class Target(NamedTuple):
    """A port under attack: its process's name, its port and the frame limit it enforces."""

    name: str
    port: int
    max_frame_bytes: int


class Credential(NamedTuple):
    tenant: str
    token: bytes


class Conversation(NamedTuple):
    """Frames a legitimate raw session sent on one connection (its opening Ping first) and the
    replies it got."""

    credential: Credential
    frames: tuple[bytes, ...]
    replies: tuple[Any, ...]


class Outcome(NamedTuple):
    outcome: str  # one of OUTCOMES
    code: str | None = None  # the final Error's code
    replies: tuple[Any, ...] = ()


class Block(NamedTuple):
    gen: int
    data: bytes


# ------------------------------------------------------------------------------ the deployment


def _block_data(key: BlockKey) -> bytes:
    """A committed block's bytes: known from its key alone, so a read-back can be checked."""
    seed = hashlib.sha256(b"kvcc-fuzz/" + key.digest).digest()
    return (seed * (BLOCK_BYTES // len(seed)))[: 512 + seed[0]]


class RawConnection:
    """One legitimate connection driven by hand (``Session.client``), keeping every frame it
    sends and every reply: the recordings replayed by attack 6."""

    def __init__(self, credential: Credential, port: int, max_frame_bytes: int) -> None:
        self.credential = credential
        self.port = port
        self.session = Session.client(*credential, max_frame_bytes=max_frame_bytes)
        self.frames: list[bytes] = []
        self.replies: list[Any] = []
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def ask(self, msg: Any) -> Any:
        if self._streams is None:
            self._streams = await asyncio.open_connection("127.0.0.1", self.port)
            await self.ask(Ping(0))  # a connection opens with a Ping, whose Pong keys the session
        reader, writer = self._streams
        frame = self.session.send(msg)
        writer.write(frame)
        await writer.drain()
        self.frames.append(frame)
        while True:
            data = await asyncio.wait_for(reader.read(1 << 20), PROBE_TIMEOUT_MS / 1000)
            if not data:
                raise FuzzError(f"port {self.port} closed a legitimate connection")
            for r in self.session.receive_data(data):
                self.replies.append(r.msg)
                return r.msg

    def recording(self) -> Conversation:
        return Conversation(self.credential, tuple(self.frames), tuple(self.replies))

    async def close(self) -> None:
        if self._streams is not None:
            self._streams[1].close()
            with contextlib.suppress(OSError):
                await self._streams[1].wait_closed()


class Deployment:
    """A directory and ``NODES`` cache nodes, each its own process on loopback, with a known
    committed state and recorded legitimate conversations; a context manager that stops every
    process however it is left."""

    def __init__(self, workdir: Path) -> None:
        self.namespace = Namespace("kvcc-fuzz", "rev1", "bfloat16", BLOCK_TOKENS)
        self.keys = chain_keys(self.namespace, list(range(BLOCK_TOKENS * SETUP_BLOCKS)))
        self.cluster = LocalCluster(workdir, nodes=NODES, tiers=TIERS, block_bytes=BLOCK_BYTES,
                                    lease_term_ms=LEASE_TERM_MS, skew_ms=SKEW_MS, namespaces=[self.namespace],
                                    metrics=True)  # fmt: skip
        self.committed: dict[BlockKey, Block] = {}
        self.recordings: dict[str, list[Conversation]] = {}
        self.client: Any = None

    def __enter__(self) -> Deployment:
        try:
            self.cluster.start()
            self.client = self.cluster.client("fuzz-reader", events=False)
            self._commit_known_state()
        except BaseException:
            self.cluster.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.cluster.stop()

    @property
    def credentials(self) -> tuple[Credential, ...]:
        tenants = self.cluster.config["tenants"]
        return tuple(Credential(t, bytes.fromhex(tenants[t]["token"])) for t in (ENGINE_TENANT, NODE_TENANT))

    @property
    def targets(self) -> tuple[Target, ...]:
        procs = self.cluster.procs
        nodes = tuple(Target(n, int(procs[n].info["port"]), MAX_FRAME_BYTES) for n in self.cluster.node_ids)
        return (Target("directory", self.cluster.directory_address[1], MAX_CONTROL_FRAME_BYTES), *nodes)

    def pids(self) -> dict[str, int]:
        return {name: int(p.info["pid"]) for name, p in self.cluster.procs.items()}

    def _commit_known_state(self) -> None:
        for i, key in enumerate(self.keys[:-1]):
            parent = self.keys[i - 1] if i else None
            out = self.client.put(self.namespace, key, parent, _block_data(key))
            if isinstance(out, Refused):
                raise FuzzError(f"committing the known state failed: {out!r}")
            self.committed[key] = Block(out.gen, _block_data(key))
        asyncio.run(self._record())

    async def _record(self) -> None:
        """The last block through raw sessions (BeginWrite and Commit at the directory,
        WriteBytes at the node it was placed on), a read-only conversation with the directory
        and a read at each node: what the replay attack sends again."""
        engine = self.credentials[0]
        ports = {t.name: t for t in self.targets}
        key, parent = self.keys[-1], self.keys[-2]
        data = _block_data(key)
        writes = RawConnection(engine, ports["directory"].port, MAX_CONTROL_FRAME_BYTES)
        granted = await writes.ask(BeginWrite(CLIENT_ID, key, self.namespace.digest(), parent, 1))
        node = granted.location.split("/", 1)[0]
        stores = RawConnection(engine, ports[node].port, MAX_FRAME_BYTES)
        await stores.ask(WriteBytes(CLIENT_ID, key, granted.lease, granted.location, granted.gen, granted.epoch, data,
                                    granted.grant))  # fmt: skip
        committed = await writes.ask(Commit(CLIENT_ID, key, granted.lease, granted.gen, granted.epoch))
        if type(committed) is not Committed:
            raise FuzzError(f"the recorded write was not committed: {committed!r}")
        self.committed[key] = Block(granted.gen, data)
        reads = RawConnection(engine, ports["directory"].port, MAX_CONTROL_FRAME_BYTES)
        await reads.ask(Lookup(self.namespace.digest(), tuple(self.keys)))
        await reads.ask(ListNodes(0))
        self.recordings = {"directory": [reads.recording(), writes.recording()]}
        for name in self.cluster.node_ids:
            fetch = RawConnection(engine, ports[name].port, MAX_FRAME_BYTES)
            grant = self.cluster.read_grant(granted.location, key, granted.gen, lease=granted.lease)
            await fetch.ask(ReadBytes(CLIENT_ID, key, granted.lease, granted.location, granted.gen, grant))
            self.recordings[name] = [fetch.recording()] + ([stores.recording()] if name == node else [])
            await fetch.close()
        for c in (writes, stores, reads):
            await c.close()


# ----------------------------------------------------------------------------------- state


def _store_dump(db_path: Path) -> dict[str, list[tuple]]:
    """Every row of the directory's durable log, read through a read-only connection."""
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        return {t: db.execute(f"SELECT * FROM {t} ORDER BY 1").fetchall() for t in ("records", "tickets", "meta")}
    finally:
        db.close()


STATE_METRICS = ("kvcc_directory_log_commits_total", "kvcc_node_tier_blocks", "kvcc_node_tier_used_bytes")


def _state_metrics(url: str) -> dict[str, float]:
    """The metrics that move when a process's state does (log commits, blocks and bytes per tier)."""
    with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_MS / 1000) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.split("{", 1)[0] in STATE_METRICS:
            out[name] = float(value)
    return out


def _read_back(d: Deployment) -> dict[str, Any]:
    """What the real client reads of the committed chain: the prefix the directory reports,
    and each block's generation and bytes (a lease taken and released per block)."""
    hit = d.client.lookup(d.namespace, d.keys)
    blocks = {}
    for key in d.keys:
        lease = d.client.acquire(d.namespace, key)
        if isinstance(lease, Refused):
            blocks[key.hex] = f"refused: {lease!r}"
            continue
        data = d.client.read(lease)
        d.client.release(lease)
        blocks[key.hex] = Block(lease.gen, data) if type(data) is bytes else f"refused: {data!r}"
    return {"prefix_blocks": hit.blocks, "blocks": blocks}


def snapshot(d: Deployment) -> dict[str, Any]:
    """The deployment's state as the invariants compare it (the durable log and metrics first:
    the read-back takes leases)."""
    cl = d.cluster
    return {
        "directory_log": _store_dump(cl.workdir / "state" / "directory" / "directory.db"),
        "metrics": {name: _state_metrics(cl.metrics_url(name)) for name in cl.procs},
        "read_back": _read_back(d),
    }


def state_differences(d: Deployment, before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What differs between two snapshots, and any committed block not read back as committed."""
    diffs = [f"{part} changed" for part in ("directory_log", "metrics") if before[part] != after[part]]
    expected = {k.hex: b for k, b in d.committed.items()}
    for name, snap in (("before", before), ("after", after)):
        rb = snap["read_back"]
        if rb["prefix_blocks"] != len(d.committed):
            diffs.append(f"{name}: the directory reports {rb['prefix_blocks']} cached blocks of {len(d.committed)}")
        bad = sorted(k[:12] for k, b in rb["blocks"].items() if b != expected[k])
        if bad:
            diffs.append(f"{name}: blocks not read back as committed: {bad}")
    return diffs


def memory(pid: int) -> dict[str, int]:
    """``VmRSS`` (resident now) and ``VmHWM`` (the most ever resident) of ``pid``, in bytes; 0
    once it is gone."""
    out = {"VmRSS": 0, "VmHWM": 0}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in out:
                out[name] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def tracebacks(d: Deployment) -> dict[str, int]:
    """Tracebacks per process log: a handler's bug is logged with one even when it is answered."""
    out = {}
    for name, proc in d.cluster.procs.items():
        text = proc.log_path.read_text(errors="replace") if proc.log_path.exists() else ""
        out[name] = text.count("Traceback (most recent call last)")
    return out


# ------------------------------------------------------------------------------- the wire


def seal(credential: Credential, body: bytes, max_frame_bytes: int, *, seq: int = 1, re: int = 0,
         tenant: str | None = None, direction: str = "c2s", key: bytes | None = None) -> bytes:  # fmt: skip
    """A frame around ``body`` (``tenant``: the name the envelope claims, by default the
    credential's own): a first frame (seq 1) with a fresh nonce and a MAC under the credential's
    token; a later one with a MAC under the session ``key`` (by default the token: refused)."""
    nonce = random.randbytes(SESSION_NONCE_BYTES) if seq == 1 else None
    mac = frame_mac(key if key is not None and seq != 1 else credential.token, direction, credential.tenant, seq, re,
                    body, nonce)  # fmt: skip
    return encode_frame(encode_envelope(tenant or credential.tenant, seq, re, mac, body, nonce), max_frame_bytes)


def _frame(payload: bytes) -> bytes:
    """A length header that frames ``payload`` exactly, whatever the limit."""
    return len(payload).to_bytes(4, "big") + payload


def _first_nonce(chunks: Sequence[bytes]) -> bytes | None:
    """The nonce of the first frame in ``chunks``, if they begin with a whole valid one: the
    server keys its later frames with it, so the reader of its answers must use it too."""
    try:
        frames = FrameDecoder(MAX_FRAME_BYTES).feed(b"".join(chunks[:1]))
        env = cbor_decode(frames[0]) if frames else None
    except (PeerViolation, ValueError, IndexError):
        return None
    nonce = env.get("nonce") if type(env) is dict else None
    return nonce if type(nonce) is bytes and len(nonce) == SESSION_NONCE_BYTES else None


async def _collect(reader: asyncio.StreamReader, credential: Credential, sent: int, expect: int,
                   wait_s: float, decoder: Session | None = None) -> Outcome:  # fmt: skip
    """Read the server's answer: until a final Error, ``expect`` replies, EOF or ``wait_s``.
    ``sent`` frames went out, so replies may name seqs up to it; ``decoder``: the session that
    opened the connection (else a new one)."""
    if decoder is None:
        decoder = Session.client(*credential)
    decoder.last_sent_seq = sent  # the frames were sealed elsewhere; replies name their seqs
    replies: list[Any] = []
    deadline = asyncio.get_running_loop().time() + wait_s
    try:
        while expect == 0 or len(replies) < expect:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                break
            async with asyncio.timeout(left):
                data = await reader.read(1 << 20)
            if not data:
                return Outcome("answered" if replies else "closed", replies=tuple(replies))
            for r in decoder.receive_data(data):
                if r.final:
                    return Outcome("typed_error", r.msg.code, tuple(replies))
                replies.append(r.msg)
    except TimeoutError:
        pass
    except PeerViolation:
        return Outcome("garbled", replies=tuple(replies))
    except OSError:
        return Outcome("answered" if replies else "closed", replies=tuple(replies))
    return Outcome("answered" if replies else "no_answer", replies=tuple(replies))


class _KeepingReader(asyncio.StreamReader):
    """A stream reader that hands out what arrived before the connection was reset, then EOF.
    asyncio's own raises the reset at once and drops its buffer -- with it the final ``Error`` a
    server sent before giving up on a peer still sending (its linger, ``CLOSE_TIMEOUT_MS``): on a
    loaded machine the attacker may read only after that (CI saw "closed" for a refused body)."""

    def set_exception(self, exc: BaseException) -> None:
        self.feed_eof()


async def _open(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """``asyncio.open_connection`` to 127.0.0.1 with a ``_KeepingReader``."""
    loop = asyncio.get_running_loop()
    reader = _KeepingReader()
    protocol = asyncio.StreamReaderProtocol(reader)
    transport, _ = await loop.create_connection(lambda: protocol, "127.0.0.1", port)
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop)


async def exchange(port: int, chunks: Sequence[bytes], credential: Credential, *, sent: int = 1, expect: int = 0,
                   pace_s: float = 0.0, wait_s: float = ANSWER_WAIT_S, keyed: Sequence[bytes] = ()) -> Outcome:  # fmt: skip
    """One attack connection: write ``chunks`` (``pace_s`` apart), stopping early once the
    server answered or closed, and return what came back. With ``keyed`` bodies, the
    connection is opened first as a client opens it (a Ping, the server's Pong, whose nonce
    keys the session), and each body follows sealed under the session key, seq 2 on."""
    reader, writer = await _open(port)
    decoder = Session.client(*credential)
    if keyed:
        writer.write(decoder.send(Ping(0)))
        await writer.drain()
        while not decoder.keyed:
            async with asyncio.timeout(wait_s):
                data = await reader.read(1 << 20)
            if not data:
                writer.transport.abort()
                return Outcome("closed")
            decoder.receive_data(data)
        key = session_key(credential.token, decoder.nonce, decoder.peer_nonce)
        chunks = [seal(credential, body, MAX_FRAME_BYTES, seq=2 + i, key=key) for i, body in enumerate(keyed)]
    else:
        decoder.nonce = _first_nonce(chunks) or decoder.nonce
    answer = asyncio.ensure_future(_collect(reader, credential, sent, expect, wait_s + pace_s * len(chunks), decoder))
    try:
        for chunk in chunks:
            if answer.done():
                break
            writer.write(chunk)
            await writer.drain()
            if pace_s:
                await asyncio.sleep(pace_s)
    except OSError:
        pass  # the server closed on us: its answer, if any, is already in
    try:
        return await answer
    finally:
        writer.transport.abort()


# ------------------------------------------------------------------------------ attack inputs


def _templates(d: Deployment, target: Target, rng: random.Random) -> list[Any]:
    """Valid messages a client may send ``target``, on fresh keys: what the mutations start from."""
    ns = d.namespace.digest()
    fresh = BlockKey(rng.randbytes(32))
    if target.name == "directory":
        return [Lookup(ns, tuple(d.keys[:2])), BeginWrite("fuzz", fresh, ns, None, 1), Release("fuzz", fresh, 1),
                Commit("fuzz", fresh, 1, 0, 1), ListNodes(0), WaitTicket(1, 10), Invalidate(ns, "key", fresh),
                Ping(7)]  # fmt: skip
    location = f"{target.name}/dram"
    return [WriteBytes("fuzz", fresh, 1, location, 0, 1, b"x" * 64), ReadBytes("fuzz", fresh, 1, location, 0),
            Evict("fuzz", fresh, location), Ping(7)]  # fmt: skip


_WRONG_TYPES: tuple[Any, ...] = (0, -5, "text", b"bytes", [1, 2], {"a": 1}, None, True, 2**64 - 1)


def _out_of_range(value: Any, rng: random.Random) -> Any:
    if type(value) is int:
        return rng.choice((-1, 2**63, 2**64 - 1))
    if type(value) is str:
        return rng.choice(("", "x" * 4097, "Not A Code!", "é" * 200))
    if type(value) is bytes:
        return rng.choice((b"", value[:-1], value + b"\x00", b"\x00" * (MAX_BLOCK_BYTES // 1024)))
    if type(value) is list:
        return [b"\x00" * 31] + list(value)
    return 2**63


def _mutate_body(body: dict[str, Any], rng: random.Random) -> bytes:
    """One mutation of a message's wire map, encoded: see the module docstring (2.)."""
    fields = [f for f in body if f != "kind"]
    how = rng.choice(("swap", "range", "type", "kind", "missing", "extra", "bomb"))
    m = dict(body)
    if how == "swap" and len(fields) > 1:
        a, b = rng.sample(fields, 2)
        m[a], m[b] = m[b], m[a]
    elif how == "range" and fields:
        f = rng.choice(fields)
        m[f] = _out_of_range(m[f], rng)
    elif how == "type" and fields:
        m[rng.choice(fields)] = rng.choice(_WRONG_TYPES)
    elif how == "missing" and fields:
        del m[rng.choice(fields)]
    elif how == "extra":
        m[rng.choice(("zzz", "kind2", "x" * 64))] = rng.choice(_WRONG_TYPES)
    elif how == "bomb":
        return cbor_bomb(rng)
    else:
        m["kind"] = rng.choice(("Bogus", "", "ping", "Welcome", "Error", "x" * 300, 7))
    return cbor_encode(m)


def cbor_bomb(rng: random.Random) -> bytes:
    """CBOR built to exhaust a careless decoder: deep nesting, huge declared lengths, indefinite
    lengths, a tower of tags."""
    huge = (2**63).to_bytes(8, "big")
    return rng.choice((
        b"\x81" * BOMB_DEPTH + b"\x00",  # [[[[...0...]]]]
        b"\xa1\x61k" * (BOMB_DEPTH // 3) + b"\x00",  # {"k": {"k": ...}}
        b"\x5b" + huge + b"abc",  # a byte string of 2**63 bytes, 3 present
        b"\x7b" + huge + b"abc",  # text, likewise
        b"\x9b" + huge + b"\x00",  # an array of 2**63 items
        b"\xbb" + huge + b"\x61k\x00",  # a map of 2**63 entries
        b"\x9f" * (BOMB_DEPTH // 10) + b"\xff",  # indefinite arrays
        b"\xc6" * BOMB_DEPTH + b"\x00",  # tags on tags
        b"\xfb" + b"\x7f\xf8" + b"\x00" * 6,  # a NaN
    ))  # fmt: skip


def _broken_body_frame(msg: Any, credential: Credential, target: Target, rng: random.Random) -> bytes:
    """``msg`` mutated until ``codec.decode`` refuses it, under a valid MAC."""
    wire = cbor_decode(encode(msg))
    while True:
        body = _mutate_body(wire, rng)
        try:
            decode(body)
        except PeerViolation:
            return seal(credential, body, target.max_frame_bytes)


def _broken_envelope_frame(msg: Any, credential: Credential, other: Credential, target: Target,
                           rng: random.Random) -> bytes:  # fmt: skip
    """A valid body in an envelope that must be refused."""
    body, limit = encode(msg), target.max_frame_bytes
    mac = frame_mac(credential.token, "c2s", credential.tenant, 1, 0, body)
    return rng.choice((
        lambda: seal(credential, body, limit, seq=0),
        lambda: seal(credential, body, limit, seq=2),  # a gap
        lambda: seal(credential, body, limit, re=5),  # answers a frame never sent
        lambda: seal(credential, body, limit, direction="s2c"),  # reflected
        lambda: seal(other, body, limit, tenant=credential.tenant),  # one name, another's MAC
        lambda: seal(credential, body, limit, tenant="nobody"),
        lambda: _frame(encode_envelope("", 1, 0, b"", body)),  # no tenant, no MAC
        lambda: _frame(cbor_encode({"tenant": credential.tenant, "seq": "1", "re": 0, "mac": mac, "body": body})),
        lambda: _frame(cbor_encode({"tenant": credential.tenant, "seq": 1, "re": 0, "mac": mac, "body": body, "x": 1})),
        lambda: _frame(cbor_encode([credential.tenant, 1, 0, mac, body])),
        lambda: _frame(cbor_bomb(rng)),
    ))()  # fmt: skip


# ----------------------------------------------------------------------------------- attacks


class Attack(NamedTuple):
    """One attack's connection plan (``exchange``'s arguments) and what its answer must be:
    ``expect`` replies at least, a final Error of ``expect_code`` (or of one of ``also_codes``)."""

    chunks: tuple[bytes, ...]
    credential: Credential
    sent: int = 1
    expect: int = 0
    expect_code: str | None = None
    pace_s: float = 0.0
    wait_s: float = ANSWER_WAIT_S
    opened: bool = False  # the first chunk is an authenticated Ping (``_opening``): its Pong is no answer
    keyed: tuple[bytes, ...] = ()  # bodies sent under the session key once opened (``exchange``)
    also_codes: tuple[str, ...] = ()  # other final Errors as clean as ``expect_code``


def random_attack(d: Deployment, target: Target, rng: random.Random) -> Attack:
    data = rng.randbytes(rng.randint(1, 4096))
    return Attack((_frame(data) if rng.random() < 0.5 else data,), d.credentials[0])


def mutated_attack(d: Deployment, target: Target, rng: random.Random) -> Attack:
    credential, other = rng.sample(d.credentials, 2)
    msg = rng.choice(_templates(d, target, rng))
    valid = Session.client(*credential, max_frame_bytes=target.max_frame_bytes).send(msg)
    how = rng.choice(("flip", "cut", "cut_framed", "body", "body", "envelope"))
    if how == "flip":
        frame = bytearray(valid)
        for _ in range(rng.randint(1, 8)):
            frame[rng.randrange(len(frame))] ^= 1 << rng.randrange(8)
        return Attack((bytes(frame),), credential)
    if how == "cut":
        return Attack((valid[: rng.randrange(1, len(valid))],), credential)
    if how == "cut_framed":
        cut = _frame(valid[4 : rng.randrange(5, len(valid))])
        return Attack((cut,), credential, expect_code=_first_frame_code(cut), wait_s=EXPECT_WAIT_S)
    if how == "body":
        broken = _broken_body_frame(msg, credential, target, rng)
        return Attack((broken,), credential, expect_code=_first_frame_code(broken), wait_s=EXPECT_WAIT_S)
    return Attack((_broken_envelope_frame(msg, credential, other, target, rng),), credential)


def oversized_attack(d: Deployment, target: Target, rng: random.Random, big_done: set[str]) -> Attack:
    """See the module docstring (3.); ``big_done``: the targets already sent the message over
    its limit (up to 64 MiB: once per run)."""
    limit, credential = target.max_frame_bytes, d.credentials[0]
    how = rng.choice(("huge_header", "just_over") + (() if target.name in big_done else ("over_message_limit",)))
    if how == "huge_header":
        return Attack(((2**32 - 1).to_bytes(4, "big") + rng.randbytes(16),), credential,
                      expect_code="frame_too_large", wait_s=EXPECT_WAIT_S)  # fmt: skip
    if how == "just_over":
        chunk = bytes(STREAM_CHUNK_BYTES)
        full, rest = divmod(limit + 1, STREAM_CHUNK_BYTES)
        chunks = ((limit + 1).to_bytes(4, "big"), *(chunk,) * full, chunk[:rest])
        return Attack(chunks, credential, expect_code="frame_too_large", wait_s=EXPECT_WAIT_S)
    big_done.add(target.name)
    if target.name == "directory":
        keys = [i.to_bytes(32, "big") for i in range(MAX_LOOKUP_KEYS + 1)]
        body = cbor_encode({"kind": "Lookup", "namespace": d.namespace.digest(), "keys": keys})
    else:
        body = cbor_encode({"kind": "WriteBytes", "node": "fuzz", "key": bytes(32), "lease": 1,
                            "location": f"{target.name}/dram", "gen": 0, "epoch": 1,
                            "data": bytes(MAX_BLOCK_BYTES + 1)})  # fmt: skip
    # After the opening exchange, under the session key: before a frame authenticated, nothing
    # above MAX_UNAUTHENTICATED_FRAME_BYTES is read; after, the body itself is refused.
    # A body this large takes long to send on a loaded machine: a server that drops the sender for
    # its rate first (``idle``: the minimum transfer rate) refused it as cleanly (CI saw it).
    return Attack((), credential, sent=2, expect_code="malformed", wait_s=EXPECT_WAIT_S, opened=True,
                  keyed=(body,), also_codes=("idle",))  # fmt: skip


def _first_frame_code(frame: bytes) -> str:
    """The refusal of a broken ``frame`` sent first on a connection: ``malformed``, unless it is
    larger than a server reads before a frame authenticated (then refused on its header)."""
    return "frame_too_large" if len(frame) - 4 > MAX_UNAUTHENTICATED_FRAME_BYTES else "malformed"


def _opening(credential: Credential, limit: int) -> bytes:
    """An authenticated ``Ping`` as a connection's first frame (seq 1), as clients open."""
    return seal(credential, encode(Ping(0)), limit)


def burst_attack(d: Deployment, target: Target) -> Attack:
    """A frame of exactly the limit holding garbage, after an authenticated ``Ping``: the most a
    server buffers for one frame of an authenticated peer before it can check it (an
    unauthenticated one is refused on the header: ``MAX_UNAUTHENTICATED_FRAME_BYTES``). Sent
    ``BURST_FRAMES`` times at once, last (see ``attack``)."""
    frame = target.max_frame_bytes.to_bytes(4, "big") + bytes(target.max_frame_bytes)
    credential = d.credentials[0]
    return Attack((_opening(credential, target.max_frame_bytes), frame), credential, sent=1, expect_code="malformed",
                  wait_s=BURST_WAIT_S, opened=True)  # fmt: skip


def slow_attack(d: Deployment, target: Target, rng: random.Random) -> Attack:
    credential = rng.choice(d.credentials)
    valid = Session.client(*credential, max_frame_bytes=target.max_frame_bytes).send(Ping(rng.randrange(2**32)))
    how = rng.choice(("trickle_valid", "header_then_silence", "half_then_silence", "trickle_garbage"))
    if how == "trickle_valid":
        return Attack(tuple(valid[i : i + 1] for i in range(len(valid))), credential, expect=1,
                      pace_s=SLOW_BYTE_INTERVAL_S, wait_s=EXPECT_WAIT_S)  # fmt: skip
    if how == "header_then_silence":
        return Attack((rng.randint(1, target.max_frame_bytes).to_bytes(4, "big"),), credential)
    if how == "half_then_silence":
        return Attack((valid[: len(valid) // 2],), credential)
    garbage = rng.randbytes(rng.randint(8, 64))
    return Attack(tuple(garbage[i : i + 1] for i in range(len(garbage))), credential, pace_s=SLOW_BYTE_INTERVAL_S)


def replay_attack(d: Deployment, target: Target, rng: random.Random) -> Attack:
    """A recorded conversation replayed on a new connection: whole (its opening Ping answered,
    then refused as ``unauthorized``: the later frames were keyed by the recorded connection's
    session key), a later frame alone (``unauthorized``: no session key yet), or its first frame
    twice (``replayed``). Before session keys, the whole replay was answered frame by frame: a
    read after its lease had ended returned the block, a replayed write changed state."""
    conv = rng.choice(d.recordings[target.name])
    how = rng.choice(("whole", "later_alone", "first_twice"))
    n = len(conv.frames)
    if how == "whole":
        return Attack(conv.frames, conv.credential, sent=n, expect_code="unauthorized", wait_s=EXPECT_WAIT_S,
                      opened=True)  # fmt: skip
    if how == "later_alone" and n > 1:
        return Attack((conv.frames[-1],), conv.credential, sent=n, expect_code="unauthorized", wait_s=EXPECT_WAIT_S)
    return Attack((conv.frames[0], conv.frames[0]), conv.credential, expect_code="replayed", wait_s=EXPECT_WAIT_S)


# ------------------------------------------------------------------------------- the run


class Tally:
    """Counts per attack kind and target: attacks sent, outcomes, and the final Errors' codes."""

    def __init__(self, targets: Sequence[Target]) -> None:
        self.counts = {k: {t.name: Counter({"sent": 0, **dict.fromkeys(OUTCOMES, 0)}) for t in targets} for k in KINDS}
        self.codes = {k: {t.name: Counter() for t in targets} for k in KINDS}

    def add(self, kind: str, target: str, outcome: Outcome) -> None:
        self.counts[kind][target]["sent"] += 1
        self.counts[kind][target][outcome.outcome] += 1
        if outcome.code is not None:
            self.codes[kind][target][outcome.code] += 1

    def as_dict(self) -> dict[str, Any]:
        return {k: {t: dict(c, codes=dict(self.codes[k][t])) for t, c in per.items()} for k, per in self.counts.items()}


class Run:
    """One fuzzing run's mutable record: the tally, the problems found, probe and flood figures,
    the processes' memory at the start."""

    def __init__(self, d: Deployment, seed: int) -> None:
        self.d = d
        self.rng = random.Random(seed)
        self.tally = Tally(d.targets)
        self.problems: list[str] = []
        self.big_done: set[str] = set()
        self.probes = {"sent": 0, "failed": 0, "max_ms": 0.0}
        self.flood_recovery_ms: dict[str, list[float]] = {t.name: [] for t in d.targets}
        self.served_during_flood = {t.name: {"served": 0, "refused": 0} for t in d.targets}
        self.pids = d.pids()
        self.memory_start = {n: memory(p) for n, p in self.pids.items()}
        self.rounds = 0

    def problem(self, text: str) -> None:
        if text not in self.problems:
            self.problems.append(text)

    def judge(self, kind: str, target: Target, outcome: Outcome, attack: Attack | None = None) -> None:
        """Count one outcome and note what it must not be."""
        self.tally.add(kind, target.name, outcome)
        where = f"{kind} attack on {target.name}"
        if outcome.outcome == "garbled":
            self.problem(f"{where}: the server sent bytes that are not a valid frame")
        if outcome.code == "internal":
            self.problem(f"{where}: answered Error(internal), a bug on the server's side")
        # An attack that opens with an authenticated Ping (``_opening``) gets its Pong; nothing more.
        opened = attack is not None and attack.opened
        answers = outcome.replies[1:] if opened and outcome.replies[:1] == (Pong(0),) else outcome.replies
        if kind in ("random", "mutated", "oversized") and answers:
            self.problem(f"{where}: broken input answered as if valid: {answers[0]!r}"[:300])
        if attack is None:
            return
        if len(outcome.replies) < attack.expect:
            self.problem(f"{where}: {attack.expect} valid frames, {len(outcome.replies)} answered ({outcome.outcome})")
        if attack.expect_code is not None and outcome.code not in (attack.expect_code, *attack.also_codes):
            self.problem(f"{where}: expected Error({attack.expect_code}), got {outcome.outcome} {outcome.code or ''}")


async def _one(run: Run, kind: str, target: Target, attack: Attack) -> None:
    try:
        outcome = await exchange(target.port, attack.chunks, attack.credential, sent=attack.sent,
                                 expect=attack.expect, pace_s=attack.pace_s, wait_s=attack.wait_s,
                                 keyed=attack.keyed)  # fmt: skip
    except OSError as e:
        run.problem(f"{kind} attack on {target.name}: could not connect: {e}")
        outcome = Outcome("closed")
    run.judge(kind, target, outcome, attack)


async def probe(target: Target, credential: Credential) -> float | None:
    """A legitimate Ping on a new connection: its round trip in ms, None if not answered
    within ``PROBE_TIMEOUT_MS``."""
    start = time.perf_counter()
    client = Client("127.0.0.1", target.port, *credential, timeout_ms=PROBE_TIMEOUT_MS,
                    connect_timeout_ms=PROBE_TIMEOUT_MS)
    try:
        await client.ping(timeout_ms=PROBE_TIMEOUT_MS)
    except KvccError:
        return None
    finally:
        await client.close()
    return (time.perf_counter() - start) * 1000


async def _probe_round(run: Run, target: Target) -> None:
    run.probes["sent"] += 1
    ms = await probe(target, run.d.credentials[0])
    if ms is None:
        run.probes["failed"] += 1
        run.problem(f"a legitimate Ping to {target.name} under attack went unanswered for {PROBE_TIMEOUT_MS} ms")
    else:
        run.probes["max_ms"] = max(run.probes["max_ms"], ms)


def _attacks_of_round(run: Run, target: Target) -> list[Awaitable[None]]:
    d, out = run.d, []
    for _ in range(ATTACKS_PER_KIND):
        rng = random.Random(run.rng.getrandbits(64))  # per attack: the bytes do not depend on timing
        out.append(_one(run, "random", target, random_attack(d, target, rng)))
        out.append(_one(run, "mutated", target, mutated_attack(d, target, rng)))
        out.append(_one(run, "oversized", target, oversized_attack(d, target, rng, run.big_done)))
        out.append(_one(run, "slow", target, slow_attack(d, target, rng)))
        out.append(_one(run, "replay", target, replay_attack(d, target, rng)))
    return out


async def flood(run: Run, target: Target) -> None:
    """Open ``FLOOD_CONNECTIONS`` idle connections and hold them (a legitimate client tries
    once meanwhile: counted, not judged -- the table is full by design), close them, then time
    until a legitimate client is served again."""
    credential = run.d.credentials[0]
    conns = []
    for _ in range(FLOOD_CONNECTIONS):
        try:
            conns.append(await asyncio.open_connection("127.0.0.1", target.port))
        except OSError:
            run.tally.add("flood", target.name, Outcome("closed"))
    answers = [asyncio.ensure_future(_collect(r, credential, 1, 0, FLOOD_HOLD_S)) for r, _ in conns]
    during = await probe(target, credential)
    run.served_during_flood[target.name]["served" if during is not None else "refused"] += 1
    for outcome in await asyncio.gather(*answers):
        run.judge("flood", target, outcome)
    for _, w in conns:
        w.transport.abort()
    start = time.perf_counter()
    while await probe(target, credential) is None:
        if time.perf_counter() - start > FLOOD_RECOVERY_DEADLINE_S:
            run.problem(f"after a flood, {target.name} served no legitimate client for {FLOOD_RECOVERY_DEADLINE_S} s")
            return
        await asyncio.sleep(0.01)
    run.flood_recovery_ms[target.name].append((time.perf_counter() - start) * 1000)


async def attack(run: Run, seconds: float) -> None:
    """Rounds until ``seconds`` are spent: every kind against every target at once, beside a
    probe per target, then a flood of the next target in turn. Last, a burst of frames of
    exactly the limit at every target at once: what stays resident after it is what the memory
    invariant reads (a server holds the most then, and nothing runs after it to tidy up)."""
    targets = run.d.targets
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        work: list[Awaitable[None]] = [_probe_round(run, t) for t in targets]
        for t in targets:
            work += _attacks_of_round(run, t)
        await asyncio.gather(*work)
        await flood(run, targets[run.rounds % len(targets)])
        run.rounds += 1
    burst = [_one(run, "oversized", t, burst_attack(run.d, t)) for t in targets for _ in range(BURST_FRAMES)]
    await asyncio.gather(*burst)


def fuzz(d: Deployment, seconds: float, seed: int, on_step: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Attack ``d`` for ``seconds`` and check every invariant; the report (``ok`` and ``problems``
    say whether they held)."""
    step = on_step or (lambda text: None)
    step("reading the state before the attacks")
    before = snapshot(d)
    run = Run(d, seed)
    step(f"attacking {', '.join(t.name for t in d.targets)} for {seconds} s (seed {seed})")
    started = time.perf_counter()
    asyncio.run(attack(run, seconds))
    elapsed = time.perf_counter() - started
    time.sleep(SETTLE_S)
    step("checking processes, memory and state")
    crashed = [name for name in d.cluster.procs if not d.cluster.alive(name)]
    traces = tracebacks(d)
    rss = memory_figures(run)
    growth = {n: r["end"] - r["start"] for n, r in rss.items()}
    # A dead process's state cannot be read: the state is then taken as changed.
    changes = ["not read: a process crashed"] if crashed else state_differences(d, before, snapshot(d))
    problems = list(run.problems)
    problems += [f"{name} is not running" for name in crashed]
    problems += [f"{name}'s log holds {n} traceback(s)" for name, n in traces.items() if n]
    problems += [f"{n}'s RSS grew by {g} bytes, more than {RSS_GROWTH_LIMIT_BYTES}" for n, g in growth.items()
                 if g > RSS_GROWTH_LIMIT_BYTES]  # fmt: skip
    problems += [f"state changed: {c}" for c in changes]
    tally = run.tally.as_dict()
    return {
        "seed": seed, "seconds": seconds, "elapsed_s": round(elapsed, 3), "rounds": run.rounds,
        "targets": {t.name: {"port": t.port, "pid": run.pids[t.name], "max_frame_bytes": t.max_frame_bytes}
                    for t in d.targets},
        "attacks": tally,
        "totals": totals(tally),
        "probes": {**run.probes, "max_ms": round(run.probes["max_ms"], 1)},
        "flood_recovery_ms": {t: round(max(v), 1) if v else None for t, v in run.flood_recovery_ms.items()},
        "floods": {t: len(v) for t, v in run.flood_recovery_ms.items()},
        "served_during_flood": run.served_during_flood,
        "crashes": len(crashed) + sum(1 for n in traces.values() if n),
        "crashed": crashed, "tracebacks": traces,
        "state_changed": bool(changes), "state_changes": changes,
        "rss_bytes": rss, "rss_growth_bytes": growth, "rss_growth_limit_bytes": RSS_GROWTH_LIMIT_BYTES,
        "problems": problems, "ok": not problems,
    }  # fmt: skip


def memory_figures(run: Run) -> dict[str, dict[str, int]]:
    """Per process: resident bytes at the start and now, and how far the high-water mark rose
    (the most the attacks made it hold at once)."""
    out = {}
    for name, pid in run.pids.items():
        start, end = run.memory_start[name], memory(pid)
        out[name] = {"start": start["VmRSS"], "end": end["VmRSS"], "peak_growth": end["VmHWM"] - start["VmHWM"]}
    return out


def totals(tally: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Per attack kind, the counts summed over the targets."""
    out = {}
    for kind, per in tally.items():
        total: Counter[str] = Counter()
        for c in per.values():
            total.update({k: c[k] for k in ("sent", *OUTCOMES)})
        out[kind] = dict(total)
    return out


def run_fuzz(seconds: float, seed: int, on_step: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Start a deployment in a temporary folder, fuzz it, stop every process."""
    step = on_step or (lambda text: None)
    with tempfile.TemporaryDirectory(prefix="kvcc-bench-fuzz-") as tmp:
        step("starting a directory and two nodes on loopback, committing the known state")
        with Deployment(Path(tmp) / "cluster") as d:
            return fuzz(d, seconds, seed, on_step)


# ------------------------------------------------------------------------------- output


def render(console: Any, r: dict[str, Any]) -> None:
    from rich.table import Table

    from kvcc.report import fmt_bytes, fmt_int

    t = Table(title=f"live fuzzing: {r['rounds']} rounds in {r['elapsed_s']} s, seed {r['seed']}")
    for col in ("attack", "target", "sent", *OUTCOMES, "error codes"):
        t.add_column(col, justify="left" if col in ("attack", "target", "error codes") else "right")
    for kind, per in r["attacks"].items():
        for target, c in per.items():
            codes = ", ".join(f"{k} {v}" for k, v in sorted(c["codes"].items(), key=lambda kv: -kv[1]))
            t.add_row(kind, target, fmt_int(c["sent"]), *(fmt_int(c[o]) for o in OUTCOMES), codes)
    console.print(t)
    p = r["probes"]
    console.print(f"probes: {p['sent']} sent, {p['failed']} failed, slowest {p['max_ms']} ms")
    console.print(f"flood recovery (ms, worst): {r['flood_recovery_ms']}; a client during a flood: "
                  f"{r['served_during_flood']}")
    console.print(f"crashes: {r['crashes']}; state changed: {r['state_changed']}")
    for name, g in r["rss_growth_bytes"].items():
        x = r["rss_bytes"][name]
        console.print(f"{name}: RSS {fmt_bytes(x['start'])} -> {fmt_bytes(x['end'])} (growth {fmt_bytes(g)}, bound "
                      f"{fmt_bytes(r['rss_growth_limit_bytes'])}; high-water mark up "
                      f"{fmt_bytes(x['peak_growth'])})")  # fmt: skip
    for p in r["problems"]:
        console.print(f"[bold red]{p}[/]")
    console.print("[bold green]every invariant held[/]" if r["ok"] else "[bold red]an invariant broke[/]")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvcc.console import positive_int

    parser.add_argument("--seconds", type=positive_int, default=DEFAULT_SECONDS, metavar="N",
                        help=f"how long to attack (default {DEFAULT_SECONDS})")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"seed of the attacks (default {DEFAULT_SEED})")
    parser.add_argument("--json", action="store_true", help="print one JSON object and nothing else")  # fmt: skip


def cli(args: argparse.Namespace) -> int:
    from kvcc.console import print_json, stderr_console, stdout_console

    err = stderr_console()
    step = None if args.json else (lambda text: err.print(f"[dim]{text}[/]"))
    try:
        r = run_fuzz(args.seconds, args.seed, on_step=step)
    except (FuzzError, ClusterError, KvccError, OSError) as exc:
        print(f"kvcc bench fuzz: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print_json(r)
    else:
        render(stdout_console(), r)
    return 0 if r["ok"] else 1
