"""The registered shims, one module each. Order is the order of reports and of revert (reversed)."""

SHIM_IDS = (
    "lora_reentrant_checkpointing",
    "resize_embeddings_keeps_frozen",
    "kbit_prep_keeps_adapters_trainable",
)
