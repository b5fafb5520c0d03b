"""Advisories: the data file's schema, and every advisory's matching on fabricated version sets.

Fast and offline: nothing here imports torch or transformers. Every advisory in
ftshims/data/advisories.json must have a row in CASES (a test fails otherwise),
with versions inside its range, on both edges, outside it, with a package
absent, and with pre-release / local versions where they matter.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap

import pytest

from ftshims import advisories
from ftshims.advisories import AdvisoryDataError, parse

N = None  # "not installed"

# advisory id -> [(versions, checks, expected match)]
CASES = {
    "modernbert_flash_attn_pos_idx_in_fp32": [
        ({"transformers": "4.48.0", "flash-attn": "2.8.0.post2"}, None, True),  # both lower edges
        ({"transformers": "4.52.4", "flash-attn": "2.8.3.post2"}, None, True),
        ({"transformers": "4.53.0", "flash-attn": "2.8.0.post2"}, None, False),  # fixed release
        ({"transformers": "4.53.0.dev0", "flash-attn": "2.8.0"}, None, False),  # dev build of the fix counts as fixed
        ({"transformers": "4.47.1", "flash-attn": "2.8.0"}, None, False),  # no ModernBERT yet
        ({"transformers": "4.50.0", "flash-attn": "2.7.4.post1"}, None, False),  # still has pos_idx_in_fp32
        ({"transformers": "4.50.0", "flash-attn": N}, None, False),
        ({"transformers": "4.51.0.dev0", "flash-attn": "2.8.1"}, None, True),
        ({"transformers": "4.50.0", "flash-attn": "2.8.0+cu12torch2.6cxx11abiTRUE"}, None, True),  # local label
        ({"transformers": "4.50.0", "flash_attn": "2.8.2"}, None, True),  # module-style name
        ({"transformers": "4.50.0", "flash-attn": "2.8.0a1"}, None, False),  # pre-release of 2.8.0 sorts below it (PEP 440)
    ],
    "flash_attn_triton_ops_need_torch_2_6": [
        ({"flash-attn": "2.8.0.post2", "torch": "2.5.1+cu124"}, None, True),
        ({"flash-attn": "2.8.3", "torch": "2.4.1"}, None, True),
        ({"flash_attn": "2.8.3.post2", "torch": "2.5.0a0+git1234abc"}, None, True),
        ({"flash-attn": "2.8.3", "torch": "2.6.0"}, None, False),  # torch edge
        ({"flash-attn": "2.8.3", "torch": "2.6.0a0+git123"}, None, False),  # NGC 2.6 build
        ({"flash-attn": "2.7.4.post1", "torch": "2.5.1"}, None, False),
        ({"flash-attn": N, "torch": "2.5.1"}, None, False),
        ({"flash-attn": "2.8.3", "torch": N}, None, False),
    ],
    "trl_constant_length_dataset_packing": [
        ({"trl": "0.14.0"}, None, True),
        ({"trl": "0.4.7"}, None, True),
        ({"trl": "0.14.0+local"}, None, True),
        ({"trl": "0.15.0"}, None, False),
        ({"trl": "0.15.0.dev0"}, None, False),
        ({"trl": "1.16.0"}, None, False),
        ({"trl": N}, None, False),
        ({}, None, False),
    ],
    "trl_wrapped_only_packing": [
        ({"trl": "0.15.0"}, None, True),
        ({"trl": "0.16.1"}, None, True),
        ({"trl": "0.18.2"}, None, True),
        ({"trl": "0.14.0"}, None, False),
        ({"trl": "0.15.0rc1"}, None, False),  # below 0.15.0
        ({"trl": "0.19.0"}, None, False),
        ({"trl": "0.19.0.dev0"}, None, False),
        ({"trl": N}, None, False),
    ],
    "packing_contaminated_below_4_37": [
        ({"transformers": "4.30.2"}, None, True),
        ({"transformers": "4.36.2"}, None, True),
        ({"transformers": "4.37.0"}, None, False),
        ({"transformers": "4.37.0.dev0"}, None, False),
        ({"transformers": "5.24.0"}, None, False),
        ({"transformers": N}, None, False),
    ],
    "custom_4d_mask_unsupported": [
        ({"transformers": "4.30.2"}, None, True),
        ({"transformers": "4.36.2"}, None, True),
        ({"transformers": "4.37.0"}, None, False),
        ({"transformers": "4.37.0.dev0"}, None, False),
        ({"transformers": "4.57.6"}, None, False),
        ({"transformers": N}, None, False),
    ],
    "packing_detection_needs_torch_2_6": [
        ({"torch": "2.5.1+cu124", "transformers": "4.53.1"}, None, True),  # lower edge of transformers
        ({"torch": "2.5.1", "transformers": "4.57.6"}, None, True),
        ({"torch": "2.4.1", "transformers": "4.57.0.dev0"}, None, True),  # dev build inside the range
        ({"torch": "2.5.0a0+git1234abc", "transformers": "4.55.0"}, None, True),  # NGC build of 2.5
        ({"torch": "2.5.1", "transformers": "4.53.0"}, None, False),  # no packing detection at all yet
        ({"torch": "2.5.1", "transformers": "5.0.0"}, None, False),  # upper edge: gate removed
        ({"torch": "2.5.1", "transformers": "5.0.0.dev0"}, None, False),
        ({"torch": "2.6.0", "transformers": "4.55.0"}, None, False),  # torch edge
        ({"torch": "2.6.0a0+git123", "transformers": "4.55.0"}, None, False),  # NGC 2.6 build: transformers counts it as 2.6
        ({"torch": "2.13.0+cpu", "transformers": "4.57.6"}, None, False),
        ({"torch": N, "transformers": "4.55.0"}, None, False),
        ({"torch": "2.5.1", "transformers": N}, None, False),
    ],
    "ga_mean_of_micro_batch_means": [
        ({"transformers": "4.30.2"}, None, True),
        ({"transformers": "4.45.2"}, None, True),
        ({"transformers": "4.46.0"}, None, False),
        ({"transformers": "4.46.0.dev0"}, None, False),
        ({"transformers": N}, None, False),
    ],
    "ga_loss_scaling_4_46": [
        ({"transformers": "4.46.0"}, None, True),
        ({"transformers": "4.46.3"}, None, True),
        ({"transformers": "4.45.2"}, None, False),
        ({"transformers": "4.47.0"}, None, False),
        ({"transformers": "4.47.0.dev0"}, None, False),
        ({"transformers": N}, None, False),
    ],
    "ga_loss_scaling_4_47_0": [
        ({"transformers": "4.47.0"}, None, True),
        ({"transformers": "4.47.0+local"}, None, True),
        ({"transformers": "4.46.3"}, None, False),
        ({"transformers": "4.47.1"}, None, False),
        ({"transformers": N}, None, False),
    ],
    "ga_loss_scaling_4_47_1": [
        ({"transformers": "4.47.1"}, None, True),
        ({"transformers": "4.47.0"}, None, False),
        ({"transformers": "4.48.0"}, None, False),
        ({"transformers": "4.48.0.dev0"}, None, False),
        ({"transformers": N}, None, False),
    ],
    "ga_loss_scaling_4_48_0": [
        ({"transformers": "4.48.0"}, None, True),
        ({"transformers": "4.47.1"}, None, False),
        ({"transformers": "4.48.1"}, None, False),
        ({"transformers": "4.57.6"}, None, False),
        ({"transformers": N}, None, False),
    ],
    "accelerate_hub_split_torch_state_dict": [
        ({"accelerate": "0.32.0", "huggingface-hub": "0.17.3"}, None, True),  # lower edge of accelerate
        ({"accelerate": "1.12.0", "huggingface-hub": "0.20.3"}, None, True),  # last accelerate importing it eagerly
        ({"accelerate": "0.32.1", "huggingface_hub": "0.17.3"}, None, True),  # module-style name
        ({"accelerate": "0.31.0", "huggingface-hub": "0.17.3"}, None, False),
        ({"accelerate": "1.13.0", "huggingface-hub": "0.20.3"}, None, False),  # import became lazy
        ({"accelerate": "0.32.1", "huggingface-hub": "0.21.0"}, None, False),  # hub edge: has the function
        ({"accelerate": "0.32.1", "huggingface-hub": "0.21.0rc0"}, None, False),
        ({"accelerate": "0.32.1", "huggingface-hub": N}, None, False),
        ({"accelerate": N, "huggingface-hub": "0.17.3"}, None, False),
    ],
    "flash_attn_abi_mismatch": [
        ({"flash-attn": "2.7.4.post1", "torch": "2.6.0+cu124"}, None, False),  # never on versions alone
        ({"flash-attn": "2.7.4.post1"}, {"flash_attn_import": "abi mismatch"}, True),
        ({}, {"flash_attn_import": "abi mismatch"}, True),  # metadata-less install still counts
        ({"flash-attn": "2.7.4.post1"}, {"flash_attn_import": "ok"}, False),
        ({"flash-attn": "2.7.4.post1"}, {"flash_attn_import": "missing library"}, False),
        ({"flash-attn": "2.7.4.post1"}, {"flash_attn_import": None}, False),
        ({"flash-attn": "2.7.4.post1"}, {}, False),
    ],
    "deepseek_v2_yarn_missing_mscale": [
        ({"transformers": "4.54.0"}, None, True),
        ({"transformers": "4.57.0.dev0"}, None, True),
        ({"transformers": "5.14.1"}, None, True),
        ({"transformers": "4.53.3"}, None, False),
        ({"transformers": "5.15.0"}, None, False),
        ({"transformers": "5.15.0.dev0"}, None, False),
        ({"transformers": N}, None, False),
    ],
    "mistral4_yarn_missing_mscale": [
        ({"transformers": "5.4.0"}, None, True),
        ({"transformers": "5.14.1"}, None, True),
        ({"transformers": "5.3.0"}, None, False),
        ({"transformers": "5.15.0"}, None, False),
        ({"transformers": "4.57.6"}, None, False),
        ({"transformers": N}, None, False),
    ],
    "llama_gemma_causal_mask_buffer_4_38": [
        ({"transformers": "4.38.0"}, None, True),
        ({"transformers": "4.38.2"}, None, True),
        ({"transformers": "4.37.2"}, None, False),
        ({"transformers": "4.38.0.dev0"}, None, False),  # below 4.38.0
        ({"transformers": "4.39.0"}, None, False),
        ({"transformers": N}, None, False),
    ],
    "num_items_in_batch_overcount_4_46": [
        ({"transformers": "4.46.2"}, None, True),
        ({"transformers": "4.56.2"}, None, True),
        ({"transformers": "4.46.1"}, None, False),  # 4.46.0-4.46.1 counted labels[..., 1:]
        ({"transformers": "4.45.2"}, None, False),
        ({"transformers": "4.57.0"}, None, False),  # from here the num_items_in_batch_overcount shim applies
        ({"transformers": N}, None, False),
    ],
    "gemma2_4_42_early_releases": [
        ({"transformers": "4.42.0"}, None, True),
        ({"transformers": "4.42.3"}, None, True),
        ({"transformers": "4.41.2"}, None, False),
        ({"transformers": "4.42.0.dev0"}, None, False),  # below 4.42.0
        ({"transformers": "4.42.4"}, None, False),  # all three fixed
        ({"transformers": N}, None, False),
    ],
    "gemma_hidden_act_gelu_exact_regression": [
        ({"transformers": "4.48.0"}, None, True),  # PR #35235: GemmaMLP(LlamaMLP) reads hidden_act
        ({"transformers": "4.57.6"}, None, True),
        ({"transformers": "5.0.0rc0"}, None, True),  # pre-release inside the range
        ({"transformers": "5.17.0"}, None, True),  # last release without the config conversion
        ({"transformers": "4.47.1"}, None, False),  # tanh unless hidden_activation says otherwise
        ({"transformers": "4.48.0.dev0"}, None, False),  # below 4.48.0
        ({"transformers": "4.38.2"}, None, False),  # exact GELU too, but before #29402: not this regression
        ({"transformers": "5.18.0"}, None, False),  # GemmaConfig maps "gelu" to "gelu_pytorch_tanh"
        ({"transformers": "5.18.0.dev0"}, None, False),  # dev build of the fix counts as fixed
        ({"transformers": N}, None, False),
    ],
    "trl_sft_double_bos_conversational": [
        ({"trl": "0.15.0"}, None, True),
        ({"trl": "0.16.1"}, None, True),
        ({"trl": "0.14.0"}, None, False),  # detects the chat format and tokenizes without special tokens
        ({"trl": "0.17.0"}, None, False),  # PR #3328
        ({"trl": "0.17.0.dev0"}, None, False),  # PEP 440: a pre-release of the bound is outside <0.17.0
        ({"trl": N}, None, False),
    ],
    "trl_sft_eos_label_masked_when_pad_is_eos": [
        ({"trl": "0.4.2"}, None, True),  # first release with SFTTrainer
        ({"trl": "0.15.2"}, None, True),
        ({"trl": "0.16.0"}, None, True),  # still transformers' collator (and now an appended EOS it masks)
        ({"trl": "0.4.1"}, None, False),  # no SFTTrainer yet
        ({"trl": "0.16.1"}, None, False),  # TRL's own collator pads labels by position
        ({"trl": "0.16.1.dev0"}, None, False),  # PEP 440: a pre-release of the bound is outside <0.16.1
        ({"trl": "0.19.1"}, None, False),
        ({"trl": N}, None, False),
    ],
    "label_smoothing_peft_causal_lm_not_shifted": [
        ({"transformers": "4.30.2", "peft": "0.4.0"}, None, True),  # "PeftModelForCausalLM"
        ({"transformers": "4.35.2", "peft": "0.6.2"}, None, True),  # "LoraModel"
        ({"transformers": "4.36.0.dev0", "peft": "0.6.2"}, None, False),  # PEP 440: a pre-release of the bound is outside <4.36.0
        ({"transformers": "4.36.0", "peft": "0.6.2"}, None, False),  # PR #27162
        ({"transformers": "4.57.6", "peft": "0.17.1"}, None, False),
        ({"transformers": "4.35.2", "peft": N}, None, False),  # no PEFT model without peft
        ({"transformers": N, "peft": "0.6.2"}, None, False),
    ],
    "fa2_right_padding_raises_in_training": [
        ({"transformers": "4.34.0"}, None, True),  # first Mistral release: raises on any right padding
        ({"transformers": "4.34.1"}, None, True),
        ({"transformers": "4.36.0"}, None, True),
        ({"transformers": "4.45.2"}, None, True),  # the check Mistral kept while the others dropped it
        ({"transformers": "4.52.4"}, None, True),
        ({"transformers": "4.33.3"}, None, False),  # no Mistral
        ({"transformers": "4.35.0"}, None, False),  # checks only with past_key_values (generation)
        ({"transformers": "4.35.2"}, None, False),
        ({"transformers": "4.53.0"}, None, False),  # masking_utils
        ({"transformers": "4.53.0.dev0"}, None, False),
        ({"transformers": N}, None, False),
    ],
    "fa2_right_padding_raises_in_training_mixtral": [
        ({"transformers": "4.36.0"}, None, True),
        ({"transformers": "4.41.2"}, None, True),
        ({"transformers": "4.48.0"}, None, True),
        ({"transformers": "4.52.4"}, None, True),
        ({"transformers": "4.35.2"}, None, False),  # no Mixtral yet
        ({"transformers": "4.42.0"}, None, False),  # 4.42-4.47 have no check for these families
        ({"transformers": "4.47.1"}, None, False),
        ({"transformers": "4.53.0"}, None, False),
        ({"transformers": N}, None, False),
    ],
    "fa2_right_padding_raises_in_training_qwen2": [
        ({"transformers": "4.37.0"}, None, True),  # first Qwen2 release
        ({"transformers": "4.41.2"}, None, True),
        ({"transformers": "4.49.0"}, None, True),
        ({"transformers": "4.52.4"}, None, True),
        ({"transformers": "4.36.2"}, None, False),  # no Qwen2 yet
        ({"transformers": "4.42.0"}, None, False),
        ({"transformers": "4.48.3"}, None, False),  # Qwen2 has no check in 4.42-4.48
        ({"transformers": "4.53.0"}, None, False),
        ({"transformers": N}, None, False),
    ],
    "fa2_right_padding_raises_in_training_qwen2_moe": [
        ({"transformers": "4.40.0"}, None, True),  # first Qwen2-MoE release
        ({"transformers": "4.41.2"}, None, True),
        ({"transformers": "4.48.0"}, None, True),
        ({"transformers": "4.57.6"}, None, True),  # kept through the 4.5x series
        ({"transformers": "4.39.3"}, None, False),
        ({"transformers": "4.42.0"}, None, False),
        ({"transformers": "4.47.1"}, None, False),
        ({"transformers": "5.0.0"}, None, False),
        ({"transformers": "5.0.0.dev0"}, None, False),  # PEP 440: a pre-release of the bound is outside <5.0.0
        ({"transformers": N}, None, False),
    ],
    "average_tokens_across_devices_off": [
        ({"transformers": "4.46.0"}, None, True),  # no option yet
        ({"transformers": "4.46.2"}, None, True),  # option added, default False
        ({"transformers": "4.53.3"}, None, True),
        ({"transformers": "4.45.2"}, None, False),  # below: ga_mean_of_micro_batch_means
        ({"transformers": "4.54.0"}, None, False),  # default True (PR #39395)
        ({"transformers": "4.54.0.dev0"}, None, False),
        ({"transformers": "4.57.6"}, None, False),
        ({"transformers": N}, None, False),
    ],
    "accelerate_resume_epoch_lost_before_1_15": [
        ({"accelerate": "1.7.0"}, None, True),  # DataLoaderShard.set_epoch reaches the sampler behind the skip
        ({"accelerate": "1.14.0"}, None, True),
        ({"accelerate": "1.6.0"}, None, False),  # no reach-through yet: the sampler keeps the epoch it was given
        ({"accelerate": "1.15.0"}, None, False),  # PR #4071 (the dispatcher: accelerate_dispatch_resume_epoch)
        ({"accelerate": "1.15.0.dev0"}, None, False),  # PEP 440: a pre-release of the bound is outside <1.15.0
        ({"accelerate": N}, None, False),
    ],
    "roberta_flattened_position_ids_before_5_15": [
        ({"transformers": "4.44.0"}, None, True),  # DataCollatorWithFlattening's first release
        ({"transformers": "5.14.1"}, None, True),
        ({"transformers": "4.43.4"}, None, False),  # no flattening collator
        ({"transformers": "5.15.0"}, None, False),  # position_ids_start, min-based boundaries: the shim's range
        ({"transformers": "5.15.0.dev0"}, None, False),  # PEP 440: a pre-release of the bound is outside <5.15.0
        ({"transformers": N}, None, False),
    ],
    "encoder_packing_contamination_4x": [
        ({"transformers": "4.44.0"}, None, True),  # DataCollatorWithFlattening's first release
        ({"transformers": "4.57.6"}, None, True),
        ({"transformers": "4.43.4"}, None, False),  # no flattening collator
        ({"transformers": "5.0.0"}, None, False),  # masks from masking_utils: the shim encoder_packing_block_mask
        ({"transformers": "5.0.0.dev0"}, None, False),  # PEP 440: a pre-release of the bound is outside <5.0.0
        ({"transformers": N}, None, False),
    ],
    # wave-3 leads (ftshims/data/leads.toml), ranges read in the released wheels
    "trl_vllm_peft_merge_unmerge_drift": [
        ({"trl": "0.15.0", "peft": "0.14.0"}, None, True),  # GRPOTrainer._move_model_to_vllm merges in place
        ({"trl": "1.16.0", "peft": "0.21.2"}, None, True),  # unfixed (trl#6688 open)
        ({"trl": "0.14.0", "peft": "0.14.0"}, None, False),  # no PEFT merge on the vLLM path yet
        ({"trl": "0.15.0.dev0", "peft": "0.14.0"}, None, False),  # PEP 440: below 0.15.0
        ({"trl": "1.16.0", "peft": N}, None, False),  # no PEFT model without peft
        ({"trl": N, "peft": "0.21.2"}, None, False),
    ],
    "trl_qlora_dora_magnitude_frozen_bf16": [
        ({"trl": "0.26.0"}, None, True),  # the QLoRA bf16 cast appears (#4577)
        ({"trl": "1.14.2"}, None, True),
        ({"trl": "0.25.1"}, None, False),
        ({"trl": "1.15.0"}, None, False),  # lora_magnitude_vector excluded
        ({"trl": "1.15.0.dev0"}, None, False),
        ({"trl": N}, None, False),
    ],
    "trl_grpo_dapo_normalizer_generation_window": [
        ({"trl": "0.22.0"}, None, True),  # dapo loss type added
        ({"trl": "1.9.0"}, None, True),
        ({"trl": "0.21.0"}, None, False),
        ({"trl": "1.9.1"}, None, False),  # normaliser rescaled to the accumulation window
        ({"trl": "1.16.0"}, None, False),
        ({"trl": N}, None, False),
    ],
    "trl_grpo_dapo_num_items_counts_masked_tokens": [
        ({"trl": "0.22.0"}, None, True),
        ({"trl": "1.8.0"}, None, True),
        ({"trl": "0.21.0"}, None, False),
        ({"trl": "1.9.0"}, None, False),  # PR #6439
        ({"trl": "1.9.0.dev0"}, None, False),
        ({"trl": N}, None, False),
    ],
    "trl_gkd_eos_masked_when_pad_is_eos": [
        ({"trl": "0.11.0"}, None, True),  # first GKDTrainer
        ({"trl": "1.8.0"}, None, True),  # trl.experimental.gkd
        ({"trl": "0.10.1"}, None, False),  # no GKD
        ({"trl": "1.9.0"}, None, False),  # masks after the first EOS (PR #6357)
        ({"trl": N}, None, False),
    ],
    "trl_grpo_none_reward_in_baseline": [
        ({"trl": "0.16.0"}, None, True),  # nansum turns all-None rows into 0
        ({"trl": "1.5.1"}, None, True),
        ({"trl": "0.15.2"}, None, False),  # no None rewards (plain sum)
        ({"trl": "1.6.0"}, None, False),  # PR #5902
        ({"trl": "1.6.0.dev0"}, None, False),
        ({"trl": N}, None, False),
    ],
    "peft_ensure_weight_tying_ties_untied_model": [
        ({"peft": "0.19.0"}, None, True),
        ({"peft": "0.19.1"}, None, True),
        ({"peft": "0.18.1"}, None, False),  # the same config raises AttributeError there (loud)
        ({"peft": "0.20.0"}, None, False),  # PR #3171
        ({"peft": "0.20.0.dev0"}, None, False),
        ({"peft": N}, None, False),
    ],
    "peft_dora_unmerge_fan_in_fan_out": [
        ({"peft": "0.11.0"}, None, True),  # merge transposes, unmerge does not
        ({"peft": "0.20.0"}, None, True),
        ({"peft": "0.10.0"}, None, False),  # neither transposes (symmetric)
        ({"peft": "0.21.0"}, None, False),  # PR #3532
        ({"peft": "0.21.2"}, None, False),
        ({"peft": N}, None, False),
    ],
    "peft_dora_multi_adapter_merge_mismatch": [
        ({"peft": "0.12.0"}, None, True),
        ({"peft": "0.20.0"}, None, True),
        ({"peft": "0.11.1"}, None, False),  # not run there (ParameterDict magnitude)
        ({"peft": "0.21.0"}, None, False),  # PR #3609
        ({"peft": "0.21.0.dev0"}, None, False),  # PEP 440: a pre-release of the bound is outside <0.21.0
        ({"peft": N}, None, False),
    ],
    "peft_loraplus_embedding_lr_ignored": [
        ({"peft": "0.13.0"}, None, True),
        ({"peft": "0.20.0"}, None, True),
        ({"peft": "0.12.0"}, None, False),  # no peft.optimizers
        ({"peft": "0.21.0"}, None, False),  # PR #3503
        ({"peft": N}, None, False),
    ],
    "trl_dpo_conversational_extra_eos": [
        ({"trl": "0.12.0"}, None, True),
        ({"trl": "0.27.1"}, None, True),
        ({"trl": "0.11.0"}, None, False),  # no chat-template path in DPO
        ({"trl": "0.27.2"}, None, False),  # PR #4908 backport
        ({"trl": "0.28.0"}, None, False),
        ({"trl": N}, None, False),
    ],
    "trl_prompt_not_prefix_completion_shift": [
        ({"trl": "0.18.2"}, None, True),  # SFT prompt-completion mask from len(prompt_ids)
        ({"trl": "1.14.1"}, None, True),
        ({"trl": "0.17.0"}, None, False),
        ({"trl": "1.14.2"}, None, False),  # common_prefix_length
        ({"trl": "1.14.2.dev0"}, None, False),  # PEP 440: a pre-release of the bound is outside <1.14.2
        ({"trl": N}, None, False),
    ],
    "moonshine_florence2_double_shifted_labels": [
        ({"transformers": "4.48.0"}, None, True),  # Moonshine's first release
        ({"transformers": "4.57.6"}, None, True),
        ({"transformers": "5.12.1"}, None, True),
        ({"transformers": "4.47.1"}, None, False),
        ({"transformers": "5.13.0"}, None, False),  # PRs #46784, #46898
        ({"transformers": N}, None, False),
    ],
    "git_cohere_asr_ppformulanet_double_shifted_labels": [
        ({"transformers": "4.50.0"}, None, True),  # GIT switches to self.loss_function
        ({"transformers": "5.14.1"}, None, True),
        ({"transformers": "4.49.0"}, None, False),  # GIT still CrossEntropyLoss
        ({"transformers": "5.15.0"}, None, False),  # PR #47395 / #46903
        ({"transformers": "5.15.0.dev0"}, None, False),  # PEP 440: a pre-release of the bound is outside <5.15.0
        ({"transformers": N}, None, False),
    ],
    "bert_family_causal_lm_attends_to_future": [
        ({"transformers": "5.9.0"}, None, True),  # create_bidirectional_mask only
        ({"transformers": "5.17.0"}, None, True),
        ({"transformers": "5.8.0"}, None, False),  # get_extended_attention_mask (causal for decoders)
        ({"transformers": "5.18.0"}, None, False),  # PR #48760
        ({"transformers": "4.57.6"}, None, False),
        ({"transformers": N}, None, False),
    ],
    "causal_heads_ignore_shift_labels": [
        ({"transformers": "4.50.0"}, None, True),  # ForCausalLMLoss takes shift_labels (PR #36607)
        ({"transformers": "5.16.1"}, None, True),
        ({"transformers": "4.49.0"}, None, False),
        ({"transformers": "5.17.0"}, None, False),  # PR #48493
        ({"transformers": N}, None, False),
    ],
    "deberta_v2_tokenizer_no_cls_sep": [
        ({"transformers": "5.0.0"}, None, True),
        ({"transformers": "5.3.0"}, None, True),
        ({"transformers": "4.57.6"}, None, False),  # v4 adds them in build_inputs_with_special_tokens
        ({"transformers": "5.4.0"}, None, False),  # TemplateProcessing post-processor
        ({"transformers": "5.0.0rc0"}, None, False),  # PEP 440: a pre-release of 5.0.0 is below >=5.0.0
        ({"transformers": N}, None, False),
    ],
    "moe_vlm_config_output_router_logits_ignored": [
        ({"transformers": "4.57.0"}, None, True),  # Qwen3-VL-MoE's first release
        ({"transformers": "5.17.0"}, None, True),
        ({"transformers": "4.56.0"}, None, False),  # no Qwen3-VL-MoE
        ({"transformers": "5.18.0"}, None, False),  # falls back to config.text_config
        ({"transformers": "5.18.0.dev0"}, None, False),
        ({"transformers": N}, None, False),
    ],
    "encoder_decoder_num_items_undercount_5_10": [
        ({"transformers": "5.10.1"}, None, True),  # _loss_shifts_labels appears (PR #46204)
        ({"transformers": "5.14.1"}, None, True),
        ({"transformers": "5.9.0"}, None, False),  # counts every label
        ({"transformers": "5.15.0"}, None, False),  # PR #46903
        ({"transformers": "4.57.6"}, None, False),  # num_items_in_batch_overcount's range: encoder-decoders left alone
        ({"transformers": N}, None, False),
    ],
    "gemma3_images_causal_without_token_type_ids": [
        ({"transformers": "5.6.0"}, None, True),  # the training check removed
        ({"transformers": "5.25.0"}, None, True),  # no fix upstream
        ({"transformers": "5.5.4"}, None, False),  # raises without token_type_ids
        ({"transformers": "4.57.6"}, None, False),
        ({"transformers": N}, None, False),
    ],
    "v5_default_dtype_half_weights_full_finetune": [
        ({"transformers": "5.0.0"}, None, True),  # dtype="auto" becomes the default (PR #42805)
        ({"transformers": "5.25.0"}, None, True),
        ({"transformers": "5.0.0rc1"}, None, False),  # pre-release of 5.0.0 sorts below it
        ({"transformers": "4.57.6"}, None, False),  # loads float32 unless asked
        ({"transformers": N}, None, False),
    ],
    "accelerate_partial_accumulation_window_underweighted": [
        ({"accelerate": "0.11.0"}, None, True),  # accumulate() and the division appear
        ({"accelerate": "1.16.0"}, None, True),  # by design, unchanged
        ({"accelerate": "0.10.0"}, None, False),
        ({"accelerate": N}, None, False),
    ],
    "trl_fused_lm_head_unsupported_logits": [
        ({"trl": "1.4.0"}, None, True),  # SFT's chunked_nll head
        ({"trl": "1.16.0"}, None, True),
        ({"trl": "1.2.0"}, None, False),
        ({"trl": "0.24.0"}, None, False),
        ({"trl": N}, None, False),
    ],
    "llamafactory_packing_position_ids_not_padded": [
        ({"llamafactory": "0.9.5"}, None, True),
        ({"llamafactory": "0.9.3"}, None, True),
        ({"llamafactory": "0.9.2"}, None, False),  # not read
        ({"llamafactory": "0.9.6"}, None, False),
        ({"llamafactory": N}, None, False),
    ],
    # issue 36 (resume gate, dossier-wave5 leads 13 and 14)
    "trainer_resume_random_data_mid_epoch": [
        ({"transformers": "4.35.0"}, None, True),  # the oldest release read: restore after the first fetch
        ({"transformers": "5.25.0"}, None, True),  # newest: unchanged
        ({"transformers": "4.34.1"}, None, False),  # not read
        ({"transformers": N}, None, False),
    ],
    "bart_untied_embeddings_lost_on_reload": [
        ({"transformers": "4.57.0"}, None, True),
        ({"transformers": "4.57.6"}, None, True),  # run: saves model.shared only
        ({"transformers": "5.0.0"}, None, False),  # 5.x saves all three matrices
        ({"transformers": "4.56.2"}, None, False),  # not checked
        ({"transformers": N}, None, False),
    ],
    "accelerate_skip_first_batches_drops_loader_config": [
        ({"accelerate": "1.3.0"}, None, True),
        ({"accelerate": "1.15.0"}, None, True),  # run
        ({"accelerate": "1.16.0"}, None, False),  # run: keeps every attribute
        ({"accelerate": "1.2.1"}, None, False),  # not read
        ({"accelerate": N}, None, False),
    ],
}


def _raw():
    return json.loads(advisories.DATA.read_text(encoding="utf-8"))


# --- the data file -------------------------------------------------------------------------------------


def test_data_file_loads_and_validates():
    loaded = advisories.load()
    assert loaded, "no advisories"
    assert [a.id for a in loaded] == [raw["id"] for raw in _raw()["advisories"]]


def test_every_advisory_has_matching_cases_and_no_stale_cases():
    ids = {a.id for a in advisories.load()}
    assert ids - set(CASES) == set(), "advisories without fabricated version cases"
    assert set(CASES) - ids == set(), "cases for advisories that no longer exist"


def test_every_advisory_has_a_positive_and_a_negative_case():
    for advisory_id, rows in CASES.items():
        outcomes = {expected for _, _, expected in rows}
        assert outcomes == {True, False}, advisory_id


def test_schema_invariants_of_the_shipped_data():
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    from ftshims.shims import SHIM_IDS

    seen = set()
    for a in advisories.load():
        assert a.id not in seen
        seen.add(a.id)
        assert a.severity in ("error", "warning", "info")
        assert a.title and a.symptom and a.remedy
        assert a.refs and all(ref.startswith(("https://", "http://")) for ref in a.refs)
        assert a.verified and all(entry.startswith(("src: ", "run: ")) for entry in a.verified)
        for name, specifier in a.when.items():
            assert name == advisories.normalize(name)
            SpecifierSet(specifier)  # raises if invalid
        for name, version in a.fixed_in.items():
            assert not (name in a.when and advisories.in_range(version, a.when[name])), (a.id, name)
            Version(version)
        assert set(a.related_shims) <= set(SHIM_IDS), (a.id, a.related_shims)
        assert set(a.fixed_by_shims) <= set(SHIM_IDS), (a.id, a.fixed_by_shims)
        assert not set(a.fixed_by_shims) & set(a.related_shims), a.id
        assert a.when or a.check is not None


def test_fixed_by_shims_apply_where_the_advisory_matches():
    """A shim named in fixed_by_shims must be in range for the versions the advisory matches."""
    from ftshims import registry

    for a in advisories.load():
        for shim_id in a.fixed_by_shims:
            requires = registry.get(shim_id).spec.requires
            for versions, _checks, expected in CASES[a.id]:
                if not expected:
                    continue
                for name, specifier in requires.items():
                    version = next((v for k, v in versions.items() if advisories.normalize(k) == name), None)
                    if version is not None:
                        assert advisories.in_range(version, specifier), (a.id, shim_id, name, version, specifier)


def test_check_advisories_are_documented_in_the_data_file():
    about = " ".join(_raw()["about"])
    for a in advisories.load():
        if a.check is not None:
            assert a.check.name in about, f"check {a.check.name!r} is not documented in the data file's 'about'"


def test_check_statuses_match_the_doctor_flash_attn_check():
    from ftshims.doctor import flashattn

    reported = {
        flashattn.OK,
        flashattn.NOT_INSTALLED,
        flashattn.ABI_MISMATCH,
        flashattn.MISSING_LIBRARY,
        flashattn.IMPORT_ERROR,
        flashattn.TIMEOUT,
        flashattn.CRASHED,
        flashattn.CHECK_FAILED,
        flashattn.SKIPPED,
    }
    assert set(advisories.CHECKS["flash_attn_import"]) == reported


def test_to_dict_round_trips():
    loaded = advisories.load()
    again = parse({"schema": 1, "advisories": [a.to_dict() for a in loaded]})
    assert again == loaded


def test_packages_lists_every_when_distribution():
    names = advisories.packages()
    assert names == tuple(sorted(names))
    for a in advisories.load():
        assert set(a.when) <= set(names)
    assert {"transformers", "torch", "trl", "flash-attn", "accelerate", "huggingface-hub"} <= set(names)


# --- schema violations are refused, with the advisory named --------------------------------------------


def _one(**changes):
    base = {
        "id": "sample",
        "title": "t",
        "severity": "warning",
        "when": {"transformers": ">=4.40,<4.41"},
        "symptom": "s",
        "remedy": "r",
        "refs": ["https://github.com/huggingface/transformers/issues/1"],
        "verified": ["src: somewhere"],
    }
    for key, value in changes.items():
        if value is KeyError:
            base.pop(key)
        else:
            base[key] = value
    return {"schema": 1, "advisories": [base]}


INVALID = [
    ({"title": KeyError}, "missing field"),
    ({"severity": "critical"}, "severity"),
    ({"when": {"transformers": ">=4.40,<<4.41"}}, "not a PEP 440 specifier"),
    ({"when": {"transformers": 4.4}}, "specifier string"),
    ({"when": {"Flash_Attn": ">=2"}}, "PEP 503"),
    ({"when": {}}, "non-empty 'when' or a 'check'"),
    ({"refs": ["github.com/x/y/issues/1"]}, "not an http(s) URL"),
    ({"refs": []}, "must not be empty"),
    ({"verified": ["read the code"]}, "must start with"),
    ({"verified": []}, "must not be empty"),
    ({"id": "Bad-Id"}, "snake_case"),
    ({"colour": "red"}, "unknown field"),
    ({"check": {"name": "nvcc_version", "status": ["x"]}}, "unknown check"),
    ({"check": {"name": "flash_attn_import", "status": ["exploded"]}}, "never reports"),
    ({"check": {"name": "flash_attn_import"}}, "exactly 'name' and 'status'"),
    ({"fixed_in": {"transformers": "4.40.5"}}, "lies inside"),
    ({"fixed_in": {"transformers": "four"}}, "not a PEP 440 version"),
    ({"absent_matches": ["torch"]}, "not in 'when'"),
    ({"symptom": ""}, "non-empty string"),
    ({"model_types": "llama"}, "list of non-empty strings"),
]


def test_invalid_advisories_are_refused():
    assert [a.id for a in parse(_one())] == ["sample"]  # the base is valid: each refusal below is the change's
    for changes, message in INVALID:
        with pytest.raises(AdvisoryDataError, match="^(advisory '|advisories\\[0\\])") as info:
            parse(_one(**changes))
        assert message in str(info.value), (changes, str(info.value))


def test_duplicate_ids_and_bad_top_level_are_refused():
    data = _one()
    data["advisories"].append(copy.deepcopy(data["advisories"][0]))
    with pytest.raises(AdvisoryDataError, match="duplicate id"):
        parse(data)
    with pytest.raises(AdvisoryDataError, match="schema"):
        parse({"schema": 2, "advisories": []})
    with pytest.raises(AdvisoryDataError, match="unknown top-level"):
        parse({"schema": 1, "advisories": [], "extra": 1})


def test_load_reports_an_unreadable_file(tmp_path):
    bad = tmp_path / "advisories.json"
    bad.write_text("{not json")
    with pytest.raises(AdvisoryDataError, match="cannot read"):
        advisories.load(bad)
    with pytest.raises(AdvisoryDataError, match="cannot read"):
        advisories.load(tmp_path / "missing.json")


# --- matching --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("advisory_id", sorted(CASES))
def test_matching_on_fabricated_versions(advisory_id):
    """One test per advisory (not per row): the autouse revert fixture costs ~0.1 s a test."""
    advisory = advisories.get(advisory_id)
    wrong = []
    for versions, checks, expected in CASES[advisory_id]:
        if advisory.matches(versions, checks) is not expected:
            wrong.append(f"matches({versions}, checks={checks}) should be {expected}")
        if (advisory in advisories.matching(versions, checks)) is not expected:
            wrong.append(f"matching({versions}, checks={checks}) should {'' if expected else 'not '}list it")
    assert not wrong, "\n".join(wrong)


def test_an_absent_package_never_matches():
    """Every positive case turns negative when any one of its `when` packages is missing (None or no key)."""
    for advisory_id, rows in CASES.items():
        advisory = advisories.get(advisory_id)
        for versions, checks, expected in rows:
            if not expected:
                continue
            for name in advisory.when:
                without = {k: v for k, v in versions.items() if advisories.normalize(k) != name}
                for absent in (without, {**without, name: None}):
                    assert not advisory.matches(absent, checks), (advisory_id, name, absent)


def test_absent_matches_opts_in_to_absence():
    data = _one(when={"transformers": ">=4.40,<4.41", "accelerate": "<0.20"}, absent_matches=["accelerate"])
    (advisory,) = parse(data)
    assert advisory.matches({"transformers": "4.40.2", "accelerate": None})
    assert advisory.matches({"transformers": "4.40.2"})
    assert advisory.matches({"transformers": "4.40.2", "accelerate": "0.19.0"})
    assert not advisory.matches({"transformers": "4.40.2", "accelerate": "0.20.0"})
    assert not advisory.matches({"transformers": None, "accelerate": None})  # only the listed package may be absent


def test_unparsable_versions_never_match():
    advisory = advisories.get("custom_4d_mask_unsupported")
    for version in ("unknown", "", "4.36-custom", "git+abc"):
        assert not advisory.matches({"transformers": version}), version


def test_check_advisory_with_versions_needs_both():
    data = _one(check={"name": "flash_attn_import", "status": ["abi mismatch"]}, when={"torch": ">=2.6"})
    (advisory,) = parse(data)
    assert advisory.matches({"torch": "2.6.0+cu124"}, {"flash_attn_import": "abi mismatch"})
    assert not advisory.matches({"torch": "2.5.1"}, {"flash_attn_import": "abi mismatch"})
    assert not advisory.matches({"torch": "2.6.0"}, {"flash_attn_import": "ok"})


def test_model_type_rules_out_other_families():
    versions = {"transformers": "4.57.6"}
    ids = [a.id for a in advisories.matching(versions)]
    assert "deepseek_v2_yarn_missing_mscale" in ids
    assert "deepseek_v2_yarn_missing_mscale" in [a.id for a in advisories.matching(versions, model_type="deepseek_v2")]
    assert "deepseek_v2_yarn_missing_mscale" not in [a.id for a in advisories.matching(versions, model_type="llama")]
    # advisories without model_types do not depend on the model
    ga = {"transformers": "4.47.0"}
    assert "ga_loss_scaling_4_47_0" in [a.id for a in advisories.matching(ga, model_type="qwen2")]


def test_matching_sorts_by_severity_then_file_order():
    versions = {
        "transformers": "4.47.0",
        "trl": "0.16.1",
        "accelerate": "0.32.1",
        "huggingface-hub": "0.17.3",
        "torch": "2.5.1",
    }
    found = advisories.matching(versions, {"flash_attn_import": "abi mismatch"})
    ranks = [advisories.SEVERITY_RANK[a.severity] for a in found]
    assert ranks == sorted(ranks)
    assert [a.id for a in found][:2] == ["accelerate_hub_split_torch_state_dict", "flash_attn_abi_mismatch"]
    assert {"ga_loss_scaling_4_47_0", "trl_wrapped_only_packing"} <= {a.id for a in found}


def test_matching_reads_installed_versions_when_none_given(monkeypatch):
    fake = {"transformers": "4.48.0", "torch": "2.13.0+cpu"}
    asked = []

    def installed(name):
        asked.append(name)
        return fake.get(name)

    monkeypatch.setattr(advisories, "installed_version", installed)
    assert [a.id for a in advisories.matching()] == [
        "ga_loss_scaling_4_48_0",
        "gemma_hidden_act_gelu_exact_regression",
        "fa2_right_padding_raises_in_training",
        "fa2_right_padding_raises_in_training_mixtral",
        "fa2_right_padding_raises_in_training_qwen2_moe",
        "roberta_flattened_position_ids_before_5_15",
        "moonshine_florence2_double_shifted_labels",
        "encoder_packing_contamination_4x",
        "num_items_in_batch_overcount_4_46",
        "average_tokens_across_devices_off",
        "trainer_resume_random_data_mid_epoch",  # info severity: last
    ]
    assert sorted(asked) == sorted(advisories.packages())


def test_evidence_names_the_matching_versions():
    advisory = advisories.get("accelerate_hub_split_torch_state_dict")
    lines = advisory.evidence({"accelerate": "0.32.1", "huggingface_hub": "0.17.3"})
    assert lines == ["accelerate 0.32.1 in >=0.32.0,<1.13.0", "huggingface-hub 0.17.3 in <0.21.0"]
    abi = advisories.get("flash_attn_abi_mismatch")
    assert abi.evidence({}, {"flash_attn_import": "abi mismatch"}) == ["check flash_attn_import: abi mismatch"]


def test_the_pinned_stacks_see_the_expected_advisories():
    """The matrix stacks (common.md) against the data: a cross-check of the ranges."""
    stacks = {
        "s430": ({"transformers": "4.30.2", "peft": "0.4.0", "trl": "0.4.7", "torch": "2.13.0+cpu"},
                 {"trl_constant_length_dataset_packing", "custom_4d_mask_unsupported", "ga_mean_of_micro_batch_means",
                  "packing_contaminated_below_4_37", "trl_sft_eos_label_masked_when_pad_is_eos",
                  "label_smoothing_peft_causal_lm_not_shifted"}),
        "s438": ({"transformers": "4.38.2", "trl": "0.8.1", "torch": "2.13.0+cpu"},
                 {"trl_constant_length_dataset_packing", "ga_mean_of_micro_batch_means",
                  "llama_gemma_causal_mask_buffer_4_38", "trl_sft_eos_label_masked_when_pad_is_eos",
                  "fa2_right_padding_raises_in_training", "fa2_right_padding_raises_in_training_mixtral",
                  "fa2_right_padding_raises_in_training_qwen2", "trainer_resume_random_data_mid_epoch"}),
        "s446": ({"transformers": "4.46.3", "trl": "0.12.2", "torch": "2.13.0+cpu"},
                 {"trl_constant_length_dataset_packing", "ga_loss_scaling_4_46", "num_items_in_batch_overcount_4_46",
                  "trl_sft_eos_label_masked_when_pad_is_eos", "fa2_right_padding_raises_in_training",
                  "average_tokens_across_devices_off", "roberta_flattened_position_ids_before_5_15",
                  "trl_dpo_conversational_extra_eos", "trl_gkd_eos_masked_when_pad_is_eos",
                  "trainer_resume_random_data_mid_epoch", "encoder_packing_contamination_4x"}),
        "s453": ({"transformers": "4.53.3", "trl": "0.19.1", "torch": "2.13.0+cpu"},
                 {"num_items_in_batch_overcount_4_46", "fa2_right_padding_raises_in_training_qwen2_moe",
                  "average_tokens_across_devices_off", "gemma_hidden_act_gelu_exact_regression",
                  "roberta_flattened_position_ids_before_5_15", "causal_heads_ignore_shift_labels",
                  "git_cohere_asr_ppformulanet_double_shifted_labels", "moonshine_florence2_double_shifted_labels",
                  "trl_dpo_conversational_extra_eos", "trl_gkd_eos_masked_when_pad_is_eos",
                  "trl_grpo_none_reward_in_baseline", "trl_prompt_not_prefix_completion_shift",
                  "trainer_resume_random_data_mid_epoch", "encoder_packing_contamination_4x"}),
        "s457b": ({"transformers": "4.57.6", "trl": "0.24.0", "torch": "2.13.0+cpu"},
                  {"deepseek_v2_yarn_missing_mscale", "fa2_right_padding_raises_in_training_qwen2_moe",
                   "gemma_hidden_act_gelu_exact_regression", "roberta_flattened_position_ids_before_5_15",
                   "causal_heads_ignore_shift_labels", "git_cohere_asr_ppformulanet_double_shifted_labels",
                   "moonshine_florence2_double_shifted_labels", "trl_dpo_conversational_extra_eos",
                   "trl_gkd_eos_masked_when_pad_is_eos", "trl_grpo_dapo_normalizer_generation_window",
                   "trl_grpo_dapo_num_items_counts_masked_tokens", "trl_grpo_none_reward_in_baseline",
                   "trl_prompt_not_prefix_completion_shift", "moe_vlm_config_output_router_logits_ignored",
                   "trainer_resume_random_data_mid_epoch", "bart_untied_embeddings_lost_on_reload", "encoder_packing_contamination_4x"}),
        "s524": ({"transformers": "5.24.0", "trl": "1.16.0", "torch": "2.13.0+cpu"},
                 {"gemma3_images_causal_without_token_type_ids", "v5_default_dtype_half_weights_full_finetune",
                  "trl_fused_lm_head_unsupported_logits", "trainer_resume_random_data_mid_epoch"}),
    }
    for name, (versions, expected) in stacks.items():
        assert {a.id for a in advisories.matching(versions)} == expected, name


# --- import cost -------------------------------------------------------------------------------------------


def test_import_is_light():
    code = textwrap.dedent(
        """
        import sys
        import ftshims.advisories as a
        a.matching({"transformers": "4.47.0", "torch": "2.5.1"}, {"flash_attn_import": "abi mismatch"})
        heavy = sorted(m for m in ("torch", "transformers", "peft", "trl", "accelerate", "numpy", "flash_attn",
                                   "huggingface_hub", "datasets", "wrapt", "ftshims.doctor", "ftshims._manager")
                       if m in sys.modules)
        print(",".join(heavy))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"importing ftshims.advisories pulled in: {out.stdout.strip()}"
