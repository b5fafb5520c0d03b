"""Packed examples attend to each other under flash-attention when a 2D mask or a batch of packed rows is passed.

Why: transformers' flash-attention path isolates packed examples only through
its *varlen* kernel, and reaches it only in narrow cases:

* a 2D ``attention_mask`` that holds padding (zeros) wins: the batch is
  unpadded row by row, so each row's real tokens become one sequence and its
  packed examples attend to each other (every version). An all-ones mask is
  dropped by transformers itself for flash (``0.0 in attention_mask`` 4.38–4.52,
  ``flash_attention_mask`` 4.53+), so it does no harm here;
* without a mask, 4.44–4.52 derive ``cu_seqlens`` from ``position_ids == 0``
  over the flattened batch, but >=4.53 only do so for batch size 1
  (``_is_packed_sequence``), so a batch of several packed rows runs the dense
  kernel and every row's examples attend to each other;
* ``cu_seq_lens_*`` / ``max_length_*`` kwargs (4.47+) are used as given, over
  the flattened batch.

The fix: wrap the decoder base model's ``forward`` (families in
``_packing.FAMILIES``). When the attention implementation is a flash one and
``position_ids`` restart at 0 between real tokens, and no cache was passed:

* 4.47+: pass ``cu_seq_lens_q/k`` and ``max_length_q/k`` computed over the
  flattened batch (each example its own sequence, each padding token a
  sequence of one, so padding is never attended), drop the 2D mask and call
  with ``use_cache=False``. Caller-provided ``cu_seq_lens_*`` are kept; only an
  all-ones mask beside them is dropped.
* 4.44–4.46 (and 4.47–4.52 families whose forward takes no extra kwargs):
  drop the 2D mask (padding tokens get position 0, so they become sequences
  of one) and call with ``use_cache=False``: transformers then takes its
  ``position_ids`` varlen path over the flattened batch.

Not covered: transformers <4.44, which only isolates through the sample-id
``_get_unpad_data`` patch and needs the mask kept through
``_update_causal_mask`` (``0.0 in attention_mask``); the sample-id trick never
works on >=4.53, where 2D masks are cast to bool. Flash attention needs a GPU:
the CPU tests drive the real transformers code with a reference (pure torch)
varlen kernel in place of flash-attn; tests/gpu/test_packing_flash_attn.py runs
the real kernels when CUDA and flash_attn are present.

Applies to transformers >=4.44 (unfixed upstream); the wrapper does nothing
unless the model's attention implementation is a flash one.
"""

from __future__ import annotations

from .._util import acted, attributes_set, compiling
from ..spec import Observation, ProbeUnsupported, ShimSpec, Target
from . import _packing

SPEC = ShimSpec(
    id="flash_attn_packing",
    since="0.1.0",
    title="Packed examples attend to each other under flash-attention with padding or several packed rows",
    symptom="flash_attention_2/3 with packed position_ids: a padded attention_mask, or a batch of more than one "
    "packed row (transformers >=4.53), runs each row as one sequence (cross-example attention)",
    why="transformers' flash-attention path isolates packed examples only through the varlen kernel, which it reaches only in narrow cases; otherwise packed examples attend to each other. The shim routes packed batches (position_ids restarting at 0) to the varlen kernel.",
    stand_in="a pure-PyTorch stand-in for flash-attn's varlen kernel (CPU)",
    needs_any=("flash-attn", "flash-attn-3"),
    requires={"transformers": ">=4.44"},
    fixed_in={},
    refs=(
        "https://github.com/huggingface/transformers/pull/31629",
        "https://github.com/huggingface/transformers/pull/46634",
        "https://github.com/huggingface/transformers/pull/47342",
    ),
    targets=(
        Target("transformers.models.llama.modeling_llama", "LlamaModel.forward", params=("attention_mask", "position_ids")),
        Target("transformers.modeling_flash_attention_utils", "_flash_attention_forward", params=("position_ids",)),
    ),
    modules=("transformers",),
)

VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def is_flash(implementation) -> bool:
    return isinstance(implementation, str) and "flash" in implementation and "paged" not in implementation


def varlen_kwargs(segment_ids, real):
    """``cu_seq_lens_q/k`` (int32) and ``max_length_q/k`` (int) over the flattened batch: every
    example is one sequence, every padding token a sequence of its own, rows never merge."""
    import torch

    batch, length = segment_ids.shape
    starts = torch.zeros_like(real)
    starts[:, 0] = True
    starts[:, 1:] = (segment_ids[:, 1:] != segment_ids[:, :-1]) | ~real[:, 1:] | ~real[:, :-1]
    flat = starts.flatten()
    begins = flat.nonzero().flatten()
    total = torch.tensor([batch * length], device=begins.device)
    cu = torch.cat([begins, total]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def _forward(wrapped, instance, call, family):
    if not is_flash(getattr(instance.config, "_attn_implementation", None)):
        return wrapped(**call)
    position_ids = call.get("position_ids")
    mask = call.get("attention_mask")
    if position_ids is None or (mask is not None and getattr(mask, "ndim", None) != 2):
        return wrapped(**call)
    if call.get(_packing.cache_key(call)) is not None:
        return wrapped(**call)  # generation
    if compiling():
        # cu_seqlens and their max length are read from the values: no data-independent
        # form exists, so under torch.compile the call is left as it is.
        return wrapped(**call)
    given = all(call.get(name) is not None for name in VARLEN_KWARGS)
    if given:
        if mask is not None and bool((mask != 0).all()):
            del call["attention_mask"]  # the all-ones mask would win over the caller's cu_seq_lens
            call["use_cache"] = False
        return wrapped(**call)
    found = _packing.segments(position_ids, mask)
    if found is None:
        return wrapped(**call)
    segment_ids, real = found
    call.pop("attention_mask", None)
    call["use_cache"] = False
    acted(SPEC.id, "packed batches sent to the varlen kernel")
    if family.extra_kwargs and _flash_takes_varlen_kwargs():
        call.update(varlen_kwargs(segment_ids, real))
    else:  # 4.44–4.52: transformers derives cu_seqlens from position_ids == 0 over the flattened batch
        call["position_ids"] = position_ids.expand(real.shape[0], -1).masked_fill(~real, 0)
    return wrapped(**call)


_FLASH_TAKES = []


def _flash_takes_varlen_kwargs() -> bool:
    """4.47+: ``_flash_attention_forward`` takes ``cu_seq_lens_*`` (read once per install)."""
    if not _FLASH_TAKES:
        import inspect
        import sys

        module = sys.modules.get("transformers.modeling_flash_attention_utils")
        flash = getattr(module, "_flash_attention_forward", None)
        _FLASH_TAKES.append(flash is not None and "cu_seq_lens_q" in inspect.signature(flash).parameters)
    return _FLASH_TAKES[0]


def install(patcher, options) -> None:
    _FLASH_TAKES.clear()
    for model_type in _packing.FAMILIES:
        _packing.install_family(patcher, model_type, _forward)


# ---------------------------------------------------------------------------
# Reproduction


def probe(kernel: str = "auto", mask: str = "padded", rows: int = 1, implementation: str = "flash_attention_2") -> Observation:
    """Two examples (5 and 7 tokens) packed per row with per-example position_ids, run through
    transformers' flash-attention path: do the packed logits equal each example run alone?

    mask: ``"ones"`` (all-ones 2D mask: transformers drops it for flash), ``"none"``, or
    ``"padded"`` (a second, right-padded row: the mask holds zeros and wins over position_ids).
    rows: identical packed rows (>1 defeats the batch-size-1 detection of >=4.53).
    kernel: ``"flash"`` runs the real kernels (CUDA and flash-attn needed, bf16);
    ``"reference"`` runs transformers' own flash-attention code on CPU in fp32 with a
    pure-torch varlen kernel in place of flash-attn (the plumbing is real, the kernel is
    not): how the CPU tests check the shim. ``"auto"``: flash where CUDA and flash-attn
    are present, else reference.
    """
    import importlib.util

    from .. import tiny

    if _packing.transformers_version().release[:2] < (4, 44):
        raise ProbeUnsupported("transformers <4.44 has no position_ids varlen path to route packed rows to")
    if kernel == "auto":
        import torch

        usable = torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None
        kernel = "flash" if usable else "reference"
    with tiny.quiet():
        if kernel == "reference":
            with reference_flash():
                model = reference_flash_model()
                gap = packed_gap(model, mask=mask, rows=rows)
            tolerance = 1e-4
        elif kernel == "flash":
            model = _real_flash_model(implementation)
            gap = packed_gap(model, mask=mask, rows=rows)
            tolerance = FLASH_BUG
        else:
            raise ValueError(f"kernel must be 'flash' or 'reference', not {kernel!r}")
    if gap > tolerance:
        return Observation(True, f"packed examples attend to each other under {kernel} flash attention: max logit difference {gap:.3g}")
    return Observation(False, f"packed examples isolated under {kernel} flash attention: max logit difference {gap:.2g}")


FLASH_BUG = 0.1  # contamination moves logits by ~0.4; bf16 rounding by ~1e-2


def _real_flash_model(implementation: str):
    import importlib.util

    import torch

    from .. import tiny

    if not torch.cuda.is_available():
        raise ProbeUnsupported("flash-attention needs CUDA")
    module = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}.get(implementation)
    if module is None or importlib.util.find_spec(module) is None:
        raise ProbeUnsupported(f"{implementation} needs the {module or implementation} package")
    try:
        model = tiny.tiny_llama(attn=implementation)
    except (ImportError, ValueError) as exc:
        raise ProbeUnsupported(f"cannot build a {implementation} model here: {exc}") from None
    return model.to(device="cuda", dtype=torch.bfloat16).train()


def packed_gap(model, mask: str = "padded", rows: int = 1) -> float:
    """Max |packed logits - each example alone|. mask: ``"ones"``/``"none"`` (``rows`` identical
    packed rows) or ``"padded"`` (a packed row plus a right-padded row: the mask holds zeros)."""
    examples = _packing.example_pair()
    if mask == "padded":
        batch = _packing.packed_batch(examples, mask="ones", pad_row=True)
    else:
        batch = _packing.packed_batch(examples, mask="none" if mask == "none" else "ones")
        batch = {k: v.expand(rows, -1).contiguous() for k, v in batch.items()}
    return _packing.segment_logit_gap(model, examples, batch)


# -- a pure-torch stand-in for flash-attn, for CPU tests of the plumbing ----------


def _attend(q, k, v, causal, scale):
    """One sequence: q ``[L, H, D]``, k/v ``[L, Hkv, D]`` (grouped-query heads repeated)."""
    import torch

    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=causal, scale=scale
    )
    return out[0].transpose(0, 1)


def reference_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, deterministic=False):
    """``flash_attn_func`` semantics: q ``[B, L, H, D]``, each row one sequence."""
    import torch

    return torch.stack([_attend(q[b], k[b], v[b], causal, softmax_scale) for b in range(q.shape[0])])


def reference_flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=(-1, -1), softcap=0.0, deterministic=False,
):
    """``flash_attn_varlen_func`` semantics: q ``[total, H, D]``, sequences delimited by ``cu_seqlens``."""
    import torch

    cu = cu_seqlens_q.tolist()
    return torch.cat([_attend(q[s:e], k[s:e], v[s:e], causal, softmax_scale) for s, e in zip(cu[:-1], cu[1:])])


def _reference_unpad(hidden_states, attention_mask, unused_mask=None):
    import torch
    import torch.nn.functional as F

    seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    cu = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    return hidden_states.reshape(-1, *hidden_states.shape[2:])[indices], indices, cu, int(seqlens.max()), seqlens


def _reference_pad(hidden_states, indices, batch, seqlen):
    import torch

    out = torch.zeros(batch * seqlen, *hidden_states.shape[1:], dtype=hidden_states.dtype, device=hidden_states.device)
    out[indices] = hidden_states
    return out.view(batch, seqlen, *hidden_states.shape[1:])


def reference_flash():
    """Context manager: transformers' flash-attention code calls the pure-torch kernels above
    (module globals of ``modeling_flash_attention_utils`` set, and restored exactly after)."""
    import contextlib
    import sys

    @contextlib.contextmanager
    def scope():
        import transformers.modeling_flash_attention_utils  # noqa: F401  (a probe may import)

        fa = sys.modules["transformers.modeling_flash_attention_utils"]
        values = {}
        put = values.__setitem__

        if hasattr(fa, "lazy_import_flash_attention"):  # 4.56+
            process = fa._lazy_define_process_function(reference_flash_attn_varlen_func)
            fns = (reference_flash_attn_func, reference_flash_attn_varlen_func)
            if hasattr(fa, "_process_with_kvcache_kwargs_fn"):  # later 5.x (5.24): a (varlen, kvcache) pair of processors
                loaded = ((*fns, None, fa._pad_input, fa._unpad_input), (process, dict))
            elif hasattr(fa, "_flash_with_kvcache_fn"):  # earlier 5.x (5.9, 5.16): one processor
                loaded = ((*fns, None, fa._pad_input, fa._unpad_input), process)
            else:
                loaded = ((*fns, fa._pad_input, fa._unpad_input), process)
            put("lazy_import_flash_attention", lambda *args, **kwargs: loaded)
        else:  # 4.44–4.55: module-level names, bound at import when flash-attn is installed
            for name in ("flash_attn_func", "flash_attn_2_func"):
                put(name, reference_flash_attn_func)
            for name in ("flash_attn_varlen_func", "flash_attn_2_varlen_func"):
                put(name, reference_flash_attn_varlen_func)
            for name in ("pad_input", "pad_input_fa2"):
                put(name, _reference_pad)
            for name in ("unpad_input", "unpad_input_fa2"):
                put(name, _reference_unpad)
            put("index_first_axis", lambda tensor, indices: tensor[indices])
            put("flash_241", False)
            put("_flash_supports_window_size", False)
        with attributes_set(fa, values):
            yield

    return scope()


def reference_flash_model():
    """A tiny fp32 Llama whose attention runs transformers' flash-attention code (CPU)."""
    import sys

    model = _packing.tiny_decoder("llama", "sdpa")
    modeling = sys.modules[type(model.model).__module__]
    flash_class = getattr(modeling, "LlamaFlashAttention2", None)
    if flash_class is not None:  # 4.44–4.47: the attention class is chosen at init
        for layer in model.model.layers:
            layer.self_attn.__class__ = flash_class
            layer.self_attn._flash_attn_uses_top_left_mask = False
        model.config._attn_implementation_internal = "flash_attention_2"
    else:  # 4.48+: dispatched by name at call time
        model.config._attn_implementation = "flash_attention_2"
    return model
