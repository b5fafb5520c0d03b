"""num_items_in_batch_overcount: the Trainer normalises a causal LM's summed loss by the labels the shifted
loss scores (transformers 4.57-5.10.0 counted position 0 of every row as well)."""

import pytest
from tests.shimcheck import assert_bug_and_fix

import ftshims
from ftshims import registry

SHIM = "num_items_in_batch_overcount"
probe_module = registry.get(SHIM).module


def test_full_labels_loss_is_mean_over_scored_tokens(evidence):
    assert_bug_and_fix(SHIM, evidence, "full labels", labels="full")


def test_completion_only_labels_are_healthy_everywhere(evidence):
    """Position 0 is already -100: the count is right on every version, and the shim changes nothing."""
    assert_bug_and_fix(SHIM, evidence, "completion-only labels", expect_bug=False, labels="completion_only")


def _trainer(model):
    import tempfile

    from transformers import Trainer, TrainingArguments

    if not hasattr(Trainer, "_get_num_items_in_batch"):
        pytest.skip("this Trainer has no _get_num_items_in_batch (before 4.57)")
    out = tempfile.mkdtemp()
    return Trainer(model=model, args=probe_module._training_args(TrainingArguments, out))


def test_non_causal_model_count_unchanged():
    """A sequence-classification model's loss does not shift: its count is left to upstream."""
    import torch
    import transformers

    from ftshims import tiny

    config = transformers.LlamaConfig(**dict(tiny.TINY_LLAMA, num_labels=2))
    with tiny.quiet():
        model = transformers.AutoModelForSequenceClassification.from_config(config)
        trainer = _trainer(model)
    batch = {"input_ids": torch.tensor([[5, 6, 7], [8, 9, 10]]), "labels": torch.tensor([0, 1])}
    plain = trainer._get_num_items_in_batch([batch], torch.device("cpu"))
    with ftshims.applied(only=[SHIM]):
        shimmed = trainer._get_num_items_in_batch([batch], torch.device("cpu"))
    assert (plain is None and shimmed is None) or int(plain) == int(shimmed)


def test_batches_are_not_modified_and_shift_labels_are_counted():
    import torch

    from ftshims import tiny

    with tiny.quiet():
        trainer = _trainer(tiny.tiny_llama())
    labels = torch.tensor([[5, 6, 7, 8], [9, 10, -100, -100]])
    batch = {"input_ids": labels.clamp(min=3), "labels": labels}
    shifted = dict(batch, shift_labels=torch.tensor([[6, 7, -100, -100], [10, -100, -100, -100]]))
    with ftshims.applied(only=[SHIM]) as report:
        if not report[SHIM].active:
            pytest.skip(f"{SHIM} not active on this stack: {report[SHIM].reason}")
        num = trainer._get_num_items_in_batch([batch, shifted], torch.device("cpu"))
        actions = ftshims.status()[SHIM].actions
    assert batch["labels"] is labels and shifted["labels"] is labels  # the training batches are untouched
    assert int(num) == 4 + 3  # labels[..., 1:] of the first batch, shift_labels of the second
    assert actions == {"batches counted over the scored labels": 2}
