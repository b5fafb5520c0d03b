"""seqcls_pools_before_first_pad: decoder sequence-classification heads score the last non-pad token,
also when the pad id (= eos) occurs inside the text (transformers <4.49 scored the token before the first pad)."""

import pytest
from tests.shimcheck import assert_bug_and_fix

import ftshims
from ftshims import registry

SHIM = "seqcls_pools_before_first_pad"
probe_module = registry.get(SHIM).module


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_eos_inside_text_pools_last_real_token(evidence, family):
    assert_bug_and_fix(SHIM, evidence, f"{family}/eos_inside", family=family, rows="eos_inside")


def test_right_padding_is_healthy_everywhere(evidence):
    """Only trailing padding: every version pools correctly, and the shim changes nothing."""
    assert_bug_and_fix(SHIM, evidence, "llama/right_padded", expect_bug=False, family="llama", rows="right_padded")


def test_left_padding(evidence):
    """Left padding: correct from 4.32 (argmax - 1 wraps to the last token); 4.30-4.31 counted non-pad tokens."""
    import transformers
    from packaging.version import Version

    buggy = Version(transformers.__version__) < Version("4.32")
    assert_bug_and_fix(SHIM, evidence, "llama/left_padded", expect_bug=buggy, family="llama", rows="left_padded")


def test_untouched_rows_are_bit_identical_and_gradients_flow():
    """Rows without a pad before their last token give bit-identical logits under the shim; in a
    repooled row the gradient reaches the hidden state of the last non-pad token only through the head."""
    import torch

    model = probe_module.tiny_classifier("llama")
    ids = torch.tensor(probe_module.ROWS["eos_inside"][:1] + probe_module.ROWS["right_padded"][1:])
    labels = torch.tensor([0, 1])
    plain = model(input_ids=ids, labels=labels).logits.detach()
    with ftshims.applied(only=[SHIM]) as report:
        shimmed = model(input_ids=ids, labels=labels)
        shimmed.loss.backward()
        actions = ftshims.status()[SHIM].actions if report[SHIM].active else {}
    assert torch.equal(plain[1], shimmed.logits[1].detach())  # row without a pad inside: untouched
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    if report[SHIM].active:
        assert not torch.allclose(plain[0], shimmed.logits[0].detach())
        assert actions == {"rows pooled at the last non-pad token": 1}


def test_hidden_states_output_is_not_rewritten():
    import torch

    model = probe_module.tiny_classifier("llama")
    ids = torch.tensor(probe_module.ROWS["eos_inside"])
    with torch.no_grad():
        plain = model(input_ids=ids, output_hidden_states=True).hidden_states
        with ftshims.applied(only=[SHIM]):
            shimmed = model(input_ids=ids, output_hidden_states=True).hidden_states
    assert all(torch.equal(a, b) for a, b in zip(plain, shimmed))


def test_inputs_embeds_pass_through():
    import torch

    model = probe_module.tiny_classifier("llama")
    ids = torch.tensor(probe_module.ROWS["eos_inside"][:1])
    embeds = model.get_input_embeddings()(ids).detach()
    with torch.no_grad():
        plain = model(inputs_embeds=embeds).logits
        with ftshims.applied(only=[SHIM]):
            shimmed = model(inputs_embeds=embeds).logits
    assert torch.equal(plain, shimmed)
