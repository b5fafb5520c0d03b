"""torch.compile: shims neither break a compiled model nor vanish from the compiled graph.

Dynamo traces Python functions by their code object. A ``wrapt`` proxy passes
``isinstance(w, FunctionType)``, so dynamo traced the *wrapped original* and the
shim vanished from the graph (or its guards on ``__closure__`` failed). The
Patcher therefore installs plain functions, and shims on traced paths take a
data-independent branch inside a trace (``ftshims._util.compiling``).

* a wrapper's effect is present in a ``fullgraph=True`` compile, and gone after revert;
* rope_inv_freq_fp32: a bf16-cast model compiled with fullgraph gets fp32 cos/sin;
* packing_block_mask: packed examples stay isolated in a compiled forward;
* what transformers' own compile tests do (a fullgraph forward, generation with a
  static cache and a compiled forward) passes with the default shims, with the
  same tokens as eager.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import ftshims  # noqa: E402
from ftshims import tiny  # noqa: E402
from ftshims.patching import Patcher, is_shim_wrapper  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class _Target:
    """A throwaway module-like namespace and class for the patching-level test."""

    @staticmethod
    def build():
        import types

        module = types.ModuleType("ftshims_compile_target")
        exec("def double(x):\n    return x * 2\n", vars(module))

        class Doubler(torch.nn.Module):
            def forward(self, x):
                return x * 2

        module.Doubler = Doubler
        return module


def _times_100(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs) * 100


def test_wrapper_effect_is_in_the_compiled_graph_and_gone_after_revert():
    module = _Target.build()
    original_fn, original_forward = module.double, module.Doubler.forward
    patcher = Patcher("compile_test")
    patcher.wrap(module, "double", _times_100)
    patcher.wrap(module.Doubler, "forward", _times_100)
    assert is_shim_wrapper(module.double) and type(module.double) is type(original_fn)
    x = torch.ones(3)
    model = module.Doubler()
    assert torch.equal(torch.compile(lambda t: module.double(t), fullgraph=True)(x), x * 200)
    assert torch.equal(torch.compile(model, fullgraph=True)(x), x * 200)
    patcher.undo()
    assert module.double is original_fn and module.Doubler.forward is original_forward
    torch._dynamo.reset()
    assert torch.equal(torch.compile(lambda t: module.double(t), fullgraph=True)(x), x * 2)
    assert torch.equal(torch.compile(module.Doubler(), fullgraph=True)(x), x * 2)


def _compiles_plain(fn, *args, **kwargs) -> bool:
    """Whether the installed transformers/torch can compile this without ftshims (older stacks cannot)."""
    try:
        with torch.no_grad():
            torch.compile(fn, fullgraph=True)(*args, **kwargs)
        return True
    except Exception:  # the stack itself cannot: nothing for ftshims to break
        return False
    finally:
        torch._dynamo.reset()


def test_rope_fix_survives_compile():
    from ftshims.shims.rope_inv_freq_fp32 import THRESHOLD, rope_error

    def compiled_error():
        model = tiny.tiny_llama(hidden_size=256, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
                                num_hidden_layers=1, max_position_embeddings=4096).to(torch.bfloat16)
        rotary = next(m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding"))
        if not hasattr(model.model, "rotary_emb"):
            pytest.skip("this transformers keeps RoPE per attention layer with cached tables (no per-call cos/sin)")
        original_forward = rotary.forward
        rotary.forward = torch.compile(original_forward, fullgraph=True)
        with tiny.quiet():
            return rope_error(model, 4096)

    if not _compiles_plain(lambda: None):
        pytest.skip("torch.compile unavailable")
    without = compiled_error()
    torch._dynamo.reset()
    with ftshims.applied(only=["rope_inv_freq_fp32"]):
        with_shim = compiled_error()
    assert without > THRESHOLD, f"negative control: compiled bf16 RoPE error {without}"
    assert with_shim < THRESHOLD, f"compiled RoPE error with the shim {with_shim}"


def test_packing_block_mask_survives_compile():
    from ftshims.shims import _packing

    examples = _packing.example_pair()
    batch = _packing.packed_batch(examples, mask="ones")
    inputs = {k: v for k, v in batch.items() if k != "labels"}

    def compiled_gap():
        model = _packing.tiny_decoder("llama", "sdpa").eval()
        reference = _packing.reference_logits(model, examples)
        forward = torch.compile(model.forward, fullgraph=True)
        with torch.no_grad():
            logits = forward(**inputs, use_cache=False).logits.float()
        return (logits[0] - reference).abs().max().item()

    model = _packing.tiny_decoder("llama", "sdpa").eval()
    if not _compiles_plain(model.forward, **inputs, use_cache=False):
        pytest.skip("this transformers cannot compile the forward with fullgraph=True")
    without = compiled_gap()
    torch._dynamo.reset()
    with ftshims.applied(only=["packing_block_mask"]):
        with_shim = compiled_gap()
    if _packing.transformers_version().release[:2] < (4, 44):
        # 4.37-4.43 mask code decides on a 4D mask's values in Python: the shim stays out of the
        # trace, and the compiled model behaves exactly as it does without ftshims.
        assert with_shim == without
        return
    affected = _packing.transformers_version().release[:2] < (5, 0) or without > 1e-4
    if affected:
        assert without > 1e-4, f"negative control: compiled packed gap {without}"
    assert with_shim < 1e-4, f"compiled packed examples still attend to each other: {with_shim}"


CASES = [("llama", "LlamaConfig", "eager"), ("llama", "LlamaConfig", "sdpa"), ("mistral", "MistralConfig", "sdpa"),
         ("qwen2", "Qwen2Config", "eager")]


@pytest.mark.parametrize("family,config_class,attn", CASES, ids=[f"{f}-{a}" for f, _, a in CASES])
def test_default_shims_keep_transformers_compile_paths_working(family, config_class, attn):
    """What transformers' test_generate_compile_model_forward_fullgraph / test_generate_compilation_all_outputs do."""
    import transformers

    if not hasattr(transformers, config_class):
        pytest.skip(f"no {config_class} in this transformers")
    overrides = {} if config_class == "LlamaConfig" else dict(tiny.TINY_LLAMA)

    def build():
        return tiny.causal_lm(config_class, attn=attn, **overrides).eval()

    ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    try:
        plain_model = build()
    except ValueError as exc:  # e.g. no sdpa for this family in this transformers
        pytest.skip(str(exc))
    if not _compiles_plain(plain_model.forward, input_ids=ids, attention_mask=mask):
        pytest.skip("this transformers cannot compile the forward with fullgraph=True by itself")

    def run():
        model = build()
        with torch.no_grad():
            eager_logits = model(input_ids=ids, attention_mask=mask).logits
            compiled = torch.compile(model.forward, fullgraph=True)(input_ids=ids, attention_mask=mask).logits
            try:
                eager_tokens = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                              cache_implementation="static")
            except (TypeError, ValueError) as exc:  # no static cache in this transformers
                return eager_logits, compiled, None, str(exc)
            model.forward = torch.compile(model.forward, fullgraph=True)
            compiled_tokens = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                             cache_implementation="static")
        return eager_logits, compiled, (eager_tokens, compiled_tokens), None

    with tiny.quiet():
        plain = run()
        torch._dynamo.reset()
        report = ftshims.apply()
        try:
            shimmed = run()
        finally:
            ftshims.revert()
    assert report["rope_inv_freq_fp32"].active or report["rope_inv_freq_fp32"].status == "not needed"
    assert torch.equal(plain[0], shimmed[0]), "eager logits changed"
    assert torch.equal(plain[1], shimmed[1]), "compiled logits changed"
    if plain[2] is not None:
        assert shimmed[2] is not None, shimmed[3]
        assert torch.equal(*shimmed[2]), "compiled generation differs from eager generation under the shims"
        assert torch.equal(plain[2][1], shimmed[2][1]), "compiled generation changed"


def test_first_trace_through_acted_and_warn_once_has_no_side_effect():
    """A fresh process whose first torch.compile trace passes through acted()/warn_once() before anything asked
    compiling(): the trace must not run their side effects (dynamo refuses a lock as a context manager)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import torch
        from ftshims import _util
        seen = set()

        def step(x):
            _util.acted("fake", "things done")
            _util.warn_once(seen, "key", lambda: print("warned"))
            return x * 2

        out = torch.compile(step, fullgraph=True, backend="eager")(torch.ones(2))
        assert torch.equal(out, torch.full((2,), 2.0)), out
        print(dict(_util.ACTIONS), sorted(seen))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "{} []"


def test_method_wrapper_over_a_graph_break_compiles():
    """A wrapped method whose body graph-breaks: dynamo resumes after the break by rebuilding ``wrapped`` by name
    (``self.forward``), which was the wrapper again when it was a bound method: RecursionError (Qwen2-MoE on
    4.57 compiled with ftshims 0.1.0). The wrapper still takes effect, and is gone after undo."""

    class Inner(torch.nn.Module):
        def forward(self, x):
            y = x * 2
            torch._dynamo.graph_break()
            return y + 1

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()

        def forward(self, x):
            return self.inner(x) * 3

    patcher = Patcher("graph_break_test")
    patcher.wrap(Inner, "forward", _times_100)
    try:
        out = torch.compile(Outer(), backend="eager")(torch.ones(2))
        assert torch.equal(out, torch.full((2,), 900.0))
    finally:
        patcher.undo()
    torch._dynamo.reset()
    assert torch.equal(torch.compile(Outer(), backend="eager")(torch.ones(2)), torch.full((2,), 9.0))
