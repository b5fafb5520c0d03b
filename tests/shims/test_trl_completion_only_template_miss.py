"""trl_completion_only_template_miss: TRL 0.6-0.19's DataCollatorForCompletionOnlyLM no longer drops examples
from the loss silently when it cannot find the template: the guard names the row and the cause."""

import warnings

import pytest
from tests.shimcheck import assert_bug_and_fix

import ftshims
from ftshims import registry
from ftshims.probing import in_affected_range

SHIM = "trl_completion_only_template_miss"
shim_module = registry.get(SHIM).module


@pytest.mark.parametrize("scenario", ["pad_in_template", "all_missing"])
def test_unmatchable_template_is_refused_by_default(evidence, scenario):
    """auto policy: a template that can never match, or a batch whose every example misses, raises."""
    assert_bug_and_fix(SHIM, evidence, f"{scenario}, policy auto", case=scenario)


def test_isolated_miss_is_refused_under_policy_error(evidence):
    assert_bug_and_fix(SHIM, evidence, "truncated row, policy error", options={"policy": "error"}, case="truncated")


def test_healthy_batch_passes_unchanged(evidence):
    assert_bug_and_fix(SHIM, evidence, "template in every row", expect_bug=False, case="healthy")


def _collator(scenario):
    try:
        from trl.trainer.utils import DataCollatorForCompletionOnlyLM
    except ImportError:
        pytest.skip("this TRL has no DataCollatorForCompletionOnlyLM")
    template, texts = shim_module.SCENARIOS[scenario]
    tok = shim_module.tokenizer()
    features = [{"input_ids": tok(t, add_special_tokens=False)["input_ids"]} for t in texts]
    return DataCollatorForCompletionOnlyLM(template, tokenizer=tok, mlm=False), features


def test_auto_policy_lets_an_isolated_miss_through_with_one_warning():
    """A truncated example in a batch that still trains: TRL's behaviour is kept (the row is dropped), said once."""
    if not in_affected_range(SHIM)[0]:
        pytest.skip("outside the shim's range")
    collator, features = _collator("truncated")
    plain = collator(features)
    with ftshims.applied(only=[SHIM]), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        shimmed = collator(features)
        collator(features)
    assert plain["labels"].tolist() == shimmed["labels"].tolist()
    ours = [w for w in seen if "trl_completion_only_template_miss" in str(w.message)]
    assert len(ours) == 1 and "row 1" in str(ours[0].message), [str(w.message) for w in seen]


def test_error_names_the_pad_token_cause():
    if not in_affected_range(SHIM)[0]:
        pytest.skip("outside the shim's range")
    collator, features = _collator("pad_in_template")
    with ftshims.applied(only=[SHIM]), pytest.raises(ValueError, match="pad token id"):
        collator(features)


def test_in_context_tokenization_mismatch_is_diagnosed():
    """The template text is in the example but its ids are not (SentencePiece in context, trl#598): refused."""
    if not in_affected_range(SHIM)[0]:
        pytest.skip("outside the shim's range")
    collator, features = _collator("healthy")
    tok = collator.tokenizer
    collator.response_token_ids = [tok.convert_tokens_to_ids("Answer:"), tok.convert_tokens_to_ids("###")]
    with ftshims.applied(only=[SHIM]), pytest.raises(ValueError, match="differently in context"):
        collator(features)
