#!/usr/bin/env bash
# The SGLang engine profile on a CUDA machine: two real SGLang servers whose HiCache L3 is kvcc's
# backend (kvcc.adapters.sglang), driven by the conformance suite's engine tests, then SGLang's
# tests that run on CPU, in the same environment.
#
# The environment (PYTHON, default .venv-sglang-cuda/bin/python if it exists, else python3) must
# hold SGLang's CUDA build and the project, e.g. on a machine with network access:
#   python3 -m venv .venv-sglang-cuda && . .venv-sglang-cuda/bin/activate
#   pip install "sglang==0.5.23"                  # its CUDA torch, kernels, transformers
#   pip install --no-deps -e . && pip install attrs hypothesis z3-solver rich uvloop xxhash \
#       prometheus-client matplotlib pytest pytest-xdist msgpack pyzmq tokenizers
# (not scripts/setup.sh: that one pins the CPU torch this project's CI uses).
#
# Results go to $OUT when set (else a fresh temp directory, printed at the end):
#   sglang-env.txt      torch, CUDA, SGLang and device facts
#   engine-bundle/      the conformance report bundle of `kvcc conform --adapter sglang --profile engine`
#   engine-report.json  the same report as one JSON object
#   sglang-tests.txt    tests/test_sglang_server.py and tests/test_sglang.py in this environment
#
# Exit 0 only when CUDA is there, every engine test ran and passed (none NOT_APPLICABLE), the
# conform run exited 0, and the tests passed. Without CUDA it exits 3 after saying so. TIMEOUT_S: per step (default 1800).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv-sglang-cuda/bin/python ]; then PYTHON=.venv-sglang-cuda/bin/python; else PYTHON=python3; fi
fi
RESULTS="${OUT:-$(mktemp -d -t kvcc-sglang-cuda-XXXXXX)}"
mkdir -p "$RESULTS"
STEP_S="${TIMEOUT_S:-1800}"
export PYTHONSAFEPATH=1 DO_NOT_TRACK=1 VLLM_NO_USAGE_STATS=1 LMCACHE_TRACK_USAGE=false HF_HUB_OFFLINE=1

# 1. The environment: CUDA, SGLang's server and the project importable.
"$PYTHON" - >"$RESULTS/sglang-env.txt" 2>&1 <<'PY'
import importlib.util, sys
missing = [m for m in ("torch", "sglang", "transformers", "tokenizers", "zmq", "msgpack", "kvcc")
           if importlib.util.find_spec(m) is None]
if missing:
    print("missing Python modules:", ", ".join(missing), "(see the header of scripts/sglang_cuda.sh)")
    sys.exit(2)
import importlib.metadata as md
import torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda build", torch.version.cuda,
      "sglang", md.version("sglang"))
if not torch.cuda.is_available():
    print("CUDA unavailable: torch.cuda.is_available() is False")
    sys.exit(3)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name} {p.total_memory / 2**30:.0f} GiB")
PY
rc=$?
cat "$RESULTS/sglang-env.txt"
if [ "$rc" -ne 0 ]; then
    echo "sglang_cuda: environment not ready (exit $rc); results in $RESULTS" >&2
    exit "$rc"
fi

# 2. The engine profile: KVCC-ENGINE-001..005 against two SGLang servers on the test's cluster.
timeout "$STEP_S" "$PYTHON" -m kvcc conform --adapter sglang --profile engine --seed 1 \
    --out "$RESULTS/engine-bundle" --json >"$RESULTS/engine-report.json" 2>"$RESULTS/engine-report.err"
conform_rc=$?
[ -s "$RESULTS/engine-report.err" ] && tail -50 "$RESULTS/engine-report.err" >&2
"$PYTHON" - "$RESULTS/engine-report.json" <<'PY'
import json, sys
try:
    report = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    print("no report:", e)
    sys.exit(1)
engine = [r for r in report.get("results", []) if r.get("id", "").startswith("KVCC-ENGINE-")]
for r in engine:
    print(f"  {r['id']}: {r.get('status')} {(r.get('verdict') or {}).get('verdict', '')} {(r.get('message') or '')[:300]}")
print("certified:", json.dumps(report.get("certified")))
sys.exit(0 if engine and all(r.get("status") == "PASS" for r in engine) else 1)
PY
[ $? -eq 0 ] || conform_rc=1

# 3. SGLang's CPU tests, in this environment (they must pass here too).
timeout "$STEP_S" "$PYTHON" -m pytest tests/test_sglang_server.py tests/test_sglang.py -rs -q -n 0 2>&1 \
    | tee "$RESULTS/sglang-tests.txt"
tests_rc=${PIPESTATUS[0]}

echo "sglang_cuda: conform exit $conform_rc, tests exit $tests_rc; results in $RESULTS"
[ "$conform_rc" -eq 0 ] && [ "$tests_rc" -eq 0 ]
