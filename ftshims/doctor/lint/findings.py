"""The lint's rules (id, default severity, what it checks, reference) and its findings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

ERROR = "error"
WARNING = "warning"
INFO = "info"
SEVERITIES = (ERROR, WARNING, INFO)

DOCS = "docs/doctor-json.md#lint-rules"


@dataclass(frozen=True)
class Rule:
    id: str
    severity: str  # the default; a finding may be raised or lowered with the reason in its message
    checks: str
    ref: Optional[str]


_RULES = (
    # inputs
    Rule("file-unreadable", ERROR, "a given file or directory is missing, unreadable or not valid JSON/YAML", DOCS),
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
    # the lint itself
    Rule("lint-rule-failed", WARNING, "a lint rule raised (a doctor bug or an input nobody foresaw); the other rules still ran", DOCS),
)

RULES: Dict[str, Rule] = {rule.id: rule for rule in _RULES}


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
        "ref": ref or spec.ref,
        "file": file,
        "key": key,
    }


def sort_findings(findings: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    order = {sev: i for i, sev in enumerate(SEVERITIES)}
    return sorted(findings, key=lambda f: order.get(f["severity"], 9))
