"""gemma_hidden_act_gelu_regression: Gemma (v1) / PaliGemma-1 with hidden_act="gelu" compute what transformers
5.18.0 computes (tanh GELU) on 4.48.0-5.17.x; everything else is bit-identical.

The 5.18.0 numbers are recorded in tests/fixtures/gemma_5_18_0_gelu.json (regenerate with
``PYTHONPATH=<unzipped transformers 5.18.0 wheel> python tests/shims/test_gemma_hidden_act_gelu_regression.py``
on a venv with its dependencies; the weights come from a seeded torch.Generator, so every stack builds the
same model without a checkpoint)."""

import json
from pathlib import Path

import pytest
from tests.shimcheck import assert_bug_and_fix

from ftshims.versions import in_range, installed_version

SHIM = "gemma_hidden_act_gelu_regression"
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "gemma_5_18_0_gelu.json"
TF = installed_version("transformers") or "0"
IN_RANGE = in_range(TF, ">=4.48.0,<5.18.0")
HAS_GEMMA = in_range(TF, ">=4.38.0")
ON_4_38 = in_range(TF, ">=4.38.0,<4.39.0")
in_range_only = pytest.mark.skipif(not IN_RANGE, reason="the shim applies to transformers 4.48.0-5.17.x")
needs_gemma = pytest.mark.skipif(not HAS_GEMMA, reason="no Gemma before transformers 4.38")


@pytest.mark.parametrize("scenario", ["gelu_fp32", "gelu_bf16", "paligemma_gelu"])
def test_bug_and_fix(evidence, scenario):
    """hidden_act="gelu": exact GELU in range (4.39-4.47 and 5.18+ run tanh: no bug there); with the shim,
    every GemmaMLP equals 5.18.0's tanh-GELU MLP exactly. (4.38.x: the probe is unsupported, see
    gemma_4_38_norm_and_activation.)"""
    assert_bug_and_fix(SHIM, evidence, scenario, expect_bug=True, case=scenario)


def test_tanh_config_is_healthy(evidence):
    assert_bug_and_fix(SHIM, evidence, "tanh_config", expect_bug=False, case="tanh_config")


# --------------------------------------------------------------------------- 5.18.0's numbers, recorded

FIELDS = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 32,
          "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "gelu"}


def _seeded_gemma():
    """A tiny GemmaForCausalLM (fp32, eager, eval) whose weights come from a seeded generator by parameter name:
    the same model on every transformers version (no checkpoint needed), plus its input ids."""
    import torch
    import transformers

    config = transformers.GemmaConfig(**FIELDS)
    model = transformers.GemmaForCausalLM(config)
    model.config._attn_implementation = "eager"
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            scale = 0.5 if "norm" in name else 0.2
            param.copy_(torch.randn(param.shape, generator=generator) * scale)
    ids = torch.randint(3, 64, (1, 8), generator=generator)
    return model.eval(), ids


def _run(model, ids):
    """(logits of the model, the first GemmaMLP's input and output)."""
    import torch

    seen = {}

    def hook(module, inputs, output):
        seen.setdefault("x", inputs[0].detach().clone())
        seen.setdefault("y", output.detach().clone())

    handle = model.model.layers[0].mlp.register_forward_hook(hook)
    try:
        with torch.no_grad():
            logits = model(input_ids=ids).logits
    finally:
        handle.remove()
    return logits, seen["x"], seen["y"]


def _record():
    """Write the fixture from the installed transformers (meant for 5.18.0)."""
    import torch
    import transformers

    model, ids = _seeded_gemma()
    logits, x, y = _run(model, ids)
    data = {
        "about": "tiny GemmaForCausalLM with hidden_act='gelu' (weights: tests/shims/"
                 "test_gemma_hidden_act_gelu_regression.py _seeded_gemma), eager attention, fp32, as computed by "
                 f"transformers {transformers.__version__} on torch {torch.__version__}",
        "transformers": transformers.__version__,
        "act_fn": type(model.model.layers[0].mlp.act_fn).__name__,
        "hidden_act_after_init": model.config.hidden_act,
        "input_ids": ids.tolist(),
        "mlp_input": x.tolist(),
        "mlp_output": y.tolist(),
        "logits": logits.tolist(),
    }
    FIXTURE.write_text(json.dumps(data) + "\n")
    print(f"wrote {FIXTURE} from transformers {transformers.__version__} (act_fn {data['act_fn']})")


def _fixture():
    import torch

    data = json.loads(FIXTURE.read_text())
    return data, {k: torch.tensor(data[k]) for k in ("input_ids", "mlp_input", "mlp_output", "logits")}


@needs_gemma
@pytest.mark.skipif(ON_4_38, reason="4.38.x is gemma_4_38_norm_and_activation's")
def test_moves_to_transformers_5_18_numbers():
    """The same weights and input as the recorded 5.18.0 run: the first MLP, fed 5.18.0's MLP input, returns
    5.18.0's output bit for bit, and the logits come within float32 rounding of 5.18.0's (the attention code
    differs between releases); without the shim, in range, both are off by the exact-vs-tanh GELU gap."""
    import torch

    import ftshims

    data, want = _fixture()
    assert data["transformers"] == "5.18.0" and data["act_fn"] == "GELUTanh"
    model, ids = _seeded_gemma()
    assert torch.equal(ids, want["input_ids"])
    mlp = model.model.layers[0].mlp

    def measure():
        with torch.no_grad():
            mlp_out = mlp(want["mlp_input"])
        logits, _, _ = _run(model, ids)
        return (mlp_out - want["mlp_output"]).abs().max().item(), (logits - want["logits"]).abs().max().item()

    plain_mlp, plain_logits = measure()
    with ftshims.applied(only=[SHIM]):
        shim_mlp, shim_logits = measure()
    if IN_RANGE:
        assert plain_mlp > 1e-4 and plain_logits > 1e-4, (plain_mlp, plain_logits)  # exact GELU: off
    else:
        assert plain_mlp == 0 and plain_logits < 1e-5, (plain_mlp, plain_logits)  # 4.39-4.47, 5.18+: tanh already
    assert shim_mlp == 0, shim_mlp
    assert shim_logits < 1e-5, shim_logits


# --------------------------------------------------------------------------- do no harm


def _gemma_mlp(hidden_act, seed=0, **extra):
    import torch
    from transformers import GemmaConfig
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    torch.manual_seed(seed)
    mlp = GemmaMLP(GemmaConfig(hidden_size=16, intermediate_size=32, hidden_act=hidden_act, **extra))
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.5)
    return mlp


def _tanh_mlp(mlp, x):
    import torch

    return mlp.down_proj(torch.nn.functional.gelu(mlp.gate_proj(x), approximate="tanh") * mlp.up_proj(x))


@in_range_only
def test_decision_rule_is_5_18s():
    """"gelu" -> tanh GELU, also with hidden_activation="gelu" (4.39's opt-out, which 5.18 does not read either);
    every other hidden_act and a replaced act_fn pass through bit-identically, and a call with other arguments
    too; the shim counts what it did."""
    import torch

    import ftshims

    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1))
    mapped = [_gemma_mlp("gelu"), _gemma_mlp("gelu", hidden_activation="gelu"),
              _gemma_mlp("gelu", hidden_activation="gelu_pytorch_tanh")]
    replaced = _gemma_mlp("gelu")
    replaced.act_fn = torch.nn.SiLU()
    untouched = [_gemma_mlp("gelu_pytorch_tanh"), _gemma_mlp("relu"), _gemma_mlp("gelu_new"), replaced]
    with torch.no_grad():
        before = [m(x) for m in untouched]
        with ftshims.applied(only=[SHIM]) as report:
            assert report[SHIM].active, report[SHIM].reason
            after_mapped = [m(x) for m in mapped]
            after = [m(x) for m in untouched]
            actions = ftshims.status()[SHIM].actions
    for mlp, out in zip(mapped, after_mapped):
        assert torch.equal(out, _tanh_mlp(mlp, x))
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert list(actions.values()) == [len(mapped)]


def _logits(model, ids):
    import torch

    with torch.no_grad():
        return model(input_ids=ids).logits


@needs_gemma
def test_other_models_and_tanh_gemma_bit_identical():
    """A tiny Llama, a Gemma with the default tanh config (fp32 and bf16) and a Gemma2 with hidden_activation
    "gelu" give the very same logits with the shim applied."""
    import torch
    import transformers

    import ftshims
    from ftshims import tiny
    from ftshims.shims.gemma_4_38_norm_and_activation import tiny_gemma

    ids = tiny.batch(batch_size=2, seq_len=12)["input_ids"]
    with tiny.quiet():
        models = [tiny.tiny_llama().eval(), tiny_gemma("float32", "gelu_pytorch_tanh"),
                  tiny_gemma("bfloat16", "gelu_pytorch_tanh")]
        if hasattr(transformers, "Gemma2Config"):
            models.append(tiny.causal_lm("Gemma2Config", attn="eager", vocab_size=128, hidden_size=64,
                                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=1, head_dim=16, hidden_activation="gelu",
                                         hidden_act="gelu").eval())
    plain = [_logits(m, ids) for m in models]
    with ftshims.applied(only=[SHIM]):
        shimmed = [_logits(m, ids) for m in models]
    assert all(torch.equal(a, b) for a, b in zip(plain, shimmed))


@in_range_only
def test_training_gradients_follow_tanh_gelu():
    """Backward goes through the tanh GELU: the gradients equal those of the tanh-GELU MLP."""
    import torch

    import ftshims

    mlp = _gemma_mlp("gelu")
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(3))
    with ftshims.applied(only=[SHIM]):
        mlp(x).pow(2).sum().backward()
    got = [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad()
    _tanh_mlp(mlp, x).pow(2).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(got, mlp.parameters()))


@in_range_only
def test_compiled_mlp_matches_eager():
    """Under torch.compile (eager backend) the decision is taken at trace time: same output as eager."""
    import torch

    import ftshims

    mlp = _gemma_mlp("gelu")
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(4))
    torch._dynamo.reset()
    with ftshims.applied(only=[SHIM]), torch.no_grad():
        compiled = torch.compile(mlp, backend="eager", fullgraph=True)(x)
    torch._dynamo.reset()
    assert torch.equal(compiled, _tanh_mlp(mlp, x).detach())


@in_range_only
def test_revert_restores_the_original_method():
    import ftshims
    from transformers.models.gemma import modeling_gemma

    original = modeling_gemma.GemmaMLP.__dict__["forward"]
    ftshims.apply(only=[SHIM])
    try:
        assert modeling_gemma.GemmaMLP.__dict__["forward"] is not original
    finally:
        ftshims.revert(only=[SHIM])
    assert modeling_gemma.GemmaMLP.__dict__["forward"] is original


if __name__ == "__main__":
    _record()
