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


# ---------------------------------------------------------------------------
# Every example layout TRL's collator accepts (issue 34: a BatchEncoding, a Mapping but not a dict, was read as a
# list of ids and crashed the call): the guard reads each one, the batch is TRL's own, and it falls back to TRL's
# call for layouts it cannot read. Run on every stack whose TRL has the collator (0.6-0.19).


def _layouts(tok, texts):
    import numpy as np
    import torch

    encoded = [tok(t, add_special_tokens=False) for t in texts]  # BatchEncoding: a Mapping, not a dict
    ids = [list(e["input_ids"]) for e in encoded]
    return {
        "BatchEncoding": encoded,
        "dict": [{"input_ids": i} for i in ids],
        "dict with attention_mask": [{"input_ids": i, "attention_mask": [1] * len(i)} for i in ids],
        "list of ids": ids,
        "tensor": [torch.tensor(i) for i in ids],
        "numpy array": [np.array(i) for i in ids],
        "dict of tensors": [{"input_ids": torch.tensor(i)} for i in ids],
    }


LAYOUTS = ["BatchEncoding", "dict", "dict with attention_mask", "list of ids", "tensor", "numpy array", "dict of tensors"]


def _in_range_or_skip():
    if not in_affected_range(SHIM)[0]:
        pytest.skip("outside the shim's range")


def _same_batch(a, b) -> bool:
    return set(a) == set(b) and all(a[k].tolist() == b[k].tolist() for k in a)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_collates_exactly_as_trl_does(layout):
    """A healthy batch in each layout: the guard reads it, raises nothing, and the batch is TRL's, bit for bit."""
    _in_range_or_skip()
    collator, _ = _collator("healthy")
    features = _layouts(collator.tokenizer, shim_module.SCENARIOS["healthy"][1])[layout]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = collator(features)
        with ftshims.applied(only=[SHIM]):
            shimmed = collator(features)
            unread = ftshims.status()[SHIM].actions.get("batches left unread", 0)
    assert _same_batch(plain, shimmed)
    assert unread == 0, f"{layout}: the guard did not read this layout"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_is_guarded(layout):
    """The same unmatchable template (it contains the pad token) is refused whatever the layout of the examples."""
    _in_range_or_skip()
    collator, _ = _collator("pad_in_template")
    features = _layouts(collator.tokenizer, shim_module.SCENARIOS["pad_in_template"][1])[layout]
    with ftshims.applied(only=[SHIM]), pytest.raises(shim_module.TemplateMissError, match="pad token id"):
        collator(features)


def test_unreadable_layout_is_left_to_trl():
    """Examples the guard cannot read ([1, n] tensors from return_tensors="pt"): TRL's call runs untouched (its
    result or its own error, the same with and without the guard), and status() counts the batch as unread."""
    _in_range_or_skip()
    collator, _ = _collator("pad_in_template")
    tok = collator.tokenizer
    features = [tok(t, add_special_tokens=False, return_tensors="pt") for t in shim_module.SCENARIOS["healthy"][1]]

    def outcome():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                return "batch", collator(features)["input_ids"].tolist()
            except Exception as exc:  # noqa: BLE001 - whatever TRL does with it, the guard must do the same
                return "error", type(exc).__name__

    plain = outcome()
    with ftshims.applied(only=[SHIM]):
        shimmed = outcome()
        unread = ftshims.status()[SHIM].actions.get("batches left unread", 0)
    assert shimmed == plain
    assert unread == 1


def test_one_truncated_example_at_batch_size_one_keeps_trl_behaviour():
    """TRL's own test_data_collator_handling_of_long_sequences: a single example whose template was truncated away
    is dropped with TRL's warning, not refused: the Trainer takes a zero-loss step, nothing is corrupted."""
    _in_range_or_skip()
    collator, features = _collator("truncated")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        plain = collator(features[1:])
    with ftshims.applied(only=[SHIM]), warnings.catch_warnings(record=True) as seen_shimmed:
        warnings.simplefilter("always")
        shimmed = collator(features[1:])
    assert _same_batch(plain, shimmed) and bool((shimmed["labels"] == -100).all())
    trl_said = [str(w.message) for w in seen if "Could not find response key" in str(w.message)]
    assert trl_said and all(any(t == str(w.message) for w in seen_shimmed) for t in trl_said)


def test_a_run_that_never_finds_its_template_stops_within_its_first_examples():
    """Batch size 1, the template in none of the data: the first FIRST_EXAMPLES - 1 calls go through as TRL's, the
    next one raises, saying that nothing was kept."""
    _in_range_or_skip()
    collator, _ = _collator("all_missing")
    tok = collator.tokenizer
    rows = [{"input_ids": tok(t, add_special_tokens=False)["input_ids"]} for t in shim_module.SCENARIOS["all_missing"][1]]
    assert len(rows) == shim_module.FIRST_EXAMPLES
    with ftshims.applied(only=[SHIM]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for row in rows[:-1]:
            collator([row])
        with pytest.raises(shim_module.TemplateMissError, match="would train on nothing"):
            collator([rows[-1]])


def test_a_dropped_batch_after_kept_examples_goes_through():
    """Once the collator has kept examples, a batch whose every row misses (a run of truncated examples) is TRL's
    drop with a warning, never an error."""
    _in_range_or_skip()
    collator, _ = _collator("healthy")
    tok = collator.tokenizer
    healthy = [{"input_ids": tok(t, add_special_tokens=False)["input_ids"]} for t in shim_module.SCENARIOS["healthy"][1]]
    missing = [{"input_ids": tok(t, add_special_tokens=False)["input_ids"]}
               for t in shim_module.SCENARIOS["all_missing"][1]]
    with ftshims.applied(only=[SHIM]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        collator(healthy)
        batch = collator(missing)
    assert bool((batch["labels"] == -100).all())
