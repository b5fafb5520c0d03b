"""Exercise every CUDA rotary kernel variant once, small, for `compute-sanitizer --tool memcheck`.

Variants: storage dtype (fp32, fp16, bf16, fp64) x layout (half, interleaved) x
vectorised / scalar path (aligned contiguous rows vs misaligned or strided) x
angle source (inv_freq, cos table in x's dtype and in fp32, per-token cos) x
q only / q+k, plus varlen with empty sequences, offsets, in place, partial dims,
and the backward, and rotary_dim/2 above the shared-memory slice of 1024 pairs
(two passes per token; values checked against the CPU kernel). Shapes are odd
on purpose so block tails are exercised.
Prints "SANITIZE <n> launches" at the end.
"""

from __future__ import annotations

import itertools

import torch

from ftshims.kernels import _build, rotary


def main(dev: str = "cuda") -> None:
    assert _build.load(jit=True) and (dev == "cpu" or _build.has_cuda_kernels()), _build.status()
    gen = torch.Generator().manual_seed(0)
    launches = 0
    for dtype, inter, path, source, with_k in itertools.product(
        (torch.float32, torch.float16, torch.bfloat16, torch.float64), (False, True), ("vector", "misaligned", "strided"),
        ("theta", "table_same", "table_fp32", "token"), (False, True),
    ):
        b, s, h, hk, d = 2, 7, 3, 2, 64
        base = torch.randn(b, s, h, d + 2, generator=gen).to(dev, dtype)
        if path == "vector":
            q = base[..., :d].contiguous()
        elif path == "misaligned":
            q = base[..., 1:d + 1]
        else:  # dim stride 2
            q = torch.randn(b, s, h, 2 * d, generator=gen).to(dev, dtype)[..., ::2]
        dd = q.shape[-1]
        k = torch.randn(b, s, hk, dd, generator=gen).to(dev, dtype) if with_k else None
        kw = dict(rotary_dim=dd - 2 if dd > 4 else dd, interleaved=inter)
        rd = kw["rotary_dim"]
        if source == "theta":
            kw.update(rope_theta=1e4, positions=torch.randint(0, 100, (b, s), generator=gen).to(dev))
        elif source.startswith("table"):
            cdt = dtype if source == "table_same" else torch.float32
            kw.update(cos=torch.randn(40, rd // 2, generator=gen).to(dev, cdt), sin=torch.randn(40, rd // 2, generator=gen).to(dev, cdt),
                      seqlen_offsets=torch.randint(0, 30, (b,), generator=gen).to(dev))
        else:
            kw.update(cos=torch.randn(1, s, rd, generator=gen).to(dev, dtype), sin=torch.randn(1, s, rd, generator=gen).to(dev, dtype))
        if k is None:
            rotary.apply_rotary(q, backend=dev, **kw)
            rotary.apply_rotary(q.clone(), backend=dev, inplace=True, **kw)
        else:
            rotary.apply_rotary_qk(q, k, backend=dev, **kw)
            rotary.apply_rotary_qk(q.clone(), k.clone(), backend=dev, inplace=True, **kw)
        launches += 2
    # varlen with empty sequences, tensor offsets, table bounds at the edge
    cu = torch.tensor([0, 5, 5, 12, 13], dtype=torch.int32, device=dev)
    x = torch.randn(13, 4, 128, generator=gen).to(dev, torch.bfloat16)
    tab_c, tab_s = torch.randn(16, 64, generator=gen).to(dev), torch.randn(16, 64, generator=gen).to(dev)
    rotary.apply_rotary(x, layout="thd", cu_seqlens=cu, cos=tab_c, sin=tab_s, seqlen_offsets=torch.tensor([11, 0, 8, 15], device=dev))
    rotary.apply_rotary(x, layout="thd", cu_seqlens=cu, rope_theta=1e4, seqlen_offsets=3, interleaved=True)
    launches += 2
    # backward
    q = torch.randn(2, 9, 4, 128, generator=gen).to(dev, torch.bfloat16).requires_grad_()
    k = torch.randn(2, 9, 1, 128, generator=gen).to(dev, torch.bfloat16).requires_grad_()
    oq, ok = rotary.apply_rotary_qk(q, k, rope_theta=5e5, layout="bshd")
    (oq.float().sum() + ok.float().sum()).backward()
    launches += 2
    # large enough for many blocks and the grid-stride loop
    big = torch.randn(3, 1031, 8, 128, generator=gen).to(dev, torch.bfloat16)
    rotary.apply_rotary(big, rope_theta=1e4)
    launches += 1
    # rotary_dim/2 above the kernel's shared-memory slice (1024 pairs): two passes per token, vector and scalar
    # paths; the values are checked against the CPU kernel too
    for dtype, half in ((torch.bfloat16, 1104), (torch.float32, 1100), (torch.float64, 1030)):
        x = torch.randn(2, 3, 2, 2 * half + 2, generator=gen, dtype=torch.float64).to(dtype)
        pos = torch.randint(0, 5000, (2, 3), generator=gen)
        cos = torch.randn(5000, half, generator=gen).to(dtype)
        sin = torch.randn(5000, half, generator=gen).to(dtype)
        for kw in (dict(rope_theta=1e4), dict(cos=cos, sin=sin)):
            for inter in (False, True):
                want = rotary.apply_rotary(x, pos, rotary_dim=2 * half, interleaved=inter, backend="cpu", **kw)
                kw_dev = {n: (v.to(dev) if isinstance(v, torch.Tensor) else v) for n, v in kw.items()}
                got = rotary.apply_rotary(x.to(dev), pos.to(dev), rotary_dim=2 * half, interleaved=inter, backend=dev, **kw_dev)
                tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
                assert torch.allclose(got.cpu().double(), want.double(), rtol=tol, atol=tol), (dtype, half, inter, kw.keys())
                launches += 1
    if dev == "cuda":
        torch.cuda.synchronize()
    print(f"SANITIZE {launches} launches")


if __name__ == "__main__":
    import sys

    main(sys.argv[1] if len(sys.argv) > 1 else "cuda")  # "cpu": a dry run of the same calls
