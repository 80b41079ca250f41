"""A kvcc client in a process of its own, for fault tests that stop, resume or kill it from outside.

Run as ``python tests/fault_client.py '<json spec>'``. The spec names the directory
(``directory: [host, port]``), the tenant and its token (hex), ``client_id``, ``skew_ms``, the
namespace digest (hex), the ``key`` (hex) and its ``parent`` (hex or null), the ``mode`` and, for
writes, ``size`` and ``seed`` (the bytes are ``payload(seed, size)``).

The process talks JSON lines on stdout and takes its go-ahead on stdin, so that a test can stop
it (SIGSTOP) exactly while it holds a lease, let the lease run out, and resume it (SIGCONT):

- ``write``: ``begin_write`` -> ``{"granted": {lease, epoch, gen, location}}`` (or ``{"refused"}``);
  waits for a line on stdin; ``write_bytes`` -> ``{"stored": null | reason}``; ``commit`` ->
  ``{"commit": "committed" | reason}``.
- ``read``: ``acquire`` and ``read`` -> ``{"leased": {lease, gen, location, sha256}}``; waits for a
  line on stdin; ``read`` again -> ``{"read": sha256 | null, "reason": ..., "budget_spent": bool}``,
  where ``budget_spent`` says whether the lease's budget had run out on this process's own clock
  when it tried (``holder_budget`` from when the acquire was sent).

It exits 0 when its script is done; any other exit is a failure the test reports.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import time

from kvcc.reference.client import KvccClient, Refused
from kvcc.spec.keys import BlockKey


def payload(seed: str, size: int) -> bytes:
    """Deterministic bytes for ``seed`` (the test computes the same)."""
    block = hashlib.sha256(seed.encode()).digest()
    return (block * (size // len(block) + 1))[:size]


def say(**fields) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


async def go_ahead() -> None:
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    if not line:
        raise SystemExit("stdin closed before the go-ahead")


async def main(spec: dict) -> None:
    ns = bytes.fromhex(spec["namespace"])
    key = BlockKey(bytes.fromhex(spec["key"]))
    parent = None if spec.get("parent") is None else BlockKey(bytes.fromhex(spec["parent"]))
    client = KvccClient(tuple(spec["directory"]), spec["tenant"], bytes.fromhex(spec["token"]),
                        client_id=spec["client_id"], skew_ms=spec["skew_ms"])  # fmt: skip
    await client.start()
    try:
        if spec["mode"] == "write":
            wl = await client.begin_write(ns, key, parent)
            if isinstance(wl, Refused):
                say(refused=wl.reason)
                return
            say(granted={"lease": wl.lease, "epoch": wl.epoch, "gen": wl.gen, "location": wl.location})
            await go_ahead()
            stored = await client.write_bytes(wl, payload(spec["seed"], spec["size"]))
            say(stored=None if stored is None else stored.reason)
            done = await client.commit(wl)
            say(commit=done.reason if isinstance(done, Refused) else "committed")
        elif spec["mode"] == "read":
            lease = await client.acquire(ns, key)
            if isinstance(lease, Refused):
                say(refused=lease.reason)
                return
            data = await client.read(lease)
            assert not isinstance(data, Refused), data
            say(leased={"lease": lease.lease, "gen": lease.gen, "location": lease.location,
                        "sha256": hashlib.sha256(data).hexdigest()})  # fmt: skip
            await go_ahead()
            spent = time.monotonic_ns() >= lease.trusted_until_ns
            again = await client.read(lease)
            if isinstance(again, Refused):
                say(read=None, reason=again.reason, budget_spent=spent)
            else:
                say(read=hashlib.sha256(again).hexdigest(), reason=None, budget_spent=spent)
        else:
            raise SystemExit(f"unknown mode {spec['mode']!r}")
    finally:
        await client.close()


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
