"""trl_rl_scoring_position_ids: GRPO/RLOO score left-padded rows of absolute-position models (GPT-2) at the
positions generate() used, so the padded row's log-probs are those of the unpadded tokens; RoPE models and
batches without left padding are untouched."""

import pytest
from tests.shimcheck import assert_bug_and_fix

import ftshims
from ftshims import registry
from ftshims.probing import in_affected_range
from ftshims.spec import ProbeUnsupported

SHIM = "trl_rl_scoring_position_ids"
shim_module = registry.get(SHIM).module


@pytest.mark.parametrize("trainer", ["grpo", "rloo"])
def test_gpt2_left_padded_row(evidence, trainer):
    assert_bug_and_fix(SHIM, evidence, f"{trainer}: gpt2, prompt left-padded by 2", trainer=trainer)


def test_rope_model_is_healthy(evidence):
    assert_bug_and_fix(SHIM, evidence, "grpo: llama (RoPE), prompt left-padded by 2 (healthy)", expect_bug=False,
                       model_type="llama")


@pytest.fixture(scope="module")
def grpo():
    if not in_affected_range(SHIM)[0]:
        pytest.skip("outside the shim's range")
    try:
        return {kind: shim_module.trainer_for(kind) for kind in ("gpt2", "llama")}
    except ProbeUnsupported as exc:
        pytest.skip(str(exc))


def _batches():
    import torch

    ids = torch.tensor([p + shim_module.COMPLETION for p in shim_module.PROMPTS])
    right = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [7, 8, 9, 10, 11, 0, 0]])  # padded on the right only
    return [(ids, (ids != 0).long()), (right, (right != 0).long())]


def test_unaffected_calls_are_bit_identical(grpo):
    """Llama with left padding, GPT-2 without left padding: the same log-probs, and the shim never acts."""
    runs = [(grpo["llama"], *_batches()[0]), (grpo["gpt2"], *_batches()[1])]
    plain = [shim_module.completion_logps(t, ids, mask) for t, ids, mask in runs]
    with ftshims.applied(only=[SHIM]) as report:
        assert report[SHIM].active, report[SHIM].reason
        shimmed = [shim_module.completion_logps(t, ids, mask) for t, ids, mask in runs]
        assert ftshims.status()[SHIM].actions == {}
    for a, b in zip(plain, shimmed):
        assert a.dtype == b.dtype and a.equal(b)


def test_scored_logps_are_those_generate_sampled_from(grpo):
    """Greedy generate() on the two prompts (one left-padded), then the trainer's scoring of prompt+completion:
    with the shim the log-probs equal those of generate's raw logits for every row; the unpadded row is unchanged."""
    import torch

    trainer = grpo["gpt2"]
    model = trainer.model
    prompts = torch.tensor(shim_module.PROMPTS)
    prompt_mask = (prompts != 0).long()
    with torch.no_grad():
        out = model.generate(prompts, attention_mask=prompt_mask, max_new_tokens=3, do_sample=False, min_new_tokens=3,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    completion = out.sequences[:, prompts.shape[1]:]
    sampled = torch.stack([torch.log_softmax(s.float(), -1).gather(-1, completion[:, i:i + 1])[:, 0]
                           for i, s in enumerate(out.logits)], dim=1)
    mask = torch.cat([prompt_mask, torch.ones_like(completion)], dim=1)
    plain = shim_module.completion_logps(trainer, out.sequences, mask)
    with ftshims.applied(only=[SHIM]):
        shimmed = shim_module.completion_logps(trainer, out.sequences, mask)
        assert ftshims.status()[SHIM].actions == {"left-padded scoring batches given mask positions": 1}
    assert torch.allclose(shimmed, sampled, atol=1e-5, rtol=0)
    assert shimmed[0].equal(plain[0])
    assert not torch.allclose(plain[1], sampled[1], atol=1e-3, rtol=0)


def test_hook_is_removed_and_method_restored(grpo):
    trainer = grpo["gpt2"]
    backbone = shim_module.affected_backbone(trainer.model)
    cls = type(trainer)
    name = next(n for n in shim_module.METHODS if n in vars(cls))
    original = vars(cls)[name]
    with ftshims.applied(only=[SHIM]):
        assert vars(cls)[name] is not original
        shim_module.completion_logps(trainer, *_batches()[0])
        assert not backbone._forward_pre_hooks
    assert vars(cls)[name] is original


def test_hook_traces_in_a_fullgraph_compile():
    """Under torch.compile(fullgraph=True) the hook takes its data-independent branch: the left-padded batch gets
    the mask's positions, a batch without left padding the arange upstream uses; one graph, no break."""
    import torch

    from ftshims import tiny

    if not in_affected_range(SHIM)[0]:
        pytest.skip("outside the shim's range")
    torch._dynamo.reset()
    model = tiny.causal_lm("GPT2Config", vocab_size=16, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0).eval()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    try:
        for left_padded, (ids, mask) in zip((True, False), _batches()):
            with torch.no_grad():
                got = shim_module._scoring(lambda m, i, a: compiled(input_ids=i, attention_mask=a).logits, None,
                                           (model, ids, mask), {})
                positions = shim_module.mask_positions(mask) if left_padded else None
                want = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
            real = mask.bool()
            assert torch.allclose(got[real], want[real], atol=1e-5, rtol=0), left_padded
    finally:
        torch._dynamo.reset()
