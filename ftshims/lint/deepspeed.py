"""DeepSpeed config rules, checked against DeepSpeed's real config schema (kept here as data).

The key names come from the released ``deepspeed 0.19.8`` sdist (``pip download
--no-deps deepspeed==0.19.8``; DeepSpeed is not imported, nor needed):

* top level: every key ``DeepSpeedConfig._initialize_params`` and the section
  readers it calls look up in the config dict (``runtime/config.py``,
  ``runtime/constants.py``, ``runtime/precision_config.py``, ``monitor``,
  ``comm``, ``profiling``, ``autotuning``, ``elasticity``, ``data_pipeline``,
  ``swap_tensor``, ``compile``, ``datastates``, ...). Unknown top-level keys are
  *silently ignored* by DeepSpeed;
* ``zero_optimization``: the fields (and ``stage3_*`` aliases, and deprecated
  names) of ``DeepSpeedZeroConfig`` in ``runtime/zero/config.py``;
  ``offload_param`` / ``offload_optimizer``: ``runtime/zero/offload_config.py``;
  ``fp16`` / ``bf16``: ``runtime/precision_config.py``. These are pydantic
  models with ``extra="forbid"`` (``runtime/config_utils.py``): an unknown key
  there makes ``deepspeed.initialize`` raise a ``ValidationError``.
  (``"auto"`` values are dropped before validation, as HF's integration
  relies on.)

What the engine does with offload per stage (``runtime/engine.py``,
``runtime/zero/offload_config.py`` docstrings): ``offload_param`` is used only
by ZeRO-3 and silently ignored at stages 0–2; ``offload_optimizer`` needs ZeRO
stage 1, 2 or 3 (ignored at stage 0); a partial ``ratio`` < 1 is asserted to
be stage 3. ``fp16`` and ``bf16`` both enabled trips
``assert not (fp16 and bf16)`` in ``DeepSpeedConfig``.

The training-config comparison mirrors
``transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig.trainer_config_process``:
a value that is not ``"auto"`` must equal the TrainingArguments value
(including TrainingArguments' *default* when the training config leaves it
out), else ``Trainer`` raises ``ValueError: Please correct the following
DeepSpeed config values that mismatch TrainingArguments values``.

Size: about half of this module is DeepSpeed's config schema kept as data (the key tables above, with
the sources they were read from); the rules that read it are short. One module, so that a schema update
is one diff next to the rules it feeds.
"""

from __future__ import annotations

import difflib
from typing import Any, Callable, Dict, Optional

from ..versions import older_than
from .findings import ERROR, INFO, WARNING, finding
from .inputs import TrainView, as_bool, as_number

SCHEMA_VERSION = "0.19.8"

TOP_LEVEL = frozenset(
    """
    train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps managed_gradient_accumulation
    steps_per_print dump_state disable_python_gc disable_allgather communication_data_type
    seq_parallel_communication_data_type prescale_gradients gradient_predivide_factor gradient_allreduce_op
    zero_optimization activation_checkpointing comms_logger tensorboard wandb csv_monitor comet gradient_clipping
    fp16 bf16 bfloat16 torch_autocast optimizer scheduler zero_allow_untested_optimizer zero_force_ds_cpu_optimizer
    flops_profiler wall_clock_breakdown memory_breakdown autotuning use_data_before_expert_parallelism hybrid_engine
    pipeline data_efficiency curriculum_learning checkpoint data_types aio dataloader_drop_last log_level
    datastates_ckpt weight_quantization compile timers tensor_parallel expert_parallel amp sparse_attention
    sparse_gradients elasticity nebula quantize_training eigenvalue progressive_layer_drop compression_training
    graph_harvesting sequence_parallel_size
    """.split()
)

ZERO = frozenset(
    """
    stage contiguous_gradients reduce_scatter reduce_bucket_size use_multi_rank_bucket_allreduce allgather_partitions
    allgather_bucket_size overlap_comm compute_grad_norm load_from_fp32_weights elastic_checkpoint offload_param
    offload_optimizer zenflow sub_group_size cpu_offload_param cpu_offload_use_pin_memory cpu_offload
    prefetch_bucket_size stage3_prefetch_bucket_size param_persistence_threshold stage3_param_persistence_threshold
    model_persistence_threshold stage3_model_persistence_threshold max_live_parameters stage3_max_live_parameters
    max_reuse_distance stage3_max_reuse_distance gather_16bit_weights_on_model_save
    stage3_gather_16bit_weights_on_model_save module_granularity_threshold stage3_module_granularity_threshold
    use_all_reduce_for_fetch_params stage3_use_all_reduce_for_fetch_params allgather_sequential
    stage3_allgather_sequential stage3_gather_fp16_weights_on_model_save ignore_unused_parameters legacy_stage1
    round_robin_gradients parameter_alignment zero_hpz_partition_size zero_quantized_weights
    zero_quantized_nontrainable_weights zero_quantized_gradients memory_efficient_linear pipeline_loading_checkpoint
    override_module_apply log_trace_cache_warnings enable_sanity_checks save_muon_momentum_buffer_in_memory
    leaf_module
    mics_shard_size mics_hierarchical_params_gather
    """.split()
)  # the last line: ZeRO++/MiCS keys of earlier 0.1x releases, still in the wild

OFFLOAD_PARAM = frozenset("device nvme_path buffer_count buffer_size max_in_cpu pin_memory".split())
OFFLOAD_OPTIMIZER = frozenset(
    "device nvme_path buffer_count pin_memory pipeline_read pipeline_write fast_init ratio super_offload "
    "cpuadam_cores_perc".split()
)
FP16 = frozenset(
    "enabled auto_cast loss_scale initial_scale_power loss_scale_window hysteresis consecutive_hysteresis "
    "min_loss_scale fp16_master_weights_and_grads".split()
)
BF16 = frozenset("enabled immediate_grad_update check_grad_overflow bf16_master_weights_and_grads bf16_optimizer_states".split())
OPTIMIZER = frozenset(("type", "params", "legacy_fusion"))
SCHEDULER = frozenset(("type", "params"))

# section path -> (known keys, strict: DeepSpeed rejects unknown keys there)
SECTIONS: Dict[str, Any] = {
    "": (TOP_LEVEL, False),
    "zero_optimization": (ZERO, True),
    "zero_optimization.offload_param": (OFFLOAD_PARAM, True),
    "zero_optimization.offload_optimizer": (OFFLOAD_OPTIMIZER, True),
    "fp16": (FP16, True),
    "bf16": (BF16, True),
    "bfloat16": (BF16, True),
    "optimizer": (OPTIMIZER, False),
    "scheduler": (SCHEDULER, False),
}

# Keys that are not valid where they were found but have a known home.
ALIASES = {
    "offload": "zero_optimization.offload_optimizer",
    "offload_optimizer": "zero_optimization.offload_optimizer",
    "optimizer_offload": "zero_optimization.offload_optimizer",
    "cpu_offload": "zero_optimization.offload_optimizer",
    "offload_param": "zero_optimization.offload_param",
    "param_offload": "zero_optimization.offload_param",
    "zero_stage": "zero_optimization.stage",
    "lr": "optimizer.params.lr",
    "betas": "optimizer.params.betas",
    "eps": "optimizer.params.eps",
    "weight_decay": "optimizer.params.weight_decay",
    "warmup_min_lr": "scheduler.params.warmup_min_lr",
    "warmup_max_lr": "scheduler.params.warmup_max_lr",
    "warmup_num_steps": "scheduler.params.warmup_num_steps",
    "total_num_steps": "scheduler.params.total_num_steps",
    "loss_scale": "fp16.loss_scale",
    "initial_scale_power": "fp16.initial_scale_power",
    "loss_scale_window": "fp16.loss_scale_window",
    "hysteresis": "fp16.hysteresis",
    "min_loss_scale": "fp16.min_loss_scale",
}
# Under optimizer.params the optimizer's own arguments go; these are DeepSpeed engine settings that do not.
OPTIMIZER_PARAMS_MISPLACED = ("offload", "offload_optimizer", "cpu_offload", "offload_param", "device", "zero_stage")


def _home(key: str, found_at: str) -> Optional[str]:
    """Where ``key`` belongs, when it is not at ``found_at``."""
    for path, (keys, _strict) in SECTIONS.items():
        if path != found_at and key in keys and path not in ("bfloat16",):
            return f"{path}.{key}" if path else key
    return ALIASES.get(key)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def check_keys(ds: Dict[str, Any], path: str, add: Callable, installed: Optional[str]) -> None:
    version_note = f"DeepSpeed {SCHEMA_VERSION} schema" + (f"; DeepSpeed {installed} is installed" if installed else "")
    sections = [(path, ds)]
    for section_path in ("zero_optimization", "zero_optimization.offload_param", "zero_optimization.offload_optimizer", "fp16", "bf16", "bfloat16", "optimizer", "scheduler"):
        node: Any = ds
        for part in section_path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            sections.append((section_path, node))
    for section_path, node in sections:
        keys, strict = SECTIONS[section_path]
        for key in node:
            if key in keys:
                continue
            where = _join(section_path, key)
            home = _home(key, section_path)
            consequence = (
                "DeepSpeed rejects it (pydantic `extra=\"forbid\"`: ValidationError at deepspeed.initialize)"
                if strict
                else "DeepSpeed silently ignores it, so the setting does not take effect"
            )
            if home:
                add(
                    finding(
                        "ds-misplaced-key",
                        f"`{where}` is not a DeepSpeed setting there; it belongs at `{home}`. {consequence}.",
                        f"move it to `{home}`"
                        + (" (e.g. \"zero_optimization\": {\"offload_optimizer\": {\"device\": \"cpu\", \"pin_memory\": true}})" if home.endswith("offload_optimizer") else ""),
                        key=where,
                    )
                )
            else:
                close = difflib.get_close_matches(key, sorted(keys), n=2, cutoff=0.75)
                hint = f" Did you mean {' or '.join('`' + c + '`' for c in close)}?" if close else ""
                add(
                    finding(
                        "ds-unknown-key",
                        f"`{where}` is not a DeepSpeed key ({version_note}); {consequence}.{hint}",
                        f"rename it to `{close[0]}`" if close else "remove it, or check the key against the DeepSpeed config docs",
                        severity=ERROR if strict else WARNING,
                        key=where,
                    )
                )
    params = ds.get("optimizer", {}).get("params") if isinstance(ds.get("optimizer"), dict) else None
    if isinstance(params, dict):
        for key in params:
            if key in OPTIMIZER_PARAMS_MISPLACED:
                home = ALIASES.get(key, "zero_optimization.offload_optimizer")
                add(
                    finding(
                        "ds-misplaced-key",
                        f"`optimizer.params.{key}` is passed to the optimizer's constructor, which does not take it "
                        f"(TypeError when DeepSpeed builds the optimizer); offload is a ZeRO setting: `{home}`.",
                        f"move it to `{home}`",
                        key=f"optimizer.params.{key}",
                    )
                )


def _enabled(section: Any) -> Optional[bool]:
    if isinstance(section, dict):
        value = section.get("enabled")
        return None if value == "auto" else as_bool(value)
    return None


def _stage(ds: Dict[str, Any]) -> Optional[int]:
    zero = ds.get("zero_optimization")
    if isinstance(zero, bool):
        return 1 if zero else 0
    if not isinstance(zero, dict):
        return 0
    try:
        return int(zero.get("stage", 0))
    except (TypeError, ValueError):
        return None


def _device(section: Any) -> Optional[str]:
    if isinstance(section, dict):
        device = section.get("device", "none")
        return str(device).lower() if device is not None else "none"
    return None


def check_offload(ds: Dict[str, Any], add: Callable) -> None:
    stage = _stage(ds)
    zero = ds.get("zero_optimization") if isinstance(ds.get("zero_optimization"), dict) else {}
    if stage is None:
        return
    param_device = _device(zero.get("offload_param"))
    if param_device in ("cpu", "nvme") and stage < 3:
        add(
            finding(
                "ds-offload-stage",
                f"`zero_optimization.offload_param` ({param_device}) is only used by ZeRO stage 3; at stage {stage} "
                "DeepSpeed ignores it and the parameters stay on the GPU.",
                "set `zero_optimization.stage` to 3, or remove `offload_param` (stage 1/2 can offload the optimizer only)",
                key="zero_optimization.offload_param",
            )
        )
    optimizer = zero.get("offload_optimizer")
    opt_device = _device(optimizer)
    if opt_device in ("cpu", "nvme") and stage == 0:
        add(
            finding(
                "ds-offload-stage",
                f"`zero_optimization.offload_optimizer` ({opt_device}) needs ZeRO stage 1, 2 or 3; at stage 0 (ZeRO "
                "off) DeepSpeed ignores it.",
                "set `zero_optimization.stage` to 1, 2 or 3",
                key="zero_optimization.offload_optimizer",
            )
        )
    if isinstance(optimizer, dict):
        ratio = as_number(optimizer.get("ratio", 1.0))
        if isinstance(ratio, (int, float)) and ratio < 1.0 and stage != 3:
            add(
                finding(
                    "ds-offload-stage",
                    f"`zero_optimization.offload_optimizer.ratio` {ratio} (partial offload) is only supported by ZeRO "
                    f"stage 3; DeepSpeed asserts \"Partial offloading only supported for ZeRO Stage 3\" at stage {stage}.",
                    "use stage 3, or remove `ratio`",
                    key="zero_optimization.offload_optimizer.ratio",
                )
            )


def check_precision(ds: Dict[str, Any], add: Callable) -> None:
    bf16 = ds.get("bf16") if "bf16" in ds else ds.get("bfloat16")
    if _enabled(ds.get("fp16")) and _enabled(bf16):
        add(
            finding(
                "ds-fp16-bf16-both",
                "`fp16.enabled` and `bf16.enabled` are both true; DeepSpeed asserts "
                "\"bfloat16 and fp16 modes cannot be simultaneously enabled\".",
                "keep one (bf16 on Ampere or newer GPUs), or set both to \"auto\" and choose with --bf16/--fp16",
                key="fp16.enabled",
            )
        )


def check_zero3_load(ds: Dict[str, Any], train: Optional[TrainView], transformers_version: Optional[str], add: Callable) -> None:
    if _stage(ds) != 3 or train is None or train.is_lf:
        # LLaMA-Factory turns low_cpu_mem_usage and its device_map off under ZeRO-3 itself (model/patcher.py).
        return
    kwargs = train.model_init_kwargs()
    device_map = kwargs.get("device_map", train.get("device_map"))
    where = "model_init_kwargs.device_map" if "device_map" in kwargs else "device_map"
    if device_map not in (None, "", False):
        add(
            finding(
                "ds-zero3-device-map",
                f"ZeRO-3 partitions the weights itself, but the model is loaded with `{where}: {device_map}`; "
                "from_pretrained raises \"DeepSpeed Zero-3 is not compatible with passing a `device_map`\".",
                f"remove `{where}` (let DeepSpeed place the weights)",
                file=train.path,
                key=where,
            )
        )
    low = kwargs.get("low_cpu_mem_usage", train.get("low_cpu_mem_usage"))
    where = "model_init_kwargs.low_cpu_mem_usage" if "low_cpu_mem_usage" in kwargs else "low_cpu_mem_usage"
    if as_bool(low):
        old = older_than(transformers_version, "4.51")
        add(
            finding(
                "ds-zero3-device-map",
                f"ZeRO-3 with `{where}: true`: "
                + (
                    "this transformers raises \"DeepSpeed Zero-3 is not compatible with `low_cpu_mem_usage=True`\""
                    if old
                    else "transformers >= 4.51 ignores low_cpu_mem_usage (no effect, no error)"
                ),
                f"remove `{where}`",
                severity=ERROR if old else INFO,
                file=train.path,
                key=where,
            )
        )


def _lookup(ds: Dict[str, Any], dotted: str):
    node: Any = ds
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def check_against_training(ds: Dict[str, Any], train: TrainView, add: Callable) -> None:
    """HfTrainerDeepSpeedConfig.trainer_config_process: non-"auto" values must equal the TrainingArguments ones."""
    v = train.hf_value
    fp16 = bool(as_bool(v("fp16")) or as_bool(v("fp16_full_eval")))
    bf16 = bool(as_bool(v("bf16")) or as_bool(v("bf16_full_eval")))
    pairs = [
        ("train_micro_batch_size_per_gpu", v("per_device_train_batch_size"), "per_device_train_batch_size"),
        ("gradient_accumulation_steps", v("gradient_accumulation_steps"), "gradient_accumulation_steps"),
        ("gradient_clipping", v("max_grad_norm"), "max_grad_norm"),
        ("optimizer.params.lr", v("learning_rate"), "learning_rate"),
        ("optimizer.params.betas", [v("adam_beta1"), v("adam_beta2")], "adam_beta1+adam_beta2"),
        ("optimizer.params.eps", v("adam_epsilon"), "adam_epsilon"),
        ("optimizer.params.weight_decay", v("weight_decay"), "weight_decay"),
        ("scheduler.params.warmup_max_lr", v("learning_rate"), "learning_rate"),
        ("fp16.enabled", fp16, "fp16"),
        ("bf16.enabled", bf16, "bf16"),
    ]
    for ds_key, hf_val, hf_key in pairs:
        present, ds_val = _lookup(ds, ds_key)
        if not present or ds_val == "auto" or ds_val is None or hf_val is None:
            continue
        left = [as_number(x) for x in ds_val] if isinstance(ds_val, list) else as_number(ds_val)
        if isinstance(left, str) and ds_key.endswith("enabled"):
            left = as_bool(left)
        if _differ(left, hf_val):
            source = "the training config" if train.given(hf_key.split("+")[0]) else "TrainingArguments' default"
            add(
                finding(
                    "ds-train-mismatch",
                    f"DeepSpeed `{ds_key}` = {ds_val!r} but {hf_key} = {hf_val!r} ({source}); Trainer raises "
                    "\"Please correct the following DeepSpeed config values that mismatch TrainingArguments values\".",
                    f"set `{ds_key}` to \"auto\" (Trainer fills it in), or make both equal",
                    key=ds_key,
                )
            )
    present, total = _lookup(ds, "train_batch_size")
    mbs, gas = v("per_device_train_batch_size"), v("gradient_accumulation_steps")
    if present and total != "auto" and isinstance(as_number(total), int) and isinstance(mbs, int) and isinstance(gas, int) and mbs * gas > 0:
        total = as_number(total)
        if total % (mbs * gas):
            add(
                finding(
                    "ds-train-mismatch",
                    f"DeepSpeed `train_batch_size` = {total} is not a multiple of per_device_train_batch_size × "
                    f"gradient_accumulation_steps = {mbs} × {gas}: no number of GPUs satisfies DeepSpeed's "
                    "train_batch_size = micro_batch × grad_accum × world_size.",
                    "set `train_batch_size` to \"auto\"",
                    key="train_batch_size",
                )
            )


def _differ(a: Any, b: Any) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return len(a) != len(b) or any(_differ(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return bool(a) != bool(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(float(a) - float(b)) > 1e-12 * max(1.0, abs(float(b)))
    return a != b


def check(ds: Dict[str, Any], train: Optional[TrainView], versions: Dict[str, Optional[str]], add: Callable) -> None:
    check_keys(ds, "", add, versions.get("deepspeed"))
    check_offload(ds, add)
    check_precision(ds, add)
    check_zero3_load(ds, train, versions.get("transformers"), add)
    if train is not None:
        check_against_training(ds, train, add)
