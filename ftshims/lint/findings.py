"""The lint's rules (id, default severity, what it checks, reference, when it fires) and its findings.

``python -m ftshims.doctor --explain RULE`` prints a rule from this module, so an installed package can
explain its findings without the repository's docs; docs/doctor-json.md's rule table is the same text
(tests/lint/test_lint.py keeps the two equal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

ERROR = "error"
WARNING = "warning"
INFO = "info"
SEVERITIES = (ERROR, WARNING, INFO)

EXPLAIN = "python -m ftshims.doctor --explain {rule}"


@dataclass(frozen=True)
class Rule:
    id: str
    severity: str  # the default; a finding may be raised or lowered with the reason in its message
    checks: str
    ref: Optional[str]


_RULES = (
    # inputs
    Rule("file-unreadable", ERROR, "a given file or directory is missing or cannot be read", None),
    Rule("config-invalid", ERROR, "a given JSON/YAML file does not parse, or its top level is not a mapping", None),
    Rule("yaml-unsupported", INFO, "a YAML file was given but PyYAML is not installed, so it was not read", "https://pypi.org/project/PyYAML/"),
    Rule("model-config-invalid", ERROR, "config.json has no model_type, or the installed transformers cannot build the model from it", "https://huggingface.co/docs/transformers/main_classes/configuration"),
    Rule("train-config-unknown-key", WARNING, "a training-config key is not an argument of the trainer it is for (installed transformers/TRL, or LLaMA-Factory 0.9.5)", "https://huggingface.co/docs/transformers/main_classes/trainer#transformers.TrainingArguments"),
    Rule("adapter-config-unknown-key", WARNING, "an adapter_config.json key is not a field of the installed PEFT's config class", "https://github.com/huggingface/peft/issues/1346"),
    # LoRA / PEFT
    Rule("lora-target-no-match", ERROR, "LoRA target_modules / lora_target match no module of the model", "https://huggingface.co/docs/peft/developer_guides/troubleshooting"),
    Rule("lora-target-partial-match", WARNING, "some target_modules entries match no module (PEFT drops them silently when another entry matches)", "https://huggingface.co/docs/peft/package_reference/lora#peft.LoraConfig"),
    Rule("lora-target-unsupported-module", ERROR, "target_modules match a module LoRA cannot wrap (a block, a norm, an activation: not Linear/Conv/Embedding)", "https://huggingface.co/docs/peft/developer_guides/custom_models"),
    Rule("modules-to-save-tied", WARNING, "modules_to_save / targets include a tied input embedding or lm_head: the trained copies drift apart and merging drops one", "https://github.com/huggingface/peft/issues/2777"),
    # tokenizer
    Rule("tokenizer-load-failed", ERROR, "the tokenizer directory does not load with the installed transformers", "https://huggingface.co/docs/transformers/main_classes/tokenizer"),
    Rule("tokenizer-no-pad", WARNING, "the tokenizer has no pad token", "https://huggingface.co/docs/transformers/pad_truncation"),
    Rule("label-smoothing-unshifted", WARNING, "label smoothing on a causal LM the Trainer does not recognise (custom code, or a PEFT model whose name it misreads): the labels are not shifted and the model learns to predict the current token", "https://github.com/huggingface/transformers/issues/27161"),
    Rule("pad-is-eos", WARNING, "pad token == eos token while the collator masks pad labels: every EOS label becomes -100 and the model never learns to stop", "https://github.com/huggingface/transformers/issues/23530"),
    Rule("chat-template-missing", WARNING, "a chat format is configured but the tokenizer has no chat template (or LLaMA-Factory's template is unknown)", "https://huggingface.co/docs/transformers/chat_templating"),
    # sequence length
    Rule("seq-len-exceeds-positions", ERROR, "the sequence length setting exceeds max_position_embeddings (learned positions: error; RoPE: warning)", "https://github.com/huggingface/transformers/issues/1749"),
    # DeepSpeed
    Rule("ds-unknown-key", WARNING, "a DeepSpeed key that DeepSpeed does not know (rejected inside zero_optimization/offload/fp16/bf16, silently ignored elsewhere)", "https://www.deepspeed.ai/docs/config-json/"),
    Rule("ds-misplaced-key", ERROR, "a DeepSpeed key in the wrong section (e.g. `offload` under `optimizer` instead of `zero_optimization.offload_optimizer`)", "https://www.deepspeed.ai/docs/config-json/#zero-optimizations-for-fp16-training"),
    Rule("ds-zero3-device-map", ERROR, "ZeRO-3 with a device_map (or low_cpu_mem_usage on transformers < 4.51) model load", "https://huggingface.co/docs/transformers/deepspeed#zero-3"),
    Rule("ds-offload-stage", ERROR, "offload on a ZeRO stage that ignores or rejects it (offload_param needs stage 3, offload_optimizer stage >= 1, partial ratio stage 3)", "https://www.deepspeed.ai/docs/config-json/#parameter-offloading"),
    Rule("ds-fp16-bf16-both", ERROR, "fp16 and bf16 both enabled in the DeepSpeed config", "https://www.deepspeed.ai/docs/config-json/#bfloat16-training-options"),
    Rule("ds-train-mismatch", ERROR, "a DeepSpeed value that is not \"auto\" contradicts the training config (batch size, gradient accumulation, clipping, lr, ...)", "https://huggingface.co/docs/transformers/deepspeed#deepspeed-and-trainer-parameters"),
    # training recipe x installed stack
    Rule("packing-contamination", WARNING, "packing whose attention implementation / versions let packed examples attend to each other", "https://github.com/huggingface/transformers/pull/39194"),
    Rule("gc-peft-reentrant", ERROR, "gradient checkpointing + PEFT on a stack where reentrant checkpointing leaves LoRA without gradients and the shim is not applied", "https://github.com/huggingface/peft/issues/742"),
    Rule("seqcls-pad-in-text", WARNING, "a decoder sequence-classification / reward model whose pad token is its eos token on transformers < 4.49: the head scores the token before the first pad inside the text, not the last token", "https://github.com/huggingface/transformers/issues/35352"),
    Rule("full-finetune-half-weights", WARNING, "a full fine-tune whose weights load in bf16/fp16 (an explicit half dtype, or transformers >= 5's default dtype=\"auto\" on a half-precision checkpoint) with no fp32 master copy: small optimizer updates round away", "https://github.com/huggingface/transformers/pull/42805"),
    Rule("llamafactory-packing-cutoff-len", ERROR, "LLaMA-Factory <= 0.9.5 packing with a cutoff_len that is not a multiple of 8: the collator pads the packed rows but not their position_ids, and the first forward fails", "https://github.com/hiyouga/LlamaFactory/issues/10736"),
    # the lint itself
    Rule("lint-rule-failed", WARNING, "a lint rule raised (a doctor bug or an input nobody foresaw); the other rules still ran", None),
)

RULES: Dict[str, Rule] = {rule.id: rule for rule in _RULES}

# When each rule fires, in full (the "fires when" column of docs/doctor-json.md's rule table).
FIRES_WHEN: Dict[str, str] = {
    "file-unreadable": "a given file or directory is missing or cannot be read (a DeepSpeed file named by the training config and not found: warning)",
    "config-invalid": "a given JSON/YAML file does not parse (the message gives the line and column, the fix the syntax rule it breaks), or its top level is not a mapping",
    "yaml-unsupported": "a YAML file was given but PyYAML is not installed (it is not read)",
    "model-config-invalid": "`config.json` has no `model_type`, the installed transformers does not know it (custom code is never run), or cannot build it",
    "train-config-unknown-key": "a training-config key is not an argument of its trainer: the installed transformers' `Seq2SeqTrainingArguments` (plus TRL `SFTConfig`/`ModelConfig`/`ScriptArguments` when TRL is installed), or LLaMA-Factory 0.9.5's arguments (LLaMA-Factory then stops: `allow_extra_keys=False`)",
    "adapter-config-unknown-key": "an `adapter_config.json` key is not a field of the installed PEFT's config class (saved by another PEFT version)",
    "lora-target-no-match": "`target_modules` / `lora_target` / `lora_target_modules` match no module (PEFT raises); the message lists the model's linear layers",
    "lora-target-partial-match": "some entries match nothing (PEFT drops them silently when another entry matches); suggests the closest linear layer name",
    "lora-target-unsupported-module": "a target matches a module LoRA cannot wrap (a block, a norm, an activation); suggests the linear layers inside it",
    "modules-to-save-tied": "`modules_to_save` (or `target_modules`, LLaMA-Factory `additional_target`) names a tied input embedding / `lm_head` without `ensure_weight_tying`",
    "tokenizer-load-failed": "the tokenizer directory does not load with the installed transformers",
    "tokenizer-no-pad": "no pad token (info for LLaMA-Factory, which sets pad = eos and labels by position)",
    "label-smoothing-unshifted": "`label_smoothing_factor` > 0 with a causal LM whose class is not in transformers' causal-LM mapping (custom code), a LoRA-style PEFT model on transformers < 4.36, or a prefix-tuning adapter on transformers < 4.32 or >= 4.36: the labels are not shifted (info when `ftshims.apply()` would install `label_smoothing_peft_unshifted`, which fixes the PEFT cases from 4.21); a prompt-tuning / p-tuning adapter on any version: the smoother fails with a shape error (the logits include the virtual tokens; info when the same shim fixes it: it scores the logits behind the virtual tokens, as PEFT's own loss does)",
    "pad-is-eos": "pad == eos and the collator masks pad labels (transformers' `DataCollatorForLanguageModeling`, TRL < 0.16.1 `SFTTrainer`): every EOS label becomes -100; info for a TRL >= 0.16.1 SFT config",
    "chat-template-missing": "a chat format is configured (`assistant_only_loss`, `dataset_text_field: messages`; LLaMA-Factory SFT without `template`) but the tokenizer has no chat template (error with `assistant_only_loss`; also when its template lacks `{% generation %}`), or a LLaMA-Factory `template` that 0.9.5 does not know",
    "seq-len-exceeds-positions": "`cutoff_len` (LLaMA-Factory; its default 2048 counts) / `max_length` / `max_seq_length` exceeds `max_position_embeddings`: error for learned positions, warning for RoPE (info with LLaMA-Factory `rope_scaling`)",
    "ds-unknown-key": "a key DeepSpeed does not know: error inside `zero_optimization`, `offload_*`, `fp16`, `bf16` (pydantic `extra=\"forbid\"`), warning elsewhere (silently ignored). Checked against DeepSpeed 0.19.8's schema",
    "ds-misplaced-key": "a key in the wrong section, e.g. `offload` under `optimizer` (or `optimizer.params`) instead of `zero_optimization.offload_optimizer`, ZeRO keys at the top level",
    "ds-zero3-device-map": "ZeRO-3 with a `device_map` model load (`model_init_kwargs`), or `low_cpu_mem_usage: true` on transformers < 4.51 (info from 4.51, where it is ignored)",
    "ds-offload-stage": "`offload_param` below stage 3, `offload_optimizer` at stage 0, a partial `offload_optimizer.ratio` below stage 3",
    "ds-fp16-bf16-both": "`fp16.enabled` and `bf16.enabled` both true",
    "ds-train-mismatch": "a non-`\"auto\"` DeepSpeed value differs from the TrainingArguments value (or its default): micro batch size, gradient accumulation, clipping, lr, betas, eps, weight decay, warmup_max_lr, fp16/bf16; or `train_batch_size` is not a multiple of micro batch × accumulation",
    "packing-contamination": "packing whose packer / attention implementation / versions let packed examples attend to each other: by design (TRL ConstantLengthDataset, `pack_examples`, `\"wrapped\"`; LLaMA-Factory `packing` without `neat_packing` under flash attention): warning; fixable by a registered shim in range (`packing_block_mask`, `trl_padding_free_position_ids`): info when `ftshims.apply()` would install it, error when it would not (disabled, target missing)",
    "gc-peft-reentrant": "gradient checkpointing + PEFT with reentrant checkpointing on a stack inside `lora_reentrant_checkpointing`'s range and the shim not applied (info when `ftshims.apply()` would install it); not for LLaMA-Factory, whose checkpointing function marks the inputs itself",
    "seqcls-pad-in-text": "a decoder `*ForSequenceClassification` model (config.json `architectures`, an adapter with `task_type: SEQ_CLS`, or a TRL reward config: `center_rewards_coefficient`, `lora_task_type: SEQ_CLS`) whose tokenizer's pad token is its eos token, on transformers < 4.49: the reward is read at the first EOS inside the text; info when `ftshims.apply()` would install `seqcls_pools_before_first_pad`; not for LLaMA-Factory `stage: rm` (its value head reads the last token by the attention mask)",
    "full-finetune-half-weights": "a full fine-tune (no adapter, no PEFT in the training config; not LLaMA-Factory, which upcasts trainable parameters, nor DeepSpeed, which keeps fp32 master weights) whose weights load in bfloat16/float16: `model_init_kwargs.dtype` / `dtype` (TRL) set to a half dtype, or to `\"auto\"` on a checkpoint whose config.json says bfloat16/float16; or, with transformers >= 5.0 (`from_pretrained` defaults to `dtype=\"auto\"`), no dtype at all on such a checkpoint: warning for a transformers config, info for a TRL config (TRL loads float32 when given a model name)",
    "llamafactory-packing-cutoff-len": "a LLaMA-Factory SFT config with `packing` or `neat_packing` and a `cutoff_len` (its default 2048 counts) that is not a multiple of 8, with LLaMA-Factory 0.9.3-0.9.5 installed or not installed: every packed row is `cutoff_len` tokens, the collator pads `input_ids` to the next multiple of 8 but not `position_ids`, and the first forward raises a size mismatch in `apply_rotary_pos_emb` (any attention implementation)",
    "lint-rule-failed": "a rule raised (a doctor bug or an unforeseen input); the other rules still ran",
}


def explain_command(rule: str) -> str:
    return EXPLAIN.format(rule=rule)


def explain(rule: str) -> str:
    """The text ``--explain RULE`` prints; KeyError for an unknown rule."""
    spec = RULES[rule]
    lines = [
        f"{spec.id} (default severity: {spec.severity})",
        f"  checks      {spec.checks}",
        f"  fires when  {FIRES_WHEN[rule]}",
    ]
    if spec.ref:
        lines.append(f"  reference   {spec.ref}")
    return "\n".join(lines) + "\n"


def finding(
    rule: str,
    message: str,
    fix: str,
    severity: Optional[str] = None,
    file: Optional[str] = None,
    key: Optional[str] = None,
    ref: Optional[str] = None,
) -> Dict[str, Any]:
    spec = RULES[rule]
    severity = severity or spec.severity
    if severity not in SEVERITIES:
        raise ValueError(f"severity must be one of {SEVERITIES}, not {severity!r}")
    return {
        "rule": rule,
        "severity": severity,
        "message": message,
        "fix": fix,
        "ref": ref or spec.ref or explain_command(rule),
        "file": file,
        "key": key,
        "explain": explain_command(rule),  # works from an installed package: no docs/ needed
    }


def sort_findings(findings: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    order = {sev: i for i, sev in enumerate(SEVERITIES)}
    return sorted(findings, key=lambda f: order.get(f["severity"], 9))
