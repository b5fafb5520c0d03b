"""The lint rules over the model, the adapter, the tokenizer and the training recipe.

Each ``check_*`` function reads the :class:`~ftshims.lint.Context` and
adds findings; :func:`ftshims.lint.run` calls each one in a guard, so a
rule that raises costs its own findings only (reported as ``lint-rule-failed``).

Size: eleven ``check_*`` functions (one per input or concern, together most of the 26 rules of
:mod:`.findings`), each independent of the others; the inputs they read live in :mod:`.inputs`, model
facts in :mod:`.model`, the DeepSpeed rules in :mod:`.deepspeed`.
"""

from __future__ import annotations

import difflib
import functools
from typing import Any, Dict, List, Optional, Tuple

from . import llamafactory as lf
from .findings import ERROR, INFO, WARNING, finding
from .inputs import as_bool
from .model import match_targets, max_positions

def _with_training_config(rule):
    """A rule about the training config: called as ``rule(ctx, train)``, and only when one was given."""

    @functools.wraps(rule)
    def check(ctx) -> None:
        if ctx.train is not None:
            rule(ctx, ctx.train)

    return check


# -- adapter / PEFT -------------------------------------------------------------------------------


def check_adapter_keys(ctx) -> None:
    adapter = ctx.adapter
    if adapter is None:
        return
    fields, cls_name = ctx.peft_config_fields(adapter.get("peft_type", "LORA"))
    if not fields:
        return
    unknown = sorted(k for k in adapter if k not in fields and not k.startswith("_"))
    if not unknown:
        return
    ctx.add(
        finding(
            "adapter-config-unknown-key",
            f"{cls_name} of the installed PEFT {ctx.versions.get('peft')} has no field(s) {', '.join(unknown)} (the "
            "adapter was saved by another PEFT version?). Older PEFT raises TypeError on load; newer PEFT drops "
            "unknown keys with a warning, so the setting silently does nothing.",
            "install the PEFT version that wrote the adapter (see `peft_version`/the release notes), or remove the keys",
            file=ctx.adapter_path,
            key=", ".join(unknown),
        )
    )


def _targets(ctx):
    """``(targets, where, file)``: the adapter's target_modules, else the training config's LoRA targets."""
    if ctx.adapter is not None and ctx.adapter.get("peft_type", "LORA") in ("LORA", "ADALORA", None):
        return ctx.adapter.get("target_modules"), "target_modules", ctx.adapter_path
    if ctx.train is not None:
        targets, key = ctx.train.lora_targets()
        if targets is not None:
            return targets, key, ctx.train.path
    return None, None, None


def check_lora_targets(ctx) -> None:
    targets, key, path = _targets(ctx)
    if key is None:
        return
    info = ctx.model_info()
    if info is None:
        return
    names = list(info.modules)
    linear = info.linear_suffixes()
    suggestion = ", ".join(linear) if linear else "(none)"
    if targets is None:
        default = ctx.peft_default_targets(info.model_type)
        if default is None:
            ctx.add(
                finding(
                    "lora-target-no-match",
                    f"`{key}` is not set and PEFT has no default target modules for model_type {info.model_type!r}: "
                    "get_peft_model raises \"Please specify `target_modules` in `peft_config`\".",
                    f"set `{key}` to some of the model's linear layers: {suggestion}",
                    file=path,
                    key=key,
                )
            )
            return
        targets = default
    if targets in ("all-linear", ["all"], ["all-linear"]):
        if not linear:
            ctx.add(finding("lora-target-no-match", f"`{key}: {targets}` but {info.class_name} has no linear layer", "use another adapter type", file=path, key=key))
        return
    matches = match_targets(targets, names)
    matched = sorted({name for hits in matches.values() for name in hits})
    if not matched:
        shown = targets if isinstance(targets, str) else list(targets)
        ctx.add(
            finding(
                "lora-target-no-match",
                f"`{key}` {shown!r} matches no module of {info.class_name}; get_peft_model raises \"Target modules "
                f"... not found in the base model\". Its linear layers: {suggestion}.",
                f"use names from: {suggestion}" + _close(targets, linear),
                file=path,
                key=key,
            )
        )
        return
    if not isinstance(targets, str):
        missing = [t for t, hits in matches.items() if not hits]
        if missing:
            ctx.add(
                finding(
                    "lora-target-partial-match",
                    f"`{key}` entr{'y' if len(missing) == 1 else 'ies'} {', '.join(repr(m) for m in missing)} "
                    f"match{'es' if len(missing) == 1 else ''} no module of {info.class_name}; PEFT drops {'it' if len(missing) == 1 else 'them'} silently because "
                    f"other entries match, so those layers get no adapter.{_close(missing, linear)} Linear layers: {suggestion}.",
                    "fix the spelling" + _close(missing, linear, as_fix=True),
                    file=path,
                    key=key,
                )
            )
    bad = [info.modules[name] for name in matched if not info.modules[name].lora_ok]
    if bad:
        kinds = sorted({m.type for m in bad})
        children = sorted({c for m in bad for c in m.children_linear})
        examples = ", ".join(m.name for m in bad[:3]) + (" ..." if len(bad) > 3 else "")
        ctx.add(
            finding(
                "lora-target-unsupported-module",
                f"`{key}` matches {len(bad)} module(s) LoRA cannot wrap ({', '.join(kinds)}: {examples}); "
                "get_peft_model raises \"Target module ... is not supported\". LoRA wraps Linear, Conv1D/Conv2d/Conv3d, "
                "Embedding and MultiheadAttention layers.",
                "target the linear layers inside them instead: " + (", ".join(children) if children else suggestion),
                file=path,
                key=key,
            )
        )


def _close(targets: Any, choices: List[str], as_fix: bool = False) -> str:
    if isinstance(targets, str):
        targets = [targets]
    pairs = []
    for target in targets:
        close = difflib.get_close_matches(str(target).rsplit(".", 1)[-1], choices, n=1, cutoff=0.6)
        if close:
            pairs.append(f"{target!r} → {close[0]!r}")
    if not pairs:
        return ""
    return (": " if as_fix else " Did you mean ") + ", ".join(pairs) + ("" if as_fix else "?")


def check_modules_to_save_tied(ctx) -> None:
    info = ctx.model_info()
    if info is None or not info.tied:
        return
    saved: List[str] = []
    where, path = None, None
    if ctx.adapter is not None:
        saved = [str(m) for m in (ctx.adapter.get("modules_to_save") or [])]
        targets = ctx.adapter.get("target_modules")
        if isinstance(targets, (list, tuple)):
            saved += [str(t) for t in targets]
        where, path = "modules_to_save / target_modules", ctx.adapter_path
        if as_bool(ctx.adapter.get("ensure_weight_tying")):
            return
    elif ctx.train is not None:
        names, key = ctx.train.modules_to_save()
        saved = names or []
        where, path = key, ctx.train.path
    tied_names = {n for n in (info.input_embeddings, info.output_embeddings) if n}
    hits = sorted({s for s in saved for n in tied_names if n == s or n.endswith("." + s)})
    if not hits:
        return
    peft = ctx.versions.get("peft")
    has_tying = ctx.peft_has_field("LORA", "ensure_weight_tying")
    ctx.add(
        finding(
            "modules-to-save-tied",
            f"{', '.join(hits)} {'is' if len(hits) == 1 else 'are'} tied (tie_word_embeddings: the input embedding and "
            f"lm_head share one weight), but `{where}` trains {'it' if len(hits) == 1 else 'them'} as separate copies: "
            "the two drift apart, and a merged or re-loaded model re-ties them, silently dropping one trained copy.",
            (
                "set `ensure_weight_tying: true` in the LoraConfig"
                if has_tying
                else f"PEFT {peft} has no `ensure_weight_tying` (added in 0.18): train only `embed_tokens` (it drives both), "
                "or untie the model first (tie_word_embeddings=False and copy the weight)"
            ),
            file=path,
            key=where,
        )
    )


# -- tokenizer ---------------------------------------------------------------------------------------


SFT_KEYS = ("packing", "max_seq_length", "max_length", "dataset_text_field", "assistant_only_loss", "completion_only_loss",
            "padding_free", "packing_strategy", "dataset_kwargs", "model_init_kwargs")


def _trl_masks_pad(ctx) -> bool:
    """Whether the run's LM collator sets labels[input_ids == pad_id] = -100: transformers'
    DataCollatorForLanguageModeling (plain Trainer scripts, and TRL SFTTrainer < 0.16.1) does; TRL >= 0.16.1's own
    collator pads labels by position. Without a TRL SFT config the trainer is unknown: assume it masks."""
    sft = ctx.train is not None and not ctx.train.is_lf and any(k in ctx.train.data for k in SFT_KEYS)
    if not sft or not ctx.versions.get("trl"):
        return True
    return ctx.version_lt("trl", "0.16.1")


def check_tokenizer_pad(ctx) -> None:
    tok = ctx.tokenizer_info()
    if tok is None:
        return
    lf_run = ctx.train is not None and ctx.train.is_lf
    if tok["pad_token"] is None:
        if lf_run:
            severity, consequence = INFO, (
                "LLaMA-Factory sets pad = eos itself (template.fix_special_tokens); harmless there, because its labels "
                "come from the template and padding is labelled -100 by position."
            )
        else:
            severity, consequence = WARNING, (
                "batching with padding raises \"Asking to pad but the tokenizer does not have a padding token\"; the "
                "common fix `tokenizer.pad_token = tokenizer.eos_token` (which TRL < 0.16.1 SFTTrainer also applies) makes "
                "transformers' DataCollatorForLanguageModeling mask every EOS label, so the model never learns to stop."
            )
        ctx.add(
            finding(
                "tokenizer-no-pad",
                f"the tokenizer in {ctx.inputs.tokenizer} has no pad token: {consequence}",
                "add a dedicated pad token (an unused reserved token, e.g. `<|finetune_right_pad_id|>` on Llama 3, or "
                "tokenizer.add_special_tokens({'pad_token': '<pad>'}) + model.resize_token_embeddings) and set "
                "model.config.pad_token_id",
                severity=severity,
                file=ctx.inputs.tokenizer,
            )
        )
        return
    if lf_run or tok["eos_token"] is None:
        return
    same = tok["pad_token"] == tok["eos_token"] or (
        tok["pad_token_id"] is not None and tok["pad_token_id"] == tok["eos_token_id"]
    )
    if not same:
        return
    masks = _trl_masks_pad(ctx)
    if masks:
        severity = WARNING
        who = (
            f"TRL {ctx.versions.get('trl')} SFTTrainer and transformers' DataCollatorForLanguageModeling"
            if ctx.versions.get("trl") and ctx.version_lt("trl", "0.16.1")
            else "transformers' DataCollatorForLanguageModeling (plain Trainer scripts; TRL < 0.16.1 SFTTrainer)"
        )
        consequence = f"{who} set labels[input_ids == pad_token_id] = -100, so every EOS label is masked and the model never learns to stop."
    else:
        severity = INFO
        consequence = (
            f"TRL {ctx.versions.get('trl')} SFTTrainer pads labels by position (safe), but transformers' "
            "DataCollatorForLanguageModeling, used by plain Trainer scripts, still masks every EOS label."
        )
    ctx.add(
        finding(
            "pad-is-eos",
            f"pad token == eos token ({tok['pad_token']!r}): {consequence}",
            "use a distinct pad token (an unused reserved token, or add '<pad>' and resize the embeddings), or a "
            "collator that masks padding by position (DataCollatorForSeq2Seq with label_pad_token_id=-100), or "
            "turn on ftshims' opt-in fix: ftshims.apply(include=['eos_label_kept_when_pad_is_eos'])",
            severity=severity,
            file=ctx.inputs.tokenizer,
        )
    )


@_with_training_config
def check_chat_template(ctx, train) -> None:
    tok = ctx.tokenizer_info()
    if train.is_lf:
        template = train.get("template")
        if template is not None:
            if str(template) not in lf.TEMPLATES:
                close = difflib.get_close_matches(str(template), sorted(lf.TEMPLATES), n=2, cutoff=0.6)
                ctx.add(
                    finding(
                        "chat-template-missing",
                        f"`template: {template}` is not a LLaMA-Factory {lf.VERSION} template; get_template_and_fix_tokenizer "
                        f"raises \"Template {template} does not exist\"."
                        + (f" Did you mean {' or '.join(close)}?" if close else ""),
                        "use a registered template name (llamafactory/data/template.py), e.g. " + (close[0] if close else "llama3"),
                        file=train.path,
                        key="template",
                    )
                )
            return
        if tok is None or str(train.get("stage", lf.DEFAULTS["stage"])) == "pt":
            return
        if not tok["chat_template"]:
            ctx.add(
                finding(
                    "chat-template-missing",
                    "no `template` is set and the tokenizer has no chat template: LLaMA-Factory falls back to its "
                    "`empty` template, so conversations are trained without role markers or turn separators.",
                    "set `template` to the model's LLaMA-Factory template (e.g. llama3, qwen, mistral)",
                    file=train.path,
                    key="template",
                )
            )
        return
    if tok is None:
        return
    wants = []
    if as_bool(train.get("assistant_only_loss")):
        wants.append("assistant_only_loss: true")
    if str(train.get("dataset_text_field", "")) in ("messages", "conversations"):
        wants.append(f"dataset_text_field: {train.get('dataset_text_field')}")
    if train.get("chat_template_path"):
        return  # TRL loads the template from there
    if not wants:
        return
    if not tok["chat_template"]:
        ctx.add(
            finding(
                "chat-template-missing",
                f"a chat format is configured ({', '.join(wants)}) but the tokenizer has no chat template: "
                "apply_chat_template raises \"Cannot use chat template functions because tokenizer.chat_template is not set\" "
                "(transformers >= 4.44; older versions silently used a generic class default).",
                "add the model's chat template to tokenizer_config.json (`chat_template`), or set `chat_template_path`",
                severity=ERROR if "assistant_only_loss: true" in wants else WARNING,
                file=ctx.inputs.tokenizer,
                key="chat_template",
            )
        )
    elif "assistant_only_loss: true" in wants and "generation" not in tok["chat_template"]:
        ctx.add(
            finding(
                "chat-template-missing",
                "assistant_only_loss: true needs a chat template with {% generation %} markers to find the assistant "
                "tokens; this tokenizer's template has none (TRL raises, or trains on nothing).",
                "use a template with {% generation %} / {% endgeneration %} around assistant content (set chat_template_path)",
                file=ctx.inputs.tokenizer,
                key="chat_template",
            )
        )


# -- sequence length ---------------------------------------------------------------------------------


def check_seq_len(ctx) -> None:
    if ctx.train is None or ctx.model_config is None:
        return
    length, key, explicit = ctx.train.seq_len()
    limit, limit_key = max_positions(ctx.model_config)
    if not length or not limit or length <= limit:
        return
    info = ctx.model_info()
    kind = info.positions if info is not None else ("rope" if "rope_theta" in ctx.model_config else "other")
    source = f"`{key}: {length}`" + ("" if explicit else f" (LLaMA-Factory's default {key})")
    if kind == "learned":
        severity = ERROR
        why = (
            f"this model has {limit} learned position embeddings ({limit_key}): a longer sequence fails inside the "
            "forward pass (IndexError on CPU, a device-side assert that poisons the CUDA context on GPU)."
        )
    elif kind == "rope":
        lf_scaling = ctx.train.is_lf and ctx.train.get("rope_scaling")
        severity = INFO if lf_scaling else WARNING
        why = (
            f"RoPE models run past {limit_key} = {limit} without an error, but quality degrades beyond the trained length."
            + (f" LLaMA-Factory's `rope_scaling: {ctx.train.get('rope_scaling')}` scales RoPE by "
               f"ceil({length}/{limit}) for this run." if lf_scaling else "")
        )
    else:
        return  # ALiBi / relative positions: no hard limit
    ctx.add(
        finding(
            "seq-len-exceeds-positions",
            f"{source} exceeds {limit_key} = {limit}: {why}",
            f"set `{key}` <= {limit}"
            + ("" if kind == "learned" else ", or configure RoPE scaling (rope_scaling) for the longer context"),
            severity=severity,
            file=ctx.train.path,
            key=key,
        )
    )


# -- training recipe x installed stack ------------------------------------------------------------------

FLASH = ("flash_attention_2", "flash_attention_3")


def _effective_attn(ctx, attn: Optional[str]) -> str:
    if attn:
        return attn
    return "sdpa" if not ctx.version_lt("transformers", "4.36") else "eager"


def _shim_sentence(state: Dict[str, Any]) -> str:
    if state["applies"]:
        return (
            f"ftshims' `{state['id']}` shim fixes it when ftshims.apply() runs in the training process "
            "(or `import ftshims.auto`; FTSHIMS_AUTO=1 for launchers)"
        )
    return f"ftshims' `{state['id']}` shim would fix it but is not applied here: {state['why']}"


def _recurrent_packing(ctx, train, pack) -> None:
    """A hybrid model's recurrent layers carry state across packed examples whatever the attention (flash too):
    name the model and its layers, and say whether packing_recurrent_state separates them."""
    from ..shims import _packing

    config = ctx.model_config or {}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    model_type = str(config.get("model_type") or "")
    kinds = [str(t) for c in (config, text) for t in (c.get("layer_types") or c.get("layers_block_type") or [])]
    recurrent = sorted({t for t in kinds if t in ("linear_attention", "mamba", "conv", "hybrid")})
    covered = _packing.RECURRENT.get(model_type) or _packing.RECURRENT.get(str(text.get("model_type") or "").replace("_text", ""))
    if covered is None and not recurrent and model_type not in _packing.RECURRENT_UNCOVERED:
        return
    what = f"{'packing' if pack['enabled'] else 'padding_free'} with a {model_type or 'hybrid'} model: its recurrent layers"
    what += f" ({', '.join(covered[1])})" if covered else (f" (layer types {', '.join(recurrent)})" if recurrent else "")
    what += (" carry their state from one packed example into the next whatever the attention mask or implementation "
             "(flash attention included)")
    own_masks = covered is not None and ctx.version_lt("transformers", "5.0") and model_type not in ("lfm2", "qwen3_next")
    if covered is None or own_masks:  # 4.x Bamba, Jamba, Granite-4 hybrid, Zamba2, Falcon-H1 build their own masks
        ctx.add(finding("packing-contamination", what + "; no ftshims shim separates them for this model"
                        + (" on this transformers (its attention masks are its own before 5.0)." if own_masks else "."),
                        "pass seq_idx / cu_seq_lens_q (DataCollatorWithFlattening(return_flash_attn_kwargs=True, "
                        "return_seq_idx=True)) to the optimised kernels (flash-linear-attention, mamba-ssm, "
                        "causal-conv1d), or packing: false", severity=WARNING, file=train.path, key=pack["key"]))
        return
    state = ctx.shim_state("packing_recurrent_state")
    if state["registered"] and state["affected"] and state["applies"]:
        ctx.add(finding("packing-contamination", what + "; ftshims' `packing_recurrent_state` runs them once per "
                        "example when ftshims.apply() runs in the training process (not inside torch.compile, where "
                        "they keep leaking).", "keep the shim applied; do not torch.compile the model while packing",
                        severity=INFO, file=train.path, key=pack["key"]))
        return
    ctx.add(finding("packing-contamination", what + ("; ftshims' `packing_recurrent_state` would run them per example "
                    f"but is not applied here: {state['why']}" if state["registered"] and state["affected"] else "."),
                    "apply ftshims (transformers >= 4.53), or packing: false",
                    severity=ERROR if state["registered"] and state["affected"] else WARNING, file=train.path,
                    key=pack["key"]))


@_with_training_config
def check_packing(ctx, train) -> None:
    pack = train.packing()
    if not pack["enabled"] and not pack["padding_free"]:
        return
    _recurrent_packing(ctx, train, pack)
    attn, attn_from = train.attn_implementation(ctx.model_config)
    attn = _effective_attn(ctx, attn)
    key = pack["key"]
    tv = ctx.versions.get("transformers")

    def report(message: str, fix: str, severity: str, shim: Optional[str] = None) -> None:
        if shim is not None:
            state = ctx.shim_state(shim)
            if state["registered"] and state["affected"]:
                message += " " + _shim_sentence(state) + "."
                severity = INFO if state["applies"] else ERROR
        ctx.add(finding("packing-contamination", message, fix, severity=severity, file=train.path, key=key))

    if train.is_lf:
        if pack["neat"]:
            return  # block-diagonal 4D mask (eager/sdpa) or varlen with batch size 1 (flash): isolated
        head = f"LLaMA-Factory packing without `neat_packing` ({attn_from} → {attn}) concatenates examples with an all-ones attention mask"
        if attn in FLASH:
            report(head + ": flash attention then treats each packed row as one sequence, so packed examples attend to each other.",
                   "set `neat_packing: true` (isolated packing), or `packing: false`", WARNING)
        else:
            report(
                head + f" and per-example position_ids; transformers {tv} does not isolate the examples under {attn} "
                "when a 2D mask is passed, so packed examples attend to each other.",
                "set `neat_packing: true` (LLaMA-Factory builds a block-diagonal mask), or `packing: false`",
                WARNING,
                shim="packing_block_mask",
            )
        return

    trl = ctx.versions.get("trl")
    strategy = str(pack["strategy"] or "").lower() or None
    if pack["enabled"] and trl is not None:
        if strategy == "wrapped" or ctx.version_lt("trl", "0.19"):
            packer = (
                "ConstantLengthDataset" if ctx.version_lt("trl", "0.15")
                else "pack_examples" if ctx.version_lt("trl", "0.16")
                else "pack_dataset(strategy='wrapped')"
            )
            report(
                f"packing: true with TRL {trl} uses {packer}, which concatenates examples into fixed-length rows and "
                "keeps no example boundaries: packed examples attend to each other (and are cut at row edges), by "
                "design; no mask or shim can undo it.",
                "upgrade to TRL >= 0.19 and use packing_strategy: bfd (\"ffd\" on 0.19), or packing: false",
                WARNING,
            )
            return
    if attn in FLASH:
        return  # TRL >= 0.19 sends per-example position_ids for flash attention: varlen kernels isolate them
    if trl is not None and not ctx.version_lt("trl", "0.19") and ctx.version_lt("trl", "0.23.1"):
        report(
            f"{'packing' if pack['enabled'] else 'padding_free'} with TRL {trl} and {attn} attention: the padding-free "
            "collator flattens examples into one row with an all-ones mask and no position_ids (TRL only emits them "
            "for flash attention), so packed examples attend to each other and labels cross example boundaries.",
            "upgrade TRL to >= 0.23.1, or use flash_attention_2",
            WARNING,
            shim="trl_padding_free_position_ids",
        )
        return
    # TRL >= 0.23.1 (or no TRL): per-example position_ids, no mask; transformers isolates them itself from 4.53.1
    # (PR #39194) when no cache is used, and on 4.53.1-4.57 only with torch >= 2.6.
    old_tf = ctx.version_lt("transformers", "4.53.1")
    old_torch = (not old_tf) and ctx.version_lt("transformers", "5.0") and ctx.version_lt("torch", "2.6")
    if trl is None:
        reason = (
            f"packed rows need an explicit block mask under {attn}; transformers {tv} "
            + ("has no packed-sequence detection for eager/sdpa (added in 4.53.1)" if old_tf
               else "detects packing only when no 2D attention_mask and no cache are passed (a plain Trainer keeps "
               "the model's use_cache=True on 4.x)")
        )
    elif old_tf:
        reason = f"transformers {tv} has no packed-sequence detection for {attn} (added in 4.53.1, PR #39194)"
    elif old_torch:
        reason = f"transformers {tv} skips packed-sequence detection silently with torch {ctx.versions.get('torch')} (< 2.6)"
    else:
        return
    report(
        f"{'packing' if pack['enabled'] else 'padding_free'} with {attn} attention: {reason}, so packed examples attend to each other.",
        "use flash_attention_2, or a transformers/torch pair that isolates packed rows (>= 4.53.1 with torch >= 2.6)",
        WARNING,
        shim="packing_block_mask",
    )


@_with_training_config
def check_gc_peft(ctx, train) -> None:
    enabled, reentrant = train.gradient_checkpointing()
    peft = train.uses_peft() or ctx.adapter is not None
    # LLaMA-Factory's own checkpointing function marks the block inputs as requiring grad
    if not enabled or reentrant is False or not peft or train.is_lf:
        return
    state = ctx.shim_state("lora_reentrant_checkpointing")
    if not state["registered"] or not state["affected"]:
        return
    base = (
        f"gradient_checkpointing with PEFT on transformers {ctx.versions.get('transformers')}: checkpointing is "
        "reentrant (use_reentrant " + ("true" if reentrant else "not set: transformers 4.x uses True") + ") and "
        "the frozen embeddings give the checkpointed blocks no input that requires grad, so LoRA weights get no "
        "gradient (\"element 0 of tensors does not require grad\", or silently all-None grads). TRL SFTTrainer given "
        "a peft_config (TRL >= 0.7.5) installs the input-grad hook itself; plain Trainer does not."
    )
    if state["applies"]:
        severity, extra = INFO, " " + _shim_sentence(state) + "."
    else:
        severity, extra = ERROR, " " + _shim_sentence(state) + "."
    ctx.add(
        finding(
            "gc-peft-reentrant",
            base + extra,
            "set gradient_checkpointing_kwargs: {\"use_reentrant\": false}, or call model.enable_input_require_grads() "
            "before training, or run ftshims.apply()",
            severity=severity,
            file=train.path,
            key="gradient_checkpointing",
        )
    )


@_with_training_config
def check_train_keys(ctx, train) -> None:
    known, what = ctx.train_known_keys()
    if not known:
        return
    unknown = [k for k in train.data if k not in known]
    if not unknown:
        return
    if train.is_lf:
        consequence = (
            "LLaMA-Factory parses its config with allow_extra_keys=False and stops with \"Some keys are not used by "
            "the HfArgumentParser\" (unless ALLOW_EXTRA_ARGS=1)"
        )
    else:
        consequence = "TrainingArguments(**config) raises TypeError, and HfArgumentParser rejects the key"
    hints = []
    for k in unknown:
        close = difflib.get_close_matches(k, sorted(known), n=1, cutoff=0.75)
        hints.append(f"{k} (did you mean {close[0]}?)" if close else k)
    ctx.add(
        finding(
            "train-config-unknown-key",
            f"not {what}: {', '.join(hints)}. {consequence}.",
            "fix or remove the key(s)",
            file=train.path,
            key=", ".join(unknown),
        )
    )


# prompt-learning PEFT methods that prepend virtual tokens to the sequence (so the logits outgrow the labels);
# prefix tuning, the other prompt-learning method, puts them in the attention cache instead
VIRTUAL_TOKENS = ("PROMPT_TUNING", "P_TUNING", "MULTITASK_PROMPT_TUNING")
# adapter task types whose model is not a causal LM (label shifting does not apply)
NOT_CAUSAL_TASKS = ("SEQ_CLS", "TOKEN_CLS", "SEQ_2_SEQ_LM", "QUESTION_ANS", "FEATURE_EXTRACTION")
LABEL_SMOOTHING_SHIM = "label_smoothing_peft_unshifted"


def _peft_method(ctx, train) -> Tuple[Optional[str], Optional[str]]:
    """``(peft_type, where)`` of the run: the adapter's, else the training config's; (None, None) without PEFT."""
    if ctx.adapter is not None:
        return str(ctx.adapter.get("peft_type") or "LORA").upper(), "the adapter config"
    kind = train.peft_type()
    return (kind, "the training config") if kind else (None, None)


def check_label_smoothing(ctx) -> None:
    """label_smoothing_factor > 0: Trainer.compute_loss shifts the labels for its LabelSmoother only when a class
    name it reads is in the causal-LM mapping. A causal LM it does not know (remote code such as Qwen-1's
    QWenLMHeadModel, still in 5.24) is trained to predict the *current* token (QwenLM/Qwen#834), and so is a PEFT
    model whose name it misreads (transformers#27161): LoRA-style adapters before 4.36 ("PeftModelForCausalLM",
    then the tuner "LoraModel"), prefix tuning before 4.32 and again from 4.36 (the headless backbone). ftshims'
    ``label_smoothing_peft_unshifted`` fixes the PEFT cases from 4.21; prompt tuning / p-tuning fail with a shape
    error on every version (their logits include the virtual tokens), which the same shim fixes since 0.2.0 (it
    scores the logits behind the virtual tokens, as PEFT's own loss does)."""
    train = ctx.train
    if train is None or train.is_lf:
        return
    factor = train.hf_value("label_smoothing_factor")
    if not isinstance(factor, (int, float)) or factor <= 0:
        return
    tv = ctx.versions.get("transformers")
    custom = None
    arch = ((ctx.model_config or {}).get("architectures") or [None])[0]
    if isinstance(arch, str) and (arch.endswith("ForCausalLM") or arch.endswith("LMHeadModel")):
        try:
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        except ImportError:
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES = None
        if MODEL_FOR_CAUSAL_LM_MAPPING_NAMES is not None:
            known = set()
            for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
                known.update(value if isinstance(value, (list, tuple)) else [value])
            if arch not in known:
                custom = f"the model class {arch} is not in transformers' causal-LM mapping (custom code)"
    peft, where = _peft_method(ctx, train)
    task = str((ctx.adapter or {}).get("task_type") or "").upper()
    if task in NOT_CAUSAL_TASKS:
        peft = None  # not a causal LM: the Trainer never shifts, and should not

    if peft in VIRTUAL_TOKENS:
        state = ctx.shim_state(LABEL_SMOOTHING_SHIM)
        covered = state["registered"] and state["affected"]
        fix = ("set label_smoothing_factor: 0, or use LoRA or prefix tuning, or compute the smoothed loss yourself "
               "(a custom compute_loss that drops the virtual-token positions and shifts the labels)")
        if covered:
            fix = f"run ftshims.apply() in the training process ({LABEL_SMOOTHING_SHIM}), or " + fix
        ctx.add(
            finding(
                "label-smoothing-unshifted",
                f"label_smoothing_factor={factor} with a {peft} adapter (from {where}): the PEFT model prepends its virtual "
                "tokens to the sequence, so the logits are longer than the labels and the Trainer's label smoother "
                "fails with a shape error at the first step, on every transformers version."
                + (f" {_shim_sentence(state)}: the smoother then scores the logits behind the virtual tokens against "
                   "the shifted labels, the pairs PEFT's own loss scores." if covered else ""),
                fix,
                severity=INFO if covered and state["applies"] else WARNING,
                file=train.path,
                key="label_smoothing_factor",
            )
        )
        peft = None  # the crash is the finding; do not also report the shift
    peft_reason = None
    if peft == "PREFIX_TUNING":
        if ctx.version_lt("transformers", "4.32"):
            peft_reason = (f"transformers {tv} reads the wrapper's class name \"PeftModelForCausalLM\" for a PEFT "
                           "model (prefix tuning is shifted only on 4.32-4.35)")
        elif not ctx.version_lt("transformers", "4.36"):
            peft_reason = (f"transformers {tv} reads base_model.model for a PEFT model, which for prefix tuning is "
                           "the headless backbone (e.g. \"LlamaModel\"), not the causal LM (a regression since 4.36, "
                           "unfixed)")
    elif peft is not None and ctx.version_lt("transformers", "4.36"):
        peft_reason = (f"transformers {tv} reads the PEFT wrapper's or tuner's class name for a {peft} model "
                       "(\"PeftModelForCausalLM\" before 4.32, e.g. \"LoraModel\" on 4.32-4.35; fixed in 4.36)")
    reasons = [r for r in (custom, peft_reason) if r]
    if not reasons:
        return
    severity, shim = WARNING, ""
    fixes = ["set label_smoothing_factor: 0", "compute the smoothed loss yourself with shifted labels (a custom compute_loss)"]
    if peft_reason:
        state = ctx.shim_state(LABEL_SMOOTHING_SHIM)
        if state["registered"] and state["affected"]:
            shim = " " + _shim_sentence(state) + "."
            if state["applies"] and not custom:
                severity = INFO
            fixes.insert(0, f"run ftshims.apply() in the training process ({LABEL_SMOOTHING_SHIM})")
        elif state["registered"] and not ctx.version_lt("transformers", "4.21"):
            shim = " " + _shim_sentence(state) + "."
        if peft != "PREFIX_TUNING":
            fixes.append("upgrade transformers to >= 4.36")
    if custom:
        shim += " No shim covers the custom-code model class."
    ctx.add(
        finding(
            "label-smoothing-unshifted",
            f"label_smoothing_factor={factor}, but the Trainer will not shift the labels for the label smoother: "
            + "; ".join(reasons) + ". The model is then trained to predict the current token, not the next one."
            + shim,
            ", or ".join([", ".join(fixes[:-1]), fixes[-1]]) if len(fixes) > 1 else fixes[0],
            severity=severity,
            file=train.path,
            key="label_smoothing_factor",
        )
    )


# -- sequence-classification heads ------------------------------------------------------------------

SEQCLS_SHIM = "seqcls_pools_before_first_pad"


def _decoder_seqcls_families() -> Tuple[frozenset, frozenset]:
    """``(model types, class names)`` of the decoder heads that pool before the first pad (< 4.49)."""
    from ..shims.seqcls_pools_before_first_pad import FAMILIES

    types = {module.split(".", 1)[0] for module in FAMILIES}
    types.add("openai-gpt")  # module openai, model_type openai-gpt
    return frozenset(types), frozenset(FAMILIES.values())


def _seqcls_source(ctx) -> Optional[str]:
    """What says the run trains a decoder sequence-classification (reward) model; None when nothing does."""
    if ctx.train is not None and ctx.train.is_lf:
        return None  # LLaMA-Factory's stage rm: a value head on AutoModelForCausalLM, read at mask.sum() - 1
    types, classes = _decoder_seqcls_families()
    config = ctx.model_config or {}
    arch = (config.get("architectures") or [None])[0]
    if ctx.model_config is not None and not ((isinstance(arch, str) and arch in classes) or str(config.get("model_type")) in types):
        return None  # an encoder (CLS pooling) or a family without the first-pad formula
    if isinstance(arch, str) and arch.endswith("ForSequenceClassification"):
        return f"config.json architectures: {arch}"
    if ctx.adapter is not None and str(ctx.adapter.get("task_type") or "").upper() == "SEQ_CLS":
        return "the adapter (task_type: SEQ_CLS)"
    hint = ctx.train.reward_hint() if ctx.train is not None else None
    if hint:
        return f"the training config (`{hint}`: " + ("a TRL RewardConfig)" if hint == "center_rewards_coefficient" else "SEQ_CLS)")
    return None


def _pad_is_eos(ctx) -> Optional[Tuple[str, Optional[str], str]]:
    """``(description, file, key)`` when the pad token the head will use is an eos token, else None."""
    tok = ctx.tokenizer_info()
    override = ctx.train.get("pad_token") if ctx.train is not None else None
    if tok is not None:
        if tok["eos_token"] is None:
            return None
        if isinstance(override, str) and override:  # TRL RewardConfig.pad_token replaces the tokenizer's
            if override != tok["eos_token"]:
                return None
            return f"the training config's pad_token {override!r} is the eos token", ctx.train.path, "pad_token"
        if tok["pad_token"] is None:
            return None  # tokenizer-no-pad reports it
        same = tok["pad_token"] == tok["eos_token"] or (
            tok["pad_token_id"] is not None and tok["pad_token_id"] == tok["eos_token_id"]
        )
        if not same:
            return None
        return f"the tokenizer's pad token is its eos token ({tok['pad_token']!r})", ctx.inputs.tokenizer, "pad_token"
    if ctx.model_config is None or ctx.inputs.tokenizer:
        return None  # no tokenizer to read, or one that failed to load (tokenizer-load-failed)
    pad_id, eos = ctx.model_config.get("pad_token_id"), ctx.model_config.get("eos_token_id")
    if pad_id is None or pad_id not in (eos if isinstance(eos, (list, tuple)) else [eos]):
        return None
    return f"config.json pad_token_id {pad_id} is an eos id", ctx.model_config_path, "pad_token_id"


def check_seqcls_pad(ctx) -> None:
    """transformers < 4.49 decoder ``*ForSequenceClassification`` heads pool the token before the first pad id;
    with pad == eos that is the first EOS inside the text (transformers#35352, fixed in 4.49 by PR #35911)."""
    if not ctx.version_lt("transformers", "4.49"):
        return
    what = _seqcls_source(ctx)
    pad = _pad_is_eos(ctx) if what else None
    if pad is None:
        return
    pad_desc, file, key = pad
    state = ctx.shim_state(SEQCLS_SHIM)
    severity, shim = WARNING, ""
    if state["registered"]:
        if state["affected"]:
            shim = " " + _shim_sentence(state) + "."
            severity = INFO if state["applies"] else WARNING
        elif ctx.version_lt("transformers", "4.30"):
            shim = f" ftshims' `{SEQCLS_SHIM}` shim covers transformers >= 4.30 only."
        else:
            shim = " " + _shim_sentence(state) + "."
    ctx.add(
        finding(
            "seqcls-pad-in-text",
            f"this is a decoder sequence-classification (reward) model ({what}) and {pad_desc}: "
            f"transformers {ctx.versions.get('transformers')} (< 4.49) pools the hidden state of the token before the "
            "FIRST pad id in each row, so the score is read at the first EOS inside the text (often the end of the "
            "system prompt or the first turn), not at the last token. Chosen and rejected responses then score alike "
            "and a reward model's loss sticks at 0.693 (log 2), silently." + shim,
            f"run ftshims.apply() in the training process ({SEQCLS_SHIM}), or use a distinct pad token (an unused "
            "reserved token, or add '<pad>' and resize the embeddings; set model.config.pad_token_id to it), or "
            "upgrade transformers to >= 4.49",
            severity=severity,
            file=file,
            key=key,
        )
    )


# -- weights' precision ---------------------------------------------------------------------------------

HALF_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16"}
# Keys only TRL's configs (SFTConfig, the TRL CLI's ModelConfig) use: TRL loads a model it is given by name in float32.
TRL_MARKERS = ("model_init_kwargs", "dataset_text_field", "packing", "padding_free", "completion_only_loss",
               "assistant_only_loss", "dataset_kwargs", "dataset_num_proc", "use_peft", "model_name_or_path",
               "max_seq_length", "packing_strategy")


def _dtype_name(value: Any) -> str:
    return str(value).strip().lower().replace("torch.", "")


def _checkpoint_dtype(config: Optional[Dict[str, Any]]) -> Optional[str]:
    """The dtype config.json records for the weights (``dtype`` on 5.x saves, ``torch_dtype`` before), as a name."""
    if not config:
        return None
    for source in (config, config.get("text_config") if isinstance(config.get("text_config"), dict) else None):
        if source:
            for key in ("dtype", "torch_dtype"):
                if source.get(key):
                    return _dtype_name(source[key])
    return None


@_with_training_config
def check_half_weights(ctx, train) -> None:
    """transformers 5.0 made ``dtype="auto"`` the default of ``from_pretrained`` (PR #42805): a checkpoint stored in
    bf16 loads in bf16, and a full fine-tune then updates bf16 weights directly; AdamW steps below half an ulp round
    away (one step at lr 1e-5 on a tiny Llama: 85.5% of the weights unchanged on 5.x, 5.6% on 4.57)."""
    if train.is_lf or train.uses_peft() or ctx.adapter is not None or ctx.ds is not None:
        return  # LLaMA-Factory upcasts trainable params; adapters train fp32 LoRA weights; DeepSpeed keeps fp32 masters
    init = train.model_init_kwargs()
    explicit = next(((where, value) for where, value in (
        ("model_init_kwargs.dtype", init.get("dtype")), ("model_init_kwargs.torch_dtype", init.get("torch_dtype")),
        ("dtype", train.get("dtype")), ("torch_dtype", train.get("torch_dtype"))) if value is not None), None)
    stored = HALF_DTYPES.get(_checkpoint_dtype(ctx.model_config) or "")
    tv = ctx.versions.get("transformers")
    trl = any(train.given(key) for key in TRL_MARKERS)
    if explicit is not None:
        key, value = explicit
        name = _dtype_name(value)
        if name in HALF_DTYPES:
            loads, severity = f"`{key}: {value}` loads the weights in {HALF_DTYPES[name]}", WARNING
        elif name == "auto" and stored:
            loads, severity = f"`{key}: auto` loads the checkpoint's {stored} (config.json)", WARNING
        else:
            return
    else:
        if not stored or ctx.version_lt("transformers", "5.0.0") or tv is None:
            return
        key = "model_init_kwargs" if trl else None
        loads = (f"transformers {tv}'s from_pretrained() defaults to dtype=\"auto\" and loads this checkpoint's "
                 f"{stored} (config.json) when it is given no dtype")
        # TRL loads a model it is given by name in float32; only a model object loaded without dtype is affected
        severity = INFO if trl else WARNING
        if trl:
            loads += " (TRL itself loads a model given by name in float32: this applies if you pass a model object)"
    ctx.add(
        finding(
            "full-finetune-half-weights",
            f"full fine-tune in half precision: {loads}, and nothing keeps a float32 master copy (bf16=True only "
            "changes the compute dtype), so optimizer updates smaller than half a bf16 step are lost "
            "(one AdamW step at lr 1e-5: 85.5% of a tiny Llama's weights unchanged).",
            "load the model with dtype=torch.float32 for full fine-tuning (keep bf16: true for bf16 compute), or "
            "train with an optimizer that keeps fp32 master weights (DeepSpeed)",
            severity=severity,
            file=train.path,
            key=key,
        )
    )


# -- LLaMA-Factory ------------------------------------------------------------------------------------

LF_POSITION_IDS_UNPADDED = ">=0.9.3,<=0.9.5"  # the releases read and run (the collator from their wheels)


@_with_training_config
def check_lf_packing_cutoff(ctx, train) -> None:
    """LLaMA-Factory subtracts 1 from cutoff_len when packing and pads every packed row back to cutoff_len with
    per-example position_ids; its SFT collator (pad_to_multiple_of=8) pads input_ids/attention_mask/labels but not
    position_ids (not a model input name), so a cutoff_len that is not a multiple of 8 fails at the first forward."""
    if not train.is_lf or str(train.get("stage", lf.DEFAULTS["stage"])) != "sft":
        return
    if not (as_bool(train.get("packing")) or as_bool(train.get("neat_packing"))):
        return
    from ..versions import in_range

    installed = ctx.versions.get("llamafactory")
    if installed is not None and not in_range(installed, LF_POSITION_IDS_UNPADDED):
        return  # a release not read (older) or after 0.9.5
    length, key, explicit = train.seq_len()
    if not length or length % 8 == 0:
        return
    padded = -(-length // 8) * 8
    source = f"`{key}: {length}`" + ("" if explicit else " (LLaMA-Factory's default)")
    ctx.add(
        finding(
            "llamafactory-packing-cutoff-len",
            f"packing with {source}: LLaMA-Factory {installed or lf.VERSION} packs rows of exactly {length} tokens with "
            f"per-example position_ids, and its SFT collator pads input_ids to {padded} (pad_to_multiple_of=8) but not "
            f"position_ids, so the first forward fails: RuntimeError: The size of tensor a ({padded}) must match the "
            f"size of tensor b ({length}) in apply_rotary_pos_emb, with any attention implementation "
            "(hiyouga/LlamaFactory#10736; PR #10737 is in no release up to 0.9.5).",
            f"set `cutoff_len` to a multiple of 8 ({padded - 8 if padded - 8 > 0 else padded} or {padded})",
            file=train.path,
            key=key,
        )
    )


CHECKS = (
    check_train_keys,
    check_adapter_keys,
    check_lora_targets,
    check_modules_to_save_tied,
    check_tokenizer_pad,
    check_chat_template,
    check_seq_len,
    check_packing,
    check_gc_peft,
    check_label_smoothing,
    check_seqcls_pad,
    check_half_weights,
    check_lf_packing_cutoff,
)
