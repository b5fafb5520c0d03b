#!/usr/bin/env bash
# Keep the evidence of a gpu/check.sh run in the repository, to be committed:
#   bash gpu/record.sh <folder the device run's $OUT files came back to>
# copies its summary, logs and JSON into gpu/evidence/<UTC date>_<gpu>/ (the GPU's name from device.txt) and
# prints the folder. Nothing is judged here: summary.txt holds check.sh's PASS/FAIL/SKIP rows.
set -eu
SRC="${1:?usage: bash gpu/record.sh <folder with summary.txt, bench.json, ...>}"
cd "$(dirname "$0")/.."
[ -f "$SRC/summary.txt" ] || { echo "record.sh: no summary.txt in $SRC" >&2; exit 2; }
GPU=$(grep -m1 -o 'GPU 0: [^(]*' "$SRC/device.txt" 2>/dev/null | sed 's/GPU 0: //; s/NVIDIA //; s/[^A-Za-z0-9]\+/-/g; s/-$//' || true)
DEST="gpu/evidence/$(date -u +%Y-%m-%dT%H%MZ)_${GPU:-unknown-gpu}"
mkdir -p "$DEST"
for f in summary.txt device.txt build.log ptxas.log pytest-gpu.log bench.json bench.log sanitizer.log monitor.json monitor.log; do
  [ -f "$SRC/$f" ] || continue
  if [ "$(stat -c %s "$SRC/$f")" -gt 1000000 ]; then tail -c 1000000 "$SRC/$f" > "$DEST/$f"; else cp "$SRC/$f" "$DEST/$f"; fi
done
echo "$DEST"
