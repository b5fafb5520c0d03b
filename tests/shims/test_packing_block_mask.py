"""packing_block_mask: packed examples attend only to themselves under eager and sdpa.

Recipe (shared with the probe, ftshims/shims/_packing.py): a tiny random Llama in
train() mode, fp32; two examples of 5 and 7 tokens packed in one row with
per-example position_ids and labels[pos == 0] = -100.
"""

import pytest
import torch
from tests.shimcheck import assert_bug_and_fix

import ftshims
from ftshims import registry
from ftshims.report import NOT_NEEDED
from ftshims.shims import _packing

SHIM = "packing_block_mask"
VERSION = _packing.transformers_version()
IN_RANGE = VERSION.release[:2] >= (4, 37)
# upstream builds the block mask itself from 4.53.1, only with no 2D mask and no cache (PR #39194)
UPSTREAM_DETECTS = VERSION.release >= (4, 53, 1)
MASK_LAYER = _packing.mask_layer_era()  # 4.53+: the fix sits in masking_utils, for every decoder built there

below_437 = pytest.mark.skipif(
    not IN_RANGE,
    reason=f"transformers {VERSION} accepts no custom 4D attention mask (added in 4.37): packing contamination "
    "cannot be fixed from outside there (doctor advisory; see test_below_437_unfixable_and_not_applied)",
)
ATTNS = ["eager", "sdpa"] if VERSION.release[:2] >= (4, 36) else ["eager"]


@below_437
@pytest.mark.parametrize("attn", ATTNS)
@pytest.mark.parametrize("mask", ["ones", "none", "padded"])
def test_packed_examples_isolated(evidence, attn, mask):
    # "ones": all-ones 2D mask beside packed position_ids (disables detection on 4.53.1–5.24);
    # "none": no mask but the default use_cache=True creates a cache (skips detection on 4.53.1+);
    # "padded": a second, right-padded row: the padding must stay masked.
    assert_bug_and_fix(SHIM, evidence, f"{attn}/{mask}", expect_bug=True, attn=attn, mask=mask)


@below_437
@pytest.mark.parametrize("attn", ATTNS)
def test_no_mask_no_cache_is_only_broken_before_upstream_detection(evidence, attn):
    assert_bug_and_fix(
        SHIM, evidence, f"{attn}/none/no_cache", expect_bug=not UPSTREAM_DETECTS, attn=attn, mask="none", use_cache=False
    )


@below_437
@pytest.mark.parametrize("family", ["mistral", "qwen2"])
@pytest.mark.parametrize("attn", ATTNS)
def test_other_families(evidence, family, attn):
    # mistral/qwen2 build masks with _prepare_4d_causal_attention_mask until 4.41 (binary 4D form,
    # and no 4D branch at all under sdpa in 4.40–4.41): the shim's pass-through covers them.
    if not _packing.family_available(family):
        pytest.skip(f"transformers {VERSION} has no {family}")
    assert_bug_and_fix(SHIM, evidence, f"{family}/{attn}/ones", expect_bug=True, family=family, attn=attn, mask="ones")


@below_437
@pytest.mark.slow
@pytest.mark.parametrize("attn", ATTNS)
def test_trainer_with_data_collator_with_flattening(evidence, attn):
    # The real path: Trainer's train dataloader + DataCollatorWithFlattening + compute_loss.
    # 4.44–4.52: no detection for eager/sdpa; 4.53–4.57: the model's default use_cache=True creates a
    # cache and detection is skipped; 5.x: Trainer sets config.use_cache = False, upstream isolates.
    assert_bug_and_fix(SHIM, evidence, f"trainer_flattening/{attn}", expect_bug=VERSION.major < 5, attn=attn, path="trainer")


# One tiny model of each decoder family the issue names (and the 13 of the per-family route): on 4.53+ their
# masks come from masking_utils, where the shim now acts; sliding windows and attention chunks (4) are shorter
# than the examples. Hybrid families (Qwen3.5, ...) also need packing_recurrent_state: tested there.
ATTENTION_FAMILIES = list(_packing.FAMILIES) + [
    "gemma2", "gemma3", "gemma4", "cohere2", "llama4", "gpt_oss", "deepseek_v3", "glm", "glm4",
]
EAGER_ONLY = ("gemma2", "gpt_oss")  # no sdpa for these in 5.x


def _family_attn(family):
    if not _packing.family_available(family):
        pytest.skip(f"transformers {VERSION} has no {family}")
    if not MASK_LAYER and family not in _packing.FAMILIES:
        pytest.skip(f"transformers {VERSION} builds no shared masks (masking_utils is 4.53+): the per-family route "
                    f"covers the {len(_packing.FAMILIES)} families of _packing.FAMILIES only")
    return "eager" if family in EAGER_ONLY or not _supports_sdpa(family) else "sdpa"


def _supports_sdpa(family):
    """Whether this release's model of ``family`` takes sdpa (phi3 before 4.44 does not: it raises)."""
    import importlib

    module_name = _packing.FAMILIES[family][0] if family in _packing.FAMILIES else _packing.modeling_module(family)
    module = importlib.import_module(module_name)
    bases = [obj for name, obj in vars(module).items() if name.endswith("PreTrainedModel") and isinstance(obj, type)]
    return not bases or any(getattr(base, "_supports_sdpa", True) for base in bases)


@below_437
@pytest.mark.parametrize("family", ATTENTION_FAMILIES)
def test_every_family_isolated_with_an_all_ones_mask_and_the_default_cache(evidence, family):
    attn = _family_attn(family)
    assert_bug_and_fix(SHIM, evidence, f"{family}/{attn}/ones", expect_bug=True, family=family, attn=attn, mask="ones")


@below_437
@pytest.mark.parametrize("family", ["gemma3", "llama4"])
def test_per_layer_masks_keep_padding(evidence, family):
    # sliding (gemma3) and chunked (llama4) layers, with a second, right-padded row
    attn = _family_attn(family)
    assert_bug_and_fix(SHIM, evidence, f"{family}/{attn}/padded", expect_bug=True, family=family, attn=attn, mask="padded")


def _separate_losses(model, examples):
    out = []
    for example in examples:
        out.append(model(input_ids=example[None], labels=example[None], use_cache=False).loss)
    return out


def _grads(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


@below_437
@pytest.mark.parametrize("attn", ATTNS)
def test_logits_loss_and_grads_equal_separate_examples(attn):
    model = _packing.tiny_decoder("llama", attn)  # train() mode, fp32
    examples = _packing.example_pair()
    batch = _packing.packed_batch(examples, mask="ones")  # the adversarial all-ones mask

    # negative control: without the shim the packed examples see each other
    assert _packing.segment_logit_gap(model, examples, batch) > 1e-2

    with ftshims.applied(only=[SHIM]):
        reference = _packing.reference_logits(model, examples)
        out = model(**batch)
        torch.testing.assert_close(out.logits[0].detach(), reference, atol=1e-5, rtol=0)

        # loss: labels[pos == 0] = -100, so the packed mean runs over (5-1)+(7-1) = 10 targets
        counts = [len(e) - 1 for e in examples]
        model.zero_grad()
        (out.loss * sum(counts)).backward()
        packed_grads = _grads(model)
        model.zero_grad()
        separate = _separate_losses(model, examples)
        weighted = sum(n * loss for n, loss in zip(counts, separate))
        weighted.backward()
        separate_grads = _grads(model)
    torch.testing.assert_close((out.loss * sum(counts)).detach(), weighted.detach(), atol=1e-5, rtol=1e-6)
    assert packed_grads.keys() == separate_grads.keys() and packed_grads
    for name in packed_grads:
        torch.testing.assert_close(packed_grads[name], separate_grads[name], atol=1e-5, rtol=1e-4, msg=name)


UNHARMED = ["llama", "gemma3", "llama4", "gpt_oss"]  # one mask, sliding, chunked, positions handed down


@below_437
@pytest.mark.parametrize("family", UNHARMED)
def test_unpacked_batches_are_bit_identical_and_untouched(family):
    model = _packing.tiny_decoder(family, _family_attn(family))
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    left = torch.ones_like(ids)
    left[1, :3] = 0  # left padding
    right = torch.ones_like(ids)
    right[1, -3:] = 0  # right padding, the padding's positions 0 (a padding-free collator's style)
    generate_style = (left.cumsum(-1) - 1).clamp(min=0)  # restarts after padding, as generate() computes
    right_style = torch.arange(9).expand(2, -1) * right
    cases = [
        dict(input_ids=ids),
        dict(input_ids=ids, attention_mask=left),
        dict(input_ids=ids, attention_mask=left, position_ids=generate_style),
        dict(input_ids=ids, attention_mask=right, position_ids=right_style),
        dict(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(9)[None], use_cache=False),
    ]
    with torch.no_grad():
        before = [model(**case).logits for case in cases]
        with ftshims.applied(only=[SHIM]):
            after = [model(**case).logits for case in cases]
            assert not ftshims.status()[SHIM].actions
    for b, a in zip(before, after):
        assert torch.equal(b, a)


@below_437
@pytest.mark.parametrize("family", UNHARMED)
def test_generation_unchanged(family):
    model = _packing.tiny_decoder(family, _family_attn(family)).eval()
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 11, 12, 13, 14]])
    mask = (prompt != 0).long()
    with torch.no_grad():
        plain = model.generate(prompt, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
        with ftshims.applied(only=[SHIM]):
            shimmed = model.generate(prompt, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(plain, shimmed)


@below_437
def test_sliding_window_longer_than_an_example(caplog):
    # A window shorter than an example: one 4D mask cannot express it, so the per-family route (4.37-4.52)
    # leaves the batch alone and says so; the mask layer (4.53+) applies the window per example.
    if not _packing.family_available("mistral"):
        pytest.skip("no mistral")
    from ftshims import tiny

    model = tiny.causal_lm("MistralConfig", attn="eager", sliding_window=4, **dict(tiny.TINY_LLAMA)).train()
    examples = _packing.example_pair()
    batch = _packing.packed_batch(examples, mask="ones")
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        before = model(**inputs).logits
        with ftshims.applied(only=[SHIM]):
            after = model(**inputs).logits
            gap = _packing.segment_logit_gap(model, examples, batch)
    if MASK_LAYER:
        assert gap < 1e-5 and "sliding window" not in caplog.text
    else:
        assert torch.equal(before, after)
        assert "sliding window" in caplog.text


def test_segments_detection():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0]])
    seg, real = _packing.segments(pos)
    assert seg.tolist() == [[0, 0, 0, 1, 1, 2, 3]] and real.all()
    # left padding before a restart is not packing
    assert _packing.segments(torch.tensor([[1, 1, 0, 1, 2]]), torch.tensor([[0, 0, 1, 1, 1]])) is None
    # one example per row, 1D/3D position ids, single tokens: not packed
    assert _packing.segments(torch.arange(6)[None].expand(2, -1)) is None
    assert _packing.segments(torch.arange(6)) is None
    assert _packing.segments(torch.zeros(3, 2, 6, dtype=torch.long)) is None
    assert _packing.segments(torch.zeros(1, 1, dtype=torch.long)) is None
    # padding keys are never attended (a padding query may look at its segment: its output is unused)
    seg, real = _packing.segments(torch.tensor([[0, 1, 0, 1, 0]]), torch.tensor([[1, 1, 1, 1, 0]]))
    allowed = _packing.allowed_pairs(seg, real)[0, 0]
    assert allowed.tolist() == [
        [True, False, False, False, False],
        [True, True, False, False, False],
        [False, False, True, False, False],
        [False, False, True, True, False],
        [False, False, True, True, True],
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mask_is_additive_in_the_model_dtype(dtype):
    seg, real = _packing.segments(torch.tensor([[0, 1, 0, 1]]))
    mask = _packing.to_form(_packing.allowed_pairs(seg, real), _packing.ADDITIVE, dtype)
    assert mask.dtype == dtype and mask.shape == (1, 1, 4, 4)
    assert mask.max() == 0 and mask.min() == torch.finfo(dtype).min


@below_437
def test_revert_restores_the_original_forward():
    if MASK_LAYER:
        from transformers import masking_utils as owner

        name = "_preprocess_mask_arguments"
    else:
        from transformers.models.llama.modeling_llama import LlamaModel as owner

        name = "forward"
    original = owner.__dict__[name]
    ftshims.apply(only=[SHIM])
    assert owner.__dict__[name] is not original
    ftshims.revert(only=[SHIM])
    assert owner.__dict__[name] is original


@pytest.mark.skipif(IN_RANGE, reason="checks the gate below transformers 4.37")
def test_below_437_unfixable_and_not_applied():
    # The bug is real below 4.37 too, but no custom 4D mask is accepted there: the shim must
    # stay off ("not needed" with the version reason) and the doctor must say so instead.
    report = ftshims.apply(only=[SHIM])
    assert report[SHIM].status == NOT_NEEDED and ">=4.37" in report[SHIM].reason
    observation = registry.get(SHIM).probe(attn="eager", mask="ones")
    assert observation.bug, observation.detail


@below_437
def test_positional_arguments_and_peft_style_direct_base_calls():
    """The base model called positionally (input_ids, attention_mask, position_ids) is handled too."""
    model = _packing.tiny_decoder("llama", "eager")
    examples = _packing.example_pair()
    batch = _packing.packed_batch(examples, mask="ones")
    with torch.no_grad():
        reference = torch.cat([model.model(e[None], use_cache=False)[0][0] for e in examples])
        with ftshims.applied(only=[SHIM]):
            hidden = model.model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])[0][0]
    torch.testing.assert_close(hidden, reference, atol=1e-5, rtol=0)


@below_437
def test_all_shims_together_keep_packed_examples_isolated():
    """With every registered shim applied (the mask shims of other issues wrap the same mask code)."""
    model = _packing.tiny_decoder("llama", "sdpa")
    examples = _packing.example_pair()
    batch = _packing.packed_batch(examples, mask="ones", pad_row=True)
    with ftshims.applied(include=list(registry.ids())):
        assert _packing.segment_logit_gap(model, examples, batch) < 1e-5


@below_437
def test_through_a_peft_lora_model():
    """PEFT calls the base model through LoraModel.forward -> LlamaForCausalLM.forward -> LlamaModel."""
    pytest.importorskip("peft")
    from ftshims import tiny

    model = tiny.lora(_packing.tiny_decoder("llama", "sdpa"))
    model.train()
    examples = _packing.example_pair()
    batch = _packing.packed_batch(examples, mask="ones")
    assert _packing.segment_logit_gap(model, examples, batch) > 1e-2
    with ftshims.applied(only=[SHIM]):
        assert _packing.segment_logit_gap(model, examples, batch) < 1e-5
