"""Helpers shared by the cluster state-machine tests (``test_cluster_stateful``: the in-process
machine; ``test_cluster_processes``: the machine over real processes): the node and client names,
the block size, how long the nodes may take to register with a restarted directory, the bytes of a
write attempt (``block_bytes``), both machines' Hypothesis settings (``MACHINE_SETTINGS``) and
``SEEN``, the count of the situations a run reached (a test clears it, runs its machine, then
checks what was reached). Importing it also opts out of the libraries' usage tracking
(``DO_NOT_TRACK`` and the like, unless already set)."""

from __future__ import annotations

import hashlib
import os
from collections import Counter

from hypothesis import HealthCheck, Phase

for _name, _value in {"DO_NOT_TRACK": "1", "VLLM_NO_USAGE_STATS": "1", "LMCACHE_TRACK_USAGE": "false",
                      "HF_HUB_OFFLINE": "1"}.items():  # fmt: skip
    os.environ.setdefault(_name, _value)

BLOCK_BYTES = 4096
REGISTER_TIMEOUT_S = 5.0

NODES = ("n1", "n2")
CLIENTS = ("c0", "c1")

SEEN: Counter[str] = Counter()


def block_bytes(key, gen: int, writer: str, nonce: int) -> bytes:
    """A block's bytes: distinct for every write attempt, of a length that varies."""
    seed = hashlib.sha256(key.digest + f"/{gen}/{writer}/{nonce}".encode()).digest()
    size = 256 + seed[0] * 8
    return (seed * (size // len(seed) + 1))[:size]


MACHINE_SETTINGS = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    database=None,
    phases=(Phase.explicit, Phase.generate),  # no shrinking: a failure prints its steps as found
)
