"""custom_init_overwrites_loaded_weights: a custom PreTrainedModel whose _init_weights writes in place
(module.weight.data.normal_()) keeps its loaded weights through from_pretrained (transformers 5.0-5.12 overwrite
them with a fresh random draw)."""

import pytest
from tests.shimcheck import assert_bug_and_fix, applied_or_skip

import ftshims
from ftshims import probing, registry, tiny

SHIM = "custom_init_overwrites_loaded_weights"
probe_module = registry.get(SHIM).module
KEPT = "fully loaded modules of a custom model kept from _init_weights"


def test_custom_model_keeps_its_loaded_weights(evidence):
    assert_bug_and_fix(SHIM, evidence, "custom PreTrainedModel, _init_weights writes .data in place, "
                                       "save + from_pretrained")


def _known_weights(model):
    import torch

    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.randn_like(p) + 0.5 * (i + 1))
    return model


def _with_shim_or_fixed():
    """The shim applied where it is in range; upstream as it is outside (where the same must hold)."""
    affected, _ = probing.in_affected_range(SHIM)
    return applied_or_skip(SHIM) if affected else None


def test_missing_keys_are_still_initialised_by_the_class():
    """A checkpoint without the head: the loaded encoder keeps its values, the missing head gets the class's own
    _init_weights (bias zeroed, weight ~ N(0, 0.02)), as 5.13+ does. Outside the range upstream must do the same."""
    import torch

    config_class, model_class = probe_module.custom_classes()
    torch.manual_seed(0)
    model = _known_weights(model_class(config_class()))
    partial = {k: v for k, v in model.state_dict().items() if k.startswith("encoder.")}
    context = _with_shim_or_fixed()
    try:
        loaded = probe_module.save_and_load(model, state_dict=partial)
    finally:
        if context is not None:
            context.__exit__(None, None, None)
    assert torch.equal(loaded.encoder.weight, model.encoder.weight)
    assert torch.equal(loaded.encoder.bias, model.encoder.bias)
    assert torch.equal(loaded.head.bias, torch.zeros(8)), loaded.head.bias
    std = float(loaded.head.weight.detach().std())
    assert 0.005 < std < 0.05, f"head not initialised by _init_weights: std {std}"


def test_transformers_model_loads_bit_identical_and_untouched():
    """Do no harm: transformers' own class (not custom code) loads exactly as without the shim, including the
    initialisation of a missing key (a sequence-classification head loaded from a causal LM), and the shim never
    acts."""
    import torch
    from transformers import LlamaForSequenceClassification

    model = tiny.tiny_llama()

    def load():
        torch.manual_seed(7)
        return probe_module.save_and_load(model, LlamaForSequenceClassification, num_labels=3)

    plain = load()
    context = applied_or_skip(SHIM)
    try:
        shimmed = load()
        actions = ftshims.status()[SHIM].actions
    finally:
        context.__exit__(None, None, None)
    assert KEPT not in actions
    a, b = plain.state_dict(), shimmed.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_custom_model_built_from_config_is_initialised_as_without_the_shim():
    """Do no harm: outside from_pretrained (a model built from its config) the shim does nothing: the same seed
    gives bit-identical weights."""
    import torch

    config_class, model_class = probe_module.custom_classes()
    torch.manual_seed(3)
    plain = model_class(config_class()).state_dict()
    context = applied_or_skip(SHIM)
    try:
        torch.manual_seed(3)
        shimmed = model_class(config_class()).state_dict()
    finally:
        context.__exit__(None, None, None)
    assert all(torch.equal(plain[k], shimmed[k]) for k in plain)


def test_custom_model_fully_loaded_counts_its_action():
    import torch

    config_class, model_class = probe_module.custom_classes()
    model = _known_weights(model_class(config_class()))
    context = applied_or_skip(SHIM)
    try:
        loaded = probe_module.save_and_load(model)
        actions = ftshims.status()[SHIM].actions
    finally:
        context.__exit__(None, None, None)
    assert torch.equal(loaded.head.weight, model.head.weight)
    assert actions.get(KEPT, 0) >= 2, actions


@pytest.mark.parametrize("module_name", ["custom", "transformers"])
def test_is_custom_code_matches_5_13(module_name):
    """5.13.0's is_custom_code: remote code or a class outside transformers."""
    class Local:
        _auto_class = None

    Local.__module__ = "my_project.model" if module_name == "custom" else "transformers.models.x.modeling_x"
    assert probe_module.is_custom_code(Local) is (module_name == "custom")
    Local._auto_class = "AutoModel"
    assert probe_module.is_custom_code(Local) is True
