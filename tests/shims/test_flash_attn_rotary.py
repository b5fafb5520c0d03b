"""The flash_attn_rotary shim against the *released* flash-attn rotary files (2.5.8, 2.6.3, 2.8.3).

The files come from the pinned sdists, fetched at install time by
``tools/fetch_flash_attn_sources.py`` into ``$FTSHIMS_FLASH_ATTN_SOURCES`` (or
``~/.cache/ftshims/flash-attn-sources``); their Triton kernels run on CPU with
Triton's interpreter. When ``FTSHIMS_FLASH_ATTN_SOURCES`` is set (CI), missing
sources or a missing ``triton`` FAIL these tests; without it they skip.

Each bug has its own scenario (without the shim on the released code, then
with it); everywhere else the shim must be invisible: bit-identical to plain
flash-attn, flash-attn's own kernel doing the work, and ftshims' kernel
package (which may build an extension) never imported.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from pathlib import Path

import pytest
from tests.shimcheck import assert_bug_and_fix

torch = pytest.importorskip("torch")

SHIM = "flash_attn_rotary"
VERSIONS = ("2.5.8", "2.6.3", "2.8.3")
ENV = "FTSHIMS_FLASH_ATTN_SOURCES"
REQUIRED = bool(os.environ.get(ENV))


def missing(reason):
    if REQUIRED:
        pytest.fail(f"{reason} ({ENV} is set, so the flash-attn tests must run)")
    pytest.skip(reason)


def sources() -> Path:
    env = os.environ.get(ENV)
    return Path(env) if env else Path.home() / ".cache" / "ftshims" / "flash-attn-sources"


def released_root(version: str) -> Path:
    """The fetched sdist of one flash-attn version; skips (or fails, with the env var set) without it or Triton."""
    root = sources() / f"flash_attn-{version}"
    if not (root / "SOURCE.json").is_file():
        missing(f"flash-attn {version} sources not found in {root}; run tools/fetch_flash_attn_sources.py")
    try:
        import triton  # noqa: F401
    except ImportError:
        missing("triton is not installed (needed to run flash-attn's kernels with TRITON_INTERPRET=1)")
    return root


def _purge():
    for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
        del sys.modules[name]


@pytest.fixture(params=VERSIONS, scope="module")
def fa_version(request):
    """Makes the released rotary files of one flash-attn version importable as ``flash_attn`` (Triton interpreter)."""
    version = request.param
    root = released_root(version)
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


def fa_modules():
    return sys.modules["flash_attn.layers.rotary"], sys.modules["flash_attn.ops.triton.rotary"]


def _is_28(version):
    return version.startswith("2.8")


@pytest.fixture
def no_ftshims_kernel(monkeypatch):
    """The fix shim must never reach ftshims.kernels (whose first call may JIT-build a C++/CUDA extension)."""
    for name in ("ftshims.kernels", "ftshims.kernels.rotary", "ftshims.kernels._build", "ftshims.kernels._ops"):
        monkeypatch.setitem(sys.modules, name, None)  # any import of them now raises ImportError
    yield


# ---------------------------------------------------------------------------
# the bugs (negative control: the released code, then the shim)


def test_offset_past_table_is_rejected(evidence, fa_version, no_ftshims_kernel):
    # The caller's own table: the rows past it cannot be made up, so the shim raises (guarded).
    assert_bug_and_fix(SHIM, evidence, f"{fa_version}/offset_past_table", expect_bug=True, case="offset_past_table")


def test_offset_past_cache_is_rotated(evidence, fa_version, no_ftshims_kernel):
    # RotaryEmbedding owns its table's recipe: the shim grows it and every row is rotated (fixed).
    outcome = assert_bug_and_fix(SHIM, evidence, f"{fa_version}/offset_past_cache", expect_bug=True, case="offset_past_cache")
    assert "3 of 6 decoded rows unrotated" in outcome.without.detail, outcome.without.detail
    assert "0 of 6 decoded rows unrotated" in outcome.with_shim.detail, outcome.with_shim.detail


def test_bf16_table(evidence, fa_version, no_ftshims_kernel):
    outcome = assert_bug_and_fix(SHIM, evidence, f"{fa_version}/bf16_table", expect_bug=True, case="bf16_table")
    assert "torch.bfloat16" in outcome.without.detail and "torch.float32" in outcome.with_shim.detail


def test_pos_idx_in_fp32(evidence, fa_version, no_ftshims_kernel):
    assert_bug_and_fix(SHIM, evidence, f"{fa_version}/pos_idx_in_fp32", expect_bug=_is_28(fa_version), case="pos_idx_in_fp32")


def test_parity_probe(evidence, fa_version, no_ftshims_kernel):
    assert_bug_and_fix(SHIM, evidence, f"{fa_version}/parity", expect_bug=False, case="parity")


# ---------------------------------------------------------------------------
# everywhere else: flash-attn's own kernel, bit for bit


def _tables(rows, rotary_dim, dtype):
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
    (torch.bfloat16, True, 32, True, "tensor", True, True),
    (torch.float16, True, 16, True, 2, False, False),
]


def _case_inputs(case, seed):
    dtype, interleaved, rotary_dim, varlen, offsets, inplace, conjugate = case
    gen = torch.Generator().manual_seed(seed)
    cos, sin = _tables(24, rotary_dim, dtype)  # cos in x's dtype: what every version accepts
    kw = dict(interleaved=interleaved, inplace=inplace, conjugate=conjugate)
    if varlen:
        x = torch.randn(8, 3, 32, generator=gen).to(dtype)
        kw.update(cu_seqlens=torch.tensor([0, 3, 3, 8], dtype=torch.int32), max_seqlen=5)
        nseq = 3
    else:
        x = torch.randn(2, 6, 3, 32, generator=gen).to(dtype)
        nseq = 2
    kw["seqlen_offsets"] = torch.randint(0, 10, (nseq,), generator=gen, dtype=torch.int32) if offsets == "tensor" else offsets
    return x, cos, sin, kw


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v).replace("torch.", "") for v in c))
def test_core_is_bit_identical_to_released(fa_version, case, no_ftshims_kernel):
    import ftshims
    from ftshims.shims.flash_attn_rotary import cpu_triton

    layers, ops = fa_modules()
    x, cos, sin, kw = _case_inputs(case, CASES.index(case))
    with cpu_triton():
        released = ops.apply_rotary(x.clone(), cos, sin, **kw)
        with ftshims.applied(only=[SHIM]) as report:
            assert report[SHIM].status == "applied", report[SHIM].reason
            assert ops.apply_rotary is not inspect.unwrap(ops.apply_rotary)  # patched
            ours = ops.apply_rotary(x.clone(), cos, sin, **kw)
            via_layers = layers.apply_rotary(x.clone(), cos, sin, **kw)
    assert torch.equal(ours, released)
    assert torch.equal(via_layers, released)


def test_public_apis_are_bit_identical_with_grad(fa_version, no_ftshims_kernel):
    import ftshims
    from ftshims.shims.flash_attn_rotary import cpu_triton

    layers, ops = fa_modules()
    gen = torch.Generator().manual_seed(5)
    cos, sin = _tables(16, 16, torch.bfloat16)
    x = torch.randn(2, 5, 2, 16, generator=gen).bfloat16().requires_grad_()
    qkv = torch.randn(2, 5, 3, 2, 16, generator=gen).bfloat16().requires_grad_()
    kv = torch.randn(2, 5, 2, 2, 16, generator=gen).bfloat16().requires_grad_()
    offsets = torch.tensor([1, 7], dtype=torch.int32)
    original = inspect.unwrap(ops.apply_rotary)

    def run():
        out = layers.apply_rotary_emb(x, cos, sin, seqlen_offsets=offsets)
        out_func = layers.apply_rotary_emb_func(x, cos, sin, seqlen_offsets=2, interleaved=True)
        out_qkv = layers.apply_rotary_emb_qkv_(qkv.clone(), cos, sin, seqlen_offsets=offsets)
        out_kv = layers.apply_rotary_emb_kv_(kv.clone(), cos, sin, seqlen_offsets=3)
        outs = (out, out_func, out_qkv, out_kv)
        grads = torch.autograd.grad([o.float().sum() * 1.5 for o in outs], (x, qkv, kv))
        return [o.detach() for o in outs] + list(grads)

    with cpu_triton():
        plain = run()
        with ftshims.applied(only=[SHIM]):
            assert inspect.unwrap(layers.apply_rotary) is original and layers.apply_rotary is not original
            shimmed = run()
    assert inspect.unwrap(ops.apply_rotary) is original
    for got, ref in zip(shimmed, plain):
        assert torch.equal(got, ref)


def test_rotary_embedding_fp32_input_is_bit_identical(fa_version, no_ftshims_kernel):
    """Where no bug is hit (fp32 input: its table already is fp32; offsets inside the table), nothing changes."""
    import ftshims
    from ftshims.shims.flash_attn_rotary import cpu_triton

    layers, _ = fa_modules()
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 6, 3, 2, 32, generator=gen)
    q = torch.randn(2, 6, 2, 32, generator=gen)
    kv = torch.randn(2, 6, 2, 2, 32, generator=gen)
    offsets = torch.tensor([0, 4], dtype=torch.int32)

    def run():
        emb = layers.RotaryEmbedding(32, interleaved=True)
        a = emb(qkv.clone(), seqlen_offset=5)
        b = emb(qkv.clone(), seqlen_offset=offsets, max_seqlen=12)
        xpos = layers.RotaryEmbedding(32, scale_base=512)
        c, d = xpos(q.clone(), kv.clone(), seqlen_offset=offsets, max_seqlen=10)
        return a, b, c, d, emb._cos_cached, xpos._cos_k_cached

    with cpu_triton():
        plain = run()
        with ftshims.applied(only=[SHIM]):
            shimmed = run()
    for got, ref in zip(shimmed, plain):
        assert torch.equal(got, ref)


# ---------------------------------------------------------------------------
# the fixes in detail


def test_tensor_offsets_are_checked_per_sequence(fa_version, no_ftshims_kernel):
    import ftshims
    from ftshims.shims.flash_attn_rotary import cpu_triton

    layers, ops = fa_modules()
    cos, sin = _tables(8, 16, torch.float32)
    x = torch.randn(9, 2, 16)
    cu = torch.tensor([0, 6, 9], dtype=torch.int32)  # lengths 6 and 3
    with cpu_triton(), ftshims.applied(only=[SHIM]):
        ok = ops.apply_rotary(x, cos, sin, seqlen_offsets=torch.tensor([2, 5]), cu_seqlens=cu, max_seqlen=6)  # 2+6, 5+3 = 8
        with pytest.raises(ValueError, match=r"position 8, outside the cos/sin table \(8 rows\)"):
            ops.apply_rotary(x, cos, sin, seqlen_offsets=torch.tensor([3, 5]), cu_seqlens=cu, max_seqlen=6)
        with pytest.raises(ValueError, match="outside the cos/sin table"):
            layers.apply_rotary_emb(torch.randn(2, 4, 1, 16), cos, sin, seqlen_offsets=torch.tensor([0, 5]))
        # the int path keeps flash-attn's own assert
        with pytest.raises(AssertionError):
            layers.apply_rotary_emb(torch.randn(2, 4, 1, 16), cos, sin, seqlen_offsets=5)
    with cpu_triton():
        assert torch.equal(ok, ops.apply_rotary(x, cos, sin, seqlen_offsets=torch.tensor([2, 5]), cu_seqlens=cu, max_seqlen=6))


def test_rotary_embedding_grows_its_table_for_tensor_offsets(fa_version, no_ftshims_kernel):
    """The decode step: after no or a shorter prefill, a tensor offset reaches past the table."""
    import ftshims
    from ftshims.shims.flash_attn_rotary import cpu_triton, fp64_table, reference_rotary

    layers, _ = fa_modules()
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(2, 3, 3, 2, 16, generator=gen)
    offsets = torch.tensor([6, 2], dtype=torch.int32)
    pos = offsets.long()[:, None] + torch.arange(3)
    cos, sin = fp64_table(pos, 16)
    ref = reference_rotary(qkv[:, :, :2], cos[:, :, None], sin[:, :, None])
    with cpu_triton():
        fresh = layers.RotaryEmbedding(16)
        with pytest.raises(Exception):  # no table at all: flash-attn fails on cos=None
            fresh(qkv.clone(), seqlen_offset=offsets)
        with ftshims.applied(only=[SHIM]):
            for max_seqlen in (None, 4):  # no max_seqlen, and one too small for the offsets
                emb = layers.RotaryEmbedding(16)
                out = emb(qkv.clone(), seqlen_offset=offsets, max_seqlen=max_seqlen)
                assert emb._cos_cached.shape[0] == 9  # max(offsets) + seqlen, as flash-attn sizes an int offset
                assert (out[:, :, :2].double() - ref).abs().max() < 1e-5


def test_bf16_rotation_accuracy_and_upcast_paths(fa_version, no_ftshims_kernel):
    """bf16 x, fp32 table (2.5.8/2.6.3: through the upcast): every API, within ~half a bf16 ulp of the fp64 result."""
    import ftshims
    from ftshims.shims.flash_attn_rotary import cpu_triton, fp64_table, reference_rotary, ulp_errors

    layers, ops = fa_modules()
    gen = torch.Generator().manual_seed(6)
    dim, start, seqlen = 32, 3000, 6
    x = torch.randn(2, seqlen, 2, dim, generator=gen).bfloat16()
    cos64, sin64 = fp64_table(torch.arange(start, start + seqlen), dim)
    ref = reference_rotary(x, cos64, sin64)
    with cpu_triton(), ftshims.applied(only=[SHIM]):
        emb = layers.RotaryEmbedding(dim)
        out_qkv = emb(torch.stack([x, x, x], dim=2), seqlen_offset=start)
        cos, sin = emb._cos_cached, emb._sin_cached
        assert cos.dtype == torch.float32 and cos.shape[0] == start + seqlen
        out = layers.apply_rotary_emb(x, cos, sin, seqlen_offsets=start)
        assert out.dtype == torch.bfloat16
        # Rounded once: to nearest by torch after the fp32 kernel (the 2.5.8/2.6.3 upcast), or by 2.8's kernel at its
        # bf16 store, which Triton's CPU interpreter truncates (< 1 ulp; a GPU rounds to nearest).
        limit = 1.1 if _is_28(fa_version) else 0.6  # + ~0.06 ulp: the fp32 phase at position ~3000
        assert ulp_errors(out, ref, x) <= limit
        assert torch.equal(out_qkv[:, :, 0], out) and torch.equal(out_qkv[:, :, 1], out) and torch.equal(out_qkv[:, :, 2], x)
        assert torch.equal(ops.apply_rotary(x, cos, sin, seqlen_offsets=start), out)
        inplace = x.clone()
        layers.apply_rotary_emb(inplace, cos, sin, seqlen_offsets=start, inplace=True)
        assert torch.equal(inplace, out)
        xg = x.clone().requires_grad_()
        g = torch.randn(x.shape, generator=gen).bfloat16()
        (grad,) = torch.autograd.grad(layers.apply_rotary_emb(xg, cos, sin, seqlen_offsets=start), xg, g)
        assert grad.dtype == torch.bfloat16
        assert ulp_errors(grad, reference_rotary(g, cos64, -sin64), g) <= limit  # backward: the conjugate rotation
        if not _is_28(fa_version):  # the released 2.5.8/2.6.3 refuse the fp32 table outright
            ftshims.revert()
            with pytest.raises(AssertionError, match="same dtype"):
                layers.apply_rotary_emb(x, cos, sin, seqlen_offsets=start)


def test_copies_taken_before_apply_are_wrapped(fa_version, no_ftshims_kernel):
    """`from flash_attn.ops.triton.rotary import apply_rotary` elsewhere (transformers' ModernBERT, a script)."""
    import types

    import ftshims
    from ftshims.shims.flash_attn_rotary import cpu_triton

    _, ops = fa_modules()
    released = ops.apply_rotary
    fake = types.ModuleType("fake_modernbert")
    fake.apply_rotary = released
    sys.modules[fake.__name__] = fake
    cos, sin = _tables(12, 16, torch.float32)
    try:
        with cpu_triton(), ftshims.applied(only=[SHIM]):
            assert fake.apply_rotary is not released and inspect.unwrap(fake.apply_rotary) is released
            with pytest.raises(ValueError, match="outside the cos/sin table"):
                fake.apply_rotary(torch.randn(2, 4, 1, 16), cos, sin, seqlen_offsets=torch.tensor([0, 9]))
            out = fake.apply_rotary(torch.randn(2, 4, 1, 16).bfloat16(), cos, sin)  # fp32 table, every version
            assert out.dtype == torch.bfloat16
        assert fake.apply_rotary is released
    finally:
        del sys.modules[fake.__name__]


def test_rotary_embedding_fp32_cache_and_pos_idx(fa_version, no_ftshims_kernel):
    import ftshims
    from ftshims.shims.flash_attn_rotary import cpu_triton

    layers, _ = fa_modules()
    with cpu_triton(), ftshims.applied(only=[SHIM]):
        emb = layers.RotaryEmbedding(32, base=10000.0, interleaved=True, pos_idx_in_fp32=True)
        emb(torch.randn(1, 4, 3, 2, 32).bfloat16(), seqlen_offset=10)
        assert emb._cos_cached.dtype == torch.float32
        assert emb.pos_idx_in_fp32 is True
        if _is_28(fa_version):
            with pytest.raises(TypeError, match="legacy low-precision positions"):
                layers.RotaryEmbedding(32, pos_idx_in_fp32=False)
        else:  # the released parameter, untouched
            assert layers.RotaryEmbedding(32, pos_idx_in_fp32=False).pos_idx_in_fp32 is False


def test_signatures_are_the_released_ones(fa_version):
    import ftshims

    layers, ops = fa_modules()
    names = ["apply_rotary_emb", "apply_rotary_emb_qkv_", "apply_rotary_emb_kv_"]
    public = {n: getattr(layers, n) for n in names}
    methods = {n: vars(layers.RotaryEmbedding)[n] for n in ("__init__", "forward", "_update_cos_sin_cache")}
    core = inspect.signature(ops.apply_rotary)
    with ftshims.applied(only=[SHIM]) as report:
        assert report[SHIM].status == "applied", report[SHIM].reason
        assert inspect.signature(ops.apply_rotary) == core
        assert inspect.signature(layers.apply_rotary) == core
        for n in names:
            assert getattr(layers, n) is public[n]  # the public APIs are not touched at all
        assert inspect.signature(layers.RotaryEmbedding.forward) == inspect.signature(methods["forward"])
        assert (vars(layers.RotaryEmbedding)["__init__"] is methods["__init__"]) == (not _is_28(fa_version))
    assert inspect.unwrap(ops.apply_rotary) is ops.apply_rotary  # reverted to the released function
    assert layers.apply_rotary is ops.apply_rotary
    for n, method in methods.items():
        assert vars(layers.RotaryEmbedding)[n] is method


def test_no_extension_is_built_or_imported():
    """A fresh interpreter: apply() first, then import flash-attn (the deferred install), run every shimmed path
    (2.5.8: the upcast too); ftshims.kernels is never imported."""
    import subprocess

    root = sources() / "flash_attn-2.5.8"
    if not (root / "SOURCE.json").is_file():
        missing(f"flash-attn 2.5.8 sources not found in {root}")
    code = "\n".join(
        [
            "import sys, torch, ftshims",
            "ftshims.apply(only=['flash_attn_rotary'])",
            "from ftshims.shims.flash_attn_rotary import cpu_triton",
            "from flash_attn.layers import rotary as fa",
            "with cpu_triton():",
            "    emb = fa.RotaryEmbedding(16, pos_idx_in_fp32=True)",
            "    emb(torch.randn(2, 4, 3, 2, 16).bfloat16())",
            "    emb(torch.randn(2, 2, 3, 2, 16).bfloat16(), seqlen_offset=torch.tensor([3, 9]))",
            "    try:",
            "        fa.apply_rotary_emb(torch.randn(2, 4, 1, 16), emb._cos_cached, emb._sin_cached, seqlen_offsets=torch.tensor([0, 9]))",
            "    except ValueError:",
            "        pass",
            "loaded = sorted(m for m in sys.modules if m.startswith('ftshims.kernels'))",
            "print('STATUS', ftshims.status()['flash_attn_rotary'].status, emb._cos_cached.dtype, loaded)",
        ]
    )
    repo = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), repo]), TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "STATUS applied torch.float32 []" in out.stdout, out.stdout
