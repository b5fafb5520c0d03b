#!/usr/bin/env bash
# Run on the CPU box before a GPU check: gathers what the (offline) GPU machine lacks into
# .gpu_carry/ (ignored through .git/info/exclude), to be sent with the device tool's carry=[".gpu_carry"].
#   .gpu_carry/whl/  liger-kernel (pure Python + Triton) for the Liger comparison
#   .gpu_carry/fa/   flash-attn 2.8.3's released rotary files (Triton) for parity + benchmark
set -eu
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
grep -qx '/.gpu_carry/' .git/info/exclude 2>/dev/null || echo '/.gpu_carry/' >> .git/info/exclude
mkdir -p .gpu_carry/whl .gpu_carry/fa
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .gpu_carry/whl "liger-kernel==${LIGER_VERSION:-0.8.5}"
"$PY" tools/fetch_flash_attn_sources.py --dest .gpu_carry/fa --versions 2.8.3
du -sh .gpu_carry
