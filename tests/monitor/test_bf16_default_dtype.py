"""Dossier wave 5, lead 2: transformers 5 loads a checkpoint saved in bf16 in bf16 (``dtype="auto"`` is the default of
``from_pretrained``), and a full fine-tune with AdamW at lr 1e-5 then loses most of its updates (the weights keep no
fp32 master copy). transformers 4 loads it in float32. Runs on the default stack and the 5.x stacks: ``updates_lost``
where the loaded weights are bf16 (5.x), none where they are float32 (4.57), the same script."""

import pytest
import torch

import ftshims

from .runs import corpus, on_matrix_stack, rows_dataset, train


def _transformers_4() -> bool:
    from ftshims.versions import in_range, installed_version

    return in_range(installed_version("transformers"), "<5")


@pytest.mark.skipif(on_matrix_stack() and _transformers_4(),
                    reason="transformers 4 loads float32: the default stack (4.57) shows the silent case once")
def test_bf16_checkpoint_loaded_with_the_default_dtype(tmp_path):
    from transformers import AutoModelForCausalLM

    from ftshims import tiny

    tiny.tiny_llama(attn="sdpa").to(torch.bfloat16).save_pretrained(tmp_path)  # a bf16 checkpoint, as on the Hub
    with tiny.quiet():
        model = AutoModelForCausalLM.from_pretrained(tmp_path)  # no dtype: the library's default
    loaded = {p.dtype for p in model.parameters()}
    ftshims.apply()
    result = train(model, rows_dataset(corpus(n=512)), max_steps=6, per_device_train_batch_size=8, learning_rate=1e-5)
    assert result.error is None, result.error
    if loaded == {torch.bfloat16}:  # transformers >= 5.0
        finding = result.only("updates_lost")
        assert finding.detail["lost_share"] > 0.5 and 'dtype="auto"' in finding.message, finding.detail
    else:
        assert loaded == {torch.float32}, loaded
        result.none()
