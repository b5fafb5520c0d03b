"""trl_fused_head_trainable_tokens: TRL's fused/chunked LM head trains a PEFT trainable_token_indices head (it crashed
with AttributeError 'bias'), with the model's own loss."""

import pytest
from tests.shimcheck import applied_or_skip, assert_bug_and_fix

from ftshims import registry

pytest.importorskip("peft")
pytest.importorskip("trl")

SHIM = "trl_fused_head_trainable_tokens"
probe_module = registry.get(SHIM).module


def _in_range():
    from ftshims import probing

    affected, reason = probing.in_affected_range(SHIM)
    if not affected:
        pytest.skip(f"{SHIM} not active on this stack: {reason}")


@pytest.mark.parametrize("case", ["lm_head", "tied_embedding"])
def test_sft_trains_a_trainable_tokens_head_with_the_models_loss(evidence, case):
    assert_bug_and_fix(SHIM, evidence, f"tiny Llama, SFTTrainer, LoRA + trainable_token_indices on {case}", case=case)


def test_modules_to_save_head_is_healthy(evidence):
    assert_bug_and_fix(SHIM, evidence, "tiny Llama, SFTTrainer, LoRA + modules_to_save=['lm_head'] (control)",
                       expect_bug=False, case="modules_to_save")


def _wrapped_model(tied: bool):
    import peft
    import torch

    from ftshims import tiny

    config = peft.LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices=[5, 6, 7] if tied else
                             {"lm_head": [5, 6, 7]})
    with tiny.quiet():
        model = peft.get_peft_model(tiny.tiny_llama(tie_word_embeddings=tied), config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "trainable_tokens_delta" in name:
                parameter.add_(0.5)
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_model_forward_and_other_attributes_are_unchanged(tied):
    """Without TRL's head nothing reads the bias: the PeftModel's own loss and gradients are bit-identical, and any
    other attribute the wrapper does not hold still raises AttributeError."""
    _in_range()
    import torch

    from ftshims import tiny

    model = _wrapped_model(tied)
    batch = tiny.batch()
    head = model.get_base_model().get_output_embeddings()

    def run():
        model.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])

    plain = run()
    context = applied_or_skip(SHIM)
    try:
        shimmed = run()
        with pytest.raises(AttributeError):
            head.not_an_attribute  # noqa: B018
        bias = head.bias
        weight_times_hidden = head.weight
    finally:
        context.__exit__(None, None, None)
    assert torch.equal(plain[0], shimmed[0]) and torch.equal(plain[1], shimmed[1])
    assert bias is None and weight_times_hidden.shape[0] == 128
    with pytest.raises(AttributeError):
        head.bias  # noqa: B018 - reverted: PEFT's own behaviour again


def test_the_bias_is_the_one_the_wrapper_forward_uses():
    """Unmerged: F.linear(x, merged weight) without a bias, so h @ weight.T equals the head's output; merged: the base
    layer runs, with its bias."""
    _in_range()
    import torch

    model = _wrapped_model(tied=False)
    head = model.get_base_model().get_output_embeddings()
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    adapter = head.token_adapter
    with torch.no_grad():
        assert probe_module.forward_bias(adapter) is None
        assert torch.allclose(head(hidden), hidden @ head.weight.T, atol=1e-6)
    saved = adapter.merged_adapters
    adapter.merged_adapters = ["default"]  # as merge() records it
    try:
        assert probe_module.forward_bias(adapter) is adapter.base_layer.bias
    finally:
        adapter.merged_adapters = saved
    assert not adapter.merged
