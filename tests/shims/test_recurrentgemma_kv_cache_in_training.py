"""recurrentgemma_kv_cache_in_training: a RecurrentGemma training forward with the config's default use_cache=True
trains k_proj and v_proj (transformers 4.40-5.3 took them from a @torch.no_grad() cache update: grad None)."""

from tests.shimcheck import assert_bug_and_fix, applied_or_skip

import ftshims
from ftshims import registry

SHIM = "recurrentgemma_kv_cache_in_training"
probe_module = registry.get(SHIM).module
ACTION = "training attention keys/values kept in the graph"


def test_default_training_step_trains_k_and_v(evidence):
    assert_bug_and_fix(SHIM, evidence, "tiny RecurrentGemma, training step with the default use_cache=True")


def _skip_outside_the_range():
    """Before anything else: before 4.40 there is no RecurrentGemma; from 5.4 the shim is not needed."""
    applied_or_skip(SHIM).__exit__(None, None, None)


def test_same_loss_and_the_gradients_of_use_cache_false():
    """The training step's loss is bit-identical to upstream's; k_proj/v_proj get the gradients of a fresh model's
    use_cache=False step (a sequence within the attention window: both paths compute the same attention); a second
    step runs."""
    import torch

    _skip_outside_the_range()
    plain_loss, _ = probe_module.training_step(probe_module.tiny_recurrent_gemma())
    _, reference = probe_module.training_step(probe_module.tiny_recurrent_gemma(), use_cache=False)
    context = applied_or_skip(SHIM)
    try:
        model = probe_module.tiny_recurrent_gemma()
        loss, grads = probe_module.training_step(model)
        second, _ = probe_module.training_step(model)
        actions = ftshims.status()[SHIM].actions
    finally:
        context.__exit__(None, None, None)
    assert torch.equal(loss, plain_loss) and torch.equal(second, plain_loss)
    assert all(torch.allclose(grads[name], reference[name], rtol=1e-5, atol=1e-7) for name in reference)
    assert actions == {ACTION: 2}  # one attention block, two steps


def test_prefill_longer_than_the_window_keeps_upstreams_values():
    """A training sequence longer than attention_window_size: the loss is bit-identical to upstream's cached path
    (the shim hands back the same last-window keys, in the graph), and k_proj/v_proj get a gradient."""
    import torch

    _skip_outside_the_range()
    def step():
        model = probe_module.tiny_recurrent_gemma(attention_window_size=4)
        return probe_module.training_step(model)

    plain_loss, plain_grads = step()
    context = applied_or_skip(SHIM)
    try:
        loss, grads = step()
    finally:
        context.__exit__(None, None, None)
    assert plain_grads["k_proj"] is None and plain_grads["v_proj"] is None
    assert torch.equal(loss, plain_loss)
    assert grads["k_proj"] is not None and float(grads["k_proj"].abs().sum()) > 0
    assert grads["v_proj"] is not None and float(grads["v_proj"].abs().sum()) > 0


def test_evaluation_and_no_grad_keep_the_cache():
    """Do no harm: an eval forward, a training-mode forward under torch.no_grad() (both with the cache on, as
    generation's prefill) and the cache buffers they leave run exactly as without the shim, and it never acts."""
    import torch

    _skip_outside_the_range()
    def run():
        model = probe_module.tiny_recurrent_gemma().eval()
        with torch.no_grad():
            evaluated = model(input_ids=probe_module.ids(), use_cache=True).logits
        model.train()
        with torch.no_grad():
            no_grad = model(input_ids=probe_module.ids(), use_cache=True).logits
        attention = model.model.layers[2].temporal_block
        return [evaluated, no_grad, attention.key_states, attention.value_states]

    plain = run()
    context = applied_or_skip(SHIM)
    try:
        shimmed = run()
        actions = ftshims.status()[SHIM].actions
    finally:
        context.__exit__(None, None, None)
    assert len(plain) == len(shimmed) and all(torch.equal(a, b) for a, b in zip(plain, shimmed))
    assert actions == {}
