"""A client of a sharded directory (docs/sharding.md, step 3's client side).

    async with ShardedClient([(addr0, tenant, token), (addr1, tenant, token)], skew_ms=100) as c:
        await c.put(ns, root, None, data)                  # to shard_of(root)
        hit = await c.lookup(ns, chain)                    # to the chain's root's shard
        lease = await c.acquire(ns, chain[3])              # the shard that knows the key
        await c.release(lease)                             # the shard that granted it: lease % N

Theory of operation
-------------------
A sharded directory is N whole directories, shard ``i`` serving ``kvcc serve directory --shard i
--shards N``: each owns the chains whose root ``keys.shard_of`` maps to it, and hands out only the
lease ids congruent to ``i`` modulo N. ``ShardedClient`` holds one ``KvccClient`` per shard (its
own session, holder and connections) and sends each request where its rule is decided:

- a **chain** (``lookup``, ``acquire_chain``, ``put_chain``) is given from its root, so it goes to
  ``shard_of(keys[0])``, unless the client has seen ``keys[0]`` before under a parent (below);
- a **write** goes to its root's shard, or to its parent's (a child is written where its parent is
  committed: the directory refuses it anywhere else);
- a **lease, its renewal, read, release**, and a **write lease's bytes, commit and abort** go to
  the shard that granted it: ``lease % N``, no table needed;
- a **single key** it has not seen (``acquire``, ``acquire_many``, key and prefix ``invalidate``)
  is located (``Locate``, read-only, no lease, no event) at every shard at once; the shard that
  holds a record of it answers, and the client remembers the key's shard (bounded, least
  recently used first out). A record is never dropped (it keeps the key's epoch), so a key
  written anywhere is found. A key no shard holds goes to its own hash's shard, which refuses
  it as the one directory would (a ``Lookup`` of one key would not do: it walks a chain from its
  root, so it finds no child alone);
- an **eviction** goes to the node that holds the copy, which asks the key's shard itself;
- a **namespace invalidation** goes to every shard: the ticket holds every shard's, and ``wait``
  returns once every one completed.

Each shard's rules hold per key and per chain, as the one directory's: nothing here decides
anything a directory decides. The per-shard clients share one identity (``client_id``: each shard
sees one client of that name) and one event log: to the spec and the validator they are one
holder and writer, whose leases are each granted by one shard.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections import OrderedDict, defaultdict
from collections.abc import Sequence
from typing import Any

from attrs import frozen

from kvcc.spec.keys import BlockKey, Namespace, shard_of
from kvcc.spec.vocabulary import REASON_NOT_FOUND, REASON_UNAUTHORIZED, SCOPE_NAMESPACE

from .client import KvccClient, PrefixHit, ReadLease, Refused, SyncClient, Ticket, WriteLease

REMEMBERED_KEYS = 1 << 16  # keys whose shard the client remembers (least recently used first out)


@frozen
class ShardedTicket:
    """An invalidation started at one or more shards: ``(shard, ticket)`` each; ``keys``: the keys
    they voided together."""

    parts: tuple[tuple[int, Ticket], ...]

    @property
    def id(self) -> str:
        """The shards' ticket ids, ``"<shard>:<ticket>"`` each, comma-separated (for people to read)."""
        return ",".join(f"{s}:{int(t)}" for s, t in self.parts)

    @property
    def keys(self) -> int:
        return sum(t.keys for _, t in self.parts)


def _nowhere(key: BlockKey) -> Refused:
    return Refused(REASON_NOT_FOUND, f"no shard holds {key.hex[:16]}")


class _Denied(Exception):
    """The tenant may not use the namespace (every shard's ``Located`` says so): a request there
    is refused by this client, ``unauthorized``, as every shard would refuse it."""


def _denied() -> Refused:
    return Refused(REASON_UNAUTHORIZED, "this tenant may not use the namespace")


def _denied_one(method: Any) -> Any:
    """``method``'s answer, or an ``unauthorized`` refusal when the tenant may not use the namespace."""

    @functools.wraps(method)
    async def call(self: Any, *args: Any) -> Any:
        try:
            return await method(self, *args)
        except _Denied:
            return _denied()

    return call


def _denied_each(method: Any) -> Any:
    """``method``'s answers, or an ``unauthorized`` refusal per item (its second argument) when
    the tenant may not use the namespace."""

    @functools.wraps(method)
    async def call(self: Any, ns: Any, items: Sequence[Any]) -> Any:
        try:
            return await method(self, ns, items)
        except _Denied:
            return [_denied() for _ in items]

    return call


class ShardedClient:
    """``ShardedClient(shards, *, skew_ms, client_id=None, **client_options)``: ``shards[i]`` is
    ``(directory address, tenant, token)`` of shard ``i``; ``client_options`` go to each shard's
    ``KvccClient`` (``events``, ``incarnation``, ``timeout_ms``, ``tls``, ...: one event log for
    all of them). ``await start()`` or ``async with``."""

    def __init__(self, shards: Sequence[tuple[tuple[str, int], str, bytes]], *, skew_ms: int,
                 client_id: str | None = None, remembered: int = REMEMBERED_KEYS, **client_options: Any) -> None:  # fmt: skip
        if not shards:
            raise ValueError("a sharded client needs at least one shard")
        if remembered < 1:
            raise ValueError(f"remembered must be positive, got {remembered}")
        self.n = len(shards)
        self.client_id = client_id or f"c{os.getpid()}-{id(self) & 0xFFFF:x}"
        self.clients = [
            KvccClient(address, tenant, token, skew_ms=skew_ms, client_id=self.client_id, **client_options)
            for address, tenant, token in shards
        ]  # fmt: skip
        self._shard_of: OrderedDict[BlockKey, int] = OrderedDict()
        self._remembered = remembered

    async def start(self) -> ShardedClient:
        """Connect to every shard; a shard that does not answer is connected to again at its first
        request (a client starts while a shard restarts), unless none answers."""
        try:
            started = await asyncio.gather(*(c.start() for c in self.clients), return_exceptions=True)
            failed = [r for r in started if isinstance(r, BaseException)]
            if len(failed) == len(started) or any(not isinstance(r, Exception) for r in failed):
                raise failed[0]
        except BaseException:
            await self.close()
            raise
        return self

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)

    async def __aenter__(self) -> ShardedClient:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ routing

    def root_shard(self, root: BlockKey) -> int:
        """The shard that owns the chain rooted at ``root``."""
        return shard_of(root.digest, self.n)

    def _remember(self, key: BlockKey, shard: int) -> None:
        self._shard_of[key] = shard
        self._shard_of.move_to_end(key)
        while len(self._shard_of) > self._remembered:
            self._shard_of.popitem(last=False)

    def _known(self, key: BlockKey) -> int | None:
        shard = self._shard_of.get(key)
        if shard is not None:
            self._shard_of.move_to_end(key)
        return shard

    def _chain_shard(self, first: BlockKey) -> int:
        """A chain's shard from its first key: remembered, else the key is its root."""
        known = self._known(first)
        return self.root_shard(first) if known is None else known

    async def _per_shard(self, shards: Sequence[int | None], call: Any, out: list[Any] | None = None) -> list[Any]:
        """Item ``i`` sent to shard ``shards[i]`` (``None``: not sent, ``out[i]`` kept): one
        ``call(shard, indices)`` per shard, the shards at once, each answering its items in
        order; the answers back in the items' order."""
        out = [None] * len(shards) if out is None else out
        by_shard: dict[int, list[int]] = defaultdict(list)
        for i, s in enumerate(shards):
            if s is not None:
                by_shard[s].append(i)
        order = list(by_shard)
        answers = await asyncio.gather(*(call(s, by_shard[s]) for s in order))
        for s, results in zip(order, answers):
            for i, result in zip(by_shard[s], results):
                out[i] = result
        return out

    def lease_shard(self, lease: ReadLease | WriteLease) -> int:
        """The shard that granted ``lease``: shard ``i`` hands out only ids congruent to ``i``."""
        return lease.lease % self.n

    async def locate(self, ns: Namespace | bytes, key: BlockKey) -> int | None:
        """The shard holding a record of ``key``: remembered, else the one whose ``Locate``
        finds it (every shard asked at once; in any namespace, so that a request naming the key
        under another one is refused where its record is), else ``None``: no shard holds it.
        ``_Denied``: the tenant may not use ``ns``."""
        known = self._known(key)
        if known is not None:
            return known
        return (await self.locate_all(ns, [key]))[0]

    async def locate_all(self, ns: Namespace | bytes, keys: Sequence[BlockKey], *,
                         partial: bool = False) -> list[int | None]:  # fmt: skip
        """``locate`` of each key: the keys not remembered asked of every shard in one ``Locate``
        each, the shards at once. The shard holding the key's record in ``ns`` wins over one
        holding a record of the same digest in another namespace (another tenant may make one in
        another shard: a digest is the client's to choose); only the former is remembered.
        ``_Denied``: the tenant may not use ``ns``. A shard that does not answer may hold a key
        the others do not: its failure is raised for such a key, unless ``partial`` (a write, which
        then goes where the rule puts a key no shard holds, its root's or its parent's shard)."""
        out: list[int | None] = [self._known(k) for k in keys]
        unknown = list(dict.fromkeys(k for k, s in zip(keys, out) if s is None))
        if unknown:
            answers = await asyncio.gather(*(c.locate(ns, unknown) for c in self.clients), return_exceptions=True)
            failed = [a for a in answers if isinstance(a, BaseException)]
            if len(failed) == len(answers):
                raise failed[0]
            if any(a is None for a in answers):
                raise _Denied  # every shard has the same tenants: no shard would take the request
            best: dict[BlockKey, tuple[int, int]] = {}  # key -> (2: its record in ns, 1: in another; shard)
            for shard, known in enumerate(answers):
                if isinstance(known, BaseException):
                    continue
                for key, level in zip(unknown, known):
                    if level > best.get(key, (0, 0))[0]:
                        best[key] = (level, shard)
            for key, (level, shard) in best.items():
                if level == 2:
                    self._remember(key, shard)
            if failed and not partial and any(best.get(k, (0, 0))[0] < 2 for k in unknown):
                raise failed[0]
            out = [best[k][1] if s is None and k in best else s for k, s in zip(keys, out)]
        return out

    async def _write_shard(self, ns: Namespace | bytes, key: BlockKey, parent: BlockKey | None, *,
                           located: Any = ..., planned: dict[BlockKey, int] | None = None) -> int:  # fmt: skip
        """Where a write of ``key`` under ``parent`` is decided: where the key's record is, if
        any shard holds one (a second parent, another namespace: refused there); else a root's
        own shard, a child's parent's (``planned``: shards of blocks written earlier in the same
        call). A parent no shard holds is taken for a root: its shard refuses the child
        (``parent_not_committed``). Nothing is remembered here: a refused write proves nothing
        about the key's shard (the callers remember a granted one)."""
        shard = await self.locate_all(ns, [key], partial=True) if located is ... else [located]
        if shard[0] is not None:
            return shard[0]
        if parent is None:
            return self.root_shard(key)
        if planned is not None and parent in planned:
            return planned[parent]
        [found] = await self.locate_all(ns, [parent], partial=True)
        return self.root_shard(parent) if found is None else found

    # ------------------------------------------------------------------ lookups and read leases

    async def lookup(self, ns: Namespace | bytes, keys: Sequence[BlockKey]) -> PrefixHit:
        if not keys:
            return await self.clients[0].lookup(ns, keys)
        shard = self._chain_shard(keys[0])
        hit = await self.clients[shard].lookup(ns, keys)
        for key in keys[: hit.blocks]:
            self._remember(key, shard)
        return hit

    async def lookup_many(self, ns: Namespace | bytes, chains: Sequence[Sequence[BlockKey]]) -> list[PrefixHit]:
        """``lookup`` of each chain: one round trip per shard involved, the shards at once."""
        shards = [self._chain_shard(keys[0]) if keys else 0 for keys in chains]
        out = await self._per_shard(shards, lambda s, at: self.clients[s].lookup_many(ns, [chains[i] for i in at]))
        for keys, shard, hit in zip(chains, shards, out):
            for key in keys[: hit.blocks]:
                self._remember(key, shard)
        return out

    def lease_of(self, key: BlockKey) -> ReadLease | None:
        for c in self.clients:
            lease = c.lease_of(key)
            if lease is not None:
                return lease
        return None

    @_denied_one
    async def acquire(self, ns: Namespace | bytes, key: BlockKey) -> ReadLease | Refused:
        """At the shard holding ``key``. A key no shard holds is refused here, ``not_found``,
        sent nowhere: it was ABSENT everywhere when located, and a shard that does not own it
        must take no step of it (each key's steps are its one shard's: the trace validator)."""
        shard = await self.locate(ns, key)
        if shard is None:
            return _nowhere(key)
        return await self.clients[shard].acquire(ns, key)

    @_denied_each
    async def acquire_many(self, ns: Namespace | bytes, keys: Sequence[BlockKey]) -> list[ReadLease | Refused]:
        """``acquire`` of each key, one ``KvccClient.acquire_many`` per shard, the shards at once."""
        keys = list(keys)
        shards = await self.locate_all(ns, keys)
        nowhere = [_nowhere(k) if s is None else None for k, s in zip(keys, shards)]
        return await self._per_shard(shards, lambda s, at: self.clients[s].acquire_many(ns, [keys[i] for i in at]),
                                     nowhere)  # fmt: skip

    async def acquire_chain(self, ns: Namespace | bytes, keys: Sequence[BlockKey]) -> tuple[list[ReadLease], Refused | None]:
        """A chain lives in one shard: its first key's (``KvccClient.acquire_chain`` there; the
        first key may continue a chain below a prefix, so it is located, not taken for a root).
        A first key no shard holds is refused here (``not_found``), sent nowhere."""
        if not keys:
            return [], None
        try:
            shard = await self.locate(ns, keys[0])
        except _Denied:
            return [], _denied()
        if shard is None:
            return [], _nowhere(keys[0])
        leases, why = await self.clients[shard].acquire_chain(ns, keys)
        for lease in leases:
            self._remember(lease.key, shard)
        return leases, why

    async def renew(self, lease: ReadLease) -> ReadLease | Refused:
        return await self.clients[self.lease_shard(lease)].renew(lease)

    async def release(self, lease: ReadLease) -> None:
        await self.clients[self.lease_shard(lease)].release(lease)

    async def release_many(self, leases: Sequence[ReadLease]) -> None:
        by_shard: dict[int, list[ReadLease]] = defaultdict(list)
        for lease in leases:
            by_shard[self.lease_shard(lease)].append(lease)
        await asyncio.gather(*(self.clients[s].release_many(ls) for s, ls in by_shard.items()))

    def trusted(self, lease: ReadLease, now_ns: int | None = None) -> bool:
        return self.clients[self.lease_shard(lease)].trusted(lease, now_ns)

    async def read(self, lease: ReadLease, out: Any = None) -> bytes | int | Refused:
        return await self.clients[self.lease_shard(lease)].read(lease, out)

    async def read_many(self, leases: Sequence[ReadLease], outs: Sequence[Any] | None = None) -> list[bytes | int | Refused]:
        return await self._per_shard(
            [self.lease_shard(lease) for lease in leases],
            lambda s, at: self.clients[s].read_many([leases[i] for i in at], None if outs is None else [outs[i] for i in at]))

    # ------------------------------------------------------------------ writes

    def _granted(self, keys: Sequence[BlockKey], results: Sequence[Any], shard: int) -> None:
        """Remember the shard of each key whose write ``shard`` granted or committed."""
        for key, result in zip(keys, results):
            if not isinstance(result, Refused):
                self._remember(key, shard)

    @_denied_one
    async def begin_write(self, ns: Namespace | bytes, key: BlockKey, parent: BlockKey | None) -> WriteLease | Refused:
        shard = await self._write_shard(ns, key, parent)
        wl = await self.clients[shard].begin_write(ns, key, parent)
        self._granted([key], [wl], shard)
        return wl

    async def write_bytes(self, wl: WriteLease, data: Any) -> None | Refused:
        return await self.clients[self.lease_shard(wl)].write_bytes(wl, data)

    async def commit(self, wl: WriteLease) -> Any:
        return await self.clients[self.lease_shard(wl)].commit(wl)

    def abort(self, wl: WriteLease) -> None:
        self.clients[self.lease_shard(wl)].abort(wl)

    @_denied_one
    async def put(self, ns: Namespace | bytes, key: BlockKey, parent: BlockKey | None, data: Any) -> Any:
        shard = await self._write_shard(ns, key, parent)
        out = await self.clients[shard].put(ns, key, parent, data)
        self._granted([key], [out], shard)
        return out

    @_denied_each
    async def put_chain(self, ns: Namespace | bytes, blocks: Sequence[tuple[BlockKey, BlockKey | None, Any]]) -> list[Any]:
        """A chain (each block's parent the one before, the first a root or a committed key's
        child) in its shard, as ``KvccClient.put_chain``."""
        if not blocks:
            return []
        key, parent, _ = blocks[0]
        shard = await self._write_shard(ns, key, parent)
        out = await self.clients[shard].put_chain(ns, blocks)
        self._granted([k for k, _, _ in blocks], out, shard)
        return out

    @_denied_each
    async def put_many(self, ns: Namespace | bytes, blocks: Sequence[tuple[BlockKey, BlockKey | None, Any]]) -> list[Any]:
        """``put`` of each block, one ``KvccClient.put_many`` per shard, the shards at once. A block
        whose parent is in the same call goes to its parent's shard."""
        located = await self.locate_all(ns, [k for k, _, _ in blocks], partial=True)
        planned: dict[BlockKey, int] = {}
        shards: list[int] = []
        for (key, parent, _), shard in zip(blocks, located):
            planned[key] = await self._write_shard(ns, key, parent, located=shard, planned=planned)
            shards.append(planned[key])
        out = await self._per_shard(shards, lambda s, at: self.clients[s].put_many(ns, [blocks[i] for i in at]))
        for (key, _, _), shard, result in zip(blocks, shards, out):
            self._granted([key], [result], shard)
        return out

    # ------------------------------------------------------------------ invalidation, eviction

    async def invalidate(self, ns: Namespace | bytes, scope: str, key: BlockKey | None = None) -> ShardedTicket:
        """A key or prefix invalidation at the key's shard (a key no shard holds: a ticket of no
        shard, complete at once, as the one directory's of 0 keys); a namespace invalidation at
        every shard (each voids its own keys of the namespace)."""
        if scope == SCOPE_NAMESPACE:
            tickets = await asyncio.gather(*(c.invalidate(ns, scope, key) for c in self.clients))
            return ShardedTicket(tuple(enumerate(tickets)))
        if key is None:
            raise ValueError(f"a {scope} invalidation names its key")
        try:
            shard = await self.locate(ns, key)
        except _Denied:  # the key's own hash's shard answers as the one directory would
            shard = self.root_shard(key)
        if shard is None:  # ABSENT everywhere, with no descendant: nothing to void, and no shard takes a step of it
            return ShardedTicket(())
        return ShardedTicket(((shard, await self.clients[shard].invalidate(ns, scope, key)),))

    async def wait(self, ticket: ShardedTicket, timeout_s: float) -> bool:
        """True once every shard's part of ``ticket`` completed within ``timeout_s``."""
        done = await asyncio.gather(*(self.clients[s].wait(t, timeout_s) for s, t in ticket.parts))
        return all(done)

    async def evict(self, key: BlockKey, location: Any) -> Any:
        """Ask the node serving ``location`` to evict its copy; the node asks the key's shard."""
        return await self.clients[0].evict(key, location)

    # ------------------------------------------------------------------ membership, faults

    async def refresh_nodes(self) -> dict[str, str]:
        """The nodes every shard knows (a node registers with each): those registered at all."""
        answers = await asyncio.gather(*(c.refresh_nodes() for c in self.clients))
        common = set(answers[0]).intersection(*answers[1:])
        return {n: a for n, a in answers[0].items() if n in common}

    async def crash(self) -> None:
        """``KvccClient.crash`` at every shard: the process embedding the client died."""
        await asyncio.gather(*(c.crash() for c in self.clients))

    async def rejoin(self) -> None:
        await asyncio.gather(*(c.rejoin() for c in self.clients))

    @property
    def clock_offset_ns(self) -> int:
        """The holder's clock offset (tests' and the suite's clock-skew fault): one clock, every shard's client."""
        return self.clients[0].clock_offset_ns

    @clock_offset_ns.setter
    def clock_offset_ns(self, value: int) -> None:
        for c in self.clients:
            c.clock_offset_ns = value

    @property
    def stats(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for c in self.clients:
            for k, v in c.stats.items():
                out[k] += v
        return dict(out)


class SyncShardedClient(SyncClient):
    """A ``ShardedClient`` for synchronous callers (as ``SyncClient`` is a ``KvccClient``'s):
    ``SyncShardedClient(shards, *, skew_ms, ...)`` with ``ShardedClient``'s arguments."""

    async def _make(self, args: tuple, kwargs: dict) -> ShardedClient:  # type: ignore[override]
        return await ShardedClient(*args, **kwargs).start()
