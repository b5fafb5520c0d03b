"""trl_extract_prompt_boundary: TRL's extract_prompt splits a text row whose chosen is a prefix of (or equal to)
its rejected at the full common prefix, and a row that differs at the first character without wrapping around;
every other row (and every conversational row) is split as upstream does it."""

import pytest
from tests.shimcheck import assert_bug_and_fix

import ftshims
from ftshims import registry
from ftshims.probing import in_affected_range
from ftshims.spec import ProbeUnsupported

SHIM = "trl_extract_prompt_boundary"
shim_module = registry.get(SHIM).module


@pytest.mark.parametrize("case", ["prefix", "equal", "first_differs"])
def test_boundary_rows_split_at_the_common_prefix(evidence, case):
    assert_bug_and_fix(SHIM, evidence, f"text row: {case}", case=case)


@pytest.mark.parametrize("case", ["healthy", "healthy_midword", "healthy_first"])
def test_rows_that_differ_are_healthy(evidence, case):
    assert_bug_and_fix(SHIM, evidence, f"text row: {case} (healthy)", expect_bug=False, case=case)


@pytest.fixture
def affected():
    if not in_affected_range(SHIM)[0]:
        pytest.skip("outside the shim's range")
    try:
        return shim_module.extractor()
    except ProbeUnsupported as exc:
        pytest.skip(str(exc))


UNTOUCHED = [
    # conversational: a prefix conversation and a tie keep upstream's split (non-empty completions)
    {"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
     "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                  {"role": "user", "content": "u2"}]},
    {"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
     "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
    {"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
     "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}]},
    # text rows that differ after index 0, or at 0 without a trailing space
    {"chosen": "Human: hi Assistant: yes ", "rejected": "Human: hi Assistant: no"},
    {"chosen": "abc", "rejected": "xbc "},
    # extra columns ride along (the trainers map the whole row)
    {"chosen": "q a", "rejected": "q b", "score": 3},
]


@pytest.mark.parametrize("example", UNTOUCHED, ids=lambda e: repr(e)[:40])
def test_other_rows_are_upstreams_split(affected, example):
    from trl.data_utils import extract_prompt

    plain = extract_prompt(dict(example))
    with ftshims.applied(only=[SHIM]) as report:
        assert report[SHIM].active, report[SHIM].reason
        shimmed = extract_prompt(dict(example))
        assert ftshims.status()[SHIM].actions == {}
    assert shimmed == plain


def test_every_alias_is_wrapped_and_restored(affected):
    """DPO and KTO import extract_prompt by name; maybe_extract_prompt reaches it through trl.data_utils."""
    import trl.data_utils as data_utils
    import trl.trainer.dpo_trainer as dpo_trainer

    original = vars(data_utils)["extract_prompt"]
    aliased = vars(dpo_trainer).get("extract_prompt") is original
    with ftshims.applied(only=[SHIM]):
        assert vars(data_utils)["extract_prompt"] is not original
        if aliased:
            assert vars(dpo_trainer)["extract_prompt"] is not original
        row = {"chosen": "Q: hi A: Sure", "rejected": "Q: hi A: Sure thing"}
        assert data_utils.maybe_extract_prompt(dict(row))["prompt"] == "Q: hi A: Sure"
        assert ftshims.status()[SHIM].actions == {"preference rows split at the full common prefix": 1}
    assert vars(data_utils)["extract_prompt"] is original
    if aliased:
        assert vars(dpo_trainer)["extract_prompt"] is original


def test_dpo_trainer_rows_equal_the_explicit_prompt(affected):
    """A DPOTrainer (TRL >= 1.0) given the implicit-prompt row tokenises it like the same row with its prompt
    given explicitly; without the shim the last shared word is in both completions."""
    import tempfile
    import warnings

    from packaging.version import Version

    from ftshims import tiny
    from ftshims.versions import installed_version

    if Version(installed_version("trl")) < Version("1.0.0"):
        pytest.skip("the DPOTrainer construction below is TRL 1.x's")
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    tok = tiny.word_tokenizer(["<pad>", "<s>", "</s>", "<unk>", "q1", "q2", "a1", "a2"],
                              bos_token="<s>", eos_token="</s>", pad_token="<pad>")

    def rows(columns):
        with tempfile.TemporaryDirectory() as out, tiny.quiet(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            args = DPOConfig(output_dir=out, report_to=[], use_cpu=True, dataset_num_proc=None,
                             bf16=False)  # TRL 1.x defaults to bf16, and accelerate keeps it for later Trainers
            trainer = DPOTrainer(model=tiny.tiny_llama(vocab_size=16), ref_model=tiny.tiny_llama(vocab_size=16),
                                 args=args, train_dataset=Dataset.from_dict(columns), processing_class=tok)
            row = trainer.train_dataset[0]
            return {k: row[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")}

    explicit = rows({"prompt": ["q1 q2 a1"], "chosen": [""], "rejected": [" a2"]})
    implicit = {"chosen": ["q1 q2 a1"], "rejected": ["q1 q2 a1 a2"]}
    assert rows(implicit) != explicit
    with ftshims.applied(only=[SHIM]):
        assert rows(implicit) == explicit
