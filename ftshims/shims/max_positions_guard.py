"""Inputs longer than ``max_position_embeddings``: a clear error, a warning, or a truncation instead of a crash.

Why: transformers does not check the sequence length against the model's
positions (only ``generate()`` prints a "friendly reminder"). Measured on every
pinned stack (4.30.2 - 5.24.0, CPU, tiny models with 16 positions, 20 and 40
tokens):

* learned absolute positions (GPT-2, OPT, BART, BERT, ...) die inside the
  forward pass with ``IndexError: index out of range in self`` in the
  position-embedding lookup; on CUDA the same lookup is a device-side assert,
  which poisons the CUDA context of the whole process (transformers#1749,
  LlamaFactory#5351);
* rotary models (Llama, Mistral, Qwen2, ...) extrapolate silently: no error,
  no warning, and quality degrades past the trained length.

(The 4.38.0 - 4.38.2 ``causal_mask`` buffer that grows only once is a bug of
its own with a real fix: see ``causal_mask_buffer_regrow``.)

The guard, at model entry: ``PreTrainedModel.__call__`` is wrapped; the
outermost model call (nested PreTrainedModels such as ``LlamaModel`` inside
``LlamaForCausalLM`` pass straight through) compares the positions the input
needs with what the model has, *before* any kernel runs.

Which limit, found once per model: the bound comes from the tower that
``input_ids`` actually pass through. Starting at the module
``get_input_embeddings()`` returns (every path to it, so shared encoder /
decoder embeddings count on both sides), the guard walks up to the smallest
module that holds a position source: a ``*RotaryEmbedding`` module means RoPE
(limit = that tower's ``config.max_position_embeddings``; a RoPE tower is never
treated as learned), else an ``nn.Embedding`` named ``wpe``, ``embed_positions``,
``position_embeddings`` or ``position_embedding`` means learned positions
(usable size = table rows minus the OPT/BART ``offset`` or the RoBERTa padding
offset). So the vision tower of a CLIP or a LLaVA, or Whisper's audio
encoder, never bounds a text input; nor does the walk leave a sub-model
(a ``PreTrainedModel`` inside the model: Kosmos-2's text model, whose positions are sinusoidal). A model whose input embedding is unknown
(``get_input_embeddings()`` not implemented, e.g. ``CLIPModel``) or whose tower
has no position source (ALiBi, relative positions, T5, ...) is left alone,
and the reason is in the shim's notes (``ftshims.status()``), once per class.

Needed positions = cached tokens + new tokens; only when that exceeds the limit
is the exact need computed (the largest ``position_ids`` + 1 when they are
given, or the longest unpadded length for OPT, whose positions follow the
attention mask), so left-padded or packed batches that really fit are not
rejected, unless the tower also keeps a square boolean causal buffer (GPT-2's
``attn.bias`` up to 4.57), which caps the token count itself. Encoder-decoder
models are checked on both sides.

Policy (option ``policy`` of ``apply(options={"max_positions_guard": {...}})``,
else the environment variable ``FTSHIMS_MAX_POSITIONS_POLICY``, else ``auto``;
read and checked by ``apply()``, which raises ``ValueError`` for any other
value before installing anything):

* ``auto`` (default): ``error`` for learned positions, ``warn`` for RoPE;
* ``error``: ``ValueError`` naming the model type, the needed length, the limit
  and the remedies;
* ``warn``: one ``PositionLimitWarning`` per model, then the call proceeds
  unchanged (a learned-position model then fails as it does without ftshims);
* ``truncate``: keep the first ``limit - cached`` tokens of the inputs and of
  every per-token tensor (attention masks, labels, position ids, token type
  ids, cache positions), with one warning per model. Impossible when the cache
  alone fills the limit: then ``ValueError``.

Applies to transformers >= 4.30 (no release checks the length; unfixed in
5.24.0). Skipped while ``torch.compile`` traces (the check is Python-side).
"""

from __future__ import annotations

import inspect
import sys
import threading
import warnings
import weakref
from typing import Any, Dict, List, Optional, Tuple

from .._util import acted, cache_length, compiling, user_stacklevel, warn_once
from ..spec import Choice, Observation, ProbeUnsupported, ShimSpec, Target

ENV_POLICY = "FTSHIMS_MAX_POSITIONS_POLICY"
POLICIES = ("auto", "error", "warn", "truncate")

SPEC = ShimSpec(
    id="max_positions_guard",
    since="0.1.0",
    title="Inputs longer than max_position_embeddings: clear error / warning / truncation instead of a crash",
    symptom="`IndexError: index out of range in self` (CUDA: device-side assert) for GPT-2/OPT/BART..., silent RoPE "
    "extrapolation",
    why="transformers does not check the sequence length against the model's position table: learned tables fail with an index error or read out of range, RoPE models run past their trained context silently. The shim checks the length of the tower input_ids pass through and raises a clear error (or warns/truncates, by policy).",
    effect='guards',
    requires={"transformers": ">=4.30"},
    fixed_in={},
    refs=(
        "https://github.com/huggingface/transformers/issues/1749",
        "https://github.com/hiyouga/LlamaFactory/issues/5351",
    ),
    targets=(
        # PreTrainedModel.__call__ (inherited from torch.nn.Module) is what gets wrapped.
        Target("transformers.modeling_utils", "PreTrainedModel"),
    ),
    modules=("transformers.modeling_utils",),
    options={"policy": None},
    choices={"policy": Choice(values=POLICIES, env=ENV_POLICY)},
)

_LEARNED_NAMES = ("wpe", "embed_positions", "position_embeddings", "position_embedding")


class PositionLimitWarning(UserWarning):
    """An input is longer than the model's positions (RoPE extrapolation, or a truncation)."""


# ---------------------------------------------------------------------------
# Per-model profile, computed once


class _Side:
    """One stream of positions: the model's input, or the encoder / decoder side of a seq2seq model."""

    __slots__ = ("name", "limit", "from_mask")

    def __init__(self, name: str, limit: int, from_mask: bool):
        self.name = name
        self.limit = limit
        self.from_mask = from_mask  # OPT: positions are the cumulative sum of the attention mask


class _Profile:
    __slots__ = ("kind", "model_type", "config_limit", "sides", "seq2seq", "bounded", "params", "reason", "__weakref__")

    def __init__(self):
        self.kind: Optional[str] = None  # "learned" | "rope" | None (left alone; ``reason`` says why)
        self.model_type = "model"
        self.config_limit: Optional[int] = None
        self.sides: Dict[str, _Side] = {}
        self.seq2seq = False
        # a square boolean causal buffer (GPT-2's ``attn.bias`` up to 4.57) caps the number of tokens, whatever
        # the position ids say: then only cached + new tokens count
        self.bounded = False
        self.params: Tuple[str, ...] = ()
        self.reason = ""


def _config_limit(config) -> Optional[int]:
    value = getattr(config, "max_position_embeddings", None)
    if value is None and hasattr(config, "get_text_config"):
        value = getattr(config.get_text_config(), "max_position_embeddings", None)
    return int(value) if isinstance(value, int) else None


def _usable(embedding) -> int:
    offset = getattr(embedding, "offset", None)
    if not isinstance(offset, int):
        padding = getattr(embedding, "padding_idx", None)
        offset = padding + 1 if isinstance(padding, int) else 0  # RoBERTa: positions start after padding_idx
    return embedding.num_embeddings - offset


def _input_embedding_paths(model) -> Tuple[List[str], str]:
    """Every module path of the embedding ``input_ids`` go through, or ``([], why not)``."""
    try:
        embedding = model.get_input_embeddings()
    except (NotImplementedError, AttributeError, TypeError) as exc:
        return [], f"get_input_embeddings() is not available ({type(exc).__name__})"
    if embedding is None:
        return [], "get_input_embeddings() returned None"
    paths = [name for name, module in model.named_modules(remove_duplicate=False) if module is embedding]
    if not paths:
        return [], "its input embedding is not one of its submodules"
    return paths, ""


def _position_sources(modules) -> Tuple[List[Tuple[str, Any]], bool]:
    """Learned position tables ``(path, embedding)`` and whether a rotary module is among ``modules``."""
    import torch

    learned, rope = [], False
    for name, module in modules:
        if isinstance(module, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in _LEARNED_NAMES:
            learned.append((name, module))
        elif "RotaryEmbedding" in type(module).__name__:
            rope = True
    return learned, rope


def _tower(model, path: str, all_modules):
    """The smallest module above the input embedding at ``path`` that holds a position source: the
    tower ``input_ids`` run through (the language model of a LLaVA, the text model of a CLIP text
    encoder, the decoder of OPT). Returns ``(prefix, learned tables, rope, config)``."""
    from transformers import PreTrainedModel

    parts = path.split(".")[:-1]
    by_path = dict(all_modules)
    while True:
        prefix = ".".join(parts)
        inside = [(n, m) for n, m in all_modules if not prefix or n == prefix or n.startswith(prefix + ".")]
        learned, rope = _position_sources(inside)
        owner = by_path.get(prefix, model) if prefix else model
        if learned or rope or not parts or isinstance(owner, PreTrainedModel):
            # A sub-model (a PreTrainedModel: Kosmos-2's text model) is the text tower whole: when it has no
            # position table of its own (sinusoidal, relative), a sibling tower's table (the vision model's 17
            # patch positions) does not bound its input.
            return prefix, learned, rope, getattr(owner, "config", None)
        parts.pop()


def _build_profile(model) -> _Profile:
    import torch

    profile = _Profile()
    config = getattr(model, "config", None)
    profile.model_type = getattr(config, "model_type", None) or type(model).__name__
    profile.config_limit = _config_limit(config) if config is not None else None
    try:
        profile.params = tuple(list(inspect.signature(type(model).forward).parameters)[1:])
    except (TypeError, ValueError):
        profile.params = ()
    profile.seq2seq = "decoder_input_ids" in profile.params
    if "input_ids" not in profile.params and "decoder_input_ids" not in profile.params:
        profile.reason = "its forward takes no input_ids"
        return profile
    paths, why = _input_embedding_paths(model)
    if not paths:
        profile.reason = why
        return profile
    all_modules = list(model.named_modules(remove_duplicate=False))
    rope = False
    rope_limit = None
    towers = []
    for path in paths:
        prefix, learned, tower_rope, tower_config = _tower(model, path, all_modules)
        towers.append(prefix)
        if tower_rope:
            rope = True
            limit = _config_limit(tower_config) if tower_config is not None else None
            rope_limit = limit if limit is not None else profile.config_limit
            continue
        for name, module in learned:
            side = "main"
            if profile.seq2seq:
                side = "decoder" if "decoder" in name else "encoder"
            try:
                params = list(inspect.signature(type(module).forward).parameters)
            except (TypeError, ValueError):
                params = []
            from_mask = len(params) > 1 and params[1] == "attention_mask"
            limit = _usable(module)
            known = profile.sides.get(side)
            if known is None or limit < known.limit:
                profile.sides[side] = _Side(side, limit, from_mask)
    if rope:
        # A RoPE tower is never treated as learned, whatever tables sit beside it.
        profile.sides = {}
        if not rope_limit:
            profile.reason = "a rotary model whose max_position_embeddings is unknown"
            return profile
        profile.kind = "rope"
        side = "decoder" if profile.seq2seq else "main"
        profile.sides[side] = _Side(side, rope_limit, False)
        profile.config_limit = rope_limit
    elif profile.sides:
        profile.kind = "learned"
    else:
        profile.reason = "no learned position table or rotary embedding in the tower input_ids go through"
        return profile
    for name, module in all_modules:
        if towers and not any(not t or name == t or name.startswith(t + ".") for t in towers):
            continue
        for buffer in getattr(module, "_buffers", {}).values():
            if (
                isinstance(buffer, torch.Tensor)
                and buffer.dim() >= 2
                and buffer.dtype in (torch.bool, torch.uint8)
                and buffer.shape[-1] == buffer.shape[-2] > 1
            ):
                profile.bounded = True
    return profile


_PROFILES: "weakref.WeakKeyDictionary[Any, _Profile]" = weakref.WeakKeyDictionary()
_WARNED: "weakref.WeakKeyDictionary[Any, set]" = weakref.WeakKeyDictionary()


# ---------------------------------------------------------------------------
# Reading the call


class _Call:
    """The call's arguments by name (positional ones mapped through ``forward``'s signature)."""

    def __init__(self, params: Tuple[str, ...], args: tuple, kwargs: dict):
        self.params = params
        self.args = args
        self.kwargs = kwargs

    def get(self, name: str) -> Any:
        if name in self.kwargs:
            return self.kwargs[name]
        try:
            index = self.params.index(name)
        except ValueError:
            return None
        return self.args[index] if index < len(self.args) else None

    def as_kwargs(self) -> dict:
        merged = dict(zip(self.params, self.args))
        merged.update(self.kwargs)
        return merged


def _length(tensor, dim: int) -> Optional[int]:
    shape = getattr(tensor, "shape", None)
    if shape is None:
        return None
    try:
        return int(shape[dim])
    except IndexError:
        return None


# names of the inputs of each side: (ids, embeds, mask, per-token extras)
_MAIN = ("input_ids", "inputs_embeds", "attention_mask", ("labels", "position_ids", "token_type_ids"))
_ENCODER = ("input_ids", "inputs_embeds", "attention_mask", ("position_ids", "token_type_ids"))
_DECODER = ("decoder_input_ids", "decoder_inputs_embeds", "decoder_attention_mask", ("labels", "decoder_position_ids"))


def _side_inputs(profile: _Profile, side: str):
    if not profile.seq2seq:
        return _MAIN
    return _DECODER if side == "decoder" else _ENCODER


def _new_tokens(call: _Call, names, profile: _Profile, side: str) -> Optional[int]:
    ids, embeds = call.get(names[0]), call.get(names[1])
    if ids is not None:
        return _length(ids, -1)
    if embeds is not None:
        return _length(embeds, 1)
    if side == "decoder":  # BART-style: decoder inputs derived from labels, else from input_ids
        for fallback in ("labels", "input_ids"):
            value = call.get(fallback)
            if value is not None:
                return _length(value, -1)
    return None


def _needed(call: _Call, profile: _Profile, side: _Side, names, new: int, past: int) -> int:
    """Positions the call really needs (exact, computed only once the cheap bound is over the limit)."""
    if profile.bounded:
        return past + new
    position_name = "decoder_position_ids" if side.name == "decoder" else "position_ids"
    positions = call.get(position_name)
    if positions is not None and hasattr(positions, "max") and positions.numel():
        return int(positions.max()) + 1
    mask = call.get(names[2])
    if side.from_mask and mask is not None and getattr(mask, "dim", lambda: 0)() == 2:
        return int(mask.sum(-1).max())
    return past + new


# ---------------------------------------------------------------------------
# Acting on it


def _message(profile: _Profile, side: _Side, need: int, new: int, past: int, policy: str) -> str:
    where = f" ({side.name} side)" if profile.seq2seq else ""
    length = f"{new} tokens" + (f" after {past} cached" if past else "")
    config = f" (config.max_position_embeddings={profile.config_limit})" if profile.config_limit is not None else ""
    if profile.kind == "learned":
        return (
            f"{profile.model_type}{where}: the input needs {need} positions ({length}) but the model has "
            f"{side.limit} learned position embeddings{config}. Running it would fail in the position-embedding "
            f"lookup with `IndexError: index out of range in self` (on CUDA a device-side assert that breaks the "
            f"CUDA context). Remedies: truncate to at most {side.limit} tokens (tokenizer(..., truncation=True, "
            f"max_length={side.limit})), split long inputs into chunks or a sliding window, or use a model with "
            f"more positions; or let ftshims truncate: apply(options={{'max_positions_guard': {{'policy': "
            f"'truncate'}}}}) or {ENV_POLICY}=truncate. [ftshims max_positions_guard, policy {policy!r}]"
        )
    return (
        f"{profile.model_type}{where}: the input needs {need} positions ({length}), beyond the {side.limit} the "
        f"model was trained with (config.max_position_embeddings); rotary position embeddings extrapolate "
        f"silently and quality usually degrades past the trained length. Remedies: truncate to at most "
        f"{side.limit} tokens, configure RoPE scaling (config.rope_scaling), or use a long-context model. "
        f"[ftshims max_positions_guard, policy {policy!r}; shown once per model]"
    )


def _warn_once(model, key: str, message: str) -> None:
    warn_once(_WARNED.setdefault(model, set()), key,
              lambda: warnings.warn(message, PositionLimitWarning, stacklevel=user_stacklevel()))


def _truncate(call: _Call, profile: _Profile, side: _Side, names, new: int, past: int, keep: int) -> None:
    """Cut every per-token input of ``side`` to its first ``keep`` new tokens (in place on ``call``)."""
    kwargs = call.as_kwargs()
    ids, embeds, mask_name, extras = names
    for name in (ids, *extras):
        value = kwargs.get(name)
        if value is not None and _length(value, -1) == new:
            kwargs[name] = value[..., :keep]
    value = kwargs.get(embeds)
    if value is not None and _length(value, 1) == new:
        kwargs[embeds] = value[:, :keep]
    mask = kwargs.get(mask_name)
    if mask is not None and hasattr(mask, "dim"):
        if mask.dim() == 2 and mask.shape[-1] == past + new:
            kwargs[mask_name] = mask[:, : past + keep]
        elif mask.dim() == 4 and mask.shape[-2] == new:
            kwargs[mask_name] = mask[:, :, :keep, : past + keep]
    if side.name != "encoder":
        cache_position = kwargs.get("cache_position")
        if cache_position is not None and _length(cache_position, 0) == new:
            kwargs["cache_position"] = cache_position[:keep]
    call.args, call.kwargs = (), kwargs


class _Guard:
    def __init__(self, policy: str, notes: List[str]):
        self.policy = policy
        self.notes = notes  # the shim's notes in status(): models left alone, and why (once per class)
        self.local = threading.local()

    def profile(self, model) -> _Profile:
        profile = _PROFILES.get(model)
        if profile is None:
            profile = _build_profile(model)
            _PROFILES[model] = profile
            if profile.kind is None:
                note = f"{type(model).__name__} left alone: {profile.reason}"
                if note not in self.notes:
                    self.notes.append(note)
        return profile

    def __call__(self, wrapped, instance, args, kwargs):
        depth = getattr(self.local, "depth", 0)
        if depth or instance is None:
            return wrapped(*args, **kwargs)
        profile = self.profile(instance)
        if profile.kind is not None:
            args, kwargs = self.check(instance, profile, args, kwargs)
        self.local.depth = depth + 1
        try:
            return wrapped(*args, **kwargs)
        finally:
            self.local.depth = depth

    def check(self, model, profile: _Profile, args, kwargs):
        call = _Call(profile.params, args, kwargs)
        policy = self.policy
        if policy == "auto":
            policy = "error" if profile.kind == "learned" else "warn"
        for side in list(profile.sides.values()):
            if side.name == "encoder" and call.get("encoder_outputs") is not None:
                continue
            names = _side_inputs(profile, side.name)
            new = _new_tokens(call, names, profile, side.name)
            if new is None:
                continue
            past = 0 if side.name == "encoder" else cache_length(call.get("past_key_values"))
            if past + new > side.limit:
                need = _needed(call, profile, side, names, new, past)
                if need > side.limit:
                    acted(SPEC.id, f"inputs over the position limit ({policy})")
                    if policy == "error":
                        raise ValueError(_message(profile, side, need, new, past, self.policy))
                    if policy == "truncate":
                        keep = side.limit - past
                        if keep <= 0:
                            raise ValueError(
                                _message(profile, side, need, new, past, self.policy)
                                + f" Cannot truncate: the cache already holds {past} of the {side.limit} positions."
                            )
                        _truncate(call, profile, side, names, new, past, keep)
                        _warn_once(
                            model,
                            f"truncate:{side.name}",
                            f"{profile.model_type}: input of {need} positions truncated to its first {side.limit} "
                            f"(the model's max_position_embeddings); masks and labels were cut to match. "
                            f"[ftshims max_positions_guard, policy 'truncate'; shown once per model]",
                        )
                        new = keep
                    else:
                        _warn_once(model, f"warn:{side.name}", _message(profile, side, need, new, past, self.policy))
        return call.args, call.kwargs


def install(patcher, options) -> None:
    # apply() has checked the option and FTSHIMS_MAX_POSITIONS_POLICY (ftshims.settings) and put the winner here.
    policy = options.get("policy") or "auto"
    modeling_utils = sys.modules["transformers.modeling_utils"]
    guard = _Guard(policy, patcher.notes)

    def call(wrapped, instance, args, kwargs):
        if compiling():
            return wrapped(*args, **kwargs)  # a Python-side check: not inside a torch.compile trace
        return guard(wrapped, instance, args, kwargs)

    patcher.wrap(modeling_utils.PreTrainedModel, "__call__", call)


# ---------------------------------------------------------------------------
# Probe

MAX_POSITIONS = 16
LONG = 24  # > MAX_POSITIONS and < 2 x MAX_POSITIONS: 4.38.0-4.38.2 regrow their causal_mask buffer once that far

FAMILIES = {
    "llama": ("LlamaConfig", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                  num_key_value_heads=4, max_position_embeddings=MAX_POSITIONS)),
    "gpt2": ("GPT2Config", dict(vocab_size=128, n_embd=32, n_layer=1, n_head=4, n_positions=MAX_POSITIONS)),
    "opt": ("OPTConfig", dict(vocab_size=128, hidden_size=32, ffn_dim=64, num_hidden_layers=1, num_attention_heads=4,
                              max_position_embeddings=MAX_POSITIONS, word_embed_proj_dim=32)),
    "bart": ("BartConfig", dict(vocab_size=128, d_model=32, decoder_ffn_dim=64, encoder_ffn_dim=64, decoder_layers=1,
                                encoder_layers=1, decoder_attention_heads=4, encoder_attention_heads=4,
                                max_position_embeddings=MAX_POSITIONS)),
}


def build(family: str = "gpt2", seed: int = 0):
    """A tiny causal LM of ``family`` with MAX_POSITIONS positions (eager attention)."""
    import transformers

    from .. import tiny

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, not {family!r}")
    config_class, fields = FAMILIES[family]
    if not hasattr(transformers, config_class):
        raise ProbeUnsupported(f"transformers {transformers.__version__} has no {config_class}")
    with tiny.quiet():
        return tiny.causal_lm(config_class, attn="eager", seed=seed, **fields).eval()


def run(model, length: int = LONG, mask: bool = True, labels: bool = False, seed: int = 0):
    """One forward pass on ``length`` random tokens. Returns ``(output, error, position_warnings, kernels_run)``.

    ``kernels_run`` counts the submodule forwards that started (0 means the call
    was stopped before any kernel); ``position_warnings`` are the warnings that
    mention ``max_position_embeddings``.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (1, length), generator=generator)
    kwargs = {"input_ids": ids}
    if mask:
        kwargs["attention_mask"] = torch.ones_like(ids)
    if labels:
        kwargs["labels"] = ids.clone()
    started = []
    handles = [m.register_forward_pre_hook(lambda *_: started.append(1)) for m in model.modules() if m is not model]
    output = error = None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with torch.no_grad():
                    output = model(**kwargs)
            except Exception as exc:  # the probe reports what happened, whatever it is
                error = exc
    finally:
        for handle in handles:
            handle.remove()
    relevant = [w for w in caught if "max_position_embeddings" in str(w.message)]
    return output, error, relevant, len(started)


def probe(family: str = "gpt2", length: int = LONG, mask: bool = True) -> Observation:
    """An input of ``length`` tokens into a ``family`` model with MAX_POSITIONS positions.

    The bug: the input is neither stopped by a clear ``ValueError`` (naming the
    model type, the length and the limit) before any kernel, nor run with a
    warning; instead it crashes inside the model or extrapolates silently.
    """
    import torch

    model = build(family)
    output, error, warned, kernels = run(model, length, mask=mask)
    limit = MAX_POSITIONS
    if error is not None:
        text = str(error)
        clear = isinstance(error, ValueError) and all(s in text for s in (str(length), str(limit), model.config.model_type))
        if clear and kernels == 0:
            return Observation(False, f"{family}: clear ValueError before any kernel: {text[:120]}...")
        where = "before any kernel" if kernels == 0 else f"after {kernels} submodule calls"
        return Observation(True, f"{family} L={length} > {limit}: {type(error).__name__} {where}: {text[:120]}")
    logits = output.logits
    if not torch.isfinite(logits).all():
        return Observation(True, f"{family} L={length} > {limit}: non-finite logits")
    if not warned:
        return Observation(True, f"{family} L={length} > {limit}: ran with no warning (silent extrapolation)")
    warning = str(warned[0].message)[:100]
    return Observation(False, f"{family} L={length} > {limit}: ran ({logits.shape[1]} positions) with a warning: {warning}...")
