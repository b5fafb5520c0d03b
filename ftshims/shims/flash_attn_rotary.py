"""flash-attn's rotary API routed to ftshims' kernel: fp32 tables, checked offsets, ``pos_idx_in_fp32`` accepted.

Why (all verified on the released 2.5.8, 2.6.3 and 2.8.3 files, run with
Triton's interpreter):

* a **tensor** ``seqlen_offsets`` that reaches past the cos/sin table gives
  *silently unrotated* rows (the Triton kernel's masked loads return cos=1,
  sin=0); an int offset asserts, a tensor is never checked;
* ``RotaryEmbedding`` caches cos/sin in the input dtype (bf16), and 2.5.8–2.7.4
  even assert ``x.dtype == cos.dtype`` in ``apply_rotary``: the rotation uses
  bf16-rounded cos/sin (flash-attn#823 reports up to 24% relative error);
* flash-attn 2.8 removed ``RotaryEmbedding(pos_idx_in_fp32=...)``, which
  transformers 4.48–4.52 ModernBERT still passes: ``TypeError``
  (transformers#38700, #38912).

What the shim does: the core ``flash_attn.ops.triton.rotary.apply_rotary``
(and its ``from ... import`` copy in ``flash_attn.layers.rotary``) is replaced
by a function with the installed version's exact signature that validates its
arguments (``ValueError`` for offsets outside the table, malformed
``cu_seqlens``, shapes) and calls ``ftshims.kernels.rotary`` (fp32 arithmetic,
cos/sin of any float dtype). Every public API — ``apply_rotary_emb``,
``apply_rotary_emb_func``, ``apply_rotary_emb_qkv_``, ``apply_rotary_emb_kv_``,
``RotaryEmbedding`` — keeps its released code, signature and autograd
Function, and reaches the kernel through that core. ``RotaryEmbedding``'s
cos/sin cache is built in fp32 (``_update_cos_sin_cache`` gets
``dtype=float32``), and on versions without ``pos_idx_in_fp32`` the argument
is accepted (``True`` is what 2.8 always does; ``False``, the legacy bf16
positions, is refused with a warning and ignored).

Applies to flash-attn >= 2.2 (the first sdist with the Triton rotary file),
< 2.9; unfixed upstream as of 2.8.3. Falls back: if ``apply_rotary`` is missing
or its parameters changed, the shim is skipped (target missing).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys

from ..spec import Observation, ProbeUnsupported, ShimSpec, Target

CORE_PARAMS = ("x", "cos", "sin", "seqlen_offsets", "cu_seqlens", "max_seqlen", "interleaved", "inplace", "conjugate")

SPEC = ShimSpec(
    id="flash_attn_rotary",
    title="flash-attn rotary: silent unrotated rows past the table, bf16 cos/sin, pos_idx_in_fp32 TypeError",
    symptom="tensor seqlen_offsets past the cos table leave rows unrotated; bf16 cos/sin; RotaryEmbedding(pos_idx_in_fp32=...) TypeError on 2.8",
    requires={"flash-attn": ">=2.2,<2.9"},
    fixed_in={},
    refs=(
        "https://github.com/Dao-AILab/flash-attention/issues/823",
        "https://github.com/huggingface/transformers/pull/38700",
        "https://github.com/huggingface/transformers/pull/38912",
        "https://github.com/EleutherAI/gpt-neox/pull/1003",
    ),
    targets=(
        Target("flash_attn.ops.triton.rotary", "apply_rotary", params=CORE_PARAMS),
        Target("flash_attn.layers.rotary", "apply_rotary_emb"),
        Target("flash_attn.layers.rotary", "apply_rotary_emb_qkv_"),
        Target("flash_attn.layers.rotary", "apply_rotary_emb_kv_"),
        Target("flash_attn.layers.rotary", "RotaryEmbedding._update_cos_sin_cache"),
    ),
    modules=("flash_attn.ops.triton.rotary",),
)

log = logging.getLogger("ftshims")


def rotary_core(x, cos, sin, seqlen_offsets=0, cu_seqlens=None, max_seqlen=None, interleaved=False, inplace=False, conjugate=False):
    """flash-attn's ``apply_rotary`` contract on ftshims' kernel (arguments checked, ValueError on bad ones)."""
    import torch

    from ..kernels import rotary

    if not isinstance(cos, torch.Tensor) or cos.dim() != 2:
        raise ValueError(f"flash_attn rotary: cos/sin must be (seqlen_ro, rotary_dim / 2), got {getattr(cos, 'shape', cos)}")
    varlen = cu_seqlens is not None
    if varlen and max_seqlen is None:
        raise ValueError("flash_attn rotary: if cu_seqlens is passed in, then max_seqlen must be passed")
    if isinstance(seqlen_offsets, torch.Tensor) and seqlen_offsets.dim() != 1:
        raise ValueError(f"flash_attn rotary: seqlen_offsets must be an int or (batch,), got {tuple(seqlen_offsets.shape)}")
    return rotary.apply_rotary(
        x,
        cos=cos,
        sin=sin,
        rotary_dim=2 * cos.shape[1],
        interleaved=bool(interleaved),
        layout="thd" if varlen else "bshd",
        cu_seqlens=cu_seqlens,
        seqlen_offsets=seqlen_offsets,
        conjugate=bool(conjugate),
        inplace=bool(inplace),
    )


def make_core_wrapper(original):
    signature = inspect.signature(original)

    def wrapper(wrapped, instance, args, kwargs):
        bound = signature.bind(*args, **kwargs)  # the installed version's own signature and defaults
        bound.apply_defaults()
        call = {name: bound.arguments[name] for name in CORE_PARAMS if name in bound.arguments}
        return rotary_core(**call)

    return wrapper


def _fp32_cache(wrapped, instance, args, kwargs):
    import torch

    params = ("seqlen", "device", "dtype")
    bound = dict(zip(params, args))
    bound.update(kwargs)
    bound["dtype"] = torch.float32
    return wrapped(**bound)


def _accept_pos_idx_in_fp32(wrapped, instance, args, kwargs):
    value = kwargs.pop("pos_idx_in_fp32", True)
    if not value:
        log.warning(
            "ftshims: flash_attn RotaryEmbedding(pos_idx_in_fp32=False) is not supported by this flash-attn "
            "(positions are always fp32 since 2.8); ignored"
        )
    wrapped(*args, **kwargs)
    if instance is not None:
        instance.pos_idx_in_fp32 = True


def install(patcher, options) -> None:
    from ..patching import require_params, resolve

    ops = sys.modules["flash_attn.ops.triton.rotary"]
    owner, attr = resolve(ops, "apply_rotary")
    original = getattr(owner, attr)
    require_params(original, CORE_PARAMS, "flash_attn.ops.triton.rotary.apply_rotary")
    wrapper = make_core_wrapper(original)
    patcher.wrap(ops, "apply_rotary", wrapper)

    def layers_part(layers):
        from ..spec import TargetMissing

        patcher.wrap_aliases(original, wrapper, packages=("flash_attn",))
        cls = vars(layers).get("RotaryEmbedding")
        if cls is None or "_update_cos_sin_cache" not in vars(cls):
            raise TargetMissing("flash_attn.layers.rotary.RotaryEmbedding._update_cos_sin_cache not found")
        require_params(cls._update_cos_sin_cache, ("seqlen", "device", "dtype"), "RotaryEmbedding._update_cos_sin_cache")
        patcher.wrap(cls, "_update_cos_sin_cache", _fp32_cache)
        if "pos_idx_in_fp32" not in inspect.signature(cls.__init__).parameters:
            patcher.wrap(cls, "__init__", _accept_pos_idx_in_fp32)


    # flash_attn.layers.rotary imports the ops module at its top: when that import is what
    # triggered this install, the layers module is still executing (its classes do not exist yet).
    patcher.when_imported("flash_attn.layers.rotary", layers_part)


# ---------------------------------------------------------------------------
# probe


@contextlib.contextmanager
def cpu_triton():
    """flash-attn launches inside ``torch.cuda.device(x.device.index)``, which fails for CPU tensors
    (index None); under Triton's interpreter on CPU that context must be a no-op."""
    import torch

    original = torch.cuda.device
    torch.cuda.device = lambda index: contextlib.nullcontext() if index is None else original(index)
    try:
        yield
    finally:
        torch.cuda.device = original


def _device():
    import os

    import torch

    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise ProbeUnsupported("flash-attn's Triton kernels need a GPU or TRITON_INTERPRET=1")
    return "cpu"


def _ulp_errors(out, ref, x):
    """|out - ref| in bf16 ulps of max(|ref|, |x| / 16) (a floor against cancellation near zero)."""
    import torch

    floor = x.double().abs().amax(dim=-1, keepdim=True) / 16
    mag = torch.maximum(ref.abs(), floor)
    ulp = torch.pow(2.0, torch.floor(torch.log2(mag)) - 7)
    return ((out.double() - ref).abs() / ulp).max().item()


def probe(case: str = "offset_past_table") -> Observation:
    """Reproductions on the installed flash-attn's own rotary code.

    ``offset_past_table``: a tensor ``seqlen_offsets`` reaching past the
    table must raise, not return unrotated rows. ``pos_idx_in_fp32``:
    ``RotaryEmbedding(..., pos_idx_in_fp32=True)`` must construct.
    ``bf16_table``: ``RotaryEmbedding`` on bf16 qkv at positions ~4000 must be
    as accurate as fp32 cos/sin allow (<= 0.75 bf16 ulp from the fp64 result).
    ``parity``: ``apply_rotary_emb`` on valid input matches the fp64 reference.
    """
    import torch

    device = _device()
    ctx = cpu_triton() if device == "cpu" else contextlib.nullcontext()
    from flash_attn.layers import rotary as fa  # noqa: F401  (imports flash_attn.ops.triton.rotary)

    from ..kernels import rotary as ours

    gen = torch.Generator().manual_seed(0)
    with ctx:
        if case == "offset_past_table":
            x = torch.randn(2, 4, 2, 16, generator=gen).to(device)
            inv = ours.default_inv_freq(16, 10000.0)
            phase = torch.arange(6, dtype=torch.float32)[:, None] * inv
            cos, sin = phase.cos().to(device), phase.sin().to(device)
            offsets = torch.tensor([0, 5], dtype=torch.int32, device=device)  # row 1 needs positions 5..8 of 6
            try:
                out = fa.apply_rotary_emb(x, cos, sin, seqlen_offsets=offsets)
            except (ValueError, AssertionError) as exc:
                return Observation(False, f"rejected: {type(exc).__name__}: {exc}")
            unrotated = torch.equal(out[1, 1:], x[1, 1:])
            return Observation(True, f"no error; rows past the table {'returned unrotated' if unrotated else 'wrong'}")
        if case == "pos_idx_in_fp32":
            try:
                emb = fa.RotaryEmbedding(16, pos_idx_in_fp32=True, device=device)
            except TypeError as exc:
                return Observation(True, f"TypeError: {exc}")
            return Observation(False, f"constructed {type(emb).__name__}(pos_idx_in_fp32=True)")
        if case == "bf16_table":
            dim, start, seqlen = 64, 4000, 8
            emb = fa.RotaryEmbedding(dim, base=10000.0, device=device)
            qkv = torch.randn(2, seqlen, 3, 2, dim, generator=gen).to(device=device, dtype=torch.bfloat16)
            x = qkv.clone()
            out = emb(qkv, seqlen_offset=start)
            inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
            pos = torch.arange(start, start + seqlen, dtype=torch.float64)
            ref_cos, ref_sin = (pos[:, None] * inv).cos(), (pos[:, None] * inv).sin()
            ref = ours.apply_rotary(
                x[:, :, 0].double().cpu(), cos=ref_cos, sin=ref_sin, positions=torch.arange(seqlen), backend="reference"
            )
            err = _ulp_errors(out[:, :, 0].cpu(), ref, x[:, :, 0].cpu())
            table = getattr(emb, "_cos_cached", None)
            detail = f"max error {err:.2f} bf16 ulp (cos/sin cache {getattr(table, 'dtype', None)})"
            return Observation(err > 0.75, detail)
        if case == "parity":
            x = torch.randn(2, 6, 3, 32, generator=gen).to(device)
            inv = ours.default_inv_freq(24, 10000.0)
            phase = torch.arange(16, dtype=torch.float32)[:, None] * inv
            cos, sin = phase.cos().to(device), phase.sin().to(device)
            out = fa.apply_rotary_emb(x, cos, sin, seqlen_offsets=3)
            ref = ours.apply_rotary(x.double().cpu(), cos=cos.double().cpu(), sin=sin.double().cpu(), rotary_dim=24,
                                    seqlen_offsets=3, backend="reference")
            err = (out.double().cpu() - ref).abs().max().item()
            return Observation(err > 1e-5, f"max |error| {err:.2e} vs fp64")
    raise ValueError(f"unknown case {case!r}")
