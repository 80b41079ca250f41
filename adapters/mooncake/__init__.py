"""Mooncake Store under kvcc's conformance suite.

- ``harness``: a real deployment on loopback (``mooncake_master`` + store-node processes);
- ``worker``/``protocol``: the store-node process and the pipe protocol that drives it;
- ``raw`` (adapter ``mooncake-raw``): the contract mapped onto the store's native operations;
- ``adapter`` (adapter ``mooncake``): kvcc's directory on top, the store holding the bytes.

Importing this package does not import the store's native module: only the worker processes do.
"""
