"""kvcc.reference.directory: the directory (metadata service) of the reference implementation.

- ``core``: the protocol as a sans-IO state machine (messages and time in; replies and effects
  out), every decision taken by a rule of ``kvcc.spec.rules``.
- ``store``: the embedded durable log (SQLite, WAL, synchronous=FULL) that the effects a reply
  depends on are committed to before the reply leaves, and that a restart reloads.
- ``etcd_store``: the same interface on etcd (records as keys, one fenced transaction per
  commit, leases mirrored in time buckets, record changes as a resumable watch).
- ``durable``: what both stores share: rows, checked commit input, ``Loaded``, typed errors.

A server wires the two to a clock, the transport and an event log; see ``core``'s docstring for
what that runtime must do.
"""

from __future__ import annotations

from .core import (
    CompleteTicket,
    CopyAt,
    DirectoryConfig,
    DirectoryCore,
    Effect,
    Emit,
    ForgetTicket,
    FreeAt,
    Persist,
    PersistTicket,
    ReadLease,
    Record,
    MirrorLeases,
    ReserveLeaseIds,
    Send,
    Ticket,
)
from .durable import Deposed, InvalidEffect, Loaded, OwnerAlive, StoreCorrupt, StoreError, StoreFailed
from .etcd_store import EtcdDirectoryStore, RecordChange
from .store import DirectoryStore

__all__ = [
    "CompleteTicket",
    "CopyAt",
    "Deposed",
    "DirectoryConfig",
    "DirectoryCore",
    "DirectoryStore",
    "EtcdDirectoryStore",
    "Effect",
    "Emit",
    "ForgetTicket",
    "FreeAt",
    "InvalidEffect",
    "Loaded",
    "OwnerAlive",
    "Persist",
    "PersistTicket",
    "ReadLease",
    "Record",
    "RecordChange",
    "MirrorLeases",
    "ReserveLeaseIds",
    "Send",
    "StoreCorrupt",
    "StoreError",
    "StoreFailed",
    "Ticket",
]
