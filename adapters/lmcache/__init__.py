"""LMCache for kvcc: ``raw`` (adapter ``lmcache-raw``), LMCache's own storage engine -- its CPU
and local-disk tiers, in this process -- under the conformance and performance suites, nothing
added, as ``mooncake-raw`` is for Mooncake Store. Needs LMCache (``scripts/setup.sh --with
lmcache``; ``--with vllm`` includes it). Importing this package imports neither LMCache nor torch."""
