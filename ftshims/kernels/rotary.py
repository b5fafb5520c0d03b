"""Rotary position embedding (RoPE) with an fp32 phase and a runtime ``rope_theta``.

    from ftshims.kernels import rotary

    q = rotary.apply_rotary(q, positions, rope_theta=500000.0)                 # [batch, seq, heads, dim]
    q, k = rotary.apply_rotary_qk(q, k, positions, rope_theta=1e4, layout="bhsd")  # GQA: one launch
    q = rotary.apply_rotary(q, cos=cos, sin=sin)                               # cos/sin handed in (HF, flash-attn)
    x = rotary.apply_rotary(x, inv_freq=inv_freq, cu_seqlens=cu, layout="thd") # varlen, per-sequence restart

The angle of pair ``i`` at position ``p`` is ``p * inv_freq[i]``, computed in
fp32 inside the kernel (the product's rounding error is recovered with an fma,
so the phase is that of the exact product), whatever the storage dtype of x
(fp32, fp16, bf16; fp64 is computed in fp64). ``inv_freq`` is either computed
from ``rope_theta`` with transformers' default formula, or passed as an fp32
tensor (scaled variants: take it from :func:`inv_freq_from_config`, which
reuses the installed transformers' rope-init functions). Alternatively cos/sin
are passed in: as a ``[rows, width]`` table indexed by position (flash-attn) or
as ``[batch or 1, seq, width]`` rows, one per token (HF), with ``width`` equal
to ``rotary_dim/2`` (one value per pair) or ``rotary_dim`` (laid out like x:
HF's ``cat(freqs, freqs)``, or ``repeat_interleave`` for the interleaved layout).

Options: half-rotated (Llama/NeoX) or ``interleaved`` (GPT-J, DeepSeek MLA)
pairs; partial ``rotary_dim`` (the rest of the head passes through); explicit
``positions`` per token; ``seqlen_offsets`` (int, or one per batch row /
varlen sequence); varlen ``cu_seqlens`` with positions restarting per
sequence; ``attention_scaling`` (yarn mscale) multiplies the rotated part;
``conjugate`` applies the transposed map (the inverse rotation; for full-width
cos/sin whose halves differ it is exactly the transpose, which is what the
backward needs); ``inplace``. Gradients flow to x (the
backward is the conjugate rotation, by the same kernel).

Backends: ``"cpu"``/``"cuda"`` (the compiled extension, built ahead of time by
setup.py or just-in-time on first use) and ``"reference"`` (pure PyTorch).
``backend=None`` reads ``FTSHIMS_ROTARY_BACKEND`` (default ``"auto"``):
auto uses the compiled kernels for the tensors' device when they load and
falls back to the reference with a logged reason otherwise; a backend named
explicitly that cannot be used raises :class:`BackendUnavailable`.

Invalid input (dtype, shape, device mismatch, odd or too large rotary_dim,
positions or offsets outside a cos/sin table, malformed cu_seqlens) raises
``ValueError`` before any kernel runs.
"""

from __future__ import annotations

import logging
import os
from typing import Dict, Optional, Tuple

from .._util import warn_once
from ..settings import ROTARY_BACKEND_ENV as BACKEND_ENV, ROTARY_BACKENDS as BACKENDS

log = logging.getLogger("ftshims")

LAYOUTS = ("bshd", "bhsd", "sbhd", "thd")

__all__ = [
    "apply_rotary",
    "apply_rotary_qk",
    "default_inv_freq",
    "inv_freq_from_config",
    "resolve_backend",
    "backend_status",
    "load",
    "BackendUnavailable",
    "BACKEND_ENV",
]


class BackendUnavailable(RuntimeError):
    """An explicitly requested rotary backend cannot be used here."""


_WARNED = set()
_INV_FREQ_CACHE: Dict[tuple, object] = {}


def _warn_once(message: str) -> None:
    warn_once(_WARNED, message, lambda: log.warning("%s", message))


# ---------------------------------------------------------------------------
# inv_freq


def default_inv_freq(rotary_dim: int, rope_theta: float, device=None):
    """transformers' default ``inv_freq`` in fp32: ``1 / theta ** (arange(0, dim, 2) / dim)``."""
    import torch

    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary: rotary_dim must be a positive even number, got {rotary_dim}")
    theta = float(rope_theta)
    if not theta > 0.0 or theta != theta or theta == float("inf"):
        raise ValueError(f"rotary: rope_theta must be a finite positive number, got {rope_theta!r}")
    key = (rotary_dim, theta, str(device))
    cached = _INV_FREQ_CACHE.get(key)
    if cached is None:
        exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        cached = (1.0 / (theta ** exponent)).to(device=device)
        if len(_INV_FREQ_CACHE) > 64:
            _INV_FREQ_CACHE.clear()
        _INV_FREQ_CACHE[key] = cached
    return cached


def inv_freq_from_config(config, device=None, seq_len=None) -> Tuple[object, float]:
    """``(inv_freq fp32, attention_scaling)`` for a transformers config, with its rope type.

    Uses the installed transformers' own rope-init functions (``ROPE_INIT_FUNCTIONS``,
    transformers >= 4.45; 5.x ``rope_parameters``); on older versions only the
    default RoPE (``rope_theta``, ``partial_rotary_factor``) is available.
    """
    import torch

    try:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    except ImportError:
        ROPE_INIT_FUNCTIONS = {}
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:  # transformers 5.x
        rope_type = params.get("rope_type", "default")
        theta = params["rope_theta"]
    else:
        scaling = getattr(config, "rope_scaling", None) or {}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        theta = getattr(config, "rope_theta", 10000.0)
    kwargs = {} if seq_len is None else {"seq_len": seq_len}
    if rope_type != "default":
        fn = ROPE_INIT_FUNCTIONS.get(rope_type)
        if fn is None:
            raise NotImplementedError(f"rope type {rope_type!r} needs transformers' rope-init functions (>= 4.45)")
        inv_freq, scaling_factor = fn(config, device, **kwargs)
        return inv_freq.float(), float(scaling_factor)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    factor = (params or {}).get("partial_rotary_factor", None) if isinstance(params, dict) else None
    if factor is None:
        factor = getattr(config, "partial_rotary_factor", 1.0)
    dim = int(head_dim * factor)
    inv_freq = 1.0 / (float(theta) ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return inv_freq.to(device=device), 1.0


# ---------------------------------------------------------------------------
# backends


def _requested(backend: Optional[str]) -> str:
    """The backend asked for: ``backend``, else ``FTSHIMS_ROTARY_BACKEND`` (empty = unset), else ``auto``.

    Checked by the same function as every other ftshims setting (``apply()``
    checks the variable too when a rotary shim is selected).
    """
    from ..settings import check_value
    from ..spec import Choice

    if backend is not None:
        return check_value("rotary: backend", backend, Choice(values=BACKENDS))
    return check_value(f"rotary: {BACKEND_ENV}", os.environ.get(BACKEND_ENV, "").strip() or "auto", Choice(values=BACKENDS))


def resolve_backend(device_type: str = "cpu", backend: Optional[str] = None) -> Tuple[str, Optional[str]]:
    """``(backend used, reason for falling back or None)`` for tensors on ``device_type``."""
    from . import _build

    name = _requested(backend)
    if name == "reference":
        return "reference", None
    if name in ("cpu", "cuda") and name != device_type:
        raise ValueError(f"rotary: backend={name!r} requested for tensors on {device_type}")
    if device_type not in ("cpu", "cuda"):
        if name != "auto":
            raise BackendUnavailable(f"rotary: no compiled kernels for device type {device_type}")
        return "reference", f"no compiled kernels for device type {device_type}"
    loaded = _build.load(jit=True)
    if loaded and (device_type == "cpu" or _build.has_cuda_kernels()):
        return device_type, None
    if loaded:
        reason = "the compiled extension has no CUDA kernels (built without a CUDA toolkit)"
    else:
        reason = f"the compiled extension is unavailable: {_build.status()['reason']}"
    if name != "auto":
        raise BackendUnavailable(f"rotary: backend {name!r} requested but {reason}")
    return "reference", reason


def load(jit: bool = True) -> bool:
    """Load (building just in time if needed) the compiled kernels now; True when they are usable.

    Call it once before ``torch.compile(..., fullgraph=True)`` regions: loading
    takes a lock and may compile, which cannot happen while Dynamo traces.
    Otherwise the first ``apply_rotary`` call loads them.
    """
    from . import _build

    return _build.load(jit=jit)


def backend_status() -> Dict[str, object]:
    """Diagnostics: how the extension was (or was not) loaded."""
    from . import _build

    return _build.status()


# ---------------------------------------------------------------------------
# argument normalisation


def _to_logical(x, layout: str, name: str):
    """A [batch, seq, heads, dim] view of x (no copy)."""
    if layout == "thd":
        if x.dim() != 3:
            raise ValueError(f"rotary: layout 'thd' expects {name} of shape [total, heads, dim], got {tuple(x.shape)}")
        return x.unsqueeze(0)
    if x.dim() != 4:
        raise ValueError(f"rotary: layout {layout!r} expects a 4-D {name}, got shape {tuple(x.shape)}")
    if layout == "bshd":
        return x
    if layout == "bhsd":
        return x.transpose(1, 2)
    return x.transpose(0, 1)  # sbhd


def _from_logical(x, layout: str):
    if layout == "thd":
        return x.squeeze(0)
    if layout == "bshd":
        return x
    if layout == "bhsd":
        return x.transpose(1, 2)
    return x.transpose(0, 1)


_STORAGE = None


def _storage_dtypes():
    global _STORAGE
    if _STORAGE is None:
        import torch

        _STORAGE = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    return _STORAGE


def _index_tensor(t, name: str, device):
    import torch

    if not isinstance(t, torch.Tensor):
        raise ValueError(f"rotary: {name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rotary: {name} must be int32 or int64, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"rotary: {name} is on {t.device} but x is on {device}")
    return t


def _prepare(q, k, positions, rope_theta, inv_freq, cos, sin, rotary_dim, interleaved, layout, cu_seqlens,
             seqlen_offsets, attention_scaling):
    """Validate everything that needs no data read; return the op's arguments."""
    import torch

    if layout not in LAYOUTS:
        raise ValueError(f"rotary: layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if not isinstance(q, torch.Tensor):
        raise ValueError(f"rotary: x must be a tensor, got {type(q).__name__}")
    if q.dtype not in _storage_dtypes():
        raise ValueError(f"rotary: x must be float32, float16, bfloat16 or float64, got {q.dtype}")
    qv = _to_logical(q, layout, "x" if k is None else "q")
    batch, seq, _, head_dim = qv.shape
    kv = None
    if k is not None:
        if not isinstance(k, torch.Tensor):
            raise ValueError(f"rotary: k must be a tensor, got {type(k).__name__}")
        kv = _to_logical(k, layout, "k")
        if k.dtype != q.dtype:
            raise ValueError(f"rotary: k is {k.dtype} but q is {q.dtype}")
        if k.device != q.device:
            raise ValueError(f"rotary: k is on {k.device} but q is on {q.device}")
        if kv.shape[0] != batch or kv.shape[1] != seq or kv.shape[3] != head_dim:
            raise ValueError(f"rotary: k {tuple(k.shape)} does not match q {tuple(q.shape)} in batch, seq and head_dim ({layout})")
    device = q.device

    if rotary_dim is None:
        rotary_dim = head_dim
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int):
        raise ValueError(f"rotary: rotary_dim must be an int, got {rotary_dim!r}")
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary: rotary_dim must be even and in [2, head_dim={head_dim}], got {rotary_dim}")
    scaling = float(attention_scaling)
    if scaling != scaling or scaling in (float("inf"), float("-inf")):
        raise ValueError(f"rotary: attention_scaling must be finite, got {attention_scaling!r}")

    sources = sum(x is not None for x in (rope_theta, inv_freq, cos))
    if (cos is None) != (sin is None):
        raise ValueError("rotary: cos and sin must be given together")
    if sources != 1:
        raise ValueError("rotary: give exactly one angle source: rope_theta, inv_freq, or cos and sin")
    if rope_theta is not None:
        inv_freq = default_inv_freq(rotary_dim, rope_theta, device)
    if inv_freq is not None:
        if not isinstance(inv_freq, torch.Tensor):
            raise ValueError(f"rotary: inv_freq must be a tensor, got {type(inv_freq).__name__}")
        if inv_freq.dtype != torch.float32:
            raise ValueError(
                f"rotary: inv_freq must be float32, got {inv_freq.dtype} (a low-precision inv_freq corrupts the "
                "phase: transformers#25681)"
            )
        if inv_freq.dim() != 1 or inv_freq.shape[0] != rotary_dim // 2:
            raise ValueError(f"rotary: inv_freq must be [rotary_dim/2 = {rotary_dim // 2}], got {tuple(inv_freq.shape)}")
        if inv_freq.device != device:
            raise ValueError(f"rotary: inv_freq is on {inv_freq.device} but x is on {device}")
    else:
        for name, t in (("cos", cos), ("sin", sin)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"rotary: {name} must be a tensor, got {type(t).__name__}")
            if not t.is_floating_point():
                raise ValueError(f"rotary: {name} must be floating point, got {t.dtype}")
            if t.device != device:
                raise ValueError(f"rotary: {name} is on {t.device} but x is on {device}")
        if cos.shape != sin.shape:
            raise ValueError(f"rotary: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ in shape")
        if cos.dtype != sin.dtype:
            raise ValueError(f"rotary: cos is {cos.dtype} but sin is {sin.dtype}")
        if cos.dim() not in (2, 3):
            raise ValueError(
                "rotary: cos/sin must be [rows, width] (indexed by position) or [batch or 1, seq, width] "
                f"(one row per token), got {tuple(cos.shape)}"
            )
        width = cos.shape[-1]
        if width not in (rotary_dim // 2, rotary_dim):
            raise ValueError(f"rotary: cos/sin width must be rotary_dim/2 = {rotary_dim // 2} or rotary_dim = {rotary_dim}, got {width}")
        if cos.dim() == 2 and cos.shape[0] < 1:
            raise ValueError("rotary: the cos/sin table is empty")
        if cos.dim() == 3:
            if cos.shape[0] not in (1, batch) or cos.shape[1] != seq:
                raise ValueError(
                    f"rotary: per-token cos/sin must be [batch or 1, seq, width] with batch={batch}, seq={seq}, got {tuple(cos.shape)}"
                )

    varlen = cu_seqlens is not None
    nseq = 0
    if varlen:
        if layout != "thd":
            raise ValueError("rotary: cu_seqlens needs layout='thd' ([total, heads, dim])")
        _index_tensor(cu_seqlens, "cu_seqlens", device)
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(f"rotary: cu_seqlens must be 1-D with at least 2 entries, got {tuple(cu_seqlens.shape)}")
        nseq = cu_seqlens.shape[0] - 1

    if positions is not None:
        _index_tensor(positions, "positions", device)
        if positions.dim() == 1:
            positions = positions.unsqueeze(0)
        if positions.dim() != 2 or positions.shape[0] not in (1, batch) or positions.shape[1] != seq:
            raise ValueError(f"rotary: positions must be [seq] or [batch, seq] = [{batch}, {seq}], got {tuple(positions.shape)}")

    offset = 0
    offsets = None
    if isinstance(seqlen_offsets, torch.Tensor):
        _index_tensor(seqlen_offsets, "seqlen_offsets", device)
        want = nseq if varlen else batch
        if seqlen_offsets.dim() == 0:
            seqlen_offsets = seqlen_offsets.reshape(1).expand(want)
        if seqlen_offsets.dim() != 1 or seqlen_offsets.shape[0] != want:
            raise ValueError(
                f"rotary: seqlen_offsets must be an int or [{want}] (one per {'sequence' if varlen else 'batch row'}), got {tuple(seqlen_offsets.shape)}"
            )
        offsets = seqlen_offsets
    elif isinstance(seqlen_offsets, bool) or not isinstance(seqlen_offsets, int):
        raise ValueError(f"rotary: seqlen_offsets must be an int or an int tensor, got {seqlen_offsets!r}")
    else:
        offset = seqlen_offsets

    if cos is not None and cos.dim() == 3 and (positions is not None or offsets is not None or offset != 0):
        raise ValueError(
            "rotary: positions/seqlen_offsets do not apply to per-token cos/sin ([batch, seq, width]); "
            "pass a [rows, width] table to index it by position"
        )
    return qv, kv, dict(
        cos=cos, sin=sin, inv_freq=inv_freq, positions=positions, seqlen_offsets=offsets, cu_seqlens=cu_seqlens,
        offset=offset, rotary_dim=rotary_dim, scaling=scaling,
    )


def _run(qv, kv, args, interleaved, conjugate, inplace, backend):
    import torch

    name, reason = resolve_backend(qv.device.type, backend)
    if name != "reference":
        needs_angle_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (args["cos"], args["sin"], args["inv_freq"])
        )
        if needs_angle_grad:
            if backend is not None and _requested(backend) != "auto":
                raise BackendUnavailable("rotary: the compiled kernels give no gradient for cos/sin/inv_freq; use backend='reference'")
            name, reason = "reference", "cos/sin/inv_freq require grad (only the reference differentiates them)"
    if reason:
        _warn_once(f"rotary: using the pure-PyTorch reference: {reason}")
    if name == "reference":
        return _reference.rotary(
            qv, kv, interleaved=interleaved, conjugate=conjugate, inplace=inplace, **args
        )
    op_args = (
        args["cos"], args["sin"], args["inv_freq"], args["positions"], args["seqlen_offsets"], args["cu_seqlens"],
        args["offset"], args["rotary_dim"], interleaved, conjugate, args["scaling"],
    )
    if not inplace:
        outs = torch.ops.ftshims.rotary(qv, kv, *op_args)
        return outs[0], (outs[1] if kv is not None else None)
    needs_grad = torch.is_grad_enabled() and (qv.requires_grad or (kv is not None and kv.requires_grad))
    if needs_grad:
        fn = _ops.INPLACE_FUNCTION  # created when the extension was loaded
        # One Function per tensor: autograd cannot rebase two in-place-modified views from one Function.
        q_res = fn.apply(qv, None, *op_args)
        k_res = fn.apply(kv, None, *op_args) if kv is not None else None
        return q_res, k_res
    torch.ops.ftshims.rotary_(qv, kv, *op_args)
    return qv, kv


def apply_rotary(x, positions=None, **options):
    """Rotate ``x`` (see the module docstring). Returns x's rotated copy, or x itself when ``inplace``.

    x: ``[batch, seq, heads, dim]`` (layout ``"bshd"``), ``[batch, heads, seq, dim]`` (``"bhsd"``),
    ``[seq, batch, heads, dim]`` (``"sbhd"``) or ``[total, heads, dim]`` (``"thd"``, varlen with
    ``cu_seqlens``). positions: int ``[seq]``, ``[batch, seq]`` (``[total]`` for thd) or None
    (the index along seq, or inside each varlen sequence). The keywords are :func:`apply_rotary_qk`'s.
    """
    out, _ = apply_rotary_qk(x, None, positions, **options)
    return out


def apply_rotary_qk(
    q,
    k,
    positions=None,
    *,
    rope_theta: Optional[float] = None,
    inv_freq=None,
    cos=None,
    sin=None,
    rotary_dim: Optional[int] = None,
    interleaved: bool = False,
    layout: str = "bshd",
    cu_seqlens=None,
    seqlen_offsets=0,
    attention_scaling: float = 1.0,
    conjugate: bool = False,
    inplace: bool = False,
    backend: Optional[str] = None,
):
    """Rotate q and k in one launch (they may have different head counts: GQA/MQA). Returns ``(q, k)``;
    ``k`` may be None (:func:`apply_rotary`)."""
    qv, kv, args = _prepare(q, k, positions, rope_theta, inv_freq, cos, sin, rotary_dim, interleaved, layout,
                            cu_seqlens, seqlen_offsets, attention_scaling)
    q_out, k_out = _run(qv, kv, args, interleaved, conjugate, inplace, backend)
    if inplace:
        return q, k
    return _from_logical(q_out, layout), (None if k is None else _from_logical(k_out, layout))


from . import _ops, _reference  # noqa: E402  (cheap: neither imports torch at import time)
