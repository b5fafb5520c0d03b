"""``from_pretrained`` re-initialises the loaded weights of a custom model whose ``_init_weights`` writes in place.

Why: since 5.0 ``from_pretrained`` loads the checkpoint first and then runs ``initialize_weights()`` over the whole
model (``_initialize_missing_keys``) to initialise what the checkpoint did not hold. Each loaded tensor carries the
flag ``_is_hf_initialized``, and transformers' own ``_init_weights`` honour it because they write through the
guarded ``transformers.initialization`` / ``torch.nn.init`` functions, which skip flagged tensors. A class outside
transformers (your own subclass, or remote code) whose ``_init_weights`` writes the BERT-era way,
``module.weight.data.normal_()`` / ``.zero_()`` / ``.fill_()``, bypasses the guard: every loaded weight is
overwritten with a fresh random draw. ``loading_info`` is clean and nothing warns; fine-tuning silently starts from
scratch. 4.57 initialised only the modules with missing keys. transformers#46620: 5.3 added a backstop in
``PreTrainedModel._initialize_weights`` (a module whose own parameters and buffers are all flagged is marked and
skipped) but only for remote code (``is_remote_code()``: a class with ``_auto_class``); 5.13.0 extended it to every
custom class (``is_custom_code()``: remote code or a class whose module is not ``transformers.*``). PR #46632
(closed) proposed the same.

The fix, upstream's own (5.13.0's ``_initialize_weights``): while ``_initialize_missing_keys`` runs (the loading
path only; a model built from its config is untouched) on a model whose class is custom code as 5.13 defines it,
``_initialize_weights(module)`` skips a module that is not yet marked and whose own parameters and buffers all
carry ``_is_hf_initialized``: the module is marked initialised and its ``_init_weights`` is not called, exactly as
5.13.0 does. Modules with a missing tensor are initialised by the model's ``_init_weights`` as before (and as 5.13
does), so missing keys get the class's own initialisation. transformers' own classes (not custom code) are never
changed; on 5.3-5.12 remote code already had this backstop, and the shim computes the same thing there.

Applies to transformers >=5.0.0,<5.13.0 (read: 5.0.0, 5.1.0, 5.2.0 have no backstop at all; 5.3.0 to 5.12.1 have it
for remote code only; 5.13.0, 5.14.1, 5.24.0 and 5.25.0 have ``is_custom_code``). The shim stays out (a changed
target: ``_initialize_weights`` or ``_initialize_missing_keys`` without the parameters it relies on) when the
methods differ from those read. A class that overrides ``_initialize_weights`` itself is not reached (its own code
decides).

Follow-ups: the merged upstream change was not identified (5.13.0's is_custom_code, read in the wheel; PR #46632
proposing it was closed); 5.14.1, 5.15.1, 5.16.1, 5.17.0, 5.18.0, 5.20.2, 5.22.2, 5.24.0 and 5.25.0 keep 5.13.0's
check; PRs #47335 and #48140 (closed) proposed honouring the flags for transformers' own classes too: not carried,
upstream kept the custom-code gate.
"""

from __future__ import annotations

import contextvars
import logging
import sys

from .._util import acted
from ..spec import Observation, ShimSpec, Target

log = logging.getLogger("ftshims")

FOLLOW_UPS = (
    "the merged upstream change was not identified (5.13.0's is_custom_code, read in the wheel; PR #46632"
    " proposing it was closed); 5.14.1, 5.15.1, 5.16.1, 5.17.0, 5.18.0, 5.20.2, 5.22.2, 5.24.0 and 5.25.0"
    " keep 5.13.0's check; PRs #47335 and #48140 (closed) proposed honouring the flags for transformers' "
    "own classes too: not carried, upstream kept the custom-code gate"
)

SPEC = ShimSpec(
    id="custom_init_overwrites_loaded_weights",
    since="0.3.0",
    title="from_pretrained overwrites the loaded weights of a custom PreTrainedModel whose _init_weights writes in "
    "place (module.weight.data.normal_())",
    symptom="your own (or remote-code) PreTrainedModel subclass with a BERT-era _init_weights "
    "(module.weight.data.normal_(), .zero_()) comes back from from_pretrained with freshly random weights: clean "
    "loading_info, no warning, fine-tuning starts from scratch",
    why="transformers 5 initialises the whole model after loading and relies on _init_weights writing through its "
    "guarded init functions, which skip loaded tensors; an in-place .data write bypasses them. 5.3 skipped fully "
    "loaded modules for remote code only, 5.13 for every custom class. The shim applies 5.13's check while loading.",
    requires={"transformers": ">=5.0.0,<5.13.0"},
    fixed_in={"transformers": "5.13.0"},
    refs=(
        "https://github.com/huggingface/transformers/issues/46620",
        "https://github.com/huggingface/transformers/pull/46632",
        "https://github.com/huggingface/transformers/blob/v5.13.0/src/transformers/modeling_utils.py",
        "https://github.com/huggingface/transformers/pull/47335",
        "https://github.com/huggingface/transformers/pull/48140",
    ),
    backports=("https://github.com/huggingface/transformers/blob/v5.13.0/src/transformers/modeling_utils.py",),
    follow_ups_checked=FOLLOW_UPS,
    targets=(
        Target("transformers.modeling_utils", "PreTrainedModel._initialize_weights", params=("module",)),
        Target("transformers.modeling_utils", "PreTrainedModel._initialize_missing_keys", params=("is_quantized",)),
    ),
    modules=("transformers.modeling_utils",),
)

# True while _initialize_missing_keys runs for a model whose class is custom code (5.13's is_custom_code()).
_CUSTOM_LOADING: contextvars.ContextVar = contextvars.ContextVar("ftshims_custom_loading", default=False)


def is_custom_code(cls) -> bool:
    """5.13.0's ``PreTrainedModel.is_custom_code``: remote code (``_auto_class`` set) or a class defined outside
    ``transformers``."""
    return getattr(cls, "_auto_class", None) is not None or not cls.__module__.startswith("transformers.")


def fully_loaded(module) -> bool:
    """5.13.0's test: every parameter and buffer the module owns directly carries ``_is_hf_initialized``."""
    return all(getattr(p, "_is_hf_initialized", False) for p in module.parameters(recurse=False)) and all(
        getattr(b, "_is_hf_initialized", False) for b in module.buffers(recurse=False) if b is not None
    )


def _initialize_missing_keys(wrapped, instance, args, kwargs):
    if not is_custom_code(type(instance)):
        return wrapped(*args, **kwargs)
    token = _CUSTOM_LOADING.set(True)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _CUSTOM_LOADING.reset(token)


def _initialize_weights(wrapped, instance, args, kwargs):
    if not _CUSTOM_LOADING.get():
        return wrapped(*args, **kwargs)
    module = args[0] if args else kwargs.get("module")
    if module is None or getattr(module, "_is_hf_initialized", False) or not fully_loaded(module):
        return wrapped(*args, **kwargs)
    module._is_hf_initialized = True  # what 5.13.0 does: marked, its _init_weights not run
    acted(SPEC.id, "fully loaded modules of a custom model kept from _init_weights")
    return None


def install(patcher, options) -> None:
    modeling_utils = sys.modules["transformers.modeling_utils"]
    cls = modeling_utils.PreTrainedModel
    patcher.wrap(cls, "_initialize_missing_keys", _initialize_missing_keys)
    patcher.wrap(cls, "_initialize_weights", _initialize_weights)


# ---------------------------------------------------------------------------
# Reproduction: a custom class whose _init_weights writes in place

def custom_classes(init_marker: float = 0.02):
    """A config and a model class defined outside transformers, with a BERT-era ``_init_weights``."""
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

    class ToyConfig(PretrainedConfig):
        model_type = "ftshims_inplace_init_probe"

        def __init__(self, hidden=8, **kwargs):
            self.hidden = hidden
            super().__init__(**kwargs)

    class ToyModel(PreTrainedModel):
        config_class = ToyConfig
        base_model_prefix = "toy"

        def __init__(self, config):
            super().__init__(config)
            self.encoder = torch.nn.Linear(config.hidden, config.hidden)
            self.head = torch.nn.Linear(config.hidden, config.hidden)
            self.post_init()

        def _init_weights(self, module):
            if isinstance(module, torch.nn.Linear):
                module.weight.data.normal_(0.0, init_marker)
                if module.bias is not None:
                    module.bias.data.zero_()

        def forward(self, x):
            return self.head(self.encoder(x))

    return ToyConfig, ToyModel


def save_and_load(model, cls=None, state_dict=None, **kwargs):
    """``model.save_pretrained`` then ``from_pretrained`` (progress bar off); ``state_dict`` overrides what is saved."""
    import tempfile

    from transformers.utils import logging as hf_logging

    from .. import tiny

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with tiny.quiet(), tempfile.TemporaryDirectory() as path:
            model.save_pretrained(path, state_dict=state_dict)
            return (cls or type(model)).from_pretrained(path, **kwargs)
    finally:
        if bar:
            hf_logging.enable_progress_bar()


def probe() -> Observation:
    """Save a tiny custom model with known weights and load it back: are the weights the saved ones?"""
    import torch

    config_class, model_class = custom_classes()
    torch.manual_seed(0)
    model = model_class(config_class())
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.randn_like(p) + 0.5 * (i + 1))
    loaded = save_and_load(model)
    saved = model.state_dict()
    gap = max(float((loaded.state_dict()[k] - v).abs().max()) for k, v in saved.items())
    detail = (f"max |loaded - saved| = {gap:.4g} over {len(saved)} tensors "
              f"(encoder.weight mean {float(loaded.encoder.weight.detach().mean()):.4f}, "
              f"saved {float(model.encoder.weight.detach().mean()):.4f})")
    return Observation(gap != 0.0, detail)
