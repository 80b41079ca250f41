"""Integration tests of the etcd harness and client against a real etcd 3.4 on loopback.

Single member: KV, compare-and-swap, lease expiry, watches from a revision, typed
errors, raw throughput (printed). Three members: kill -9 of the leader with writes
and a watch continuing through the other members, restart and catch-up; a
SIGSTOPped member resumed.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvcc.reference.etcd_client import (
    Cmp,
    EtcdCompacted,
    EtcdIndeterminate,
    EtcdKV,
    EtcdLeaseNotFound,
    EtcdServerError,
    EtcdUnavailable,
    Op,
)
from kvcc.reference.etcd_harness import EtcdCluster
from kvcc.reference.procs import free_ports

pytestmark = pytest.mark.integration


def wait_until(pred, timeout_s: float, what: str, step_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(step_s)


def put_retrying(kv: EtcdKV, key: str, value: str, timeout_s: float = 20.0) -> tuple[int, int]:
    """Put that retries when the outcome is unknown (safe here: the same value again).
    Returns (revision, number of indeterminate attempts)."""
    deadline, unknown = time.monotonic() + timeout_s, 0
    while True:
        try:
            return kv.put(key, value), unknown
        except EtcdIndeterminate:
            unknown += 1
            if time.monotonic() > deadline:
                raise


# ----------------------------------------------------------------------------- one member
def test_put_get_range_delete(etcd_kv):
    kv, p = etcd_kv
    r1 = kv.put(p + "a", b"\x00\xffbytes")
    r2 = kv.put(p + "b", "text")
    assert r2 > r1 > 0
    assert kv.get(p + "a") == (b"\x00\xffbytes", r1)
    assert kv.get(p + "missing") is None
    kvs, rev = kv.range_prefix(p, page_size=1)  # paged, one snapshot
    assert [(x.key, x.value, x.mod_revision) for x in kvs] == [
        ((p + "a").encode(), b"\x00\xffbytes", r1),
        ((p + "b").encode(), b"text", r2),
    ]
    assert rev >= r2
    deleted, drev = kv.delete(p + "a")
    assert deleted == 1 and drev > r2
    assert kv.delete(p + "a")[0] == 0
    assert kv.delete(p, prefix=True)[0] == 1
    assert kv.range_prefix(p)[0] == []


def test_compare_and_swap(etcd_kv):
    kv, p = etcd_kv
    k = p + "owner"
    ok, rev = kv.txn_compare_and_put(k, 0, "node-a/epoch-1")  # create: must not exist
    assert ok and kv.get(k) == (b"node-a/epoch-1", rev)
    assert kv.txn_compare_and_put(k, 0, "node-b/epoch-1") == (False, rev)  # exists already
    ok2, rev2 = kv.txn_compare_and_put(k, rev, "node-b/epoch-2")  # fenced by mod_revision
    assert ok2 and rev2 > rev
    assert kv.txn_compare_and_put(k, rev, "stale-writer") == (False, rev2)  # stale revision
    assert kv.get(k) == (b"node-b/epoch-2", rev2)
    assert kv.txn_compare_and_delete(k, rev) == (False, rev2)
    assert kv.txn_compare_and_delete(k, rev2)[0] is True
    assert kv.get(k) is None
    # General txn: compare value + create_revision, multi-op success branch.
    r = kv.txn([Cmp.create_revision(k, 0)], [Op.put(k, "x"), Op.put(p + "epoch", "1")], [])
    assert r.succeeded
    r = kv.txn([Cmp.value(k, "y")], [Op.delete(k)], [Op.get(p, prefix=True)])
    assert not r.succeeded and len(r.responses[0]["response_range"]["kvs"]) == 2


def test_lease_expiry_deletes_attached_keys(etcd_kv):
    kv, p = etcd_kv
    dying = kv.grant_lease(1)  # etcd raises it to its minimum (2 s with default timing)
    kept = kv.grant_lease(1)
    kv.put(p + "d1", "x", lease=dying)
    kv.put(p + "d2", "x", lease=dying)
    kv.put(p + "k", "x", lease=kept)
    ttl, granted, keys = kv.lease_ttl(dying)
    assert 0 < ttl <= granted <= 3 and sorted(keys) == [(p + "d1").encode(), (p + "d2").encode()]
    ka = kv.start_keepalive(kept)
    t0 = time.monotonic()
    try:
        wait_until(lambda: kv.get(p + "d1") is None and kv.get(p + "d2") is None, 10, "lease expiry")
        took = time.monotonic() - t0
        time.sleep(max(0.0, granted + 0.5 - took))  # now past the kept lease's own TTL too
        assert kv.get(p + "k") is not None, "kept-alive lease expired"
        assert not ka.lost.is_set()
    finally:
        ka.stop()
    assert kv.lease_ttl(dying) is None
    with pytest.raises(EtcdLeaseNotFound):
        kv.keepalive(dying)  # a keep-alive never revives an expired lease
    with pytest.raises(EtcdLeaseNotFound):
        kv.put(p + "late", "x", lease=dying)
    assert kv.revoke(kept) is True
    assert kv.get(p + "k") is None  # revoke deletes attached keys at once
    assert kv.revoke(kept) is False
    print(f"lease of {granted}s: attached keys gone {took:.2f}s after grant")


def test_watch_from_start_revision(etcd_kv):
    kv, p = etcd_kv
    r1 = kv.put(p + "1", "a")
    kv.put(p + "2", "b")
    kv.delete(p + "1")
    kv.put("elsewhere", "not watched")
    w = kv.watch_prefix(p, start_revision=r1)
    try:
        kv.put(p + "3", "c")
        got = [w.get(5) for _ in range(4)]
        assert [(e.type, e.key, e.value) for e in got] == [
            ("PUT", (p + "1").encode(), b"a"),
            ("PUT", (p + "2").encode(), b"b"),
            ("DELETE", (p + "1").encode(), b""),
            ("PUT", (p + "3").encode(), b"c"),
        ]
        assert [e.mod_revision for e in got] == sorted(e.mod_revision for e in got)
        assert got[0].mod_revision == r1 and w.revision == got[-1].mod_revision
        assert w.get(0.2) is None  # nothing else (not the key outside the prefix)
    finally:
        w.cancel()
    assert list(w) == []  # iteration ends after cancel

    # async iteration, from "now", with a callback-free consumer
    async def consume():
        w2 = kv.watch_prefix(p + "async/")
        threading.Timer(0.1, kv.put, (p + "async/x", "1")).start()
        try:
            async for ev in w2:
                return ev
        finally:
            w2.cancel()

    ev = asyncio.run(asyncio.wait_for(consume(), 10))
    assert ev.key == (p + "async/x").encode() and ev.type == "PUT"

    # callback style
    seen, done = [], threading.Event()
    w3 = kv.watch_prefix(p, kv.put(p + "cb", "1"), callback=lambda e: (seen.append(e), done.set()))
    try:
        assert done.wait(5) and seen[0].key == (p + "cb").encode()
    finally:
        w3.cancel()


def test_watch_compacted_revision_is_an_error(etcd_kv):
    kv, p = etcd_kv
    old = kv.put(p + "x", "1")
    kv.put(p + "x", "2")
    kv.compact(kv.put(p + "x", "3"))
    with pytest.raises(EtcdCompacted):
        kv.watch_prefix(p, start_revision=old)


def test_typed_errors_and_endpoint_failover(etcd1):
    dead = f"http://127.0.0.1:{free_ports(1)[0]}"
    with EtcdKV([dead], request_timeout_s=0.5, failover_timeout_s=0.5) as kv:
        # A dead cluster is a typed error that comes back (a deadline far beyond the 0.5 s
        # failover budget catches a client that retries forever, without timing it).
        with ThreadPoolExecutor(1) as pool, pytest.raises(EtcdUnavailable):
            pool.submit(kv.get, "x").result(timeout=30)
    with EtcdKV([dead, *etcd1.endpoints], request_timeout_s=1.0, failover_timeout_s=5.0) as kv:
        rev = kv.put("failover/x", "1")  # connection refused: safe to try the next endpoint
        assert kv.get("failover/x") == (b"1", rev)
        assert kv.endpoints[kv._current] == etcd1.endpoints[0]
        with pytest.raises(EtcdServerError) as ei:
            kv.txn([Cmp.mod_revision("failover/x", rev)], [Op.put("", "no key")], [])
        assert ei.value.grpc_code == 3 and ei.value.code == "etcd_server_error"  # InvalidArgument, not retried
        with pytest.raises(EtcdLeaseNotFound):
            kv.put("failover/y", "1", lease=12345)


def test_harness_stop_leaves_nothing(etcd_leak_check):
    with EtcdCluster(members=1) as c:
        pid, data_dir = c.pid(0), c.data_dir
        assert pid and data_dir.is_dir() and c.healthy(0)
        c.kill(0)
        assert not c.is_running(0)
        c.restart(0)
        pid = c.pid(0)
        c.pause(0)  # stop() must also end a stopped process
    assert not data_dir.exists()
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def test_raw_throughput_baseline(etcd1, capsys):
    """The rates are printed, not asserted (the directory benchmark compares its etcd backend to
    them; tests never assert wall-clock times); what is asserted is that the measured operations
    happened: every put is read back with the value of its last write, and every granted lease
    was revoked (etcd no longer knows it)."""
    dur = 1.0

    def puts(kv: EtcdKV, tag: str, stop: float) -> int:
        n = 0
        while time.monotonic() < stop:
            kv.put(f"bench/{tag}/{n % 256}", f"{n:08d}" + "v" * 56)
            n += 1
        return n

    def landed(kv: EtcdKV, tag: str, n: int) -> None:
        assert n > 0, f"{tag}: no put completed"
        for slot in {0, (n - 1) % 256}:
            last = max(i for i in range(slot, n, 256))  # the last put into this slot
            got = kv.get(f"bench/{tag}/{slot}")
            assert got is not None and got[0] == (f"{last:08d}" + "v" * 56).encode(), (tag, slot, got)

    with EtcdKV(etcd1.endpoints) as kv:
        puts(kv, "warm", time.monotonic() + 0.2)
        t = time.monotonic()
        n_one = puts(kv, "one", t + dur)
        one = n_one / (time.monotonic() - t)

        counts: dict[int, int] = {}
        clients = [EtcdKV(etcd1.endpoints) for _ in range(4)]
        stop = time.monotonic() + dur
        threads = [threading.Thread(target=lambda c=c, i=i: counts.__setitem__(i, puts(c, f"c{i}", stop)))
                   for i, c in enumerate(clients)]  # fmt: skip
        t = time.monotonic()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        four = sum(counts.values()) / (time.monotonic() - t)
        for c in clients:
            c.close()

        landed(kv, "one", n_one)
        assert sorted(counts) == list(range(len(clients)))
        for i, n in counts.items():
            landed(kv, f"c{i}", n)

        n, t, revoked = 0, time.monotonic(), []
        while time.monotonic() - t < dur:
            lease = kv.grant_lease(10)
            assert kv.revoke(lease), f"lease {lease} was gone before its revocation"
            revoked.append(lease)
            n += 1
        leases = n / (time.monotonic() - t)
        assert n > 0 and kv.lease_ttl(revoked[-1]) is None, "a revoked lease is still known"
        kv.delete("bench/", prefix=True)
        assert kv.range_prefix("bench/")[0] == []
    with capsys.disabled():
        print(
            f"\netcd raw baseline (1 member, loopback, JSON gateway): put {one:.0f}/s from 1 client, "
            f"{four:.0f}/s from 4 threads; lease grant+revoke {leases:.0f} pairs/s"
        )


# ----------------------------------------------------------------------------- three members
def test_leader_kill_failover_and_catch_up(etcd3):
    c = etcd3
    leader = c.leader()
    order = [leader] + [i for i in range(3) if i != leader]  # the client starts on the leader
    with EtcdKV([c.endpoint(i) for i in order], request_timeout_s=2.0, failover_timeout_s=20.0) as kv:
        p = "ha/"
        start = kv.put(p + "before/0", "0")
        w = kv.watch_prefix(p, start_revision=start)  # stream on the leader
        for i in range(1, 10):
            kv.put(f"{p}before/{i}", str(i))

        c.kill(leader)  # SIGKILL
        t0 = time.monotonic()
        unknown = 0
        for i in range(20):
            _, u = put_retrying(kv, f"{p}after/{i}", str(i))
            unknown += u
            if i == 0:
                first_write = time.monotonic() - t0
        assert kv.endpoints[kv._current] != c.endpoint(leader)
        new_leader = c.leader()
        assert new_leader != leader

        kvs, rev = kv.range_prefix(p)
        assert len(kvs) == 30
        # The watch moved to a live member and resumed: every change once, in order.
        events = []
        while True:
            ev = w.get(10)
            assert ev is not None, f"watch stalled after {len(events)} events"
            events.append(ev)
            if ev.mod_revision >= rev:
                break
        w.cancel()
        revs = [e.mod_revision for e in events]
        assert revs == sorted(set(revs)), "watch lost order or delivered twice"
        assert {e.key for e in events} == {x.key for x in kvs}
        assert w.reconnects >= 1

        c.restart(leader)  # same data dir: it rejoins and catches up
        wait_until(lambda: int(c.status(leader)["header"]["revision"]) >= rev, 15, "restarted member catch-up")
        with EtcdKV([c.endpoint(leader)], request_timeout_s=2.0, failover_timeout_s=10.0) as only_old:
            latest = {x.key: x.mod_revision for x in kvs}
            assert only_old.get(p + "after/19") == (b"19", latest[(p + "after/19").encode()])
            assert len(only_old.range_prefix(p)[0]) == 30
    print(f"leader kill: first write after {first_write:.2f}s ({unknown} indeterminate attempts retried)")


def test_paused_member_resumed(etcd3):
    c = etcd3
    victim = c.leader()  # pausing the leader forces an election, the harder case
    order = [victim] + [i for i in range(3) if i != victim]
    with EtcdKV([c.endpoint(i) for i in order], request_timeout_s=1.5, failover_timeout_s=20.0) as kv:
        base = kv.put("pause/base", "0")
        w = kv.watch_prefix("pause/", start_revision=base + 1, probe_after_s=1.0)
        assert w.endpoint == c.endpoint(victim)
        c.pause(victim)  # SIGSTOP: connections hang instead of failing
        try:
            t0 = time.monotonic()
            assert kv.get("pause/base") is not None  # read: times out on the paused member, fails over
            for i in range(10):
                put_retrying(kv, f"pause/{i}", str(i))
            during = time.monotonic() - t0
            assert c.leader() != victim
            # The watch noticed the silence and moved. A put retried after a lost answer may have
            # been applied twice (etcd puts are not idempotent): the same key twice in a row.
            keys: list[bytes] = []
            while len(set(keys)) < 10:
                keys.append(w.get(15).key)
            assert [k for i, k in enumerate(keys) if i == 0 or k != keys[i - 1]] == [f"pause/{i}".encode() for i in range(10)]
            assert w.endpoint != c.endpoint(victim)
        finally:
            c.resume(victim)
        w.cancel()
        rev = kv.put("pause/after", "resumed")
        wait_until(lambda: c.healthy(victim), 15, "resumed member healthy")
        wait_until(lambda: int(c.status(victim)["header"]["revision"]) >= rev, 15, "resumed member catch-up")
        with EtcdKV([c.endpoint(victim)], request_timeout_s=2.0, failover_timeout_s=10.0) as only:
            assert only.get("pause/after") == (b"resumed", rev)
    print(f"paused leader: 1 read + 10 writes done in {during:.2f}s through the others")
