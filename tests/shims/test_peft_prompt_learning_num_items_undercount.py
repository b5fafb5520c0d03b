"""peft_prompt_learning_num_items_undercount: the Trainer counts every label of a PEFT prompt-tuned / p-tuned
causal LM (whose virtual tokens' ignored labels make the shifted loss score them all), not labels[..., 1:]
(transformers >=5.10.1)."""

import pytest
from tests.shimcheck import assert_bug_and_fix, applied_or_skip

import ftshims
from ftshims import registry

SHIM = "peft_prompt_learning_num_items_undercount"
probe_module = registry.get(SHIM).module
ACTION = "prompt-learning batches counted over every label"


@pytest.mark.parametrize("method", ["prompt_tuning", "p_tuning"])
def test_prompt_learning_loss_is_the_mean_over_scored_labels(evidence, method):
    assert_bug_and_fix(SHIM, evidence, f"{method}, tiny Llama, two rows of 8 labels", method=method)


def _skip_outside_the_range():
    """Before anything else: before 4.57 the Trainer has no _get_num_items_in_batch to call."""
    applied_or_skip(SHIM).__exit__(None, None, None)


def _count(trainer, batches):
    import torch

    return trainer._get_num_items_in_batch(batches, torch.device("cpu"))


def _trainer(model):
    import tempfile

    from transformers import Trainer, TrainingArguments

    from ftshims import tiny
    from ftshims.shims.num_items_in_batch_overcount import _training_args

    with tiny.quiet():
        return Trainer(model=model, args=_training_args(TrainingArguments, tempfile.mkdtemp()))


def test_other_methods_and_batches_keep_upstreams_count():
    """Do no harm: prefix tuning and LoRA (no prepended labels), a prompt-tuned batch with its own shift_labels, and
    the plain base model are counted exactly as without the shim, and the batches are never modified."""
    import torch

    from ftshims import tiny

    _skip_outside_the_range()
    batch = probe_module.batch()
    shifted = dict(batch, shift_labels=torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100))
    cases = [(_trainer(probe_module.prompt_model("prefix_tuning")), [batch]),
             (_trainer(probe_module.prompt_model("lora")), [batch]),
             (_trainer(probe_module.prompt_model("prompt_tuning")), [shifted]),
             (_trainer(tiny.tiny_llama()), [batch])]
    plain = [_count(trainer, batches) for trainer, batches in cases]
    labels = batch["labels"].clone()
    context = applied_or_skip(SHIM)
    try:
        shimmed = [_count(trainer, batches) for trainer, batches in cases]
        actions = ftshims.status()[SHIM].actions
    finally:
        context.__exit__(None, None, None)
    assert [int(n) for n in shimmed] == [int(n) for n in plain]
    assert actions == {}
    assert torch.equal(batch["labels"], labels) and "shift_labels" not in batch


def test_prompt_tuned_count_over_accumulated_batches():
    """Two micro-batches (one right-padded): every label that is not -100 is counted, the batches untouched."""
    import torch

    _skip_outside_the_range()
    trainer = _trainer(probe_module.prompt_model("prompt_tuning"))
    first = probe_module.batch()
    second = probe_module.batch()
    second["labels"] = second["labels"].clone()
    second["labels"][1, 5:] = -100
    before = second["labels"].clone()
    context = applied_or_skip(SHIM)
    try:
        num = _count(trainer, [first, second])
        actions = ftshims.status()[SHIM].actions
    finally:
        context.__exit__(None, None, None)
    assert int(num) == int(first["labels"].ne(-100).sum() + second["labels"].ne(-100).sum()) == 29
    assert torch.equal(second["labels"], before)
    assert actions == {ACTION: 2}
