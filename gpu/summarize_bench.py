"""Summary rows for gpu/check.sh from bench/rotary.py's JSON: the issue's GPU targets, PASS/FAIL each.

Targets (issue 5, on an H200): the fused kernel reaches >= 85% of the device
copy bandwidth measured in the same run, is >= 1.3x Liger and >= 3x HF eager.
Rows are printed for the Llama-8B and long-context shapes, bf16, fwd and fwd+bwd,
for ``ftshims_cos`` (same inputs as HF/Liger).
"""

from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    data = json.load(open(path))
    results = data["results"]
    for r in results:
        if r["impl"] != "ftshims_cos" or r["dtype"] != "bfloat16":
            continue
        tag = f"bench {r['shape']} bf16 {r['mode']}"
        detail = f"{r['ms']:.3f} ms, {r['gbs']:.0f} GB/s, {r['frac_copy']:.0%} of copy"
        ok = r["frac_copy"] >= 0.85
        checks = [f"copy>=85%:{'ok' if ok else 'no'}"]
        if "x_vs_hf_eager" in r:
            hf_ok = r["x_vs_hf_eager"] >= 3.0
            ok = ok and hf_ok
            detail += f", {r['x_vs_hf_eager']:.2f}x HF"
            checks.append(f"HF>=3x:{'ok' if hf_ok else 'no'}")
        if "x_vs_liger" in r:
            liger_ok = r["x_vs_liger"] >= 1.3
            ok = ok and liger_ok
            detail += f", {r['x_vs_liger']:.2f}x Liger"
            checks.append(f"Liger>=1.3x:{'ok' if liger_ok else 'no'}")
        if "x_vs_flash_attn" in r:
            detail += f", {r['x_vs_flash_attn']:.2f}x flash-attn"
        print(f"{tag:<34} {'PASS' if ok else 'FAIL':<6} {detail} [{' '.join(checks)}]")
    for name, why in data.get("skipped", {}).items():
        print(f"{'bench ' + name:<34} {'SKIP':<6} {why}")


if __name__ == "__main__":
    main(sys.argv[1])
