"""Known-bad variants of kvcc's vLLM connector, for the suite's own tests: the ``engine`` profile
must fail each (``tests/test_vllm_conformance.py``). Never for serving.

- ``NoCopyConnector``: a load reads the block under its lease and reports it loaded, but copies
  nothing into vLLM's paged KV tensors (the engine then attends over whatever the block held).
"""

from __future__ import annotations

from kvcc.adapters.vllm.conformance import VllmAdapter
from kvcc.adapters.vllm.connector import KvccConnector


class NoCopyConnector(KvccConnector):
    def _copy_in(self, block_id, staging) -> None:
        return None


class NoCopyAdapter(VllmAdapter):
    """``vllm`` whose engines run ``NoCopyConnector``."""

    engine_connector = ("kvcc.adapters.vllm.known_bad", "NoCopyConnector")


def no_copy() -> NoCopyAdapter:
    return NoCopyAdapter()
