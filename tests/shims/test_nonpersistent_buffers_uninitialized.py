"""nonpersistent_buffers_uninitialized: after from_pretrained, a non-persistent buffer that nothing initialised holds
the value the class's __init__ computes (transformers >=5.0 leave torch.empty_like memory in it)."""

import tempfile

import pytest
from tests.shimcheck import assert_bug_and_fix, applied_or_skip

import ftshims
from ftshims import registry, tiny

SHIM = "nonpersistent_buffers_uninitialized"
probe_module = registry.get(SHIM).module
FILLED = "uninitialised non-persistent buffers filled"


def test_custom_buffer_computed_in_init_survives_loading(evidence):
    assert_bug_and_fix(SHIM, evidence, "custom PreTrainedModel, buffer computed in __init__, save + from_pretrained")


def _reload(model, cls=None, *args, **kwargs):
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        with tempfile.TemporaryDirectory() as path, tiny.quiet():
            model.save_pretrained(path)
            return (cls or type(model)).from_pretrained(path, *args, **kwargs)
    finally:
        hf_logging.enable_progress_bar()


def _applied():
    return applied_or_skip(SHIM)


def test_transformers_model_loads_bit_identical_without_a_second_instance(monkeypatch):
    """Do no harm: a Llama's own _init_weights rebuilds its RoPE buffers, no placeholder is left untouched, so the
    shim builds nothing and every parameter and buffer is bit-identical."""
    import torch

    model = tiny.tiny_llama()
    plain = _reload(model)
    context = _applied()
    try:
        monkeypatch.setattr(probe_module, "reference_buffers", lambda *a: pytest.fail("a second instance was built"))
        shimmed = _reload(model)
        actions = ftshims.status()[SHIM].actions
    finally:
        context.__exit__(None, None, None)
    assert FILLED not in actions
    plain_state = dict(plain.named_parameters()) | dict(plain.named_buffers())
    shim_state = dict(shimmed.named_parameters()) | dict(shimmed.named_buffers())
    assert plain_state.keys() == shim_state.keys()
    assert all(torch.equal(plain_state[k], shim_state[k]) for k in plain_state)


def test_buffer_set_by_init_weights_is_left_alone():
    """A class whose _init_weights writes the buffer (as transformers asks) keeps what it wrote, even where that
    differs from __init__'s value: the shim fills only placeholders nothing wrote."""
    import torch

    config_class, model_class = probe_module.custom_classes()

    class Rebuilds(model_class):
        def _init_weights(self, module):
            super()._init_weights(module)
            if module is self:
                with torch.no_grad():
                    self.scale.fill_(7.0)

    model = Rebuilds(config_class())
    context = _applied()
    try:
        loaded = _reload(model)
        actions = ftshims.status()[SHIM].actions
    finally:
        context.__exit__(None, None, None)
    assert torch.equal(loaded.scale, torch.full((8,), 7.0)) and FILLED not in actions


def test_class_that_needs_more_than_its_config_stays_out_with_a_note():
    config_class, model_class = probe_module.custom_classes()

    class NeedsMore(model_class):
        def __init__(self, config, width):
            super().__init__(config)
            self.width = width

    model = NeedsMore(config_class(), 3)
    context = _applied()
    try:
        loaded = _reload(model, None, 3)
        notes = ftshims.status()[SHIM].notes
    finally:
        context.__exit__(None, None, None)
    assert loaded.width == 3
    assert any("NeedsMore(config) failed" in note for note in notes), notes


def test_buffer_in_the_default_dtype_is_computed_in_the_loading_dtype():
    """from_pretrained(dtype=bfloat16) builds the model under that default dtype: a buffer computed without an
    explicit dtype gets the bfloat16 values __init__ gives then (what 4.57 kept), not float32 ones cast."""
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

    class Config(PretrainedConfig):
        model_type = "ftshims_dtype_probe"

    class Model(PreTrainedModel):
        config_class = Config
        base_model_prefix = "probe"

        def __init__(self, config):
            super().__init__(config)
            self.linear = torch.nn.Linear(4, 4)
            self.register_buffer("table", torch.arange(1, 9) / 3, persistent=False)  # default dtype
            self.post_init()

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        expected = Model(Config()).table
    finally:
        torch.set_default_dtype(previous)
    context = _applied()
    try:
        loaded = _reload(Model(Config()), None, dtype=torch.bfloat16)
    finally:
        context.__exit__(None, None, None)
    assert loaded.table.dtype == torch.bfloat16 and torch.equal(loaded.table, expected)


def test_random_state_is_the_same_as_without_the_shim():
    """The second instance is built under a saved and restored random state: what the program draws next is the same."""
    import torch

    config_class, model_class = probe_module.custom_classes()
    model = model_class(config_class())

    def draw_after_load(shim_on):
        torch.manual_seed(123)
        context = _applied() if shim_on else None
        try:
            _reload(model)
        finally:
            if context is not None:
                context.__exit__(None, None, None)
        return torch.rand(4)

    assert torch.equal(draw_after_load(False), draw_after_load(True))
