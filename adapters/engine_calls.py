"""What the adapters that drive an engine's own kvcc code on the reference cluster share (``sglang``:
SGLang's HiCache backend; ``vllm``: vLLM's KV connector).

The engine's code makes a whole operation of what the contract splits into steps (SGLang's
``clear()`` and vLLM's ``reset_cache()`` each start a namespace invalidation and wait for it to
complete), so a contract step hands the engine's kvcc client what it needs and takes back what
the engine's code would have swallowed:

- ``Step``: what the contract step in progress hands the engine's code (the lease the contract
  acquired, the grant it began) and what it takes back (the kvcc answer, or what a kvcc call
  raised: the engine's code turns that into a miss or a failed save; the contract into
  ``AdapterError``). It travels in the ``current`` context variable, so a coroutine on the node
  client's loop thread sees the step of the thread that called it.
- ``ClearingAdapter``: the contract's ``invalidate`` of a whole namespace performed by such an
  engine call on a thread of its own: ``invalidate`` returns the ticket as soon as the directory
  answered the engine's invalidation (the engine's client hands it over with ``deliver``), and
  ``wait_invalidation`` waits for the engine call to return (``True``: it saw the invalidation
  complete).
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from kvcc.adapters.reference import ReferenceAdapter
from kvcc.conformance.contract import AdapterError, InvalidationTicket

TICKET_WAIT_S = 30.0  # the longest the contract's invalidate waits for the engine call's ticket
CLEAR_POLL_S = 0.05


class Step:
    """What the contract step in progress on this thread hands the engine's code."""

    read_lease: Any = None
    read_result: Any = None
    read_bytes: bytes | None = None  # what a read answered, as it answered it
    write_lease: Any = None
    written: bytes | None = None  # what the contract's write_bytes sent: the engine's save must match it
    commit_result: Any = None
    failure: BaseException | None = None  # what the kvcc call raised (the engine's code swallows it)


# The contract step an engine's kvcc call belongs to: a ContextVar, as an asynchronous engine's
# coroutine runs on the node client's loop thread, not the caller's (run_coroutine_threadsafe runs
# it in a copy of the caller's context, and gather's tasks copy it on).
current: contextvars.ContextVar[Step | None] = contextvars.ContextVar("kvcc_engine_step", default=None)


def failed(e: BaseException) -> None:
    """Record what a kvcc call raised on the step in progress (the engine's code will swallow it)."""
    step = current.get()
    if step is not None:
        step.failure = e


class TicketHandover:
    """The tickets of namespace invalidations a node's engine code starts, handed to the contract
    steps waiting for them, in order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: list[concurrent.futures.Future] = []

    def expect(self) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._waiting.append(fut)
        return fut

    def deliver(self, ticket: Any) -> None:
        with self._lock:
            fut = self._waiting.pop(0) if self._waiting else None
        if fut is not None and not fut.done():
            fut.set_result(ticket)

    def forget(self, fut: concurrent.futures.Future) -> None:
        with self._lock:
            if fut in self._waiting:
                self._waiting.remove(fut)

    def fail_all(self, why: str) -> None:
        with self._lock:
            waiting, self._waiting = self._waiting, []
        for fut in waiting:
            if not fut.done():
                fut.set_exception(AdapterError(why))


class ClearingAdapter(ReferenceAdapter):
    """A reference-cluster adapter whose namespace invalidations are an engine's call."""

    ENGINE_VERSION: tuple[str, str] = ("", "")  # (report key, distribution) of the engine's code

    def __init__(self, backend: str = "sqlite") -> None:
        super().__init__(backend)
        self._clears: dict[int, tuple[threading.Thread, list[bool], str, Any]] = {}  # ticket -> the call's run

    def versions(self) -> Mapping[str, str]:
        from importlib.metadata import version

        out = dict(super().versions())
        key, distribution = self.ENGINE_VERSION
        if key:
            out[key] = version(distribution)
        return out

    def _invalidate_through(self, node: str, handover: TicketHandover, call: Callable[[], Any], what: str) -> InvalidationTicket:
        """Run ``call`` (it starts a namespace invalidation through node ``node``'s client, whose
        ticket it hands over, and waits for it) on a thread; the ticket, once the directory answered."""
        sync = self._client(node)
        fut = handover.expect()
        done: list[bool] = []  # the call's answer, once it returned

        def run() -> None:
            try:
                done.append(bool(call()))
            except BaseException as e:  # noqa: BLE001 -- handed to the waiting contract step
                if not fut.done():
                    fut.set_exception(AdapterError(f"{what} failed: {type(e).__name__}: {e}"))
            finally:
                handover.forget(fut)
                if not fut.done():
                    fut.set_exception(AdapterError(f"{what} returned without an invalidation"))

        t = threading.Thread(target=run, name=f"{what}-{node}", daemon=True)
        t.start()
        try:
            ticket = fut.result(TICKET_WAIT_S)
        except concurrent.futures.TimeoutError:
            raise AdapterError(f"{what} got no invalidation ticket in time") from None
        with self._lock:
            self._clears[ticket.id] = (t, done, node, sync)
        return InvalidationTicket(ticket.id, ticket.keys)

    def wait_invalidation(self, ticket: InvalidationTicket, timeout_s: float) -> bool:
        """A ticket of an engine call: its answer, once it returned (it waits for the completion
        itself). The node's client gone meanwhile (killed), or the call failed: the ticket,
        waited for by any live client, as ``reference`` does."""
        with self._lock:
            run = self._clears.get(ticket.id)
        if run is None:
            return super().wait_invalidation(ticket, timeout_s)
        thread, done, node, sync = run
        deadline = time.monotonic() + timeout_s
        while thread.is_alive() and self._clients.get(node) is sync:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            thread.join(min(left, CLEAR_POLL_S))
        if not thread.is_alive() and done == [True]:
            return True
        return super().wait_invalidation(ticket, max(0.0, deadline - time.monotonic()))
