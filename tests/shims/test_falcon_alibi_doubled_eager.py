"""falcon_alibi_doubled_eager: ALiBi Falcon under eager attention (or output_attentions=True) gets the ALiBi bias
once, as under sdpa and in 5.25 (transformers 4.45-5.24 added it twice)."""

import pytest
from tests.shimcheck import assert_bug_and_fix, applied_or_skip

import ftshims
from ftshims import registry

SHIM = "falcon_alibi_doubled_eager"
probe_module = registry.get(SHIM).module
ACTION = "eager ALiBi attention calls given the bias once"


@pytest.mark.parametrize("output_attentions", [False, True])
def test_eager_alibi_equals_sdpa(evidence, output_attentions):
    scenario = "sdpa asked for attention weights" if output_attentions else "attn_implementation='eager'"
    assert_bug_and_fix(SHIM, evidence, f"alibi Falcon, {scenario}, left-padded batch",
                       output_attentions=output_attentions)


def _skip_outside_the_range():
    """Before anything else: outside 4.45-5.24 the shim is not needed (and before 4.33 there is no Falcon)."""
    applied_or_skip(SHIM).__exit__(None, None, None)


def _run(model, train=False):
    import torch

    ids, mask = probe_module.batch()
    if train:
        # no padding in the training step: eager and sdpa differ in the gradients of a left-padded batch on their
        # own (rotary Falcon too, without the shim: 0.119), through the fully masked padding rows
        mask = torch.ones_like(mask)
    if not train:
        with torch.no_grad():
            return [model(input_ids=ids, attention_mask=mask).logits]
    model.zero_grad()
    out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    out.loss.backward()
    return [out.logits.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_calls_it_must_not_touch_are_bit_identical():
    """Do no harm: ALiBi Falcon under sdpa (forward and a training step) and rotary Falcon under eager run exactly as
    without the shim, and it never acts."""
    import torch

    _skip_outside_the_range()
    makers = [(lambda: probe_module.tiny_falcon("sdpa", alibi=True), True),
              (lambda: probe_module.tiny_falcon("eager", alibi=False), True)]
    plain = [_run(make(), train) for make, train in makers]
    context = applied_or_skip(SHIM)
    try:
        shimmed = [_run(make(), train) for make, train in makers]
        actions = ftshims.status()[SHIM].actions
    finally:
        context.__exit__(None, None, None)
    for a, b in zip(plain, shimmed):
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    assert actions == {}


def test_eager_training_step_matches_sdpa():
    """The gradients of an eager training step (no padding) are sdpa's (to float summation order), one action per layer
    call."""
    import torch

    _skip_outside_the_range()
    reference = _run(probe_module.tiny_falcon("sdpa"), train=True)
    context = applied_or_skip(SHIM)
    try:
        eager = _run(probe_module.tiny_falcon("eager"), train=True)
        actions = ftshims.status()[SHIM].actions
    finally:
        context.__exit__(None, None, None)
    assert float((eager[0] - reference[0]).abs().max()) < 1e-5
    assert all(float((a - b).abs().max()) < 1e-6 for a, b in zip(eager[1:], reference[1:]))
    assert actions == {ACTION: 2}  # two layers, one forward


def test_fix_survives_a_fullgraph_compile():
    import torch

    context = applied_or_skip(SHIM)
    torch._dynamo.reset()
    try:
        model = probe_module.tiny_falcon("eager")
        ids, mask = probe_module.batch()
        with torch.no_grad():
            compiled = torch.compile(model, fullgraph=True, backend="eager")(input_ids=ids, attention_mask=mask).logits
            want = probe_module.tiny_falcon("sdpa")(input_ids=ids, attention_mask=mask).logits
    finally:
        context.__exit__(None, None, None)
        torch._dynamo.reset()
    assert float((compiled - want)[mask.bool()].abs().max()) < 1e-5
