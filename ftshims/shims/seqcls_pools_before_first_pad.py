"""Decoder ``*ForSequenceClassification`` heads pool the token before the *first* pad token.

Why: the classification (and reward-model) heads of the decoder-only families
are documented to score "the last token that is not a padding token in each
row". Before transformers 4.49 they compute that index as
``argmax(input_ids == pad_token_id) - 1`` (4.32–4.48; ``ne(...).sum(-1) - 1``,
the number of non-pad tokens, before that): the token before the first pad. When
the pad id also occurs *inside* the text, which is the usual setup for models
without a pad token (``pad_token = eos_token``, Llama-3's ``<|eot_id|>`` closing
each chat turn), the head scores the prefix before the first such token,
typically the system prompt or the first turn. Chosen and rejected responses
then get the same score and a reward model's loss sticks at log 2. No warning.
transformers#35352 / #35909 / #30004; fixed in 4.49.0 by PR #35911, which pools
the rightmost non-pad token.

The fix: wrap ``forward`` of every decoder ``*ForSequenceClassification`` class
that has this code. Where a row holds a pad token before its last non-pad
token, a forward hook on the base model (``model.base_model``, the module the
head's forward calls first) replaces that row's last hidden state at every
position by the hidden state of the rightmost non-pad token, so whatever index
the installed code picks, the head scores the token 4.49 scores; the loss
(regression / single- / multi-label) is the installed code's own. Rows with
only trailing padding, or none, are not touched (identical outputs), and neither
are calls without ``input_ids`` or without ``config.pad_token_id``. The
returned ``hidden_states`` tuple (``output_hidden_states=True``) is unchanged.

Applies to transformers >=4.30,<4.49 (reproduced on 4.34.1, 4.36.2, 4.37.2,
4.38.2, 4.43.4; 4.30.2 also pools left-padded rows wrongly, which the same
rewrite fixes). Fallback: a family whose module or class is missing is
skipped; a model whose base model is itself, or whose base model's output is
not a tensor-first output, passes through. Inside a ``torch.compile`` trace
the rewrite runs for every row with a pad before its last token, without the
data-dependent check.

Follow-ups: none that change the pooled token. The rightmost-non-pad index #35911
added was read in 4.49.0, 4.50.3, 4.53.3, 4.56.2 and 4.57.6 (modeling_layers.py in the
4.56.2 and later wheels), 5.0.0, 5.9.0, 5.16.1, 5.24.0 and 5.25.0: unchanged except that 4.50 builds the
index range as int32 (the same index) and 5.x reads pad_token_id from
config.get_text_config() (composite configs; every family this shim wraps keeps it
on its top-level config); no revert or regression report against #35911 found.
"""

from __future__ import annotations

from .._util import acted, compiling, method_binder
from ..spec import Observation, ProbeUnsupported, ShimSpec, Target

SPEC = ShimSpec(
    id="seqcls_pools_before_first_pad",
    since="0.1.0",
    title="Sequence-classification / reward heads pool the token before the first pad, not the last real token",
    symptom="with pad_token == eos (or any pad id inside the text), LlamaForSequenceClassification and the other "
    "decoder classification heads score the prefix before the first pad/eos: rewards of chosen and rejected are "
    "equal, the reward loss sticks at 0.693",
    why="Before transformers 4.49 decoder sequence-classification heads take the token before the first pad id, not "
    "the last non-pad token the docs promise, so with pad == eos inside the text they score only the prefix. The "
    "shim makes the head score the rightmost non-pad token, as 4.49 does.",
    requires={"transformers": ">=4.30,<4.49"},
    fixed_in={"transformers": "4.49.0"},
    refs=(
        "https://github.com/huggingface/transformers/issues/35352",
        "https://github.com/huggingface/transformers/issues/35909",
        "https://github.com/huggingface/transformers/issues/30004",
        "https://github.com/huggingface/transformers/pull/35911",
    ),
    backports=("https://github.com/huggingface/transformers/pull/35911",),
    follow_ups_checked="The rightmost-non-pad index #35911 added was read in 4.49.0, 4.50.3, 4.53.3, 4.56.2 and "
    "4.57.6 (modeling_layers.py in the 4.56.2 and later wheels), 5.0.0, 5.9.0, 5.16.1, 5.24.0 and 5.25.0: "
    "unchanged except that 4.50 builds the index range as int32 (the same index) and 5.x reads pad_token_id from "
    "config.get_text_config() (composite configs; every family this shim wraps keeps it on its top-level config); "
    "no revert or regression report against #35911 found.",
    targets=(
        Target("transformers.models.llama.modeling_llama", "LlamaForSequenceClassification.forward",
               params=("input_ids",)),
    ),
    modules=("transformers",),
)

# modeling module (under transformers.models) -> sequence-classification class. Every decoder head that
# pools with the first-pad formula in 4.48.3 (grep of the wheel), where it exists in the installed version.
FAMILIES = {
    "llama.modeling_llama": "LlamaForSequenceClassification",
    "mistral.modeling_mistral": "MistralForSequenceClassification",
    "mixtral.modeling_mixtral": "MixtralForSequenceClassification",
    "qwen2.modeling_qwen2": "Qwen2ForSequenceClassification",
    "qwen2_moe.modeling_qwen2_moe": "Qwen2MoeForSequenceClassification",
    "gemma.modeling_gemma": "GemmaForSequenceClassification",
    "gemma2.modeling_gemma2": "Gemma2ForSequenceClassification",
    "phi.modeling_phi": "PhiForSequenceClassification",
    "phi3.modeling_phi3": "Phi3ForSequenceClassification",
    "phimoe.modeling_phimoe": "PhimoeForSequenceClassification",
    "starcoder2.modeling_starcoder2": "Starcoder2ForSequenceClassification",
    "stablelm.modeling_stablelm": "StableLmForSequenceClassification",
    "persimmon.modeling_persimmon": "PersimmonForSequenceClassification",
    "nemotron.modeling_nemotron": "NemotronForSequenceClassification",
    "glm.modeling_glm": "GlmForSequenceClassification",
    "diffllama.modeling_diffllama": "DiffLlamaForSequenceClassification",
    "jetmoe.modeling_jetmoe": "JetMoeForSequenceClassification",
    "jamba.modeling_jamba": "JambaForSequenceClassification",
    "zamba.modeling_zamba": "ZambaForSequenceClassification",
    "gpt2.modeling_gpt2": "GPT2ForSequenceClassification",
    "gpt_neox.modeling_gpt_neox": "GPTNeoXForSequenceClassification",
    "gpt_neo.modeling_gpt_neo": "GPTNeoForSequenceClassification",
    "gptj.modeling_gptj": "GPTJForSequenceClassification",
    "gpt_bigcode.modeling_gpt_bigcode": "GPTBigCodeForSequenceClassification",
    "opt.modeling_opt": "OPTForSequenceClassification",
    "bloom.modeling_bloom": "BloomForSequenceClassification",
    "falcon.modeling_falcon": "FalconForSequenceClassification",
    "mpt.modeling_mpt": "MptForSequenceClassification",
    "ctrl.modeling_ctrl": "CTRLForSequenceClassification",
    "openai.modeling_openai": "OpenAIGPTForSequenceClassification",
}


def last_non_pad(input_ids, pad_token_id):
    """The index of the rightmost non-pad token of each row (0 for an all-pad row), as 4.49 computes it."""
    import torch

    non_pad = (input_ids != pad_token_id).to(torch.int64)
    positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
    return (positions * non_pad).argmax(-1)


def _rows_to_repool(input_ids, pad_token_id, last):
    """Rows holding a pad token before their last non-pad token (mid-text pad/eos, or left padding)."""
    import torch

    positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
    return ((input_ids == pad_token_id) & (positions < last.unsqueeze(-1))).any(-1)


def _repooling_hook(rows, last, count):
    """A forward hook for the base model: rows in ``rows`` carry hidden[b, last[b]] at every position."""

    def hook(module, inputs, output):
        first = output[0] if isinstance(output, (tuple, list)) else getattr(output, "last_hidden_state", None)
        if first is None or getattr(first, "dim", lambda: 0)() != 3 or first.shape[0] != rows.shape[0]:
            return None  # not a (batch, seq, hidden) first output: leave it alone
        import torch

        index = torch.arange(first.shape[0], device=first.device)
        chosen = first[index, last.to(first.device)]  # (batch, hidden)
        mask = rows.to(first.device).view(-1, 1, 1)
        rewritten = torch.where(mask, chosen.unsqueeze(1).expand_as(first), first)
        if count:
            acted(SPEC.id, "rows pooled at the last non-pad token", count)
        if isinstance(output, tuple):
            return (rewritten,) + tuple(output[1:])
        if isinstance(output, list):
            return [rewritten] + list(output[1:])
        output.last_hidden_state = rewritten  # ModelOutput keeps its tuple view in step
        return output

    return hook


def _forward_wrapper(bind):
    def forward(wrapped, instance, args, kwargs):
        call = bind(args, kwargs)
        input_ids = call.get("input_ids") if call is not None else None
        pad = getattr(getattr(instance, "config", None), "pad_token_id", None)
        base = getattr(instance, "base_model", instance)
        if input_ids is None or pad is None or base is instance or getattr(input_ids, "dim", lambda: 0)() != 2:
            return wrapped(*args, **kwargs)
        last = last_non_pad(input_ids, pad)
        rows = _rows_to_repool(input_ids, pad, last)
        count = 0
        if not compiling():
            count = int(rows.sum())
            if not count:
                return wrapped(*args, **kwargs)
        handle = base.register_forward_hook(_repooling_hook(rows, last, count))
        try:
            return wrapped(*args, **kwargs)
        finally:
            handle.remove()

    return forward


def install(patcher, options) -> None:
    from ..patching import require_params
    from ..spec import TargetMissing

    for module_suffix, class_name in FAMILIES.items():
        module_name = f"transformers.models.{module_suffix}"

        def part(module, module_name=module_name, class_name=class_name):
            cls = vars(module).get(class_name)
            if cls is None or "forward" not in vars(cls):
                if module_name.endswith("modeling_llama"):
                    raise TargetMissing(f"{module_name}.{class_name}.forward not found")
                return  # a family this version does not have
            require_params(cls.forward, ("input_ids",), f"{module_name}.{class_name}.forward")
            patcher.wrap(cls, "forward", _forward_wrapper(method_binder(cls.forward)))

        patcher.when_imported(module_name, part)


# ---------------------------------------------------------------------------
# Reproduction

_TINY = dict(vocab_size=64, hidden_size=32, num_labels=2, pad_token_id=2, eos_token_id=2, bos_token_id=1)


def tiny_classifier(family: str = "llama", seed: int = 0):
    """A tiny random ``family`` sequence-classification model whose pad id is its eos id (2)."""
    import torch
    import transformers

    from .. import tiny

    if family == "llama":
        config = transformers.LlamaConfig(**dict(tiny.TINY_LLAMA, **_TINY))
    elif family == "qwen2":
        if not hasattr(transformers, "Qwen2Config"):
            raise ProbeUnsupported("this transformers has no Qwen2")
        config = transformers.Qwen2Config(**dict(tiny.TINY_LLAMA, **_TINY))
    elif family == "gpt2":
        config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, **_TINY)
    else:
        raise ValueError(f"no tiny config for {family!r}")
    torch.manual_seed(seed)
    with tiny.quiet():
        model = transformers.AutoModelForSequenceClassification.from_config(config)
    return model.eval()


# Rows of input ids, pad = eos = 2. "eos_inside": an eos closes the first turn, then more text, then
# padding (the chat/reward-model case). "right_padded": eos only at the end, then padding.
# "left_padded": padding first.
ROWS = {
    "eos_inside": [[1, 10, 11, 2, 12, 13, 14, 2, 2, 2], [1, 20, 2, 21, 22, 23, 24, 25, 26, 2]],
    "right_padded": [[1, 10, 11, 12, 13, 14, 2, 2, 2, 2], [1, 20, 21, 22, 23, 24, 25, 26, 27, 28]],
    "left_padded": [[2, 2, 2, 1, 10, 11, 12, 13, 14, 15], [1, 20, 21, 22, 23, 24, 25, 26, 27, 28]],
}


def probe(family: str = "llama", rows: str = "eos_inside") -> Observation:
    """Score two rows with a tiny ``family`` classifier (pad = eos): do the pooled logits and the loss
    equal the head applied to each row's last non-pad token, as the docs (and 4.49+) say?"""
    import torch

    model = tiny_classifier(family)
    input_ids = torch.tensor(ROWS[rows])
    labels = torch.tensor([0, 1])
    with torch.no_grad(), _quiet():
        out = model(input_ids=input_ids, labels=labels)
        hidden = model.base_model(input_ids=input_ids)[0]
        last = last_non_pad(input_ids, 2)
        head = model.score(hidden[torch.arange(input_ids.shape[0]), last])
        loss = torch.nn.functional.cross_entropy(head, labels)
    gap = float((out.logits - head).abs().max())
    loss_gap = abs(float(out.loss) - float(loss))
    if gap > 1e-5 or loss_gap > 1e-5:
        return Observation(True, f"{family}/{rows}: pooled logits differ from the last non-pad token's by {gap:.3g} "
                                 f"(loss {float(out.loss):.4f} vs {float(loss):.4f})")
    return Observation(False, f"{family}/{rows}: pooled at the last non-pad token (max |diff| {gap:.1e})")


def _quiet():
    from .. import tiny

    return tiny.quiet()
