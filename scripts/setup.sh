#!/usr/bin/env bash
# Idempotent bootstrap: creates .venv (system python3) and installs kvcc
# editable with the repo's constraints. Fast no-op when already up to date.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PYTHON="${PYTHON:-python3}"
VENV="$ROOT/.venv"
STAMP="$VENV/.kvcc-installed"

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV with $(command -v "$PYTHON")" >&2
    "$PYTHON" -m venv "$VENV"
    rm -f "$STAMP"
fi

# Reinstall only when the stamp is missing or older than any install input.
needs_install=0
if [ ! -f "$STAMP" ]; then
    needs_install=1
else
    for f in pyproject.toml constraints.txt scripts/setup.sh; do
        if [ "$f" -nt "$STAMP" ]; then needs_install=1; fi
    done
fi

if [ "$needs_install" = 1 ]; then
    # [mooncake]: a real Mooncake Store for the mooncake adapters (no torch; see pyproject.toml).
    echo "setup: pip install -c constraints.txt -e .[mooncake] (quiet)" >&2
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
        -c constraints.txt -e ".[mooncake]"
    # Guard: never a CUDA torch, never torchvision or nvidia-* wheels.
    "$VENV/bin/python" - <<'PY'
import sys
from importlib.metadata import distributions, version
names = {(d.metadata["Name"] or "").lower() for d in distributions()}
bad = sorted(n for n in names if n == "torchvision" or n.startswith("nvidia-"))
tv = version("torch")
if bad or not (tv.startswith("2.13.0") and tv.endswith("+cpu")):
    sys.exit(f"setup: bad environment: torch=={tv}, unwanted packages: {bad}")
PY
    touch "$STAMP"
fi
