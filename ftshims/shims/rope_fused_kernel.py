"""Opt-in speed: transformers' ``apply_rotary_pos_emb`` replaced by ftshims' fused q+k rotary kernel.

Why: HF's eager RoPE (``q * cos + rotate_half(q) * sin``, twice) materialises
about six full-size temporaries per call and computes in the storage dtype. The
fused kernel (``ftshims.kernels.rotary``) reads q and k once, rotates both in
one launch with fp32 arithmetic, and writes them once: on a 2-core CPU it is
several times faster for a Llama-8B layer (see bench/rotary.py), on GPUs it is
bandwidth-bound.

What is replaced: the module-level ``apply_rotary_pos_emb`` of every imported
``transformers.models.*.modeling_*`` module whose function *behaves* like one
of transformers' known RoPE variants. The behaviour is checked when the module
is imported, on random fp64 inputs: per-token cos/sin unsqueezed at
``unsqueeze_dim`` (4.38+, 5.x: Llama, Mistral, Qwen2, Qwen3, Gemma, ... about
60 families on 4.57, 120 on 5.24), cos/sin tables gathered at ``position_ids``
(4.34–4.37 ``[seq, dim]``, 4.30–4.35 ``[1, 1, seq, dim]``), with the
half-rotated or the interleaved (Cohere) layout, and whether a narrower cos
means a partial rotary dim (NeoX-style) or an error. A function that matches
none of them (GLM's half-width interleave, multimodal variants) is left alone.

At call time the fused kernel runs only when the call is expressible: 4-D q/k,
cos/sin of q's dtype that need no gradient, the compiled extension available
for the device; anything else (and any argument error) goes to the original
function, so errors and dtype promotion stay transformers' own. Outputs match
the original within the dtype's rounding (the kernel keeps fp32 intermediates
where HF rounds each product to bf16/fp16).

Under ``torch.compile`` the original function is what gets traced: inductor
fuses it into the graph itself, and the kernel's loading and argument checks
are Python-side work that a trace cannot hold. The shim speeds up eager runs.

Applies to transformers >= 4.30, < 5.25; kind "speed": only with
``ftshims.apply(include=["rope_fused_kernel"])``. From 5.25.0 ``apply_rotary_pos_emb``
is no longer a function but a ``kernels`` hub-function module (``use_kernel_func_from_hub``:
an ``nn.Module`` whose ``forward(q, k, cos, sin, unsqueeze_dim=1)`` is the eager code, and which
``kernelize`` swaps for a hub kernel on accelerators): transformers then has a fused-RoPE path of its own,
and replacing the module would take it away. The shim stays out there ("outside its range").
"""

from __future__ import annotations

import inspect
import logging
import threading

from .._util import acted, compiling
from ..settings import ROTARY_BACKEND_ENV as BACKEND_ENV, ROTARY_BACKENDS as BACKENDS
from ..spec import SPEED, Choice, Observation, ShimSpec, Target

SPEC = ShimSpec(
    id="rope_fused_kernel",
    since="0.1.0",
    title="Fused q+k rotary kernel for transformers' apply_rotary_pos_emb",
    symptom="HF eager RoPE is memory-bound on six temporaries per call",
    why="Speed opt-in: HF's eager RoPE materialises about six full-size temporaries per call; the fused kernel rotates q and k in one pass with fp32 arithmetic.",
    requires={"transformers": ">=4.30,<5.25"},
    fixed_in={},
    refs=(
        "https://github.com/huggingface/transformers/issues/25681",
        "https://github.com/linkedin/Liger-Kernel/blob/main/src/liger_kernel/ops/rope.py",
        "https://github.com/Dao-AILab/flash-attention/blob/main/flash_attn/ops/triton/rotary.py",
    ),
    targets=(
        Target("transformers.models.llama.modeling_llama", "apply_rotary_pos_emb"),
        Target("transformers.models.mistral.modeling_mistral", "apply_rotary_pos_emb", when=">=4.34"),
        Target("transformers.models.qwen2.modeling_qwen2", "apply_rotary_pos_emb", when=">=4.37"),
        Target("transformers.models.qwen3.modeling_qwen3", "apply_rotary_pos_emb", when=">=4.51"),
    ),
    modules=("transformers.modeling_utils",),
    kind=SPEED,
    # Not an option: the kernel reads FTSHIMS_ROTARY_BACKEND at each call; apply() checks it up front.
    choices={"backend": Choice(values=BACKENDS, env=BACKEND_ENV)},
)

log = logging.getLogger("ftshims")

# How many calls took the fused path (for tests and the doctor).
STATS = {"fused": 0, "fallback": 0}
_STATS_LOCK = threading.Lock()


_ACTION = {"fused": "rotations on the fused kernel", "fallback": "calls left to transformers' RoPE"}


def _count(key: str) -> None:
    with _STATS_LOCK:
        STATS[key] += 1
    acted(SPEC.id, _ACTION[key])


# ---------------------------------------------------------------------------
# behavioural fingerprint

TOKEN, TABLE, TABLE4D = "token", "table", "table4d"


def _inputs(semantics, layout_dim, width, gen):
    import torch

    b, h, hk, s, d, rows = 2, 3, 1, 5, 8, 7
    if layout_dim == 1:
        q, k = torch.randn(b, h, s, d, generator=gen, dtype=torch.float64), torch.randn(b, hk, s, d, generator=gen, dtype=torch.float64)
    else:
        q, k = torch.randn(b, s, h, d, generator=gen, dtype=torch.float64), torch.randn(b, s, hk, d, generator=gen, dtype=torch.float64)
    if semantics == TOKEN:
        cos, sin = (torch.randn(b, s, width, generator=gen, dtype=torch.float64) for _ in range(2))
        pos = None
    else:
        cos, sin = (torch.randn(rows, width, generator=gen, dtype=torch.float64) for _ in range(2))
        pos = torch.tensor([[0, 1, 2, 3, 4], [2, 3, 4, 5, 6]])
        if semantics == TABLE4D:
            cos, sin = cos[None, None], sin[None, None]
    return q, k, cos, sin, pos


def _call_original(fn, params, semantics, q, k, cos, sin, pos, unsqueeze_dim):
    args = [q, k, cos, sin]
    kwargs = {}
    if semantics == TOKEN:
        if "position_ids" in params and params["position_ids"].default is inspect.Parameter.empty:
            kwargs["position_ids"] = None
    else:
        kwargs["position_ids"] = pos
    if "unsqueeze_dim" in params:
        kwargs["unsqueeze_dim"] = unsqueeze_dim
    elif unsqueeze_dim != 1:
        return None
    return fn(*args, **kwargs)


def _ours(semantics, interleaved, q, k, cos, sin, pos, unsqueeze_dim):
    from ..kernels import rotary

    layout = "bhsd" if unsqueeze_dim == 1 else "bshd"
    if semantics == TABLE4D:
        cos, sin = cos[0, 0], sin[0, 0]
    return rotary.apply_rotary_qk(
        q, k, pos, cos=cos, sin=sin, rotary_dim=cos.shape[-1], interleaved=interleaved, layout=layout, backend="reference"
    )


def _matches(fn, params, semantics, interleaved, unsqueeze_dim, width):
    import torch

    gen = torch.Generator().manual_seed(1234)
    q, k, cos, sin, pos = _inputs(semantics, unsqueeze_dim, width, gen)
    try:
        with torch.no_grad():
            got = _call_original(fn, params, semantics, q, k, cos, sin, pos, unsqueeze_dim)
    except Exception:  # the variant does not accept these inputs: not this semantics
        return False
    if got is None or not isinstance(got, tuple) or len(got) != 2:
        return False
    want = _ours(semantics, interleaved, q, k, cos, sin, pos, unsqueeze_dim)
    return all(
        isinstance(g, torch.Tensor) and g.shape == w.shape and g.dtype == w.dtype and torch.allclose(g, w, atol=1e-12, rtol=0)
        for g, w in zip(got, want)
    )


def fingerprint(fn):
    """``(semantics, interleaved, partial_ok)`` for a function behaving like a known RoPE variant, else None.

    ``semantics`` is the set of input forms it handles like transformers' RoPE
    (4.30's function, for one, accepts both a ``[seq, dim]`` and a ``[1, 1, seq, dim]`` table).
    """
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    names = list(params)
    if names[:4] != ["q", "k", "cos", "sin"]:
        return None
    for interleaved in (False, True):
        semantics = set()
        for form in (TOKEN, TABLE, TABLE4D):
            if not _matches(fn, params, form, interleaved, 1, 8):
                continue
            if "unsqueeze_dim" in params and not _matches(fn, params, form, interleaved, 2, 8):
                continue
            semantics.add(form)
        if semantics:
            form = next(f for f in (TOKEN, TABLE, TABLE4D) if f in semantics)
            partial_ok = _matches(fn, params, form, interleaved, 1, 4)
            return frozenset(semantics), interleaved, partial_ok
    return None


# ---------------------------------------------------------------------------
# the replacement


def _fused(semantics, interleaved, partial_ok, bound):
    """The fused call's result, or None when the call is not expressible (the original runs)."""
    import torch

    from ..kernels import rotary

    q, k, cos, sin = bound.args[:4]
    if not all(isinstance(t, torch.Tensor) for t in (q, k, cos, sin)):
        return None
    if q.dim() != 4 or k.dim() != 4 or q.dtype != k.dtype or not (q.dtype == cos.dtype == sin.dtype):
        return None
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        return None
    if q.device != k.device or cos.device != q.device or sin.device != q.device:
        return None
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        return None
    # None: FTSHIMS_ROTARY_BACKEND decides, as for every other kernel call ("reference" never loads the extension)
    backend, _reason = rotary.resolve_backend(q.device.type, None)
    if backend == "reference":
        return None  # no compiled kernel here (or the reference was asked for): transformers' own code is as good
    form = TOKEN if TOKEN in semantics else (TABLE4D if cos.dim() == 4 else TABLE)
    if form not in semantics:
        return None
    unsqueeze_dim = bound.arguments.get("unsqueeze_dim", 1)
    if not isinstance(unsqueeze_dim, int):
        return None
    if unsqueeze_dim < 0:
        unsqueeze_dim += 4
    if unsqueeze_dim not in (1, 2):
        return None
    layout = "bhsd" if unsqueeze_dim == 1 else "bshd"
    batch, seq, head_dim = q.shape[0], q.shape[3 - unsqueeze_dim], q.shape[3]
    if k.shape[0] != batch or k.shape[3 - unsqueeze_dim] != seq or k.shape[3] != head_dim:
        return None
    positions = None
    if form == TOKEN:
        if cos.dim() != 3 or cos.shape != sin.shape or cos.shape[0] not in (1, batch) or cos.shape[1] not in (1, seq):
            return None
        cos = cos.expand(cos.shape[0], seq, cos.shape[2])
        sin = sin.expand(sin.shape[0], seq, sin.shape[2])
    else:
        if form == TABLE4D:
            if cos.dim() != 4 or cos.shape[:2] != (1, 1) or sin.shape != cos.shape:
                return None
            cos, sin = cos[0, 0], sin[0, 0]
        if cos.dim() != 2 or cos.shape != sin.shape:
            return None
        positions = bound.arguments.get("position_ids")
        if not isinstance(positions, torch.Tensor) or positions.dtype not in (torch.int32, torch.int64):
            return None
        if positions.dim() != 2 or positions.shape[0] not in (1, batch) or positions.shape[1] != seq:
            return None
    width = cos.shape[-1]
    if width != head_dim and not (partial_ok and width < head_dim):
        return None
    try:
        out = rotary.apply_rotary_qk(
            q, k, positions, cos=cos, sin=sin, rotary_dim=width, interleaved=interleaved, layout=layout, backend=backend
        )
    except ValueError:
        return None  # e.g. a position outside the table: transformers raises its own error
    _count("fused")
    return out


def make_wrapper(semantics, interleaved, partial_ok, signature):
    def wrapper(wrapped, instance, args, kwargs):
        if compiling():
            return wrapped(*args, **kwargs)  # inductor fuses transformers' own RoPE in the graph
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return wrapped(*args, **kwargs)
        bound.apply_defaults()
        out = _fused(semantics, interleaved, partial_ok, bound)
        if out is None:
            _count("fallback")
            return wrapped(*args, **kwargs)
        return out

    return wrapper


def install(patcher, options) -> None:
    from .rope_inv_freq_fp32 import modeling_modules

    def install_part(module):
        fn = vars(module).get("apply_rotary_pos_emb")
        if fn is None or not callable(fn):
            return
        found = fingerprint(fn)
        if found is None:
            patcher.notes.append(f"{module.__name__}.apply_rotary_pos_emb: not a known RoPE variant, left alone")
            return
        semantics, interleaved, partial_ok = found
        patcher.wrap(module, "apply_rotary_pos_emb", make_wrapper(semantics, interleaved, partial_ok, inspect.signature(fn)))

    for name in modeling_modules():
        patcher.when_imported(name, install_part)


# ---------------------------------------------------------------------------
# probe: accuracy of a tiny model's logits and gradients against an fp64 twin


def _logits_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach().double(), grads


def probe(case: str = "llama", dtype: str = "float32") -> Observation:
    """Tiny model forward+backward in ``dtype`` vs its fp64 twin: max relative error of logits and gradients.

    A bug is an error beyond the dtype's tolerance (the fused path must not be
    less accurate than transformers' own). ``case`` picks the family
    (``llama``, ``mistral``, ``qwen2``, ``qwen3``).
    """
    import copy

    import torch
    import transformers

    from .. import tiny
    from ..spec import ProbeUnsupported

    config_class = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}[case]
    if not hasattr(transformers, config_class):
        raise ProbeUnsupported(f"transformers has no {config_class}")
    fields = dict(tiny.TINY_LLAMA)
    fields.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    before = STATS["fused"]
    torch.manual_seed(0)
    with tiny.quiet():
        model = tiny.causal_lm(config_class, **fields)
        twin = copy.deepcopy(model).double()
        model = model.to(getattr(torch, dtype))
        batch = tiny.batch(batch_size=2, seq_len=12)
        try:
            ref_logits, ref_grads = _logits_and_grads(twin, batch)
        except RuntimeError as exc:  # 4.35-4.37 cannot build an fp64 attention mask
            raise ProbeUnsupported(f"no fp64 twin on this transformers: {exc}") from exc
        logits, grads = _logits_and_grads(model, batch)
    scale = ref_logits.abs().max().item()
    err = (logits - ref_logits).abs().max().item() / scale
    gerr = max(
        ((grads[n] - g).abs().max() / max(g.abs().max().item(), 1e-30)).item() for n, g in ref_grads.items()
    )
    tol = {"float32": 1e-4, "bfloat16": 0.1, "float16": 0.02}[dtype]
    fused = STATS["fused"] - before
    detail = f"{case} {dtype}: logits rel err {err:.2e}, grads rel err {gerr:.2e} (tol {tol}), fused calls {fused}"
    return Observation(err > tol or gerr > tol, detail)
