import pytest
from tests.shimcheck import assert_bug_and_fix

import ftshims

SHIM = "resize_embeddings_keeps_frozen"


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_frozen_embeddings_stay_frozen(evidence, tied):
    assert_bug_and_fix(SHIM, evidence, f"tie_word_embeddings={tied}", tie_word_embeddings=tied)


def test_trainable_embeddings_stay_trainable():
    """The shim copies flags, it does not freeze: trainable embeddings remain trainable."""
    from ftshims import tiny

    with ftshims.applied(only=[SHIM]):
        model = tiny.tiny_llama(tie_word_embeddings=False)
        with tiny.quiet():
            model.resize_token_embeddings(model.config.vocab_size + 8)
        assert model.get_input_embeddings().weight.requires_grad
        assert model.get_output_embeddings().weight.requires_grad
        assert model.get_input_embeddings().weight.shape[0] == model.config.vocab_size
