"""moe_router_logits_not_recorded: with output_router_logits=True, FlexOlmo, GLM-4V-MoE, Qwen3-Next and Phi-MoE
compute their aux loss from their routers' logits (transformers 5.0-5.1 record nothing, the MoE block's hidden
states, or the routing weights)."""

import pytest
from tests.shimcheck import assert_bug_and_fix, applied_or_skip

import ftshims
from ftshims import registry

SHIM = "moe_router_logits_not_recorded"
RESOFTMAX = "moe_router_probs_resoftmaxed"
probe_module = registry.get(SHIM).module
resoftmax_module = registry.get(RESOFTMAX).module
ACTED = "router logits recorded from the routers"


def _build(family):
    """The tiny model of ``family``, or a skip where this transformers has no such model type (4.x stacks)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if family not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers has no {family} model type on this stack")
    return resoftmax_module.build(family)


@pytest.mark.parametrize("family", ["flex_olmo", "qwen3_next", "phimoe", "glm4v_moe"])
def test_aux_loss_comes_from_the_router_logits(evidence, family):
    assert_bug_and_fix(SHIM, evidence, f"{family}, padded batch, labels, output_router_logits=True: aux loss vs "
                                       "the routers' own logits", family=family)


def test_family_recording_its_router_is_healthy(evidence):
    """Negative control: Mixtral records its router on every 5.x release."""
    assert_bug_and_fix(SHIM, evidence, "mixtral (recorder on its router), padded batch", expect_bug=False,
                       family="mixtral")


@pytest.mark.parametrize("family", ["flex_olmo", "qwen3_next"])
def test_with_the_resoftmax_shim_the_aux_loss_is_that_of_the_raw_logits(family):
    """Both shims together give 5.6+'s aux loss and router gradient: the loss on the raw router logits (on 5.2-5.5
    only the resoftmax shim is active, on 5.6+ neither: the same must hold)."""
    import torch

    model = _build(family)
    torch.manual_seed(1)
    input_ids = torch.randint(3, 99, (2, 12))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :4] = 0
    with ftshims.applied(only=[SHIM, RESOFTMAX]):
        aux, reference, grads, reference_grads = resoftmax_module.aux_against_raw_logits(
            model, input_ids, attention_mask)
    assert torch.allclose(aux, reference, rtol=1e-5, atol=1e-6), (float(aux), float(reference))
    for g, r in zip(grads, reference_grads):
        assert torch.allclose(g, r, rtol=1e-4, atol=1e-7)


def _run(model, **kwargs):
    import torch

    torch.manual_seed(1)
    input_ids = torch.randint(3, 99, (2, 12))
    return model(input_ids=input_ids, labels=input_ids, **kwargs)


def test_calls_without_router_logits_are_bit_identical():
    """Do no harm: a call that does not ask for router logits is untouched (no hooks, same logits and loss)."""
    import torch

    plain = _run(_build("flex_olmo"), output_router_logits=False)
    context = applied_or_skip(SHIM)
    try:
        shimmed = _run(_build("flex_olmo"), output_router_logits=False)
        actions = ftshims.status()[SHIM].actions
    finally:
        context.__exit__(None, None, None)
    assert ACTED not in actions
    assert torch.equal(plain.logits, shimmed.logits) and torch.equal(plain.loss, shimmed.loss)


def test_recorded_logits_are_the_routers_first_output():
    """What is recorded is each router's first output, one per MoE layer, in order (5.2's recorder), and the
    forward's logits are unchanged by recording."""
    import torch

    model = _build("flex_olmo")
    plain = _run(_build("flex_olmo"), output_router_logits=False)
    context = applied_or_skip(SHIM)
    try:
        seen = []
        hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, o: seen.append(o[0]))
                 for layer in model.model.layers]
        out = _run(model, output_router_logits=True)
        for hook in hooks:
            hook.remove()
        actions = ftshims.status()[SHIM].actions
    finally:
        context.__exit__(None, None, None)
    assert actions.get(ACTED, 0) == 1
    assert len(out.router_logits) == len(seen) == 2
    assert all(a is b for a, b in zip(out.router_logits, seen))
    assert torch.equal(out.logits, plain.logits)
