"""The model's modules, from config.json alone: built on the meta device, no weights, no download.

``with torch.device("meta")`` is the textbook way, but on torch 2.x every
random init (and the rotary ``inv_freq`` arithmetic) on the meta device goes
through the Python reference implementations, whose first use imports
``torch._dynamo``: 3–15 s on a 2-core machine. The skeleton here gets the same
module tree without executing a single meta op: parameters are moved to the
meta device as they are registered (accelerate's ``init_empty_weights``
trick), ``torch.nn.init`` functions and transformers' ``_init_weights`` do
nothing while the model is built, and position-dependent buffers are computed
for a short context (``max_position_embeddings`` is capped for the build only;
the rules read the real value from config.json). Nothing is allocated beyond
one layer's empty tensor at a time.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

SKELETON_POSITIONS = 256
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
LEARNED_POSITION_NAMES = ("wpe", "embed_positions", "position_embeddings", "position_embedding")


class ConfigProblem(ValueError):
    """config.json cannot describe a model for the installed transformers (no model_type, unknown type)."""


@dataclass
class ModuleInfo:
    name: str
    type: str
    lora_ok: bool  # a layer LoRA can wrap
    linear: bool  # Linear / Conv1D (what "all-linear" selects)
    children_linear: List[str] = field(default_factory=list)


@dataclass
class ModelInfo:
    model_type: str
    class_name: str
    modules: Dict[str, ModuleInfo]
    input_embeddings: Optional[str]
    output_embeddings: Optional[str]
    tied: bool
    positions: str  # "learned", "rope" or "other"
    learned_rows: Optional[int]

    def linear_suffixes(self, exclude_output: bool = True) -> List[str]:
        out: List[str] = []
        for info in self.modules.values():
            if info.linear and not (exclude_output and info.name == self.output_embeddings):
                suffix = info.name.rsplit(".", 1)[-1]
                if suffix not in out:
                    out.append(suffix)
        return out


@contextlib.contextmanager
def skeleton():
    """Build modules with parameters on the meta device and no initialisation at all."""
    import torch
    import torch.nn.init as init

    original_register = torch.nn.Module.register_parameter

    def register_parameter(self, name, param):
        original_register(self, name, param)
        if param is not None and param.device.type != "meta":
            current = self._parameters[name]
            self._parameters[name] = torch.nn.Parameter(current.to("meta"), requires_grad=current.requires_grad)

    saved = {}
    for name in dir(init):
        value = getattr(init, name)
        if name.endswith("_") and not name.startswith("_") and callable(value):
            saved[name] = value
            setattr(init, name, lambda tensor, *args, **kwargs: tensor)
    torch.nn.Module.register_parameter = register_parameter
    stack = contextlib.ExitStack()
    try:
        try:
            from transformers import modeling_utils

            no_init = getattr(modeling_utils, "no_init_weights", None)
            if no_init is not None:
                stack.enter_context(no_init())
        except Exception:  # an exotic transformers: the init functions are already no-ops
            pass
        with stack:
            yield
    finally:
        torch.nn.Module.register_parameter = original_register
        for name, value in saved.items():
            setattr(init, name, value)


def build_config(data: Dict[str, Any], shrink: bool):
    """A transformers config object from a config.json dict (raises ValueError with a clear message)."""
    import transformers
    from transformers import AutoConfig

    model_type = data.get("model_type")
    if not model_type:
        raise ConfigProblem("config.json has no `model_type`")
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        known = model_type in CONFIG_MAPPING
    except Exception:
        known = True
    if not known:
        remote = " It declares `auto_map` (custom code): the doctor does not run remote code." if data.get("auto_map") else ""
        raise ConfigProblem(f"transformers {transformers.__version__} does not know model_type {model_type!r}.{remote}")
    fields = {k: v for k, v in data.items() if k not in ("model_type", "transformers_version", "auto_map")}
    if shrink:
        for key in POSITION_KEYS:
            if isinstance(fields.get(key), int) and fields[key] > SKELETON_POSITIONS:
                fields[key] = SKELETON_POSITIONS
        scaling = fields.get("rope_scaling")
        if isinstance(scaling, dict) and isinstance(scaling.get("original_max_position_embeddings"), int):
            scaling = dict(scaling)
            scaling["original_max_position_embeddings"] = min(scaling["original_max_position_embeddings"], SKELETON_POSITIONS)
            fields["rope_scaling"] = scaling
    return AutoConfig.for_model(model_type, **fields)


def build_model(data: Dict[str, Any]):
    """The skeleton model for a config.json dict; raises ValueError (why) when it cannot be built."""
    import warnings

    from transformers import AutoModel, AutoModelForCausalLM

    errors = []
    for shrink in (True, False):
        try:
            config = build_config(data, shrink)
        except ConfigProblem:
            raise
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        for auto in (AutoModelForCausalLM, _seq2seq(), AutoModel):
            if auto is None:
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    with skeleton():
                        model = auto.from_config(config)
                        _tie(model)
                        return model
            except Exception as exc:
                errors.append(f"{auto.__name__}: {type(exc).__name__}: {exc}")
    raise ValueError("the installed transformers cannot build it: " + " | ".join(" ".join(e.split())[:200] for e in errors[-3:]))


def _tie(model) -> None:
    """Tie the embeddings as loading would (some versions skip it while initialisation is off)."""
    try:
        model.tie_weights()
    except Exception:  # then inspect_model falls back to config.tie_word_embeddings
        pass


def _seq2seq():
    try:
        from transformers import AutoModelForSeq2SeqLM

        return AutoModelForSeq2SeqLM
    except ImportError:
        return None


def _lora_types():
    import torch

    types: Tuple[type, ...] = (
        torch.nn.Linear,
        torch.nn.Embedding,
        torch.nn.Conv1d,
        torch.nn.Conv2d,
        torch.nn.Conv3d,
        torch.nn.MultiheadAttention,
    )
    linear: Tuple[type, ...] = (torch.nn.Linear,)
    try:
        from transformers.pytorch_utils import Conv1D

        types += (Conv1D,)
        linear += (Conv1D,)
    except ImportError:
        pass
    return types, linear


def inspect_model(model, data: Dict[str, Any]) -> ModelInfo:
    import torch

    lora_types, linear_types = _lora_types()
    modules: Dict[str, ModuleInfo] = {}
    for name, module in model.named_modules():
        if not name:
            continue
        modules[name] = ModuleInfo(
            name=name,
            type=type(module).__name__,
            lora_ok=isinstance(module, lora_types),
            linear=isinstance(module, linear_types),
        )
    for name, info in modules.items():
        if not info.lora_ok:
            prefix = name + "."
            info.children_linear = sorted(
                {n[len(prefix):] for n, child in modules.items() if n.startswith(prefix) and child.linear and "." not in n[len(prefix):]}
            )
    names = {id(m): n for n, m in model.named_modules()}
    input_emb = output_emb = None
    try:
        input_emb = names.get(id(model.get_input_embeddings()))
    except (NotImplementedError, AttributeError):
        pass
    try:
        out = model.get_output_embeddings()
        output_emb = names.get(id(out)) if out is not None else None
    except (NotImplementedError, AttributeError):
        pass
    tied = False
    if input_emb and output_emb:
        try:
            tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
        except AttributeError:
            tied = False
        if not tied:
            tied = bool(getattr(model.config, "tie_word_embeddings", False)) and bool(getattr(model, "_tied_weights_keys", None))
    positions, rows = "other", None
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in LEARNED_POSITION_NAMES:
            positions = "learned"
            rows = _real_rows(module, data)
            break
    if positions == "other":
        if any("Rotary" in info.type for info in modules.values()) or "rope_theta" in data or data.get("rope_scaling"):
            positions = "rope"
        elif data.get("position_embedding_type") == "rotary" or data.get("rotary_dim") or data.get("rotary_pct"):
            positions = "rope"
    return ModelInfo(
        model_type=str(data.get("model_type")),
        class_name=type(model).__name__,
        modules=modules,
        input_embeddings=input_emb,
        output_embeddings=output_emb,
        tied=tied,
        positions=positions,
        learned_rows=rows,
    )


def _real_rows(module, data: Dict[str, Any]) -> Optional[int]:
    """Usable learned positions, from config.json: the skeleton's table was built short (OPT/BART add an offset
    of rows on top of ``max_position_embeddings``; the usable count is the config value either way)."""
    return max_positions(data)[0]


def max_positions(data: Dict[str, Any]) -> Tuple[Optional[int], Optional[str]]:
    for key in POSITION_KEYS:
        value = data.get(key)
        if isinstance(value, int) and value > 0:
            return value, key
    text = data.get("text_config")
    if isinstance(text, dict):
        return max_positions(text)
    return None, None


# -- PEFT target matching (peft.tuners.tuners_utils.check_target_module_exists) ----------------------------


def match_targets(targets: Any, names: List[str]) -> Dict[str, List[str]]:
    """``{target entry: [matching module names]}``. A string is a regex (``re.fullmatch``), a list holds names
    matched exactly or as a dotted suffix, as PEFT does."""
    if isinstance(targets, str):
        return {targets: [n for n in names if re.fullmatch(targets, n)]}
    out = {}
    for target in targets:
        target = str(target)
        out[target] = [n for n in names if n == target or n.endswith("." + target)]
    return out
