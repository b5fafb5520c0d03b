"""Step-time overhead of the training health monitor (``ftshims.monitor``) at its default settings.

A ~33 M-parameter Llama (hidden 512, 8 layers, vocabulary 8000), sequence 512, trained on the CPU with a
plain loop that does what the Trainer does per optimizer step: forward with labels, backward,
``torch.nn.utils.clip_grad_norm_``, AdamW step, ``zero_grad``. Both variants run in the same process, side
by side: every repetition times one step with the monitor attached and one without (the order alternates
between repetitions, so drift and warm-up hit both alike). The monitor is built once (its one-time checks
are not per-step cost) and its hooks are detached / re-attached between the steps. The report: the median
step time of each variant, the ratio of the medians, the median of the per-repetition ratios, the ratio of
the minima (min of N: on a shared machine the neighbours only ever add time), and the time spent inside the
monitor's hooks per step (measured directly: immune to the neighbours' noise).
Target (issue 21): <= 1.01. Process CPU time with one thread is the default clock: on a shared machine
wall time mostly measures the neighbours.

    python bench/monitor.py                         # 21 repetitions, batch 2 x 512 tokens, CPU time, 1 thread,
                                                    # update statistics at every step (the worst case)
    python bench/monitor.py --skip                  # with the skip defence armed
    python bench/monitor.py --reps 41 --read log    # read the device-side values every 50 steps (the GPU path)
    python bench/monitor.py --device cuda --clock wall --threads 0 --count-syncs   # on a GPU (gpu/check.sh)

``--count-syncs`` (CUDA) also runs steps of each variant under ``torch.cuda.set_sync_debug_mode("warn")`` and
counts the synchronising calls: the monitor must add none between its read points (``read`` log: none in
the counted steps).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build(device: str, vocab: int, hidden: int, layers: int, seq: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                         max_position_embeddings=seq, tie_word_embeddings=False)
    try:
        model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    except (TypeError, ValueError):
        model = LlamaForCausalLM(config)
    return model.to(device).train()


def _time_the_monitor(monitor) -> dict:
    """Time spent inside the monitor's per-step entry points (process CPU time), summed: its own work, measured
    directly, next to the side-by-side ratio (which on a shared machine carries the neighbours' noise)."""
    spent = {"seconds": 0.0, "depth": 0}
    names = ("_pre_hook", "_post_hook", "_optimizer_pre_hook", "_optimizer_post_hook", "after_backward", "after_step")
    for name in names:
        original = getattr(monitor, name)

        def timed(*args, _original=original, **kwargs):
            spent["depth"] += 1
            start = time.process_time()
            try:
                return _original(*args, **kwargs)
            finally:
                spent["depth"] -= 1
                if spent["depth"] == 0:
                    spent["seconds"] += time.process_time() - start

        setattr(monitor, name, timed)  # instance attributes: _attach() registers these bound wrappers
    return spent


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=21, help="repetitions (each times one step of each variant)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each variant first")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--read", choices=("auto", "step", "log"), default="auto",
                        help="the monitor's read option (auto: every step on the CPU, every 50 steps elsewhere)")
    parser.add_argument("--update-every", type=int, default=1,
                        help="the monitor's update_every: update statistics on every step by default (the worst "
                        "case; the monitor's own default, 10, samples the first 10 steps and every 10th)")
    parser.add_argument("--skip", action="store_true",
                        help="policy skip for nonfinite_loss / nonfinite_grad (the defence reads one flag per step; "
                        "its optimizer.step wrapper runs the gradient checks outside the timed hooks: judge by the ratio)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: leave as is)")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="cpu: process CPU time (use with --threads 1 on a shared machine); wall: perf_counter "
                        "(with a CUDA synchronize after each step)")
    parser.add_argument("--count-syncs", type=int, default=0, metavar="STEPS",
                        help="CUDA: count host-device synchronisations over STEPS steps of each variant")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    args = parser.parse_args(argv)

    import torch

    from ftshims.monitor import Monitor

    if args.threads:
        torch.set_num_threads(args.threads)
    model = build(args.device, args.vocab, args.hidden, args.layers, args.seq)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(args.device) for _ in range(8)]
    options = {"read": args.read, "update_every": args.update_every}
    if args.skip:
        options["policy"] = {"nonfinite_loss": "skip", "nonfinite_grad": "skip"}
    monitor = Monitor(model, optimizer, **options)  # one-time checks happen here, outside the timing
    inside = _time_the_monitor(monitor)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    state = {"attached": True, "step": 0}

    def switch(on: bool) -> None:
        if on and not state["attached"]:
            monitor._attach(optimizer)  # the same hooks Monitor() installs
        elif not on and state["attached"]:
            monitor.detach()
        state["attached"] = on

    def step(on: bool) -> float:
        switch(on)
        ids = batches[state["step"] % len(batches)]
        state["step"] += 1
        sync()
        start = clock()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if on:
            monitor.after_backward(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if on:
            monitor.after_step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        return clock() - start

    monitor.detach()
    monitor._attach(optimizer)  # the hooks now call the timed entry points
    for _ in range(args.warmup):
        step(True)
        step(False)
    inside["seconds"] = 0.0
    times = {True: [], False: []}
    ratios = []
    for rep in range(args.reps):
        order = (True, False) if rep % 2 == 0 else (False, True)
        measured = {on: step(on) for on in order}
        for on, seconds in measured.items():
            times[on].append(seconds)
        ratios.append(measured[True] / measured[False])
    own = inside["seconds"] / args.reps
    syncs = {}
    if args.count_syncs and args.device.startswith("cuda"):
        import warnings

        for on in (False, True):
            step(on)  # outside the count: a switch's first step
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    for _ in range(args.count_syncs):
                        step(on)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs["on" if on else "off"] = sum("synchroniz" in str(w.message) for w in caught)
    switch(True)
    summary = monitor.close()
    on, off = statistics.median(times[True]), statistics.median(times[False])
    result = {
        "params_million": round(params / 1e6, 1), "batch": args.batch, "seq": args.seq, "device": args.device,
        "read": args.read, "update_every": args.update_every, "skip": args.skip, "clock": args.clock, "threads": torch.get_num_threads(), "reps": args.reps,
        "step_s_off": round(off, 4), "step_s_on": round(on, 4), "ratio_of_medians": round(on / off, 4),
        "median_ratio": round(statistics.median(ratios), 4),
        "ratio_of_minima": round(min(times[True]) / min(times[False]), 4), "monitor": summary,
        "monitor_own_s_per_step": round(own, 5), "monitor_own_fraction": round(own / off, 5),
        "ratios": [round(r, 4) for r in ratios],
    }
    if syncs:
        result["syncs"] = syncs
        result["syncs_added_per_step"] = (syncs["on"] - syncs["off"]) / args.count_syncs
    print(f"monitor overhead: {result['params_million']} M-parameter Llama, batch {args.batch} x {args.seq}, "
          f"{args.device}, {args.clock} clock, {result['threads']} thread(s), {args.reps} repetitions, read={args.read}, "
          f"update statistics every {args.update_every} step(s){', policy skip' if args.skip else ''}")
    print(f"  step without the monitor {off:.3f} s, with it {on:.3f} s: ratio of medians {on / off:.4f}, "
          f"median of per-repetition ratios {statistics.median(ratios):.4f}, ratio of the minima (min of N: "
          f"neighbours only add time) {min(times[True]) / min(times[False]):.4f} (target <= 1.01)")
    print(f"  the monitor's own work, timed inside its hooks: {own * 1e3:.2f} ms per step = {own / off:.2%} of the "
          f"step (the clip_grad_norm_ wrapper, which only keeps the norm it returns, is not in it)")
    if syncs:
        print(f"  host-device synchronisations in {args.count_syncs} steps: without the monitor {syncs['off']}, "
              f"with it {syncs['on']} (added per step: {result['syncs_added_per_step']:g}; target 0)")
    print(f"  monitor: {summary}")
    if args.json:
        import json

        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
