"""eos_label_kept_when_pad_is_eos (opt-in): with pad = EOS the causal-LM collator keeps the EOS labels and
still masks the padding (transformers' DataCollatorForLanguageModeling masked both, by value)."""

import pytest
from tests.shimcheck import assert_bug_and_fix

import ftshims
from ftshims import registry

SHIM = "eos_label_kept_when_pad_is_eos"
probe_module = registry.get(SHIM).module


@pytest.mark.parametrize("features", ["dicts", "lists"])
@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_eos_labels_kept_padding_masked(evidence, features, padding_side):
    assert_bug_and_fix(SHIM, evidence, f"{features}/{padding_side}", features=features, padding_side=padding_side)


def test_distinct_pad_token_is_healthy_everywhere(evidence):
    """pad != eos: upstream's masking is right on every version, and the shim changes nothing."""
    assert_bug_and_fix(SHIM, evidence, "dicts/right/pad!=eos", expect_bug=False, pad_is_eos=False)


def test_opt_in_only():
    """A default apply() leaves the collator alone: which labels are trained is the user's decision."""
    with ftshims.applied() as report:
        assert not report[SHIM].active
        assert "opt-in" in report[SHIM].reason
    with ftshims.applied(include=[SHIM]) as report:
        assert report[SHIM].active


def _collate(collator_class, tok, texts, **kwargs):
    import warnings

    collator = collator_class(tokenizer=tok, mlm=False, **kwargs) if not kwargs.get("response_template") else None
    if collator is None:
        template = kwargs.pop("response_template")
        collator = collator_class(template, tokenizer=tok, mlm=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return collator([{"input_ids": tok(t, add_special_tokens=False)["input_ids"]} for t in texts])


def test_masked_lm_and_distinct_pad_are_bit_identical():
    import torch
    from transformers import DataCollatorForLanguageModeling

    tok = probe_module.tokenizer(pad_is_eos=False)
    plain = _collate(DataCollatorForLanguageModeling, tok, probe_module.TEXTS)
    torch.manual_seed(0)
    masked_plain = DataCollatorForLanguageModeling(tokenizer=probe_module.tokenizer(), mlm=True)(
        [{"input_ids": [1, 4, 5, 2]}, {"input_ids": [1, 6, 2]}])
    with ftshims.applied(only=[SHIM]):
        shimmed = _collate(DataCollatorForLanguageModeling, tok, probe_module.TEXTS)
        torch.manual_seed(0)
        masked_shimmed = DataCollatorForLanguageModeling(tokenizer=probe_module.tokenizer(), mlm=True)(
            [{"input_ids": [1, 4, 5, 2]}, {"input_ids": [1, 6, 2]}])
    for key in plain:
        assert torch.equal(plain[key], shimmed[key])
    for key in masked_plain:
        assert torch.equal(masked_plain[key], masked_shimmed[key])


def test_only_the_eos_labels_change_and_counted():
    import torch
    from transformers import DataCollatorForLanguageModeling

    tok = probe_module.tokenizer()
    plain = _collate(DataCollatorForLanguageModeling, tok, probe_module.TEXTS)
    with ftshims.applied(only=[SHIM]):
        shimmed = _collate(DataCollatorForLanguageModeling, tok, probe_module.TEXTS)
        actions = ftshims.status()[SHIM].actions
    changed = plain["labels"] != shimmed["labels"]
    assert torch.equal(shimmed["input_ids"], plain["input_ids"])
    assert bool((shimmed["input_ids"][changed] == tok.eos_token_id).all())
    assert int(changed.sum()) == 2 and actions == {"EOS labels kept": 2}
    # the shorter row's padding is still -100
    assert shimmed["labels"][1, -1].item() == -100


def test_completion_only_collator_keeps_the_response_eos():
    """TRL's DataCollatorForCompletionOnlyLM calls super().torch_call: the response's EOS is trained, the prompt
    still masked."""
    try:
        from trl import DataCollatorForCompletionOnlyLM
    except ImportError:
        pytest.skip("this TRL has no DataCollatorForCompletionOnlyLM")
    tok = probe_module.tokenizer()
    texts = ["<s> a b c d </s>", "<s> a e </s>"]
    plain = _collate(DataCollatorForCompletionOnlyLM, tok, texts, response_template="a")
    with ftshims.applied(only=[SHIM]):
        shimmed = _collate(DataCollatorForCompletionOnlyLM, tok, texts, response_template="a")
    eos = tok.eos_token_id
    assert (plain["labels"] == eos).sum() == 0  # the negative control: no EOS label survives upstream
    assert (shimmed["labels"] == eos).sum() == 2
    assert shimmed["labels"][0, :2].tolist() == [-100, -100]  # prompt still masked
