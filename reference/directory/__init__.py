"""kvcc.reference.directory: the directory (metadata service) of the reference implementation.

- ``core``: the protocol as a sans-IO state machine (messages and time in; replies and effects
  out), every decision taken by a rule of ``kvcc.spec.rules``.
- ``store``: the embedded durable log (SQLite, WAL, synchronous=FULL) that the effects a reply
  depends on are committed to before the reply leaves, and that a restart reloads.

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
    ReserveLeaseIds,
    Send,
    Ticket,
)
from .store import DirectoryStore, Loaded

__all__ = [
    "CompleteTicket",
    "CopyAt",
    "DirectoryConfig",
    "DirectoryCore",
    "DirectoryStore",
    "Effect",
    "Emit",
    "ForgetTicket",
    "FreeAt",
    "Loaded",
    "Persist",
    "PersistTicket",
    "ReadLease",
    "Record",
    "ReserveLeaseIds",
    "Send",
    "Ticket",
]
