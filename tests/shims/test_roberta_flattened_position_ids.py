"""roberta_flattened_position_ids: padding-free (flattened) batches of RoBERTa-family encoders read the position
embeddings the model's own numbering gives (DataCollatorWithFlattening numbers from 0, these models from
padding_idx + 1)."""

import pytest
from tests.shimcheck import assert_bug_and_fix, applied_or_skip

import ftshims
from ftshims import registry

SHIM = "roberta_flattened_position_ids"
probe_module = registry.get(SHIM).module
ACTION = "0-based padding-free rows started at padding_idx + 1"


@pytest.mark.parametrize("family", ["roberta", "xlm-roberta", "mpnet"])
def test_flattened_example_reads_the_models_own_positions(evidence, family):
    assert_bug_and_fix(SHIM, evidence, f"{family} masked LM, one example through DataCollatorWithFlattening",
                       family=family)


def _applied():
    return applied_or_skip(SHIM)


def _skip_outside_the_range():
    """Before anything else: outside the shim's range (before 5.15) DataCollatorWithFlattening may not even exist."""
    _applied().__exit__(None, None, None)


def _logits(model, **inputs):
    import torch

    with torch.no_grad():
        return model(**inputs).logits


def test_two_flattened_examples_equal_position_ids_start_2():
    """The fixed default gives exactly what upstream's opt-in position_ids_start=2 (5.15+) gives, restart by restart."""
    import torch

    _skip_outside_the_range()
    from transformers import DataCollatorWithFlattening

    model = probe_module.build("roberta")
    features = [{"input_ids": [0, 5, 6, 7, 2]}, {"input_ids": [0, 9, 10, 11, 12, 13, 2]}]
    default = DataCollatorWithFlattening()(features)
    context = _applied()
    try:
        fixed = _logits(model, input_ids=default["input_ids"], position_ids=default["position_ids"])
        actions = ftshims.status()[SHIM].actions
    finally:
        context.__exit__(None, None, None)
    opt_in = DataCollatorWithFlattening(position_ids_start=2)(features)
    assert torch.equal(fixed, _logits(model, input_ids=opt_in["input_ids"], position_ids=opt_in["position_ids"]))
    assert actions == {ACTION: 1}


def test_calls_it_must_not_touch_are_bit_identical():
    """Do no harm: a padded batch (attention mask), positions already numbered from 2, a row that would not fit the
    position table, and ESM-2 (rotary, no position table) run exactly as without the shim, with no action."""
    import torch
    import transformers

    from ftshims import tiny

    model = probe_module.build("roberta")
    ids = torch.tensor([probe_module.EXAMPLE])
    rows = model.roberta.embeddings.position_embeddings.num_embeddings
    long_ids = torch.randint(5, 64, (1, rows - 1))
    calls = [
        dict(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(ids.shape[1])[None]),
        dict(input_ids=ids, position_ids=torch.arange(2, 2 + ids.shape[1])[None]),  # position_ids_start=2 (5.15+)
        dict(input_ids=long_ids, position_ids=torch.arange(rows - 1)[None]),  # + 2 would overflow the table
    ]
    with tiny.quiet():
        esm = transformers.EsmForMaskedLM(transformers.EsmConfig(
            vocab_size=33, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
            pad_token_id=1, mask_token_id=32, position_embedding_type="rotary", max_position_embeddings=34)).eval()
    esm_call = dict(input_ids=torch.tensor([[0, 5, 6, 7, 2]]), position_ids=torch.arange(5)[None])
    plain = [_logits(model, **call) for call in calls] + [_logits(esm, **esm_call)]
    context = _applied()
    try:
        shimmed = [_logits(model, **call) for call in calls] + [_logits(esm, **esm_call)]
        actions = ftshims.status()[SHIM].actions
    finally:
        context.__exit__(None, None, None)
    assert all(torch.equal(a, b) for a, b in zip(plain, shimmed))
    assert actions == {}


def test_generation_is_unchanged():
    """generate() hands the base model a cache (empty at the prefill) with its own 0-based position_ids and, in 5.x, no
    attention mask: the shim stays out, token for token and score for score."""
    import torch
    import transformers

    from ftshims import tiny

    torch.manual_seed(0)
    with tiny.quiet():
        config = transformers.RobertaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                            intermediate_size=32, max_position_embeddings=34, pad_token_id=1,
                                            is_decoder=True, bos_token_id=0, eos_token_id=2)
        model = transformers.RobertaForCausalLM(config).eval()
    prompt = torch.tensor([[0, 5, 6, 7]])

    def generate():
        with tiny.quiet():
            return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False,
                                  output_scores=True, return_dict_in_generate=True)

    plain = generate()
    context = _applied()
    try:
        shimmed = generate()
    finally:
        context.__exit__(None, None, None)
    assert torch.equal(plain.sequences, shimmed.sequences)
    assert all(torch.equal(a, b) for a, b in zip(plain.scores, shimmed.scores))


def test_fix_survives_a_fullgraph_compile():
    """The shift is a tensor expression (no branch on values): a fullgraph compile traces it and gives the fix."""
    import torch

    _skip_outside_the_range()
    from transformers import DataCollatorWithFlattening

    model = probe_module.build("roberta")
    batch = DataCollatorWithFlattening()([{"input_ids": probe_module.EXAMPLE}])
    own = _logits(model, input_ids=batch["input_ids"])
    torch._dynamo.reset()
    context = _applied()
    try:
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        with torch.no_grad():
            fixed = compiled(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    finally:
        context.__exit__(None, None, None)
        torch._dynamo.reset()
    assert torch.equal(fixed, own)


def test_reads_no_value_off_the_cpu(monkeypatch):
    """No host-device synchronisation per step: on a device the shim decides nothing from values. A meta-device
    model (tensors without values: any read raises) takes a padding-free call through the shim, and gets the
    shifted positions (the meta output has the CPU run's shape; the values are checked on the CPU above)."""
    _skip_outside_the_range()
    from transformers import DataCollatorWithFlattening

    model = probe_module.build("roberta").to("meta")
    batch = DataCollatorWithFlattening()([{"input_ids": probe_module.EXAMPLE}, {"input_ids": probe_module.EXAMPLE}])
    seen = []
    hook = model.roberta.embeddings.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("position_ids")), with_kwargs=True)
    given = batch["position_ids"].to("meta")
    from transformers import masking_utils

    # transformers 5.25's encoders build their mask from position_ids (masking_utils.find_packed_sequence_indices
    # reads their values, which a meta tensor refuses): that read is upstream's own, not the shim's, so it is stubbed
    if hasattr(masking_utils, "find_packed_sequence_indices"):
        monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda *args, **kwargs: None)
    context = _applied()
    try:
        out = model(input_ids=batch["input_ids"].to("meta"), position_ids=given)
        actions = ftshims.status()[SHIM].actions
    finally:
        context.__exit__(None, None, None)
        hook.remove()
    assert out.logits.device.type == "meta" and out.logits.shape[:2] == batch["input_ids"].shape
    assert seen and seen[0] is not given and seen[0].device.type == "meta"  # the shifted positions went down
    assert actions == {"padding-free calls checked on the device (rows starting at 0 shifted)": 1}
