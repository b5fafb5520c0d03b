import pytest
from tests.shimcheck import assert_bug_and_fix

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import ftshims  # noqa: E402
from ftshims.kernels import _build  # noqa: E402
from ftshims.shims import rope_fused_kernel as shim  # noqa: E402

SHIM = "rope_fused_kernel"

from ftshims.versions import explain_mismatch, installed_versions  # noqa: E402

# transformers 5.25 turned apply_rotary_pos_emb into a kernels hub-function module: the shim stays out there.
OUT_OF_RANGE = explain_mismatch(shim.SPEC.requires, installed_versions(tuple(shim.SPEC.requires)))


@pytest.fixture(autouse=True)
def _in_range(request):
    if OUT_OF_RANGE and request.node.name != "test_stays_out_where_apply_rotary_pos_emb_is_a_hub_module":
        pytest.skip(f"rope_fused_kernel outside its range here: {OUT_OF_RANGE}")


def test_stays_out_where_apply_rotary_pos_emb_is_a_hub_module():
    """On transformers 5.25+ the opt-in is skipped with its reason, and the module-level function is untouched."""
    if not OUT_OF_RANGE:
        pytest.skip("inside the shim's range: the tests below cover it")
    import transformers.models.llama.modeling_llama as llama

    before = llama.apply_rotary_pos_emb
    ftshims.apply(include=[SHIM])
    try:
        status = ftshims.status()[SHIM]
        assert status.status == "not needed" and status.patched == [], status
        assert "is outside >=4.30,<5.25" in status.reason
        assert llama.apply_rotary_pos_emb is before
    finally:
        ftshims.revert()


@pytest.fixture(scope="module")
def compiled():
    if not _build.load(jit=True):
        pytest.fail(f"ftshims rotary extension unavailable: {_build.status()['reason']}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", ["llama", "mistral", "qwen2", "qwen3"])
def test_accuracy_against_fp64_twin(evidence, compiled, case, dtype):
    # A speed shim has no bug to fix: it must leave the model as accurate as transformers' own code.
    assert_bug_and_fix(SHIM, evidence, f"{case}/{dtype}", expect_bug=False, case=case, dtype=dtype)


def _family(name):
    import transformers

    config_class = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}[name]
    if not hasattr(transformers, config_class):
        pytest.skip(f"transformers has no {config_class}")
    return config_class


def _run(config_class, dtype, seed=0):
    from ftshims import tiny

    fields = dict(tiny.TINY_LLAMA, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    model = tiny.causal_lm(config_class, seed=seed, **fields).to(dtype)
    batch = tiny.batch(batch_size=2, seq_len=16)
    out = model(**batch)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("case", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_logits_and_grads_match_unpatched(compiled, case, dtype):
    config_class = _family(case)
    plain_logits, plain_grads = _run(config_class, dtype)
    before = shim.STATS["fused"]
    with ftshims.applied(include=[SHIM], only=[SHIM]):
        fused_logits, fused_grads = _run(config_class, dtype)
    assert shim.STATS["fused"] > before, "the fused kernel was not used"
    atol = {torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    scale = plain_logits.abs().max()
    assert (fused_logits - plain_logits).abs().max() <= atol * scale
    for name, g in plain_grads.items():
        assert (fused_grads[name] - g).abs().max() <= atol * max(g.abs().max(), 1e-12) * 4, name


def test_known_variants_are_recognised():
    import importlib

    from ftshims.versions import in_range, installed_version

    version = installed_version("transformers")
    expected = ["llama"] + (["mistral"] if in_range(version, ">=4.34") else []) + (["qwen2"] if in_range(version, ">=4.37") else [])
    for name in expected:
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        found = shim.fingerprint(module.apply_rotary_pos_emb)
        assert found is not None, name
        semantics, interleaved, _ = found
        assert not interleaved
        if name == "llama":  # the form moved with the version; other families followed at their own pace
            want = shim.TOKEN if in_range(version, ">=4.38") else (shim.TABLE if in_range(version, ">=4.36") else shim.TABLE4D)
            assert want in semantics, (name, semantics)


def test_unknown_variant_is_left_alone():
    def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        return q * 2, k * 2  # not RoPE

    assert shim.fingerprint(apply_rotary_pos_emb) is None


def test_inexpressible_calls_use_the_original(compiled):
    from transformers.models.llama import modeling_llama

    original = modeling_llama.apply_rotary_pos_emb
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 5, 8, generator=gen).bfloat16()
    k = torch.randn(1, 1, 5, 8, generator=gen).bfloat16()
    cos = torch.randn(1, 5, 8, generator=gen)  # fp32 cos with bf16 q: transformers promotes to fp32
    sin = torch.randn(1, 5, 8, generator=gen)
    params = __import__("inspect").signature(original).parameters
    if "position_ids" in params and params["position_ids"].default is __import__("inspect").Parameter.empty:
        pytest.skip("table variant (<= 4.37) takes a cos table")
    want = original(q, k, cos, sin)
    with ftshims.applied(include=[SHIM], only=[SHIM]):
        assert modeling_llama.apply_rotary_pos_emb is not original
        before = shim.STATS["fallback"]
        got = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
        assert shim.STATS["fallback"] == before + 1
    assert got[0].dtype == want[0].dtype == torch.float32
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert modeling_llama.apply_rotary_pos_emb is original


def test_applied_before_transformers_is_imported(compiled):
    """ftshims.apply(include=...) first, then the model code is imported (deferred install)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import ftshims; ftshims.apply(include=['rope_fused_kernel'], only=['rope_fused_kernel']);"
        "from ftshims import tiny; from ftshims.shims import rope_fused_kernel as shim;"
        "m = tiny.tiny_llama(); m(**tiny.batch());"
        "print('FUSED', shim.STATS['fused'])"
    )
    repo = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo, timeout=600,
                         env=dict(os.environ, PYTHONPATH=repo))
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split("FUSED")[-1]) > 0, out.stdout
