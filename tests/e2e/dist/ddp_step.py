"""One DDP training step with shims on: tiny Llama + LoRA + gradient checkpointing + packed rows.

Run under ``torchrun --nproc_per_node=2`` (gloo, CPU): each rank trains on one packed
row of the global batch. Run plainly: one process trains on the whole global batch.
Either way the LoRA parameters after the step are saved to ``--out`` (rank 0), so the
test can compare the two. Both rows carry the same number of label tokens, so DDP's
mean of per-rank mean losses equals the single process's token mean.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import ftshims


def global_batch():
    """Two packed rows: examples of lengths (5, 7) and (4, 8); 10 label tokens per row."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for lengths in ((5, 7), (4, 8)):
        ids = torch.randint(3, 128, (sum(lengths),), generator=g)
        pos = torch.cat([torch.arange(n) for n in lengths])
        labels = ids.clone()
        labels[pos == 0] = -100  # no target across an example boundary
        rows.append({"input_ids": ids, "position_ids": pos, "labels": labels, "attention_mask": torch.ones_like(ids)})
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--attn", default="sdpa")
    args = parser.parse_args()

    ftshims.apply()
    from ftshims import tiny

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        torch.distributed.init_process_group("gloo")
    torch.manual_seed(0)
    model = tiny.lora(tiny.tiny_llama(attn=args.attn))
    with tiny.quiet():
        model.gradient_checkpointing_enable()
    model.train()
    batch = global_batch()
    if world > 1:
        batch = {k: v[rank : rank + 1] for k, v in batch.items()}
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    with tiny.quiet():
        loss = model(**batch).loss
        loss.backward()
    optimizer.step()
    inner = model.module if world > 1 else model
    if rank == 0:
        params = {n: p.detach().tolist() for n, p in tiny.lora_parameters(inner).items()}
        statuses = {e.id: e.status for e in ftshims.status()}
        with open(args.out, "w") as fh:
            json.dump({"params": params, "loss": float(loss.detach()), "statuses": statuses}, fh)
    if world > 1:
        torch.distributed.barrier()  # nobody tears down the group while another rank still uses it
        torch.distributed.destroy_process_group()
        # gloo's background threads can abort the interpreter's teardown ("terminate called without an
        # active exception"); the step is done and written, so leave without it.
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
