"""trainer_plain_module_shared_params_crash_at_first_save: a plain nn.Module with a Parameter shared by two layers
is checkpointed by the Trainer (upstream: 'Some tensors share memory' at the first save) and resumes to the
uninterrupted run's weights with the sharing kept; modules without shared tensors save exactly as upstream."""

import pytest
from tests.shimcheck import applied_or_skip, assert_bug_and_fix

from ftshims import registry

SHIM = "trainer_plain_module_shared_params_crash_at_first_save"
shim_module = registry.get(SHIM).module


def test_shared_parameter_saves_and_resumes(evidence):
    assert_bug_and_fix(SHIM, evidence, "plain module, embedding and head share a Parameter: save, resume")


def test_module_without_shared_tensors_is_untouched(evidence):
    assert_bug_and_fix(SHIM, evidence, "plain module without shared tensors (healthy)", expect_bug=False, shared=False)


def test_unshared_save_is_byte_identical_and_the_shim_does_not_act(tmp_path):
    """Without shared tensors the checkpoint's model.safetensors is the same file with and without the shim."""
    import ftshims

    shim_module._train(str(tmp_path / "plain"), shared=False)
    context = applied_or_skip(SHIM)
    try:
        shim_module._train(str(tmp_path / "shimmed"), shared=False)
        assert ftshims.status()[SHIM].actions == {}
    finally:
        context.__exit__(None, None, None)
    for step in (2, 4):
        plain = (tmp_path / "plain" / f"checkpoint-{step}" / "model.safetensors").read_bytes()
        assert (tmp_path / "shimmed" / f"checkpoint-{step}" / "model.safetensors").read_bytes() == plain


def test_without_aliases_copies_only_the_second_name():
    import torch

    weight = torch.nn.Parameter(torch.ones(2, 2))
    state = {"a": weight.detach(), "b": weight.detach(), "c": torch.zeros(3)}
    out, copied = shim_module.without_aliases(state)
    assert copied == ["b"] and out["a"] is state["a"] and out["c"] is state["c"]
    assert torch.equal(out["b"], state["a"]) and out["b"].untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()
    assert shim_module.without_aliases({"c": state["c"]}) == ({"c": state["c"]}, [])
