"""The registered shims, one module each. Order is the order of reports and of revert (reversed)."""

SHIM_IDS = (
    "lora_reentrant_checkpointing",
)
