"""Pure-PyTorch rotary embedding: the fallback backend and the test oracle.

Same contract as the compiled op ``ftshims::rotary`` (see csrc/rotary.cpp): q
and k are logical ``[batch, seq, heads, dim]`` views (varlen: ``[1, total,
heads, dim]`` with ``cu_seqlens``). Angles from ``inv_freq`` are computed in
fp64 and rounded once to the compute dtype; the rotation runs in
``compute_dtype`` (fp32, or fp64 for fp64 data; the oracle passes fp64).
Differentiable with respect to x and cos/sin through ordinary autograd.
"""

from __future__ import annotations

from typing import Optional, Tuple


def _seq_ids(cu_seqlens, total: int):
    import torch

    tokens = torch.arange(total, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].long(), tokens, right=True)


def check_cu_seqlens(cu_seqlens, total: int) -> None:
    cu = cu_seqlens.long()
    first, last = int(cu[0]), int(cu[-1])
    if first != 0 or last != total:
        raise ValueError(f"rotary: cu_seqlens must start at 0 and end at total={total}, got {first} ... {last}")
    if cu.numel() > 2 and int((cu[1:] - cu[:-1]).min()) < 0:
        raise ValueError("rotary: cu_seqlens must be non-decreasing")


def positions_of(batch: int, seq: int, device, positions=None, seqlen_offsets=None, cu_seqlens=None, offset: int = 0):
    """int64 ``[batch or 1, seq]`` positions of every token, as the kernel computes them."""
    import torch

    if cu_seqlens is not None:
        seq_id = _seq_ids(cu_seqlens, seq)
        if positions is not None:
            pos = positions.long().reshape(seq)
        else:
            pos = torch.arange(seq, device=device) - cu_seqlens.long()[seq_id]
        if seqlen_offsets is not None:
            pos = pos + seqlen_offsets.long()[seq_id]
        return (pos + offset).view(1, seq)
    pos = positions.long() if positions is not None else torch.arange(seq, device=device).view(1, seq)
    if seqlen_offsets is not None:
        pos = pos + seqlen_offsets.long().view(-1, 1)
    return pos + offset


def angles(batch: int, seq: int, device, rotary_dim: int, interleaved: bool, compute_dtype, *, cos=None, sin=None,
           inv_freq=None, positions=None, seqlen_offsets=None, cu_seqlens=None, offset: int = 0,
           conjugate: bool = False, scaling: float = 1.0):
    """``(c0, s0, c1, s1)``, each ``[batch or 1, seq, 1, rotary_dim/2]`` in ``compute_dtype``."""
    import torch

    half = rotary_dim // 2
    if inv_freq is not None:
        pos = positions_of(batch, seq, device, positions, seqlen_offsets, cu_seqlens, offset)
        phase = pos.to(torch.float64)[..., None] * inv_freq.to(torch.float64)
        c = torch.cos(phase).to(compute_dtype)
        s = torch.sin(phase).to(compute_dtype)
        c0 = c1 = c
        s0 = s1 = s
    else:
        if cos.dim() == 2:
            pos = positions_of(batch, seq, device, positions, seqlen_offsets, cu_seqlens, offset)
            if pos.numel():
                lo, hi = int(pos.min()), int(pos.max())
                if lo < 0 or hi >= cos.shape[0]:
                    raise ValueError(
                        f"rotary: positions {lo}..{hi} (after seqlen_offsets) fall outside the cos/sin table of {cos.shape[0]} rows"
                    )
            cos_rows, sin_rows = cos[pos], sin[pos]
        else:
            cos_rows, sin_rows = cos, sin
        cos_rows = cos_rows.to(compute_dtype)
        sin_rows = sin_rows.to(compute_dtype)
        if cos_rows.shape[-1] == rotary_dim:  # full width, laid out like x
            if interleaved:
                c0, c1 = cos_rows[..., 0::2], cos_rows[..., 1::2]
                s0, s1 = sin_rows[..., 0::2], sin_rows[..., 1::2]
            else:
                c0, c1 = cos_rows[..., :half], cos_rows[..., half:]
                s0, s1 = sin_rows[..., :half], sin_rows[..., half:]
        else:
            c0 = c1 = cos_rows
            s0 = s1 = sin_rows
    if scaling != 1.0:
        c0, c1, s0, s1 = c0 * scaling, c1 * scaling, s0 * scaling, s1 * scaling
    if conjugate:  # the transposed map; the inverse rotation when s0 == s1
        s0, s1 = -s1, -s0
    return tuple(t.unsqueeze(-2) for t in (c0, s0, c1, s1))


def rotate(x, c0, s0, c1, s1, rotary_dim: int, interleaved: bool, compute_dtype, inplace: bool = False):
    import torch

    half = rotary_dim // 2
    xr = x[..., :rotary_dim].to(compute_dtype)
    if interleaved:
        x0, x1 = xr[..., 0::2], xr[..., 1::2]
    else:
        x0, x1 = xr[..., :half], xr[..., half:]
    o0 = x0 * c0 - x1 * s0
    o1 = x1 * c1 + x0 * s1
    if interleaved:
        rotated = torch.stack((o0, o1), dim=-1).flatten(-2)
    else:
        rotated = torch.cat((o0, o1), dim=-1)
    if inplace:
        x[..., :rotary_dim].copy_(rotated)
        return x
    if rotary_dim == x.shape[-1]:
        return rotated.to(x.dtype)
    return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)


def rotary(q, k=None, *, rotary_dim: Optional[int] = None, interleaved: bool = False, inplace: bool = False,
           compute_dtype=None, **table) -> Tuple:
    """Rotate q (and k); returns ``(q_out, k_out or None)``. Value checks raise ValueError.

    ``table``: where the angles come from and how they are read, :func:`angles`' keywords (``cos``/``sin``
    or ``inv_freq``, ``positions``, ``seqlen_offsets``, ``cu_seqlens``, ``offset``, ``conjugate``, ``scaling``).
    """
    import torch

    batch, seq, _, head_dim = q.shape
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    if compute_dtype is None:
        compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if table.get("cu_seqlens") is not None:
        check_cu_seqlens(table["cu_seqlens"], seq)
    c0, s0, c1, s1 = angles(batch, seq, q.device, rotary_dim, interleaved, compute_dtype, **table)
    q_out = rotate(q, c0, s0, c1, s1, rotary_dim, interleaved, compute_dtype, inplace)
    k_out = None if k is None else rotate(k, c0, s0, c1, s1, rotary_dim, interleaved, compute_dtype, inplace)
    return q_out, k_out
