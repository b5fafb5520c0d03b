"""From a symptom to the catalogue: which known bugs of *this* stack produce it, and whether each is fixed here.

Each detector names its candidates (``LINKS``: shim ids from the registry and
advisory ids from ``ftshims/data/advisories.json``), narrowed to the ones that
fit what it saw (a LoRA model under reentrant checkpointing, fp16 eager
attention with padding, ...). :func:`explain` keeps only the candidates whose bug
exists on the installed versions — a shim when they are inside its ``requires``
(:func:`ftshims.probing.in_affected_range`) and one of its ``needs_any``
distributions is installed, an advisory when it matches them (its own
``matches``) — and says for each whether it is applied (``ftshims.status()``;
an advisory counts as applied when one of its ``fixed_by_shims`` is).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

# symptom code -> every catalogue id that can produce it (shims first, then advisories)
LINKS: Dict[str, Tuple[str, ...]] = {
    "nothing_trainable": ("kbit_prep_keeps_adapters_trainable",),
    "trainable_without_grad": ("lora_reentrant_checkpointing",),
    "frozen_param_changed": ("resize_embeddings_keeps_frozen",),
    "nonfinite_loss": ("expand_mask_clamp",),
    "nonfinite_grad": ("expand_mask_clamp",),
    "labels_all_ignored": ("trl_completion_only_template_miss",),
    "eos_never_target": ("eos_label_kept_when_pad_is_eos", "trl_sft_eos_label_masked_when_pad_is_eos"),
    "loss_count_mismatch": ("num_items_in_batch_overcount", "num_items_in_batch_overcount_4_46"),
    "packing_contaminated": (
        "packing_block_mask",
        "flash_attn_packing",
        "trl_padding_free_position_ids",
        "packing_contaminated_below_4_37",
        "trl_constant_length_dataset_packing",
        "trl_wrapped_only_packing",
        "packing_detection_needs_torch_2_6",
    ),
    "rope_low_precision": ("rope_inv_freq_fp32",),
    "rows_without_target": ("trl_completion_only_template_miss",),
    "bos_doubled": ("trl_sft_double_bos_conversational",),
}


def is_shim(catalogue_id: str) -> bool:
    from .. import registry

    return catalogue_id in registry.shims()


def exists_here(catalogue_id: str) -> bool:
    """Whether the bug behind ``catalogue_id`` exists on the installed versions."""
    from .. import advisories, registry
    from ..probing import in_affected_range
    from ..versions import installed_version

    if is_shim(catalogue_id):
        spec = registry.get(catalogue_id).spec
        if spec.needs_any and not any(installed_version(name) for name in spec.needs_any):
            return False  # flash attention without flash-attn: the bug cannot happen here
        return in_affected_range(catalogue_id)[0]
    advisory = advisories.get(catalogue_id)
    return advisory.matches({name: installed_version(name) for name in advisory.when})


def _active() -> Dict[str, bool]:
    import ftshims

    return {entry.id: entry.active for entry in ftshims.status()}


def _versions_text(spec_requires: Iterable[str]) -> str:
    from ..versions import installed_version

    return ", ".join(f"{name} {installed_version(name)}" for name in spec_requires)


def explain(candidates: Iterable[str]) -> Tuple[List[str], Dict[str, bool], str]:
    """``(explains, applied, text)`` for the candidates whose bug exists here.

    ``text`` is the sentence the finding's message ends with: what fixes the
    symptom on this stack and whether it is applied, or, plainly, that no
    known bug of this stack produces it.
    """
    from .. import advisories, registry
    from ..spec import FIX

    explains = [c for c in dict.fromkeys(candidates) if exists_here(c)]
    active = _active() if explains else {}
    applied: Dict[str, bool] = {}
    parts: List[str] = []
    for catalogue_id in explains:
        if is_shim(catalogue_id):
            spec = registry.get(catalogue_id).spec
            on = bool(active.get(catalogue_id))
            applied[catalogue_id] = on
            where = _versions_text(spec.requires)
            if on:
                parts.append(f"{catalogue_id} fixes this on {where} and is applied (yet the symptom showed: please report it)")
            elif spec.kind == FIX:
                parts.append(f"{catalogue_id} fixes this on {where} and is not applied (ftshims.apply())")
            else:
                parts.append(f"{catalogue_id} fixes this on {where} and is not applied (opt-in: "
                             f"ftshims.apply(include=[{catalogue_id!r}]))")
        else:
            advisory = advisories.get(catalogue_id)
            fixers = [s for s in advisory.fixed_by_shims if active.get(s)]
            applied[catalogue_id] = bool(fixers)
            fixed = f" (fixed here by {', '.join(fixers)})" if fixers else ""
            parts.append(f"advisory {catalogue_id}: {advisory.title}{fixed}")
    if parts:
        return explains, applied, "; ".join(parts)
    from ..versions import installed_version

    names = [name for name in ("torch", "transformers", "peft", "trl") if installed_version(name)]
    return [], {}, f"no known bug of this stack ({_versions_text(names)}) produces this symptom"
