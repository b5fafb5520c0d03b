"""trainer_invalid_generation_config_crash_at_first_save: a model whose generation config cannot be saved is refused
when train() starts (upstream: 5 steps train, then the first checkpoint save raises); a valid config trains and
saves exactly as upstream, and the guard never changes the model's config."""

import pytest
from tests.shimcheck import applied_or_skip, assert_bug_and_fix

from ftshims import registry

SHIM = "trainer_invalid_generation_config_crash_at_first_save"
shim_module = registry.get(SHIM).module


def test_invalid_generation_config_refused_before_training(evidence):
    assert_bug_and_fix(SHIM, evidence, "temperature 1e-6 with do_sample=False: refused at train()")


def test_valid_generation_config_trains_and_saves(evidence):
    assert_bug_and_fix(SHIM, evidence, "valid generation config (healthy)", expect_bug=False, invalid=False)


def test_the_error_gives_transformers_reason_and_the_fix_and_the_config_is_untouched(tmp_path):
    from transformers import Trainer, TrainingArguments

    from ftshims import tiny

    context = applied_or_skip(SHIM)
    try:
        model = tiny.tiny_llama()
        model.generation_config.do_sample = False
        model.generation_config.temperature = 1e-6
        before = model.generation_config.to_dict()
        trainer = Trainer(model=model, args=TrainingArguments(str(tmp_path), report_to=[], max_steps=1, **tiny.on_cpu()),
                          train_dataset=[{"input_ids": [3, 4], "labels": [3, 4]}])
        with pytest.raises(shim_module.InvalidGenerationConfig) as raised:
            trainer.train()
        text = str(raised.value)
        assert "temperature" in text and "do_sample = True" in text and isinstance(raised.value, ValueError)
        assert model.generation_config.to_dict() == before
    finally:
        context.__exit__(None, None, None)


def test_peft_models_are_not_checked():
    """A PeftModel's Trainer save writes the adapter only (no generation config): the guard stays out."""
    from types import SimpleNamespace

    from ftshims import tiny

    peft_model = tiny.lora(tiny.tiny_llama())
    assert shim_module.saved_model(SimpleNamespace(model=peft_model, accelerator=None)) is None
    assert shim_module.saved_model(SimpleNamespace(model=tiny.tiny_llama(), accelerator=None)) is not None


def test_a_run_that_saves_no_checkpoint_is_not_refused(tmp_path):
    """save_strategy="no": the run may never save (a sweep, an evaluation run), so it trains as upstream does; the guard
    only counts it and says once that a later save would raise."""
    import torch
    from transformers import Trainer, TrainingArguments

    import ftshims
    from ftshims import tiny

    context = applied_or_skip(SHIM)
    try:
        model = tiny.tiny_llama()
        model.generation_config.do_sample = False
        model.generation_config.temperature = 1e-6
        before = [p.detach().clone() for p in model.parameters()]
        args = TrainingArguments(str(tmp_path), report_to=[], max_steps=2, save_strategy="no", **tiny.on_cpu(),
                                 learning_rate=1e-2, disable_tqdm=True)
        rows = [{"input_ids": [3, 4, 5], "labels": [3, 4, 5]}] * 4
        with tiny.quiet(), shim_module.user_warnings_default():
            Trainer(model=model, args=args, train_dataset=rows).train()
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters())), "the run did not train"
        assert ftshims.status()[SHIM].actions.get("trainings without checkpoint saves let through") == 1
    finally:
        context.__exit__(None, None, None)
