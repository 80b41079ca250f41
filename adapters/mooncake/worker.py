"""A store node: one Mooncake Store client in its own process, driven over two pipes.

Run by ``kvcc.adapters.mooncake.harness.StoreNode`` as
``python -m kvcc.adapters.mooncake.worker --req-fd R --resp-fd W --master HOST:PORT
--metadata URL --segment-bytes N --buffer-bytes N``; never by hand.

Theory of operation
-------------------
The process sets up ``MooncakeDistributedStore`` against the given master over TCP on loopback,
mounting a global segment of ``--segment-bytes`` of its own memory into the shared pool (so the
objects other nodes put may live here, and die with this process), then answers requests of
``kvcc.adapters.mooncake.protocol`` until its request pipe closes or a ``close`` request comes.

Requests run on a small thread pool: the store client is thread-safe, and a request that waits on
a paused or dead peer's segment must not hold up the others. Replies are written whole under a
lock. Every operation maps to exactly one store call and returns its raw result (an int return
code, negative for the store's error codes; values as the payload): deciding what a code means is
the adapters' business, not the node's.

The process asks the kernel to SIGKILL it when its parent dies (``PR_SET_PDEATHSIG``), so a
harness that is itself killed leaves no node behind.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from kvcc.adapters.mooncake.protocol import READY_ID, FrameError, PipeClosed, encode, read_frame, write_all

REQUEST_THREADS = 4  # concurrent store calls per node
READ_BUFFER_BYTES = 4 << 20  # one registered buffer per request thread for get_into
RC_BUFFER_TOO_SMALL = -600  # get_into's code when the value is larger than the buffer
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the harness's stop() and atexit hook still reap us
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


class Node:
    def __init__(self, store: Any, resp_fd: int) -> None:
        self.store = store
        self.resp_fd = resp_fd
        self.write_lock = threading.Lock()
        self.local = threading.local()
        self.ops: dict[str, Callable[[dict[str, Any], bytes], tuple[Any, bytes]]] = {
            "ping": lambda a, p: ({"pid": os.getpid()}, b""),
            "put": self._put,
            "upsert": lambda a, p: (self.store.upsert(a["key"], p), b""),
            "get": self._get,
            "is_exist": lambda a, p: (self.store.is_exist(a["key"]), b""),
            "batch_is_exist": lambda a, p: (list(self.store.batch_is_exist(list(a["keys"]))), b""),
            "get_size": lambda a, p: (self.store.get_size(a["key"]), b""),
            "remove": lambda a, p: (self.store.remove(a["key"], bool(a.get("force", False))), b""),
            "remove_by_regex": lambda a, p: (
                self.store.remove_by_regex(a["pattern"], bool(a.get("force", False))),
                b"",
            ),
            "remove_all": lambda a, p: (self.store.remove_all(bool(a.get("force", False))), b""),
            "health": lambda a, p: (self.store.health_check(), b""),
            "hostname": lambda a, p: (self.store.get_hostname(), b""),
        }

    def _put(self, args: dict[str, Any], payload: bytes) -> tuple[Any, bytes]:
        """put, placed in the segment ``preferred_segment`` names (a node's own) if given."""
        segment = args.get("preferred_segment")
        if not segment:
            return self.store.put(args["key"], payload), b""
        from mooncake.store import ReplicateConfig

        config = ReplicateConfig()
        config.replica_num = 1
        config.preferred_segment = str(segment)
        return self.store.put(args["key"], payload, config), b""

    def _buffer(self) -> tuple[ctypes.Array, int]:
        buf = getattr(self.local, "buf", None)
        if buf is None:
            buf = ctypes.create_string_buffer(READ_BUFFER_BYTES)
            rc = self.store.register_buffer(ctypes.addressof(buf), READ_BUFFER_BYTES)
            if rc != 0:
                raise RuntimeError(f"register_buffer returned {rc}")
            self.local.buf = buf
        return buf, ctypes.addressof(buf)

    def _get(self, args: dict[str, Any], payload: bytes) -> tuple[Any, bytes]:
        """get_into, which tells why a read failed (get() answers b'' for every failure); a
        value larger than the buffer falls back to get()."""
        buf, addr = self._buffer()
        rc = self.store.get_into(args["key"], addr, READ_BUFFER_BYTES)
        if rc == RC_BUFFER_TOO_SMALL:
            data = self.store.get(args["key"])
            return (len(data) if data else RC_BUFFER_TOO_SMALL), bytes(data)
        if rc < 0:
            return rc, b""
        return rc, ctypes.string_at(addr, rc)

    def reply(self, header: dict[str, Any], payload: bytes = b"") -> None:
        frame = encode(header, payload)
        with self.write_lock:
            write_all(self.resp_fd, frame)

    def serve(self, req_id: int, op: str, args: dict[str, Any], payload: bytes) -> None:
        try:
            fn = self.ops.get(op)
            if fn is None:
                self.reply({"id": req_id, "ok": False, "error": f"unknown op {op!r}"})
                return
            result, out = fn(args, payload)
            self.reply({"id": req_id, "ok": True, "result": result}, out)
        except BrokenPipeError:
            os._exit(0)  # the harness is gone
        except Exception as e:  # a bad argument or a store exception: answer it, keep serving
            self.reply({"id": req_id, "ok": False, "error": f"{type(e).__name__}: {e}"})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcc.adapters.mooncake.worker")
    ap.add_argument("--req-fd", type=int, required=True)
    ap.add_argument("--resp-fd", type=int, required=True)
    ap.add_argument("--master", required=True)
    ap.add_argument("--metadata", required=True)
    ap.add_argument("--hostname", default="127.0.0.1")
    ap.add_argument("--segment-bytes", type=int, required=True)
    ap.add_argument("--buffer-bytes", type=int, required=True)
    a = ap.parse_args(argv)
    _die_with_parent()
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(a.hostname, a.metadata, a.segment_bytes, a.buffer_bytes, "tcp", "", a.master)
    node = Node(store, a.resp_fd)
    node.reply({"id": READY_ID, "ok": rc == 0, "result": {"rc": rc, "pid": os.getpid()}})
    if rc != 0:
        return 2

    pool = ThreadPoolExecutor(max_workers=REQUEST_THREADS, thread_name_prefix="node")
    try:
        while True:
            try:
                header, payload = read_frame(a.req_fd)
            except PipeClosed:
                break
            except FrameError as e:
                print(f"worker: bad request frame: {e}", file=sys.stderr)
                return 3
            op = header.get("op")
            if op == "close":
                break
            pool.submit(node.serve, header["id"], str(op), dict(header.get("args") or {}), payload)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    # Leave the pool: unmount our segment so the master stops placing objects here.
    rc = store.close()
    try:
        node.reply({"id": READY_ID, "ok": True, "result": {"closed": rc}})
    except OSError:
        pass
    os._exit(0)  # skip interpreter teardown of the store's native threads


if __name__ == "__main__":
    sys.exit(main())
