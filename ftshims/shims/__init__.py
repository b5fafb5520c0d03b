"""The registered shims, one module each. Order is the order of reports and of revert (reversed)."""

SHIM_IDS = (
    "lora_reentrant_checkpointing",
    "rope_inv_freq_fp32",
    "rope_fused_kernel",
    "flash_attn_rotary",
    "flash_attn_rotary_kernel",
    "expand_mask_clamp",
    "max_positions_guard",
    "causal_mask_buffer_regrow",
    "packing_block_mask",
    "custom_4d_mask_format",
    "trl_padding_free_position_ids",
    "flash_attn_packing",
    "packing_contamination_warning",
    "resize_embeddings_keeps_frozen",
    "kbit_prep_keeps_adapters_trainable",
    "seqcls_pools_before_first_pad",
    "peft_tied_embeddings_lost_on_merge",
    "num_items_in_batch_overcount",
    "trl_completion_only_template_miss",
    "eos_label_kept_when_pad_is_eos",
)
