"""Packed forward+backward with the ``packing_block_mask`` shim vs a padded batch of the same examples.

The point of packing is speed: the same examples, packed into a few full rows
(per-example position_ids, block-causal mask from the shim: examples stay
isolated), against the classic padded batch (one example per row, padded to
the longest). Both run forward + backward on the same model, in the same
process, interleaved: every repetition times one step of each variant (the
order alternates between repetitions), and the report gives the median over
repetitions, tokens/s (real tokens only, padding excluded) and the ratio
packed/padded. A third line shows packed rows *without* the shim (what
transformers does on its own: contaminated, and so not a valid option) to make
the shim's own cost visible.

Before timing, the script checks that the shimmed packed loss equals the
padded loss (same examples, same targets) and that the unshimmed one does not.

    python bench/packing.py                              # sdpa, fp32, CPU, 1 thread, CPU time
    python bench/packing.py --attn eager --reps 15
    python bench/packing.py --device cuda --dtype bfloat16 --clock wall --examples 256 --row 2048 --hidden 1024
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_examples(count: int, low: int, high: int, vocab: int, seed: int):
    import torch

    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (rng.randint(low, high),), generator=generator) for _ in range(count)]


def padded_batch(examples):
    """One example per row, right-padded to the longest; loss targets exclude padding."""
    import torch

    length = max(len(e) for e in examples)
    ids = torch.zeros(len(examples), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, example in enumerate(examples):
        ids[row, : len(example)] = example
        mask[row, : len(example)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def packed_batch(examples, row_length: int):
    """First-fit-decreasing into rows of ``row_length``; per-example position_ids, labels[pos == 0] = -100,
    padding at row ends masked (mask 0, pos 0)."""
    import torch

    rows = []  # list of (free, [examples])
    for example in sorted(examples, key=len, reverse=True):
        if len(example) > row_length:
            raise SystemExit(f"an example of {len(example)} tokens does not fit a row of {row_length}")
        for index, (free, members) in enumerate(rows):
            if len(example) <= free:
                rows[index] = (free - len(example), members + [example])
                break
        else:
            rows.append((row_length - len(example), [example]))
    ids = torch.zeros(len(rows), row_length, dtype=torch.long)
    pos = torch.zeros_like(ids)
    mask = torch.zeros_like(ids)
    for r, (_, members) in enumerate(rows):
        offset = 0
        for example in members:
            n = len(example)
            ids[r, offset : offset + n] = example
            pos[r, offset : offset + n] = torch.arange(n)
            mask[r, offset : offset + n] = 1
            offset += n
    labels = ids.masked_fill(mask == 0, -100).masked_fill(pos == 0, -100)
    return {"input_ids": ids, "position_ids": pos, "attention_mask": mask, "labels": labels}


def token_sum_loss(model, batch):
    """Sum of per-token cross-entropies over the batch's targets (comparable across layouts)."""
    import torch

    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    labels = batch["labels"]
    shift_logits = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    shift_labels = labels[:, 1:].reshape(-1)
    return torch.nn.functional.cross_entropy(shift_logits, shift_labels, ignore_index=-100, reduction="sum")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--examples", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--row", type=int, default=512, help="packed row length")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=9, help="repetitions (each times every variant once)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: leave torch's default)")
    parser.add_argument("--clock", default="cpu", choices=("cpu", "wall"), help="cpu: process time (robust on a busy machine)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch
    import transformers

    import ftshims

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 128),
        max_position_embeddings=max(args.row, args.max_len),
        pad_token_id=0,
    )
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=args.attn)
    model = model.to(device=args.device, dtype=dtype).train()

    examples = build_examples(args.examples, args.min_len, args.max_len, args.vocab, args.seed)
    real_tokens = sum(len(e) for e in examples)
    padded = {k: v.to(args.device) for k, v in padded_batch(examples).items()}
    packed = {k: v.to(args.device) for k, v in packed_batch(examples, args.row).items()}

    # Correctness first: the packed rows give the padded batch's loss only with the shim.
    with torch.no_grad():
        reference = token_sum_loss(model, padded).item()
        contaminated = token_sum_loss(model, packed).item()
        with ftshims.applied(only=["packing_block_mask"]):
            isolated = token_sum_loss(model, packed).item()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    ok = abs(isolated - reference) <= tolerance * abs(reference)
    print(f"loss (token sum): padded {reference:.6g}  packed+shim {isolated:.6g}  packed, no shim {contaminated:.6g}")
    if not ok:
        print("packed loss with the shim differs from the padded loss: not timing a wrong result", file=sys.stderr)
        return 1

    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    def step(batch, shim: bool) -> float:
        model.zero_grad(set_to_none=True)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = clock()
        if shim:
            with ftshims.applied(only=["packing_block_mask"]):
                loss = model(**batch).loss
        else:
            loss = model(**batch).loss
        loss.backward()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return clock() - start

    variants = [("padded (one example per row)", padded, False), ("packed + packing_block_mask", packed, True), ("packed, no shim (contaminated)", packed, False)]
    for _, batch, shim in variants:  # warm-up
        step(batch, shim)
    times = {name: [] for name, _, _ in variants}
    for rep in range(args.reps):
        order = variants if rep % 2 == 0 else list(reversed(variants))
        for name, batch, shim in order:
            times[name].append(step(batch, shim))

    print(
        f"transformers {transformers.__version__}, torch {torch.__version__}, {args.attn}, {args.dtype}, {args.device}, "
        f"threads {torch.get_num_threads()}, clock {args.clock}"
    )
    print(
        f"{args.examples} examples, {real_tokens} real tokens, lengths {args.min_len}-{args.max_len}; "
        f"padded {tuple(padded['input_ids'].shape)} ({real_tokens / padded['input_ids'].numel():.0%} real), "
        f"packed {tuple(packed['input_ids'].shape)} ({real_tokens / packed['input_ids'].numel():.0%} real)"
    )
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"{'variant':34s} {'median s/step':>14s} {'tokens/s':>10s}")
    for name, median in medians.items():
        print(f"{name:34s} {median:14.4f} {real_tokens / median:10.0f}")
    base = medians["padded (one example per row)"]
    print(f"speed-up packed+shim vs padded: {base / medians['packed + packing_block_mask']:.2f}x (median of {args.reps})")
    print(f"shim overhead vs packed without it: {medians['packed + packing_block_mask'] / medians['packed, no shim (contaminated)']:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
