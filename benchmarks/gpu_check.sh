#!/usr/bin/env bash
# The one GPU command: everything that needs a GPU, in ≤ 8 minutes on one H200, into one
# Markdown file. Run it first on any CUDA host:
#
#     bash benchmarks/gpu_check.sh [OUT_DIR]        # default runs/gpu-check
#
# Steps (each with its own time limit, so one slow step cannot eat the others):
#   1. versions: torch, Triton, CUDA, driver, GPU;
#   2. the ahead-of-time compile of every kernel specialisation for sm_80 / sm_90 on this
#      host's Triton, with registers, spills and shared memory (python -m mita.kernels.aot);
#   3. the top-k paths side by side per layer, checked first (benchmarks/gpu_topk.py);
#   4. the kernel checks, attention-only and whole-model tables at 16K-1M vs flash
#      (benchmarks/gpu_mita.py);
#   5. the serving code path without Ray, CUDA graphs and the profiler overhead
#      (benchmarks/gpu_serving.py).
# The report is OUT_DIR/gpu_check.md; each step's full log is OUT_DIR/<step>.log.
set -u
cd "$(dirname "$0")/.."
OUT_DIR=${1:-runs/gpu-check}
mkdir -p "$OUT_DIR"
export PYTHONPATH=. PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
REPORT=$OUT_DIR/gpu_check.md
status=0

{
  echo "# GPU check, $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  $PY - <<'EOF'
import torch
import triton
print(f"- torch {torch.__version__}, CUDA {torch.version.cuda}, Triton {triton.__version__}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"- {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
          f"{p.total_memory / 2**30:.0f} GiB")
else:
    print("- no CUDA device")
EOF
  echo "- driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null || echo unknown)"
} > "$REPORT"

step() {  # step NAME LIMIT_S TABLE_FILE COMMAND...
  local name=$1 limit=$2 table=$3
  shift 3
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
  local rc=$?
  [ $rc -ne 0 ] && status=1
  {
    echo
    echo "## $name (exit $rc, $((SECONDS - t0)) s, limit $limit s)"
    echo
    if [ -n "$table" ] && [ -f "$table" ]; then cat "$table"; else tail -n 40 "$OUT_DIR/$name.log"; fi
  } >> "$REPORT"
}

# limits: 150 + 60 + 170 + 100 s = 8 min
step aot 150 "$OUT_DIR/aot.log" $PY -m mita.kernels.aot --table
step topk 60 "$OUT_DIR/gpu_topk.md" $PY benchmarks/gpu_topk.py --out "$OUT_DIR"
step mita 170 "$OUT_DIR/gpu_mita.md" $PY benchmarks/gpu_mita.py --out "$OUT_DIR" --budget-s 140
step serving 100 "$OUT_DIR/gpu_serving.md" $PY benchmarks/gpu_serving.py --out "$OUT_DIR" --budget-s 70
cat "$REPORT"
exit $status
