"""Reading the lint's input files, and one normalised view of the training config.

Every reader returns ``None`` and records a finding when a file is missing,
unreadable or unparsable: nothing here raises into the doctor. YAML needs
PyYAML; without it a YAML file becomes an ``info`` finding.

Training configs come in two flavours:

* ``transformers``: a ``TrainingArguments`` (or TRL ``SFTConfig``) dump as JSON,
  or a TRL-CLI YAML (``SFTConfig`` + ``ModelConfig`` keys);
* ``llamafactory``: a LLaMA-Factory YAML/JSON (``stage``, ``finetuning_type``,
  ``lora_target``, ``cutoff_len``, ``template``, ...).

:class:`TrainView` answers the questions the rules ask (sequence length,
packing, attention implementation, gradient checkpointing, PEFT, batch
sizes, ...) the same way for both, applying each trainer's defaults.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from . import llamafactory as lf
from .findings import finding

LLAMAFACTORY = "llamafactory"
TRANSFORMERS = "transformers"


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:400]



def _mapping(value) -> Optional[Dict[str, Any]]:
    """A dict-valued training argument, given as a dict or as JSON text (the CLI form); None otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return value if isinstance(value, dict) else None

class Loader:
    """Reads files, collecting ``file-unreadable`` / ``config-invalid`` / ``yaml-unsupported`` findings."""

    def __init__(self, findings: List[Dict[str, Any]]):
        self.findings = findings

    def unreadable(self, path: str, why: str, what: str, severity: Optional[str] = None, fix: Optional[str] = None) -> None:
        self.findings.append(
            finding(
                "file-unreadable",
                f"{what} {path}: {why}",
                fix or f"pass the path of a readable {what}",
                severity=severity,
                file=path,
            )
        )

    def invalid(self, path: str, what: str, fmt: str, exc: BaseException, text: str) -> None:
        """``config-invalid``: the file was read but does not parse; say where and which syntax rule."""
        line, column, problem = _error_location(exc)
        where = f" at line {line}, column {column}" if line else ""
        source = text.splitlines()[line - 1].strip() if line and line <= len(text.splitlines()) else ""
        shown = f" (the line reads: {source[:120]!r})" if source else ""
        self.findings.append(
            finding(
                "config-invalid",
                f"{what} {path} is not valid {fmt}{where}: {problem}{shown}",
                f"fix the {fmt} syntax{where}: {_SYNTAX_HINT[fmt]}",
                file=path,
            )
        )

    def mapping(self, path: str, what: str, referenced: bool = False) -> Optional[Dict[str, Any]]:
        """A JSON or YAML file whose top level is a mapping. ``referenced``: the path came from inside another
        config (relative to the directory training is launched from), so a missing file is only a warning."""
        if not os.path.isfile(path):
            if referenced and not os.path.exists(path):
                self.unreadable(
                    path,
                    "not found (relative paths are tried from the working directory and beside the training config)",
                    what,
                    severity="warning",
                    fix="run the doctor from the directory training is launched from, or pass --deepspeed",
                )
                return None
            self.unreadable(path, "no such file" if not os.path.exists(path) else "not a file", what)
            return None
        try:
            with open(path, "rb") as handle:
                raw = handle.read()
            text = raw.decode("utf-8-sig")
        except (OSError, UnicodeDecodeError) as exc:
            self.unreadable(path, f"cannot be read ({_one_line(exc)})", what)
            return None
        is_yaml = path.lower().endswith((".yaml", ".yml"))
        if not is_yaml:
            try:
                data = json.loads(text)
            except ValueError as exc:
                if not text.lstrip().startswith(("{", "[")) and _yaml_available():
                    is_yaml = True  # a YAML file with another extension
                else:
                    self.invalid(path, what, "JSON", exc, text)
                    return None
        if is_yaml:
            if not _yaml_available():
                self.findings.append(
                    finding(
                        "yaml-unsupported",
                        f"{what} {path} is YAML, but PyYAML is not installed: it was not checked",
                        "pip install pyyaml, or pass the config as JSON",
                        file=path,
                    )
                )
                return None
            import yaml

            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as exc:
                self.invalid(path, what, "YAML", exc, text)
                return None
        if not isinstance(data, dict):
            self.findings.append(
                finding(
                    "config-invalid",
                    f"{what} {path}: its top level is {type(data).__name__}, not a mapping of settings",
                    "write the settings as one mapping at the top level: `{\"key\": value, ...}` in JSON, `key: value` lines in YAML",
                    file=path,
                )
            )
            return None
        return data


# The syntax rules a hand-written config most often breaks, for the fix text.
_SYNTAX_HINT = {
    "JSON": "keys and strings in double quotes, a comma between items and none after the last, no comments, "
    "true/false/null in lower case",
    "YAML": "indent nested keys with spaces (no tabs) and consistently, a space after each `key:`, close every "
    "[ and {, and quote values that contain `: ` or ` #` or start with [, {, *, &, !, % or @",
}


def _error_location(exc: BaseException) -> Tuple[Optional[int], Optional[int], str]:
    """(line, column, problem) of a JSON or YAML parse error, 1-based; (None, None, text) when unknown."""
    if isinstance(exc, json.JSONDecodeError):
        return exc.lineno, exc.colno, exc.msg
    mark = getattr(exc, "problem_mark", None)  # yaml.MarkedYAMLError
    problem = " ".join(str(getattr(exc, "problem", None) or exc).split())[:300]
    context = getattr(exc, "context", None)
    if context:
        problem = f"{problem} ({' '.join(str(context).split())})"
    if mark is not None:
        return mark.line + 1, mark.column + 1, problem
    return None, None, problem


def _yaml_available() -> bool:
    try:
        import yaml  # noqa: F401
    except ImportError:
        return False
    return True


def config_file(path: str, name: str) -> str:
    """``path`` itself, or ``path/name`` when ``path`` is a directory."""
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, name)):
        return os.path.join(path, name)
    if os.path.isdir(path):
        return os.path.join(path, name)  # reported as missing by the loader
    return path


# -- the training config ---------------------------------------------------------------------------


def flavor(data: Dict[str, Any]) -> str:
    return LLAMAFACTORY if set(data) & lf.MARKERS else TRANSFORMERS


def as_bool(value: Any) -> Optional[bool]:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return bool(value)
    if isinstance(value, str):
        low = value.strip().lower()
        if low in ("true", "yes", "1", "on"):
            return True
        if low in ("false", "no", "0", "off", "none", "null", ""):
            return False
    return None


def as_number(value: Any) -> Any:
    """``"2e-5"`` → ``2e-05`` (PyYAML reads an exponent without a dot as a string; HfArgumentParser converts it)."""
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value
        return int(number) if number.is_integer() and "." not in value and "e" not in value.lower() else number
    return value


def split_names(value: Any) -> Optional[List[str]]:
    """LLaMA-Factory's comma-separated lists (``lora_target: q_proj,v_proj``)."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return [str(v).strip() for v in value if str(v).strip()]
    return [part.strip() for part in str(value).split(",") if part.strip()]


@dataclass
class TrainView:
    data: Dict[str, Any]
    path: str
    kind: str
    hf_defaults: Dict[str, Any] = field(default_factory=dict)

    # generic access ---------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    def given(self, key: str) -> bool:
        return key in self.data

    def hf_value(self, key: str) -> Any:
        """A TrainingArguments value: the config's, else the installed transformers' default."""
        if key in self.data:
            return as_number(self.data[key])
        return self.hf_defaults.get(key)

    @property
    def is_lf(self) -> bool:
        return self.kind == LLAMAFACTORY

    def model_init_kwargs(self) -> Dict[str, Any]:
        return _mapping(self.data.get("model_init_kwargs")) or {}

    # what the rules ask -------------------------------------------------------------------
    def seq_len(self) -> Tuple[Optional[int], Optional[str], bool]:
        """``(length, key, explicit)``: the longest sequence the run will feed the model."""
        if self.is_lf:
            if "cutoff_len" in self.data:
                return _int(self.data["cutoff_len"]), "cutoff_len", True
            return lf.DEFAULTS["cutoff_len"], "cutoff_len", False
        for key in ("max_length", "max_seq_length", "model_max_length", "max_seq_len"):
            if self.data.get(key) is not None:
                return _int(self.data[key]), key, True
        return None, None, False

    def packing(self) -> Dict[str, Any]:
        if self.is_lf:
            stage = self.data.get("stage", lf.DEFAULTS["stage"])
            value = self.data.get("packing")
            enabled = as_bool(value) if value is not None else stage == "pt"
            return {
                "enabled": bool(enabled),
                "neat": bool(as_bool(self.data.get("neat_packing"))),
                "strategy": None,
                "padding_free": False,
                "key": "packing" if value is not None else "stage",
            }
        return {
            "enabled": bool(as_bool(self.data.get("packing"))),
            "neat": False,
            "strategy": self.data.get("packing_strategy"),
            "padding_free": bool(as_bool(self.data.get("padding_free"))),
            "key": "packing",
        }

    def attn_implementation(self, model_config: Optional[Dict[str, Any]]) -> Tuple[Optional[str], str]:
        """``(implementation or None for transformers' default, where it came from)``."""
        if self.is_lf:
            value = str(self.data.get("flash_attn", lf.DEFAULTS["flash_attn"])).lower()
            return lf.FLASH_ATTN.get(value, value), f"flash_attn: {value}"
        for where, value in (
            ("model_init_kwargs.attn_implementation", self.model_init_kwargs().get("attn_implementation")),
            ("attn_implementation", self.data.get("attn_implementation")),
        ):
            if value:
                return str(value), where
        if model_config:
            value = model_config.get("attn_implementation") or model_config.get("_attn_implementation")
            if value:
                return str(value), "config.json attn_implementation"
        return None, "not set (transformers' default)"

    def gradient_checkpointing(self) -> Tuple[bool, Optional[bool]]:
        """``(enabled, use_reentrant or None when not set)``."""
        if self.is_lf:
            enabled = not as_bool(self.data.get("disable_gradient_checkpointing", False))
            reentrant = self.data.get("use_reentrant_gc", lf.DEFAULTS["use_reentrant_gc"])
            return enabled, as_bool(reentrant)
        enabled = bool(as_bool(self.data.get("gradient_checkpointing")))
        kwargs = _mapping(self.data.get("gradient_checkpointing_kwargs"))
        reentrant = as_bool(kwargs.get("use_reentrant")) if kwargs and "use_reentrant" in kwargs else None
        return enabled, reentrant

    def uses_peft(self) -> bool:
        if self.is_lf:
            return str(self.data.get("finetuning_type", lf.DEFAULTS["finetuning_type"])) in ("lora", "oft")
        return bool(as_bool(self.data.get("use_peft"))) or "peft_config" in self.data or "lora_target_modules" in self.data

    def peft_type(self) -> Optional[str]:
        """The PEFT method the config trains with (``"LORA"``, ``"PREFIX_TUNING"``, ...), None without PEFT.
        LLaMA-Factory: its ``finetuning_type`` (lora/oft); transformers/TRL: ``peft_config.peft_type`` when the
        config carries a PEFT config, else LoRA for TRL's ``use_peft`` / ``lora_target_modules``."""
        if self.is_lf:
            kind = str(self.data.get("finetuning_type", lf.DEFAULTS["finetuning_type"]))
            return kind.upper() if kind in ("lora", "oft") else None
        peft_config = _mapping(self.data.get("peft_config"))
        if peft_config and peft_config.get("peft_type"):
            return str(peft_config["peft_type"]).upper()
        return "LORA" if self.uses_peft() else None

    def reward_hint(self) -> Optional[str]:
        """The setting that marks a transformers/TRL config as training a sequence-classification (reward) model:
        TRL ``RewardConfig``'s own ``center_rewards_coefficient``, TRL ``ModelConfig``'s ``lora_task_type: SEQ_CLS``
        (the reward script's LoRA setting), or a ``peft_config`` with ``task_type: SEQ_CLS``. None otherwise,
        and always for LLaMA-Factory (its ``stage: rm`` trains a value head, not a classification head)."""
        if self.is_lf:
            return None
        if "center_rewards_coefficient" in self.data:
            return "center_rewards_coefficient"
        if str(self.data.get("lora_task_type", "")).upper() == "SEQ_CLS":
            return "lora_task_type"
        peft_config = _mapping(self.data.get("peft_config"))
        if peft_config and str(peft_config.get("task_type", "")).upper() == "SEQ_CLS":
            return "peft_config.task_type"
        return None

    def lora_targets(self) -> Tuple[Any, Optional[str]]:
        if self.is_lf:
            if str(self.data.get("finetuning_type", lf.DEFAULTS["finetuning_type"])) != "lora":
                return None, None
            value = self.data.get("lora_target", lf.DEFAULTS["lora_target"])
            names = split_names(value) or []
            return (["all"] if names == ["all"] else names), "lora_target"
        if "lora_target_modules" in self.data:
            value = self.data["lora_target_modules"]
            return (value if isinstance(value, str) and value == "all-linear" else split_names(value)), "lora_target_modules"
        return None, None

    def modules_to_save(self) -> Tuple[Optional[List[str]], Optional[str]]:
        if self.is_lf:
            return split_names(self.data.get("additional_target")), "additional_target"
        if "lora_modules_to_save" in self.data:
            return split_names(self.data["lora_modules_to_save"]), "lora_modules_to_save"
        return None, None

    def deepspeed(self) -> Any:
        return self.data.get("deepspeed")


def _int(value: Any) -> Optional[int]:
    try:
        return int(float(value))
    except (TypeError, ValueError):
        return None


def hf_training_defaults() -> Dict[str, Any]:
    """Defaults of the installed transformers' TrainingArguments (what Trainer compares DeepSpeed values to)."""
    import dataclasses

    try:
        from transformers import TrainingArguments
    except Exception:
        return {}
    out = {}
    for f in dataclasses.fields(TrainingArguments):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
    return out


def resolve_relative(path: str, base_file: Optional[str]) -> str:
    """A path from inside a config: as given (relative to the working directory), else next to that config."""
    if os.path.isabs(path) or os.path.exists(path) or not base_file:
        return path
    beside = os.path.join(os.path.dirname(os.path.abspath(base_file)), path)
    return beside if os.path.exists(beside) else path
