"""A small, typed, dependency-free etcd v3 client over etcd's JSON gateway.

This is what the etcd directory backend builds on. It speaks the grpc-gateway
that every etcd 3.4+ member serves on its client port under ``/v3/`` (keys and
values base64 in JSON, int64 fields as strings), using only ``http.client`` and
raw sockets, so it adds no dependency (no grpcio/protobuf) to the project.

Why not an existing client (evaluated against etcd 3.4.23):

* ``etcd3`` (python-etcd3 0.12, grpc): its generated protobuf code does not import
  with protobuf >= 4 (the current one); unmaintained since 2020.
* ``etcd3gw`` (2.7, gateway + requests): works, but ``put`` returns ``True``
  rather than the revision, there is one endpoint per client (no failover), and a
  watch whose member dies just stops: its iterator blocks forever with no error.
* ``aetcd`` (1.0, grpc asyncio): works and surfaces watch failures, but is
  asyncio-only, single-endpoint, does not resume a broken watch, and brings grpcio
  and protobuf into a venv that later hosts engines with their own pins.

None resumes a watch on another member from the last delivered revision, which
is what invalidation propagation needs, so that part would have to be written
anyway; the rest is a few JSON POSTs.

Semantics
---------
*Endpoints and failover.* ``EtcdKV(endpoints)`` talks to one endpoint at a time
and moves to the next on connection errors and on "unavailable" answers, cycling
with backoff until ``failover_timeout_s`` has passed (then
:class:`EtcdUnavailable`). Reads (get, range, status, lease TTL) and lease
keep-alive / revoke / grant are retried freely. A *mutation* (put, delete, txn)
is retried on another endpoint only when it certainly was not applied (the
connection was refused or found closed before sending, or etcd answered "no
leader" / "proposal dropped"). When it may have been applied (timeout or reset
after sending, "request timed out"), :class:`EtcdIndeterminate` is raised and the
caller decides (the directory re-reads and compares its own request id). This is
what etcd's own clientv3 does.

*Reads are linearizable* (etcd's default for the gateway's range).

*Watches* (``watch_prefix``) run on a thread with their own connection. If the
stream breaks (member killed, paused past ``probe_after_s``, lost its leader), the
watch reconnects, to the next endpoint if need be, from the revision after the
last delivered event: no event is lost or delivered twice. If that revision has
been compacted, the watch ends with :class:`EtcdCompacted` (the consumer must
re-read and re-watch). If no endpoint takes the watch for ``failover_timeout_s``,
it ends with :class:`EtcdUnavailable`.

Thread safety: one ``EtcdKV`` may be shared by threads (a connection per thread
and endpoint).
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import json
import logging
import queue
import select
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, ClassVar
from urllib.parse import urlsplit

from attrs import frozen

__all__ = [
    "EtcdKV",
    "KeyValue",
    "WatchEvent",
    "TxnResult",
    "Watch",
    "LeaseKeepAlive",
    "Cmp",
    "Op",
    "EtcdError",
    "EtcdUnavailable",
    "EtcdIndeterminate",
    "EtcdServerError",
    "EtcdLeaseNotFound",
    "EtcdCompacted",
    "prefix_range_end",
]

log = logging.getLogger(__name__)

# Named limits (units last). etcd's own server-side request timeout is 5 s plus two
# election timeouts (7 s with default timing); a client request timeout below that
# turns a slow write into EtcdIndeterminate sooner, which the caller must handle anyway.
DEFAULT_REQUEST_TIMEOUT_S = 5.0
DEFAULT_FAILOVER_TIMEOUT_S = 15.0  # one call cycles through endpoints this long
RETRY_BACKOFF_FIRST_S = 0.02  # pause after every endpoint failed once, doubled each round...
RETRY_BACKOFF_MAX_S = 0.5  # ...up to this
RANGE_PAGE_SIZE = 1000  # keys per range request when reading a prefix
WATCH_POLL_S = 0.25  # how often a watch thread looks at its cancel flag
WATCH_PROBE_AFTER_S = 3.0  # a silent watch stream is checked (status request) after this
WATCH_PROBE_TIMEOUT_S = 1.0
WATCH_CANCEL_JOIN_S = 5.0
assert RETRY_BACKOFF_FIRST_S < RETRY_BACKOFF_MAX_S < DEFAULT_FAILOVER_TIMEOUT_S
assert WATCH_POLL_S < WATCH_PROBE_AFTER_S

Bytesish = bytes | str


# ----------------------------------------------------------------------------- errors
class EtcdError(Exception):
    """Base of every error this module raises. ``code`` is a stable string (for logs and
    reports, like the reference's other typed errors)."""

    code: ClassVar[str] = "etcd_error"


class EtcdUnavailable(EtcdError):
    """No endpoint answered (connection errors / no leader) within failover_timeout_s."""

    code: ClassVar[str] = "etcd_unavailable"


class EtcdIndeterminate(EtcdError):
    """A mutation may or may not have been applied (the connection failed or timed
    out after the request was sent, or etcd answered "request timed out")."""

    def __init__(self, message: str, endpoint: str) -> None:
        super().__init__(f"{message} (endpoint {endpoint})")
        self.endpoint = endpoint


class EtcdServerError(EtcdError):
    """etcd answered with an error (``grpc_code``: the gRPC status code, e.g. 3 invalid argument)."""

    code: ClassVar[str] = "etcd_server_error"

    def __init__(self, message: str, grpc_code: int = 2, http_status: int = 0) -> None:
        super().__init__(f"{message} (grpc code {grpc_code}, http {http_status})")
        self.message = message
        self.grpc_code = grpc_code
        self.http_status = http_status


class EtcdLeaseNotFound(EtcdServerError):
    """The lease does not exist (never granted, expired or revoked)."""

    code: ClassVar[str] = "etcd_lease_not_found"


class EtcdCompacted(EtcdServerError):
    """The requested revision has been compacted (``compact_revision``: the oldest left,
    0 when etcd did not say)."""

    code: ClassVar[str] = "etcd_compacted"

    def __init__(self, message: str, compact_revision: int, grpc_code: int = 11, http_status: int = 0) -> None:
        super().__init__(message, grpc_code, http_status)
        self.compact_revision = compact_revision


# ----------------------------------------------------------------------------- helpers
def _b(x: Bytesish) -> bytes:
    return x.encode() if isinstance(x, str) else bytes(x)


def _enc(x: Bytesish) -> str:
    return base64.b64encode(_b(x)).decode("ascii")


def _dec(s: str | None) -> bytes:
    return base64.b64decode(s) if s else b""


def prefix_range_end(prefix: Bytesish) -> bytes:
    """The ``range_end`` covering every key that starts with ``prefix``."""
    p = bytearray(_b(prefix))
    while p:
        if p[-1] < 0xFF:
            p[-1] += 1
            return bytes(p)
        p.pop()
    return b"\0"  # empty prefix (or all 0xff): every key


@frozen
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def _from(cls, kv: dict) -> "KeyValue":
        return cls(
            _dec(kv.get("key")),
            _dec(kv.get("value")),
            int(kv.get("create_revision", 0)),
            int(kv.get("mod_revision", 0)),
            int(kv.get("version", 0)),
            int(kv.get("lease", 0)),
        )


@frozen
class WatchEvent:
    type: str  # "PUT" or "DELETE"
    key: bytes
    value: bytes  # b"" for DELETE
    mod_revision: int  # the revision of this change
    create_revision: int
    version: int
    lease: int
    prev_value: bytes | None = None  # with prev_kv=True


@frozen
class TxnResult:
    succeeded: bool
    revision: int  # the store revision after the txn (header revision)
    responses: list[dict]  # raw gateway responses of the branch taken


_SAFE_UNAVAILABLE = ("no leader", "proposal dropped", "too many requests", "not capable")


class _Safe(Exception):
    """Transport failure where the request certainly did not reach etcd."""


class _Ambiguous(Exception):
    """Transport failure after the request may have been processed."""


class Cmp:
    """Transaction comparisons (``op`` one of = != < >)."""

    _RESULT = {"=": "EQUAL", "==": "EQUAL", "!=": "NOT_EQUAL", "<": "LESS", ">": "GREATER"}

    @staticmethod
    def _c(key: Bytesish, target: str, field: str, value: Any, op: str) -> dict:
        return {"key": _enc(key), "target": target, "result": Cmp._RESULT[op], field: value}

    @staticmethod
    def mod_revision(key: Bytesish, revision: int, op: str = "=") -> dict:
        return Cmp._c(key, "MOD", "mod_revision", str(revision), op)

    @staticmethod
    def create_revision(key: Bytesish, revision: int, op: str = "=") -> dict:
        return Cmp._c(key, "CREATE", "create_revision", str(revision), op)

    @staticmethod
    def version(key: Bytesish, version: int, op: str = "=") -> dict:
        return Cmp._c(key, "VERSION", "version", str(version), op)

    @staticmethod
    def value(key: Bytesish, value: Bytesish, op: str = "=") -> dict:
        return Cmp._c(key, "VALUE", "value", _enc(value), op)

    @staticmethod
    def lease(key: Bytesish, lease_id: int, op: str = "=") -> dict:
        return Cmp._c(key, "LEASE", "lease", str(lease_id), op)


class Op:
    """Transaction operations."""

    @staticmethod
    def put(key: Bytesish, value: Bytesish, lease: int | None = None) -> dict:
        req: dict[str, Any] = {"key": _enc(key), "value": _enc(value)}
        if lease:
            req["lease"] = str(lease)
        return {"request_put": req}

    @staticmethod
    def delete(key: Bytesish, prefix: bool = False) -> dict:
        req = {"key": _enc(key)}
        if prefix:
            req["range_end"] = _enc(prefix_range_end(key))
        return {"request_delete_range": req}

    @staticmethod
    def get(key: Bytesish, prefix: bool = False) -> dict:
        req = {"key": _enc(key)}
        if prefix:
            req["range_end"] = _enc(prefix_range_end(key))
        return {"request_range": req}


def _error_from_body(status: int, body: bytes) -> EtcdServerError:
    try:
        j = json.loads(body)
        err = j.get("error")
        if isinstance(err, dict):  # streaming error shape
            msg, code = str(err.get("message", "")), int(err.get("grpc_code") or err.get("code") or 2)
        else:
            msg, code = j.get("message") or err or "", int(j.get("code", 2))
    except (ValueError, TypeError, AttributeError):
        msg, code = body.decode("utf-8", "replace")[:500] or http.client.responses.get(status, "?"), 2
    return _classify(msg, code, status)


def _classify(msg: str, code: int, status: int = 0) -> EtcdServerError:
    low = msg.lower()
    if "lease not found" in low:
        return EtcdLeaseNotFound(msg, code, status)
    if "compacted" in low:
        return EtcdCompacted(msg, 0, code, status)
    return EtcdServerError(msg, code, status)


def _is_unavailable(e: EtcdServerError) -> bool:
    return e.grpc_code == 14 or e.http_status == 503


# ----------------------------------------------------------------------------- client
class EtcdKV:
    """Typed etcd v3 KV / lease / watch client with endpoint failover (see module doc).

    ``endpoints``: ``["http://127.0.0.1:2379", ...]`` (or ``"host:port"``).
    ``request_timeout_s``: socket timeout of one request to one endpoint (etcd itself
    gives up on a write after 7 s with default settings). ``failover_timeout_s``: how
    long one call keeps cycling through endpoints before :class:`EtcdUnavailable`.
    """

    def __init__(
        self,
        endpoints: Sequence[str] | str,
        *,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        failover_timeout_s: float = DEFAULT_FAILOVER_TIMEOUT_S,
        api_prefix: str = "/v3",
    ) -> None:
        if isinstance(endpoints, str):
            endpoints = [e for e in endpoints.split(",") if e]
        if not endpoints:
            raise ValueError("no etcd endpoints")
        self._eps: list[tuple[str, int]] = []
        for e in endpoints:
            u = urlsplit(e if "//" in e else f"http://{e}")
            if u.scheme not in ("http", ""):
                raise ValueError(f"only http:// endpoints are supported: {e!r}")
            self._eps.append((u.hostname or "127.0.0.1", u.port or 2379))
        self.endpoints = [f"http://{h}:{p}" for h, p in self._eps]
        assert request_timeout_s > 0 and failover_timeout_s >= 0
        self.request_timeout_s = request_timeout_s
        self.failover_timeout_s = failover_timeout_s
        self.api_prefix = api_prefix.rstrip("/")
        self._current = 0
        self._local = threading.local()
        self._closed = False
        self._watches: set[Watch] = set()
        self._keepalives: set[LeaseKeepAlive] = set()
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- KV
    def get(self, key: Bytesish) -> tuple[bytes, int] | None:
        """``(value, mod_revision)`` of ``key``, or ``None`` when absent."""
        r = self._call("/kv/range", {"key": _enc(key)}, mutation=False)
        kvs = r.get("kvs") or []
        if not kvs:
            return None
        kv = KeyValue._from(kvs[0])
        return kv.value, kv.mod_revision

    def get_kv(self, key: Bytesish) -> KeyValue | None:
        """The whole record of ``key`` (revisions, version, lease), or ``None``."""
        r = self._call("/kv/range", {"key": _enc(key)}, mutation=False)
        kvs = r.get("kvs") or []
        return KeyValue._from(kvs[0]) if kvs else None

    def range_prefix(self, prefix: Bytesish, *, page_size: int = RANGE_PAGE_SIZE) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` (sorted by key) and the revision of that snapshot.

        Large ranges are read in pages pinned to one revision, so the result is one
        consistent snapshot; watch from ``revision + 1`` to follow it.
        """
        end = _enc(prefix_range_end(prefix))
        start = _enc(_b(prefix) or b"\0")  # etcd wants a non-empty key; "\0".."\0" is every key
        out: list[KeyValue] = []
        rev = 0
        while True:
            body: dict[str, Any] = {"key": start, "range_end": end, "limit": str(page_size)}
            if rev:
                body["revision"] = str(rev)
            r = self._call("/kv/range", body, mutation=False)
            if not rev:
                rev = int(r["header"]["revision"])
            kvs = [KeyValue._from(kv) for kv in r.get("kvs") or []]
            out.extend(kvs)
            if not r.get("more") or not kvs:
                return out, rev
            start = _enc(kvs[-1].key + b"\0")

    def put(self, key: Bytesish, value: Bytesish, lease: int | None = None) -> int:
        """Store ``value`` under ``key`` (attached to ``lease`` if given); returns the new revision."""
        body: dict[str, Any] = {"key": _enc(key), "value": _enc(value)}
        if lease:
            body["lease"] = str(lease)
        r = self._call("/kv/put", body, mutation=True)
        return int(r["header"]["revision"])

    def delete(self, key: Bytesish, *, prefix: bool = False) -> tuple[int, int]:
        """Delete ``key`` (or every key under it with ``prefix=True``): ``(deleted_count, revision)``."""
        body = {"key": _enc(key)}
        if prefix:
            body["range_end"] = _enc(prefix_range_end(key))
        r = self._call("/kv/deleterange", body, mutation=True)
        return int(r.get("deleted", 0)), int(r["header"]["revision"])

    def txn(self, compare: Sequence[dict], success: Sequence[dict] = (), failure: Sequence[dict] = ()) -> TxnResult:
        """General transaction built from :class:`Cmp` and :class:`Op` items."""
        r = self._call(
            "/kv/txn",
            {"compare": list(compare), "success": list(success), "failure": list(failure)},
            mutation=True,
        )
        return TxnResult(bool(r.get("succeeded", False)), int(r["header"]["revision"]), r.get("responses") or [])

    def txn_compare_and_put(
        self, key: Bytesish, expected_mod_revision: int, value: Bytesish, lease: int | None = None
    ) -> tuple[bool, int]:
        """Put only if ``key``'s mod_revision is ``expected_mod_revision`` (0: key must not
        exist). Returns ``(succeeded, revision)``: on success the key's new mod_revision;
        on conflict the key's current mod_revision (0 if it does not exist)."""
        r = self.txn(
            [Cmp.mod_revision(key, expected_mod_revision)],
            [Op.put(key, value, lease)],
            [Op.get(key)],
        )
        if r.succeeded:
            return True, r.revision
        kvs = (r.responses[0].get("response_range") or {}).get("kvs") or [] if r.responses else []
        return False, (KeyValue._from(kvs[0]).mod_revision if kvs else 0)

    def txn_compare_and_delete(self, key: Bytesish, expected_mod_revision: int) -> tuple[bool, int]:
        """Delete only if ``key``'s mod_revision is ``expected_mod_revision``.
        Returns ``(succeeded, revision)`` like :meth:`txn_compare_and_put`."""
        r = self.txn([Cmp.mod_revision(key, expected_mod_revision)], [Op.delete(key)], [Op.get(key)])
        if r.succeeded:
            return True, r.revision
        kvs = (r.responses[0].get("response_range") or {}).get("kvs") or [] if r.responses else []
        return False, (KeyValue._from(kvs[0]).mod_revision if kvs else 0)

    # ---------------------------------------------------------------- leases
    def grant_lease(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds (etcd's minimum is its election timeout
        rounded up, about 2 s by default; shorter TTLs are raised to it). Returns its id."""
        r = self._call("/lease/grant", {"TTL": int(ttl_s), "ID": "0"}, mutation=False)
        if r.get("error"):
            raise _classify(str(r["error"]), 2)
        return int(r["ID"])

    def keepalive(self, lease_id: int) -> int:
        """Renew ``lease_id`` once; returns its TTL in seconds. Raises
        :class:`EtcdLeaseNotFound` if it has expired or been revoked (a keep-alive
        never revives a dead lease)."""
        r = self._call("/lease/keepalive", {"ID": str(lease_id)}, mutation=False)
        res = r.get("result", r)
        ttl = int(res.get("TTL", 0))
        if ttl <= 0:
            raise EtcdLeaseNotFound("etcdserver: requested lease not found", 5)
        return ttl

    def start_keepalive(
        self,
        lease_id: int,
        interval_s: float | None = None,
        on_lost: Callable[[EtcdError], None] | None = None,
    ) -> "LeaseKeepAlive":
        """Renew ``lease_id`` in the background every ``interval_s`` (default TTL/3)
        until ``stop()``; ``on_lost`` is called once if the lease is found dead."""
        ka = LeaseKeepAlive(self, lease_id, interval_s, on_lost)
        with self._lock:
            self._keepalives.add(ka)
        ka._start()
        return ka

    def revoke(self, lease_id: int) -> bool:
        """Revoke ``lease_id`` (its keys are deleted). False if it was already gone."""
        try:
            self._call("/lease/revoke", {"ID": str(lease_id)}, mutation=False)
            return True
        except EtcdLeaseNotFound:
            return False

    def lease_ttl(self, lease_id: int) -> tuple[int, int, list[bytes]] | None:
        """``(remaining_ttl, granted_ttl, attached_keys)`` or ``None`` if the lease is gone."""
        r = self._call("/lease/timetolive", {"ID": str(lease_id), "keys": True}, mutation=False)
        ttl = int(r.get("TTL", -1))
        if ttl < 0:
            return None
        return ttl, int(r.get("grantedTTL", 0)), [_dec(k) for k in r.get("keys") or []]

    # ---------------------------------------------------------------- cluster
    def status(self, endpoint: str | None = None) -> dict:
        """``/maintenance/status`` of ``endpoint`` (no failover) or of any member."""
        if endpoint is None:
            return self._call("/maintenance/status", {}, mutation=False)
        u = urlsplit(endpoint if "//" in endpoint else f"http://{endpoint}")
        i = self._eps.index((u.hostname or "127.0.0.1", u.port or 2379))
        try:
            return self._post_once(i, "/maintenance/status", {})
        except (_Safe, _Ambiguous) as e:
            raise EtcdUnavailable(f"{endpoint}: {e}") from None

    def compact(self, revision: int, physical: bool = False) -> None:
        self._call("/kv/compaction", {"revision": str(revision), "physical": physical}, mutation=False)

    # ---------------------------------------------------------------- watch
    def watch_prefix(
        self,
        prefix: Bytesish,
        start_revision: int = 0,
        callback: Callable[[WatchEvent], None] | None = None,
        *,
        on_error: Callable[[EtcdError], None] | None = None,
        prev_kv: bool = False,
        probe_after_s: float = WATCH_PROBE_AFTER_S,
    ) -> "Watch":
        """Watch every key under ``prefix`` from ``start_revision`` (0: from now on).

        Returns once the watch is established (raises if it cannot be). Events go
        to ``callback`` (on the watch's thread) or, without one, are iterated from
        the returned :class:`Watch` (``for ev in w`` or ``async for ev in w``). A
        terminal error goes to ``on_error`` or is raised by the iteration.
        """
        return self._watch(_b(prefix) or b"\0", prefix_range_end(prefix), start_revision, callback, on_error, prev_kv, probe_after_s)

    def watch_key(
        self,
        key: Bytesish,
        start_revision: int = 0,
        callback: Callable[[WatchEvent], None] | None = None,
        *,
        on_error: Callable[[EtcdError], None] | None = None,
        prev_kv: bool = False,
        probe_after_s: float = WATCH_PROBE_AFTER_S,
    ) -> "Watch":
        """Like :meth:`watch_prefix`, for one key."""
        return self._watch(_b(key), b"", start_revision, callback, on_error, prev_kv, probe_after_s)

    def _watch(self, key, range_end, start_revision, callback, on_error, prev_kv, probe_after_s) -> "Watch":
        w = Watch(self, key, range_end, start_revision, callback, on_error, prev_kv, probe_after_s)
        with self._lock:
            self._watches.add(w)
        w._start()
        return w

    # ---------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Cancel watches and keep-alives, close this thread's connections."""
        self._closed = True
        with self._lock:
            watches, kas = list(self._watches), list(self._keepalives)
        for w in watches:
            w.cancel()
        for ka in kas:
            ka.stop()
        conns = getattr(self._local, "conns", {})
        for c in conns.values():
            c.close()
        conns.clear()

    def __enter__(self) -> "EtcdKV":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- transport
    def _conn(self, i: int) -> http.client.HTTPConnection:
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        c = conns.get(i)
        if c is None:
            host, port = self._eps[i]
            c = conns[i] = http.client.HTTPConnection(host, port, timeout=self.request_timeout_s)
        return c

    def _post_once(self, i: int, path: str, body: dict, timeout_s: float | None = None) -> dict:
        """One POST to endpoint ``i``. Raises _Safe / _Ambiguous / EtcdServerError."""
        c = self._conn(i)
        if timeout_s is not None:
            c.timeout = timeout_s
            if c.sock is not None:
                c.sock.settimeout(timeout_s)
        if c.sock is not None:
            # An idle keep-alive connection that is readable was closed (or reset) by
            # the server, e.g. the member died: reconnect rather than send into it.
            try:
                readable = bool(select.select([c.sock], [], [], 0)[0])
            except (OSError, ValueError):
                readable = True
            if readable:
                c.close()
        if c.sock is None:
            try:
                c.connect()
                assert c.sock is not None
                c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError as e:
                c.close()
                raise _Safe(f"connect: {e!r}") from None
        data = json.dumps(body).encode()
        try:
            c.request(
                "POST",
                self.api_prefix + path,
                body=data,
                headers={"Content-Type": "application/json", "Grpc-Metadata-Hasleader": "true"},
            )
            resp = c.getresponse()
            payload = resp.read()
        except (OSError, http.client.HTTPException) as e:
            c.close()
            raise _Ambiguous(f"{type(e).__name__}: {e}") from None
        finally:
            if timeout_s is not None:
                c.timeout = self.request_timeout_s
                if c.sock is not None:
                    c.sock.settimeout(self.request_timeout_s)
        if resp.status == 200:
            try:
                out = json.loads(payload)
            except ValueError:
                raise EtcdServerError(f"bad JSON from etcd: {payload[:200]!r}", 2, 200) from None
            if isinstance(out, dict) and isinstance(out.get("error"), dict):  # streaming-style error
                raise _error_from_body(200, payload)
            return out
        raise _error_from_body(resp.status, payload)

    def _call(self, path: str, body: dict, *, mutation: bool) -> dict:
        if self._closed:
            raise EtcdError("client closed")
        n = len(self._eps)
        deadline = time.monotonic() + self.failover_timeout_s
        delay = RETRY_BACKOFF_FIRST_S
        last: str = ""
        while True:
            start = self._current
            for k in range(n):
                i = (start + k) % n
                try:
                    out = self._post_once(i, path, body)
                    self._current = i
                    return out
                except _Safe as e:
                    last = f"{self.endpoints[i]}: {e}"
                except _Ambiguous as e:
                    if mutation:
                        self._current = (i + 1) % n
                        raise EtcdIndeterminate(f"{path}: {e}", self.endpoints[i]) from None
                    last = f"{self.endpoints[i]}: {e}"
                except EtcdServerError as e:
                    if not _is_unavailable(e):
                        raise
                    if mutation and not any(s in e.message.lower() for s in _SAFE_UNAVAILABLE):
                        self._current = (i + 1) % n
                        raise EtcdIndeterminate(f"{path}: {e.message}", self.endpoints[i]) from None
                    last = f"{self.endpoints[i]}: {e.message}"
                self._current = (i + 1) % n
            if time.monotonic() + delay > deadline:
                raise EtcdUnavailable(f"{path}: no etcd endpoint answered within {self.failover_timeout_s}s; last: {last}")
            time.sleep(delay)
            delay = min(delay * 2, RETRY_BACKOFF_MAX_S)


# ----------------------------------------------------------------------------- keep-alive
class LeaseKeepAlive:
    """Background renewal of one lease (see :meth:`EtcdKV.start_keepalive`)."""

    def __init__(self, kv: EtcdKV, lease_id: int, interval_s: float | None, on_lost) -> None:
        self.kv = kv
        self.lease_id = lease_id
        self.interval_s = interval_s
        self.on_lost = on_lost
        self.ttl: int | None = None
        self.lost = threading.Event()
        self.error: EtcdError | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"etcd-keepalive-{lease_id:x}", daemon=True)

    def _start(self) -> None:
        sent = time.monotonic()
        self.ttl = self.kv.keepalive(self.lease_id)  # fails fast if the lease is already gone
        self._last_ok = sent
        self._thread.start()

    @property
    def live_until(self) -> float:
        """``time.monotonic()`` until which the lease is surely live: the TTL counted from
        when the last successful renewal was *sent* (docs/protocol.md: leases), not answered."""
        return self._last_ok + (self.ttl or 0)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                interval = self.interval_s or max(0.1, (self.ttl or 3) / 3)
                if self._stop.wait(interval):
                    return
                sent = time.monotonic()
                try:
                    self.ttl = self.kv.keepalive(self.lease_id)
                    self._last_ok = sent
                except EtcdLeaseNotFound as e:
                    self._lose(e)
                    return
                except EtcdError as e:
                    # Unreachable for longer than the TTL: the lease is surely gone.
                    if time.monotonic() - self._last_ok > (self.ttl or 0):
                        self._lose(e)
                        return
        finally:
            with self.kv._lock:
                self.kv._keepalives.discard(self)

    def _lose(self, e: EtcdError) -> None:
        self.error = e
        self.lost.set()
        if self.on_lost is not None:
            try:
                self.on_lost(e)
            except Exception:
                log.exception("etcd keep-alive on_lost callback failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=self.kv.request_timeout_s + 1)


# ----------------------------------------------------------------------------- watch
_END = object()


class _StreamClosed(Exception):
    pass


class _HttpStream:
    """One streaming POST on a raw socket; yields newline-delimited JSON messages.
    Keeps its own buffers so that a read timeout (used to poll) loses nothing."""

    def __init__(self, host: str, port: int, path: str, body: dict, connect_timeout_s: float, poll_s: float) -> None:
        self.sock = socket.create_connection((host, port), timeout=connect_timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        data = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Grpc-Metadata-Hasleader: true\r\nContent-Length: {len(data)}\r\n\r\n"
        ).encode()
        self.sock.sendall(head + data)
        self.sock.settimeout(poll_s)
        self.raw = b""  # undecoded bytes from the socket
        self.text = b""  # decoded body bytes not yet split into lines
        self.status: int | None = None
        self.chunked = False
        self.chunk_left = 0  # bytes left in the current chunk (chunked mode)
        self.done = False

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def _fill(self) -> None:
        """Read once from the socket (socket.timeout propagates: nothing lost)."""
        b = self.sock.recv(65536)
        if not b:
            raise _StreamClosed("connection closed by etcd")
        self.raw += b

    def _headers(self) -> None:
        while b"\r\n\r\n" not in self.raw:
            self._fill()
        head, self.raw = self.raw.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        self.status = int(lines[0].split()[1])
        for line in lines[1:]:
            k, _, v = line.partition(":")
            if k.strip().lower() == "transfer-encoding" and "chunked" in v.lower():
                self.chunked = True

    def _decode(self) -> bool:
        """Move decoded body bytes from raw to text; False if more input is needed."""
        if not self.chunked:
            self.text += self.raw
            self.raw = b""
            return True
        progressed = False
        while True:
            if self.chunk_left == 0:
                if b"\r\n" not in self.raw:
                    return progressed
                size_line, rest = self.raw.split(b"\r\n", 1)
                if not size_line:  # CRLF after a chunk's data
                    self.raw = rest
                    continue
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    self.done = True
                    self.raw = b""
                    return True
                self.raw = rest
                self.chunk_left = size
            take = self.raw[: self.chunk_left]
            self.text += take
            self.raw = self.raw[len(take):]
            self.chunk_left -= len(take)
            progressed = progressed or bool(take)
            if self.chunk_left:
                return progressed

    def _pop(self) -> dict | None:
        text = self.text.lstrip()
        if not text:
            self.text = b""
            return None
        try:
            s = text.decode("utf-8")
            obj, end = json.JSONDecoder().raw_decode(s)
        except ValueError:
            self.text = text
            return None  # incomplete message (or a UTF-8 sequence cut in two)
        self.text = s[end:].encode("utf-8")
        return obj

    def next_message(self) -> dict:
        """Next JSON message; raises socket.timeout (poll: nothing is lost), _StreamClosed."""
        if self.status is None:
            self._headers()
        while True:
            self._decode()
            msg = self._pop()
            if msg is not None:
                return msg
            if self.done:
                raise _StreamClosed("stream ended")
            self._fill()


class Watch:
    """A running watch (see :meth:`EtcdKV.watch_prefix`).

    ``cancel()`` stops it. Without a callback, iterate it (``for ev in w``,
    ``async for ev in w``) or call ``get(timeout_s)``. ``revision`` is the last
    revision delivered; ``error`` the terminal error, if any.
    """

    def __init__(self, kv: EtcdKV, key: bytes, range_end: bytes, start_revision: int, callback, on_error, prev_kv, probe_after_s) -> None:
        self.kv = kv
        self.key = key
        self.range_end = range_end
        self.callback = callback
        self.on_error = on_error
        self.prev_kv = prev_kv
        self.probe_after_s = probe_after_s
        self.revision = 0  # last delivered event's revision
        self._next_start = start_revision  # where a (re)connect starts
        self.error: EtcdError | None = None
        self.reconnects = 0
        self._cancelled = threading.Event()
        self._created = threading.Event()
        self._create_error: BaseException | None = None
        self._q: queue.Queue = queue.Queue()
        self._qlock = threading.Lock()
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._aq: asyncio.Queue | None = None
        self._stream: _HttpStream | None = None
        self._endpoint = kv._current
        self._established = False
        self._thread = threading.Thread(target=self._run, name="etcd-watch", daemon=True)

    # ------------------------------------------------------------ public
    @property
    def endpoint(self) -> str:
        return self.kv.endpoints[self._endpoint]

    def cancel(self) -> None:
        self._cancelled.set()
        s = self._stream
        if s is not None:
            s.close()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=WATCH_CANCEL_JOIN_S)
        self._emit(_END)

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def get(self, timeout_s: float | None = None) -> WatchEvent | None:
        """Next event, or None on timeout / after the watch ended; raises the terminal error."""
        try:
            item = self._q.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if item is _END:
            self._q.put(_END)
            if self.error is not None:
                raise self.error
            return None
        if isinstance(item, BaseException):
            self._q.put(_END)
            raise item
        return item

    def __iter__(self) -> Iterator[WatchEvent]:
        while True:
            ev = self.get()
            if ev is None:
                return
            yield ev

    def __aiter__(self) -> AsyncIterator[WatchEvent]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[WatchEvent]:
        with self._qlock:
            if self._aloop is None:
                self._aloop = asyncio.get_running_loop()
                self._aq = asyncio.Queue()
                while True:  # move what arrived before iteration began
                    try:
                        self._aq.put_nowait(self._q.get_nowait())
                    except queue.Empty:
                        break
        assert self._aq is not None
        while True:
            item = await self._aq.get()
            if item is _END:
                self._aq.put_nowait(_END)
                if self.error is not None:
                    raise self.error
                return
            if isinstance(item, BaseException):
                self._aq.put_nowait(_END)
                raise item
            yield item

    # ------------------------------------------------------------ internals
    def _emit(self, item: Any) -> None:
        if self.callback is not None and isinstance(item, WatchEvent):
            try:
                self.callback(item)
            except Exception:
                log.exception("etcd watch callback failed")
            return
        if self.callback is not None and isinstance(item, BaseException):
            if self.on_error is not None:
                try:
                    self.on_error(item)
                except Exception:
                    log.exception("etcd watch on_error callback failed")
            else:
                log.error("etcd watch on %r ended: %s", self.key, item)
            return
        with self._qlock:
            if self._aloop is not None and self._aq is not None:
                try:
                    self._aloop.call_soon_threadsafe(self._aq.put_nowait, item)
                except RuntimeError:  # loop closed
                    pass
            else:
                self._q.put(item)
        if isinstance(item, BaseException) and self.on_error is not None:
            try:
                self.on_error(item)
            except Exception:
                log.exception("etcd watch on_error callback failed")

    def _start(self) -> None:
        if self._next_start > 0:
            # A compacted start revision shows on the stream only after "created";
            # ask first so that watch_prefix() itself raises EtcdCompacted.
            try:
                self.kv._call(
                    "/kv/range",
                    {"key": _enc(self.key), "revision": str(self._next_start), "limit": "1", "count_only": True},
                    mutation=False,
                )
            except EtcdCompacted:
                raise
            except EtcdServerError as e:
                if "future revision" not in e.message:
                    raise
        self._thread.start()
        deadline = self.kv.failover_timeout_s + self.kv.request_timeout_s + 1
        if not self._created.wait(deadline):
            self.cancel()
            raise EtcdUnavailable(f"watch on {self.key!r} not established within {deadline:.0f}s")
        if self._create_error is not None:
            self.cancel()
            raise self._create_error

    def _fail(self, e: EtcdError) -> None:
        self.error = e
        if not self._created.is_set():
            self._create_error = e
            self._created.set()
            return
        self._emit(e)
        self._emit(_END)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # never die silently
            if not self._cancelled.is_set():
                err = e if isinstance(e, EtcdError) else EtcdError(f"watch thread failed: {e!r}")
                self._fail(err)
        finally:
            with self.kv._lock:
                self.kv._watches.discard(self)

    def _loop(self) -> None:
        kv = self.kv
        n = len(kv._eps)
        down_since: float | None = None
        delay = RETRY_BACKOFF_FIRST_S
        last_problem = ""
        while not self._cancelled.is_set():
            i = self._endpoint
            host, port = kv._eps[i]
            create: dict[str, Any] = {"key": _enc(self.key), "progress_notify": True}
            if self.range_end:
                create["range_end"] = _enc(self.range_end)
            if self._next_start:
                create["start_revision"] = str(self._next_start)
            if self.prev_kv:
                create["prev_kv"] = True
            problem = ""
            self._established = False
            try:
                self._stream = _HttpStream(host, port, kv.api_prefix + "/watch", {"create_request": create}, kv.request_timeout_s, WATCH_POLL_S)
                if self._cancelled.is_set():
                    return
                problem = self._consume(self._stream)
                if problem == "":
                    return  # cancelled
            except EtcdCompacted as e:
                self._fail(e)
                return
            except EtcdServerError as e:
                problem = e.message
                if not _is_unavailable(e):
                    self._fail(e)
                    return
            except (OSError, _StreamClosed, ValueError) as e:
                problem = f"{type(e).__name__}: {e}"
            finally:
                if self._stream is not None:
                    self._stream.close()
                    self._stream = None
            if self._cancelled.is_set():
                return
            # Reconnect (next endpoint), resuming after the last delivered revision.
            if self._established:  # that stream worked: a new outage starts now
                down_since, delay = None, RETRY_BACKOFF_FIRST_S
            last_problem = f"{kv.endpoints[i]}: {problem}"
            log.info("etcd watch on %r: %s; reconnecting from revision %s", self.key, last_problem, self._next_start)
            self._endpoint = (i + 1) % n
            now = time.monotonic()
            if down_since is None:
                down_since = now
            if now - down_since > kv.failover_timeout_s:
                self._fail(EtcdUnavailable(f"watch on {self.key!r}: no endpoint for {kv.failover_timeout_s}s; last: {last_problem}"))
                return
            if self._endpoint == 0 or n == 1:
                self._cancelled.wait(delay)
                delay = min(delay * 2, RETRY_BACKOFF_MAX_S)
            self.reconnects += 1

    def _consume(self, s: _HttpStream) -> str:
        """Read one stream until it breaks (returns why) or the watch is cancelled (returns "")."""
        last_msg = time.monotonic()
        while not self._cancelled.is_set():
            try:
                msg = s.next_message()
            except socket.timeout:
                if time.monotonic() - last_msg > self.probe_after_s:
                    # Silent for a while: is the member still there (not paused or dead)?
                    try:
                        self.kv._post_once(self._endpoint, "/maintenance/status", {}, timeout_s=min(WATCH_PROBE_TIMEOUT_S, self.kv.request_timeout_s))
                        last_msg = time.monotonic()
                    except (_Safe, _Ambiguous, EtcdError) as e:
                        return f"liveness probe failed: {e}"
                continue
            last_msg = time.monotonic()
            if "error" in msg:
                raise _error_from_body(s.status or 200, json.dumps(msg).encode())
            res = msg.get("result") or {}
            if res.get("canceled"):
                crev = int(res.get("compact_revision", 0))
                if crev:
                    raise EtcdCompacted(
                        f"mvcc: required revision {self._next_start} has been compacted (oldest {crev})", crev
                    )
                return f"watch canceled by etcd: {res.get('cancel_reason', '')}"
            if res.get("created"):
                if not self._next_start:
                    self._next_start = int(res["header"]["revision"]) + 1
                self._established = True
                self._created.set()
                continue
            events = res.get("events") or []
            if not events:
                # Progress notification: every event up to header.revision was delivered.
                hrev = int((res.get("header") or {}).get("revision", 0))
                if hrev + 1 > self._next_start:
                    self._next_start = hrev + 1
                continue
            top = 0
            for item in events:
                kv = item.get("kv") or {}
                rev = int(kv.get("mod_revision", 0))
                if rev < self._next_start:
                    continue  # already delivered before a reconnect
                prev = item.get("prev_kv")
                ev = WatchEvent(
                    item.get("type", "PUT"),
                    _dec(kv.get("key")),
                    _dec(kv.get("value")),
                    rev,
                    int(kv.get("create_revision", 0)),
                    int(kv.get("version", 0)),
                    int(kv.get("lease", 0)),
                    _dec(prev.get("value")) if prev else None,
                )
                self.revision = rev
                top = max(top, rev)
                self._emit(ev)
            if top:
                self._next_start = top + 1
        return ""
