#!/usr/bin/env bash
# One-command GPU check for ftshims' rotary kernel (and every test under tests/gpu).
#
#   bash gpu/check.sh                 # on the GPU machine, from the repository root
#
# Steps (each logged; the summary table is printed last):
#   1. device + toolchain facts (nvidia-smi, nvcc, python, torch)
#   2. build the extension on the device (JIT, TORCH_CUDA_ARCH_LIST = the GPU's arch), timed;
#      plus `nvcc -Xptxas -v` on csrc/rotary_cuda.cu for registers/spills
#      (tools/nvcc_compile_check.py: no spills, 16-byte global loads/stores only in the vectorised kernels)
#   3. correctness: the CUDA kernel vs the fp64 oracle over the matrix of cases, gradcheck,
#      opcheck/torch.compile, bad input (tests/gpu/test_rotary_cuda.py), and every other
#      test under tests/gpu: `pytest -m gpu tests/gpu`
#   4. the benchmark (bench/rotary.py --device cuda): fraction of the copy bandwidth measured in the same run for
#      every path (cos/sin, in-kernel theta, in place), and speed against HF eager, Liger and flash-attn's Triton
#      rotary when present (.gpu_carry); rows judged by gpu/summarize_bench.py
#   5. compute-sanitizer memcheck on every kernel variant (gpu/sanitize_rotary.py), where it works
#   6. the training monitor's step-time overhead and host-device synchronisations (bench/monitor.py --device cuda)
#
# Optional extras carried from the CPU box (prepared by gpu/prepare.sh, carry ".gpu_carry"):
#   .gpu_carry/whl/*.whl                      wheels installed to /tmp/site (e.g. liger-kernel)
#   .gpu_carry/fa/flash_attn-2.8.3/           flash-attn's released rotary files (Triton) for parity + bench
#
# Budget: one deadline for the whole script, CHECK_BUDGET_S (default 480 s), so that with the machine's start
# it stays well inside a lent session's 15 minutes of device time. Each step gets at most its own cap (build 180,
# tests 150, sanitizer 90, bench 150, monitor 90 s) and never more than what is left; a step that finds too
# little time left is recorded SKIP (no time left), never silently dropped. Typical on an H100/H200: ~5 minutes.
# Outputs go to $OUT (or /tmp/ftshims-gpu-out): logs, bench.json, summary.txt. Afterwards, on the CPU box:
#   bash gpu/record.sh <the folder the files came back to>     # copies them to gpu/evidence/<date>_<gpu>/ to commit
set -u
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-/tmp/ftshims-gpu-out}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/ftshims-ext}"
export MAX_JOBS="${MAX_JOBS:-16}"
SUMMARY="$OUT_DIR/summary.txt"
: > "$SUMMARY"
T0=$(date +%s)

row() { printf '%-34s %-6s %s\n' "$1" "$2" "$3" | tee -a "$SUMMARY.rows" >/dev/null; }
: > "$SUMMARY.rows"
elapsed() { echo $(( $(date +%s) - T0 ))s; }
BUDGET=${CHECK_BUDGET_S:-480}
# seconds a step may take: its cap, or what is left of the budget (0: skip it)
allow() { local left=$(( BUDGET - ($(date +%s) - T0) )); [ "$left" -lt 20 ] && { echo 0; return; }; [ "$left" -lt "$1" ] && echo "$left" || echo "$1"; }

echo "=== 1. device"
nvidia-smi -L 2>&1 | tee "$OUT_DIR/device.txt"
nvcc --version 2>&1 | tail -1 | tee -a "$OUT_DIR/device.txt"
$PY -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO CUDA')" 2>&1 | tee -a "$OUT_DIR/device.txt"
ARCH=$($PY -c "import torch; c=torch.cuda.get_device_capability(); print(f'{c[0]}.{c[1]}')" 2>/dev/null || echo "9.0")
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$ARCH}"
export CUDA_HOME="${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}"

if [ -d .gpu_carry/whl ] && ls .gpu_carry/whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu_carry/whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
FA_DIR=$(ls -d .gpu_carry/fa/flash_attn-2.8.3 2>/dev/null || true)
if [ -n "$FA_DIR" ]; then export FTSHIMS_FA_GPU_SOURCES="$PWD/$FA_DIR"; fi

echo "=== 2. build (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST) [$(elapsed)]"
B0=$(date +%s)
timeout "$(allow 180)" $PY - <<'EOF' 2>&1 | tee "$OUT_DIR/build.log"
import time
from ftshims.kernels import _build
t = time.time()
ok = _build.load(jit=True)
st = _build.status()
print(f"BUILD loaded={ok} cuda={st['cuda']} how={st['how']} reason={st['reason']} seconds={time.time() - t:.1f}")
EOF
B1=$(date +%s)
if grep -q "BUILD loaded=True cuda=True" "$OUT_DIR/build.log"; then row "build (JIT, sm_${ARCH/./})" PASS "$((B1 - B0)) s"; else row "build (JIT)" FAIL "see build.log"; fi
SM="sm_${ARCH/./}"
T=$(allow 120)
if [ "$T" = 0 ]; then row "nvcc/ptxas ($SM)" SKIP "no time left"; else
timeout "$T" $PY tools/nvcc_compile_check.py --arch "${ARCH/./}" > "$OUT_DIR/ptxas.log" 2>&1
PTX_RC=$?
PTX_LINE="$(grep "^nvcc" "$OUT_DIR/ptxas.log" | tail -1 | sed 's/^[^:]*: //'); $(grep "^ptx:" "$OUT_DIR/ptxas.log" | tail -1)"
row "nvcc/ptxas ($SM)" "$([ $PTX_RC = 0 ] && echo PASS || echo FAIL)" "$PTX_LINE"
fi

echo "=== 3. tests: pytest -m gpu tests/gpu [$(elapsed)]"
T=$(allow 150)
if [ "$T" = 0 ]; then row "pytest -m gpu tests/gpu" SKIP "no time left"; else
timeout "$T" $PY -m pytest -m gpu tests/gpu -q -p no:cacheprovider -rs 2>&1 | tee "$OUT_DIR/pytest-gpu.log"
LAST=$(grep -E "passed|failed|error|skipped|no tests ran" "$OUT_DIR/pytest-gpu.log" | tail -1)
if echo "$LAST" | grep -qE "failed|error"; then row "pytest -m gpu tests/gpu" FAIL "$LAST"
elif echo "$LAST" | grep -q "passed"; then row "pytest -m gpu tests/gpu" PASS "$LAST"
else row "pytest -m gpu tests/gpu" FAIL "nothing ran on the GPU (or timed out after ${T}s): $LAST"; fi
fi

echo "=== 4. benchmark [$(elapsed)]"
T=$(allow 150)
if [ "$T" = 0 ]; then row "benchmark" SKIP "no time left"; else
timeout "$T" $PY bench/rotary.py --device cuda --json "$OUT_DIR/bench.json" 2>&1 | tee "$OUT_DIR/bench.log"
$PY gpu/summarize_bench.py "$OUT_DIR/bench.json" >> "$SUMMARY.rows" 2>> "$OUT_DIR/bench.log" || row "benchmark" FAIL "see bench.log"
fi

echo "=== 5. compute-sanitizer memcheck [$(elapsed)]"
T=$(allow 90)
if [ "$T" = 0 ]; then row "compute-sanitizer memcheck" SKIP "no time left"
elif command -v compute-sanitizer >/dev/null 2>&1; then
  timeout "$T" compute-sanitizer --tool memcheck --error-exitcode 3 --target-processes all $PY gpu/sanitize_rotary.py \
    > "$OUT_DIR/sanitizer.log" 2>&1
  RC=$?
  tail -5 "$OUT_DIR/sanitizer.log"
  if grep -q "Device not supported\|error 999" "$OUT_DIR/sanitizer.log"; then row "compute-sanitizer memcheck" SKIP "not supported on this runtime"
  elif [ $RC = 0 ] && grep -q "ERROR SUMMARY: 0 errors" "$OUT_DIR/sanitizer.log"; then row "compute-sanitizer memcheck" PASS "$(grep -o 'SANITIZE [0-9]* launches' "$OUT_DIR/sanitizer.log" | head -1), 0 errors"
  else row "compute-sanitizer memcheck" FAIL "rc=$RC, see sanitizer.log"; fi
else
  row "compute-sanitizer memcheck" SKIP "compute-sanitizer not found"
fi

echo "=== 6. training monitor: overhead and host-device syncs (bench/monitor.py) [$(elapsed)]"
# ~0.7 B-parameter Llama, batch 8 x 512, fp32: steps of ~0.3-0.5 s; the monitor reads its device values at
# read points only (read=auto on CUDA: every 50 steps in a loop, the logging steps in a Trainer)
T=$(allow 90)
if [ "$T" = 0 ]; then echo "no time left"; : > "$OUT_DIR/monitor.json"; fi
[ "$T" = 0 ] || timeout "$T" $PY bench/monitor.py --device cuda --clock wall --threads 0 --hidden 2048 --layers 12 --vocab 32000 \
  --batch 8 --seq 512 --reps 21 --count-syncs 8 --json "$OUT_DIR/monitor.json" 2>&1 | tee "$OUT_DIR/monitor.log"
MON=$($PY -c "import json; d = json.load(open('$OUT_DIR/monitor.json')); print(d['ratio_of_medians'], d['median_ratio'], d.get('syncs_added_per_step', 'n/a'))" 2>/dev/null)
if [ "$T" = 0 ]; then row "monitor overhead (cuda)" SKIP "no time left"
elif [ -z "$MON" ]; then row "monitor overhead (cuda)" FAIL "see monitor.log"
else
  set -- $MON
  if $PY -c "import sys; sys.exit(0 if float('$2') <= 1.01 and '$3' in ('0', '0.0') else 1)"; then RES=PASS; else RES=FAIL; fi
  row "monitor overhead (cuda)" $RES "ratio of medians $1, median ratio $2, syncs added/step $3"
fi

echo
echo "=== summary (total $(elapsed))"
{ printf '%-34s %-6s %s\n' "check" "result" "detail"; printf '%s\n' "--------------------------------------------------------------------------------"; cat "$SUMMARY.rows"; } | tee "$SUMMARY"
rm -f "$SUMMARY.rows"
grep -q " FAIL " "$SUMMARY" && exit 1
exit 0
