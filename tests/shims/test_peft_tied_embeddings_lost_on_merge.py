"""peft_tied_embeddings_lost_on_merge: a LoRA model that trained a copy of a tied lm_head/embed_tokens, merged,
saved and reloaded, gives the trained model's logits (peft <0.19 kept tie_word_embeddings=True)."""

import pytest
from tests.shimcheck import assert_bug_and_fix

import ftshims
from ftshims import tiny

SHIM = "peft_tied_embeddings_lost_on_merge"


@pytest.mark.parametrize("module", ["lm_head", "embed_tokens"])
def test_merged_tied_model_reloads_as_trained(evidence, module):
    assert_bug_and_fix(SHIM, evidence, f"modules_to_save={module}, tied", module=module)


def test_untied_model_is_healthy_everywhere(evidence):
    """Control: with tie_word_embeddings=False there is nothing to lose, with or without the shim."""
    assert_bug_and_fix(SHIM, evidence, "modules_to_save=lm_head, untied", expect_bug=False,
                       module="lm_head", tied=False)


def test_merge_without_a_tied_copy_keeps_the_model_tied():
    """LoRA on attention only: after the merge the embeddings are still one tensor and the config is left alone."""
    with ftshims.applied(only=[SHIM]):
        model = tiny.lora(tiny.tiny_llama(tie_word_embeddings=True))
        with tiny.quiet():
            merged = model.merge_and_unload()
    assert merged.config.tie_word_embeddings is True
    assert merged.get_output_embeddings().weight is merged.get_input_embeddings().weight
