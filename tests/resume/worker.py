"""The resume gate's worker: one engine, one phase, every case in one process, one ``Trainer`` after the other.

    python tests/resume/worker.py --engine single --phase full   --out DIR [--cases a,b]
    python tests/resume/worker.py --engine single --phase resume --out DIR
    torchrun --standalone --nproc_per_node=2 tests/resume/worker.py --engine ddp,fsdp2 --phase full --out DIR

Several engines in one launch run one after the other in the same ranks (``ddp,fsdp2``; ``zero2,zero3``), each
case of each engine in ``DIR/<engine>/<case>``: a launch costs more than a case on 2 cores.

``--phase full`` trains each case's N optimizer steps in one go, writing its checkpoints as it goes;
``--phase resume`` (a new process) builds the same case again and resumes from the full run's
``checkpoint-K``. Each rank writes ``DIR/<case>/<phase>.rank<R>.json``: every micro step's loss (as the
``Trainer`` computed it, unrounded) and a fingerprint of its input ids, the learning rate of every
param group at the start of every optimizer step, the final ``global_step``; rank 0 writes the final
weights (every parameter, gathered from FSDP2's DTensors and ZeRO-3's partitions) to
``DIR/<case>/<phase>.weights.pt``. A run that raises writes ``error`` instead (the ``save_only_model``
case under ftshims' guard).

The worker calls ``ftshims.apply()`` (every default shim: the gate checks the resume users get with ftshims)
unless ``--without-ftshims``, and runs every ``Trainer`` with the monitor (``ftshims.monitor.callback()``): each
save is verified against the weights in memory on every engine (ZeRO-3: gathered) and the parity is that of a
monitored run; its finding codes and whether checkpoint-K has its manifest are in the JSON. Engines: ``single`` (one process, CPU), ``ddp`` (2 ranks, gloo), ``fsdp2``
(a loop over ``fully_shard`` with torch's distributed checkpoint, fsdp2_loop.py: the Trainer cannot run FSDP
without an accelerator), ``zero2`` / ``zero3`` (DeepSpeed on CPU, the catch of docs/deepspeed.md). The global batch is the same on every engine (per-device batch x ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

VOCAB = 128
SEQ = 8

# name -> what the case is; its N and K are in CASES' builder (max_steps / epochs, save_steps = K)
CASE_NAMES = (
    "full_resized_tied",  # full fine-tune, tied embeddings resized, attention dropout, 2 epochs, resume mid-epoch
    "lora_mts_resized",  # LoRA (dropout) + modules_to_save embed_tokens/lm_head on resized embeddings
    "ga_mid_epoch",  # gradient accumulation 4 over 6 batches an epoch (windows 4 + 2), resume mid-epoch
    "ga_epoch_end",  # the same, resumed at an epoch's end
    "workers_mid_epoch",  # 2 DataLoader workers, a plain collator, resumed mid-epoch
    "workers_random_epoch_end",  # 2 workers, a collator that masks labels at random (worker RNG), at an epoch's end
    "random_collate_mid_epoch",  # that collator in the main process (the global RNG), resumed mid-epoch
    "workers_random_mid_epoch",  # that collator in 2 workers, resumed mid-epoch
    "iterable_multipass",  # an IterableDataset (no length), max_steps past one pass, resumed after it wrapped
    "sft_packing",  # TRL SFTTrainer, packing=True
    "save_only_model",  # save_only_model=True: no optimizer/scheduler/RNG in the checkpoint
)


def world_and_rank():
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))


def rows(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(3, VOCAB, (n, SEQ), generator=g)
    return [{"input_ids": r.tolist(), "labels": r.tolist()} for r in x]


class IterRows(torch.utils.data.IterableDataset):
    """A finite iterable dataset (no ``__len__``): the same ``n`` rows every pass."""

    def __init__(self, n=10):
        self.data = rows(n, seed=3)

    def __iter__(self):
        for row in self.data:
            yield {"input_ids": torch.tensor(row["input_ids"]), "labels": torch.tensor(row["labels"])}


class RandomMaskCollator:
    """Stacks rows and ignores 30 % of the labels at random: the draw depends on the worker's RNG."""

    def __call__(self, features):
        ids = torch.stack([torch.as_tensor(f["input_ids"]) for f in features])
        labels = ids.clone()
        labels[torch.rand(ids.shape) < 0.3] = -100
        return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


def tiny_model(tie=False, resize=None, dropout=0.0):
    from ftshims import tiny

    model = tiny.tiny_llama(attn="sdpa", tie_word_embeddings=tie, attention_dropout=dropout)
    if resize:
        torch.manual_seed(5)
        with tiny.quiet():
            model.resize_token_embeddings(resize)
    return model


def word_tokenizer():
    from ftshims import tiny

    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(4, VOCAB)]
    return tiny.word_tokenizer(words, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def case(name, engine, world):
    """``(trainer class, model, dataset, collator, TrainingArguments kwargs, checkpoint K)``."""
    from transformers import Trainer

    per_device = 2 // world
    kw = dict(per_device_train_batch_size=per_device, learning_rate=5e-3, lr_scheduler_type="linear", warmup_steps=2,
              num_train_epochs=2, max_steps=-1)
    collator, cls = None, Trainer
    if name == "full_resized_tied":
        model, data, k = tiny_model(tie=True, resize=VOCAB + 8, dropout=0.1), rows(12), 9
    elif name == "lora_mts_resized":
        from peft import LoraConfig, get_peft_model

        from ftshims import tiny

        base = tiny_model(resize=VOCAB + 8)
        with tiny.quiet():
            model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                    lora_dropout=0.1, modules_to_save=["embed_tokens", "lm_head"],
                                                    task_type="CAUSAL_LM"))
        data, k = rows(12), 9
    elif name in ("ga_mid_epoch", "ga_epoch_end"):
        model, data = tiny_model(), rows(12)
        kw.update(gradient_accumulation_steps=4, num_train_epochs=3)  # 6 batches an epoch: steps of 4 and 2 batches
        k = 3 if name == "ga_mid_epoch" else 4
    elif name in ("workers_mid_epoch", "workers_random_epoch_end", "random_collate_mid_epoch", "workers_random_mid_epoch"):
        model, data = tiny_model(), rows(12)
        collator = None if name == "workers_mid_epoch" else RandomMaskCollator()
        k = 6 if name.endswith("epoch_end") else 9  # 6 steps an epoch
        if name.startswith("workers"):
            kw.update(dataloader_num_workers=2)
    elif name == "iterable_multipass":
        model, data, k = tiny_model(), IterRows(10), 12
        kw.update(per_device_train_batch_size=1, max_steps=16, num_train_epochs=1)
    elif name == "sft_packing":
        from trl import SFTConfig, SFTTrainer

        model, k = tiny_model(), 6
        data = _sft_dataset()
        # bf16=False: SFTConfig defaults to bf16, which DeepSpeed's CPU accelerator refuses (the other engines run fp32)
        kw.update(packing=True, max_length=16, dataset_num_proc=None, per_device_train_batch_size=per_device, bf16=False)
        cls = SFTTrainer
    elif name == "save_only_model":
        model, data, k = tiny_model(), rows(16), 4
        kw.update(max_steps=8, num_train_epochs=1, save_only_model=True)
    else:
        raise SystemExit(f"unknown case {name!r}; cases: {', '.join(CASE_NAMES)}")
    return cls, model, data, collator, kw, k


def _sft_dataset():
    from datasets import Dataset

    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(3, 9, (24,), generator=g).tolist()
    ids = [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in lengths]
    return Dataset.from_dict({"input_ids": ids})


def engine_args(engine, world, out):
    from tests.deepspeed.ranks import ds_config

    kw = dict(output_dir=out, report_to=[], disable_tqdm=True, logging_strategy="no", seed=0, data_seed=0,
              dataloader_pin_memory=False, save_strategy="steps", max_grad_norm=1.0)
    if engine == "single":
        kw.update(use_cpu=True)
    elif engine == "ddp":
        kw.update(use_cpu=True, ddp_backend="gloo")
    elif engine in ("zero2", "zero3"):
        kw.update(deepspeed=ds_config(2 if engine == "zero2" else 3), accelerator_config={"use_configured_state": True})
    else:
        raise SystemExit(f"unknown engine {engine!r}")
    return kw


def recording(cls):
    """``cls`` with every training micro step's loss and input fingerprint recorded."""

    class Recording(cls):
        def compute_loss(self, model, inputs, *args, **kwargs):
            out = super().compute_loss(model, inputs, *args, **kwargs)
            if model.training:
                loss = out[0] if isinstance(out, tuple) else out
                ids = inputs["input_ids"]
                weights = torch.arange(1, ids.numel() + 1, dtype=torch.int64).reshape(ids.shape)
                self.calls.append({"step": self.state.global_step + 1, "loss": float(loss.detach()),
                                   "ids": int((ids.to(torch.int64).cpu() * weights).sum())})
            return out

    return Recording


def lr_recorder(lrs):
    from transformers import TrainerCallback

    class LearningRates(TrainerCallback):
        def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
            if optimizer is not None:
                lrs[str(state.global_step + 1)] = [float(g["lr"]) for g in optimizer.param_groups]

    return LearningRates()


def final_weights(trainer):
    """Every parameter's full value (DTensor shards gathered; ZeRO-3 partitions gathered), on every rank."""
    model = trainer.model
    named = list(model.named_parameters())
    if any(hasattr(p, "ds_id") for _, p in named):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
            return {n: p.detach().clone().cpu() for n, p in named}
    out = {}
    for n, p in named:
        value = p.detach()
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        out[n] = value.clone().cpu()
    return out


def reset_engine_state():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    try:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
    except ImportError:
        pass


def run_case(name, engine, phase, out):
    if engine == "fsdp2":
        from fsdp2_loop import run_case as loop  # the worker's own directory is on sys.path

        return loop(name, phase, out, sys.modules[__name__])
    world, rank = world_and_rank()
    folder = Path(out) / name
    folder.mkdir(parents=True, exist_ok=True)
    result = {"case": name, "engine": engine, "phase": phase, "world": world, "rank": rank, "calls": [], "lrs": {}}
    try:
        trainer, lrs, k = build_trainer(name, engine, phase, folder, world)
        result.update(k=k, lrs=lrs)
        resume = str(folder / "run" / f"checkpoint-{k}") if phase == "resume" else None
        from ftshims import tiny

        try:
            with tiny.quiet():
                trainer.train(resume_from_checkpoint=resume)
        finally:
            result["calls"] = trainer.calls
            result["findings"] = [f.code for f in trainer.ftshims_monitor.findings]
            checkpoint = folder / "run" / f"checkpoint-{k}"
            result["manifest"] = (checkpoint / "ftshims-manifest.json").is_file()
        result["global_step"] = trainer.state.global_step
        result["distributed_type"] = str(trainer.accelerator.distributed_type)
        result["dtensor"] = any(hasattr(p, "full_tensor") for p in trainer.model.parameters())
        result["zero3_partitioned"] = any(hasattr(p, "ds_id") for p in trainer.model.parameters())
        weights = final_weights(trainer)
        if rank == 0:
            torch.save(weights, folder / f"{phase}.weights.pt")
    except Exception as exc:  # recorded for the test: the guard's refusal, or a failure to explain
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-3000:]
    (folder / f"{phase}.rank{rank}.json").write_text(json.dumps(result))
    reset_engine_state()


def build_trainer(name, engine, phase, folder, world):
    from transformers import TrainingArguments

    from ftshims import tiny

    cls, model, data, collator, kw, k = case(name, engine, world)
    args_kw = engine_args(engine, world, str(folder / ("run" if phase == "full" else "resumed")))
    args_kw.update(kw, save_steps=k)
    if cls.__name__ == "SFTTrainer":
        from trl import SFTConfig

        args = SFTConfig(**args_kw)
    else:
        args = TrainingArguments(**args_kw)
    trainer_kw = dict(model=model, args=args, train_dataset=data)
    if collator is not None:
        trainer_kw["data_collator"] = collator
    if cls.__name__ == "SFTTrainer":
        trainer_kw["processing_class"] = word_tokenizer()
    lrs = {}
    import ftshims.monitor

    # every save verified against memory, a manifest written beside it; every detector on, on every engine
    monitor = ftshims.monitor.callback()
    with tiny.quiet():
        trainer = recording(cls)(callbacks=[lr_recorder(lrs), monitor], **trainer_kw)
    trainer.calls = []
    trainer.ftshims_monitor = monitor
    return trainer, lrs, k


def cpu_rank_locations():
    """The CPU stand-in's one accommodation: transformers 4.57 loads the optimizer state of a multi-process run with
    ``map_location=args.device``, which is ``cpu:0`` on a multi-process CPU run, and torch cannot restore that tag
    ("don't know how to restore data location ... (tagged with cpu:0)"): every DDP/FSDP2 resume on CPU would
    crash before its first step. On GPUs the device is ``cuda:N``, which torch restores. Here ``cpu:N`` is
    registered as the CPU (5.25 passes no such map_location). Declared in test_resume.py."""
    from torch import serialization

    def cpu_rank(obj, location):
        if isinstance(location, str) and location.startswith("cpu:"):
            return obj
        return None

    serialization.register_package(5, lambda obj: None, cpu_rank)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", default="single")
    parser.add_argument("--phase", choices=("full", "resume"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default=",".join(CASE_NAMES))
    parser.add_argument("--without-ftshims", action="store_true")
    args = parser.parse_args()
    world, _ = world_and_rank()
    os.environ.setdefault("WANDB_DISABLED", "true")
    engines = [e for e in args.engine.split(",") if e]
    deepspeed = {"zero2", "zero3"} & set(engines)
    if deepspeed and set(engines) - deepspeed:
        raise SystemExit("DeepSpeed engines run in a launch of their own (their PartialState is made for DeepSpeed)")
    if deepspeed:
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # docs/deepspeed.md: the CPU catch
        from accelerate import PartialState

        PartialState(backend="gloo")
    if world > 1 and "ddp" in engines:
        cpu_rank_locations()
    if not args.without_ftshims:
        import ftshims

        ftshims.apply()
    import transformers

    transformers.logging.set_verbosity_error()
    from fsdp2_loop import CASES as FSDP2_CASES

    for engine in engines:
        if engine == "fsdp2":  # fsdp2_loop.py: no Trainer (it cannot run FSDP without an accelerator)
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("gloo")
        for name in args.cases.split(","):
            if engine != "fsdp2" or name in FSDP2_CASES:
                run_case(name, engine, args.phase, os.path.join(args.out, engine))
    import torch.distributed as dist

    # Tear the process group down before the interpreter exits, as the other multi-rank scripts here do: a gloo
    # group left alive at exit aborted one rank of a CI run's DDP/FSDP2 launch ("terminate called without an active
    # exception", SIGABRT after every case had finished), which failed the whole launch. Not under DeepSpeed: there
    # the barrier waited for ever (its launches never aborted this way)
    if not deepspeed and dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
