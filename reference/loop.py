"""Which event loop the runtime's processes use: uvloop where it is installed (a C event loop:
the transport's per-request cost is mostly the loop's), else asyncio's own. ``KVCC_EVENT_LOOP=
asyncio`` forces the standard loop (for comparisons and debugging)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

ENV_VAR = "KVCC_EVENT_LOOP"


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    if os.environ.get(ENV_VAR, "").strip().lower() != "asyncio":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop
    return asyncio.new_event_loop


def loop_name() -> str:
    return "uvloop" if loop_factory() is not asyncio.new_event_loop else "asyncio"
