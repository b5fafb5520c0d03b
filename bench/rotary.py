#!/usr/bin/env python
"""Rotary embedding benchmark: ftshims' kernel vs HF eager vs Liger vs flash-attn (where importable).

    python bench/rotary.py                      # CPU (reduced long-context batch), bf16 + fp32, fwd and fwd+bwd
    python bench/rotary.py --device cuda        # GPU: also Liger and flash-attn's Triton apply_rotary if importable
    python bench/rotary.py --json out.json --shapes llama8b --dtypes bfloat16
    python bench/rotary.py --shapes llama8b --impls ftshims_cos ftshims_theta --repeats 15 --threads 2

Shapes (q heads 32, kv heads 8, head_dim 128, like one Llama-3-8B layer):
``llama8b`` batch 4 x seq 4096; ``long`` batch 4 x seq 32768 (on CPU batch 1:
a 2-core, 24 GiB box cannot hold HF eager's temporaries at batch 4; the batch
used is printed). q/k are laid out as transformers makes them:
``proj(x).view(b, s, h, d).transpose(1, 2)``; cos/sin are HF's per-token
``[b, s, d]`` tables in the storage dtype.

Implementations (each computes rotated q and k):
* ``hf_eager``: transformers' ``apply_rotary_pos_emb`` (Llama's, or the same
  formula when transformers is absent);
* ``ftshims_cos``: ``ftshims.kernels.rotary.apply_rotary_qk`` with HF's cos/sin;
* ``ftshims_theta``: the same from positions and ``rope_theta`` (angles in-kernel);
* ``ftshims_cos_inplace`` / ``ftshims_theta_inplace``: the same, ``inplace=True`` (forward only): the kernel's
  own memory traffic, without the page faults of a freshly allocated output;
* ``liger``: ``liger_kernel.transformers.rope.liger_rotary_pos_emb`` (CUDA only);
* ``flash_attn``: ``flash_attn.ops.triton.rotary.apply_rotary`` on q and k with
  its ``[s, d/2]`` fp32 table (CUDA only; 2 launches).

Bytes counted (for GB/s): every element of q and k read once and written once,
plus cos and sin as each implementation receives them (HF/Liger/ours-cos:
``[b, s, d]`` x 2; flash-attn: its ``[s, d/2]`` table; theta: positions). The
backward pass counts the same again (grads in, grads out). ``copy`` is a
``dst.copy_(src)`` of the q+k bytes into an existing buffer, timed in the same
loop as every implementation (copy and implementation alternate, repeat after
repeat, so a busy machine slows both alike): ``frac_copy`` is the achieved
bandwidth as a fraction of it (ratio of the minima), for every implementation
and mode; ``paired`` is the median over repeats of the same ratio within each
(copy, implementation) pair, the steadier figure when the load changes. ``clone``
(``src.clone()``: the same copy into freshly allocated memory) is printed as
a row of its own: an out-of-place op pays for its output's first touch, which
bounds its ``frac_copy`` below 1 on CPU. Times are the minimum over repeats
(CPU) or the median of CUDA-event timings (GPU). The machine's load average is
printed before and after (CPU numbers from a shared machine are only as good
as its quiet moments).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ftshims.kernels import rotary  # noqa: E402

SHAPES = {"llama8b": dict(batch=4, seq=4096), "long": dict(batch=4, seq=32768)}
HEADS_Q, HEADS_K, HEAD_DIM, THETA = 32, 8, 128, 500000.0


def hf_apply():
    try:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        return apply_rotary_pos_emb, "transformers"
    except Exception:  # transformers absent or broken: the same formula
        def rotate_half(x):
            x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
            return torch.cat((-x2, x1), dim=-1)

        def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
            cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
            return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)

        return apply_rotary_pos_emb, "local copy of the HF formula"


def hf_call(fn):
    import inspect

    params = inspect.signature(fn).parameters
    if "position_ids" in params and params["position_ids"].default is inspect.Parameter.empty:
        return None  # transformers <= 4.37 takes a table; the benchmark needs the per-token form
    return lambda q, k, cos, sin: fn(q, k, cos, sin)


def make_inputs(batch, seq, dtype, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(batch, seq, HEADS_Q, HEAD_DIM, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype).transpose(1, 2)
    k = torch.randn(batch, seq, HEADS_K, HEAD_DIM, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype).transpose(1, 2)
    positions = torch.arange(seq, device=device)[None].expand(batch, seq)
    inv_freq = rotary.default_inv_freq(HEAD_DIM, THETA, device)
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    table = (torch.arange(seq, device=device, dtype=torch.float32)[:, None] * inv_freq)
    return dict(q=q, k=k, positions=positions, cos=cos, sin=sin, fa_cos=table.cos(), fa_sin=table.sin())


def implementations(device, skip):
    impls = {}
    fn, source = hf_apply()
    call = hf_call(fn)
    if call is not None:
        impls["hf_eager"] = (lambda t: call(t["q"], t["k"], t["cos"], t["sin"]), ("cos",), source)
    impls["ftshims_cos"] = (
        lambda t: rotary.apply_rotary_qk(t["q"], t["k"], cos=t["cos"], sin=t["sin"], layout="bhsd"), ("cos",), "ftshims"
    )
    impls["ftshims_theta"] = (
        lambda t: rotary.apply_rotary_qk(t["q"], t["k"], t["positions"], rope_theta=THETA, layout="bhsd"), ("positions",), "ftshims"
    )
    impls["ftshims_cos_inplace"] = (
        lambda t: rotary.apply_rotary_qk(t["q"], t["k"], cos=t["cos"], sin=t["sin"], layout="bhsd", inplace=True),
        ("cos",), "ftshims",
    )
    impls["ftshims_theta_inplace"] = (
        lambda t: rotary.apply_rotary_qk(t["q"], t["k"], t["positions"], rope_theta=THETA, layout="bhsd", inplace=True),
        ("positions",), "ftshims",
    )
    if device == "cuda":
        try:
            from liger_kernel.transformers.rope import liger_rotary_pos_emb

            impls["liger"] = (lambda t: liger_rotary_pos_emb(t["q"], t["k"], t["cos"], t["sin"]), ("cos",), "liger_kernel")
        except Exception as exc:
            skip["liger"] = f"not importable ({type(exc).__name__})"
        try:
            from flash_attn.ops.triton.rotary import apply_rotary

            def fa(t):
                # flash-attn wants [b, s, h, d]; HF's transposed q is exactly that view
                q = apply_rotary(t["q"].transpose(1, 2), t["fa_cos"].to(t["q"].dtype), t["fa_sin"].to(t["q"].dtype))
                k = apply_rotary(t["k"].transpose(1, 2), t["fa_cos"].to(t["q"].dtype), t["fa_sin"].to(t["q"].dtype))
                return q.transpose(1, 2), k.transpose(1, 2)

            impls["flash_attn"] = (fa, ("fa_table",), "flash_attn")
        except Exception as exc:
            skip["flash_attn"] = f"not importable ({type(exc).__name__})"
    else:
        skip["liger"] = skip["flash_attn"] = "Triton kernels need CUDA"
    return impls


def count_bytes(t, extra, backward):
    elem = t["q"].element_size()
    qk = (t["q"].numel() + t["k"].numel()) * elem * 2  # read + write
    side = 0
    if "cos" in extra:
        side = 2 * t["cos"].numel() * t["cos"].element_size()
    elif "fa_table" in extra:
        side = 2 * t["fa_cos"].numel() * elem
    elif "positions" in extra:
        side = t["positions"].numel() * t["positions"].element_size()
    per_pass = qk + side
    return per_pass * (2 if backward else 1)


def timer(device, fns, repeats, warmup, samples=None):
    """Seconds per call of each of ``fns``, timed alternately in one loop: min over repeats (CPU) or median (GPU).
    ``samples``: a list that receives every repeat's times (one list per function)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times[i].append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times[i].append(time.perf_counter() - t0)
    if samples is not None:
        samples.extend(times)
    return [statistics.median(t) if device == "cuda" else min(t) for t in times]


def load_average():
    try:
        return tuple(round(x, 2) for x in os.getloadavg())
    except (AttributeError, OSError):
        return None


def run(args):
    device = args.device
    results = []
    skip = {}
    if args.threads:
        torch.set_num_threads(args.threads)
    impls = implementations(device, skip)
    if args.impls:
        unknown = sorted(set(args.impls) - set(impls) - set(skip))
        if unknown:
            raise SystemExit(f"unknown --impls {unknown}; available: {sorted(impls)}")
        impls = {name: impl for name, impl in impls.items() if name in args.impls}
    backend, reason = rotary.resolve_backend(device, "auto")
    isa = rotary.backend_status().get("cpu_isa") if backend == "cpu" else None
    load_before = load_average()
    print(f"# device {device} ({torch.cuda.get_device_name() if device == 'cuda' else platform.processor() or platform.machine()}), "
          f"torch {torch.__version__}, threads {torch.get_num_threads()}, ftshims backend {backend}"
          + (f" ({isa})" if isa else "") + (f" (fallback: {reason})" if reason else "")
          + f", repeats {args.repeats}, load average {load_before}")
    for name, why in skip.items():
        print(f"# {name}: skipped, {why}")
    for shape_name in args.shapes:
        shape = dict(SHAPES[shape_name])
        if device == "cpu" and shape_name == "long":
            shape["batch"] = args.cpu_long_batch
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            t = make_inputs(shape["batch"], shape["seq"], dtype, device)
            copy_src = torch.empty((t["q"].numel() + t["k"].numel(),), dtype=dtype, device=device)
            copy_dst = torch.empty_like(copy_src)
            copy = lambda: copy_dst.copy_(copy_src)  # noqa: E731
            copy_bytes = 2 * copy_src.numel() * copy_src.element_size()
            base = dict(shape=shape_name, batch=shape["batch"], seq=shape["seq"], dtype=dtype_name)
            copy_s, clone_s = timer(device, [copy, lambda: copy_src.clone()], args.repeats, args.warmup)
            copy_gbs = copy_bytes / copy_s / 1e9
            for name, seconds in (("copy", copy_s), ("clone", clone_s)):
                gbs = copy_bytes / seconds / 1e9
                results.append(dict(base, mode="fwd", impl=name, ms=seconds * 1e3, gbs=gbs, frac_copy=gbs / copy_gbs,
                                    copy_gbs=copy_gbs))
            for mode in args.modes:
                backward = mode == "fwd+bwd"
                for impl_name, (fn, extra, _source) in impls.items():
                    if backward and impl_name.endswith("_inplace"):
                        continue  # forward only: the in-place op needs non-leaf inputs under autograd
                    if backward:
                        q = t["q"].detach().requires_grad_()
                        k = t["k"].detach().requires_grad_()
                        gq, gk = torch.randn_like(q), torch.randn_like(k)
                        tt = dict(t, q=q, k=k)

                        def step(fn=fn, tt=tt, gq=gq, gk=gk):
                            oq, ok = fn(tt)
                            # the gradients returned, not accumulated into .grad (an extra pass over q and k)
                            torch.autograd.grad((oq, ok), (tt["q"], tt["k"]), (gq, gk))
                    else:
                        def step(fn=fn, t=t):
                            with torch.no_grad():
                                fn(t)
                    try:
                        # the copy again, alternating with this implementation: a ratio from one stretch of time
                        samples = []
                        pair_copy_s, seconds = timer(device, [copy, step], args.repeats, args.warmup, samples)
                    except Exception as exc:  # one implementation failing must not hide the others
                        print(f"# {impl_name} {shape_name} {dtype_name} {mode}: failed: {type(exc).__name__}: {exc}")
                        continue
                    pair_copy_gbs = copy_bytes / pair_copy_s / 1e9
                    nbytes = count_bytes(t, extra, backward)
                    gbs = nbytes / seconds / 1e9
                    # the same ratio from each repeat's pair (copy, implementation run back to back), median over
                    # repeats: less sensitive to a load that changes during the run than the ratio of the minima
                    paired = statistics.median(
                        (nbytes / impl_s) / (copy_bytes / c_s) for c_s, impl_s in zip(samples[0], samples[1])
                    )
                    results.append(dict(
                        base, mode=mode, impl=impl_name, ms=seconds * 1e3, gbs=gbs, frac_copy=gbs / pair_copy_gbs,
                        frac_copy_paired=paired, copy_gbs=pair_copy_gbs,
                    ))
            del t
    by_key = {}
    for r in results:
        by_key.setdefault((r["shape"], r["dtype"], r["mode"]), {})[r["impl"]] = r
    for r in results:
        group = by_key[(r["shape"], r["dtype"], r["mode"])]
        for ref in ("hf_eager", "liger", "flash_attn"):
            if ref in group and r["impl"].startswith("ftshims"):
                r[f"x_vs_{ref}"] = group[ref]["ms"] / r["ms"]
    header = f"{'shape':<8} {'b':>2} {'seq':>6} {'dtype':<9} {'mode':<8} {'impl':<21} {'ms':>9} {'GB/s':>8} {'f_copy':>6} {'paired':>6} {'vs HF':>6} {'vs Liger':>8} {'vs FA':>6}"
    print(header)
    print("-" * len(header))
    for r in results:
        def ratio(key):
            return f"{r[key]:.2f}x" if key in r else ""
        print(f"{r['shape']:<8} {r['batch']:>2} {r['seq']:>6} {r['dtype']:<9} {r['mode']:<8} {r['impl']:<21} "
              f"{r['ms']:>9.3f} {r['gbs']:>8.1f} {r['frac_copy']:>6.2f} {r.get('frac_copy_paired', r['frac_copy']):>6.2f} {ratio('x_vs_hf_eager'):>6} "
              f"{ratio('x_vs_liger'):>8} {ratio('x_vs_flash_attn'):>6}")
    load_after = load_average()
    print(f"# load average before {load_before}, after {load_after}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            device=device, torch=torch.__version__, threads=torch.get_num_threads(), cpu_isa=isa, repeats=args.repeats,
            load_average_before=load_before, load_average_after=load_after, results=results, skipped=skip,
        ), indent=2))
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--cpu-long-batch", type=int, default=1)
    parser.add_argument("--impls", nargs="+", default=None, help="only these implementations (default: all)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 50 if args.device == "cuda" else 7
    if args.warmup is None:
        args.warmup = 10 if args.device == "cuda" else 1
    run(args)


if __name__ == "__main__":
    main()
