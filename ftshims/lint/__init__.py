"""Setup lint: the files a fine-tuning run actually uses, checked against each other and the installed stack.

    python -m ftshims.doctor --model CONFIG [--adapter ADAPTER_CONFIG] [--tokenizer DIR]
                             [--deepspeed DS_JSON] [--train-config YAML_OR_JSON]

Inputs: a model ``config.json`` (the model is built on the meta device, see
:mod:`.model`: no weights, no download), a PEFT ``adapter_config.json``, a
tokenizer directory (loaded with ``local_files_only=True``), a DeepSpeed JSON
(also found through the training config's ``deepspeed`` key), and a training
config: transformers ``TrainingArguments``/TRL ``SFTConfig`` as JSON, or a
LLaMA-Factory YAML. With no ``--model``, a local ``model_name_or_path`` (the
training config's) or ``base_model_name_or_path`` (the adapter's) that holds a
``config.json`` is used.

Each finding is a dict (see :func:`.findings.finding`): ``rule``, ``severity``
(error / warning / info), ``message``, ``fix``, ``ref``, ``file``, ``key``. The
rules are listed in :data:`.findings.RULES` and docs/doctor-json.md. Nothing
here raises: unreadable or unparsable files and unknown keys are findings, and
a rule that fails is reported as ``lint-rule-failed`` while the others run.
Rules that need the registry's view (is a shim in range, would ``apply()``
install it) read the doctor's shim rows when given, else ask the registry.
"""

from __future__ import annotations

import json
import os
import traceback
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from ..versions import older_than
from . import deepspeed as ds_rules
from . import llamafactory as lf
from . import rules
from .findings import RULES, finding, sort_findings
from .inputs import Loader, TrainView, config_file, flavor, hf_training_defaults, resolve_relative
from .model import ModelInfo, build_model, inspect_model

__all__ = ["Inputs", "run", "RULES"]

VERSION_PACKAGES = ("torch", "transformers", "peft", "trl", "deepspeed", "accelerate", "llamafactory")


@dataclass
class Inputs:
    model: Optional[str] = None
    adapter: Optional[str] = None
    tokenizer: Optional[str] = None
    deepspeed: Optional[str] = None
    train_config: Optional[str] = None


class Context:
    """What the rules read: the parsed inputs, lazily built model/tokenizer facts, versions and shim states."""

    def __init__(self, inputs: Inputs, shim_rows: Optional[List[Dict[str, Any]]] = None):
        from ..versions import installed_versions

        self.inputs = inputs
        self.findings: List[Dict[str, Any]] = []
        self.loader = Loader(self.findings)
        self.versions: Dict[str, Optional[str]] = installed_versions(VERSION_PACKAGES)
        self.shim_rows = {row["id"]: row for row in shim_rows} if shim_rows else None
        self._model_info: Any = ...
        self._tokenizer: Any = ...
        self._peft_fields: Dict[str, Tuple[frozenset, str]] = {}

        self.train: Optional[TrainView] = None
        if inputs.train_config:
            data = self.loader.mapping(inputs.train_config, "training config")
            if data is not None:
                kind = flavor(data)
                self.train = TrainView(data, inputs.train_config, kind, hf_training_defaults())

        self.adapter_path = config_file(inputs.adapter, "adapter_config.json") if inputs.adapter else None
        self.adapter = self.loader.mapping(self.adapter_path, "adapter config") if self.adapter_path else None

        self.model_config_path = self._model_config_path()
        self.model_config = (
            self.loader.mapping(self.model_config_path, "model config") if self.model_config_path else None
        )

        self.ds_path = None
        self.ds: Optional[Dict[str, Any]] = None
        if inputs.deepspeed:
            self.ds_path = inputs.deepspeed
            self.ds = self.loader.mapping(self.ds_path, "DeepSpeed config")
        elif self.train is not None and self.train.deepspeed() is not None:
            value = self.train.deepspeed()
            if isinstance(value, dict):
                self.ds_path, self.ds = f"{self.train.path} (inline `deepspeed`)", value
            elif isinstance(value, str) and value.strip().startswith("{"):
                try:
                    self.ds_path, self.ds = f"{self.train.path} (inline `deepspeed`)", json.loads(value)
                except ValueError as exc:
                    self.loader.invalid(self.train.path, "the `deepspeed` value of training config", "JSON", exc, value)
            elif isinstance(value, str):
                self.ds_path = resolve_relative(value, self.train.path)
                self.ds = self.loader.mapping(
                    self.ds_path, "DeepSpeed config (the training config's `deepspeed`)", referenced=True
                )

        if inputs.tokenizer and not os.path.isdir(inputs.tokenizer):
            self.loader.unreadable(inputs.tokenizer, "no such directory" if not os.path.exists(inputs.tokenizer) else "not a directory", "tokenizer directory")

    def _model_config_path(self) -> Optional[str]:
        if self.inputs.model:
            return config_file(self.inputs.model, "config.json")
        for candidate in (
            self.train.get("model_name_or_path") if self.train is not None else None,
            self.adapter.get("base_model_name_or_path") if self.adapter is not None else None,
        ):
            if isinstance(candidate, str) and os.path.isfile(os.path.join(candidate, "config.json")):
                return os.path.join(candidate, "config.json")
        return None

    # --------------------------------------------------------------------------------------------
    def add(self, item: Dict[str, Any]) -> None:
        if item.get("file") is None:
            item["file"] = self._default_file(item["rule"])
        self.findings.append(item)

    def _default_file(self, rule: str) -> Optional[str]:
        if rule.startswith("ds-"):
            return self.ds_path
        if rule.startswith(("lora-", "adapter-", "modules-")):
            return self.adapter_path or (self.train.path if self.train else None)
        if rule == "model-config-invalid":
            return self.model_config_path
        return None

    def version_lt(self, package: str, bound: str) -> bool:
        return older_than(self.versions.get(package), bound)

    def model_info(self) -> Optional[ModelInfo]:
        """The model's module inventory (built once); None when there is no usable config.json."""
        if self._model_info is not ...:
            return self._model_info
        self._model_info = None
        if self.model_config is None:
            return None
        try:
            model = build_model(self.model_config)
        except ValueError as exc:
            self.add(
                finding(
                    "model-config-invalid",
                    f"{self.model_config_path}: {exc}",
                    "upgrade transformers to a version that knows this model type, or check config.json "
                    "(the model- and adapter-based rules were skipped)",
                    file=self.model_config_path,
                )
            )
            return None
        self._model_info = inspect_model(model, self.model_config)
        return self._model_info

    def tokenizer_info(self) -> Optional[Dict[str, Any]]:
        if self._tokenizer is not ...:
            return self._tokenizer
        self._tokenizer = None
        directory = self.inputs.tokenizer
        if not directory or not os.path.isdir(directory):
            return None
        try:
            import warnings

            from transformers import AutoTokenizer

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tok = AutoTokenizer.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
        except Exception as exc:
            self.add(
                finding(
                    "tokenizer-load-failed",
                    f"AutoTokenizer.from_pretrained({directory!r}) fails with transformers "
                    f"{self.versions.get('transformers')}: {' '.join(f'{type(exc).__name__}: {exc}'.split())[:400]}",
                    "check tokenizer.json / tokenizer_config.json, and install what it needs (sentencepiece, tiktoken)",
                    file=directory,
                )
            )
            return None
        template = getattr(tok, "chat_template", None)
        if not template:
            template = _template_from_files(directory)
        if isinstance(template, dict):  # several named templates
            template = template.get("default") or next(iter(template.values()), None)
        if isinstance(template, list):
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None) or (
                template[0].get("template") if template and isinstance(template[0], dict) else None
            )
        self._tokenizer = {
            "class": type(tok).__name__,
            "pad_token": _text(tok.pad_token),
            "eos_token": _text(tok.eos_token),
            "pad_token_id": tok.pad_token_id,
            "eos_token_id": tok.eos_token_id,
            "chat_template": template if isinstance(template, str) and template.strip() else None,
        }
        return self._tokenizer

    def peft_config_fields(self, peft_type: Any) -> Tuple[frozenset, str]:
        key = str(peft_type or "LORA").upper()
        if key in self._peft_fields:
            return self._peft_fields[key]
        result: Tuple[frozenset, str] = (frozenset(), "")
        if self.versions.get("peft"):
            try:
                import dataclasses
                import importlib

                mapping = None
                for module_name in ("peft.mapping", "peft.utils.peft_types", "peft"):
                    module = importlib.import_module(module_name)
                    mapping = getattr(module, "PEFT_TYPE_TO_CONFIG_MAPPING", None)
                    if mapping:
                        break
                cls = None
                if mapping:
                    for name, value in mapping.items():
                        if str(getattr(name, "value", name)).upper() == key:
                            cls = value
                if cls is None and key == "LORA":
                    from peft import LoraConfig as cls  # noqa: N813
                if cls is not None:
                    names = {f.name for f in dataclasses.fields(cls)}
                    result = (frozenset(names), f"peft.{cls.__name__}")
            except Exception:
                result = (frozenset(), "")
        self._peft_fields[key] = result
        return result

    def peft_has_field(self, peft_type: str, name: str) -> bool:
        return name in self.peft_config_fields(peft_type)[0]

    def peft_default_targets(self, model_type: str) -> Optional[List[str]]:
        try:
            from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as mapping
        except Exception:
            return None
        value = mapping.get(model_type)
        return list(value) if value else None

    def train_known_keys(self) -> Tuple[frozenset, str]:
        import dataclasses

        if self.train is None:
            return frozenset(), ""
        names = set()
        try:
            from transformers import Seq2SeqTrainingArguments

            names |= {f.name for f in dataclasses.fields(Seq2SeqTrainingArguments) if f.init}
        except Exception:
            return frozenset(), ""
        if self.train.is_lf:
            return frozenset(names | lf.ARGUMENTS), f"a LLaMA-Factory {lf.VERSION} argument"
        what = f"a TrainingArguments field of transformers {self.versions.get('transformers')}"
        if set(self.train.data) - names and self.versions.get("trl"):
            try:
                import trl

                for cls_name in ("SFTConfig", "ModelConfig", "ScriptArguments"):
                    cls = getattr(trl, cls_name, None)
                    if cls is not None and dataclasses.is_dataclass(cls):
                        names |= {f.name for f in dataclasses.fields(cls) if f.init}
                what = (
                    f"a TrainingArguments/SFTConfig/ModelConfig field of transformers {self.versions.get('transformers')} "
                    f"/ TRL {self.versions.get('trl')}"
                )
            except Exception:
                pass
        return frozenset(names), what

    def shim_state(self, shim_id: str) -> Dict[str, Any]:
        """``{"id", "registered", "affected", "applies", "why"}`` from the doctor's trial rows, else the registry."""
        from .. import registry

        state = {"id": shim_id, "registered": False, "affected": False, "applies": False, "why": "not registered"}
        if self.shim_rows is not None:
            row = self.shim_rows.get(shim_id)
            if row is None:
                return state
            state.update(registered=True, affected=bool(row.get("affected")))
            state["applies"] = row.get("verdict") in ("patched", "patched on import")
            state["why"] = f"{row.get('status')} ({row.get('reason')})"
            return state
        try:
            registry.get(shim_id)
        except ValueError:
            return state
        from .._manager import selection
        from ..probing import in_affected_range

        affected, reason = in_affected_range(shim_id)
        skip, why = selection(registry.get(shim_id))
        state.update(registered=True, affected=affected, applies=affected and skip is None, why=why or reason or "")
        return state


def _text(token: Any) -> Optional[str]:
    if token is None:
        return None
    return str(getattr(token, "content", token))


def _template_from_files(directory: str) -> Any:
    """A chat template saved beside the tokenizer (chat_template.jinja / .json, or tokenizer_config.json)."""
    jinja = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja):
        try:
            with open(jinja, encoding="utf-8") as handle:
                return handle.read()
        except OSError:
            return None
    for name, key in (("chat_template.json", "chat_template"), ("tokenizer_config.json", "chat_template")):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as handle:
                    value = json.load(handle).get(key)
            except (OSError, ValueError, AttributeError):
                continue
            if value:
                return value
    return None


def _check_deepspeed(ctx: Context) -> None:
    ds_rules.check(ctx.ds, ctx.train, ctx.versions, ctx.add)


def run(inputs: Inputs, shim_rows: Optional[List[Dict[str, Any]]] = None) -> List[Dict[str, Any]]:
    """All findings for these inputs, errors first. Never raises (except KeyboardInterrupt)."""
    ctx = Context(inputs, shim_rows)
    checks = list(rules.CHECKS)
    if ctx.ds is not None:
        checks.append(_check_deepspeed)
    if ctx.model_config is not None:
        checks.append(lambda c: c.model_info())  # builds it (model-config-invalid) even when no rule needs it
    for check in checks:
        try:
            check(ctx)
        except KeyboardInterrupt:
            raise
        except Exception as exc:
            name = getattr(check, "__name__", "check")
            where = traceback.extract_tb(exc.__traceback__)[-1]
            ctx.add(
                finding(
                    "lint-rule-failed",
                    f"lint rule {name} raised {type(exc).__name__}: {exc} (at {os.path.basename(where.filename)}:"
                    f"{where.lineno}; the other rules still ran)",
                    "please report this with the files you passed",
                )
            )
    return sort_findings(ctx.findings)
