#!/usr/bin/env bash
# Install what the tests need (system packages: scripts/system-deps.sh; the venv with the vllm extra:
# scripts/setup.sh --with vllm),
# then run the whole test suite from the repo root. Nothing the tests need is left to skip.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

export PYTHONSAFEPATH=1
export DO_NOT_TRACK=1 VLLM_NO_USAGE_STATS=1 LMCACHE_TRACK_USAGE=false HF_HUB_OFFLINE=1

bash scripts/system-deps.sh
bash scripts/setup.sh --with vllm
# loadgroup: a module that starts one expensive server for all its tests (a vLLM engine) is one
# xdist group, run by one worker; every other test is spread as usual.
exec .venv/bin/python -m pytest -n auto --dist loadgroup -q "$@"
