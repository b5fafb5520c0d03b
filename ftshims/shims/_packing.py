"""Shared code of the packing shims: finding packed segments, building block masks, and
the reproductions the probes and tests share.

Not a shim (the module name starts with ``_``). Importing it imports neither
torch nor transformers; every function imports them inside.

Vocabulary:

* a *packed row* holds several examples one after the other; each example's
  ``position_ids`` restart at 0. A *segment* is one example's span.
* a *block-causal mask* lets a token attend to earlier tokens of its own
  segment only (and never to padding).
* mask *forms* of a custom 4D mask ``[batch, 1, query, key]``: ``"additive"``
  (0 = attend, ``finfo(dtype).min`` = masked, added to the scores),
  ``"binary"`` (float 1 = attend, 0 = masked) and ``"bool"`` (True = attend).
  Which one a model reads correctly depends on the transformers version and on
  the helper its modeling file builds masks with. The shims always hand the
  model an additive mask in its dtype, and where its mask code would ignore,
  misread or reject that, they wrap the code to pass the mask through
  (:func:`needs_passthrough`).
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import sys
from typing import Dict, NamedTuple, Optional, Tuple

from .._util import compiling, method_binder

log = logging.getLogger("ftshims")

# model_type -> (modeling module, decoder base-model class). Decoder-only families whose
# base model builds one causal mask for every layer. Families with per-layer masks
# (gemma2/3, cohere2, ...) or softcapping are deliberately absent: one 4D mask
# cannot describe them.
_BASE_MODELS = (
    ("llama", "LlamaModel"), ("mistral", "MistralModel"), ("mixtral", "MixtralModel"), ("qwen2", "Qwen2Model"),
    ("qwen2_moe", "Qwen2MoeModel"), ("qwen3", "Qwen3Model"), ("qwen3_moe", "Qwen3MoeModel"), ("phi3", "Phi3Model"),
    ("gemma", "GemmaModel"), ("granite", "GraniteModel"), ("olmo", "OlmoModel"), ("olmo2", "Olmo2Model"),
    ("starcoder2", "Starcoder2Model"),
)
# family -> (modeling module, base model class)
FAMILIES: Dict[str, Tuple[str, str]] = {
    family: (f"transformers.models.{family}.modeling_{family}", cls) for family, cls in _BASE_MODELS
}

EAGER_LIKE = ("eager", "sdpa")
FLASH = ("flash_attention_2", "flash_attention_3")

ADDITIVE, BINARY, BOOL = "additive", "binary", "bool"


_VERSION = []


def transformers_version():
    """The installed transformers version (read once from metadata; never imports transformers)."""
    if not _VERSION:
        from packaging.version import Version

        from ..versions import installed_version

        _VERSION.append(Version(installed_version("transformers") or "0"))
    return _VERSION[0]


# ---------------------------------------------------------------------------
# Reading the call


def takes_extra_kwargs(forward) -> bool:
    """Whether ``forward`` has a ``**kwargs`` catch-all (passed on to the attention layers from 4.47)."""
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(forward).parameters.values())


def cache_key(kwargs) -> str:
    """The name of the cache argument: ``past_key_values`` (<=4.57) or ``cache`` (5.x)."""
    return "cache" if "cache" in kwargs else "past_key_values"


def window_of(config) -> Optional[int]:
    """The model's sliding attention window, when one is active."""
    if getattr(config, "use_sliding_window", True) is False:
        return None
    window = getattr(config, "sliding_window", None)
    return int(window) if isinstance(window, int) and window > 0 else None


def embed_dtype(model, kwargs):
    embeds = kwargs.get("inputs_embeds")
    if embeds is not None:
        return embeds.dtype
    return model.get_input_embeddings().weight.dtype


# ---------------------------------------------------------------------------
# Segments and masks


def segments(position_ids, attention_mask=None, always: bool = False):
    """``(segment_ids, real)`` for a batch whose rows hold several examples, else None.

    A new segment starts wherever ``position_ids`` restart at 0 between two real
    (non-padding) tokens. ``real`` is the 2D padding mask as bool (all True when
    there is none). Padding next to a restart does not count, so the position
    ids of a left-padded generation batch (``[1, 1, 0, 1, 2]``) are not packed.
    Returns None for 1D/3D position ids, a single token, or rows with one example.

    ``always=True`` (under ``torch.compile``) skips that last, data-dependent
    test: rows of one example then get one segment each, whose block-causal
    mask is the plain causal mask with padding.
    """
    import torch

    if not torch.is_tensor(position_ids) or position_ids.ndim != 2 or position_ids.shape[-1] < 2:
        return None
    batch, length = position_ids.shape
    if attention_mask is not None:
        if not torch.is_tensor(attention_mask) or attention_mask.ndim != 2 or attention_mask.shape[-1] != length:
            return None
        real = attention_mask.to(device=position_ids.device) != 0
        if real.shape[0] != batch:
            if batch != 1:
                return None
            position_ids = position_ids.expand(real.shape[0], -1)
    else:
        real = torch.ones_like(position_ids, dtype=torch.bool)
    starts = torch.zeros_like(real)
    starts[:, 1:] = (position_ids[:, 1:] == 0) & real[:, 1:] & real[:, :-1]
    if not always and not bool(starts.any()):
        return None
    return starts.long().cumsum(-1), real


def segment_lengths(segment_ids, real):
    """Lengths of the real segments, row by row (a flat list; for window checks and bench)."""
    import torch

    lengths = []
    for row_ids, row_real in zip(segment_ids, real):
        ids = row_ids[row_real]
        if ids.numel():
            lengths.extend(torch.unique_consecutive(ids, return_counts=True)[1].tolist())
    return lengths


def allowed_pairs(segment_ids, real, window: Optional[int] = None):
    """Bool ``[batch, 1, L, L]``: query i may attend key j (same segment, j <= i, j real).

    Every query also attends itself, so that no row is fully masked (a fully
    masked row turns into NaN in half precision and spreads through the keys).
    """
    import torch

    length = segment_ids.shape[-1]
    device = segment_ids.device
    idx = torch.arange(length, device=device)
    causal = idx[None, :] <= idx[:, None]
    if window is not None:
        causal = causal & (idx[:, None] - idx[None, :] < window)
    allowed = (segment_ids[:, :, None] == segment_ids[:, None, :]) & causal[None] & real[:, None, :]
    allowed = allowed | torch.eye(length, dtype=torch.bool, device=device)[None]
    return allowed[:, None]


def to_form(allowed, form: str, dtype):
    """A bool "may attend" mask in the requested form."""
    import torch

    if form == BOOL:
        return allowed
    if form == BINARY:
        return allowed.to(dtype)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


def read_form(mask) -> Optional[str]:
    """Which form a user's 4D mask is in: ``bool``, ``binary`` (floats in {0, 1} with a 1),
    ``additive`` (max 0), or None (something else: left alone)."""
    import torch

    if mask.dtype == torch.bool:
        return BOOL
    if not mask.is_floating_point():
        return BINARY if bool(((mask == 0) | (mask == 1)).all()) and bool((mask == 1).any()) else None
    top = float(mask.max())
    if top == 0.0:
        return ADDITIVE
    if top == 1.0 and bool(((mask == 0) | (mask == 1)).all()):
        return BINARY
    return None


def allowed_from(mask, form: str):
    """The bool "may attend" mask of a 4D mask in ``form``."""
    if form == BOOL:
        return mask
    if form == BINARY:
        return mask != 0
    return mask == 0


# ---------------------------------------------------------------------------
# Getting an additive 4D mask to the layers, on every version >= 4.37


def mask_helper(model_class) -> str:
    """How a decoder base class builds its mask: ``create_causal_mask`` (>=4.53 masking_utils),
    ``update_causal_mask`` (its own ``_update_causal_mask``, 4.38+) or ``attn_mask_utils``
    (the ``_prepare_4d_causal_attention_mask*`` helpers: every family on 4.37, mistral,
    qwen2, mixtral, phi, ... until 4.41)."""
    module = sys.modules.get(model_class.__module__)
    if module is not None and hasattr(module, "create_causal_mask"):
        return "create_causal_mask"
    if hasattr(model_class, "_update_causal_mask"):
        return "update_causal_mask"
    return "attn_mask_utils"


# The additive 4D mask one of our forward wrappers is handing down right now: the
# pass-through wrappers below return exactly this object, and nothing else.
PASS_THROUGH: contextvars.ContextVar = contextvars.ContextVar("ftshims_packing_mask", default=None)

HELPERS = ("_prepare_4d_causal_attention_mask", "_prepare_4d_causal_attention_mask_for_sdpa")


def needs_passthrough(model_class) -> bool:
    """Whether this model's mask code would ignore, misread or reject an additive 4D mask.

    * ``attn_mask_utils`` (4.37–4.41): the eager helper computes ``1 - mask``
      (binary only); the sdpa helper does too on 4.37–4.39 and has no 4D branch
      at all on 4.40–4.41 (``ValueError: too many values to unpack``).
    * ``_update_causal_mask`` on 4.38–4.40: 4.38 llama/gemma and 4.39–4.40
      gemma/cohere ignore a 4D mask; 4.39–4.40 llama reads it as binary.
    * From 4.41 ``_update_causal_mask`` and from 4.53 ``create_causal_mask`` use an
      additive 4D mask as-is.
    """
    helper = mask_helper(model_class)
    if helper == "attn_mask_utils":
        return True
    return helper == "update_causal_mask" and transformers_version().release[:2] in ((4, 38), (4, 39), (4, 40))


def passthrough(wrapped, instance, args, kwargs):
    """A mask builder that returns the additive 4D mask our forward wrapper handed down, unchanged."""
    if compiling():
        # Inside a trace the forward wrappers hand nothing down (and dynamo cannot read a
        # context variable): the helper runs as upstream wrote it.
        return wrapped(*args, **kwargs)
    mask = args[0] if args else kwargs.get("attention_mask")
    if mask is not None and mask is PASS_THROUGH.get():
        return mask
    return wrapped(*args, **kwargs)


class Family(NamedTuple):
    """What the forward wrappers need to know about a decoder class, read once at install time
    (so that nothing version- or signature-related is looked up inside a ``torch.compile`` trace)."""

    extra_kwargs: bool  # forward(**kwargs) passes extra keyword arguments on (flash varlen kwargs, 4.47+)
    passthrough: bool  # its mask code needs the pass-through wrappers (see needs_passthrough)
    bool_misread: Dict[str, bool]  # attn implementation -> whether a bool 4D mask is mishandled
    traces_4d: bool  # its mask code takes a 4D mask inside a torch.compile trace (see traces_4d_mask)


def bool_misread(model_class) -> Dict[str, bool]:
    """Per attention implementation, whether this class's mask code mishandles a bool 4D mask:
    handed to torch's sdpa as a boolean mask (correct) from 4.44; 4.41–4.43 reject it; eager
    adds it as 0/1 everywhere; the pass-through versions need every mask converted."""
    if needs_passthrough(model_class):
        return {"eager": True, "sdpa": True}
    return {"eager": True, "sdpa": transformers_version().release[:2] < (4, 44)}


def traces_4d_mask(model_class) -> bool:
    """Whether a 4D mask goes through this class's mask code inside a ``torch.compile`` trace
    with ``fullgraph=True``: not with the pass-through wrappers (4.37-4.40, a context variable),
    nor on 4.41-4.43, whose ``_update_causal_mask`` checks a 4D mask's values in Python
    (``if attention_mask.max() != 0``, a data-dependent branch); from 4.44 it does."""
    return not needs_passthrough(model_class) and transformers_version().release[:2] >= (4, 44)


def install_family(patcher, model_type: str, forward_wrapper) -> None:
    """Wrap ``<Family>Model.forward`` when the family's modeling module is imported, and the
    mask code that would not take an additive 4D mask as-is (see :func:`needs_passthrough`).

    ``forward_wrapper(wrapped, instance, call, family)`` gets the call's
    arguments as one keyword dict (bound by :func:`ftshims._util.method_binder`) and the
    :class:`Family` facts read at install time; it returns ``wrapped(**call)``
    with whatever it changed.
    """
    from ..patching import require_params
    from ..spec import TargetMissing

    module_name, class_name = FAMILIES[model_type]

    def part(module):
        cls = vars(module).get(class_name)
        if cls is None:
            raise TargetMissing(f"{module_name}.{class_name} not found")
        require_params(cls.forward, ("attention_mask", "position_ids"), f"{module_name}.{class_name}.forward")
        if needs_passthrough(cls):
            if mask_helper(cls) == "update_causal_mask":
                patcher.wrap(cls, "_update_causal_mask", passthrough)
            else:
                found = [name for name in HELPERS if callable(vars(module).get(name))]
                if not found:
                    raise TargetMissing(f"{module_name}: no _update_causal_mask and no _prepare_4d_causal_attention_mask")
                for name in found:
                    patcher.wrap(module, name, passthrough)
        bind = method_binder(cls.forward)
        family = Family(takes_extra_kwargs(cls.forward), needs_passthrough(cls), bool_misread(cls), traces_4d_mask(cls))

        def adapter(wrapped, instance, args, kwargs):
            call = bind(args, kwargs)
            if call is None:
                return wrapped(*args, **kwargs)
            return forward_wrapper(wrapped, instance, call, family)

        patcher.wrap(cls, "forward", adapter)

    patcher.when_imported(module_name, part)


def handing_down(mask):
    """Context manager: mark ``mask`` as the one the pass-through wrappers let through."""
    import contextlib

    @contextlib.contextmanager
    def scope():
        token = PASS_THROUGH.set(mask)
        try:
            yield mask
        finally:
            PASS_THROUGH.reset(token)

    return scope()


# ---------------------------------------------------------------------------
# Reproductions shared by probes, tests and the bench.


def example_pair(lengths=(5, 7), vocab_size: int = 128, seed: int = 0, low: int = 3):
    """Random examples (token ids from ``low``, avoiding the special ids) of the given lengths."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab_size, (n,), generator=generator) for n in lengths]


def packed_batch(examples, mask: str = "ones", pad_row: bool = False):
    """One packed row of ``examples`` with per-example position_ids and ``labels[pos == 0] = -100``.

    ``mask``: ``"ones"`` (an all-ones 2D mask beside the packed position ids:
    the adversarial case), ``"none"`` (no mask). ``pad_row`` adds a second row
    holding the first example alone, right-padded with pos 0 and a 0 mask
    (only with ``mask="ones"``: then the mask carries real padding).
    """
    import torch

    ids = torch.cat(examples)[None]
    pos = torch.cat([torch.arange(len(e)) for e in examples])[None]
    labels = ids.clone()
    labels[pos == 0] = -100
    batch = {"input_ids": ids, "position_ids": pos, "labels": labels}
    if mask == "ones" or pad_row:
        batch["attention_mask"] = torch.ones_like(ids)
    if pad_row:
        length = ids.shape[1]
        first = examples[0]
        row_ids = torch.zeros(length, dtype=ids.dtype)
        row_ids[: len(first)] = first
        row_pos = torch.zeros(length, dtype=pos.dtype)
        row_pos[: len(first)] = torch.arange(len(first))
        row_mask = (torch.arange(length) < len(first)).long()
        row_labels = torch.full((length,), -100, dtype=labels.dtype)
        row_labels[1 : len(first)] = first[1:]
        batch = {
            "input_ids": torch.stack([ids[0], row_ids]),
            "position_ids": torch.stack([pos[0], row_pos]),
            "labels": torch.stack([labels[0], row_labels]),
            "attention_mask": torch.stack([batch["attention_mask"][0], row_mask]),
        }
    return batch


def reference_logits(model, examples):
    """Each example run alone (no mask, fresh positions), logits concatenated (fp32)."""
    import torch

    device = next(model.parameters()).device
    with torch.no_grad():
        return torch.cat([model(input_ids=e[None].to(device), use_cache=False).logits[0].float() for e in examples])


def segment_logit_gap(model, examples, batch, **call) -> float:
    """Max |packed logits - each example alone| over every row of ``batch``: a packed row holds all
    ``examples``; a row with padding (``packed_batch(pad_row=True)``) holds the first example."""
    import torch

    device = next(model.parameters()).device
    reference = reference_logits(model, examples)
    inputs = {k: v.to(device) for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        logits = model(**inputs, **call).logits.float()
    mask = batch.get("attention_mask")
    gap = 0.0
    for row in range(logits.shape[0]):
        n = int(mask[row].sum()) if mask is not None and mask.ndim == 2 else logits.shape[1]
        gap = max(gap, (logits[row, :n] - reference[:n]).abs().max().item())
    return gap


def tiny_decoder(family: str = "llama", attn: str = "eager", seed: int = 0):
    """A tiny random decoder of ``family`` in train() mode (dropout is 0 in these configs)."""
    from .. import tiny

    if family == "llama":
        model = tiny.tiny_llama(attn=attn, seed=seed)
    elif family == "mistral":
        model = tiny.causal_lm("MistralConfig", attn=attn, seed=seed, sliding_window=None, **_small())
    elif family == "qwen2":
        model = tiny.causal_lm("Qwen2Config", attn=attn, seed=seed, use_sliding_window=False, **_small())
    else:
        raise ValueError(f"no tiny config for {family!r}")
    model.train()
    return model


def _small():
    from .. import tiny

    return dict(tiny.TINY_LLAMA)


def family_available(family: str) -> bool:
    import importlib.util

    module_name = FAMILIES[family][0]
    try:
        return importlib.util.find_spec(module_name) is not None
    except (ImportError, ValueError):
        return False


# ---------------------------------------------------------------------------
# The real trainer paths


def quiet_datasets():
    """Context manager: no ``datasets`` progress bars (restored after)."""
    import contextlib

    @contextlib.contextmanager
    def scope():
        try:
            from datasets.utils import logging as ds_logging
        except ImportError:
            yield
            return
        enabled = ds_logging.is_progress_bar_enabled()
        ds_logging.disable_progress_bar()
        try:
            yield
        finally:
            if enabled:
                ds_logging.enable_progress_bar()

    return scope()


SPECIAL = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3}


def tiny_tokenizer(vocab_size: int = 128):
    """A word-level tokenizer over ``w4 .. w{vocab_size-1}`` (id = number) plus the specials, no hub."""
    from ..tiny import word_tokenizer

    words = sorted(SPECIAL, key=SPECIAL.get) + [f"w{i}" for i in range(len(SPECIAL), vocab_size)]
    return word_tokenizer(words, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


def find_in_row(row, tokens) -> int:
    """Index where ``tokens`` occur in the 1D ``row``."""
    n = len(tokens)
    for start in range(len(row) - n + 1):
        if bool((row[start : start + n] == tokens).all()):
            return start
    raise AssertionError(f"{tokens.tolist()} not found in the collated row {row.tolist()}")


def sft_packing_gap(attn: str = "sdpa", strategy: Optional[str] = None, model=None) -> Tuple[float, dict]:
    """``trl.SFTTrainer(packing=True)`` on two short texts (5 and 7 words): one batch from the real
    train dataloader through ``compute_loss``; max logit difference of each packed example to the
    example run alone. Returns ``(gap, batch)``.

    strategy: ``packing_strategy`` (TRL >= 0.19), None for TRL's default.
    """
    import dataclasses
    import tempfile
    import warnings

    import torch

    import datasets
    from trl import SFTConfig, SFTTrainer

    from .. import tiny

    fields = {f.name for f in dataclasses.fields(SFTConfig)}
    if "packing_strategy" not in fields:
        from ..spec import ProbeUnsupported

        raise ProbeUnsupported("this TRL packs with ConstantLengthDataset/pack_examples (contaminating by design)")
    examples = example_pair(low=len(SPECIAL))
    texts = [" ".join(f"w{int(t)}" for t in e) for e in examples]
    tokenizer = tiny_tokenizer()
    model = model if model is not None else tiny_decoder("llama", attn)
    config = dict(packing=True, max_length=32, per_device_train_batch_size=2, report_to=[], save_strategy="no")
    config.update(logging_strategy="no", bf16=False, fp16=False)
    if strategy is not None:
        config["packing_strategy"] = strategy
    with tiny.quiet(), quiet_datasets(), tempfile.TemporaryDirectory() as out:
        warnings.filterwarnings("always", message="ftshims:")  # ours stay audible inside quiet()
        args = SFTConfig(output_dir=out, **{k: v for k, v in config.items() if k in fields})
        trainer = SFTTrainer(
            model=model,
            args=args,
            train_dataset=datasets.Dataset.from_list([{"text": t} for t in texts]),
            processing_class=tokenizer,
        )
        batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
        model.train()
        with torch.no_grad():
            _, outputs = trainer.compute_loss(model, batch, return_outputs=True)
            logits = outputs["logits"]
            row = batch["input_ids"][0]
            gap = 0.0
            for example in examples:
                tokens = torch.cat([example, torch.tensor([SPECIAL["<eos>"]])])
                start = find_in_row(row, tokens)
                alone = model(input_ids=tokens[None].to(row.device), use_cache=False).logits[0]
                gap = max(gap, (logits[0, start : start + len(tokens)] - alone).abs().max().item())
    return gap, batch
