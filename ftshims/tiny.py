"""Tiny random models built from configs, for probes and tests. No network, no weights.

Everything here imports torch/transformers inside the functions: importing this
module is as cheap as importing ``ftshims``.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Optional

TINY_LLAMA = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


@contextlib.contextmanager
def quiet():
    """Silence the deprecation chatter of old transformers/torch pairs inside probes."""
    import logging

    hf_logger = logging.getLogger("transformers")
    level = hf_logger.level
    hf_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logger.setLevel(level)


def causal_lm(config_class: str = "LlamaConfig", attn: Optional[str] = "eager", seed: int = 0, dtype=None, **overrides):
    """A small randomly initialised causal LM from ``transformers.<config_class>``.

    ``attn`` picks the attention implementation where the installed
    transformers lets one choose (>= 4.36); older versions are eager only.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    fields = dict(TINY_LLAMA) if config_class == "LlamaConfig" else {}
    fields.update(overrides)
    config = getattr(transformers, config_class)(**fields)
    torch.manual_seed(seed)
    with quiet():
        try:
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
        except TypeError:  # transformers < 4.36: no choice, eager attention
            model = AutoModelForCausalLM.from_config(config)
    if dtype is not None:
        model = model.to(dtype)
    return model


def tiny_llama(attn: Optional[str] = "eager", seed: int = 0, **overrides):
    return causal_lm("LlamaConfig", attn=attn, seed=seed, **overrides)


def lora(model, target_modules=("q_proj", "v_proj"), r: int = 4):
    """Wrap ``model`` with a LoRA adapter (``peft.get_peft_model``)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=8, target_modules=list(target_modules), lora_dropout=0.0, task_type="CAUSAL_LM")
    with quiet():
        return get_peft_model(model, config)


def batch(batch_size: int = 2, seq_len: int = 8, vocab_size: int = 128, seed: int = 0):
    """Random token ids (avoiding the special ids 0..2) with labels equal to the inputs."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab_size, (batch_size, seq_len), generator=generator)
    return {"input_ids": input_ids, "labels": input_ids.clone(), "attention_mask": torch.ones_like(input_ids)}


def lora_parameters(model):
    return {name: p for name, p in model.named_parameters() if "lora_" in name}


def word_tokenizer(words, **special_tokens):
    """A whitespace word-level fast tokenizer over ``words`` (id = position), no hub.

    ``special_tokens`` are PreTrainedTokenizerFast's (``bos_token="<s>"``, ``pad_token=...``); the
    unknown token is ``"<unk>"``, which ``words`` must contain.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", **special_tokens)


def on_cpu() -> dict:
    """The ``TrainingArguments`` keyword that keeps a Trainer on the CPU in the installed release: ``use_cpu=True``
    (transformers 4.34 and later), ``no_cuda=True`` before."""
    import inspect

    from transformers import TrainingArguments

    params = inspect.signature(TrainingArguments.__init__).parameters
    return {"use_cpu": True} if "use_cpu" in params else {"no_cuda": True}


@contextlib.contextmanager
def resumable():
    """Around a probe's resumed ``Trainer.train``: where the installed transformers cannot resume any checkpoint under
    the installed torch, the scenario cannot be expressed (``ProbeUnsupported``). transformers before ~4.40 loads
    ``rng_state.pth`` (numpy arrays) with ``torch.load``'s default, which torch 2.6 made ``weights_only=True``: every
    resume there raises ``UnpicklingError``, whatever ftshims does."""
    import pickle

    from .spec import ProbeUnsupported

    try:
        yield
    except pickle.UnpicklingError as exc:
        import torch

        from .versions import installed_version

        raise ProbeUnsupported(
            f"transformers {installed_version('transformers')} cannot resume a checkpoint under torch "
            f"{torch.__version__}: its rng_state.pth load fails (weights_only): {str(exc).splitlines()[0][:80]}"
        ) from exc


def trainer_first_step(model, rows, batch_size: int, accumulation: int, **arguments):
    """One optimizer step of a ``Trainer`` (learning rate 0, no clipping) on ``rows``: ``(the loss it logs, the
    accumulated gradients concatenated, the trainer)``. The gradients are taken as they stand after the step's
    last backward (the Trainer zeroes them after the optimizer step); ``arguments`` go to ``TrainingArguments``."""
    import gc
    import inspect
    import sys
    import tempfile

    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    logged = {}

    class Grab(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs and "loss" not in logged:
                logged.update(logs)

    accumulated = {}
    handles = [p.register_post_accumulate_grad_hook(lambda p, i=i: accumulated.__setitem__(i, p.grad.clone()))
               for i, p in enumerate(model.parameters()) if p.requires_grad]
    params = inspect.signature(TrainingArguments.__init__).parameters
    with tempfile.TemporaryDirectory() as out, quiet():
        kwargs = dict(output_dir=out, per_device_train_batch_size=batch_size, gradient_accumulation_steps=accumulation,
                      learning_rate=0.0, max_steps=1, logging_steps=1, report_to=[], max_grad_norm=1e9, seed=0,
                      save_strategy="no", disable_tqdm=True, remove_unused_columns=False, dataloader_num_workers=0,
                      **arguments)
        if "use_cpu" in params:
            kwargs["use_cpu"] = True
        trainer = Trainer(model=model, args=TrainingArguments(**kwargs), train_dataset=rows, callbacks=[Grab()])
        for quiet_callback in ("PrinterCallback", "ProgressCallback"):  # the logs printed on stdout
            trainer.remove_callback(getattr(sys.modules["transformers.trainer_callback"], quiet_callback))
        # Trainer.train ends with accelerate's free_memory(), a gc.collect() that takes ~1 s in a process holding
        # torch and transformers; with the heap frozen it takes milliseconds (unfrozen right after).
        gc.freeze()
        try:
            trainer.train()
        finally:
            gc.unfreeze()
            for handle in handles:
                handle.remove()
    grads = torch.cat([accumulated[i].reshape(-1) for i in sorted(accumulated)])
    return float(logged["loss"]), grads, trainer
