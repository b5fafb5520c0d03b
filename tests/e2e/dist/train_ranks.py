"""ftshims in the ranks of torch's own distributed engines (gloo, CPU): DDP, FSDP2, and a Trainer.

Run plainly (``--engine single``: the reference), under ``torchrun --nproc_per_node=2`` (``--engine
ddp,fsdp2,trainer``: each engine in turn, in the same two ranks), or under ``accelerate launch``
(``--engine accelerate``). The script never calls ``ftshims.apply()``: the shims come from the
start-up hook (``FTSHIMS_AUTO=1`` and ``ftshims-auto.pth``), in every rank. Each rank writes
``<--out>/rank<N>.json`` (what ftshims did in it, and its results) for the test to compare with the
single-process run.

What each engine does, on a tiny Llama (sdpa) with LoRA on q/v, ``lm_head`` in ``modules_to_save``
and gradient checkpointing left at transformers' default (reentrant below 5.0: with ``lm_head``
trainable the loss has a graph, so without the fix the LoRA weights silently get no gradient):

* ``losses``: STEPS SGD steps on the global batch (two packed rows, the examples marked by
  ``position_ids`` beside an all-ones attention mask); each rank trains on one row. Both rows score
  the same number of labels, so the mean of the ranks' mean losses is the single process's mean
  loss, and the per-step losses (averaged over ranks) must equal the single process's;
* ``lora``: the LoRA weights after the steps (gathered from FSDP2's DTensor shards) and at the start;
* ``packed``: each rank's packed row, evaluated after training: each example's loss in the packed
  row and the same example's loss run alone;
* ``trainer`` (a ``transformers.Trainer`` on a plain tiny Llama, ``average_tokens_across_devices``):
  the ``num_items_in_batch`` the loss was divided by, and the labels the loss scores on each rank;
* ``accelerate`` (under ``accelerate launch``): what accelerate made of its config here (distributed
  type, processes, FSDP plugin, the wrapper ``prepare`` returned, DTensor parameters or not).

The single process also trains once more with every shim reverted (``without_shims``): on a stack in
the bug's range its LoRA weights do not move, which shows the run above tests the bug's silent form.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

import ftshims

STEPS = 3
LR = 0.5
ROWS = ((5, 7), (4, 8))  # the example lengths of the two packed rows; 12 tokens, 10 scored labels each


def global_batch():
    """Two packed rows; labels at each example's first position are -100 (no target across a boundary)."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for lengths in ROWS:
        ids = torch.randint(3, 128, (sum(lengths),), generator=g)
        pos = torch.cat([torch.arange(n) for n in lengths])
        labels = ids.clone()
        labels[pos == 0] = -100
        rows.append({"input_ids": ids, "position_ids": pos, "labels": labels, "attention_mask": torch.ones_like(ids)})
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def lora_model():
    """Tiny Llama + LoRA (q/v) + a trainable copy of lm_head, checkpointing at transformers' default."""
    from peft import LoraConfig, get_peft_model

    from ftshims import tiny

    base = tiny.tiny_llama(attn="sdpa")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                        task_type="CAUSAL_LM", modules_to_save=["lm_head"])
    with tiny.quiet():
        model = get_peft_model(base, config)
        model.gradient_checkpointing_enable()  # Trainer's order: after get_peft_model
    return model


def full(tensor):
    """A parameter's whole value: FSDP2 keeps DTensor shards."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def lora_values(model):
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    return {n: full(p.detach()).tolist() for n, p in inner.named_parameters() if "lora_" in n}


def train(model, batch, world):
    """STEPS SGD steps; the per-step loss averaged over the ranks."""
    from ftshims import tiny

    model.train()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for _ in range(STEPS):
        with tiny.quiet():
            loss = model(**batch).loss
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(value)
            value /= world
        losses.append(float(value))
    return losses


def example_losses(model, row):
    """Each example's mean loss in the packed row, and the same example's loss run alone (eval, no grad)."""
    import torch.nn.functional as F

    from ftshims import tiny

    def scored(ids, pos, labels):
        with torch.no_grad(), tiny.quiet():
            logits = model(input_ids=ids[None], position_ids=pos[None], attention_mask=torch.ones_like(ids)[None]).logits[0]
        return F.cross_entropy(logits[:-1].float(), labels[1:], ignore_index=-100, reduction="none")

    model.eval()
    ids, pos, labels = row["input_ids"], row["position_ids"], row["labels"]
    token_loss = scored(ids, pos, labels)
    example = (torch.cumsum((pos == 0).long(), 0) - 1)[1:]  # the example each target belongs to
    starts = (pos == 0).nonzero().flatten().tolist() + [len(ids)]
    packed, alone = [], []
    for e, (a, b) in enumerate(zip(starts, starts[1:])):
        keep = (example == e) & (labels[1:] != -100)
        packed.append(float(token_loss[keep].mean()))
        alone.append(float(scored(ids[a:b], torch.arange(b - a), labels[a:b]).mean()))
    return {"packed": packed, "alone": alone}


def run_engine(engine, rank, world):
    batch = global_batch()
    torch.manual_seed(0)
    model = lora_model()
    start = lora_values(model)
    dtensor = None
    if engine == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif engine == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.get_base_model().model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        from torch.distributed.tensor import DTensor

        dtensor = all(isinstance(p, DTensor) for p in model.parameters())
    rows = batch if world == 1 else {k: v[rank : rank + 1] for k, v in batch.items()}
    losses = train(model, rows, world)
    lora = lora_values(model)  # collective under FSDP2: every rank calls it
    packed = example_losses(model, {k: v[0] for k, v in rows.items()})
    if world > 1:
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, packed)
        packed = gathered
    else:
        packed = [example_losses(model, {k: v[i] for k, v in batch.items()}) for i in range(len(ROWS))]
    return {"losses": losses, "lora": lora, "lora_start": start, "packed": packed, "dtensor_parameters": dtensor}


def run_trainer(rank, world):
    """One Trainer step with average_tokens_across_devices: the num_items_in_batch the loss was divided by."""
    from transformers import Trainer, TrainingArguments

    from ftshims import tiny

    # Two examples of different lengths; the first has two leading -100 labels (a prompt), the second none.
    lengths = (9, 6)
    g = torch.Generator().manual_seed(2)
    examples = []
    for i, n in enumerate(lengths):
        ids = torch.randint(3, 128, (n,), generator=g)
        labels = ids.clone()
        if i == 0:
            labels[:2] = -100
        examples.append({"input_ids": ids.tolist(), "labels": labels.tolist(), "attention_mask": [1] * n})
    seen = {}

    class Recorder(Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            seen["num_items_in_batch"] = int(kwargs.get("num_items_in_batch") or 0)
            seen["local_scored"] = int((inputs["labels"][..., 1:] != -100).sum())
            return super().compute_loss(model, inputs, *args, **kwargs)

    with tempfile.TemporaryDirectory() as out, tiny.quiet():
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=1, max_steps=1, use_cpu=True, report_to=[],
            save_strategy="no", logging_strategy="no", disable_tqdm=True, average_tokens_across_devices=True,
            dataloader_num_workers=0, seed=0,
        )
        trainer = Recorder(model=tiny.tiny_llama(attn="sdpa"), args=args, train_dataset=examples)
        trainer.train()
        state = trainer.accelerator.state
        seen["distributed_type"] = str(state.distributed_type)
        seen["num_processes"] = state.num_processes
    if world > 1:
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, seen)
    else:
        gathered = [seen]
    scored = sum(sum(1 for label in e["labels"][1:] if label != -100) for e in examples)
    return {"ranks": gathered, "scored_labels_all_ranks": scored}


def run_accelerate(rank, world):
    """Under ``accelerate launch`` with an FSDP config: what accelerate made of it on this machine."""
    from accelerate import Accelerator

    accelerator = Accelerator()
    state = accelerator.state
    model = accelerator.prepare(lora_model())
    from torch.distributed.tensor import DTensor

    return {
        "distributed_type": str(state.distributed_type),
        "fsdp_plugin": getattr(state, "fsdp_plugin", None) is not None,
        "use_fsdp_env": os.environ.get("ACCELERATE_USE_FSDP"),
        "wrapper": type(model).__name__,
        "dtensor_parameters": any(isinstance(p, DTensor) for p in model.parameters()),
        "num_processes": state.num_processes,
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--engine", default="single", help="comma-separated: single, ddp, fsdp2, trainer, accelerate")
    args = parser.parse_args()
    engines = args.engine.split(",")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1 and "accelerate" not in engines:
        torch.distributed.init_process_group("gloo")
    import transformers  # noqa: F401  (deferred shims install on this import)

    result = {"rank": rank, "world": world, "auto": os.environ.get("FTSHIMS_AUTO"), "torch": torch.__version__}
    for engine in engines:
        if engine in ("single", "ddp", "fsdp2"):
            result[engine] = run_engine(engine, rank, world)
        elif engine == "trainer":
            result[engine] = run_trainer(rank, world)
        elif engine == "accelerate":
            result[engine] = run_accelerate(rank, world)
        else:
            raise SystemExit(f"unknown engine {engine!r}")
    result["statuses"] = {e.id: e.status for e in ftshims.status()}  # after the runs: deferred shims installed
    result["acted"] = {e.id: dict(e.actions) for e in ftshims.status() if e.actions}
    if engines == ["single"]:
        ftshims.revert()  # the same run without any shim: shows whether this stack has the bug
        result["without_shims"] = run_engine("single", rank, world)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    if world > 1:
        torch.distributed.barrier()  # nobody tears down the group while another rank still uses it
        torch.distributed.destroy_process_group()
        # gloo's background threads can abort the interpreter's teardown ("terminate called without an
        # active exception"); the work is done and written, so leave without it.
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
