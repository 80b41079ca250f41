#!/usr/bin/env bash
# The GPU tier on a CUDA machine, in a few minutes: its tests with the pool forced onto the cuda
# device (pytest -k "gpu or cuda"), then `kvcc bench tiers --tiers gpu,dram --json`.
#
# Results go to $OUT when set (else a fresh temp directory, printed at the end):
#   gpu-env.txt        torch, CUDA and device facts
#   gpu-tests.txt      the pytest run (-rs: every skip with its reason)
#   gpu-tests.xml      the same as JUnit XML
#   bench-tiers.json   the benchmark's one JSON object (ratios against the raw copy, same run)
#
# Exit 0 only when CUDA is there, every selected test passed with none skipped, and the benchmark
# ran. Without CUDA it exits 3 after saying so (the same tests then skip with their reason in a
# plain `pytest tests/test_tiers*.py -rs`). Environment: PYTHON (default: .venv/bin/python if it
# exists, else python3), TIMEOUT_S per step (default 300), BENCH_ARGS (extra benchmark flags).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
RESULTS="${OUT:-$(mktemp -d -t kvcc-gpu-check-XXXXXX)}"
mkdir -p "$RESULTS"
STEP_S="${TIMEOUT_S:-300}"
export PYTHONSAFEPATH=1 DO_NOT_TRACK=1 VLLM_NO_USAGE_STATS=1 LMCACHE_TRACK_USAGE=false HF_HUB_OFFLINE=1

# 1. The environment: CUDA present, and the project's imports in place (the tiers need xxhash).
"$PYTHON" - >"$RESULTS/gpu-env.txt" 2>&1 <<'PY'
import importlib, sys
missing = [m for m in ("torch", "numpy", "attrs", "xxhash", "rich", "hypothesis", "pytest", "kvcc")
           if importlib.util.find_spec(m) is None]
if missing:
    print("missing Python modules:", ", ".join(missing),
          "(install the project: pip install -c constraints.txt -e . with a CUDA build of torch)")
    sys.exit(2)
import torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda build", torch.version.cuda)
if not torch.cuda.is_available():
    print("CUDA unavailable: torch.cuda.is_available() is False")
    sys.exit(3)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name} {p.total_memory / 2**30:.0f} GiB")
# A pinned round trip on a side stream, as the tier does it, before anything is measured.
x = torch.arange(1 << 20, dtype=torch.int32).to(torch.uint8).pin_memory()
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    d = x.to("cuda", non_blocking=True)
    back = torch.empty_like(x).pin_memory()
    back.copy_(d, non_blocking=True)
e = torch.cuda.Event()
e.record(s)
e.synchronize()
assert torch.equal(back, x), "pinned round trip through the device changed bytes"
print("pinned round trip ok")
PY
rc=$?
if [ "$rc" -ne 0 ]; then
    cat "$RESULTS/gpu-env.txt"
    echo "gpu_check: environment not ready (exit $rc); results in $RESULTS" >&2
    exit "$rc"
fi
cat "$RESULTS/gpu-env.txt"

# 2. The GPU-tier tests, the pool forced onto cuda (a CPU fallback fails them instead).
export KVCC_TEST_GPU_DEVICE=cuda
timeout "$STEP_S" "$PYTHON" -m pytest tests/test_tiers.py tests/test_tiers_recovery.py tests/test_tiers_stateful.py -k "gpu or cuda" -rs -q -n 0 \
    --junitxml="$RESULTS/gpu-tests.xml" 2>&1 | tee "$RESULTS/gpu-tests.txt"
tests_rc=${PIPESTATUS[0]}
skipped=$(grep -Eo '[0-9]+ skipped' "$RESULTS/gpu-tests.txt" | tail -1 | cut -d' ' -f1)
if [ "$tests_rc" -eq 0 ] && [ -n "$skipped" ] && [ "$skipped" != 0 ]; then
    echo "gpu_check: $skipped GPU test(s) skipped on a CUDA machine" >&2
    tests_rc=1
fi

# 3. Bandwidth against the raw copy measured in the same run.
# shellcheck disable=SC2086
timeout "$STEP_S" "$PYTHON" -m kvcc.bench.tiers --tiers gpu,dram --json ${BENCH_ARGS:-} \
    >"$RESULTS/bench-tiers.json" 2>"$RESULTS/bench-tiers.err"
bench_rc=$?
[ -s "$RESULTS/bench-tiers.err" ] && cat "$RESULTS/bench-tiers.err" >&2
if [ "$bench_rc" -eq 0 ]; then
    "$PYTHON" - "$RESULTS/bench-tiers.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"cuda={r['cuda']} sizes={[s >> 10 for s in r['sizes']]} KiB, ratio tier/raw (tier GB/s):")
for row in r["rows"]:
    print(f"  {row['tier']:<18} {row['op']:<5} {row['size'] >> 10:>6} KiB  {row['ratio']:5.2f}  "
          f"({row['tier_gb_per_s']:.1f} / {row['raw_gb_per_s']:.1f})  raw: {row['raw']}")
print("target met:", json.dumps(r["met"]))
PY
fi

echo "gpu_check: tests exit $tests_rc, bench exit $bench_rc; results in $RESULTS"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
