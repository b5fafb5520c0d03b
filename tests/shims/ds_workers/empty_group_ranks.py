"""DeepSpeed ZeRO ranks for ``deepspeed_empty_param_group``: the Trainer's own optimizer with an empty group.

Run under ``torchrun --standalone --nproc_per_node=2`` (gloo, CPU: DeepSpeed picks its CPU accelerator by
itself). Each ``--scenario NAME=STAGE,OFFLOAD,MODEL,GROUPS,SHIM`` trains a ``transformers.Trainer`` with
``deepspeed=<config dict>``, one after the other in the same two ranks (each with its own engine):

* ``STAGE``: 2 or 3 (ZeRO stage); ``OFFLOAD``: ``none`` or ``cpu`` (``offload_optimizer``);
* ``MODEL``: ``lora`` (a tiny Llama, LoRA on q/v, only the LoRA weights trainable: the Trainer's no-decay
  group is empty) or ``full`` (every weight trainable: both groups hold parameters);
* ``GROUPS``: ``trainer`` (``Trainer.create_optimizer``'s two groups) or ``hand`` (a ``create_optimizer``
  override that passes only the non-empty groups, same hyperparameters: the workaround a user writes);
* ``SHIM``: ``on`` (``ftshims.apply(only=[the shim], strict=True)``) or ``off`` (nothing applied).

``--noop-shim ID`` installs that shim as a no-op in the ranks (the mutation check, ``tests/noop_shims.py``:
the shim acts in these processes, not in pytest's).

Each rank writes ``<--out>/rank<N>.json``: per scenario its loss of every forward (full precision; the Trainer
logs 4 decimals), the learning rates the Trainer logged, the parameter-group counts (the engine's basic
optimizer, the scheduler's ``base_lrs``), a SHA-256 of the trainable weights after training (gathered under
ZeRO-3), or the exception the run ended with (type, message, innermost frames), and the shim's status.

CPU catch: accelerate picks no distributed backend for DeepSpeed on a machine without GPUs, and each rank
then believes it is alone (DeepSpeed asserts on the batch size). ``ACCELERATE_USE_DEEPSPEED=true`` and
``PartialState(backend="gloo")`` first, then ``accelerator_config={"use_configured_state": True}``, make the
Trainer use the process group torchrun set up.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import os
import sys
import tempfile
import time
import traceback

STEPS = 3
ROWS = 12  # 3 steps x 2 ranks x 2 rows: each step's global batch is 4 rows
SEQ = 8
LR = 5e-2
WEIGHT_DECAY = 0.1
SHIM = "deepspeed_empty_param_group"


def rows():
    import torch

    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(ROWS):
        ids = torch.randint(3, 128, (SEQ,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": ids, "attention_mask": [1] * SEQ})
    return out


def model_for(kind: str):
    from ftshims import tiny

    model = tiny.tiny_llama(attn="eager", seed=0)
    if kind == "lora":
        return tiny.lora(model)
    if kind == "full":
        return model
    raise ValueError(f"unknown model kind {kind!r}")


def ds_config(stage: int, offload: str) -> dict:
    zero = {"stage": stage}
    if offload != "none":
        zero["offload_optimizer"] = {"device": offload, "pin_memory": False}
    return {"zero_optimization": zero, "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}


def weights_digest(model) -> str:
    """SHA-256 over the trainable weights' bytes, in parameter order (gathered from ZeRO-3's partitions)."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    ctx = contextlib.nullcontext()
    if params and hasattr(params[0], "ds_id"):
        import deepspeed

        ctx = deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    digest = hashlib.sha256()
    with ctx, torch.no_grad():
        for p in params:
            digest.update(p.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()


def hand_groups_trainer():
    from transformers import Trainer

    class HandGroups(Trainer):
        """The workaround a user writes: the Trainer's two groups without the empty one, same hyperparameters."""

        def create_optimizer(self, *args, **kwargs):
            if self.optimizer is None:
                decay = set(self.get_decay_parameter_names(self.model))
                named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
                groups = [
                    {"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                    {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
                ]
                cls, kw = self.get_optimizer_cls_and_kwargs(self.args, self.model)
                self.optimizer = cls([g for g in groups if g["params"]], **kw)
            return self.optimizer

    return HandGroups


def run(spec: str, out_dir: str) -> dict:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import ftshims
    from ftshims import tiny

    stage, offload, kind, groups, shim = spec.split(",")
    ftshims.revert()
    if shim == "on":
        ftshims.apply(only=[SHIM], strict=True)
    elif shim != "off":
        raise ValueError(f"SHIM must be on or off, not {shim!r}")
    started = time.perf_counter()
    logged, exact = [], []

    class Log(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                logged.append({k: logs[k] for k in ("loss", "learning_rate") if k in logs})

    model = model_for(kind)
    model.register_forward_hook(lambda module, inputs, output: exact.append(float(output.loss.detach())))
    record = {"spec": spec}
    trainer_cls = {"trainer": Trainer, "hand": hand_groups_trainer()}[groups]
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp, tiny.quiet():
        args = TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=2, max_steps=STEPS, learning_rate=LR,
            weight_decay=WEIGHT_DECAY, lr_scheduler_type="linear", logging_steps=1, report_to=[], save_strategy="no",
            disable_tqdm=True, seed=0, dataloader_num_workers=0, deepspeed=ds_config(int(stage), offload),
            accelerator_config={"use_configured_state": True},
        )
        trainer = trainer_cls(model=model, args=args, train_dataset=rows(), callbacks=[Log()])
        for printer in ("PrinterCallback", "ProgressCallback"):
            trainer.remove_callback(getattr(sys.modules["transformers.trainer_callback"], printer))
        try:
            trainer.train()
        except Exception as exc:  # noqa: BLE001 - the crash is the result being recorded
            frames = traceback.extract_tb(exc.__traceback__)
            record["error"] = {
                "type": type(exc).__name__, "message": str(exc)[:300],
                "where": f"{frames[-1].filename}:{frames[-1].lineno} {frames[-1].name}" if frames else "",
                "frames": [f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames[-5:]],
            }
        basic = getattr(trainer.model_wrapped, "basic_optimizer", None)
        scheduler = getattr(trainer.lr_scheduler, "scheduler", trainer.lr_scheduler)
        record.update(
            engine_groups=len(basic.param_groups) if basic is not None else None,
            scheduler_lrs=len(getattr(scheduler, "base_lrs", None) or []),
            losses=exact, logged_lrs=[entry.get("learning_rate") for entry in logged],
            shim_status=ftshims.status()[SHIM].status,
        )
        if "error" not in record:
            record["weights"] = weights_digest(trainer.model)
        del trainer, basic, scheduler
    record["seconds"] = round(time.perf_counter() - started, 2)
    _reset()
    ftshims.revert()
    return record


def _reset() -> None:
    """What one run leaves for the next in the same process: accelerate's state (the process group stays) and
    transformers' global DeepSpeed config."""
    from accelerate.state import AcceleratorState
    from transformers.integrations import deepspeed as hf_deepspeed

    unset = getattr(hf_deepspeed, "unset_hf_deepspeed_config", None)
    if unset is not None:
        unset()
    AcceleratorState._reset_state(reset_partial_state=False)
    gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenario", action="append", default=[], help="NAME=STAGE,OFFLOAD,MODEL,GROUPS,SHIM")
    parser.add_argument("--noop-shim", action="append", default=[])
    ns = parser.parse_args()
    os.makedirs(ns.out, exist_ok=True)
    if ns.noop_shim:
        from tests.noop_shims import make_noop

        make_noop(ns.noop_shim)

    from accelerate import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # what TrainingArguments(deepspeed=...) would set, too late
    state = PartialState(backend="gloo")  # the CPU catch (see the module docstring)
    results = {}
    for item in ns.scenario:
        name, spec = item.split("=", 1)
        results[name] = run(spec, ns.out)
        with open(os.path.join(ns.out, f"rank{state.process_index}.json"), "w") as f:
            json.dump({"world": state.num_processes, "results": results}, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
