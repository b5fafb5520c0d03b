"""Summary rows for gpu/check.sh from bench/rotary.py's JSON: PASS/FAIL against the GPU targets.

Targets (issue 5, on an H200; issue 38 asks for the same figures on the first GPU
lent): the fused kernel reaches >= 85% of the device copy bandwidth measured in
the same run, is >= 1.3x Liger and >= 3x HF eager on the same inputs. One row per
ftshims path (``ftshims_cos``: HF's cos/sin, the inputs HF and Liger take;
``ftshims_theta``: angles in-kernel), shape, dtype and mode, with its speed
against flash-attn's Triton rotary where that ran (reported, not judged: it
takes another table and two launches). The in-place rows are printed as INFO.
"""

from __future__ import annotations

import json
import sys

COPY_TARGET, LIGER_TARGET, HF_TARGET = 0.85, 1.3, 3.0
SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def rows(data):
    for r in data["results"]:
        if not r["impl"].startswith("ftshims"):
            continue
        tag = f"bench {r['shape']} {SHORT.get(r['dtype'], r['dtype'])} {r['mode']} {r['impl'][len('ftshims_'):]}"
        detail = f"{r['ms']:.3f} ms, {r['gbs']:.0f} GB/s, {r['frac_copy']:.0%} of copy"
        ok = r["frac_copy"] >= COPY_TARGET
        checks = [f"copy>={COPY_TARGET:.0%}:{'ok' if ok else 'no'}"]
        for key, name, target in (("x_vs_hf_eager", "HF", HF_TARGET), ("x_vs_liger", "Liger", LIGER_TARGET)):
            if key in r:
                good = r[key] >= target
                detail += f", {r[key]:.2f}x {name}"
                if r["impl"] == "ftshims_cos":  # the same inputs as HF / Liger
                    ok = ok and good
                    checks.append(f"{name}>={target}x:{'ok' if good else 'no'}")
        if "x_vs_flash_attn" in r:
            detail += f", {r['x_vs_flash_attn']:.2f}x flash-attn"
        result = "INFO" if r["impl"].endswith("_inplace") else ("PASS" if ok else "FAIL")
        yield f"{tag:<34} {result:<6} {detail} [{' '.join(checks)}]"
    for name, why in data.get("skipped", {}).items():
        yield f"{'bench ' + name:<34} {'SKIP':<6} {why}"


def main(path: str) -> None:
    for line in rows(json.load(open(path))):
        print(line)


if __name__ == "__main__":
    main(sys.argv[1])
