"""moe_router_probs_resoftmaxed: with output_router_logits=True the MoE load-balancing loss and its gradient on
the router weights are those of the raw router logits (transformers 5.0-5.5 softmax the routers' probabilities a
second time)."""

import pytest
from tests.shimcheck import assert_bug_and_fix, applied_or_skip

import ftshims
from ftshims import registry
from ftshims.spec import ProbeUnsupported

SHIM = "moe_router_probs_resoftmaxed"
probe_module = registry.get(SHIM).module
ACTED = "router probabilities returned as log-probabilities"

AFFECTED = ("minimax", "mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "flex_olmo", "qwen3_next")


@pytest.mark.parametrize("family", AFFECTED)
def test_aux_loss_is_that_of_the_raw_router_logits(evidence, family):
    assert_bug_and_fix(SHIM, evidence, f"{family}, padded batch, output_router_logits=True: aux loss and router "
                                       "gradient vs the raw router logits", family=family)


def test_family_whose_router_returns_logits_is_healthy(evidence):
    """Negative control: MiniMax-M2's router returns raw logits on every 5.x release: no bug, nothing wrapped."""
    assert_bug_and_fix(SHIM, evidence, "minimax_m2 (router returns logits), padded batch", expect_bug=False,
                       family="minimax_m2")


def _build(family):
    try:
        return probe_module.build(family)
    except (ValueError, KeyError) as exc:
        pytest.skip(f"{family} not in this transformers: {type(exc).__name__}")


def _run(model, **kwargs):
    import torch

    torch.manual_seed(1)
    input_ids = torch.randint(3, 99, (2, 12))
    return model(input_ids=input_ids, labels=input_ids, **kwargs)


def test_routing_logits_and_lm_loss_are_bit_identical():
    """Do no harm: the shim changes only the recorded router output; the MoE routing (top-k weights and indices),
    the logits and the language-model loss are bit-identical, with and without output_router_logits."""
    import torch

    # separate (identical) instances: 5.0-5.1 leave a recorded router's forward bound on the instance
    plain, shimmed = _build("mixtral"), _build("mixtral")
    plain_on, plain_off = _run(plain, output_router_logits=True), _run(plain, output_router_logits=False)
    context = applied_or_skip(SHIM)
    try:
        shim_on, shim_off = _run(shimmed, output_router_logits=True), _run(shimmed, output_router_logits=False)
        actions = ftshims.status()[SHIM].actions
    finally:
        context.__exit__(None, None, None)
    assert actions.get(ACTED, 0) > 0
    assert torch.equal(plain_on.logits, shim_on.logits) and torch.equal(plain_off.logits, shim_off.logits)
    assert torch.equal(plain_off.loss, shim_off.loss)
    # the recorded output is log(p): softmax gives back the probabilities upstream recorded
    for p, logp in zip(plain_on.router_logits, shim_on.router_logits):
        assert torch.allclose(logp.softmax(-1), p, atol=1e-6)


def test_router_that_returns_logits_is_untouched():
    """Do no harm: a family whose router returns logits keeps bit-identical router logits and aux loss."""
    import torch

    plain = _run(_build("minimax_m2"), output_router_logits=True)
    context = applied_or_skip(SHIM)
    try:
        shimmed = _run(_build("minimax_m2"), output_router_logits=True)
        actions = ftshims.status()[SHIM].actions
    finally:
        context.__exit__(None, None, None)
    assert ACTED not in actions
    assert torch.equal(plain.aux_loss, shimmed.aux_loss)
    assert all(torch.equal(a, b) for a, b in zip(plain.router_logits, shimmed.router_logits))


def test_underflowed_probability_gives_a_finite_gradient():
    """A probability that underflowed to 0 becomes log(tiny): finite loss and gradient (log 0 would give NaN)."""
    import torch

    logits = torch.tensor([[0.0, 200.0, -200.0, 1.0]], requires_grad=True)
    probs = logits.softmax(-1)
    assert float(probs.detach()[0, 2]) == 0.0
    logp = probe_module.log_probabilities(probs)
    loss = (logp.softmax(-1) * torch.arange(4.0)).sum()
    loss.backward()
    assert torch.isfinite(logp).all() and torch.isfinite(logits.grad).all()
