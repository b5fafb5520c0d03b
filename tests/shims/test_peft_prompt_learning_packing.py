"""peft_prompt_learning_packing: padding-free packed rows through PEFT prompt tuning, p-tuning and prefix tuning give
every example the logits (and the gradients) of that example alone through the adapter.

Recipe (the probe): a tiny random Llama with 4 virtual tokens (trained-looking, N(0, 0.5)), two examples of 5 and 7
tokens packed in one row with per-example position_ids (as DataCollatorWithFlattening / TRL padding_free give them).
"""

import pytest
from tests.shimcheck import applied_or_skip, assert_bug_and_fix

import ftshims
from ftshims import registry
from ftshims.shims import _packing

pytest.importorskip("peft")

SHIM = "peft_prompt_learning_packing"
probe_module = registry.get(SHIM).module


def _in_range():
    from ftshims import probing

    affected, reason = probing.in_affected_range(SHIM)
    if not affected:
        pytest.skip(f"{SHIM} not active on this stack: {reason}")
ACTION = "packed prompt-learning rows given per-example masks"
PROMPT_LEARNING = ("prompt_tuning", "p_tuning", "prefix_tuning")


@pytest.mark.parametrize("method", PROMPT_LEARNING)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_examples_isolated(evidence, method, attn):
    assert_bug_and_fix(SHIM, evidence, f"{method}/{attn}/all-ones mask", method=method, attn=attn)


@pytest.mark.parametrize("method", PROMPT_LEARNING)
def test_no_mask_and_a_padded_row(evidence, method):
    """No 2D mask (DataCollatorWithFlattening's batch), and a second right-padded row whose padding stays masked."""
    assert_bug_and_fix(SHIM, evidence, f"{method}/sdpa/no mask", method=method, mask="none")
    assert_bug_and_fix(SHIM, evidence, f"{method}/sdpa/padded row", method=method, pad_row=True)


def test_lora_is_healthy_and_untouched(evidence):
    """LoRA keeps the position ids: transformers' own packed detection (no mask, no cache) isolates the examples."""
    assert_bug_and_fix(SHIM, evidence, "lora/sdpa/no mask (control)", expect_bug=False, method="lora", mask="none")


def _logits_and_grads(model, call):
    import torch

    model.zero_grad()
    out = model(**call, use_cache=False)
    out.loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
    return out.logits.detach(), out.loss.detach(), grads


@pytest.mark.parametrize("method", PROMPT_LEARNING)
def test_rows_of_one_example_are_bit_identical(method):
    """Unpacked rows (position ids 0..n-1, a right-padded row): the shim does not act, outputs and gradients are
    bit-identical."""
    _in_range()
    import torch

    model = probe_module.adapted(method).train()
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    call = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100),
            "position_ids": torch.arange(9).expand(2, -1)}
    plain = _logits_and_grads(model, call)
    context = applied_or_skip(SHIM)
    try:
        shimmed = _logits_and_grads(model, call)
        actions = ftshims.status()[SHIM].actions
    finally:
        context.__exit__(None, None, None)
    assert actions == {}
    for a, b in zip(plain, shimmed):
        assert torch.equal(a, b)


@pytest.mark.parametrize("method", PROMPT_LEARNING)
def test_packed_loss_and_gradient_are_the_examples_alone(method):
    """Training: the summed token loss of the packed row and its gradient (the virtual tokens' included) equal the
    sums over the examples run alone (labels as DataCollatorWithFlattening gives them: -100 at each example start)."""
    _in_range()
    import torch

    examples = _packing.example_pair()
    batch = _packing.packed_batch(examples, mask="none")
    model = probe_module.adapted(method).train()
    context = applied_or_skip(SHIM)
    try:
        _, packed_loss, packed_grads = _logits_and_grads(model, batch)
        actions = ftshims.status()[SHIM].actions
        total_loss, total_grads = 0.0, 0.0
        for example in examples:
            labels = example.clone()
            labels[0] = -100
            count = len(example) - 1
            _, loss, grads = _logits_and_grads(model, {"input_ids": example[None], "labels": labels[None]})
            total_loss = total_loss + loss * count
            total_grads = total_grads + grads * count
    finally:
        context.__exit__(None, None, None)
    count = int((batch["labels"] != -100).sum())
    assert actions == {ACTION: 1}
    assert float(packed_loss * count) == pytest.approx(float(total_loss), rel=1e-5)
    assert torch.allclose(packed_grads * count, total_grads, rtol=1e-4, atol=1e-6)


def test_composes_with_every_default_shim():
    """With apply()'s default selection (packing_block_mask and custom_4d_mask_format included) the fix holds."""
    with ftshims.applied() as report:
        if not report[SHIM].active:
            pytest.skip(f"{SHIM} not active on this stack: {report[SHIM].reason}")
        model = probe_module.adapted("prompt_tuning")
        gap = probe_module.packed_gap(model, _packing.example_pair(), mask="ones", pad_row=True)
    assert gap < 1e-4


def test_unreadable_position_ids_go_to_peft_unchanged():
    """Position ids as a list (PEFT drops them for prompt tuning): the shim cannot read them, does not act, and the
    result is PEFT's, bit for bit."""
    _in_range()
    import torch

    model = probe_module.adapted("prompt_tuning")
    batch = _packing.packed_batch(_packing.example_pair(), mask="none")
    call = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"].tolist(), "use_cache": False}
    with torch.no_grad():
        plain = model(**call).logits
        context = applied_or_skip(SHIM)
        try:
            shimmed = model(**call).logits
            actions = ftshims.status()[SHIM].actions
        finally:
            context.__exit__(None, None, None)
    assert actions == {} and torch.equal(plain, shimmed)
