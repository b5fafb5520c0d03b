"""packing_recurrent_state: packed examples do not leak through the recurrent layers of hybrid models.

Recipe (the probe's, ftshims/shims/_packing.py): a tiny hybrid decoder of each family (one recurrent and one
attention layer) in train() mode, fp32; two examples of 5 and 7 tokens packed in one row with per-example
position_ids. The attention layers are kept apart by packing_block_mask (the probe applies it in both runs),
so what the probe sees without this shim is the recurrent layers' leak.
"""

import pytest
import torch
from tests.shimcheck import assert_bug_and_fix

import ftshims
from ftshims.shims import _packing

SHIM = "packing_recurrent_state"
BOTH = ["packing_block_mask", SHIM]
VERSION = _packing.transformers_version()


def _attention_from_the_mask_layer(family) -> None:
    """Skip unless ``family`` exists here and its attention masks come from masking_utils (where
    packing_block_mask keeps its attention layers apart: 4.57 for Qwen3-Next and LFM2, 5.x for the others)."""
    import importlib

    if not _packing.family_available(family):
        pytest.skip(f"transformers {VERSION} has no {family}")
    module = importlib.import_module(_packing.modeling_module(family))
    if not hasattr(module, "create_causal_mask"):
        pytest.skip(f"transformers {VERSION}: {family} builds its own attention mask (no masking_utils), which no "
                    "packing shim isolates; only its recurrent layers would be")


@pytest.fixture
def gated_delta():
    """The gated-delta-rule hybrid of this stack: Qwen3.5 (5.x), else Qwen3-Next (4.57)."""
    for family in ("qwen3_5", "qwen3_next"):
        if _packing.family_available(family):
            _attention_from_the_mask_layer(family)
            return family
    pytest.skip(f"transformers {VERSION} has no gated-delta-rule hybrid")


@pytest.mark.parametrize("family", list(_packing.RECURRENT))
def test_recurrent_layers_keep_packed_examples_apart(evidence, family):
    # no mask and use_cache=False: transformers isolates the attention layers itself; the leak left is recurrent
    _attention_from_the_mask_layer(family)
    assert_bug_and_fix(SHIM, evidence, f"{family}/none/no_cache", expect_bug=True, family=family, mask="none",
                       use_cache=False)


@pytest.mark.parametrize("family", ["bamba", "jamba"])
def test_hybrids_with_their_own_attention_masks_are_left_alone(family):
    # 4.53-4.57: Bamba, Jamba (Granite-4 hybrid, Zamba2, Falcon-H1) build their own attention masks, which no shim
    # isolates: splitting their recurrent layers alone would be a change that proves nothing
    import importlib

    if not _packing.family_available(family):
        pytest.skip(f"transformers {VERSION} has no {family}")
    from ftshims.versions import explain_mismatch, installed_versions

    requires = ftshims.registry.get(SHIM).spec.requires
    outside = explain_mismatch(requires, installed_versions(requires))
    if outside:
        pytest.skip(f"{SHIM} is not in range: {outside}")
    if hasattr(importlib.import_module(_packing.modeling_module(family)), "create_causal_mask"):
        pytest.skip(f"transformers {VERSION}: {family}'s masks come from masking_utils (covered above)")
    model = _packing.tiny_decoder(family, "sdpa")
    batch = {k: v for k, v in _packing.packed_batch(_packing.example_pair(), mask="ones").items() if k != "labels"}
    with torch.no_grad():
        before = model(**batch).logits
        with ftshims.applied(only=[SHIM]):
            after = model(**batch).logits
            notes = " ".join(ftshims.status()[SHIM].notes)
    assert torch.equal(before, after)
    assert f"modeling_{family} builds its own attention masks" in notes


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("mask", ["ones", "padded"])
def test_qwen3_5_packed_equals_alone(evidence, family, mask):
    # the case: an all-ones mask (or a second, right-padded row) and the default cache
    _attention_from_the_mask_layer(family)
    assert_bug_and_fix(SHIM, evidence, f"{family}/{mask}", expect_bug=True, family=family, mask=mask)


def test_loss_and_grads_equal_separate_examples(gated_delta):
    model = _packing.tiny_decoder(gated_delta, "sdpa")
    examples = _packing.example_pair()
    batch = _packing.packed_batch(examples, mask="ones")
    counts = [len(e) - 1 for e in examples]
    with ftshims.applied(only=BOTH):
        model.zero_grad()
        packed = model(**batch).loss * sum(counts)
        packed.backward()
        packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        separate = sum(n * model(input_ids=e[None], labels=e[None], use_cache=False).loss for n, e in zip(counts, examples))
        separate.backward()
        separate_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(packed.detach(), separate.detach(), atol=1e-5, rtol=1e-6)
    linear = [n for n in packed_grads if "linear_attn" in n]
    assert linear and packed_grads.keys() == separate_grads.keys()
    for name in packed_grads:
        torch.testing.assert_close(packed_grads[name], separate_grads[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("kind", ["gated_delta", "bamba"])
def test_unpacked_batches_and_generation_are_bit_identical(kind, request):
    family = request.getfixturevalue("gated_delta") if kind == "gated_delta" else kind
    _attention_from_the_mask_layer(family)
    model = _packing.tiny_decoder(family, "sdpa")
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    left = torch.ones_like(ids)
    left[1, :3] = 0
    cases = [
        dict(input_ids=ids),
        dict(input_ids=ids, attention_mask=left),
        dict(input_ids=ids, attention_mask=left, position_ids=(left.cumsum(-1) - 1).clamp(min=0)),
        dict(input_ids=ids, position_ids=torch.arange(9)[None], use_cache=False),
    ]
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 11, 12, 13, 14]])
    generate = dict(attention_mask=(prompt != 0).long(), max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        before = [model(**case).logits for case in cases]
        tokens = model.eval().generate(prompt, **generate)
        with ftshims.applied(only=BOTH):
            model.train()
            after = [model(**case).logits for case in cases]
            shimmed_tokens = model.eval().generate(prompt, **generate)
            assert not ftshims.status()[SHIM].actions
    for b, a in zip(before, after):
        assert torch.equal(b, a)
    assert torch.equal(tokens, shimmed_tokens)


def test_boundaries_the_caller_hands_to_upstream_are_left_to_upstream(gated_delta):
    # seq_idx / cu_seq_lens_q go to the optimised kernels (flash-linear-attention, mamba-ssm); without them
    # 5.24 raises, which the shim must not turn into a silent success or a different result
    model = _packing.tiny_decoder(gated_delta, "sdpa")
    batch = {k: v for k, v in _packing.packed_batch(_packing.example_pair(), mask="none").items() if k != "labels"}
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    extra = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7, use_cache=False)

    def outcome():
        try:
            with torch.no_grad():
                return model(**batch, **extra).logits
        except (ValueError, TypeError, RuntimeError) as exc:
            return type(exc).__name__ + str(exc)[:80]

    plain = outcome()
    with ftshims.applied(only=BOTH):
        shimmed = outcome()
        assert not ftshims.status()[SHIM].actions
    assert type(plain) is type(shimmed)
    assert torch.equal(plain, shimmed) if torch.is_tensor(plain) else plain == shimmed


def test_compiled_forward_is_left_as_it_is(gated_delta):
    # segments are data-dependent: inside a trace the shim stays out (and the doctor names the model)
    batch = {k: v for k, v in _packing.packed_batch(_packing.example_pair(), mask="none").items() if k != "labels"}
    try:
        with torch.no_grad():
            torch.compile(_packing.tiny_decoder(gated_delta, "sdpa").eval().forward, backend="eager")(**batch, use_cache=False)
    except Exception as exc:  # noqa: BLE001 - the stack itself cannot: nothing for the shim to keep
        pytest.skip(f"transformers {VERSION} cannot compile {gated_delta} by itself: {type(exc).__name__}")
    finally:
        torch._dynamo.reset()
    with ftshims.applied(only=[SHIM]):
        model = _packing.tiny_decoder(gated_delta, "sdpa").eval()
        with torch.no_grad():
            eager = model(**batch, use_cache=False).logits
            assert ftshims.status()[SHIM].actions  # acts outside a trace
            torch._dynamo.reset()
            compiled = torch.compile(model.forward, backend="eager")(**batch, use_cache=False).logits
    torch._dynamo.reset()
    plain = _packing.tiny_decoder(gated_delta, "sdpa").eval()
    with torch.no_grad():
        reference = plain(**batch, use_cache=False).logits
    assert not torch.equal(eager, reference)  # the shim acted outside the trace
    torch.testing.assert_close(compiled, reference, atol=1e-5, rtol=0)  # and not inside it


@pytest.mark.parametrize("applies,severity", [(True, "info"), (False, "error")])
def test_doctor_names_the_hybrid_model(tmp_path, monkeypatch, applies, severity):
    # flash attention keeps the attention layers apart, not the recurrent ones: the finding names the model
    import json

    import ftshims.versions
    from ftshims import lint

    real = ftshims.versions.installed_versions
    monkeypatch.setattr(ftshims.versions, "installed_versions", lambda names: {**real(names), "transformers": "5.24.0"})

    config = {"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text",
                                                       "layer_types": ["linear_attention", "full_attention"]}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    train = tmp_path / "train.json"
    train.write_text(json.dumps({"output_dir": "out", "packing": True,
                                 "model_init_kwargs": {"attn_implementation": "flash_attention_2"}}))
    rows = [{"id": SHIM, "affected": True, "verdict": "patched" if applies else "unpatched",
             "status": "applied" if applies else "disabled", "reason": "in range" if applies else "FTSHIMS_DISABLE"}]
    found = lint.run(lint.Inputs(model=str(tmp_path), train_config=str(train)), shim_rows=rows)
    hits = [f for f in found if f["rule"] == "packing-contamination" and "Qwen3_5GatedDeltaNet" in f["message"]]
    assert [h["severity"] for h in hits] == [severity], found
    config = {"model_type": "recurrent_gemma"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    found = lint.run(lint.Inputs(model=str(tmp_path), train_config=str(train)), shim_rows=rows)
    hits = [f for f in found if f["rule"] == "packing-contamination" and "recurrent_gemma" in f["message"]]
    assert [h["severity"] for h in hits] == ["warning"] and "no ftshims shim" in hits[0]["message"]
    # before 5.0 Bamba builds its own attention masks: no shim covers it there
    monkeypatch.setattr(ftshims.versions, "installed_versions", lambda names: {**real(names), "transformers": "4.57.6"})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bamba", "attn_layer_indices": [1]}))
    found = lint.run(lint.Inputs(model=str(tmp_path), train_config=str(train)), shim_rows=rows)
    hits = [f for f in found if f["rule"] == "packing-contamination" and "BambaMixer" in f["message"]]
    assert [h["severity"] for h in hits] == ["warning"] and "before 5.0" in hits[0]["message"]
