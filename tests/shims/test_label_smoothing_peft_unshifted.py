"""label_smoothing_peft_unshifted: with label_smoothing_factor>0 the Trainer scores a PEFT causal LM's logits
against shifted labels (transformers 4.21-4.35 left them unshifted for LoRA-style PEFT models; 4.21-4.31 and
every release from 4.36 leave them unshifted for prefix tuning), and, for prompt tuning / p-tuning, past the
virtual-token prefix as PEFT's own loss does (upstream: a shape error on every version)."""

import tempfile

import pytest
from tests.shimcheck import assert_bug_and_fix

import ftshims
from ftshims import registry, tiny

SHIM = "label_smoothing_peft_unshifted"
probe_module = registry.get(SHIM).module


def _transformers_before(version):
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) < Version(version)


def test_peft_causal_lm_smoothed_loss_is_shifted(evidence):
    """LoRA: unshifted before 4.36 (PR #27162), shifted from 4.36 (the shim's forced shift is then a no-op)."""
    assert_bug_and_fix(SHIM, evidence, "LoRA causal LM, label_smoothing_factor=0.1",
                       expect_bug=_transformers_before("4.36"), model="peft_causal")


def test_module_wrapped_peft_causal_lm_smoothed_loss_is_shifted(evidence):
    """Inside a DataParallel container (as Trainer.model_wrapped): 4.36 unwraps it before the PeftModel test, and so
    does the shim."""
    assert_bug_and_fix(SHIM, evidence, "LoRA causal LM in a DataParallel container, label_smoothing_factor=0.1",
                       expect_bug=_transformers_before("4.36"), model="wrapped_peft_causal")


def test_prefix_tuned_causal_lm_smoothed_loss_is_shifted(evidence):
    """Prefix tuning: 4.21-4.31 read "PeftModelForCausalLM" (unshifted), 4.32-4.35 read base_model's name, the
    causal LM itself (shifted), and 4.36+ read base_model.model's, the headless backbone (unshifted again)."""
    buggy = _transformers_before("4.32") or not _transformers_before("4.36")
    assert_bug_and_fix(SHIM, evidence, "prefix-tuned causal LM, label_smoothing_factor=0.1", expect_bug=buggy,
                       model="prefix_causal")


def test_plain_causal_lm_is_healthy_everywhere(evidence):
    """Control: a bare registered causal LM is shifted by every version, with or without the shim."""
    assert_bug_and_fix(SHIM, evidence, "plain causal LM, label_smoothing_factor=0.1", expect_bug=False,
                       model="plain_causal")


def _trainer(model, smoothing=0.1):
    from transformers import Trainer, TrainingArguments

    out = tempfile.mkdtemp()
    with tiny.quiet():
        args = probe_module.training_args(TrainingArguments, out, label_smoothing_factor=smoothing)
        return Trainer(model=model, args=args)


def _seqcls_lora():
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    config = transformers.LlamaConfig(**dict(tiny.TINY_LLAMA, num_labels=3))
    torch.manual_seed(0)
    with tiny.quiet():
        model = transformers.AutoModelForSequenceClassification.from_config(config)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                          task_type="SEQ_CLS")
        return get_peft_model(model, lora)


def _loss(trainer, model, batch):
    import torch

    with torch.no_grad(), tiny.quiet():
        return trainer.compute_loss(model, dict(batch))


def _assert_untouched(trainer, model, batch):
    """The loss is the same tensor value with and without the shim, and the shim records no action."""
    import torch

    plain = _loss(trainer, model, batch)
    with ftshims.applied(only=[SHIM]):
        shimmed = _loss(trainer, model, batch)
        actions = ftshims.status()[SHIM].actions
    assert torch.equal(plain, shimmed)
    assert actions == {}


def test_peft_sequence_classification_loss_is_bit_identical():
    """A LoRA sequence classifier's labels must not be shifted: its smoothed loss is the same tensor value
    with and without the shim, and the shim does nothing."""
    import torch

    model = _seqcls_lora().eval()
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]]), "labels": torch.tensor([0, 2])}
    trainer = _trainer(model)
    _assert_untouched(trainer, model, batch)


def test_no_label_smoothing_passes_through():
    """label_smoothing_factor=0: the model computes its own (shifted) loss; the shim does nothing."""
    model = tiny.lora(tiny.tiny_llama()).eval()
    batch = tiny.batch()
    trainer = _trainer(model, smoothing=0.0)
    _assert_untouched(trainer, model, batch)


class _Boom(RuntimeError):
    pass


def _boom(module, args):
    raise _Boom("forward failed")


def test_trainer_untouched_and_mark_cleared_after_errors():
    """The shim marks the smoother only for the length of one compute_loss call, on this thread: afterwards
    (also after an exception) a direct smoother call is unshifted as requested, and the trainer is unchanged."""
    import torch

    model = tiny.lora(tiny.tiny_llama()).eval()
    batch = tiny.batch()
    trainer = _trainer(model)
    smoother = trainer.label_smoother
    with ftshims.applied(only=[SHIM]) as report:
        if not report[SHIM].active:
            pytest.skip(f"{SHIM} not active on this stack: {report[SHIM].reason}")
        _loss(trainer, model, batch)
        assert trainer.label_smoother is smoother
        assert ftshims.status()[SHIM].actions == {"label-smoothed losses computed on shifted labels": 1}
        handle = model.register_forward_pre_hook(_boom)
        try:
            with pytest.raises(_Boom), tiny.quiet():
                trainer.compute_loss(model, dict(batch))
        finally:
            handle.remove()
        assert getattr(probe_module._STATE, "smoother", None) is None
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"]).logits
        direct = float(smoother({"logits": logits}, batch["labels"]))
        _, unshifted = probe_module.reference_losses(logits, batch["labels"])
    assert abs(direct - unshifted) < 1e-5  # outside compute_loss the smoother does what it is told


@pytest.mark.parametrize("method", ["prompt_causal", "ptuning_causal"])
def test_prompt_tuned_causal_lm_smoothed_loss_past_the_virtual_tokens(evidence, method):
    """Prompt tuning / p-tuning prepend virtual tokens: upstream's smoother fails with a shape error on every
    version; with the shim it scores the logits that belong to the labels, as PEFT's own loss does."""
    assert_bug_and_fix(SHIM, evidence, f"{method.split('_')[0]}-tuned causal LM, label_smoothing_factor=0.1",
                       expect_bug=True, model=method)


def _prompt_tuned(peft_type="PROMPT_TUNING"):
    base = tiny.tiny_llama(num_key_value_heads=tiny.TINY_LLAMA["num_attention_heads"])
    return probe_module.prompt_tuned(base, peft_type).eval()


def _error(trainer, model, batch):
    try:
        _loss(trainer, model, batch)
    except RuntimeError as exc:  # the logits carry the virtual tokens, the labels do not
        return str(exc)
    return None


def test_prompt_tuning_scores_the_pairs_peft_scores():
    """Without the shim: the shape error. With it: the smoothed loss of the labels behind num_virtual_tokens ignored
    labels, shifted (the last virtual position predicts the first label); its NLL part (epsilon 0) is PEFT's own
    unsmoothed loss, and a trainer with label_smoothing_factor=0 is untouched."""
    import torch

    model = _prompt_tuned()
    batch = tiny.batch()
    trainer = _trainer(model)
    assert _error(trainer, model, batch) is not None
    with ftshims.applied(only=[SHIM]):
        loss = float(_loss(trainer, model, batch))
        actions = ftshims.status()[SHIM].actions
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        own = float(model(**batch).loss)
    shifted, _ = probe_module.reference_losses(logits, batch["labels"], prefix=3)
    nll, _ = probe_module.reference_losses(logits, batch["labels"], prefix=3, epsilon=0.0)
    assert abs(loss - shifted) < 1e-6 and abs(nll - own) < 1e-6, (loss, shifted, nll, own)
    assert actions == {"label-smoothed losses computed past the virtual-token prefix, on shifted labels": 1}
    _assert_untouched(_trainer(model, smoothing=0.0), model, batch)


def test_prefix_length_must_match_exactly():
    """Logits longer than the labels by anything but the adapter's virtual tokens pass through (the smoother
    decides, and fails, as upstream): labels cut by one position keep upstream's shape error."""
    model = _prompt_tuned()
    batch = tiny.batch()
    short = dict(batch, labels=batch["labels"][:, 1:])
    trainer = _trainer(model)
    plain = _error(trainer, model, short)
    with ftshims.applied(only=[SHIM]):
        shimmed = _error(trainer, model, short)
        actions = ftshims.status()[SHIM].actions
    assert plain is not None and shimmed == plain
    assert actions == {}


def test_predicate_sees_through_torch_compile():
    """A torch.compile wrapper (accelerate's unwrap_model strips it in 4.46+) is unwrapped like a container;
    the causal LM inside is base_model for prefix tuning, base_model.model for LoRA; other heads are not."""
    import torch

    prefix = probe_module.prefix_tuned(tiny.tiny_llama(num_key_value_heads=tiny.TINY_LLAMA["num_attention_heads"]))
    lora = tiny.lora(tiny.tiny_llama())
    assert probe_module.is_peft_registered_causal_lm(prefix)
    assert probe_module.is_peft_registered_causal_lm(torch.compile(lora))  # lazy: nothing is compiled here
    assert not probe_module.is_peft_registered_causal_lm(_seqcls_lora())
    assert not probe_module.is_peft_registered_causal_lm(prefix.base_model)  # not a PeftModel


def test_compute_loss_func_passes_through():
    """4.46+: a compute_loss_func takes the labels instead of the smoother; the shim leaves that call alone."""
    import inspect

    from transformers import Trainer, TrainingArguments

    if "compute_loss_func" not in inspect.signature(Trainer.__init__).parameters:
        pytest.skip("this transformers' Trainer takes no compute_loss_func")
    model = probe_module.prefix_tuned(tiny.tiny_llama(num_key_value_heads=tiny.TINY_LLAMA["num_attention_heads"]))
    model.eval()
    batch = tiny.batch()

    def loss_func(outputs, labels, num_items_in_batch=None):
        return trainer.label_smoother(outputs, labels)  # a user function that reuses the trainer's smoother

    with tiny.quiet():
        args = probe_module.training_args(TrainingArguments, tempfile.mkdtemp(), label_smoothing_factor=0.1)
        trainer = Trainer(model=model, args=args, compute_loss_func=loss_func)
    _assert_untouched(trainer, model, batch)
