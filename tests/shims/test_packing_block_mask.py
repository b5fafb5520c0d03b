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


@below_437
def test_unpacked_batches_are_bit_identical_and_untouched():
    model = _packing.tiny_decoder("llama", "sdpa")
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # what generate() computes: restarts after padding
    cases = [dict(input_ids=ids), dict(input_ids=ids, attention_mask=mask), dict(input_ids=ids, attention_mask=mask, position_ids=position_ids)]
    with torch.no_grad():
        before = [model(**case).logits for case in cases]
        with ftshims.applied(only=[SHIM]):
            after = [model(**case).logits for case in cases]
    for b, a in zip(before, after):
        assert torch.equal(b, a)


@below_437
def test_generation_unchanged():
    model = _packing.tiny_decoder("llama", "sdpa").eval()
    prompt = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        plain = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
        with ftshims.applied(only=[SHIM]):
            shimmed = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(plain, shimmed)


@below_437
def test_sliding_window_longer_than_an_example_is_left_alone(caplog):
    if not _packing.family_available("mistral"):
        pytest.skip("no mistral")
    from ftshims import tiny

    model = tiny.causal_lm("MistralConfig", attn="eager", sliding_window=4, **dict(tiny.TINY_LLAMA)).train()
    examples = _packing.example_pair()
    batch = {k: v for k, v in _packing.packed_batch(examples, mask="ones").items() if k != "labels"}
    with torch.no_grad():
        before = model(**batch).logits
        with ftshims.applied(only=[SHIM]):
            after = model(**batch).logits
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
    from transformers.models.llama import modeling_llama

    original = modeling_llama.LlamaModel.__dict__["forward"]
    ftshims.apply(only=[SHIM])
    assert modeling_llama.LlamaModel.__dict__["forward"] is not original
    ftshims.revert(only=[SHIM])
    assert modeling_llama.LlamaModel.__dict__["forward"] is original


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
