"""resume_iterable_dataset_wrapped_pass_replays: a resume into the second pass of a dataset without length is
refused with a clear error before the first step (upstream it replays and skips examples); a checkpoint inside
the first pass, ignore_data_skip=True and datasets with a length resume as upstream does."""

import pytest
from tests.shimcheck import applied_or_skip, assert_bug_and_fix

from ftshims import registry

SHIM = "resume_iterable_dataset_wrapped_pass_replays"
shim_module = registry.get(SHIM).module


def test_resume_after_the_data_wrapped_is_refused(evidence):
    """Without the guard: examples 0, 1, 2, 3 at steps 13-16 instead of 2, 3, 4, 5."""
    assert_bug_and_fix(SHIM, evidence, "IterableDataset, 10 examples, 16 steps, resumed at 12 (second pass)")


def test_resume_inside_the_first_pass_is_exact_and_untouched(evidence):
    assert_bug_and_fix(SHIM, evidence, "resumed at 8 (first pass, healthy)", expect_bug=False, save=8)


def test_refusal_text_and_the_ways_out(tmp_path):
    """The error names the checkpoint, the passes and ignore_data_skip; with ignore_data_skip=True or a dataset
    with a length the guard stays out (refusal() returns None)."""
    from types import SimpleNamespace

    from ftshims.checkpoint import ResumeNotExact

    context = applied_or_skip(SHIM)
    try:
        shim_module._run(str(tmp_path))
        checkpoint = str(tmp_path / "checkpoint-12")
        with pytest.raises(ResumeNotExact) as raised:
            shim_module._run(str(tmp_path / "resumed"), resume=checkpoint)
        text = str(raised.value)
        assert checkpoint in text and "gone through it 1 time " in text and "ignore_data_skip=True" in text, text
        args = SimpleNamespace(ignore_data_skip=False, max_steps=16)
        assert shim_module.refusal(SimpleNamespace(args=args, train_dataset=[1] * 10), checkpoint) is None
        args.ignore_data_skip = True
        assert shim_module.refusal(SimpleNamespace(args=args, train_dataset=iter(())), checkpoint) is None
    finally:
        context.__exit__(None, None, None)
