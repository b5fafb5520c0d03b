"""``from_pretrained`` leaves a model's non-persistent buffers uninitialised unless its ``_init_weights`` rebuilds them.

Why: since 5.0 ``from_pretrained`` builds the model on the meta device, so the values a class computes in
``__init__`` for its non-persistent buffers (``register_buffer(..., persistent=False)``: RoPE ``inv_freq``, scale
and position tables) are never computed. ``PreTrainedModel._move_missing_keys_from_meta_to_device`` then gives
every non-persistent buffer a ``torch.empty_like`` placeholder (uninitialised memory: zeros, or garbage such as
3e-41 and 1e+33), and only ``_init_weights`` writes real values. transformers' own classes rebuild their buffers
there (PR #42309 and the model-specific fixes after it); a custom class (your own, or remote code) that computes
a buffer in ``__init__``, as any PyTorch module may and as 4.57 supported, loads with garbage in it. Nothing warns,
``loading_info`` is clean, and fine-tuning runs on a corrupted model. 4.57 built models with real buffers
(parameters only on meta) and kept them. transformers#48892 (open); PR #48932 was closed: maintainers want model
code to rebuild buffers in ``_init_weights``. 5.0.0 to 5.25.0 (read) have the same two methods.

The fix: the shim wraps ``_move_missing_keys_from_meta_to_device`` to note each non-persistent buffer's placeholder
right after it is created (the tensor and its in-place version counter), and ``_initialize_missing_keys`` to look
at them once initialisation is done. A placeholder that is still the model's buffer and that no in-place write
touched (same tensor, same ``_version``: ``_init_weights`` writes through ``copy_``/``fill_``, which bump it) still
holds uninitialised memory. Only for those the shim computes what ``__init__`` computes: it builds a second
instance of the same class from the model's config (a deep copy), with its parameters on the meta device
(accelerate's ``init_empty_weights(include_buffers=False)``, as 4.57's loading did), under the dtype the model was
built with (``config.dtype``), with the random-number state saved and restored, and copies each such buffer's
value into the placeholder when its shape and dtype match. Buffers that ``_init_weights`` set, every parameter,
and every model without such a placeholder are untouched (transformers' own classes: no second instance is
built); the shim only ever writes memory nobody initialised.

Applies to transformers >=5.0.0, unfixed in every release read (5.0.0, 5.5.4, 5.9.0, 5.16.1, 5.24.0, 5.25.0).
It stays out, leaving the placeholder as upstream does and saying why in the shim's notes, when it cannot build
the second instance (a class that needs more constructor arguments than its config: the error is noted), when
accelerate is not installed, or when a buffer's shape or dtype differs in the second instance. Under DeepSpeed
ZeRO-3 transformers builds real buffers and creates no placeholder, so there is nothing to do.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref

from .._util import acted
from ..spec import Observation, ShimSpec, Target

log = logging.getLogger("ftshims")

SPEC = ShimSpec(
    id="nonpersistent_buffers_uninitialized",
    since="0.2.0",
    title="from_pretrained leaves the non-persistent buffers of a model whose _init_weights does not rebuild them "
    "uninitialised (custom and remote-code classes)",
    symptom="a custom PreTrainedModel that computes a non-persistent buffer in __init__ (a RoPE inv_freq, a scale "
    "or position table) loads from from_pretrained with uninitialised memory in it (zeros, or values like 3e-41 and "
    "1e+33): wrong outputs and a corrupted fine-tune, no warning, clean loading_info",
    why="transformers 5 builds models on the meta device and replaces non-persistent buffers with torch.empty_like "
    "placeholders that only _init_weights fills; a class that computes them in __init__ (fine in PyTorch and in "
    "transformers 4.57) keeps uninitialised memory. The shim fills exactly the placeholders nothing wrote, with the "
    "values the class's __init__ computes.",
    requires={"transformers": ">=5.0.0"},
    fixed_in={},
    refs=(
        "https://github.com/huggingface/transformers/issues/48892",
        "https://github.com/huggingface/transformers/pull/48932",
        "https://github.com/huggingface/transformers/pull/42309",
    ),
    targets=(
        Target("transformers.modeling_utils", "PreTrainedModel._move_missing_keys_from_meta_to_device",
               params=("missing_keys",)),
        Target("transformers.modeling_utils", "PreTrainedModel._initialize_missing_keys", params=("is_quantized",)),
    ),
    modules=("transformers.modeling_utils",),
)

# model -> {buffer name: (placeholder tensor, its _version when created)}, from the move to the initialisation.
_PLACEHOLDERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
_NOTES: list = []  # the installed patcher's notes (status()), bound by install()


def _note(message: str) -> None:
    if message not in _NOTES:
        _NOTES.append(message)
        log.info("%s: %s", SPEC.id, message)


def _move(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    try:
        placeholders = {name: (buffer, buffer._version) for name, buffer in instance.named_non_persistent_buffers()}
    except Exception:  # noqa: BLE001 - a model that cannot list them: nothing noted, nothing changed later
        return result
    with _LOCK:
        _PLACEHOLDERS[instance] = placeholders
    return result


def untouched(model, placeholders) -> list:
    """The names of the buffers that still hold their placeholder, never written in place."""
    names = []
    for name, (placeholder, version) in placeholders.items():
        try:
            current = model.get_buffer(name)
        except AttributeError:
            continue
        if current is placeholder and current._version == version and current.device.type != "meta":
            names.append(name)
    return names


def _construction_dtype(model):
    import torch

    dtype = getattr(getattr(model, "config", None), "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.get_default_dtype()


def reference_buffers(model, names):
    """The values ``type(model)(config)`` computes for ``names``, built with parameters on meta; raises when it
    cannot be built."""
    import copy

    import torch
    from accelerate import init_empty_weights

    previous = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]), init_empty_weights(include_buffers=False):
        torch.set_default_dtype(_construction_dtype(model))
        try:
            reference = type(model)(copy.deepcopy(model.config))
        finally:
            torch.set_default_dtype(previous)
    return {name: reference.get_buffer(name) for name in names}


def _initialize(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    with _LOCK:
        placeholders = _PLACEHOLDERS.pop(instance, None)
    if not placeholders:
        return result
    names = untouched(instance, placeholders)
    if not names:
        return result
    cls = type(instance).__name__
    try:
        import accelerate  # noqa: F401 - init_empty_weights
    except ImportError:
        _note(f"{cls}: {len(names)} non-persistent buffer(s) left uninitialised (accelerate is not installed)")
        return result
    try:
        values = reference_buffers(instance, names)
    except Exception as exc:  # noqa: BLE001 - a class that needs more than its config: left as upstream leaves it
        _note(f"{cls}: {len(names)} non-persistent buffer(s) left uninitialised: {cls}(config) failed "
              f"({type(exc).__name__}: {exc})")
        return result
    import torch

    filled = 0
    with torch.no_grad():
        for name in names:
            buffer, value = instance.get_buffer(name), values[name]
            if value.shape != buffer.shape or value.dtype != buffer.dtype or value.device.type == "meta":
                _note(f"{cls}.{name} left uninitialised: {cls}(config) gives {tuple(value.shape)} {value.dtype}, "
                      f"the model has {tuple(buffer.shape)} {buffer.dtype}")
                continue
            buffer.copy_(value)
            filled += 1
    if filled:
        acted(SPEC.id, "uninitialised non-persistent buffers filled", filled)
        log.info("%s: %s: %d non-persistent buffer(s) held uninitialised memory after loading; filled with the values "
                 "%s.__init__ computes", SPEC.id, cls, filled, cls)
    return result


def install(patcher, options) -> None:
    global _NOTES
    modeling_utils = sys.modules["transformers.modeling_utils"]
    _NOTES = patcher.notes
    cls = modeling_utils.PreTrainedModel
    patcher.wrap(cls, "_move_missing_keys_from_meta_to_device", _move)
    patcher.wrap(cls, "_initialize_missing_keys", _initialize)


# ---------------------------------------------------------------------------
# Reproduction: a custom class with a non-persistent buffer computed in __init__

def custom_classes():
    """A config and a model class defined outside transformers, as a user or remote code would."""
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

    class ScaleConfig(PretrainedConfig):
        model_type = "ftshims_scale_probe"

        def __init__(self, hidden=8, **kwargs):
            self.hidden = hidden
            super().__init__(**kwargs)

    class ScaleModel(PreTrainedModel):
        config_class = ScaleConfig
        base_model_prefix = "probe"

        def __init__(self, config):
            super().__init__(config)
            self.linear = torch.nn.Linear(config.hidden, config.hidden)
            # computed in __init__, not saved: what RoPE inv_freq and position tables do
            self.register_buffer("scale", torch.arange(1, config.hidden + 1, dtype=torch.float32) / 10,
                                 persistent=False)
            self.post_init()

        def forward(self, x):
            return self.linear(x) * self.scale

    return ScaleConfig, ScaleModel


def probe() -> Observation:
    """Save a tiny custom model and load it back: is its non-persistent buffer what __init__ computed?"""
    import tempfile

    import torch

    from .. import tiny

    from transformers.utils import logging as hf_logging

    config_class, model_class = custom_classes()
    torch.manual_seed(0)
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # 5.x shows one while loading weights
    try:
        with tiny.quiet():
            model = model_class(config_class())
            with tempfile.TemporaryDirectory() as path:
                model.save_pretrained(path)
                loaded = model_class.from_pretrained(path)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    expected = model.scale
    detail = (f"non-persistent buffer after from_pretrained: {[float(f'{v:.3g}') for v in loaded.scale[:4].tolist()]} "
              f"(__init__ computes {[round(v, 3) for v in expected[:4].tolist()]})")
    return Observation(not torch.equal(loaded.scale, expected), detail)
