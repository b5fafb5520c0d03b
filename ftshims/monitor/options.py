"""The monitor's options and detector codes, checked when they are given.

``ftshims.monitor.callback(**options)``, ``Monitor(model, **options)`` and
``FTSHIMS_MONITOR='{...}'`` all go through :func:`check`: an unknown name or
a bad value is a ``ValueError`` in the one format of :mod:`ftshims.settings`
(setting, what was given, what is allowed, the closest match). Importing this
module imports nothing heavy: the start-up hook and ``settings.py`` use it.
It imports :mod:`ftshims._setting_base` (the error format, the log path), not
``settings`` itself: ``settings`` imports this module, so the dependency runs one way.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

from .._setting_base import invalid, parse_monitor_log

ERROR, WARNING, INFO = "error", "warning", "info"  # the severities of ftshims.advisories and the lint

# Every detector: code -> (severity, what it watches). The codes are stable: they are the JSONL's and the
# report's vocabulary, and policy=/off= name them.
CODES: Dict[str, Tuple[str, str]] = {
    "nothing_trainable": (ERROR, "no parameter requires grad at train begin"),
    "trainable_without_grad": (ERROR, "parameters with requires_grad got no gradient in the first optimizer steps"),
    "frozen_param_changed": (ERROR, "a frozen parameter (or a PEFT base weight) changed value (sampled checksums)"),
    "nonfinite_loss": (ERROR, "the loss is NaN/inf; the first module with a non-finite output is named"),
    "nonfinite_grad": (ERROR, "the gradient norm is NaN/inf while the loss is finite"),
    "loss_spike": (WARNING, "the step loss jumped far above its recent median (median/MAD, after a warm-up)"),
    "grad_norm_spike": (WARNING, "the gradient norm jumped far above its recent median (median/MAD, after a warm-up)"),
    "labels_all_ignored": (WARNING, "a training batch had no label the loss scores"),
    "eos_never_target": (WARNING, "pad = EOS, EOS is in the inputs, and no EOS was a label over eos_steps steps"),
    "loss_count_mismatch": (WARNING, "the Trainer's num_items_in_batch differs from the number of labels the loss scores"),
    "packing_contaminated": (ERROR, "a packed example's logits differ from the same example run alone"),
    "rope_low_precision": (WARNING, "a rotary inv_freq buffer is not float32 during training"),
    "token_id_out_of_range": (ERROR, "an input id is at or above the embedding's row count (raised before the forward)"),
    "ranks_identical_batches": (ERROR, "every rank received the same batch (a sampler that does not shard)"),
    # learning progress judged from first principles (detectors/progress.py, updates.py, data.py, trainable.py)
    "loss_diverging": (ERROR, "the loss climbed above a uniform predictor's (ln of the classes the head scores) or far above its early level, and stayed there"),
    "updates_lost": (ERROR, "most sampled weight elements with a non-zero gradient did not change: bf16/fp16 weights without fp32 master copies round the optimizer's steps away"),
    "updates_vanishing": (WARNING, "the optimizer's steps are negligible next to the weights (||dw||/||w|| below update_ratio_min): a learning rate or clipping far too small"),
    "updates_too_large": (WARNING, "an optimizer step moved the sampled weights by more than their own size (||dw||/||w|| above update_ratio_max)"),
    "no_eos_target": (WARNING, "a causal LM trained on padded rows of different lengths in which no scored label is EOS: it never learns to stop"),
    "model_in_eval_mode": (WARNING, "the optimizer steps after forwards made in eval mode (model.eval() never undone): dropout is off, and the monitor sees no training forward"),
    "trainable_not_in_optimizer": (ERROR, "parameters with requires_grad that are in no optimizer parameter group: they get gradients and never change"),
    # what users get wrong in their data and configuration (checked on the first data_steps steps' batches and
    # every read_every steps after)
    "labels_preshifted": (ERROR, "the labels equal the inputs shifted by one: a causal LM shifts them again and learns the token after next"),
    "padding_trained_on": (WARNING, "labels on padding: positions the attention mask excludes, or pad ids (pad != EOS) left in the labels"),
    "bos_doubled": (WARNING, "rows start with BOS twice (a chat template that renders BOS, tokenized with add_special_tokens=True)"),
    "special_token_invalid": (ERROR, "a BOS/EOS id outside the model's vocabulary, or a tokenizer without EOS for a causal LM"),
    "rows_without_target": (WARNING, "more than no_target_share of the rows have no label the loss scores"),
    "rows_truncated": (WARNING, "more than truncated_share of the rows fill the maximum length without their EOS target, while shorter rows end with EOS"),
    "lr_schedule_cannot_train": (ERROR, "warmup longer than the run, a learning rate of 0 at most steps, or a scheduler that never moves the lr"),
    "loss_not_moving": (ERROR, "the loss did not change at all over the first loss_steps optimizer steps while parameters are trainable"),
    # each save verified (detectors/checkpoint.py): the files read back against the weights in memory, a manifest
    # with SHA-256 written beside them
    "checkpoint_key_missing": (ERROR, "a saved checkpoint lacks a tensor the model has in memory (or a weight file cannot be read back)"),
    "checkpoint_tensor_empty": (ERROR, "a saved tensor is empty or all zeros while the model's in memory is not"),
    "checkpoint_tensor_changed": (ERROR, "a saved tensor's dtype, shape or values differ from the model's in memory"),
}

POLICIES = ("warn", "raise", "skip")
# the codes policy "skip" may name: the step's update is not applied (core.py, "the skip defence")
SKIPPABLE = ("nonfinite_loss", "nonfinite_grad", "loss_spike", "grad_norm_spike")
READS = ("auto", "step", "log")

# name -> default. The per-step work is what README.md / the module docstring promise: no option turns on
# a per-step host-device synchronisation except read="step" (on an accelerator).
DEFAULTS: Dict[str, Any] = {
    "policy": "warn",  # "warn" | "raise" | {code: "warn"/"raise"}; token_id_out_of_range raises unless set to "warn"
    "off": (),  # codes not to run
    "warmup": 20,  # steps before the spike detectors judge (and values they need first)
    "spike_sigmas": 8.0,  # how many robust standard deviations (1.4826 x MAD) above the median is a spike
    "grad_steps": 4,  # optimizer steps over which trainable_without_grad judges
    "eos_steps": 50,  # steps over which eos_never_target judges
    "hash_every": 50,  # ranks_identical_batches compares ranks at step 1 and every hash_every steps
    "frozen_samples": 8,  # frozen parameters checksummed by frozen_param_changed
    "read": "auto",  # when device-side values are read: "auto" (CPU: every step; else logging steps), "step", "log"
    "read_every": 50,  # custom loops, read="log" on an accelerator: read every N steps (and at read()/close())
    "localize": True,  # re-run a non-finite batch once with per-module hooks
    "max_skips": 5,  # policy "skip": this many consecutive skipped steps raise MonitorError
    # learning progress (loss_diverging, updates_*): chosen so that healthy runs give no finding
    "diverge_steps": 5,  # loss_diverging: consecutive optimizer steps above the threshold
    "diverge_factor": 3.0,  # loss_diverging: "far above its early level" is above diverge_factor x that level (and +1)
    "update_every": 10,  # update statistics on the first update_every optimizer steps, then every update_every-th
    "update_ratio_min": 1e-6,  # updates_vanishing: median ||dw||/||w|| of the sampled tensors below this
    "update_ratio_max": 1.0,  # updates_too_large: a step's median ||dw||/||w|| above this
    "lost_share": 0.5,  # updates_lost: share of sampled elements with a non-zero gradient left unchanged
    "log": None,  # JSONL path (default: FTSHIMS_MONITOR_LOG)
    # the data and configuration checks: chosen so that healthy runs give no finding
    "data_steps": 4,  # the batches of the first N optimizer steps are checked (then those of every read_every-th step)
    "no_target_share": 0.2,  # rows_without_target: fires above this share of rows with no scored label
    "truncated_share": 0.2,  # rows_truncated: fires above this share of rows cut at the maximum length
    "shifted_share": 0.9,  # labels_preshifted: fires above this share of labels equal to the next input id
    "padding_share": 0.0,  # padding_trained_on: fires above this share of scored labels on padding
    "doubled_share": 0.0,  # bos_doubled: fires above this share of rows starting with BOS twice
    "lr_zero_share": 0.5,  # lr_schedule_cannot_train: fires above this share of the run's steps at learning rate 0
    "loss_steps": 5,  # loss_not_moving judges the first N optimizer steps' losses (N >= 2)
}

_POSITIVE_INTS = ("warmup", "grad_steps", "eos_steps", "hash_every", "frozen_samples", "read_every", "data_steps",
                  "max_skips", "diverge_steps", "update_every")
_POSITIVE_NUMBERS = ("update_ratio_min", "update_ratio_max")
# shares: a number in [0, 1); the finding fires when the share seen is above it
SHARES = ("no_target_share", "truncated_share", "shifted_share", "padding_share", "doubled_share", "lr_zero_share",
          "lost_share")


def _where(name: str, source: str) -> str:
    return f"{source}[{name!r}]"


def check_policy(value: Any, source: str = "options") -> Dict[str, str]:
    """``{code: "warn"/"raise"}`` for every code, from ``"warn"``, ``"raise"`` or a per-code dict."""
    where = _where("policy", source)
    policy = {code: "warn" for code in CODES}
    policy["token_id_out_of_range"] = "raise"  # the forward would crash anyway: fail with the clear message
    if isinstance(value, str):
        chosen = _choice(where, value, ("warn", "raise"))
        if chosen == "raise":
            policy = {code: "raise" for code in CODES}
        return policy
    if not isinstance(value, Mapping):
        raise invalid(where, value, f"expected 'warn', 'raise' or {{code: 'warn'/'raise'/'skip'}}, got {value!r}", POLICIES)
    for code, each in value.items():
        code = check_code(code, where)
        chosen = _choice(f"{where}[{code!r}]", each, POLICIES)
        if chosen == "skip" and code not in SKIPPABLE:
            raise invalid(f"{where}[{code!r}]", each, f"'skip' drops a step's update, which only a symptom seen before the "
                          f"update can justify: {', '.join(SKIPPABLE)}; {code!r} takes 'warn' or 'raise'", ("warn", "raise"))
        policy[code] = chosen
    return policy


def skip_codes(policy: Mapping[str, str]) -> frozenset:
    """The codes whose policy is ``"skip"``."""
    return frozenset(code for code, each in policy.items() if each == "skip")


def check_code(code: Any, where: str) -> str:
    if not isinstance(code, str) or code.strip().lower().replace("-", "_") not in CODES:
        raise invalid(where, code, f"unknown detector code {code!r}", list(CODES))
    return code.strip().lower().replace("-", "_")


def _choice(where: str, value: Any, allowed) -> str:
    if isinstance(value, str) and value.strip().lower() in allowed:
        return value.strip().lower()
    raise invalid(where, value, f"got {value!r}", allowed)


def check(given: Optional[Mapping[str, Any]] = None, source: str = "options") -> Dict[str, Any]:
    """Every option with its default filled in and each given value checked; ValueError on the first bad one."""
    given = dict(given or {})
    for name in given:
        if name not in DEFAULTS:
            raise invalid(source, name, f"unknown option {name!r}", list(DEFAULTS))
    merged = dict(DEFAULTS)
    merged.update(given)
    merged["policy"] = check_policy(merged["policy"], source)
    off = merged["off"]
    if isinstance(off, str):
        off = [off]
    if not isinstance(off, (list, tuple, set, frozenset)):
        raise invalid(_where("off", source), off, f"expected a list of detector codes, got {off!r}", list(CODES))
    merged["off"] = frozenset(check_code(code, _where("off", source)) for code in off)
    for name in _POSITIVE_INTS:
        value = merged[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise invalid(_where(name, source), value, f"expected a positive int, got {value!r}", ["any int >= 1"])
    loss_steps = merged["loss_steps"]
    if isinstance(loss_steps, bool) or not isinstance(loss_steps, int) or loss_steps < 2:
        raise invalid(_where("loss_steps", source), loss_steps, f"expected an int >= 2, got {loss_steps!r}", ["any int >= 2"])
    for name in SHARES:
        value = merged[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise invalid(_where(name, source), value, f"expected a share in [0, 1), got {value!r}", ["any number >= 0 and < 1"])
        merged[name] = float(value)
    for name in _POSITIVE_NUMBERS:
        value = merged[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise invalid(_where(name, source), value, f"expected a positive number, got {value!r}", ["any number > 0"])
        merged[name] = float(value)
    if merged["update_ratio_min"] >= merged["update_ratio_max"]:
        raise invalid(_where("update_ratio_min", source), merged["update_ratio_min"],
                      f"update_ratio_min ({merged['update_ratio_min']:g}) must be below update_ratio_max "
                      f"({merged['update_ratio_max']:g})", ["a number below update_ratio_max"])
    factor = merged["diverge_factor"]
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 1 < factor < float("inf"):
        raise invalid(_where("diverge_factor", source), factor, f"expected a number > 1, got {factor!r}", ["any number > 1"])
    merged["diverge_factor"] = float(factor)
    sigmas = merged["spike_sigmas"]
    if isinstance(sigmas, bool) or not isinstance(sigmas, (int, float)) or not sigmas > 0:
        raise invalid(_where("spike_sigmas", source), sigmas, f"expected a positive number, got {sigmas!r}", ["any number > 0"])
    merged["spike_sigmas"] = float(sigmas)
    merged["read"] = _choice(_where("read", source), merged["read"], READS)
    if not isinstance(merged["localize"], bool):
        raise invalid(_where("localize", source), merged["localize"], f"expected true or false, got {merged['localize']!r}", ["true", "false"])
    if merged["log"] is not None:
        merged["log"] = parse_monitor_log(merged["log"], setting=_where("log", source))
    return merged


def public(options: Mapping[str, Any]) -> Dict[str, Any]:
    """The checked options as JSON-ready values (for the JSONL header)."""
    out = dict(options)
    out["off"] = sorted(out["off"])
    return out
