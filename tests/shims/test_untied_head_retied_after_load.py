"""untied_head_retied_after_load: a T5 v1.1 / mT5 / UMT5 checkpoint with its own lm_head keeps it through
resize_token_embeddings and tie_weights() on transformers 5.x (whose T5-family configs force tie_word_embeddings)."""

import pytest
from tests.shimcheck import assert_bug_and_fix, applied_or_skip

import ftshims
from ftshims import probing, registry, tiny

SHIM = "untied_head_retied_after_load"
probe_module = registry.get(SHIM).module
KEPT = "untied checkpoint heads kept untied"


def _config_forces_tying(family: str) -> bool:
    """Whether this release's config of ``family`` turns a checkpoint's tie_word_embeddings=False into True (the
    condition of the bug: T5 and mT5 from 5.0, UMT5 only later, 5.1.0's UMT5Config keeps False)."""
    import transformers

    name = {"t5": "T5Config", "mt5": "MT5Config", "umt5": "UMT5Config"}[family]
    config_class = getattr(transformers, name, None)
    return config_class is not None and config_class(tie_word_embeddings=False).tie_word_embeddings is True


@pytest.mark.parametrize("family,step", [("mt5", "resize"), ("t5", "resize"), ("umt5", "resize"), ("mt5", "tie")])
def test_untied_checkpoint_head_survives(evidence, family, step):
    assert_bug_and_fix(SHIM, evidence, f"{family} checkpoint with tie_word_embeddings=false, then "
                                       f"{'resize_token_embeddings(+8)' if step == 'resize' else 'tie_weights()'}",
                       expect_bug=_config_forces_tying(family), family=family, step=step)


def _shim_where_in_range():
    """The shim applied where it is in range; upstream as it is outside (where the same must hold)."""
    affected, _ = probing.in_affected_range(SHIM)
    return applied_or_skip(SHIM) if affected else None


def test_resized_head_is_resized_and_reloads(tmp_path):
    """With the shim the head is resized on its own (8 new rows, the old rows exactly kept, as 4.x does), trains
    apart from the embeddings, and a save + reload gives the same logits and the same untied head."""
    import torch

    context = _shim_where_in_range()
    try:
        model = probe_module.load(probe_module.untied_checkpoint(str(tmp_path / "ckpt"), "mt5"))
        head = model.lm_head.weight.detach().clone()
        with tiny.quiet():
            model.resize_token_embeddings(probe_module.VOCAB + 8)
        assert model.lm_head.weight.shape[0] == probe_module.VOCAB + 8
        assert torch.equal(model.lm_head.weight[: probe_module.VOCAB], head)
        assert not probe_module.head_is_tied(model)
        before = probe_module.logits(model)
        with tiny.quiet():
            model.save_pretrained(str(tmp_path / "resized"))
        reloaded = probe_module.load(str(tmp_path / "resized"))
        actions = ftshims.status()[SHIM].actions if context is not None else {}
    finally:
        if context is not None:
            context.__exit__(None, None, None)
    assert not probe_module.head_is_tied(reloaded)
    assert torch.equal(probe_module.logits(reloaded), before)
    if context is not None:
        assert actions == {KEPT: 1}, actions


def _resized_state(make):
    """state_dict and tie state after resize_token_embeddings(+8) of the model ``make()`` returns."""
    import torch

    model = make()
    torch.manual_seed(3)  # the new rows are drawn
    with tiny.quiet():
        model.resize_token_embeddings(model.get_input_embeddings().weight.shape[0] + 8)
        model.tie_weights()
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, tied


def _tied_checkpoint(tmp_path):
    """A T5 checkpoint whose head is the embedding matrix (original T5, tie_word_embeddings=true)."""
    import transformers

    with tiny.quiet():
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, decoder_start_token_id=0))
        model.save_pretrained(str(tmp_path / "tied"))
    return str(tmp_path / "tied")


def test_models_it_must_not_touch_resize_bit_identical(tmp_path):
    """Do no harm: a tied T5 checkpoint, a T5 v1.1 config built without a checkpoint (tied in 5.x, upstream's
    choice), an untied Llama and a tied Llama resize (and tie) exactly as without the shim, and it never acts."""
    import torch
    import transformers

    tied_dir = _tied_checkpoint(tmp_path)

    def v1_1_from_config():
        torch.manual_seed(0)
        with tiny.quiet():
            return transformers.T5ForConditionalGeneration(transformers.T5Config(
                vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, decoder_start_token_id=0,
                feed_forward_proj="gated-gelu", tie_word_embeddings=False))

    makers = [lambda: probe_module.load(tied_dir), v1_1_from_config,
              lambda: tiny.tiny_llama(tie_word_embeddings=False), lambda: tiny.tiny_llama(tie_word_embeddings=True)]
    plain = [_resized_state(make) for make in makers]
    context = applied_or_skip(SHIM)
    try:
        shimmed = [_resized_state(make) for make in makers]
        actions = ftshims.status()[SHIM].actions
    finally:
        context.__exit__(None, None, None)
    for (a, a_tied), (b, b_tied) in zip(plain, shimmed):
        assert a_tied == b_tied
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert actions == {}


def test_apply_after_from_pretrained_stays_out(tmp_path):
    """The shim only knows what from_pretrained declined when it saw the load: a model loaded before apply() is
    resized exactly as upstream does (head tied), not guessed at."""
    import torch

    directory = probe_module.untied_checkpoint(str(tmp_path / "ckpt"), "mt5")
    reference = probe_module.load(directory)
    with tiny.quiet():
        reference.resize_token_embeddings(probe_module.VOCAB + 8)
    model = probe_module.load(directory)
    context = applied_or_skip(SHIM)
    try:
        with tiny.quiet():
            model.resize_token_embeddings(probe_module.VOCAB + 8)
        actions = ftshims.status()[SHIM].actions
    finally:
        context.__exit__(None, None, None)
    assert actions == {}
    assert probe_module.head_is_tied(model) == probe_module.head_is_tied(reference)
    assert torch.equal(probe_module.logits(model), probe_module.logits(reference))
