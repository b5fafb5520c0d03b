"""GRPO/RLOO score left-padded completions of absolute-position models (GPT-2 ...) at shifted positions.

Why: ``GRPOTrainer`` and ``RLOOTrainer`` left-pad the prompts of a batch, append the completions and
compute the per-token log-probs of the completions (the policy's for the loss, the reference model's for
the KL, the old policy's for the ratio) with ``_get_per_token_logps_and_entropies`` (``_get_per_token_logps``
before TRL 0.20), passing ``input_ids`` and ``attention_mask`` but no ``position_ids``. Models with learned
or sinusoidal *absolute* position embeddings whose transformers code falls back to ``arange`` when
``position_ids`` is None (GPT-2, GPT-Neo, GPT-BigCode/StarCoder from transformers 4.57, XGLM, CTRL, OpenAI
GPT) then put every token of a row with ``p`` pads at position ``i`` instead of ``i - p``. ``generate``
(and vLLM) sampled those completions with positions counted from the attention mask, so the log-probs the
loss trains are not those of the distribution that produced the samples: on a random tiny GPT-2 a row with
two pads is 0.2 nats off per token; upstream measured 34 nats per sequence on GPT-2 (trl#6800). RoPE and
ALiBi models are unaffected (a shift of every position leaves their attention unchanged). TRL's PPO builds
the positions itself (``attention_mask.cumsum(1) - 1``); GRPO and RLOO never did, up to 1.16.0, the newest.

The fix: wrap the scoring method of both trainers. When the model (unwrapped from DDP/DeepSpeed/FSDP/
``torch.compile`` and PEFT) is one of those model types, a forward pre-hook on its backbone
(``base_model``, e.g. ``GPT2Model``) is registered for the duration of the call. For a call without
``position_ids`` whose 2-D ``attention_mask`` has left padding, it passes
``position_ids = attention_mask.cumsum(-1) - 1`` (pads set to 1, as transformers 4.x ``generate`` and
GPT-BigCode <=4.56 compute them), the positions generation used. Every real token then gets the logits of
the unpadded sequence.

Applies to trl >=0.15.0 (the first GRPO with a scoring method) and every later release (no fix upstream:
trl#6800 is open, PR #6819 closed). Left alone, bit-identical: every other model type; batches without
left padding (there ``arange`` is already right); calls that pass ``position_ids`` or a cache; models whose
transformers code already counts positions from the mask (GPT-BigCode 4.52-4.56 counts them exactly this
way, so passing them changes nothing). Not covered: the experimental Online DPO trainer, and GRPO's
Liger path before TRL 1.13 (``_get_last_hidden_state`` reads ``model.model``, which GPT-2-style models do
not have: it fails before scoring anything).
"""

from __future__ import annotations

from .._util import acted, compiling
from ..spec import Observation, ProbeUnsupported, ShimSpec, Target, TargetMissing

# Decoder LMs whose position embeddings are absolute and default to arange, not to the attention mask.
ABSOLUTE_POSITION_TYPES = frozenset({"gpt2", "gpt_neo", "gpt_bigcode", "xglm", "ctrl", "openai-gpt"})
METHODS = ("_get_per_token_logps_and_entropies", "_get_per_token_logps")
PARAMS = ("model", "input_ids", "attention_mask")
TRAINERS = (("trl.trainer.grpo_trainer", "GRPOTrainer"), ("trl.trainer.rloo_trainer", "RLOOTrainer"))

SPEC = ShimSpec(
    id="trl_rl_scoring_position_ids",
    since="0.2.0",
    title="GRPO/RLOO score left-padded rows of absolute-position models (GPT-2 ...) at shifted positions",
    symptom="GRPOTrainer/RLOOTrainer with GPT-2, GPT-Neo, GPT-BigCode, XGLM, CTRL, OpenAI GPT: the log-probs of every "
    "completion whose prompt was left-padded are computed at positions shifted by the pad count (0.2 nats a token on "
    "a tiny GPT-2, 34 nats a sequence on GPT-2), not those of the distribution generate() sampled from",
    why="TRL's GRPO and RLOO pass left-padded prompt+completion rows to the model without position_ids; models with "
    "absolute position embeddings then count positions from the first pad, unlike generation. The shim passes the "
    "positions counted from the attention mask, as generate() and TRL's PPO do.",
    requires={"trl": ">=0.15.0"},
    fixed_in={},
    refs=(
        "https://github.com/huggingface/trl/issues/6800",
        "https://github.com/huggingface/trl/pull/6819",
        "https://github.com/huggingface/trl/issues/469",
    ),
    targets=(
        Target("trl.trainer.grpo_trainer", "GRPOTrainer._get_per_token_logps", params=PARAMS, when="<0.20.0"),
        Target("trl.trainer.grpo_trainer", "GRPOTrainer._get_per_token_logps_and_entropies", params=PARAMS,
               when=">=0.20.0"),
        Target("trl.trainer.rloo_trainer", "RLOOTrainer._get_per_token_logps_and_entropies", params=PARAMS,
               when=">=0.22.0"),
    ),
    modules=("trl",),
)


def language_model(model):
    """The ``PreTrainedModel`` inside DDP/DeepSpeed/FSDP(1) wrappers, ``torch.compile`` and a PeftModel."""
    import torch

    for _ in range(8):
        inner = getattr(model, "_orig_mod", None)  # torch.compile
        if not isinstance(inner, torch.nn.Module):
            inner = getattr(model, "module", None)  # DDP, DeepSpeedEngine, FSDP1
        if not isinstance(inner, torch.nn.Module):
            break
        model = inner
    get_base = getattr(model, "get_base_model", None)  # PeftModel
    if callable(get_base):
        model = get_base()
    return model


def affected_backbone(model):
    """The backbone module to hook when ``model`` is an absolute-position LM; else None."""
    import torch

    try:
        lm = language_model(model)
        model_type = getattr(getattr(lm, "config", None), "model_type", None)
        if model_type not in ABSOLUTE_POSITION_TYPES:
            return None
        backbone = getattr(lm, "base_model", lm)
    except Exception:  # noqa: BLE001 - an unusual wrapper: no decision, no change
        return None
    return backbone if isinstance(backbone, torch.nn.Module) else None


def mask_positions(attention_mask):
    """Positions counted from the mask, pads set to 1 (transformers 4.x ``generate``, GPT-BigCode <=4.56)."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill_(attention_mask == 0, 1)


def _pre_hook(module, args, kwargs):
    import torch

    if kwargs.get("position_ids") is not None or len(args) > 1:
        return None
    if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
        return None  # a continuation: positions depend on the cache, not this mask alone
    mask = kwargs.get("attention_mask")
    if not (torch.is_tensor(mask) and mask.dim() == 2):
        return None
    tokens = args[0] if args else kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    if tokens is None or tokens.shape[:2] != mask.shape:
        return None
    left_padded = (mask[:, 0] == 0).any()
    if compiling():
        # No Python branch on a tensor inside a trace: arange (upstream's default) unless a row is left-padded.
        arange = torch.arange(mask.shape[1], device=mask.device).expand(mask.shape)
        kwargs["position_ids"] = torch.where(left_padded, mask_positions(mask), arange)
        return args, kwargs
    if not bool(left_padded):
        return None  # no left padding: arange already is the mask's count at every real token
    kwargs["position_ids"] = mask_positions(mask)
    acted(SPEC.id, "left-padded scoring batches given mask positions")
    return args, kwargs


def _scoring(wrapped, instance, args, kwargs):
    model = args[0] if args else kwargs.get("model")
    backbone = affected_backbone(model)
    if backbone is None:
        return wrapped(*args, **kwargs)
    handle = backbone.register_forward_pre_hook(_pre_hook, with_kwargs=True)
    try:
        return wrapped(*args, **kwargs)
    finally:
        handle.remove()


def install(patcher, options) -> None:
    import inspect

    def part(class_name):
        def install_part(module):
            cls = vars(module).get(class_name)
            if not isinstance(cls, type):
                raise TargetMissing(f"{module.__name__}.{class_name} is missing")
            found = [name for name in METHODS if inspect.isfunction(vars(cls).get(name))]
            if not found:
                raise TargetMissing(f"{module.__name__}.{class_name} has no {' or '.join(METHODS)}")
            method = vars(cls)[found[0]]
            params = list(inspect.signature(method).parameters)[1:4]
            if params != list(PARAMS):
                raise TargetMissing(f"{class_name}.{found[0]}{tuple(params)}: not (model, input_ids, attention_mask, ...)")
            patcher.wrap(cls, found[0], _scoring)

        return install_part

    for module_name, class_name in TRAINERS:
        patcher.when_imported(module_name, part(class_name))


# ---------------------------------------------------------------------------
# Reproduction

PROMPTS = [[5, 6, 7, 8], [0, 0, 7, 8]]  # the second prompt left-padded by two (pad id 0)
COMPLETION = [9, 10, 11]


def trainer_for(model_type: str = "gpt2", trainer: str = "grpo"):
    """A real ``GRPOTrainer``/``RLOOTrainer`` on a tiny random model (vocabulary of 16 words, no hub)."""
    import tempfile
    import warnings

    from .. import tiny

    try:
        if trainer == "grpo":
            from trl import GRPOConfig as Config
            from trl import GRPOTrainer as Trainer
        else:
            from trl import RLOOConfig as Config
            from trl import RLOOTrainer as Trainer
    except (ImportError, RuntimeError) as exc:  # TRL's lazy module turns a failed import into a RuntimeError
        raise ProbeUnsupported(f"this TRL's {trainer.upper()}Trainer cannot be imported here ({exc})") from None
    if not any(callable(getattr(Trainer, name, None)) for name in METHODS):
        raise ProbeUnsupported(f"this TRL's {Trainer.__name__} has no per-token scoring method")
    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(12)]
    tok = tiny.word_tokenizer(words, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fields = dict(vocab_size=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if model_type == "gpt2":
        model = tiny.causal_lm("GPT2Config", n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **fields)
    else:
        model = tiny.tiny_llama(**fields)
    from datasets import Dataset

    with tempfile.TemporaryDirectory() as out, tiny.quiet(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = Config(output_dir=out, per_device_train_batch_size=2, num_generations=2, max_completion_length=4,
                      report_to=[], use_cpu=True, bf16=False, beta=0.0)
        return Trainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                       train_dataset=Dataset.from_dict({"prompt": ["w1 w2", "w3"]}), processing_class=tok)


def completion_logps(trainer, input_ids, attention_mask):
    import torch

    method = next(getattr(trainer, name) for name in METHODS if callable(getattr(trainer, name, None)))
    with torch.no_grad():
        out = method(trainer.model, input_ids, attention_mask, len(COMPLETION))
    return (out[0] if isinstance(out, tuple) else out).float()


def probe(model_type: str = "gpt2", trainer: str = "grpo") -> Observation:
    """The trainer's scoring method on two prompt+completion rows, the second prompt left-padded by two:
    are the completion log-probs of the padded row those of the same tokens without the padding?"""
    import torch

    rl = trainer_for(model_type, trainer)
    ids = torch.tensor([p + COMPLETION for p in PROMPTS])
    mask = (ids != 0).long()
    padded = completion_logps(rl, ids, mask)
    alone = completion_logps(rl, ids[1:, 2:], mask[1:, 2:])
    error = float((padded[1] - alone[0]).abs().max())
    detail = (f"{model_type} {type(rl).__name__}: completion log-probs of the left-padded row "
              f"{[round(v, 4) for v in padded[1].tolist()]} vs unpadded {[round(v, 4) for v in alone[0].tolist()]} "
              f"(max difference {error:.2e})")
    return Observation(error > 1e-4, detail)
