"""neftune_noise_packed_rows: NEFTune's noise in a padding-free (packed) row is scaled by each example's length, as
for that example alone, not by the row's (transformers' hook, 4.35-5.25: x1/sqrt(n) for n equal examples)."""

from tests.shimcheck import assert_bug_and_fix, applied_or_skip

import ftshims
from ftshims import registry

SHIM = "neftune_noise_packed_rows"
probe_module = registry.get(SHIM).module
ACTION = "padding-free NEFTune noise scaled per example"


def test_packed_row_gets_each_examples_noise(evidence):
    assert_bug_and_fix(SHIM, evidence, "8 examples of 16 tokens in one padding-free row, Trainer step, alpha 5")


def _skip_outside_the_range():
    """Before anything else: before 4.35 there is no NEFTune."""
    applied_or_skip(SHIM).__exit__(None, None, None)


def _noise(**kwargs):
    context = applied_or_skip(SHIM)
    try:
        noise = probe_module.noise_of_step(**kwargs)
        actions = ftshims.status()[SHIM].actions
    finally:
        context.__exit__(None, None, None)
    return noise, actions


def test_examples_of_different_lengths_each_get_their_own_scale():
    """A 16-token and a 112-token example in one row: each gets alpha / sqrt(3 * l * d) (std within 15 %; the
    noise is uniform), where upstream gives both the row's alpha / sqrt(3 * 128 * d)."""
    noise, actions = _noise(lengths=(16, 112))
    hidden = noise.shape[-1]
    for part, length in ((noise[:16], 16), (noise[16:], 112)):
        expected = 5.0 / (length * hidden) ** 0.5 / 3 ** 0.5
        assert 0.85 < float(part.std()) / expected < 1.15, (length, float(part.std()), expected)
    assert actions == {ACTION: 1}


def test_steps_it_must_not_touch_are_bit_identical():
    """Do no harm: a padded batch (attention mask: the reference implementation's padded length, left as it is) and a
    padding-free row of a single example get exactly upstream's noise, number for number, and the shim never acts."""
    import torch

    _skip_outside_the_range()
    cases = [dict(lengths=(16, 16, 16), padding_free=False), dict(lengths=(48,), padding_free=True)]
    plain = [probe_module.noise_of_step(**case) for case in cases]
    shimmed, actions = zip(*[_noise(**case) for case in cases])
    assert all(torch.equal(a, b) for a, b in zip(plain, shimmed))
    assert all(a == {} for a in actions[:1])  # the padded step is not padding-free: no action at all
    assert actions[1] == {ACTION: 1}  # the single example is scaled by exactly 1


def test_example_lengths_follow_the_positions():
    import torch

    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0], [2, 3, 4, 5, 2, 3, 0, 0, 0, 0]])
    assert probe_module.example_lengths(positions).tolist() == [[3, 3, 3, 2, 2, 4, 4, 4, 4, 1],
                                                                [4, 4, 4, 4, 2, 2, 1, 1, 1, 1]]


def test_trl_sft_padding_free_step():
    """The client path: TRL's SFTTrainer with padding_free=True and neftune_noise_alpha (its collator's row of eight
    16-token examples plus EOS, no attention mask): each token's noise is that of its example alone with the shim,
    x1/sqrt(8) of it without."""
    import dataclasses
    import tempfile

    import pytest
    import torch

    _skip_outside_the_range()
    trl = pytest.importorskip("trl")
    import datasets

    from ftshims import tiny
    from ftshims.shims import _packing

    if getattr(trl, "SFTConfig", None) is None or "padding_free" not in {f.name for f in dataclasses.fields(trl.SFTConfig)}:
        pytest.skip("this TRL has no padding_free")
    texts = [" ".join(f"w{4 + (7 * i + j) % 100}" for j in range(16)) for i in range(8)]

    def step_noise():
        model = _packing.tiny_decoder("llama", "sdpa")
        seen = {}
        embeddings = model.get_input_embeddings()
        def ids_in(module, args):
            seen.setdefault("ids", args[0])

        def first_layer_in(module, args, kwargs):  # after NEFTune's hook on the embeddings
            seen.setdefault("hidden", args[0] if args else kwargs["hidden_states"])

        hooks = [embeddings.register_forward_pre_hook(ids_in),
                 model.model.layers[0].register_forward_pre_hook(first_layer_in, with_kwargs=True)]
        fields = {f.name for f in dataclasses.fields(trl.SFTConfig)}
        config = dict(padding_free=True, neftune_noise_alpha=5.0, max_steps=1, per_device_train_batch_size=8,
                      max_length=None, report_to=[], save_strategy="no", logging_strategy="no", learning_rate=0.0,
                      bf16=False, fp16=False, loss_type="nll")
        with tiny.quiet(), _packing.quiet_datasets(), tempfile.TemporaryDirectory() as out:
            args = trl.SFTConfig(output_dir=out, **{k: v for k, v in config.items() if k in fields})
            trainer = trl.SFTTrainer(model=model, args=args, processing_class=_packing.tiny_tokenizer(),
                                     train_dataset=datasets.Dataset.from_list([{"text": t} for t in texts]))
            try:
                trainer.train()
            finally:
                for hook in hooks:
                    hook.remove()
        ids = seen["ids"]
        assert ids.shape[0] == 1, "not one padding-free row"
        clean = torch.nn.functional.embedding(ids, embeddings.weight)
        return (seen["hidden"] - clean).detach()[0], embeddings.weight.shape[1]

    plain, hidden = step_noise()
    from ftshims.probing import in_affected_range

    # TRL 0.19-0.23.0's padding-free collator leaves out the position ids the examples are found by: there the
    # default shims restore them first (trl_padding_free_position_ids), and NEFTune's noise follows them
    also = [s for s in ("trl_padding_free_position_ids",) if in_affected_range(s)[0]]
    context = applied_or_skip(SHIM, *also)
    try:
        fixed, _ = step_noise()
        actions = ftshims.status()[SHIM].actions
    finally:
        context.__exit__(None, None, None)
    expected = 5.0 / (17 * hidden) ** 0.5 / 3 ** 0.5  # 16 words + EOS per example
    assert 0.85 < float(fixed.std()) / expected < 1.15, (float(fixed.std()), expected)
    assert float(plain.std()) / expected < 0.45, (float(plain.std()), expected)
    assert actions == {ACTION: 1}
