#!/usr/bin/env bash
# Bootstrap (scripts/setup.sh) then run the test suite from the repo root.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

export PYTHONSAFEPATH=1
export DO_NOT_TRACK=1 VLLM_NO_USAGE_STATS=1 LMCACHE_TRACK_USAGE=false HF_HUB_OFFLINE=1

bash scripts/setup.sh
exec .venv/bin/python -m pytest -n auto -q "$@"
