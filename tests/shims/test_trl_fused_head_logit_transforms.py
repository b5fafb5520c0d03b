"""trl_fused_head_logit_transforms: TRL's fused/chunked LM head gets RecurrentGemma's soft cap and Inkling's µP divisor
under TRL's own config names while it is installed; the SFT loss then equals the model's own loss."""

import pytest
from tests.shimcheck import applied_or_skip, assert_bug_and_fix

import ftshims
from ftshims import registry

pytest.importorskip("trl")

SHIM = "trl_fused_head_logit_transforms"
probe_module = registry.get(SHIM).module
ACTION = "fused LM heads given the model's logit transform"


def _in_range():
    from ftshims import probing

    affected, reason = probing.in_affected_range(SHIM)
    if not affected:
        pytest.skip(f"{SHIM} not active on this stack: {reason}")


EXPRESSED = []  # the bug scenarios that ran on this stack (the parametrized test below runs first)


@pytest.mark.parametrize("model", ["recurrent_gemma", "inkling"])
def test_sft_loss_is_the_models_own(evidence, model):
    assert_bug_and_fix(SHIM, evidence, f"tiny {model} (head x30), SFTTrainer loss vs the model's own", model=model)
    EXPRESSED.append(model)


def test_llama_is_healthy(evidence):
    if not EXPRESSED:  # e.g. TRL 1.4 on transformers 5.1: no Inkling, and RecurrentGemma fails in TRL's head first
        pytest.skip("no model with a logit transform runs TRL's fused head on this stack: the shim's effect cannot be "
                    "shown here, so its control proves nothing either")
    assert_bug_and_fix(SHIM, evidence, "tiny Llama (head x30), SFTTrainer loss vs the model's own (control)",
                       expect_bug=False, model="llama")


def test_the_config_is_left_as_it_was():
    """The translation lives on the config only while TRL installs its head: afterwards the config, its dict and the
    model's own forward are what they were."""
    _in_range()
    import torch

    try:
        model = probe_module.tiny_model("recurrent_gemma")
    except probe_module.ProbeUnsupported as exc:
        pytest.skip(str(exc))
    before = model.config.to_dict()
    ids = torch.randint(4, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    context = applied_or_skip(SHIM)
    try:
        try:
            observation = probe_module.probe("recurrent_gemma")
        except probe_module.ProbeUnsupported as exc:
            pytest.skip(str(exc))
        from trl.trainer import utils as trl_utils

        installer = getattr(trl_utils, "add_fused_lm_head", None)
        if installer is not None:
            installer(model)
            with torch.no_grad():
                shimmed = model(input_ids=ids).logits  # not fused: the model's own forward
        else:
            with torch.no_grad():
                shimmed = model(input_ids=ids).logits
        actions = ftshims.status()[SHIM].actions
    finally:
        context.__exit__(None, None, None)
    assert not observation.bug
    assert model.config.to_dict() == before and not hasattr(model.config, "final_logit_softcapping")
    assert torch.equal(plain, shimmed)
    assert actions.get(ACTION, 0) >= 1


def test_a_transform_trl_cannot_express_is_left_alone(caplog):
    """Inkling with a sliced vocabulary: no translation (the advisory names it), one log line, TRL's head as TRL
    installs it."""
    model = None
    try:
        model = probe_module.tiny_model("inkling")
    except probe_module.ProbeUnsupported as exc:
        pytest.skip(str(exc))
    model.config.unpadded_vocab_size = 100
    values, reason = probe_module.translation(model)
    assert values == {} and "unpadded_vocab_size=100" in reason
