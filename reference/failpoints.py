"""Failpoints: a process kills itself at a named point of its code, for fault tests that need a
crash exactly there (etcd's gofail does the same for its own tests).

``KVCC_FAILPOINTS="name=N[,name=N...]"`` in a process's environment arms them: the ``N``-th time
that process reaches ``failpoint(name)`` it sends itself SIGKILL -- a kill -9 at that instruction,
with nothing flushed or closed. Unarmed (the variable unset, the only way a deployment runs), a
failpoint is one test of an empty dict. The variable is read at the first failpoint a process
reaches (a process forked from a zygote has its own environment by then); a malformed one raises
``ValueError`` there.

Points:

- ``directory.committed_unlogged``: the directory server has made a step durable, with its
  event-log lines in the store's events tail, and not yet written the lines to its log.
"""

from __future__ import annotations

import os
import signal

ENV = "KVCC_FAILPOINTS"
POINTS = ("directory.committed_unlogged",)


def _armed(text: str) -> dict[str, int]:
    armed: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, count = item.partition("=")
        if name not in POINTS or not count.isdigit() or int(count) < 1:
            raise ValueError(f"{ENV}: {item!r} is not <point>=<count >= 1> with a point of {POINTS}")
        armed[name] = int(count)
    return armed


_ARMED: dict[str, int] | None = None  # read at the first failpoint reached


def failpoint(name: str) -> None:
    """Count one pass through ``name``; at its armed count, kill this process (SIGKILL)."""
    global _ARMED
    if _ARMED is None:
        _ARMED = _armed(os.environ.get(ENV, ""))
    if _ARMED and name in _ARMED:
        _ARMED[name] -= 1
        if _ARMED[name] == 0:
            os.kill(os.getpid(), signal.SIGKILL)
