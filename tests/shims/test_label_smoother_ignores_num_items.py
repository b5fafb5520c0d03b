"""label_smoother_ignores_num_items: with label smoothing, the Trainer's loss of a model with loss kwargs is normalised
by num_items_in_batch, as 5.15.0 does (4.48.1-5.14 multiplied loss and gradients by the accumulation steps)."""

import tempfile

import pytest
from tests.shimcheck import assert_bug_and_fix, applied_or_skip

import ftshims
from ftshims import registry, tiny

SHIM = "label_smoother_ignores_num_items"
probe_module = registry.get(SHIM).module
ACTION = "smoothed losses normalised by num_items_in_batch"


def test_accumulated_smoothed_step_equals_the_whole_batch(evidence):
    assert_bug_and_fix(SHIM, evidence, "tiny Llama, label_smoothing_factor=0.1, 4 x 1 vs 2 x 2 accumulated")


def test_without_label_smoothing_it_is_healthy_everywhere(evidence):
    """Control: no smoother, the model's own loss uses the count."""
    assert_bug_and_fix(SHIM, evidence, "tiny Llama, no label smoothing, 4 x 1 vs 2 x 2 accumulated",
                       expect_bug=False, smoothing=0.0)


def test_trl_sft_trainer_accumulated_smoothed_step_equals_the_whole_batch(evidence):
    """TRL >= 1.15.0's SFTTrainer calls the smoother itself (the Trainer's compute_loss never runs): the count is
    marked for it too. Out of range (transformers >= 5.15) TRL passes the count itself: healthy."""
    pytest.importorskip("trl")
    assert_bug_and_fix(SHIM, evidence, "tiny Llama, TRL SFTTrainer, label_smoothing_factor=0.1, 4 x 1 vs 2 x 2",
                       trainer="sft")


def test_trl_sft_trainer_without_label_smoothing_is_untouched():
    """SFTTrainer without label smoothing (its fused LM head path): the shim marks nothing, no action, and the
    step's loss and gradients are bit-identical."""
    pytest.importorskip("trl")
    import torch

    _in_range()
    try:
        plain = probe_module.first_step(2, 2, smoothing=0.0, trainer="sft")
    except probe_module.ProbeUnsupported as exc:
        pytest.skip(str(exc))
    context = _applied(SHIM)
    try:
        shimmed = probe_module.first_step(2, 2, smoothing=0.0, trainer="sft")
        actions = ftshims.status()[SHIM].actions
    finally:
        context.__exit__(None, None, None)
    assert plain[0] == shimmed[0] and torch.equal(plain[1], shimmed[1]) and actions == {}


def _applied(*ids):
    return applied_or_skip(*ids)


def _in_range():
    from ftshims import probing

    affected, reason = probing.in_affected_range(SHIM)
    if not affected:
        pytest.skip(f"{SHIM} not active on this stack: {reason}")


def _trainer(model, **extra):
    from transformers import TrainingArguments, Trainer

    peft_module = registry.get("label_smoothing_peft_unshifted").module
    with tiny.quiet():
        return Trainer(model=model, args=peft_module.training_args(TrainingArguments, tempfile.mkdtemp(),
                                                                   label_smoothing_factor=0.1, **extra))


def test_model_without_loss_kwargs_is_left_to_the_trainers_division():
    """A model the Trainer divides itself (accepts_loss_kwargs=False): the smoother is called as installed, no action,
    bit-identical."""
    import torch

    _in_range()
    model = tiny.tiny_llama()
    model.accepts_loss_kwargs = False
    batch = tiny.batch()
    trainer = _trainer(model)
    assert not trainer.model_accepts_loss_kwargs
    with torch.no_grad():
        plain = trainer.compute_loss(model, dict(batch), num_items_in_batch=torch.tensor(20))
        context = _applied(SHIM)
        try:
            shimmed = trainer.compute_loss(model, dict(batch), num_items_in_batch=torch.tensor(20))
            actions = ftshims.status()[SHIM].actions
        finally:
            context.__exit__(None, None, None)
    assert torch.equal(plain, shimmed) and actions == {}


def test_count_gives_5_15s_loss_and_equals_the_installed_smoother_from_5_15():
    """The smoothed loss divided by the count: sum over the shifted active labels / count. From 5.15 the installed
    LabelSmoother takes the count itself; the backport's expression gives its result bit for bit."""
    import inspect

    import torch
    from transformers.trainer_pt_utils import LabelSmoother

    torch.manual_seed(0)
    logits, labels = torch.randn(2, 6, 11), torch.randint(0, 11, (2, 6))
    labels[1, :2] = -100
    smoother = LabelSmoother(epsilon=0.1)
    count = torch.tensor(17)
    ours = probe_module.smoothed_loss(smoother, {"logits": logits}, labels, True, count)
    mean = smoother({"logits": logits}, labels, shift_labels=True)
    active = int(labels[:, 1:].ne(-100).sum())
    assert float(ours) == pytest.approx(float(mean) * active / 17, rel=1e-6)
    if "num_items_in_batch" in inspect.signature(LabelSmoother.__call__).parameters:
        assert torch.equal(ours, smoother({"logits": logits}, labels, shift_labels=True, num_items_in_batch=count))


def test_composes_with_the_prefix_tuning_shift():
    """A prefix-tuned PEFT causal LM (label_smoothing_peft_unshifted shifts its labels): with both shims the smoothed
    loss is the shifted one, divided by the count."""
    pytest.importorskip("peft")
    import torch

    _in_range()
    peft_shim = registry.get("label_smoothing_peft_unshifted").module
    model = peft_shim.prefix_tuned(tiny.tiny_llama(num_key_value_heads=tiny.TINY_LLAMA["num_attention_heads"]))
    model.eval()
    batch = tiny.batch()
    trainer = _trainer(model)
    if not trainer.model_accepts_loss_kwargs:
        pytest.skip("the Trainer does not pass loss kwargs to this model here")
    active = int(batch["labels"][:, 1:].ne(-100).sum())
    count = torch.tensor(2 * active)  # as if this were half of a 2-step accumulated batch
    context = _applied(SHIM, "label_smoothing_peft_unshifted")
    try:
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            loss = float(trainer.compute_loss(model, dict(batch), num_items_in_batch=count))
        actions = ftshims.status()[SHIM].actions
    finally:
        context.__exit__(None, None, None)
    shifted, _ = peft_shim.reference_losses(logits, batch["labels"])
    assert loss == pytest.approx(shifted * active / (2 * active), rel=1e-5)
    assert actions == {ACTION: 1}
