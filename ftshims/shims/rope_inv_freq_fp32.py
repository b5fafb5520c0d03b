"""RoPE loses its phase after ``model.to(torch.bfloat16)``: the non-persistent ``inv_freq`` is cast too.

Why: every transformers RoPE module keeps ``inv_freq`` as a buffer, and
``Module.to(dtype)`` / ``.half()`` / ``.bfloat16()`` cast floating buffers along
with the weights. A bf16 ``inv_freq`` has 8 significant bits, so the phase
``position * inv_freq`` is off by up to ``position * 2**-9`` radians. From
transformers 4.38 the cos/sin are recomputed from ``inv_freq`` on every forward
(in fp32, but from the already-rounded bf16 values), so every position is hit:
max |cos error| for positions below 4096 is ~0.7 with head_dim 128 (4.38–5.24).
Up to 4.37 the cos/sin tables built at init in fp32 survive the cast with only
bf16 rounding, but a sequence longer than the table regrows it from the bf16
``inv_freq`` with bf16 *positions* (cos errors up to 2.0). transformers#25681,
#29496; the fp32 upcast inside ``forward`` (PR #29285) did not help because the
damage is done before it. ``from_pretrained(torch_dtype=...)`` keeps fp32
buffers; only a later cast breaks them.

The fix: every ``*RotaryEmbedding`` class in the imported
``transformers.models.*.modeling_*`` modules gets a wrapped ``_apply`` (the
method ``Module.to`` / ``.half()`` / ``.bfloat16()`` run on every submodule to
cast it) and a wrapped ``forward``. Right after a cast, and at the first
forward of a module cast before ``apply()``, a buffer named ``inv_freq`` (or
``original_inv_freq``, ``<layer_type>_inv_freq``) that was cast to a 16-bit
float is recomputed in fp32 from the model's own rope parameters, with the
installed transformers' functions: ``rope_init_fn(config, device)`` /
``ROPE_INIT_FUNCTIONS[rope_type]`` (4.45+, 5.x ``config.rope_parameters``), else
the module's ``base``/``dim`` (``config.rope_theta``, 4.31–4.44), else the
constructor's default ``base`` (4.30). The recomputed buffer is installed only
if rounding it to the cast dtype reproduces the cast buffer bit for bit, i.e.
it provably is the value the module had before the cast; otherwise the module
is left alone and the reason recorded in the shim's notes. On <= 4.37 a
cos/sin table that was already regrown from the cast buffer is rebuilt at the
next forward (``max_seq_len_cached`` is reset). fp32 and fp64 models are
untouched (the wrappers only compare a dtype). The buffer stays fp32 after the
shim is reverted (a correct value, not a patch).

Under ``torch.compile`` the repair is already done: it happens at cast time,
outside any trace, so the compiled graph reads the fp32 buffer; the forward
check steps aside inside a trace (mutating buffers there would break the graph).

Applies to transformers >= 4.30 (unfixed through 5.24).
"""

from __future__ import annotations

import inspect
import logging
import os
import sys

from .._util import acted, compiling
from ..spec import Observation, ProbeUnsupported, ShimSpec, Target

SPEC = ShimSpec(
    id="rope_inv_freq_fp32",
    since="0.1.0",
    title="RoPE inv_freq cast to bf16/fp16 by model.to(dtype) corrupts cos/sin",
    symptom="after model.to(torch.bfloat16) RoPE cos/sin below position 4096 are off by up to 2.0 (head_dim 128; 4.38+), "
    "or beyond the cached length (<=4.37); bf16 rounding alone would give 2e-3",
    why="model.to(bfloat16) casts RoPE's inv_freq buffer, and from 4.38 cos/sin are recomputed from it on every forward: phases lose precision at every position (max |cos error| ~0.7 below 4096 with head_dim 128). The shim recomputes inv_freq in fp32 when the module is cast.",
    requires={"transformers": ">=4.30"},
    fixed_in={},
    refs=(
        "https://github.com/huggingface/transformers/issues/25681",
        "https://github.com/huggingface/transformers/issues/29496",
        "https://github.com/huggingface/transformers/pull/29285",
    ),
    targets=(
        Target("transformers.models.llama.modeling_llama", "LlamaRotaryEmbedding.forward"),
        Target("transformers.models.mistral.modeling_mistral", "MistralRotaryEmbedding.forward", when=">=4.34"),
        Target("transformers.models.qwen2.modeling_qwen2", "Qwen2RotaryEmbedding.forward", when=">=4.37"),
    ),
    modules=("transformers.modeling_utils",),
)

log = logging.getLogger("ftshims")

THRESHOLD = 1e-2  # max |cos/sin error|: bf16 rounding of cos is <= 2**-9; the bug is >= 0.1


def modeling_modules():
    """Names of transformers' PyTorch modeling modules, read from the installed package's folders."""
    import importlib.util

    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return []
    names = []
    for root in spec.submodule_search_locations:
        models = os.path.join(root, "models")
        if not os.path.isdir(models):
            continue
        for model in sorted(os.listdir(models)):
            folder = os.path.join(models, model)
            if not os.path.isdir(folder):
                continue
            for filename in sorted(os.listdir(folder)):
                if filename.startswith("modeling_") and filename.endswith(".py") and not filename.startswith(
                    ("modeling_tf_", "modeling_flax_")
                ):
                    names.append(f"transformers.models.{model}.{filename[:-3]}")
    return names


def _is_inv_freq(name: str) -> bool:
    return name == "inv_freq" or name.endswith("_inv_freq")


def _layer_type(module, name: str):
    """The layer type of a per-layer-type buffer (``sliding_attention_inv_freq``), or None."""
    stem = name[: -len("inv_freq")].rstrip("_")
    if stem.endswith("original"):
        stem = stem[: -len("original")].rstrip("_")
    return stem or None


def _call_init_fn(fn, config, device, layer_type, extra):
    params = inspect.signature(fn).parameters
    kwargs = dict(extra or {})
    if layer_type is not None:
        if "layer_type" not in params:
            return None
        kwargs["layer_type"] = layer_type
    if "device" in params:
        kwargs["device"] = device
    out = fn(config, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _candidates(module, name: str, device):
    """fp32 inv_freq candidates, most specific first, each from the installed transformers' own code."""
    import torch

    layer_type = _layer_type(module, name)
    config = getattr(module, "config", None)
    rope_type = getattr(module, "rope_type", None)
    if isinstance(rope_type, dict):
        rope_type = rope_type.get(layer_type)
    fns = []
    own = getattr(module, "rope_init_fn", None)  # 4.45 .. 4.57
    if callable(own):
        fns.append((own, getattr(module, "rope_kwargs", None)))
    if rope_type in (None, "default") and callable(getattr(module, "compute_default_rope_parameters", None)):
        fns.append((module.compute_default_rope_parameters, None))  # 5.x
    rope_utils = sys.modules.get("transformers.modeling_rope_utils")
    table = getattr(rope_utils, "ROPE_INIT_FUNCTIONS", {}) if rope_utils else {}
    if rope_type in table:
        fns.append((table[rope_type], getattr(module, "rope_kwargs", None)))
    for fn, extra in fns:
        if config is None and not extra:
            continue
        try:
            inv = _call_init_fn(fn, config, device, layer_type, extra)
        except Exception as exc:  # a rope-init function that does not take this config: try the next source
            log.debug("rope_inv_freq_fp32: %s(...) failed: %s", getattr(fn, "__name__", fn), exc)
            continue
        if inv is not None:
            yield inv
    base, dim = getattr(module, "base", None), getattr(module, "dim", None)
    if isinstance(base, (int, float)) and isinstance(dim, int) and dim > 0:  # 4.31 .. 4.44
        yield 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    try:  # 4.30: base is only the constructor's default
        default = inspect.signature(type(module).__init__).parameters.get("base")
    except (TypeError, ValueError):
        default = None
    current = module._buffers.get(name)
    if default is not None and isinstance(default.default, (int, float)) and current is not None:
        dim = 2 * current.numel()
        yield 1.0 / (default.default ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))


def restore_fp32_inv_freq(module) -> list:
    """Recompute every cast ``*inv_freq`` buffer of ``module`` in fp32; returns what could not be restored."""
    import torch

    problems = []
    restored = False
    for name, buf in list(module._buffers.items()):
        if buf is None or not _is_inv_freq(name) or buf.dtype not in (torch.bfloat16, torch.float16):
            continue
        if buf.device.type == "meta":
            continue
        fixed = None
        for candidate in _candidates(module, name, buf.device):
            candidate = candidate.to(device=buf.device, dtype=torch.float32)
            if candidate.shape == buf.shape and torch.equal(candidate.to(buf.dtype), buf):
                fixed = candidate
                break
        if fixed is None:
            problems.append(f"{type(module).__name__}.{name}: no fp32 source reproduces the {buf.dtype} buffer")
            continue
        module._buffers[name] = fixed
        restored = True
        acted(SPEC.id, "inv_freq buffers recomputed in fp32")
    if restored and "cos_cached" in module._buffers and isinstance(getattr(module, "max_seq_len_cached", None), int):
        # transformers <= 4.37 cache cos/sin tables; one regrown from the cast inv_freq is corrupt.
        # A zero length makes the next forward rebuild it from the restored fp32 inv_freq.
        module.max_seq_len_cached = 0
    return problems


def install(patcher, options) -> None:
    seen_problems = set()

    def repair(module) -> None:
        for problem in restore_fp32_inv_freq(module):
            if problem not in seen_problems:
                seen_problems.add(problem)
                patcher.notes.append(problem)
                # not a warning: a RoPE this shim cannot recompute (2D, per-modality) is left exactly as
                # upstream made it, and status() notes say so
                log.info("rope_inv_freq_fp32: %s; left as is", problem)

    def apply_wrapper(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        if instance is not None and _has_cast_inv_freq(instance):
            repair(instance)
        return result

    def forward_wrapper(wrapped, instance, args, kwargs):
        if not compiling() and instance is not None and _has_cast_inv_freq(instance):
            repair(instance)  # cast before apply() (or by code that bypasses Module._apply)
        return wrapped(*args, **kwargs)

    def install_part(module):
        import torch

        # Classes defined in this module only (imported aliases are patched where they are defined).
        for attr, obj in list(vars(module).items()):
            if not (isinstance(obj, type) and attr.endswith("RotaryEmbedding") and obj.__module__ == module.__name__):
                continue
            if issubclass(obj, torch.nn.Module) and "forward" in vars(obj):
                # _apply is inherited: a rotary class that subclasses another (4.3x's
                # LlamaLinearScalingRotaryEmbedding) already gets its base's wrapped _apply.
                if not any(base.__name__.endswith("RotaryEmbedding") for base in obj.__mro__[1:]):
                    patcher.wrap(obj, "_apply", apply_wrapper)
                patcher.wrap(obj, "forward", forward_wrapper)

    for name in modeling_modules():
        patcher.when_imported(name, install_part)


_HALF = None


def _has_cast_inv_freq(module) -> bool:
    global _HALF
    if _HALF is None:
        import torch

        _HALF = (torch.bfloat16, torch.float16)
    for name, buf in module._buffers.items():
        if buf is not None and buf.dtype in _HALF and _is_inv_freq(name):
            return True
    return False


# ---------------------------------------------------------------------------
# reproduction


def rope_error(model, positions: int = 4096, dtype=None) -> float:
    """Max |cos - cos_ref|, |sin - sin_ref| of the model's RoPE module for positions 0..positions-1 (fp64 reference)."""
    import torch

    rotary = next((m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")), None)
    if rotary is None:
        raise ProbeUnsupported("the model has no RotaryEmbedding module")
    config = model.config
    params = getattr(config, "rope_parameters", None)
    theta = params.get("rope_theta") if isinstance(params, dict) else getattr(config, "rope_theta", 10000.0)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = dtype or next(model.parameters()).dtype
    x = torch.zeros(1, 1, positions, head_dim, dtype=dtype)
    position_ids = torch.arange(positions)[None]
    forward_params = inspect.signature(type(rotary).forward).parameters
    with torch.no_grad():
        if "position_ids" in forward_params:
            cos, sin = rotary(x, position_ids)
        else:
            cos, sin = rotary(x, seq_len=positions)
    cos = cos.reshape(-1, cos.shape[-1])[-positions:].double()
    sin = sin.reshape(-1, sin.shape[-1])[-positions:].double()
    inv = 1.0 / (float(theta) ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    phase = torch.arange(positions, dtype=torch.float64)[:, None] * inv
    phase = torch.cat((phase, phase), dim=-1)
    return max((cos - phase.cos()).abs().max().item(), (sin - phase.sin()).abs().max().item())


def probe(case: str = "within_table", dtype: str = "bfloat16") -> Observation:
    """Tiny Llama (head_dim 128) cast with ``model.to(dtype)``: max cos/sin error for positions 0..4095.

    ``within_table``: max_position_embeddings=4096 (the positions are inside
    the config's range). ``beyond_table``: max_position_embeddings=64 (the
    sequence outgrows it). ``no_cast``: the model stays fp32.
    """
    import torch

    from .. import tiny

    max_pos = {"within_table": 4096, "beyond_table": 64, "no_cast": 4096}.get(case)
    if max_pos is None:
        raise ValueError(f"unknown case {case!r}")
    model = tiny.tiny_llama(
        hidden_size=256, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
        num_hidden_layers=1, max_position_embeddings=max_pos,
    )
    if case != "no_cast":
        model = model.to(getattr(torch, dtype))
    with tiny.quiet():
        error = rope_error(model, 4096)
    where = f"{case}, {dtype if case != 'no_cast' else 'float32'}"
    if error > THRESHOLD:
        return Observation(True, f"max |cos/sin error| {error:.3g} for positions < 4096 ({where})")
    return Observation(False, f"max |cos/sin error| {error:.2e} for positions < 4096 ({where})")
