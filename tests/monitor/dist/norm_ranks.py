"""torchrun worker for tests/monitor/test_grad_norm.py: the monitor's gradient norm under DDP and FSDP2 (gloo, CPU).

    torchrun --standalone --nproc_per_node=2 norm_ranks.py OUT_DIR

* ``fsdp2-<mode>``: a tiny Llama under ``fully_shard`` (DTensor gradients), a custom loop of 2 SGD steps with
  the Monitor; ``mode`` is how the loop clips: ``clip`` (``torch.nn.utils.clip_grad_norm_``), ``twopart``
  (``get_total_norm`` + ``clip_grads_with_norm_``, what accelerate 1.16 does), ``none`` (the monitor's own
  norm). The norm the loop got (a DTensor: its global value) is recorded beside the monitor's;
* ``ddp-trainer``: a ``transformers.Trainer`` on 2 ranks (DDP through accelerate), ``max_grad_norm=1.0``:
  the monitor's per-step norm beside the ``grad_norm`` the Trainer logged.

Each rank writes ``OUT/rank<N>.json``: ``{run: {"monitor": [...], "reference": [...], "codes": [...]}}``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

LR = 1e-2


def _steps(path):
    records = [json.loads(line) for line in open(path, encoding="utf-8")]
    return ([r["grad_norm"] for r in records if r["type"] == "step"],
            [r["grad_norm"] for r in records if r["type"] == "log" and "grad_norm" in r])


def fsdp2(out, rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ftshims import tiny
    from ftshims.monitor import Monitor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = tiny.tiny_llama()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    results = {}
    for mode in ("clip", "twopart", "none"):
        log = os.path.join(out, f"fsdp2-{mode}.jsonl")
        monitor = Monitor(model, optimizer, log=log, off=["loss_count_mismatch"])
        got = []
        batch = tiny.batch(batch_size=2, seq_len=8, seed=rank)
        for _ in range(2):
            loss = model(**batch).loss
            loss.backward()
            monitor.after_backward(loss)
            params = [p for p in model.parameters() if p.grad is not None]
            if mode == "clip":
                norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
            elif mode == "twopart":
                norm = torch.nn.utils.get_total_norm([p.grad for p in params])
                torch.nn.utils.clip_grads_with_norm_(params, 1.0, norm)
            else:
                norm = torch.nn.utils.get_total_norm([p.grad for p in params])
            got.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
            optimizer.step()
            monitor.after_step()
            optimizer.zero_grad()
        monitor.close()
        results[f"fsdp2-{mode}"] = {"monitor": _steps(f"{os.path.splitext(log)[0]}.rank{rank}.jsonl")[0],
                                    "reference": got, "codes": [f.code for f in monitor.findings]}
    return results


def ddp_trainer(out, rank):
    from transformers import Trainer, TrainingArguments

    import ftshims.monitor
    from ftshims import tiny

    g = torch.Generator().manual_seed(1)
    start = torch.randint(0, 125, (16, 1), generator=g)
    ids = 3 + (start + torch.arange(16)) % 125
    rows = [{"input_ids": r.tolist(), "labels": r.tolist(), "attention_mask": [1] * 16} for r in ids]
    log = os.path.join(out, "ddp-trainer.jsonl")
    callback = ftshims.monitor.callback(log=log, off=["loss_count_mismatch"])
    with tempfile.TemporaryDirectory(dir=out) as tmp, tiny.quiet():
        args = TrainingArguments(output_dir=tmp, per_device_train_batch_size=2, max_steps=3, learning_rate=LR,
                                 max_grad_norm=1.0, logging_steps=1, report_to=[], save_strategy="no",
                                 disable_tqdm=True, seed=0, dataloader_num_workers=0, use_cpu=True)
        trainer = Trainer(model=tiny.tiny_llama(), args=args, train_dataset=rows, callbacks=[callback])
        trainer.train()
        kind = str(trainer.accelerator.state.distributed_type)
    monitor, logged = _steps(f"{os.path.splitext(log)[0]}.rank{rank}.jsonl")
    return {"ddp-trainer": {"monitor": monitor, "reference": logged, "codes": [f.code for f in callback.findings],
                            "distributed_type": kind}}


def main(out):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    results.update(fsdp2(out, rank))
    results.update(ddp_trainer(out, rank))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads can abort the interpreter's teardown; everything is written


if __name__ == "__main__":
    main(sys.argv[1])
