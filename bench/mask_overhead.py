"""Forward-pass overhead of the ``expand_mask_clamp`` shim (the patched mask path) on a tiny model.

Both variants are measured in the same process, side by side: every repetition
times a block of forward passes without the shim and then the same block with
it (the order alternates between repetitions, so drift and warm-up hit both
alike). The shim is switched off and on between blocks through its patcher
layers (the framework's own pass-through switch), because a full
``revert()``/``apply()`` between blocks disturbs the block after it (it showed a
spurious 4-5% "overhead" for bf16, where the repair is a no-op). The report is
the median over repetitions of each variant, the median of the per-repetition
ratios patched/unpatched, the ratio of the fastest blocks, and the cost of the
repair alone. Target: <= 1.02. CPU time of the process is the default clock: on
a shared machine wall time mostly measures the neighbours.

    python bench/mask_overhead.py                       # fp16, eager, left-padded batch, 1 thread, CPU time
    python bench/mask_overhead.py --attn sdpa --dtype bfloat16 --reps 15
    python bench/mask_overhead.py --threads 0 --clock wall  # all threads, wall clock (needs an idle machine)

The default batch is left-padded so that the repair really runs (fully-masked
rows exist); ``--no-padding`` measures the common case without padding.
The q/k projections are *not* forced here: this measures cost, not the bug.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", default="llama", choices=("llama", "mistral", "bart", "opt", "gpt2"))
    parser.add_argument("--attn", default="eager")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--pad", type=int, default=32, help="left-padded tokens in every other sequence")
    parser.add_argument("--no-padding", action="store_true")
    parser.add_argument("--reps", type=int, default=101, help="repetitions (each times both variants)")
    parser.add_argument("--calls", type=int, default=3, help="forward passes per timed block")
    parser.add_argument("--toggle", choices=("layers", "apply"), default="layers",
                        help="layers: switch the installed shim's wrappers off/on between blocks (no side effects; "
                        "'unpatched' then pays one pass-through wrapper call per mask, ~1 us); apply: "
                        "ftshims.revert()/apply() between blocks (their own work disturbs the next block)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: leave as is)")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="cpu: process CPU time (robust when other processes share the cores; use with "
                        "--threads 1), wall: perf_counter")
    args = parser.parse_args(argv)

    import torch
    import transformers

    import ftshims
    from ftshims import _manager
    from ftshims.shims import expand_mask_clamp as shim

    if args.threads:
        torch.set_num_threads(args.threads)
    model = shim.build(args.family, attn=args.attn, dtype=args.dtype, forced=False)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (args.batch, args.seq), generator=generator)
    mask = torch.ones_like(ids)
    if not args.no_padding:
        mask[::2, : args.pad] = 0  # every other sequence left-padded: fully-masked rows exist
    ids = ids.masked_fill(mask == 0, 1)

    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    def block() -> float:
        gc.collect()
        gc.disable()  # no collection pauses (apply/revert leave garbage) inside a timed block
        try:
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask)  # untimed: settle caches after apply()/revert()
                start = clock()
                for _ in range(args.calls):
                    model(input_ids=ids, attention_mask=mask)
                return clock() - start
        finally:
            gc.enable()

    report = ftshims.apply(only=["expand_mask_clamp"])
    assert report["expand_mask_clamp"].status == "applied", report["expand_mask_clamp"].reason
    layers = [layer for _, layer in _manager._RECORDS["expand_mask_clamp"].patcher._layers]
    print(f"patched slots: {', '.join(report['expand_mask_clamp'].patched)}")

    def timed(patched: bool) -> float:
        if args.toggle == "apply":
            if patched:
                ftshims.apply(only=["expand_mask_clamp"])
            else:
                ftshims.revert(only=["expand_mask_clamp"])
        else:
            for layer in layers:  # the patcher's own off switch: an inactive layer's wrapper passes straight through
                layer.active = patched
        return block()

    # warm-up both paths
    timed(False)
    timed(True)
    plain, patched, ratios = [], [], []
    for rep in range(args.reps):
        order = (False, True) if rep % 2 == 0 else (True, False)
        result = {flag: timed(flag) for flag in order}
        plain.append(result[False])
        patched.append(result[True])
        ratios.append(result[True] / result[False])
    for layer in layers:
        layer.active = True
    ftshims.revert(only=["expand_mask_clamp"])

    # The repair alone, on a mask of this batch's shape, for scale.
    lowest = torch.finfo(getattr(torch, args.dtype)).min
    causal = torch.full((args.seq, args.seq), lowest, dtype=getattr(torch, args.dtype)).triu(1)
    sample = causal[None, None].repeat(args.batch, 1, 1, 1)
    sample[:, :, :, : args.pad] = lowest
    start = time.perf_counter()
    for _ in range(200):
        shim.repair_mask(sample, getattr(torch, args.dtype))
    repair_us = (time.perf_counter() - start) / 200 * 1e6

    q = statistics.quantiles(ratios, n=4)
    per_call = 1e3 / args.calls
    print(
        f"transformers {transformers.__version__}, torch {torch.__version__}, threads {torch.get_num_threads()}; "
        f"{args.family}/{args.attn}/{args.dtype}, batch {args.batch} x seq {args.seq}, "
        f"{'no padding' if args.no_padding else f'{args.pad} left-padded tokens in every other row'}"
    )
    print(f"reps {args.reps} x {args.calls} forward passes per variant, interleaved (alternating order), "
          f"{'process CPU time' if args.clock == 'cpu' else 'wall time'}, toggled by {args.toggle}")
    print(f"unpatched: median {statistics.median(plain) * per_call:.3f} ms/forward")
    print(f"patched:   median {statistics.median(patched) * per_call:.3f} ms/forward")
    print(f"ratio patched/unpatched: median of per-rep ratios {statistics.median(ratios):.4f} "
          f"(ratio of medians {statistics.median(patched) / statistics.median(plain):.4f}; "
          f"per-rep quartiles {q[0]:.4f} / {q[1]:.4f} / {q[2]:.4f}); target <= 1.02")
    print(f"ratio of the fastest blocks (least disturbed by other processes): {min(patched) / min(plain):.4f}")
    print(f"repair_mask alone on a [{args.batch},1,{args.seq},{args.seq}] {args.dtype} mask: {repair_us:.1f} us/call "
          f"(the shim calls it once per forward)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
