"""One foreign-patch scenario in a fresh process (patches of Liger and the fakes cannot be undone).

    python foreign_scenario.py STEPS OUT_PREFIX [--forward] [--weights W.pt] [--liger-full]

STEPS is a comma-separated order of patchers, applied left to right:

* ``liger``: ``apply_liger_kernel_to_llama()`` (with ``rms_norm=False`` unless ``--liger-full``:
  Liger's RMSNorm kernel calls ``libdevice.rsqrt``, which Triton 3.9's interpreter returns as None);
* ``ftshims`` / ``ftshims+rope``: ``ftshims.apply()`` / ``ftshims.apply(include=["rope_fused_kernel"])``;
* ``fake_unsloth``: ``LlamaModel.forward`` replaced by a re-implementation that never calls what it
  replaced (unsloth's ``LlamaModel_fast_forward`` style; here it delegates to transformers' pristine
  function, so its numbers are transformers' own);
* ``fake_axolotl``: ``masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]`` re-registered with a wrapper of
  whatever was registered (axolotl's ``sdpa_varlen`` mask patch style, which composes).

Writes OUT_PREFIX.json (facts: what each target holds, ftshims' status and notes, call counters,
the same after ``ftshims.revert()``) and, with ``--forward``, OUT_PREFIX.pt (loss and gradients of a
tiny Llama on a plain and on a packed batch, before and after the revert).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import ftshims  # noqa: E402
from ftshims.foreign import is_shim_wrapper  # noqa: E402

steps = sys.argv[1].split(",") if sys.argv[1] else []
out = Path(sys.argv[2])
forward_wanted = "--forward" in sys.argv
liger_full = "--liger-full" in sys.argv
weights = sys.argv[sys.argv.index("--weights") + 1] if "--weights" in sys.argv else None

from transformers import masking_utils  # noqa: E402
from transformers import modeling_utils  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

PRISTINE_MODEL_FORWARD = vars(modeling_llama.LlamaModel)["forward"]
CALLS = {"fake_unsloth": 0, "fake_axolotl": 0}

TARGETS = {
    "modeling_llama.apply_rotary_pos_emb": lambda: vars(modeling_llama)["apply_rotary_pos_emb"],
    "modeling_llama.LlamaRMSNorm": lambda: vars(modeling_llama)["LlamaRMSNorm"],
    "modeling_llama.LlamaMLP": lambda: vars(modeling_llama)["LlamaMLP"],
    "LlamaForCausalLM.forward": lambda: vars(modeling_llama.LlamaForCausalLM)["forward"],
    "LlamaModel.forward": lambda: vars(modeling_llama.LlamaModel)["forward"],
    "LlamaRotaryEmbedding.forward": lambda: vars(modeling_llama.LlamaRotaryEmbedding)["forward"],
    "ALL_MASK_ATTENTION_FUNCTIONS['sdpa']": lambda: masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"],
    "PreTrainedModel.gradient_checkpointing_enable": lambda: vars(modeling_utils.PreTrainedModel)["gradient_checkpointing_enable"],
    "PreTrainedModel.__call__": lambda: vars(modeling_utils.PreTrainedModel).get("__call__"),
}


def _ftshims_layer(obj):
    """The shim id of an ftshims wrapper (a plain function marked ``__ftshims_shim__`` or a wrapt proxy), else None."""
    import types

    import wrapt

    if isinstance(obj, wrapt.ObjectProxy):
        return "?"
    if is_shim_wrapper(obj) and type(obj) is types.FunctionType:
        return vars(obj)["__ftshims_shim__"]
    return None


def owner(obj) -> str:
    """A chain such as ``ftshims:packing_block_mask(fake_unsloth)``: who wraps whom, outermost first."""
    chain = []
    while True:
        shim = _ftshims_layer(obj)
        if shim is not None:  # checked first: functools.wraps copies the inner function's __dict__
            chain.append(f"ftshims:{shim}")
            obj = obj.__wrapped__
            continue
        inner = vars(obj).get("_foreign_inner") if hasattr(obj, "__dict__") else None
        if inner is not None:
            chain.append(obj._foreign_name)
            obj = inner
            continue
        break
    if obj is None:
        chain.append("none")
    else:
        name = (vars(obj).get("_foreign_name") if hasattr(obj, "__dict__") else None) or getattr(obj, "__module__", "") or ""
        chain.append("liger" if name.startswith("liger") else "transformers" if name.startswith("transformers") else name)
    return "(".join(chain) + ")" * (len(chain) - 1)


def objects() -> dict:
    return {name: owner(get()) for name, get in TARGETS.items()}


# ---------------------------------------------------------------------------
# the patchers


def liger():
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    apply_liger_kernel_to_llama() if liger_full else apply_liger_kernel_to_llama(rms_norm=False)


def fake_unsloth():
    # explicit parameters, like unsloth's LlamaModel_fast_forward (ftshims checks the target's signature)
    def fast_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                     inputs_embeds=None, use_cache=None, cache_position=None, **kwargs):
        CALLS["fake_unsloth"] += 1
        return PRISTINE_MODEL_FORWARD(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                      past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                                      cache_position=cache_position, **kwargs)

    fast_forward._foreign_name = "fake_unsloth"
    modeling_llama.LlamaModel.forward = fast_forward


def fake_axolotl():
    previous = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]

    def mask_wrapper(*args, **kwargs):
        CALLS["fake_axolotl"] += 1
        return previous(*args, **kwargs)

    mask_wrapper._foreign_name = "fake_axolotl"
    mask_wrapper._foreign_inner = previous
    masking_utils.ALL_MASK_ATTENTION_FUNCTIONS.register("sdpa", mask_wrapper)


PATCHERS = {
    "liger": liger,
    "ftshims": lambda: ftshims.apply(),
    "ftshims+rope": lambda: ftshims.apply(include=["rope_fused_kernel"]),
    "fake_unsloth": fake_unsloth,
    "fake_axolotl": fake_axolotl,
}


# ---------------------------------------------------------------------------
# the measurement


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config)
    if weights:
        model.load_state_dict(torch.load(weights))
    return model


def measure() -> dict:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 128, (2, 12), generator=gen)
    packed = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]] * 2)
    results = {}
    for name, extra in (("plain", {}), ("packed", {"position_ids": packed})):
        model = tiny_llama()
        model.train()
        out = model(input_ids=ids, labels=ids, **extra)
        out.loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results[name] = {"loss": out.loss.detach(), "grads": grads}
    return results


def status() -> dict:
    from ftshims import _manager

    report = {}
    for entry in ftshims.status():
        report[entry.id] = {"status": entry.status, "reason": entry.reason, "patched": entry.patched,
                            "notes": _manager.notes(entry.id)}
    return report


for step in steps:
    PATCHERS[step]()

facts = {"steps": steps, "objects": objects(), "status": status()}
tensors = {}
if forward_wanted:
    from ftshims.shims import rope_fused_kernel

    rope_fused_kernel.STATS.update(fused=0, fallback=0)
    tensors["applied"] = measure()
    facts["rope_fused_kernel_calls"] = dict(rope_fused_kernel.STATS)
facts["calls"] = dict(CALLS)

ftshims.revert()
facts["after_revert"] = {"objects": objects(), "status": {k: v["status"] for k, v in status().items()}}
if forward_wanted:
    tensors["reverted"] = measure()
    facts["calls_after_revert"] = dict(CALLS)
    torch.save(tensors, str(out) + ".pt")
Path(str(out) + ".json").write_text(json.dumps(facts, indent=1, default=repr))
