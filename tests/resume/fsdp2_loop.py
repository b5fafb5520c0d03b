"""The gate's FSDP2 engine: a training loop over ``fully_shard`` with torch's distributed checkpoint, on 2 CPU ranks.

The HF ``Trainer`` cannot run FSDP on a machine without an accelerator: accelerate (1.15.0, 1.16.0) turns
``ACCELERATE_USE_FSDP`` into ``DistributedType.FSDP`` only from a multi-accelerator state (``state.py``: the
FSDP branch lists MULTI_GPU/NPU/XPU/..., not MULTI_CPU), and the ``Trainer`` then refuses ("Using fsdp only
works in distributed training"). So this engine is the loop a user writes around FSDP2, on the gate's models:
each decoder layer and the root ``fully_shard``-ed on a 1-D gloo mesh, AdamW + linear warmup/decay, gradient
clipping, gradient accumulation with ``set_requires_gradient_sync(False)`` between micro steps, every rank its
own rows of the global batch. A checkpoint is what ``torch.distributed.checkpoint`` saves of
``get_state_dict(model, optimizer)`` (sharded, every rank writes its part), the scheduler's state, each rank's RNG
state and the step; the resume (a new process) loads them with ``set_state_dict`` and skips the batches trained.
Records the same JSON as worker.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

CASES = ("full_resized_tied", "lora_mts_resized", "ga_mid_epoch")


def run_case(name, phase, out, worker):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import get_linear_schedule_with_warmup

    world, rank = dist.get_world_size(), dist.get_rank()
    _, model, data, _, kw, k = worker.case(name, "fsdp2", world)
    ga = kw.get("gradient_accumulation_steps", 1)
    epochs = kw.get("num_train_epochs", 2)
    per_rank = kw["per_device_train_batch_size"]
    global_batch = per_rank * world
    batches = len(data) // global_batch
    steps_per_epoch = -(-batches // ga)
    total = steps_per_epoch * epochs
    folder = Path(out) / name
    folder.mkdir(parents=True, exist_ok=True)

    mesh = init_device_mesh("cpu", (world,))
    layers = model.get_base_model().model.layers if hasattr(model, "get_base_model") else model.model.layers
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=kw["learning_rate"])
    scheduler = get_linear_schedule_with_warmup(optimizer, kw["warmup_steps"], total)
    torch.manual_seed(0)

    start = 0
    checkpoint = folder / "run" / f"checkpoint-{k}"
    if phase == "resume":
        state = {"model": None, "optimizer": None}
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=str(checkpoint / "dcp"))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        scheduler.load_state_dict(torch.load(checkpoint / "scheduler.pt", weights_only=True))
        start = json.loads((checkpoint / "step.json").read_text())["step"]
        torch.set_rng_state(torch.load(checkpoint / f"rng_{rank}.pt", weights_only=True))

    calls, lrs = [], {}
    order = [torch.randperm(len(data), generator=torch.Generator().manual_seed(epoch)).tolist() for epoch in range(epochs)]
    step = start
    for epoch in range(start // steps_per_epoch, epochs):
        micro = [order[epoch][b * global_batch:(b + 1) * global_batch] for b in range(batches)]
        windows = [micro[i:i + ga] for i in range(0, batches, ga)]
        for window in windows[step - epoch * steps_per_epoch:]:
            lrs[str(step + 1)] = [float(g["lr"]) for g in optimizer.param_groups]
            count = sum(len(rows[rank * per_rank:(rank + 1) * per_rank]) for rows in window)
            for i, rows in enumerate(window):
                mine = rows[rank * per_rank:(rank + 1) * per_rank]
                ids = torch.tensor([data[j]["input_ids"] for j in mine])
                model.set_requires_gradient_sync(i == len(window) - 1)
                loss = model(input_ids=ids, labels=ids).loss * len(mine) / count
                loss.backward()
                weights = torch.arange(1, ids.numel() + 1, dtype=torch.int64).reshape(ids.shape)
                calls.append({"step": step + 1, "loss": float(loss.detach()), "ids": int((ids * weights).sum())})
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if phase == "full" and step == k:
                save_at = folder / "run" / f"checkpoint-{k}"
                model_state, optim_state = get_state_dict(model, optimizer)
                dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(save_at / "dcp"))
                torch.save(torch.get_rng_state(), save_at / f"rng_{rank}.pt")
                if rank == 0:
                    torch.save(scheduler.state_dict(), save_at / "scheduler.pt")
                    (save_at / "step.json").write_text(json.dumps({"step": step}))
                dist.barrier()
    weights = {n: (p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()).clone() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save(weights, folder / f"{phase}.weights.pt")
    result = {"case": name, "engine": "fsdp2", "phase": phase, "world": world, "rank": rank, "k": k, "global_step": step,
              "calls": calls, "lrs": lrs, "distributed_type": "fsdp2 loop (fully_shard, torch.distributed.checkpoint)",
              "dtensor": any(hasattr(p, "full_tensor") for p in model.parameters())}
    (folder / f"{phase}.rank{rank}.json").write_text(json.dumps(result))
