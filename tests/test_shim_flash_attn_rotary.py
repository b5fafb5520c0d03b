"""The flash_attn_rotary shim against the *released* flash-attn rotary files (2.5.8, 2.6.3, 2.8.3).

The files come from the pinned sdists, fetched at install time by
``tools/fetch_flash_attn_sources.py`` into ``$FTSHIMS_FLASH_ATTN_SOURCES`` (or
``~/.cache/ftshims/flash-attn-sources``); their Triton kernels run on CPU with
Triton's interpreter. When ``FTSHIMS_FLASH_ATTN_SOURCES`` is set (CI), missing
sources or a missing ``triton`` FAIL these tests; without it they skip.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from pathlib import Path

import pytest
from shimcheck import assert_bug_and_fix

torch = pytest.importorskip("torch")

SHIM = "flash_attn_rotary"
VERSIONS = ("2.5.8", "2.6.3", "2.8.3")
ENV = "FTSHIMS_FLASH_ATTN_SOURCES"
REQUIRED = bool(os.environ.get(ENV))


def _missing(reason):
    if REQUIRED:
        pytest.fail(f"{reason} ({ENV} is set, so the flash-attn tests must run)")
    pytest.skip(reason)


def _sources() -> Path:
    env = os.environ.get(ENV)
    return Path(env) if env else Path.home() / ".cache" / "ftshims" / "flash-attn-sources"


def _purge():
    for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
        del sys.modules[name]


@pytest.fixture(params=VERSIONS, scope="module")
def fa_version(request):
    version = request.param
    root = _sources() / f"flash_attn-{version}"
    if not (root / "SOURCE.json").is_file():
        _missing(f"flash-attn {version} sources not found in {root}; run tools/fetch_flash_attn_sources.py")
    try:
        import triton  # noqa: F401
    except ImportError:
        _missing("triton is not installed (needed to run flash-attn's kernels with TRITON_INTERPRET=1)")
    import ftshims

    ftshims.revert()
    old_env = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # read when triton.jit decorates the kernels at import
    _purge()
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    from importlib import metadata

    assert metadata.version("flash-attn") == version
    importlib.import_module("flash_attn.layers.rotary")
    try:
        yield version
    finally:
        ftshims.revert()
        _purge()
        sys.path.remove(str(root))
        importlib.invalidate_caches()
        if old_env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old_env


def _fa():
    return sys.modules["flash_attn.layers.rotary"], sys.modules["flash_attn.ops.triton.rotary"]


def _is_28(version):
    return version.startswith("2.8")


# ---------------------------------------------------------------------------
# the bugs (negative control: the released code, then the shim)


def test_offset_past_table(evidence, fa_version):
    assert_bug_and_fix(SHIM, evidence, f"{fa_version}/offset_past_table", expect_bug=True, case="offset_past_table")


def test_pos_idx_in_fp32(evidence, fa_version):
    assert_bug_and_fix(SHIM, evidence, f"{fa_version}/pos_idx_in_fp32", expect_bug=_is_28(fa_version), case="pos_idx_in_fp32")


def test_bf16_table(evidence, fa_version):
    assert_bug_and_fix(SHIM, evidence, f"{fa_version}/bf16_table", expect_bug=True, case="bf16_table")


def test_parity_probe(evidence, fa_version):
    assert_bug_and_fix(SHIM, evidence, f"{fa_version}/parity", expect_bug=False, case="parity")


# ---------------------------------------------------------------------------
# parity with the released Triton kernel, argument by argument


def _tables(rows, rotary_dim, dtype, gen):
    inv = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    phase = torch.arange(rows, dtype=torch.float32)[:, None] * inv
    return phase.cos().to(dtype), phase.sin().to(dtype)


CASES = [
    # (dtype, interleaved, rotary_dim, varlen, offsets, inplace, conjugate)
    (torch.float32, False, 32, False, 0, False, False),
    (torch.float32, True, 32, False, 3, False, True),
    (torch.float32, False, 16, False, "tensor", True, False),
    (torch.float32, True, 24, True, "tensor", False, False),
    (torch.float32, False, 32, True, 0, True, True),
    (torch.bfloat16, False, 32, False, "tensor", False, False),
    (torch.float16, True, 16, True, 2, False, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v).replace("torch.", "") for v in c))
def test_core_parity_with_released_triton(fa_version, case):
    import ftshims
    from ftshims.shims.flash_attn_rotary import cpu_triton

    dtype, interleaved, rotary_dim, varlen, offsets, inplace, conjugate = case
    layers, ops = _fa()
    gen = torch.Generator().manual_seed(hash(case) % 1000)
    cos, sin = _tables(24, rotary_dim, dtype, gen)  # 2.5.8/2.6.3 want cos in x's dtype
    kw = dict(interleaved=interleaved, inplace=inplace, conjugate=conjugate)
    if varlen:
        cu = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
        x = torch.randn(8, 3, 32, generator=gen).to(dtype)
        kw.update(cu_seqlens=cu, max_seqlen=5)
        nseq = 3
    else:
        x = torch.randn(2, 6, 3, 32, generator=gen).to(dtype)
        nseq = 2
    if offsets == "tensor":
        kw["seqlen_offsets"] = torch.randint(0, 10, (nseq,), generator=gen, dtype=torch.int32)
    else:
        kw["seqlen_offsets"] = offsets
    with cpu_triton():
        released = ops.apply_rotary(x.clone(), cos, sin, **kw)
        with ftshims.applied(only=[SHIM]):
            assert ops.apply_rotary is not inspect.unwrap(ops.apply_rotary)  # patched
            ours = ops.apply_rotary(x.clone(), cos, sin, **kw)
    tol = {torch.float32: 2e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -9}[dtype]
    assert torch.allclose(ours.float(), released.float(), atol=tol * 4, rtol=tol), (ours - released).abs().max()


def test_public_apis_route_through_kernel_with_grad(fa_version):
    import ftshims
    from ftshims.kernels import rotary as kernel
    from ftshims.shims.flash_attn_rotary import cpu_triton

    layers, _ = _fa()
    gen = torch.Generator().manual_seed(5)
    cos, sin = _tables(16, 16, torch.float32, gen)
    x = torch.randn(2, 5, 2, 16, generator=gen, requires_grad=True)
    qkv = torch.randn(2, 5, 3, 2, 16, generator=gen)
    kv = torch.randn(2, 5, 2, 2, 16, generator=gen)
    calls = []
    original = kernel.apply_rotary

    def spy(*args, **kwargs):
        calls.append(kwargs.get("layout"))
        return original(*args, **kwargs)

    with cpu_triton():
        ref_out = layers.apply_rotary_emb(x, cos, sin, seqlen_offsets=2)
        (ref_grad,) = torch.autograd.grad(ref_out.sum(), x)
        ref_qkv = layers.apply_rotary_emb_qkv_(qkv.clone(), cos, sin)
        ref_kv = layers.apply_rotary_emb_kv_(kv.clone(), cos, sin)
        with ftshims.applied(only=[SHIM]):
            kernel.apply_rotary = spy
            try:
                out = layers.apply_rotary_emb(x, cos, sin, seqlen_offsets=2)
                (grad,) = torch.autograd.grad(out.sum(), x)
                out_func = layers.apply_rotary_emb_func(x, cos, sin, seqlen_offsets=2)
                got_qkv = layers.apply_rotary_emb_qkv_(qkv.clone(), cos, sin)
                got_kv = layers.apply_rotary_emb_kv_(kv.clone(), cos, sin)
            finally:
                kernel.apply_rotary = original
    assert len(calls) >= 5
    for got, ref in ((out, ref_out), (grad, ref_grad), (out_func, ref_out), (got_qkv, ref_qkv), (got_kv, ref_kv)):
        assert torch.allclose(got, ref, atol=2e-6), (got - ref).abs().max()


def test_signatures_are_the_released_ones(fa_version):
    import ftshims

    layers, ops = _fa()
    names = ["apply_rotary_emb", "apply_rotary_emb_qkv_", "apply_rotary_emb_kv_"]
    before = {n: inspect.signature(getattr(layers, n)) for n in names}
    core = inspect.signature(ops.apply_rotary)
    with ftshims.applied(only=[SHIM]) as report:
        assert report[SHIM].status == "applied", report[SHIM].reason
        assert inspect.signature(ops.apply_rotary) == core
        assert inspect.signature(layers.apply_rotary) == core
        for n in names:
            assert inspect.signature(getattr(layers, n)) == before[n]
        assert ("num_heads_q" in inspect.signature(layers.apply_rotary_emb_qkv_).parameters) == _is_28(fa_version)
    assert inspect.unwrap(ops.apply_rotary) is ops.apply_rotary  # reverted to the released function


def test_rotary_embedding_fp32_cache_and_error(fa_version):
    import ftshims
    from ftshims.shims.flash_attn_rotary import cpu_triton

    layers, _ = _fa()
    with cpu_triton(), ftshims.applied(only=[SHIM]):
        emb = layers.RotaryEmbedding(32, base=10000.0, interleaved=True)
        qkv = torch.randn(1, 4, 3, 2, 32).bfloat16()
        emb(qkv, seqlen_offset=10)
        assert emb._cos_cached.dtype == torch.float32
        # the tensor-offset path now checks the table
        emb_k = layers.RotaryEmbedding(32)
        emb_k(torch.randn(2, 4, 3, 2, 32), max_seqlen=6)
        with pytest.raises(ValueError, match="outside the cos/sin table"):
            emb_k(torch.randn(2, 4, 3, 2, 32), seqlen_offset=torch.tensor([0, 3]), max_seqlen=6)


def test_applied_before_flash_attn_is_imported():
    """ftshims.apply() first, then `import flash_attn.layers.rotary` (which imports the ops module at its top)."""
    import subprocess

    root = _sources() / "flash_attn-2.8.3"
    if not (root / "SOURCE.json").is_file():
        _missing(f"flash-attn 2.8.3 sources not found in {root}")
    code = (
        "import ftshims; ftshims.apply(only=['flash_attn_rotary']);"
        "import torch; from flash_attn.layers import rotary as fa;"
        "emb = fa.RotaryEmbedding(16, pos_idx_in_fp32=True);"
        "emb(torch.randn(1, 4, 3, 2, 16).bfloat16());"
        "print('STATUS', ftshims.status()['flash_attn_rotary'].status, emb._cos_cached.dtype)"
    )
    repo = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), repo]), TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "STATUS applied torch.float32" in out.stdout, out.stdout
