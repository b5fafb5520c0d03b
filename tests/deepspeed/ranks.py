"""ftshims inside DeepSpeed ZeRO-2/3 through the HF ``Trainer``: the rank worker of ``test_zero.py``.

Run plainly (one process, no DeepSpeed: the reference) or under ``torchrun --standalone
--nproc_per_node=2`` (two ranks, CPU, gloo, ``Trainer(deepspeed=<dict>)``); ``WORLD_SIZE`` tells which.
``FTSHIMS_TEST_NOOP_SHIMS`` (the mutation check's ``--noop-shim``, passed on by the test) installs those
shims as no-ops before transformers is imported.
The script never calls ``ftshims.apply()``: the shims come from the start-up hook (``FTSHIMS_AUTO=1``
and ``ftshims-auto.pth``) in every rank, or not at all. Every scenario runs in the same processes, one
``Trainer`` after the other (each with its own DeepSpeed engine); each rank writes
``<--out>/rank<N>.json``: ``{scenario: result}``.

The two ranks see the same global batch as the single process: a sequential sampler, one example per
rank and micro step (accelerate hands batch ``j`` to rank ``j % 2``), two per micro step in one process.

Scenarios (``--scenarios``, comma-separated; the names are what the test reads):

* ``lora_z2`` / ``lora_z3``: tiny Llama, LoRA on q/v, ``lm_head`` in ``modules_to_save`` and the
  ``Trainer``'s gradient checkpointing (reentrant on transformers < 5.0): the silent form of
  ``lora_reentrant_checkpointing``. ZeRO-2, and ZeRO-3 with the optimizer offloaded to the CPU. The
  norms are in ``modules_to_save`` too (``"norm"`` matches the final norm and every layer's two), so that
  the ``Trainer``'s no-decay parameter group is not empty: with only LoRA and ``lm_head`` trainable that
  group is empty and, without a fix, torch >= 2.10's scheduler crashes at the first step under ZeRO
  (``zip() argument 2 is longer than argument 1``, see ``lora_empty_group``), and the run without
  ftshims could not show the silent bug. The same model in every run, with and without ftshims. Records the per-step losses, the LoRA tensors before and after, the eval
  loss; ``lora_z3`` also saves the adapter with ``Trainer.save_model`` (ZeRO-3 gathers it:
  ``stage3_gather_16bit_weights_on_model_save``; without it the save raises ``KeyError:
  'modules_to_save.default.weight'`` in peft's ``get_peft_model_state_dict`` on rank 0, transformers
  4.57.6 / peft 0.21.2, a loud failure, not tested here).
* ``lora_empty_group``: the same without the norm (the Trainer's own two groups, the no-decay one
  empty), ZeRO-2: the crash, or a run when a shim fixes it.
* ``resize_z3``: the model built under ``zero.Init`` (``from_pretrained`` while the Trainer's
  ``HfDeepSpeedConfig`` is alive), input embeddings frozen, ``resize_token_embeddings`` by 8 rows, then
  two ZeRO-3 steps: the flags and the new rows (one process: the same seed before the resize).
* ``ga_z2``: full fine-tuning, ZeRO-2, ``gradient_accumulation_steps=2``, rows with a prompt (-100) or
  not and right padding: each micro step's ``num_items_in_batch`` and loss.
* ``bad_config``: a ``zero_optimization`` key DeepSpeed's schema forbids (the lint's ``ds-unknown-key``
  error): what ``Trainer.train`` raises, and whether a step ran before it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback

import torch

LR = 1e-2
SEQ = 10
LORA_STEPS = 4
# A zero_optimization key DeepSpeed 0.19.8 does not have (DeepSpeedZeroConfig forbids extra keys): the lint
# reports it as an error (ds-unknown-key, "did you mean overlap_comm").
BAD_KEY = "overlap_com"
SHARED = {}  # "out": the launch's --out directory (every rank's)


def world_and_rank():
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))


def ds_config(stage, offload=False, gather_on_save=True, **zero_extra):
    zero = {"stage": stage, **zero_extra}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = gather_on_save
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": zero,
        # the Trainer's own torch AdamW, also with offload (what the single process runs)
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1000,
    }


def lm_rows(n, seed, prompt=()):
    """``n`` rows of SEQ tokens; the rows listed in ``prompt`` get 3 leading -100 labels and 2 right pads."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(3, 128, (SEQ,), generator=g)
        labels = ids.clone()
        mask = torch.ones_like(ids)
        if i in prompt:
            labels[:3] = -100
            ids[-2:] = 0
            labels[-2:] = -100
            mask[-2:] = 0
        rows.append({"input_ids": ids.tolist(), "labels": labels.tolist(), "attention_mask": mask.tolist()})
    return rows


def trainer_class():
    from torch.utils.data import SequentialSampler
    from transformers import Trainer

    class Recording(Trainer):
        """The loss and num_items_in_batch of every micro step; the same global order as one process."""

        calls = None

        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
            if model.training:
                loss = out[0] if return_outputs else out
                count = int(num_items_in_batch) if num_items_in_batch is not None else None
                self.calls.append({"loss": float(loss.detach()), "num_items_in_batch": count,
                                   "scored": int((inputs["labels"][..., 1:] != -100).sum()),
                                   "labels": int((inputs["labels"] != -100).sum())})
            return out

    return Recording


def training_args(out, world, stage=None, offload=False, gather_on_save=True, ga=1, steps=LORA_STEPS, zero_extra=None,
                  **extra):
    from transformers import TrainingArguments

    kwargs = dict(
        output_dir=out, per_device_train_batch_size=2 // world, per_device_eval_batch_size=2 // world,
        gradient_accumulation_steps=ga, max_steps=steps, learning_rate=LR, report_to=[], save_strategy="no",
        logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0, data_seed=0,
        dataloader_pin_memory=False,
    )
    if world > 1:
        kwargs.update(deepspeed=ds_config(stage, offload, gather_on_save, **(zero_extra or {})), accelerator_config={"use_configured_state": True})
    else:
        kwargs.update(use_cpu=True)
    kwargs.update(extra)
    return TrainingArguments(**kwargs)


def reset_engine_state():
    """Between two Trainers in one process: a fresh AcceleratorState (its DeepSpeed plugin), the process group
    kept; and no HfDeepSpeedConfig left behind (it would build the next model under zero.Init)."""
    from accelerate.state import AcceleratorState, GradientState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    unset_hf_deepspeed_config()


def full_values(model, keep):
    """``{name: values}`` of the parameters whose name contains ``keep``, gathered when ZeRO-3 partitions them."""
    params = [(n, p) for n, p in model.named_parameters() if keep in n]
    if any(hasattr(p, "ds_id") for _, p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
            return {n: p.detach().clone().tolist() for n, p in params}
    return {n: p.detach().clone().tolist() for n, p in params}


def lora_model(norm=True):
    from peft import LoraConfig, get_peft_model

    from ftshims import tiny

    base = tiny.tiny_llama(attn="sdpa")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM",
                        modules_to_save=["lm_head", "norm"] if norm else ["lm_head"])
    with tiny.quiet():
        return get_peft_model(base, config)


def gather(value, world):
    if world == 1:
        return [value]
    out = [None] * world
    torch.distributed.all_gather_object(out, value)
    return out


def run_lora(out, world, stage, offload=False, save=False, gather_on_save=True, norm=True):
    from ftshims import tiny

    train, evaluation = lm_rows(2 * LORA_STEPS, seed=1), lm_rows(4, seed=2)
    model = lora_model(norm=norm)  # before the TrainingArguments: not under zero.Init
    start = full_values(model, "lora_")
    groups = {"trainable": sum(p.requires_grad for p in model.parameters())}
    args = training_args(out, world, stage, offload, gather_on_save, gradient_checkpointing=True)
    trainer = trainer_class()(model=model, args=args, train_dataset=train, eval_dataset=evaluation)
    trainer.calls = []
    result = {"world": world}
    try:
        with tiny.quiet():
            trainer.train()
    except Exception as exc:  # recorded for the test (the empty-group crash); every rank raises the same
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback_tail"] = traceback.format_exc()[-1500:]
        result["calls"] = gather(trainer.calls, world)
        reset_engine_state()
        return result
    groups["optimizer_groups"] = [len(g["params"]) for g in trainer.optimizer.param_groups]
    with tiny.quiet():
        result["eval_loss"] = trainer.evaluate()["eval_loss"]
    end = full_values(trainer.model, "lora_")
    result.update(start=start, end=end, moved=sum(start[k] != end[k] for k in start), total=len(start),
                  calls=gather(trainer.calls, world), groups=groups,
                  grads_in_engine=world > 1 and trainer.model_wrapped is not trainer.model)
    if save:
        target = os.path.join(out, "adapter")
        trainer.save_model(target)
        result["saved_to"] = target
        saved_trained = full_values(trainer.model, "lm_head")
        saved_trained.update(full_values(trainer.model, "norm.modules_to_save"))
        saved_trained.update(end)
        result["trained_for_save"] = saved_trained
        if world > 1:
            torch.distributed.barrier()
        path = os.path.join(target, "adapter_model.safetensors")
        result["saved_files"] = sorted(os.listdir(target)) if os.path.isdir(target) else []
        if os.path.exists(path):
            from safetensors.torch import load_file

            tensors = load_file(path)
            result["saved"] = {k: {"shape": list(v.shape), "values": v.tolist()} for k, v in tensors.items()}
    reset_engine_state()
    return result


def run_resize(out, world):
    """The model built under zero.Init (ZeRO-3) or plainly, embeddings frozen, resized by 8 rows, two steps."""
    from ftshims import tiny

    from transformers import AutoModelForCausalLM

    saved = os.path.join(SHARED["out"], "resize_base")
    if int(os.environ.get("RANK", "0")) == 0:  # transformers 5 writes only on the main process
        tiny.tiny_llama(attn="sdpa").save_pretrained(saved)
    if world > 1:
        torch.distributed.barrier()
    args = training_args(out, world, stage=3, steps=2)  # ZeRO-3: HfDeepSpeedConfig alive from here on
    # from_pretrained builds it under zero.Init (from_config there raises IndexError in _init_weights: the
    # padding row of a partitioned, empty embedding, transformers 4.57.6 modeling_utils.py:2929)
    with tiny.quiet():
        model = AutoModelForCausalLM.from_pretrained(saved, attn_implementation="sdpa")
    zero_init = any(hasattr(p, "ds_id") for p in model.parameters())
    embed = model.get_input_embeddings()
    embed.weight.requires_grad_(False)
    torch.manual_seed(123)  # the new rows are sampled from torch's global generator
    with tiny.quiet():
        model.resize_token_embeddings(136)
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    result = {"zero_init": zero_init, "requires_grad_after_resize": embed.weight.requires_grad,
              "head_requires_grad": head.weight.requires_grad, "vocab_size": model.config.vocab_size}
    rows = full_values(model, "embed_tokens")
    rows.update(full_values(model, "lm_head"))
    result["embed_new_rows"] = next(v for k, v in rows.items() if "embed_tokens" in k)[128:]
    result["head_new_rows"] = next(v for k, v in rows.items() if "lm_head" in k)[128:]
    before = full_values(model, "embed_tokens")
    trainer = trainer_class()(model=model, args=args, train_dataset=[dict(r) for r in lm_rows(4, seed=3)])
    trainer.calls = []
    with tiny.quiet():
        trainer.train()
    after = full_values(trainer.model, "embed_tokens")
    result.update(requires_grad_after_train=trainer.model.get_input_embeddings().weight.requires_grad,
                  embed_unchanged=before == after, embed_shape=[len(next(iter(after.values()))), len(next(iter(after.values()))[0])],
                  losses=gather(trainer.calls, world))
    reset_engine_state()
    return result


def run_ga(out, world):
    from ftshims import tiny

    train = lm_rows(8, seed=4, prompt=(0, 3, 5))  # rows 0, 3, 5: prompt labels and padding
    model = tiny.tiny_llama(attn="sdpa")
    args = training_args(out, world, stage=2, ga=2, steps=2)
    trainer = trainer_class()(model=model, args=args, train_dataset=train)
    trainer.calls = []
    with tiny.quiet():
        trainer.train()
    rows = [r["labels"] for r in train]
    result = {"calls": gather(trainer.calls, world),
              "scored_per_step": [sum(sum(1 for x in r[1:] if x != -100) for r in rows[4 * s: 4 * s + 4]) for s in range(2)],
              "labels_per_step": [sum(sum(1 for x in r if x != -100) for r in rows[4 * s: 4 * s + 4]) for s in range(2)]}
    reset_engine_state()
    return result


def run_bad_config(out, world):
    from ftshims import tiny

    model = tiny.tiny_llama(attn="sdpa")
    args = training_args(out, world, stage=2, steps=1, zero_extra={BAD_KEY: True})
    trainer = trainer_class()(model=model, args=args, train_dataset=lm_rows(2, seed=5))
    trainer.calls = []
    result = {"error": None}
    try:
        with tiny.quiet():
            trainer.train()
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["error_type"] = type(exc).__name__
    result["steps_before_error"] = len(trainer.calls)
    reset_engine_state()
    return result


SCENARIOS = {
    "lora_z2": lambda out, world: run_lora(out, world, stage=2),
    "lora_z3": lambda out, world: run_lora(out, world, stage=3, offload=True, save=True),
    "lora_empty_group": lambda out, world: run_lora(out, world, stage=2, norm=False),
    "resize_z3": run_resize,
    "ga_z2": run_ga,
    "bad_config": run_bad_config,
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenarios", required=True, help="comma-separated: " + ", ".join(SCENARIOS))
    args = parser.parse_args()
    world, rank = world_and_rank()
    SHARED["out"] = args.out
    os.makedirs(args.out, exist_ok=True)
    noop = os.environ.get("FTSHIMS_TEST_NOOP_SHIMS")
    if noop:  # the mutation check (pytest --noop-shim ID): before transformers' import installs the deferred shims
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        from tests.noop_shims import make_noop

        make_noop(noop.split(","))
    if world > 1:
        # The CPU catch: on a machine without an accelerator, accelerate picks no backend for DeepSpeed
        # (state.py _prepare_backend) and every rank believes it is alone. A PartialState made for DeepSpeed
        # with gloo first, and the Trainer told to use it (accelerator_config use_configured_state).
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        from accelerate import PartialState

        PartialState(backend="gloo")
    import transformers  # noqa: F401  (deferred shims install on this import)

    import ftshims

    result = {"rank": rank, "world": world, "auto": os.environ.get("FTSHIMS_AUTO")}
    for name in args.scenarios.split(","):
        if name not in SCENARIOS:
            raise SystemExit(f"unknown scenario {name!r}")
        with tempfile.TemporaryDirectory() as scratch:
            out = os.path.join(args.out, name) if name.startswith("lora_z3") else scratch
            result[name] = SCENARIOS[name](out, world)
        if world > 1:
            torch.distributed.barrier()
    result["statuses"] = {e.id: e.status for e in ftshims.status()}
    result["acted"] = {e.id: dict(e.actions) for e in ftshims.status() if e.actions}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    if world > 1:
        torch.distributed.barrier()  # nobody tears down the group while another rank still uses it
        torch.distributed.destroy_process_group()
    # gloo's (and DeepSpeed's shared-memory) threads can abort the interpreter's teardown ("terminate called
    # without an active exception"); the work is done and written, so leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
