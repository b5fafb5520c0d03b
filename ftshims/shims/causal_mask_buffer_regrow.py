"""transformers 4.38.0–4.38.2: Llama/Gemma fail past twice ``max_position_embeddings`` (a buffer that grows once).

Why: 4.38.0 moved the causal mask of Llama and Gemma into a square
``causal_mask`` buffer of ``max_position_embeddings`` rows, built at init.
``_update_causal_mask`` "supports going beyond" it by doubling the buffer
*once* when the new tokens outnumber it, and never looks at cached tokens. So
a fresh model given more than twice ``max_position_embeddings`` tokens, or a
generation that runs past the buffer with a cache, fails inside the forward:
``IndexError`` (no attention mask: the layers index the buffer at
``cache_position``) or a size-mismatch ``RuntimeError`` (with a 2D mask)
(transformers#29252; 4.39.0 builds the mask at the needed size, PR #29263 /
#29753). Measured on the pinned 4.38.2 stack: a tiny Llama with 16 positions
fails at 40 tokens with and without a mask, and in generation past 32 tokens.

The fix: the ``forward`` of every decoder base class that defines
``_update_causal_mask`` and keeps a ``causal_mask`` buffer (``LlamaModel``,
``GemmaModel``) is wrapped. Before the call, when the cached plus new tokens
(``cache_position`` + 1 when given) exceed the buffer, the buffer is regrown by
doubling, as upstream does, until it covers them; the call then proceeds
unchanged. Models whose buffer already covers the input are untouched (one
integer comparison).

Applies to transformers >=4.38.0,<4.39 (fixed in 4.39.0). Under
``torch.compile`` the buffer is not regrown (a buffer mutation cannot live in a
trace): compiled static-cache generation sizes the buffer itself
(``_setup_cache``). Falls back: classes without the buffer or
``_update_causal_mask`` are left alone.

Follow-ups: none that apply. The shim's fix differs from 4.39.0's (#29263 / #29753): it keeps
4.38's causal_mask buffer and regrows it by 4.38's own doubling rule until it covers cached plus
new tokens, where 4.39.0 drops the buffer and builds the mask at the needed size.
_update_causal_mask of LlamaModel and GemmaModel read in 4.39.0-4.39.3 and 4.40.0: 4.39.3 only
changes the static-cache test (layers without self_attn) and 4.40.0 rewrites the function; neither
touches a 4.38.x code path.
"""

from __future__ import annotations

from .._util import acted, cache_length, compiling
from ..spec import Observation, ProbeUnsupported, ShimSpec, Target

SPEC = ShimSpec(
    id="causal_mask_buffer_regrow",
    since="0.1.0",
    title="Llama/Gemma 4.38.0–4.38.2 fail past twice max_position_embeddings (causal_mask buffer grows once)",
    symptom="IndexError or a size-mismatch RuntimeError inside the forward for inputs (or cached + new tokens) longer "
    "than 2 x max_position_embeddings on Llama/Gemma",
    why="4.38.0-4.38.2 keep Llama/Gemma's causal mask in a buffer of max_position_embeddings rows that _update_causal_mask doubles once and never sizes for cached tokens: a long input or a generation past it fails inside the forward (IndexError or a size mismatch). The shim regrows the buffer to cover cached plus new tokens.",
    requires={"transformers": ">=4.38.0,<4.39"},
    fixed_in={"transformers": "4.39.0"},
    refs=(
        "https://github.com/huggingface/transformers/issues/29252",
        "https://github.com/huggingface/transformers/pull/29263",
        "https://github.com/huggingface/transformers/pull/29753",
    ),
    backports=(
        "https://github.com/huggingface/transformers/pull/29263",
        "https://github.com/huggingface/transformers/pull/29753",
    ),
    follow_ups_checked="_update_causal_mask of LlamaModel and GemmaModel read in 4.39.0-4.39.3 and 4.40.0: 4.39.3 "
    "only changes the static-cache test (layers without self_attn) and 4.40.0 rewrites the function; neither "
    "touches a 4.38.x code path.",
    targets=(
        Target("transformers.models.llama.modeling_llama", "LlamaModel.forward", params=("input_ids", "cache_position")),
        Target("transformers.models.llama.modeling_llama", "LlamaModel._update_causal_mask"),
    ),
    modules=("transformers.modeling_utils",),
)

MODULES = ("transformers.models.llama.modeling_llama", "transformers.models.gemma.modeling_gemma")


def needed_length(kwargs) -> int:
    """The buffer rows this call indexes: cached + new tokens, or the largest cache position + 1."""
    cache_position = kwargs.get("cache_position")
    if cache_position is not None and getattr(cache_position, "numel", lambda: 0)():
        return int(cache_position.max()) + 1
    ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
    new = ids.shape[-1] if ids is not None else embeds.shape[1] if embeds is not None else 0
    return cache_length(kwargs.get("past_key_values")) + new


def regrow(module, total: int) -> bool:
    """Double ``module.causal_mask`` until it covers ``total`` positions; True when it grew."""
    import torch

    buffer = module._buffers.get("causal_mask")
    if not isinstance(buffer, torch.Tensor) or buffer.dim() != 2 or buffer.shape[-1] >= total:
        return False
    size = buffer.shape[-1]
    while size < total:
        size *= 2
    grown = torch.triu(torch.ones((size, size), dtype=buffer.dtype, device=buffer.device), diagonal=1)
    module.register_buffer("causal_mask", grown, persistent=False)
    acted(SPEC.id, "causal_mask buffers regrown")
    return True


def install(patcher, options) -> None:
    import inspect

    def part(module):
        for name, cls in list(vars(module).items()):
            if not (isinstance(cls, type) and cls.__module__ == module.__name__):
                continue
            if "_update_causal_mask" not in vars(cls) or "forward" not in vars(cls):
                continue
            names = tuple(list(inspect.signature(cls.forward).parameters)[1:])

            def forward(wrapped, instance, args, kwargs, names=names):
                if not compiling() and isinstance(getattr(instance, "causal_mask", None), _tensor_type()):
                    call = dict(zip(names, args))
                    call.update(kwargs)
                    regrow(instance, needed_length(call))
                return wrapped(*args, **kwargs)

            patcher.wrap(cls, "forward", forward)

    for name in MODULES:
        patcher.when_imported(name, part)


def _tensor_type():
    import torch

    return torch.Tensor


# ---------------------------------------------------------------------------
# Probe

MAX_POSITIONS = 16


def build(family: str = "llama", max_positions: int = MAX_POSITIONS):
    import transformers

    from .. import tiny

    config_class = {"llama": "LlamaConfig", "gemma": "GemmaConfig"}[family]
    if not hasattr(transformers, config_class):
        raise ProbeUnsupported(f"transformers {transformers.__version__} has no {config_class}")
    fields = dict(tiny.TINY_LLAMA, max_position_embeddings=max_positions)
    if family == "gemma":
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    with tiny.quiet():
        return tiny.causal_lm(config_class, attn="eager", **fields).eval()


def probe(family: str = "llama", case: str = "long_mask") -> Observation:
    """A tiny ``family`` model with 16 positions: ``long_mask`` / ``long_no_mask`` run 40 tokens at once;
    ``generate`` runs 30 tokens, then 10 more one at a time with a cache. The bug: an exception; with the
    shim the logits must equal those of the same weights with a 64-row buffer."""
    import warnings

    import torch

    from .. import tiny

    model, reference = build(family), build(family, max_positions=64)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (1, 40), generator=generator)

    def run(m):
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if case in ("long_mask", "long_no_mask"):
                mask = {"attention_mask": torch.ones_like(ids)} if case == "long_mask" else {}
                return m(input_ids=ids, **mask).logits
            if case == "generate":
                out = m(input_ids=ids[:, :30], use_cache=True)
                past, logits = out.past_key_values, [out.logits]
                for step in range(30, 40):
                    out = m(input_ids=ids[:, step : step + 1], past_key_values=past, use_cache=True)
                    past = out.past_key_values
                    logits.append(out.logits)
                return torch.cat(logits, dim=1)
            raise ValueError(f"unknown case {case!r}")

    with tiny.quiet():
        try:
            logits = run(model)
        except (IndexError, RuntimeError) as exc:
            return Observation(True, f"{family} {case}: {type(exc).__name__}: {str(exc)[:120]}")
        expected = run(reference)
    gap = (logits - expected).abs().max().item()
    if gap > 1e-5:
        return Observation(True, f"{family} {case}: ran but differs from a large-buffer model by {gap:.3g}")
    return Observation(False, f"{family} {case}: 40 positions ran, equal to a large-buffer model ({gap:.1e})")
