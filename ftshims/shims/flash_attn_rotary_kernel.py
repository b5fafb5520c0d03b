"""Opt-in speed: flash-attn's rotary core (``flash_attn.ops.triton.rotary.apply_rotary``) routed to ftshims' kernel.

Why: flash-attn's Triton rotary kernel is JIT-compiled by Triton on first use
per configuration and needs a GPU; ftshims' kernel (``ftshims.kernels.rotary``)
is a C++/CUDA extension (built ahead of time by ``pip install
--no-build-isolation .``, or JIT-built on first use) that also runs on CPU, is
registered with ``torch.library`` for ``torch.compile``, computes in fp32
whatever the storage dtype, and accepts cos/sin of any float dtype (fp32
tables with bf16 x on every version). Results match flash-attn's kernel within
the dtype's rounding: both compute in fp32 and round once.

What is replaced: ``apply_rotary`` and every module-level copy of it
(``flash_attn.layers.rotary``'s, transformers' ModernBERT's, a user script's,
and copies wrapped by ``flash_attn_rotary``) by a function with the installed
version's exact signature that validates its arguments (``ValueError`` for
offsets outside the table, malformed ``cu_seqlens``, shapes) and calls
``ftshims.kernels.rotary``. Every public API (``apply_rotary_emb``,
``apply_rotary_emb_func``, ``apply_rotary_emb_qkv_``, ``apply_rotary_emb_kv_``,
``RotaryEmbedding``) keeps its released code, signature and autograd Function,
and reaches the kernel through that core. The bug fixes (fp32 cos/sin cache,
tables grown for tensor offsets, ``pos_idx_in_fp32`` on 2.8) are the default
``flash_attn_rotary`` shim's, which ``ftshims.apply(include=[...])`` applies
alongside; this shim does not repeat them.

Applies to flash-attn >= 2.2 (the first sdist with the Triton rotary file),
< 2.9; kind "speed": only with ``ftshims.apply(include=["flash_attn_rotary_kernel"])``.
Falls back: if ``apply_rotary`` is missing or its parameters changed, the shim
is skipped (target missing); the kernel itself falls back to its pure-PyTorch
``reference`` backend, with a logged reason, where the extension cannot load.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys

from ..settings import ROTARY_BACKEND_ENV as BACKEND_ENV, ROTARY_BACKENDS as BACKENDS
from .._util import acted
from ..spec import SPEED, Choice, Observation, ShimSpec, Target, TargetMissing
from .flash_attn_rotary import CORE_PARAMS, _device, cpu_triton, wrap_copies

SPEC = ShimSpec(
    id="flash_attn_rotary_kernel",
    since="0.1.0",
    unpinned="flash-attn cannot be installed without CUDA, so no pinned stack has it: its released rotary files "
    "(2.5.8, 2.6.3, 2.8.3) run under Triton's CPU interpreter in the rotary_flash session instead (nox -s rotary_flash)",
    title="flash-attn's rotary core on ftshims' compiled rotary kernel",
    symptom="flash-attn's Triton rotary kernel: GPU only, Triton JIT per configuration",
    why="Speed opt-in: flash-attn's Triton rotary core routed to ftshims' compiled rotary kernel, which also runs on CPU, computes in fp32 and is registered for torch.compile.",
    requires={"flash-attn": ">=2.2,<2.9"},
    fixed_in={},
    refs=(
        "https://github.com/Dao-AILab/flash-attention/blob/main/flash_attn/ops/triton/rotary.py",
        "https://github.com/Dao-AILab/flash-attention/issues/823",
    ),
    targets=(Target("flash_attn.ops.triton.rotary", "apply_rotary", params=CORE_PARAMS),),
    modules=("flash_attn.ops.triton.rotary",),
    kind=SPEED,
    # Not an option: the kernel reads FTSHIMS_ROTARY_BACKEND at each call; apply() checks it up front.
    choices={"backend": Choice(values=BACKENDS, env=BACKEND_ENV)},
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
        backend=None,  # FTSHIMS_ROTARY_BACKEND decides ("reference" never loads the extension)
    )


def _core_wrapper(wrapped, instance, args, kwargs):
    acted(SPEC.id, "rotations on ftshims' kernel")
    return rotary_core(*args, **kwargs)  # same parameters, order and defaults as the released function (checked at install)


def install(patcher, options) -> None:
    from ..patching import require_params, resolve

    ops = sys.modules["flash_attn.ops.triton.rotary"]
    owner, attr = resolve(ops, "apply_rotary")
    original = inspect.unwrap(getattr(owner, attr))
    require_params(original, CORE_PARAMS, "flash_attn.ops.triton.rotary.apply_rotary")
    released = [(p.name, p.default) for p in inspect.signature(original).parameters.values()]
    ours = [(p.name, p.default) for p in inspect.signature(rotary_core).parameters.values()]
    if released != ours:
        raise TargetMissing(f"flash_attn.ops.triton.rotary.apply_rotary: signature changed: {inspect.signature(original)}")
    installed = set()
    wrap_copies(patcher, original, _core_wrapper, installed)
    # flash_attn.layers.rotary may still be executing its imports (see flash_attn_rotary.install).
    patcher.when_imported("flash_attn.layers.rotary", lambda layers: wrap_copies(patcher, original, _core_wrapper, installed))


# ---------------------------------------------------------------------------
# probe: the same results as flash-attn's own kernel (a difference is the bug; none is expected)


# One ulp of the output's largest magnitude: both kernels compute in fp32 and round once, but Triton's CPU
# interpreter truncates its bf16/fp16 stores where ftshims' kernel (and a GPU) rounds to nearest.
TOLERANCE = {"float32": 2e-6, "bfloat16": 2**-7, "float16": 2**-10}


def probe(case: str = "bshd", dtype: str = "float32") -> Observation:
    """flash-attn's public rotary APIs against flash-attn's released kernel, on the same input.

    The released kernel is called as ``inspect.unwrap(ops.apply_rotary)``,
    whatever is installed. ``bshd``: ``apply_rotary_emb`` forward and backward
    with tensor offsets, half-rotated, partial rotary dim. ``interleaved``:
    the same, interleaved, int offset, in place. ``varlen``: packed sequences
    with ``cu_seqlens`` and tensor offsets. ``qkv``: ``apply_rotary_emb_qkv_``
    and ``apply_rotary_emb_kv_`` forward and backward. A relative difference
    above one ulp of ``dtype`` (relative to the largest output) is the "bug".
    """
    import torch

    device = _device()
    ctx = cpu_triton() if device == "cpu" else contextlib.nullcontext()
    from flash_attn.layers import rotary as fa
    from flash_attn.ops.triton import rotary as ops

    released_core = inspect.unwrap(ops.apply_rotary)
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(1)

    def table(rows, rotary_dim):
        inv = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        phase = torch.arange(rows, dtype=torch.float32)[:, None] * inv
        return phase.cos().to(device, dt), phase.sin().to(device, dt)

    def released(x, cos, sin, conjugate=False, **kw):
        return released_core(x.clone(), cos, sin, conjugate=conjugate, **kw)

    outs, refs = [], []
    with ctx:
        if case in ("bshd", "interleaved"):
            interleaved = case == "interleaved"
            rotary_dim = 32 if interleaved else 24
            cos, sin = table(24, rotary_dim)
            x = torch.randn(2, 7, 3, 32, generator=gen).to(device, dt).requires_grad_()
            offsets = 5 if interleaved else torch.tensor([3, 11], dtype=torch.int32, device=device)
            kw = dict(seqlen_offsets=offsets, interleaved=interleaved)
            out = fa.apply_rotary_emb(x.detach().clone() if interleaved else x, cos, sin, inplace=interleaved, **kw)
            outs.append(out)
            refs.append(released(x.detach(), cos, sin, **kw))
            if not interleaved:
                g = torch.randn(out.shape, generator=gen).to(device, dt)
                (grad,) = torch.autograd.grad(out, x, g)
                outs.append(grad)
                refs.append(released(g, cos, sin, conjugate=True, **kw))
        elif case == "varlen":
            cos, sin = table(20, 16)
            cu = torch.tensor([0, 3, 3, 9], dtype=torch.int32, device=device)
            x = torch.randn(9, 2, 32, generator=gen).to(device, dt)
            offsets = torch.tensor([0, 4, 7], dtype=torch.int32, device=device)
            kw = dict(seqlen_offsets=offsets, cu_seqlens=cu, max_seqlen=6)
            outs.append(fa.apply_rotary_emb(x, cos, sin, **kw))
            refs.append(released(x, cos, sin, **kw))
        elif case == "qkv":
            cos, sin = table(12, 16)
            qkv = torch.randn(2, 5, 3, 2, 16, generator=gen).to(device, dt)
            kv = torch.randn(2, 5, 2, 2, 16, generator=gen).to(device, dt)
            q_ref = released(qkv[:, :, 0], cos, sin, seqlen_offsets=2)
            k_ref = released(qkv[:, :, 1], cos, sin, seqlen_offsets=2)
            outs.append(fa.apply_rotary_emb_qkv_(qkv.clone(), cos, sin, seqlen_offsets=2))
            refs.append(torch.stack([q_ref, k_ref, qkv[:, :, 2]], dim=2))
            outs.append(fa.apply_rotary_emb_kv_(kv.clone(), cos, sin, seqlen_offsets=2))
            refs.append(torch.stack([released(kv[:, :, 0], cos, sin, seqlen_offsets=2), kv[:, :, 1]], dim=2))
        else:
            raise ValueError(f"unknown case {case!r}")
    worst = 0.0
    for got, ref in zip(outs, refs):
        scale = max(ref.detach().abs().max().item(), 1e-30)
        worst = max(worst, (got.detach().double() - ref.double()).abs().max().item() / scale)
    return Observation(worst > TOLERANCE[dtype], f"max difference {worst:.2e} x max|out| from flash-attn's kernel ({dtype})")
