"""Healthy reference runs give zero findings at the default settings (the defaults are chosen for it).

"Healthy" means no known bug of the stack is left in: ftshims is applied (on the default stack the plain
Trainer counts ``num_items_in_batch`` wrongly, and the monitor rightly says so).
"""

import pytest

import ftshims

from .runs import corpus, default_stack_only, rows_dataset, train

pytestmark = default_stack_only


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_tiny_model_200_steps_no_findings(family):
    from ftshims import tiny

    ftshims.apply()
    if family == "llama":
        model = tiny.tiny_llama(attn="sdpa")
    else:
        model = tiny.causal_lm("GPT2Config", attn="eager", vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                               n_positions=64, bos_token_id=1, eos_token_id=2)
    result = train(model, rows_dataset(corpus(n=512)), max_steps=200, per_device_train_batch_size=8, logging_steps=10)
    assert result.error is None, result.error
    result.none()
    losses = [h["loss"] for h in result.trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0] * 0.7, losses  # it trained: the reference run is a real run
