#!/usr/bin/env bash
# The one GPU command: everything that needs a GPU, within its steps' limits (60 + 180 + 60
# + 45 + 60 s, under 7 min with the preflight; not yet timed on a GPU), into Markdown files
# written as each table is ready. Run it first on any CUDA host:
#
#     bash benchmarks/gpu_check.sh [OUT_DIR]        # default runs/gpu-check
#     bash benchmarks/gpu_check.sh --dry            # on any machine: what it would compile
#
# Steps (each with its own time limit, so one slow step cannot eat the others):
#   0. preflight: versions, one tiny Triton launch, the packages each step imports — one line
#      and exit 1 if the driver, Triton or a package does not fit;
#   1. warm: every Triton specialisation the run uses (benchmarks/gpu_compiles.py lists them,
#      per step, against a budget), compiled in one process per core into Triton's cache; each
#      later step prints how many fresh compiles it still made;
#   2. mita: the correctness checks, then whole model vs flash at 16K-1M with the per-stage
#      CUDA-event profile, then one layer (benchmarks/gpu_mita.py; gpu_mita.md rewritten
#      after each part);
#   3. training: the Triton backward's gradients against float64, then one layer's forward +
#      backward against flash's, bfloat16, 16K-256K (benchmarks/gpu_training.py);
#   4. topk: the top-k paths side by side per layer, checked first (benchmarks/gpu_topk.py);
#   5. serving: the serving code path without Ray (benchmarks/gpu_serving.py; needs pydantic).
# The report is OUT_DIR/gpu_check.md; each step's full log is OUT_DIR/<step>.log.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "${1:-}" = "--dry" ]; then  # no GPU needed: the specialisations per step, and the budget
  exec env PYTHONPATH=. "$PY" benchmarks/gpu_compiles.py --list
fi
OUT_DIR=${1:-runs/gpu-check}
mkdir -p "$OUT_DIR"
export PYTHONPATH=. PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/$OUT_DIR/triton-cache}
REPORT=$OUT_DIR/gpu_check.md
status=0

fresh() { find "$TRITON_CACHE_DIR" -name '*.cubin' 2>/dev/null | wc -l; }

(  # a subshell: its exit 1 reaches the cat below, which prints why
  echo "# GPU check, $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  if ! $PY - <<'PYEOF'
import sys
try:
    import numpy, safetensors, torch, triton, triton.language as tl
except ImportError as e:
    sys.exit(f"- preflight failed: {e}")
print(f"- torch {torch.__version__}, CUDA {torch.version.cuda}, Triton {triton.__version__}")
from mita.kernels import triton_supported
if triton_supported() is not None:
    sys.exit(f"- preflight failed: {triton_supported()}")
if not torch.cuda.is_available():
    sys.exit("- preflight failed: no CUDA device")
p = torch.cuda.get_device_properties(0)
print(f"- {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
      f"{p.total_memory / 2**30:.0f} GiB")

@triton.jit
def _add_one(X, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(X + i, tl.load(X + i) + 1)

x = torch.arange(16, device="cuda", dtype=torch.float32)
try:
    _add_one[(1,)](x, 16)
    torch.cuda.synchronize()
except Exception as e:
    sys.exit(f"- preflight failed: a one-line Triton kernel does not run: {type(e).__name__}: "
             f"{str(e)[:300]}")
if not torch.equal(x.cpu(), torch.arange(1, 17, dtype=torch.float32)):
    sys.exit("- preflight failed: a one-line Triton kernel computed a wrong result")
print("- a one-line Triton kernel compiled and ran")
try:
    import pydantic  # noqa: F401
except ImportError:
    print("- no pydantic: the serving step is skipped")
PYEOF
  then
    echo "- driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null || echo unknown)"
    exit 1
  fi
  echo "- driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null || echo unknown)"
) > "$REPORT" 2>&1 || { cat "$REPORT"; exit 1; }
cat "$REPORT"

step() {  # step NAME LIMIT_S TABLE_FILE COMMAND...
  local name=$1 limit=$2 table=$3
  shift 3
  local t0=$SECONDS before
  before=$(fresh)
  timeout "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
  local rc=$?
  [ $rc -ne 0 ] && status=1
  {
    echo
    echo "## $name (exit $rc, $((SECONDS - t0)) s, limit $limit s, $(( $(fresh) - before )) fresh compiles)"
    echo
    if [ -n "$table" ] && [ -f "$table" ]; then cat "$table"; else tail -n 40 "$OUT_DIR/$name.log"; fi
  } >> "$REPORT"
  echo "$name: exit $rc, $((SECONDS - t0)) s"
}

# the run's compiles, listed by benchmarks/gpu_compiles.py, one process per core
step warm 60 "" $PY benchmarks/gpu_compiles.py --warm
step mita 180 "$OUT_DIR/gpu_mita.md" $PY benchmarks/gpu_mita.py --out "$OUT_DIR" --budget-s 150
step training 60 "$OUT_DIR/gpu_training.md" $PY benchmarks/gpu_training.py --out "$OUT_DIR" --budget-s 45
step topk 45 "$OUT_DIR/gpu_topk.md" $PY benchmarks/gpu_topk.py --out "$OUT_DIR"
if $PY -c "import pydantic" 2>/dev/null; then
  step serving 60 "$OUT_DIR/gpu_serving.md" $PY benchmarks/gpu_serving.py --out "$OUT_DIR" --budget-s 45
fi
cat "$REPORT"
exit $status
