"""torchrun worker for tests/monitor/test_deepspeed.py: the monitor inside DeepSpeed ZeRO-2 and ZeRO-3.

    torchrun --standalone --nproc_per_node=2 ds_ranks.py OUT_DIR --stage 2 --stage 3

gloo on the CPU (DeepSpeed picks its CPU accelerator by itself). For each ``--stage``, three
``transformers.Trainer`` runs with ``deepspeed=<config dict>`` in the same two ranks, one after the other,
the monitor attached as a user would (``callbacks=[ftshims.monitor.callback(log=...)]``) and ftshims'
shims NOT applied (the test starts the ranks without ``FTSHIMS_AUTO``):

* ``healthy``: a tiny Llama, full fine-tune, the Trainer's own optimizer, ``max_grad_norm=1.0``;
* ``silent``: LoRA on q/v, ``lm_head`` in ``modules_to_save``, reentrant gradient checkpointing
  (transformers 4's default): ``lora_reentrant_checkpointing``'s silent form where the stack is in its range;
* ``nan``: the healthy model with a forward hook that turns ``model.layers.1.mlp``'s output into NaN at
  optimizer step 3 on every rank; ``max_grad_norm=0`` (transformers 4 then asks DeepSpeed for no norm:
  the monitor reads the engine's own);
* ``nan-rank0`` (ZeRO-3 only): the same NaN on rank 0 alone. Rank 0 would re-run a forward (its loss is NaN),
  rank 1 a forward and a backward (its loss is finite, the global norm is not): under ZeRO-3 those re-runs'
  parameter gathers would not match, so the ranks agree to localize nothing, and the run goes on.
* ``packing`` / ``packing-off`` (ZeRO-3 only): TRL's ``SFTTrainer`` with ``packing=True`` (one batch a rank,
  rows of several examples with restarting position ids: the packing check's input; the resume gate's
  ``sft_packing``), the healthy model (sdpa), with every detector on / with ``packing_contaminated`` off.
  Under ZeRO-3 the check stays out (its forwards broke the backward): the two runs' losses and gradient norms
  must be equal at every step;
* ``frozen`` (ZeRO-3 only): the LoRA model without checkpointing; at the end of step 2 every element of the frozen
  ``embed_tokens`` weight is moved by 1 (gathered, rank 0 modifies, DeepSpeed re-partitions): frozen_param_changed
  on both ranks (each judges its own partition).

Each run writes the monitor's JSONL per rank (``OUT/z<stage>-<run>.rank<N>.jsonl``, with the Trainer's
logged values as ``log`` records), and each rank writes ``OUT/rank<N>.json``: per run its findings, and the
step whose packed row the packing check compared (``packing_compared``).

The LoRA run uses DeepSpeed's own optimizer (an ``optimizer`` section in the config: one group of the
trainable weights): with LoRA-only trainable weights the Trainer's default optimizer has an empty no-decay
group, and on torch >= 2.10 the engine then crashes at the first scheduler step (``zip() argument 2 is
longer than argument 1``; ftshims' ``deepspeed_empty_param_group`` is about that crash, not this test).

CPU catch: accelerate picks no distributed backend for DeepSpeed without GPUs and every rank believes it is
alone; ``PartialState(backend="gloo")`` first and ``accelerator_config={"use_configured_state": True}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import tempfile

STEPS = 5
RUNS = {2: ("healthy", "silent", "nan"),
        3: ("healthy", "silent", "nan", "nan-rank0", "packing", "packing-off", "frozen")}
ROWS = 40  # 2 ranks x 2 rows x 5 steps, and some left
COMPARED = {}  # run -> the step whose packed row the packing check compared (None: it compared none)


def rows():
    import torch

    g = torch.Generator().manual_seed(1)
    start = torch.randint(0, 125, (ROWS, 1), generator=g)
    ids = 3 + (start + torch.arange(16)) % 125  # learnable progressions, as tests/monitor/runs.py's corpus
    return [{"input_ids": r.tolist(), "labels": r.tolist(), "attention_mask": [1] * 16} for r in ids]


def ds_config(stage: int, own_optimizer: bool) -> dict:
    config = {
        "zero_optimization": {"stage": stage},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
    }
    if own_optimizer:  # see the module docstring: a single group, no empty one
        config["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                           "weight_decay": "auto", "torch_adam": True}}
    return config


def sft_rows():
    """24 examples of 3..8 tokens for TRL's packing (max_length 16: rows of several examples)."""
    import torch
    from datasets import Dataset

    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(3, 9, (24,), generator=g).tolist()
    return Dataset.from_dict({"input_ids": [torch.randint(4, 128, (n,), generator=g).tolist() for n in lengths]})


def word_tokenizer():
    from ftshims import tiny

    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(4, 128)]
    return tiny.word_tokenizer(words, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def lora_model():
    from peft import LoraConfig, get_peft_model

    from ftshims import tiny

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"],
                        lora_dropout=0.0, task_type="CAUSAL_LM")
    with tiny.quiet():
        return get_peft_model(tiny.tiny_llama(), config)


def run(stage, name: str, out: str) -> list:
    """One Trainer run; ``stage`` None: the single-process reference (no DeepSpeed, the same global batch of 4)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import ftshims.monitor
    from ftshims import tiny

    extra = {}
    callbacks = []
    trainer_kwargs = {}
    options = {}
    if name == "healthy":
        model = tiny.tiny_llama()
    elif name in ("packing", "packing-off"):  # TRL's SFTTrainer, packing=True (the resume gate's sft_packing)
        model = tiny.tiny_llama(attn="sdpa")
        trainer_kwargs["processing_class"] = word_tokenizer()
        # bf16=False: SFTConfig defaults to bf16, which DeepSpeed's CPU accelerator refuses
        extra.update(packing=True, max_length=16, dataset_num_proc=None, bf16=False)
        if name == "packing-off":
            options["off"] = ["packing_contaminated"]
    elif name == "frozen":
        model = lora_model()

        class Nudge(TrainerCallback):
            def on_step_end(self, args, state, control, model=None, **kwargs):
                if state.global_step != 2:
                    return
                import deepspeed
                import torch.distributed as dist

                weight = model.get_input_embeddings().weight
                assert not weight.requires_grad
                with deepspeed.zero.GatheredParameters([weight], modifier_rank=0):
                    if dist.get_rank() == 0:
                        weight.data.add_(1.0)

        callbacks.append(Nudge())
    elif name == "silent":
        model = lora_model()
        extra["gradient_checkpointing"] = True
    elif name in ("nan", "nan-rank0"):
        import torch.distributed as dist

        model = tiny.tiny_llama()
        switch = {"on": False}
        here = name == "nan" or not dist.is_initialized() or dist.get_rank() == 0
        model.model.layers[1].mlp.register_forward_hook(lambda m, a, out: out * float("nan") if switch["on"] else out)

        class Switch(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                switch["on"] = here and state.global_step + 1 == 3

        callbacks.append(Switch())
        extra["max_grad_norm"] = 0.0
    else:
        raise SystemExit(f"unknown run {name!r}")
    if stage is None:
        extra.update(per_device_train_batch_size=4, use_cpu=True)
    else:
        extra.update(per_device_train_batch_size=1 if "packing" in extra else 2, deepspeed=ds_config(stage, own_optimizer=name in ("silent", "frozen")),
                     accelerator_config={"use_configured_state": True})
    monitor = ftshims.monitor.callback(log=os.path.join(out, f"z{stage or 'single'}-{name}.jsonl"), **options)
    with tempfile.TemporaryDirectory(dir=out) as tmp, tiny.quiet():
        kind, trainer_class, data = TrainingArguments, Trainer, rows()
        if "packing" in extra:
            from trl import SFTConfig, SFTTrainer

            kind, trainer_class, data = SFTConfig, SFTTrainer, sft_rows()
        args = kind(
            output_dir=tmp, max_steps=STEPS, learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no",
            disable_tqdm=True, seed=0, data_seed=0, dataloader_num_workers=0, **extra,
        )
        trainer = trainer_class(model=model, args=args, train_dataset=data, callbacks=[monitor, *callbacks],
                                **trainer_kwargs)
        trainer.train()
        del trainer
    _reset()
    packing = monitor.monitor.detectors.by_code.get("packing_contaminated")
    COMPARED[f"z{stage or 'single'}-{name}"] = None if packing is None else packing.compared_at
    return [finding.to_dict() for finding in monitor.findings]


def _reset() -> None:
    """What one run leaves for the next in the same ranks: accelerate's state (the process group stays) and
    transformers' global DeepSpeed config."""
    from accelerate.state import AcceleratorState
    from transformers.integrations import deepspeed as hf_ds

    unset = getattr(hf_ds, "unset_hf_deepspeed_config", None)
    if unset is not None:
        unset()
    AcceleratorState._reset_state(reset_partial_state=False)
    gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--stage", type=int, action="append", default=[])
    parser.add_argument("--run", action="append", default=[])
    ns = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # what TrainingArguments(deepspeed=...) sets, needed first
    from accelerate import PartialState

    state = PartialState(backend="gloo")  # the CPU catch (see the module docstring)
    results = {}
    for stage in ns.stage:
        for name in ns.run or RUNS[stage]:
            results[f"z{stage}-{name}"] = run(stage, name, ns.out)
            with open(os.path.join(ns.out, f"rank{state.process_index}.json"), "w") as fh:
                json.dump({"world": state.num_processes, "results": results, "packing_compared": COMPARED}, fh, indent=1)
    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads can abort the interpreter's teardown; everything is written


if __name__ == "__main__":
    main()
