"""resume_save_only_model_restarts_lr_schedule: a resume from a save_only_model checkpoint is refused with a clear
error before the first step (it would restart the schedule and AdamW's moments); a full checkpoint resumes
bit-identically with or without the guard."""

import os

import pytest
from tests.shimcheck import applied_or_skip, assert_bug_and_fix

from ftshims import registry

SHIM = "resume_save_only_model_restarts_lr_schedule"
shim_module = registry.get(SHIM).module


def test_save_only_model_resume_is_refused(evidence):
    """Without the guard: lr steps 5-8 are 0, 5e-4, 1e-3, 8.3e-4 (warmup again) instead of 6.7e-4 ... 1.7e-4."""
    assert_bug_and_fix(SHIM, evidence, "resume from a save_only_model checkpoint")


def test_full_checkpoint_resumes_exactly(evidence):
    assert_bug_and_fix(SHIM, evidence, "resume from a full checkpoint (healthy)", expect_bug=False, save_only_model=False)


def test_refusal_names_the_checkpoint_and_comes_before_any_step(tmp_path):
    """The error names the checkpoint, what it lacks and the way out; no optimizer step ran in the resumed Trainer."""
    from ftshims.checkpoint import ResumeNotExact

    context = applied_or_skip(SHIM)
    try:
        shim_module._run(str(tmp_path), save_only_model=True)
        checkpoint = str(tmp_path / "checkpoint-4")
        assert sorted(os.listdir(checkpoint)).count("optimizer.pt") == 0
        with pytest.raises(ResumeNotExact) as raised:
            lrs, _ = shim_module._run(str(tmp_path / "resumed"), save_only_model=True, resume=checkpoint)
        text = str(raised.value)
        assert checkpoint in text and "no optimizer.pt and no scheduler.pt" in text and "save_only_model" in text
        assert "exclude=['resume_save_only_model_restarts_lr_schedule']" in text
        assert not (tmp_path / "resumed").exists() or not any((tmp_path / "resumed").glob("checkpoint-*"))
    finally:
        context.__exit__(None, None, None)


def test_checkpoint_layout_reads_what_save_only_model_wrote(tmp_path):
    """ftshims.checkpoint.layout (shared with the doctor): the save_only_model checkpoint is named as such."""
    from ftshims.checkpoint.layout import describe

    from ftshims.probing import in_affected_range

    if not in_affected_range(SHIM)[0]:
        pytest.skip("no save_only_model on this transformers")
    shim_module._run(str(tmp_path / "only"), save_only_model=True)
    shim_module._run(str(tmp_path / "full"), save_only_model=False)
    only, full = describe(str(tmp_path / "only" / "checkpoint-4")), describe(str(tmp_path / "full" / "checkpoint-4"))
    assert only["save_only_model"] and only["global_step"] == 4 and len(only["missing_for_resume"]) == 3, only
    assert not full["save_only_model"] and full["missing_for_resume"] == [], full
