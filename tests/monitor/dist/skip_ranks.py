"""The skip defence's proof (tests/monitor/test_skip.py): one NaN-poisoned micro-batch at step K.

    torchrun --standalone --nproc_per_node=2 skip_ranks.py OUT_DIR ddp            # DDP, then FSDP2 (gloo, CPU)
    torchrun --standalone --nproc_per_node=2 skip_ranks.py OUT_DIR zero2          # DeepSpeed ZeRO-2 (CPU)

and ``run("single", ...)`` in one process. A tiny Llama, the ``Trainer``, gradient accumulation 2, ``STEPS``
optimizer steps, a linear schedule; a forward hook turns ``model.layers.1.mlp``'s output into NaN in the *second*
micro-batch of step ``K``, on rank 0 only (the other rank's batch is clean: the ranks must agree). After every step
(``on_step_end``) the weights are kept; each run returns whether the weights after step K equal those after
step K-1 exactly, whether they moved again at K+1, whether they end finite, the learning rate of every step, the
monitor's skip records and finding codes. Runs:

* ``plain``: no policy: the NaN update is applied (the weights end NaN) — except under DeepSpeed, whose engine
  skips a step with a non-finite global gradient norm itself (``zero2``'s ``plain`` shows it);
* ``skip``: ``policy={"nonfinite_loss": "skip", "nonfinite_grad": "skip"}``;
* ``zero2`` also ``nonorm-plain`` / ``nonorm-skip``: ``zero_optimization.compute_grad_norm=false``, where DeepSpeed
  checks nothing (its ``check_grad_overflow`` is off in fp32): the NaN update is applied, unless the policy turns
  DeepSpeed's overflow check on (the monitor never skips a second time under DeepSpeed).

* ``ddp`` also ``fsdp2-plain`` / ``fsdp2-skip``: a custom loop under FSDP2 (:func:`fsdp2`), the same NaN.

Each rank writes ``OUT/<engine>.rank<N>.json``: ``{run: result}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile

STEPS = 6
K = 3
SKIP = {"nonfinite_loss": "skip", "nonfinite_grad": "skip"}


def rows(n=64):
    import torch

    g = torch.Generator().manual_seed(1)
    start = torch.randint(0, 125, (n, 1), generator=g)
    ids = 3 + (start + torch.arange(16)) % 125  # learnable progressions, as tests/monitor/runs.py's corpus
    return [{"input_ids": r.tolist(), "labels": r.tolist(), "attention_mask": [1] * 16} for r in ids]


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def run(engine: str, name: str, out: str, policy=None, ds_zero=None) -> dict:
    """One Trainer run; ``engine``: ``single`` (this process), ``ddp`` or ``zero2`` (under torchrun)."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import ftshims.monitor
    from ftshims import tiny

    model = tiny.tiny_llama()
    state = {"step": 0, "poison": False}
    poisoned_rank = _rank() == 0

    def nan_hook(module, args, output):
        return output * float("nan") if state["poison"] else output

    model.model.layers[1].mlp.register_forward_hook(nan_hook)
    weights, lrs = {}, {}

    class Poison(TrainerCallback):
        def on_step_begin(self, args, st, control, **kwargs):
            state["step"] = st.global_step + 1

        def on_substep_end(self, args, st, control, **kwargs):  # after the first micro-batch of a step
            state["poison"] = poisoned_rank and state["step"] == K

        def on_step_end(self, args, st, control, model=None, optimizer=None, **kwargs):
            state["poison"] = False
            weights[st.global_step] = {n: p.detach().clone() for n, p in model.named_parameters()}

    import inspect

    params = inspect.signature(TrainingArguments.__init__).parameters
    extra = {"use_cpu": True} if "use_cpu" in params else {"no_cuda": True}  # transformers < 4.34: no_cuda
    if ds_zero is not None:
        extra = {"deepspeed": ds_zero, "accelerator_config": {"use_configured_state": True}}
    log = os.path.join(out, f"{engine}-{name}.jsonl")
    options = {"log": log, "off": ["loss_count_mismatch"]}
    if policy:
        options["policy"] = policy
    monitor = ftshims.monitor.callback(**options)
    error = None
    with tempfile.TemporaryDirectory(dir=out) as tmp, tiny.quiet():
        args = TrainingArguments(
            output_dir=tmp, max_steps=STEPS, learning_rate=1e-3, lr_scheduler_type="linear", logging_steps=1,
            per_device_train_batch_size=2, gradient_accumulation_steps=2, max_grad_norm=1.0 if ds_zero is None else 0.0,
            report_to=[], save_strategy="no", disable_tqdm=True, seed=0, data_seed=0, dataloader_num_workers=0, **extra,
        )
        trainer = Trainer(model=model, args=args, train_dataset=rows(), callbacks=[monitor, Poison()])
        try:
            trainer.train()
        except Exception as exc:  # the test asserts on it (max_skips)
            error = f"{type(exc).__name__}: {exc}"
        finally:
            monitor._finish()
        lrs = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
        del trainer
    _reset(ds_zero is not None)
    last = max(weights) if weights else 0
    same = lambda a, b: all(torch.equal(weights[a][n], weights[b][n]) for n in weights[a])  # noqa: E731
    result = {
        "equal_after_k": K in weights and K - 1 in weights and same(K, K - 1),
        "moved_after_k": K + 1 in weights and not same(K + 1, K),
        "final_finite": bool(last) and all(bool(torch.isfinite(t).all()) for t in weights[last].values()),
        "steps": sorted(weights), "lrs": lrs, "skipped": monitor.monitor.skipped if monitor.monitor else [],
        "codes": [f.code for f in monitor.findings], "error": error,
    }
    if ds_zero is not None:
        records = [json.loads(line) for line in open(_rank_path(log), encoding="utf-8")]
        result["engine_notes"] = records[0].get("engine", {}).get("notes", [])
        result["skip_records"] = [r for r in records if r["type"] == "skip"]
    return result


def fsdp2(name: str, out: str, policy=None) -> dict:
    """A custom loop under FSDP2 (``fully_shard``: DTensor weights and gradients), AdamW, gradient accumulation 2,
    ``clip_grad_norm_``, a LambdaLR stepped only where ``mon.last_step_skipped`` is False; the same NaN in rank 0's
    second micro-batch of step K. Weights compared as full tensors (a gather on every rank)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ftshims import tiny
    from ftshims.monitor import Monitor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = tiny.tiny_llama()
    poison = {"on": False}
    model.model.layers[1].mlp.register_forward_hook(lambda m, a, out: out * float("nan") if poison["on"] else out)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / STEPS)
    options = {"log": os.path.join(out, f"fsdp2-{name}.jsonl"), "off": ["loss_count_mismatch"]}
    if policy:
        options["policy"] = policy
    mon = Monitor(model, optimizer, **options)
    data = rows()
    weights, lrs = {}, []
    for step in range(1, STEPS + 1):
        for micro in range(2):
            index = (4 * (step - 1) + 2 * micro + 2 * STEPS * 4 * _rank()) % len(data)
            ids = torch.tensor([data[index]["input_ids"], data[(index + 1) % len(data)]["input_ids"]])
            poison["on"] = _rank() == 0 and step == K and micro == 1
            loss = model(input_ids=ids, labels=ids).loss / 2
            loss.backward()
            mon.after_backward(loss)
        poison["on"] = False
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        if not mon.last_step_skipped:
            schedule.step()
        mon.after_step()
        optimizer.zero_grad()
        weights[step] = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                         for n, p in model.named_parameters()}  # a DTensor's gather; the root's may be unsharded
    mon.close()
    same = lambda a, b: all(torch.equal(weights[a][n], weights[b][n]) for n in weights[a])  # noqa: E731
    return {"equal_after_k": same(K, K - 1), "moved_after_k": not same(K + 1, K),
            "final_finite": all(bool(torch.isfinite(t).all()) for t in weights[STEPS].values()),
            "steps": sorted(weights), "lrs": lrs, "skipped": mon.skipped, "codes": [f.code for f in mon.findings],
            "error": None}


def _rank_path(log: str) -> str:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        stem, suffix = os.path.splitext(log)
        return f"{stem}.rank{dist.get_rank()}{suffix}"
    return log


def _reset(deepspeed: bool) -> None:
    from accelerate.state import AcceleratorState

    if deepspeed:
        from transformers.integrations import deepspeed as hf_ds

        unset = getattr(hf_ds, "unset_hf_deepspeed_config", None)
        if unset is not None:
            unset()
    AcceleratorState._reset_state(reset_partial_state=False)
    gc.collect()


def zero2(compute_norm: bool) -> dict:
    config = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
              "gradient_accumulation_steps": "auto", "train_batch_size": "auto", "gradient_clipping": "auto"}
    if not compute_norm:
        config["zero_optimization"]["compute_grad_norm"] = False
    return config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("engine", choices=("ddp", "zero2"))
    ns = parser.parse_args()
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    if ns.engine == "zero2":
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        from accelerate import PartialState

        PartialState(backend="gloo")  # DeepSpeed on CPU: see ds_ranks.py's CPU catch
        plan = {"plain": (None, zero2(True)), "skip": (SKIP, zero2(True)),
                "nonorm-plain": (None, zero2(False)), "nonorm-skip": (SKIP, zero2(False))}
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        plan = {"plain": (None, None), "skip": (SKIP, None)}
    results = {}
    for name, (policy, ds) in plan.items():
        results[name] = run(ns.engine, name, ns.out, policy, ds)
        with open(os.path.join(ns.out, f"{ns.engine}.rank{_rank()}.json"), "w") as fh:
            json.dump(results, fh, indent=1)
    if ns.engine == "ddp":
        for name, policy in (("fsdp2-plain", None), ("fsdp2-skip", SKIP)):
            results[name] = fsdp2(name, ns.out, policy)
            with open(os.path.join(ns.out, f"{ns.engine}.rank{_rank()}.json"), "w") as fh:
                json.dump(results, fh, indent=1)
    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads can abort the interpreter's teardown; everything is written


if __name__ == "__main__":
    main()
