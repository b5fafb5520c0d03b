"""Healthy TRL runs give zero findings at the default settings: a LoRA SFT run and a DPO run (TRL's trainers are
Trainer subclasses; the callback only uses the callback events). ftshims applied, as in test_healthy.py."""

import dataclasses
import random

import pytest

import ftshims

from .runs import default_stack_only

pytestmark = [pytest.mark.slow, default_stack_only]


def _words(rng, n):
    return " ".join(f"w{rng.randrange(4, 128)}" for _ in range(n))


def _config(cls, out, **extra):
    fields = {f.name for f in dataclasses.fields(cls)}
    settings = dict(output_dir=out, max_steps=60, per_device_train_batch_size=4, learning_rate=5e-4, report_to=[],
                    save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0, bf16=False, fp16=False,
                    use_cpu=True, max_length=48, **extra)
    return cls(**{k: v for k, v in settings.items() if k in fields})


def test_lora_sft_run_no_findings(tmp_path):
    import datasets
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    import ftshims.monitor
    from ftshims import tiny
    from ftshims.shims import _packing

    ftshims.apply()
    rng = random.Random(0)
    texts = [{"text": _words(rng, rng.randrange(8, 30))} for _ in range(160)]
    callback = ftshims.monitor.callback(log=str(tmp_path / "run.jsonl"))
    with tiny.quiet(), _packing.quiet_datasets():
        trainer = SFTTrainer(
            model=tiny.tiny_llama(attn="sdpa"), args=_config(SFTConfig, str(tmp_path)),
            train_dataset=datasets.Dataset.from_list(texts), processing_class=_packing.tiny_tokenizer(),
            peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
            callbacks=[callback],
        )
        trainer.train()
    assert callback.monitor.steps_done == 60
    assert callback.findings == [], [f.line() for f in callback.findings]


def test_dpo_run_no_findings(tmp_path):
    import datasets
    from peft import LoraConfig
    from trl import DPOConfig, DPOTrainer

    import ftshims.monitor
    from ftshims import tiny
    from ftshims.shims import _packing

    ftshims.apply()
    rng = random.Random(1)
    rows = [{"prompt": _words(rng, 6), "chosen": " " + _words(rng, 4), "rejected": " " + _words(rng, 5)} for _ in range(160)]
    callback = ftshims.monitor.callback(log=str(tmp_path / "run.jsonl"))
    with tiny.quiet(), _packing.quiet_datasets():
        trainer = DPOTrainer(
            model=tiny.tiny_llama(attn="sdpa"), args=_config(DPOConfig, str(tmp_path), max_prompt_length=16),
            train_dataset=datasets.Dataset.from_list(rows), processing_class=_packing.tiny_tokenizer(),
            peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
            callbacks=[callback],
        )
        trainer.train()
    assert callback.monitor.steps_done == 60
    assert callback.findings == [], [f.line() for f in callback.findings]
