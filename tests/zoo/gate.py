"""Model-zoo parity gate: the default ``ftshims.apply()`` must leave every healthy setup bit-identical.

    python tests/zoo/gate.py                       # every listed mapping, 2 worker processes
    python tests/zoo/gate.py --only llama,clip --verbose
    python tests/zoo/gate.py --json /tmp/zoo.json --skips /tmp/zoo-skips.txt

For every architecture of the installed transformers' auto mappings (LISTED
below), a tiny random model is built from its config (``shrink.py`` plus the
``overrides.py`` table) and run on inputs that hit the shims' triggers
(``inputs.py``), forward and backward, in fp32 and bf16 (``.to(bfloat16)`` of
the fp32 model), under eager and sdpa attention: once plain, once after
``ftshims.apply()`` (models built and cast after it), then ``ftshims.revert()``.
Outputs and gradients must be bit-identical (NaN-aware), with no new exception
and no new warning, except the changes declared in ``declared_changes.toml``,
whose direction checks must hold. Exit status 1 on any failure.

See README.md in this folder for the run matrix, the pruning and the JSON keys.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

# (label, candidate attribute names in transformers.models.auto.modeling_auto: the first that exists is used)
LISTED = [
    ("base", ("MODEL_MAPPING_NAMES",)),
    ("causal_lm", ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",)),
    ("seq2seq_lm", ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",)),
    ("masked_lm", ("MODEL_FOR_MASKED_LM_MAPPING_NAMES",)),
    ("seq_cls", ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",)),
    ("image_text_to_text", ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "MODEL_FOR_VISION_2_SEQ_MAPPING_NAMES")),
    ("speech_seq2seq", ("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",)),
    ("image_cls", ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",)),
]
# the class of a model type that gets the full matrix: the first mapping in this order that lists the model type
PRIMARY_ORDER = ["causal_lm", "seq2seq_lm", "image_text_to_text", "speech_seq2seq", "masked_lm", "base", "seq_cls",
                 "image_cls"]
COMPILE_FAMILIES = ("llama", "mistral", "qwen2")
SEED = 0
GROUP_TIMEOUT_S = 60
MAX_PARAMS = 2_500_000  # a tiny model has ~0.1-1M; more means the shrinker missed a dimension
MAX_TRIAL_S = 1.5  # CPU seconds of one fp32 forward of the main batch
MONITOR_LOGGER = "ftshims.monitor"
MONITOR_OPTIONS = {"policy": "warn"}  # every finding recorded, none raised (token_id_out_of_range raises by default)


# ----------------------------------------------------------------------------------------------- enumeration

def enumerate_tasks(only=None):
    """``[(model_type, [(class_name, [mapping labels])...], primary_class)]`` sorted by model type; plus mapping totals."""
    from transformers.models.auto import modeling_auto

    per_type = defaultdict(dict)  # model_type -> class_name -> [labels]
    totals = {}
    mapping_names = {}
    for label, candidates in LISTED:
        name = next((c for c in candidates if hasattr(modeling_auto, c)), None)
        if name is None:
            continue
        mapping_names[label] = name
        mapping = getattr(modeling_auto, name)
        totals[label] = []
        for model_type, cls_name in mapping.items():
            if isinstance(cls_name, (list, tuple)):
                cls_name = cls_name[0]
            totals[label].append(model_type)
            per_type[model_type].setdefault(cls_name, []).append(label)
    tasks = []
    for model_type in sorted(per_type):
        if only and model_type not in only:
            continue
        classes = per_type[model_type]
        order = {label: i for i, label in enumerate(PRIMARY_ORDER)}
        primary = min(classes, key=lambda c: min(order[label] for label in classes[c]))
        ordered = [primary] + [c for c in classes if c != primary]
        tasks.append((model_type, [(c, classes[c]) for c in ordered], primary))
    return tasks, totals, mapping_names


# ----------------------------------------------------------------------------------------------- capture

ADDR = re.compile(r"0x[0-9a-fA-F]+")
SHIM_FILE = re.compile(r"ftshims[/\\]shims[/\\]([a-z0-9_]+)\.py")


def _norm(text: str) -> str:
    return ADDR.sub("0x?", str(text)).strip()[:400]


class _Handler(logging.Handler):
    def __init__(self, sink):
        super().__init__(logging.WARNING)
        self.sink = sink

    def emit(self, record):
        if record.name == MONITOR_LOGGER or record.name.startswith(MONITOR_LOGGER + "."):
            return  # the monitor's findings are collected from its callback (trainer_record), not compared as warnings
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001
            msg = str(record.msg)
        self.sink.append((f"log:{record.name}:{record.levelname}: {_norm(msg)}", record.pathname or ""))


@contextlib.contextmanager
def capture():
    """Collect python warnings and WARNING+ records of the 'transformers' and 'ftshims' loggers: [(text, origin)]."""
    sink = []
    handler = _Handler(sink)
    loggers = [logging.getLogger("transformers"), logging.getLogger("ftshims")]
    for lg in loggers:
        lg.addHandler(handler)
    _clear_once_caches()
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        try:
            yield sink
        finally:
            for lg in loggers:
                lg.removeHandler(handler)
            for w in records:
                sink.append((f"warn:{w.category.__name__}: {_norm(w.message)}", w.filename or ""))


def _clear_once_caches():
    for name in ("warning_once", "info_once"):
        fn = getattr(logging.Logger, name, None)
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()
    warnings.resetwarnings() if False else None


class GroupTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds):
    """Raise GroupTimeout after ``seconds`` of this process's CPU time (ITIMER_PROF, not wall time: on a machine
    shared with other jobs a wall-clock limit skipped models by the load, not by their cost)."""
    if seconds <= 0 or not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(signum, frame):
        raise GroupTimeout(f"time limit of {seconds}s CPU exceeded")

    old = signal.signal(signal.SIGPROF, on_alarm)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, old)


def exc_record(e: BaseException) -> dict:
    text = f"{type(e).__name__}: {_norm(str(e).strip().splitlines()[0] if str(e).strip() else '')}"
    shim = None
    for frame in reversed(traceback.extract_tb(e.__traceback__)):
        m = SHIM_FILE.search(frame.filename or "")
        if m:
            shim = m.group(1)
            break
    where = None
    tb = traceback.extract_tb(e.__traceback__)
    if tb:
        last = tb[-1]
        where = f"{Path(last.filename).name}:{last.lineno}"
    return {"text": text, "shim": shim, "where": where}


# ----------------------------------------------------------------------------------------------- running

def flat_tensors(obj, out=None, depth=0):
    import torch

    if out is None:
        out = []
    if depth > 6:
        return out
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):  # ModelOutput is an OrderedDict of its non-None fields
        for value in obj.values():
            flat_tensors(value, out, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            flat_tensors(value, out, depth + 1)
    return out


def _weights(shape, dtype):
    import torch

    gen = torch.Generator().manual_seed(1234)
    return torch.randn(shape, generator=gen, dtype=torch.float32)


def fresh(kwargs):
    """Copies of the input tensors: some models change their inputs in place (XGLM 4.57: ``position_ids += 2``)."""
    import torch

    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}


def run_step(model, kwargs, backward=True):
    """One forward (+ backward of a weighted sum of the first floating output); outputs, grads, warnings, exception."""
    import torch

    kwargs = fresh(kwargs)
    rec = {"exc": None, "warn": [], "out": None, "grads": None}
    model.zero_grad(set_to_none=True)
    torch.manual_seed(SEED)
    with capture() as sink:
        try:
            out = model(**kwargs)
            tensors = flat_tensors(out)
            rec["out"] = [t.detach().clone() for t in tensors]
            if backward:
                first = next((t for t in tensors if t.is_floating_point() and t.requires_grad), None)
                if first is not None:
                    scalar = (torch.nan_to_num(first.float()) * _weights(first.shape, first.dtype)).sum()
                    scalar.backward()
                rec["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        except GroupTimeout:
            raise
        except Exception as e:  # noqa: BLE001
            rec["exc"] = exc_record(e)
    rec["warn"] = sink
    model.zero_grad(set_to_none=True)
    return rec


def config_for(cls, config):
    """The config the Auto classes hand to ``cls``: the text sub-config when ``cls`` is the text model of a composite
    config (``AutoModelForCausalLM.from_pretrained`` of a Qwen3.5 or Gemma 4 checkpoint builds ``*ForCausalLM`` from
    ``config.get_text_config()``; 4.57 and 5.x alike), the sub-config of the class's own config class for other
    composites (a decoder sub-config), else the config itself."""
    subs = getattr(config, "sub_configs", None) or {}
    wanted = getattr(cls, "config_class", None)
    if not isinstance(subs, dict) or wanted is None or isinstance(config, wanted):
        return config
    if subs.get("text_config") is wanted:
        return config.get_text_config()
    # the decoder of a composite (MusicgenForCausalLM from MusicgenConfig.decoder): the sub-config of its class
    for key, sub_cls in subs.items():
        value = getattr(config, key, None)
        if sub_cls is wanted and isinstance(value, wanted):
            return value
    return config


def build(cls, config, attn):
    import torch

    torch.manual_seed(SEED)
    kwargs = {"attn_implementation": attn} if attn else {}
    model = cls._from_config(copy.deepcopy(config_for(cls, config)), **kwargs)
    model.eval()
    return model


def rotary_modules(model):
    return [(name, mod) for name, mod in model.named_modules() if type(mod).__name__.endswith("RotaryEmbedding")]


def rope_tables(module, dtype, length=64):
    """cos/sin a rotary module hands to attention for positions 0..length-1 (as float64), or None."""
    import torch

    x = torch.zeros((1, 1, length, 2), dtype=dtype)
    pos = torch.arange(length).unsqueeze(0)
    for call in (lambda: module(x, pos), lambda: module(x, position_ids=pos), lambda: module(x, seq_len=length)):
        try:
            with torch.no_grad():
                out = call()
        except Exception:  # noqa: BLE001
            continue
        if isinstance(out, (tuple, list)) and len(out) >= 2 and all(isinstance(t, torch.Tensor) for t in out[:2]):
            cos, sin = out[0], out[1]
            if cos.dim() >= 2 and cos.shape[-2] >= length:
                cos, sin = cos[..., :length, :], sin[..., :length, :]
            return cos.double(), sin.double()
    return None


def inv_freq_buffers(module):
    return {n: b for n, b in module.named_buffers(recurse=False) if n.endswith("inv_freq")}


def rope_reference(model):
    """fp64 references of every rotary module of the (fp32, pristine) model: the cos/sin it hands to
    attention (module copied to float64), and its ``*inv_freq`` buffers (float64 copies)."""
    import torch

    refs = {}
    for name, mod in rotary_modules(model):
        tables = rope_tables(copy.deepcopy(mod).to(torch.float64), torch.float64)
        inv = {n: b.detach().double().clone() for n, b in inv_freq_buffers(mod).items()}
        if tables is not None or inv:  # llama4's forward returns complex freqs: inv_freq only
            refs[name] = {"tables": tables, "inv": inv}
    return refs


def _phase_error(inv, ref, length=64):
    import torch

    pos = torch.arange(length, dtype=torch.float64).unsqueeze(1)
    a, b = pos * inv.double().reshape(1, -1), pos * ref.reshape(1, -1)
    return float(max((a.cos() - b.cos()).abs().max(), (a.sin() - b.sin()).abs().max()))


PHASE_POSITIONS = 4096  # where a bf16 inv_freq's phase error shows (at 64 positions bf16 cos/sin rounding hides it)


def rope_errors(model, refs, dtype):
    """Per rotary module: max error of its cos/sin (first 64 positions) and of its inv_freq phases
    (``PHASE_POSITIONS`` positions) against the fp64 references."""
    errors = {}
    for name, mod in rotary_modules(model):
        ref = refs.get(name)
        if ref is None:
            continue
        errs = []
        bufs = inv_freq_buffers(mod)
        errs += [_phase_error(bufs[n], r, PHASE_POSITIONS) for n, r in ref["inv"].items()
                 if n in bufs and bufs[n].shape == r.shape]
        tables = rope_tables(mod, dtype) if ref["tables"] is not None else None
        if tables is not None and tables[0].shape == ref["tables"][0].shape:
            (cos, sin), (rc, rs) = tables, ref["tables"]
            errs.append(float(max((cos - rc).abs().max(), (sin - rs).abs().max())))
        if errs:
            errors[name] = max(errs)
    return errors


def packed_gap(model, rec, parts, dtype):
    """Max |logits of each packed example - logits of the example run alone|."""
    import torch

    import inputs as zin

    if rec["exc"] or not rec["out"]:
        return None
    packed = rec["out"][0]
    gaps = []
    start = 0
    for part in parts:
        n = part["input_ids"].shape[1]
        with torch.no_grad(), capture():
            alone = flat_tensors(model(**fresh(zin.cast(part, dtype))))[0]
        seg = packed[:, start:start + n]
        if seg.shape != alone.shape:
            return None
        gaps.append(float((seg.float() - alone.float()).abs().max()))
        start += n
    return max(gaps)


@contextlib.contextmanager
def gelu_gap(model):
    """Yields a dict that gets ``"gelu_gap"``: the max |output - the same MLP with tanh GELU| over the model's
    ``GemmaMLP`` modules in the forward run inside the block (transformers 5.18's MLP for hidden_act "gelu"),
    for the ``gelu_tanh_gap_closed`` check. Nothing is measured in models without a GemmaMLP."""
    import torch

    seen = {}

    def hook(module, args, output):
        with torch.no_grad():
            x = args[0]
            ref = module.down_proj(torch.nn.functional.gelu(module.gate_proj(x), approximate="tanh") * module.up_proj(x))
            gap = float((output.detach().float() - ref.float()).abs().max())
        seen["gelu_gap"] = max(seen.get("gelu_gap", 0.0), gap)

    handles = [m.register_forward_hook(hook) for m in model.modules() if type(m).__name__ == "GemmaMLP"]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def run_group(task, cls, config, attn, inputs, plan, compile_backend=None, monitor=False):
    """Build ``cls`` with ``attn``; run the plan's steps. Returns {step_key: record}. ``monitor``: the Trainer
    steps run with ``ftshims.monitor.callback()`` attached (their records get ``"monitor"``)."""
    import torch

    import inputs as zin
    import trainer_step as zts

    recs = {}
    with capture() as sink:
        try:
            model = build(cls, config, attn)
            exc = None
        except GroupTimeout:
            raise
        except Exception as e:  # noqa: BLE001
            model, exc = None, exc_record(e)
    recs[f"{attn}|build"] = {"exc": exc, "warn": sink, "out": None, "grads": None}
    if model is None:
        return recs
    need_bf16 = any(d == "bf16" for d, _ in plan["steps"])
    pristine = copy.deepcopy(model) if need_bf16 else None
    want_trainer = "trainer" in inputs and attn == plan.get("trainer_attn") and any(
        inp in zts.STEPS for _, inp in plan["steps"])
    # the Trainer steps get the model as built: a rerun of them alone (attributing a difference) must start from
    # the same state, and some models change themselves in their first forward (big_bird drops block-sparse
    # attention on short inputs)
    untouched = copy.deepcopy(model) if want_trainer else None
    want_rope = plan.get("rope_probe") and need_bf16
    refs = rope_reference(model) if want_rope else {}
    for dtype_name, inp in plan["steps"]:
        if dtype_name != "fp32" or inp not in inputs or inp in zts.STEPS:
            continue
        with gelu_gap(model) as gelu:
            rec = run_step(model, inputs[inp])
        if inp == "packed" and "packed_parts" in inputs:
            rec["probe"] = {"packed_gap": packed_gap(model, rec, inputs["packed_parts"], torch.float32)}
        if gelu:
            rec.setdefault("probe", {}).update(gelu)
        recs[f"{attn}|fp32|{inp}"] = rec
    if compile_backend and plan.get("compile") and attn == plan.get("compile_attn", attn):
        recs[f"{attn}|fp32|compile"] = compile_step(model, inputs["main"], compile_backend)
    if want_trainer:
        del model
        model = untouched
        for dtype_name, inp in plan["steps"]:
            if inp in zts.STEPS:
                ga2 = recs.get(f"{attn}|fp32|trainer_ga2")
                if inp == "trainer_lossfn" and ga2 is not None and ga2["exc"]:
                    continue  # the class refuses these micro-batches with its own loss: not a Trainer it trains
                with gelu_gap(model) as gelu:
                    rec = trainer_record(model, inputs["trainer"], inp, plan["trainer_kind"], monitor)
                rec["probe"].update(gelu)
                recs[f"{attn}|fp32|{inp}"] = rec
    del model
    if need_bf16:
        with capture() as sink:
            try:
                m16 = pristine.to(torch.bfloat16)
                exc = None
            except GroupTimeout:
                raise
            except Exception as e:  # noqa: BLE001
                m16, exc = None, exc_record(e)
        recs[f"{attn}|bf16|cast"] = {"exc": exc, "warn": sink, "out": None, "grads": None}
        if m16 is not None:
            for dtype_name, inp in plan["steps"]:
                if dtype_name != "bf16" or inp not in inputs:
                    continue
                with gelu_gap(m16) as gelu:
                    rec = run_step(m16, zin.cast(inputs[inp], torch.bfloat16))
                probe = dict(gelu)
                if refs:
                    probe["rope_err"] = rope_errors(m16, refs, torch.bfloat16)
                if inp == "packed" and "packed_parts" in inputs:
                    probe["packed_gap"] = packed_gap(m16, rec, inputs["packed_parts"], torch.bfloat16)
                if probe:
                    rec["probe"] = probe
                recs[f"{attn}|bf16|{inp}"] = rec
    return recs


def trainer_record(model, batches, step, kind, monitor=False):
    """One Trainer step (``trainer_step.py``) as a step record: outputs are the step losses and
    ``num_items_in_batch`` (-1: not counted), grads the accumulated gradients. ``monitor``: with
    ``ftshims.monitor.callback()`` watching it; ``rec["monitor"]`` then holds its findings (code, severity,
    message, explains) and the step's CPU seconds (the callback only observes: the record is compared as usual)."""
    import torch

    import trainer_step as zts

    rec = {"exc": None, "warn": [], "out": None, "grads": None,
           "probe": {"num_items": None, "step": step, **zts.label_counts(batches)}}
    model.zero_grad(set_to_none=True)
    watcher = None
    t0 = time.process_time()
    with capture() as sink:
        try:
            if monitor:
                import ftshims.monitor

                watcher = ftshims.monitor.callback(**MONITOR_OPTIONS)
            losses, num, grads = zts.run(model, [fresh(b) for b in batches], step, kind, SEED, watcher)
            rec["out"] = losses + [torch.tensor([-1.0 if num is None else float(num)])]
            rec["grads"] = grads
            rec["probe"]["num_items"] = num
        except GroupTimeout:
            raise
        except Exception as e:  # noqa: BLE001
            rec["exc"] = exc_record(e)
    rec["warn"] = sink
    if monitor:
        rec["monitor"] = {"t_cpu": time.process_time() - t0, "ran": watcher is not None and rec["exc"] is None,
                          "findings": [{"code": f.code, "severity": f.severity, "message": f.message,
                                        "explains": list(f.explains), "modules": sorted((f.detail or {}).get("modules") or [])}
                                       for f in (watcher.findings if watcher else [])]}
    elif rec["exc"] is None:
        rec["t_cpu"] = time.process_time() - t0
    model.zero_grad(set_to_none=True)
    model.eval()
    return rec


def compile_step(model, kwargs, backend):
    import torch

    rec = {"exc": None, "warn": [], "out": None, "grads": None}
    torch._dynamo.reset()
    torch.manual_seed(SEED)
    with capture() as sink:
        try:
            compiled = torch.compile(model, fullgraph=True, backend=backend)
            with torch.no_grad():
                rec["out"] = [t.detach().clone() for t in flat_tensors(compiled(**fresh(kwargs)))]
        except GroupTimeout:
            raise
        except Exception as e:  # noqa: BLE001
            rec["exc"] = exc_record(e)
    rec["warn"] = sink
    torch._dynamo.reset()
    return rec


# ----------------------------------------------------------------------------------------------- comparison

def _equal(a, b):
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False, f"shape/dtype {tuple(a.shape)}/{a.dtype} vs {tuple(b.shape)}/{b.dtype}"
    if torch.equal(a, b):
        return True, None
    if a.is_floating_point() or a.is_complex():
        na, nb = torch.isnan(a), torch.isnan(b)
        if torch.equal(na, nb) and torch.equal(a[~na], b[~nb]):
            return True, None
        if not torch.equal(na, nb):
            return False, f"NaN pattern differs ({int(na.sum())} vs {int(nb.sum())} NaN)"
        diff = (a[~na].double() - b[~nb].double()).abs()
        return False, f"max abs diff {float(diff.max()):.3g}"
    return False, "values differ"


def compare(p, s):
    """The differences of a shimmed record ``s`` against the plain one ``p``: [{kind, detail}]."""
    diffs = []
    pe, se = (p.get("exc") or {}).get("text"), (s.get("exc") or {}).get("text")
    if pe != se:
        diffs.append({"kind": "exception", "detail": f"plain: {pe or 'ok'} | shimmed: {se or 'ok'}",
                      "shim_hint": (s.get("exc") or {}).get("shim"), "where": (s.get("exc") or {}).get("where")})
    plain_warn = {w for w, _ in p.get("warn", [])}
    for text, origin in s.get("warn", []):
        if text not in plain_warn:
            m = SHIM_FILE.search(origin or "")
            diffs.append({"kind": "warning", "detail": text, "shim_hint": m.group(1) if m else None})
            plain_warn.add(text)
    if pe is None and se is None:
        for kind in ("out", "grads"):
            a, b = p.get(kind), s.get(kind)
            if a is None and b is None:
                continue
            if (a is None) != (b is None):
                diffs.append({"kind": kind, "detail": "present in one run only"})
                continue
            if kind == "out":
                if len(a) != len(b):
                    diffs.append({"kind": "out", "detail": f"{len(a)} vs {len(b)} output tensors"})
                    continue
                for i, (x, y) in enumerate(zip(a, b)):
                    same, why = _equal(x, y)
                    if not same:
                        diffs.append({"kind": "out", "detail": f"output[{i}] {why}"})
                        break
            else:
                if set(a) != set(b):
                    missing = sorted(set(a) ^ set(b))[:3]
                    diffs.append({"kind": "grads", "detail": f"grad presence differs: {missing}"})
                    continue
                bad = []
                for name in a:
                    same, why = _equal(a[name], b[name])
                    if not same:
                        bad.append((name, why))
                if bad:
                    diffs.append({"kind": "grads", "detail": f"{len(bad)}/{len(a)} grads differ, e.g. {bad[0][0]}: {bad[0][1]}"})
    return diffs


def strip(rec):
    """A record without tensors, for JSON."""
    return {k: v for k, v in rec.items() if k not in ("out", "grads")}


# ----------------------------------------------------------------------------------------------- tasks

class Skip(Exception):
    pass


def classify_skip(text: str) -> str:
    low = text.lower()
    for lib in ("timm", "scipy", "detectron2", "pytesseract", "torchvision", "librosa", "natten", "essentia",
                "pretty_midi", "sentencepiece", "tokenizers", "protobuf", "einops", "mamba_ssm", "causal_conv1d",
                "av", "decord", "phonemizer", "g2p_en", "soundfile", "torchaudio", "bs4", "ftfy", "rjieba", "jieba",
                "num2words", "levenshtein", "kenlm", "pyctcdecode", "flash_attn", "spacy", "fairscale", "xformers"):
        if f"requires the {lib} library" in low or f"no module named '{lib}" in low or f"`{lib}`" in low and "install" in low:
            return f"needs {lib}"
    if "cuda" in low and ("kernel" in low or "not available" in low or "requires" in low):
        return "CUDA-only kernel: " + text[:160]
    return text[:200]


class TaskRunner:
    def __init__(self, args, declared):
        import torch
        import transformers

        import overrides

        self.args = args
        self.torch = torch
        self.transformers = transformers
        self.overrides = overrides
        self.declared = declared

    # --- plain phase: config, classes, inputs, records
    def prepare(self, task):
        import inputs as zin
        from transformers import AutoConfig

        import shrink

        model_type, classes, primary = task
        st = {"model_type": model_type, "classes": {}, "skip": None, "t0": time.time()}
        reason = self.overrides.SKIP.get(model_type)
        if reason:
            st["skip"] = reason
            return st
        try:
            with capture():
                base = AutoConfig.for_model(model_type)
                config = shrink.shrink_config(base, self.overrides.config_overrides(model_type, base))
                self.overrides.post_shrink(model_type, config)
        except Exception as e:  # noqa: BLE001
            st["skip"] = "config: " + classify_skip(exc_record(e)["text"])
            return st
        st["config"] = config
        for cls_name, labels in classes:
            c = {"labels": labels, "primary": cls_name == primary, "status": "pending", "reason": None, "notes": [],
                 "plain": {}, "groups": []}
            st["classes"][cls_name] = c
            try:
                cls = getattr(self.transformers, cls_name)
            except Exception as e:  # noqa: BLE001
                c["status"], c["reason"] = "skipped", "import: " + classify_skip(exc_record(e)["text"])
                continue
            c["cls"] = cls
            decoder_lm = "causal_lm" in labels
            attns = ["eager", "sdpa"] if c["primary"] else ["sdpa"]
            plan_steps = [("fp32", "main"), ("bf16", "main")]
            if decoder_lm and c["primary"]:
                plan_steps += [("fp32", "packed"), ("bf16", "packed")]
            plan = {"steps": plan_steps, "rope_probe": True,
                    "compile": c["primary"] and model_type in COMPILE_FAMILIES and not self.args.no_compile}
            c["plan"] = plan
            try:
                with time_limit(self.args.group_timeout):
                    self._plain_class(st, c, cls, config, attns, decoder_lm)
            except GroupTimeout as e:
                c["status"], c["reason"] = "skipped", f"timeout: {e}"
            except zin.InputError as e:
                c["status"], c["reason"] = "skipped", f"inputs: {e}"
            except Exception as e:  # noqa: BLE001
                c["status"], c["reason"] = "skipped", "gate error: " + exc_record(e)["text"]
        return st

    def _plain_class(self, st, c, cls, config, attns, decoder_lm):
        import inputs as zin
        import trainer_step as zts

        # inputs come from an eager build (plain); sdpa where the class supports it
        try:
            probe_model = build(cls, config, "eager")
        except Exception as e:  # noqa: BLE001
            try:
                probe_model = build(cls, config, None)
                attns = [None]
                c["notes"].append("eager not selectable: " + exc_record(e)["text"][:120])
            except Exception as e2:  # noqa: BLE001
                c["status"], c["reason"] = "skipped", "build: " + classify_skip(exc_record(e2)["text"])
                return
        n_params = sum(p.numel() for p in probe_model.parameters())
        if n_params > MAX_PARAMS:
            biggest = max(probe_model.named_parameters(), key=lambda kv: kv[1].numel())[0]
            c["status"], c["reason"] = "skipped", (f"too large after shrinking: {n_params / 1e6:.1f}M parameters "
                                                   f"(largest {biggest}); needs an override")
            return
        ins = zin.make_inputs(probe_model, config_for(cls, config), decoder_lm=decoder_lm, seed=SEED)
        main = ins["main"]
        image_token = main.get("__image_token__")
        if "__image_token__" in main:
            n = zin.count_image_tokens(probe_model, main)
            if n is None:
                trial = dict(main)
                trial.pop("__image_token__")
                rec = run_step(probe_model, trial, backward=False)
                n = zin.tokens_from_error((rec["exc"] or {}).get("text", "")) if rec["exc"] else None
            if n is None:
                # models that expand one placeholder per image themselves (llava & co. before 4.47 merged the
                # image features into the text at the position of a single <image> token)
                one = zin.place_image_tokens({**main, "input_ids": main["input_ids"].clone()}, 1,
                                             zin.forward_params(probe_model), config_for(cls, config))
                main["__image_token__"] = image_token
                if any(not run_step(probe_model, batch, backward=False)["exc"]
                       for batch in [one] + [b for _, b in zin.fallbacks(one)]):
                    n = 1
            if n is None:
                raise zin.InputError("could not tell how many image tokens the model wants")
            zin.place_image_tokens(main, n, zin.forward_params(probe_model), config_for(cls, config))
        # a trial forward; when the batch itself is refused, fall back to simpler batches (noted)
        t_trial = time.process_time()  # CPU time: the load of other jobs does not count
        trial = run_step(probe_model, main, backward=False)
        t_trial = time.process_time() - t_trial
        if t_trial > MAX_TRIAL_S:
            c["status"], c["reason"] = "skipped", f"too slow: one forward takes {t_trial:.1f}s CPU (> {MAX_TRIAL_S}s)"
            return
        if trial["exc"]:
            for label, variant in zin.fallbacks(main):
                again = run_step(probe_model, variant, backward=False)
                if not again["exc"]:
                    c["notes"].append(f"main batch refused ({trial['exc']['text'][:100]}); using {label}")
                    ins["main"] = main = variant
                    break
        c["inputs"] = ins
        c["has_rope"] = bool(rotary_modules(probe_model))
        kind = None if self.args.no_trainer else zts.batch_kind(c["labels"], zin.forward_params(probe_model))
        if kind:  # the Trainer steps (trainer_step.py) on rows 0-1 of the batch the class accepted
            ins["trainer"] = zts.micro_batches(main, kind, config_for(cls, config), image_token, SEED)
            c["plan"]["steps"] += [("fp32", step) for step in zts.STEPS
                                   if step != "trainer_lossfn" or zts.supports_loss_func()]
            c["plan"]["trainer_kind"] = kind
        del probe_model
        groups = []
        for attn in attns:
            if attn == "sdpa" and not getattr(cls, "_supports_sdpa", False):
                c["notes"].append("sdpa skipped: class does not support it (_supports_sdpa is False)")
                continue
            groups.append(attn)
        if not groups:
            groups = ["eager"]
        c["groups"] = groups
        c["plan"]["compile_attn"] = "sdpa" if "sdpa" in groups else groups[0]
        c["plan"]["trainer_attn"] = groups[0]  # one group is enough: the Trainer's shims do not see the attention
        for attn in groups:
            recs = run_group(st["model_type"], cls, config, attn, ins, c["plan"], self.args.compile_backend)
            build_rec = recs.get(f"{attn}|build")
            if build_rec and build_rec["exc"] and attn == "sdpa":
                c["notes"].append("sdpa skipped: " + build_rec["exc"]["text"][:160])
                c["groups"] = [g for g in c["groups"] if g != "sdpa"]
                continue
            c["plain"].update(recs)
        ok = [k for k, r in c["plain"].items() if k.endswith("|fp32|main") and not r["exc"]]
        if ok:
            c["status"] = "run"
        else:
            first = next((r["exc"]["text"] for k, r in c["plain"].items() if r.get("exc")), "no step ran")
            c["status"], c["reason"] = "skipped", "plain run fails: " + classify_skip(first)

    # --- shimmed phase and the follow-ups
    def rerun(self, st, cls_name, keys=None, monitor=False):
        """Run the class's groups again (fresh builds) in whatever shim state is current; only ``keys`` if given;
        ``monitor``: the Trainer steps with the monitor attached (the shimmed phase)."""
        c = st["classes"][cls_name]
        out = {}
        for attn in c["groups"]:
            plan = c["plan"]
            if keys is not None:
                wanted = {k for k in keys if k.split("|")[0] == str(attn)}
                if not wanted:
                    continue
                steps = [(d, i) for d, i in plan["steps"] if f"{attn}|{d}|{i}" in wanted]
                if f"{attn}|bf16|cast" in wanted and not any(d == "bf16" for d, _ in steps):
                    steps.append(("bf16", "main"))
                plan = dict(plan, steps=steps, compile=plan.get("compile") and f"{attn}|fp32|compile" in wanted)
            try:
                with time_limit(self.args.group_timeout):
                    out.update(run_group(st["model_type"], c["cls"], st["config"], attn, c["inputs"], plan,
                                         self.args.compile_backend, monitor))
            except GroupTimeout as e:
                out[f"{attn}|timeout"] = {"exc": {"text": f"GroupTimeout: {e}", "shim": None}, "warn": []}
        return out


    def loss_probe(self, st, cls_name):
        """``trainer_step.loss_probe`` on a fresh plain build of the class (its values None when it fails)."""
        import trainer_step as zts

        c = st["classes"][cls_name]
        try:
            with time_limit(self.args.group_timeout), capture():
                model = build(c["cls"], st["config"], c["groups"][0])
                return zts.loss_probe(model, fresh(c["inputs"]["trainer"][0]))
        except Exception:  # noqa: BLE001 - the check then reports that it could not compare
            return {"first_label_scored": None, "uses_num_items": None}


def group_key(step_key):
    return step_key.split("|")[0]


# ----------------------------------------------------------------------------------------------- declared changes

def load_declared(path):
    import tomllib

    if not Path(path).exists():
        return []
    data = tomllib.loads(Path(path).read_text())
    return data.get("change", [])


def load_declared_findings(path):
    """The ``[[monitor_finding]]`` entries of ``declared_changes.toml``: monitor findings allowed on healthy classes,
    each with a ``reason``; a malformed entry is a ValueError (the gate must not pass on a typo)."""
    import tomllib

    if not Path(path).exists():
        return []
    entries = tomllib.loads(Path(path).read_text()).get("monitor_finding", [])
    for entry in entries:
        missing = [k for k in ("id", "code", "arch", "kind", "reason") if not entry.get(k)]
        unknown = set(entry) - {"id", "code", "arch", "classes", "steps", "modules", "match", "kind", "reason"}
        if missing or unknown or entry.get("kind") not in FINDING_KINDS:
            raise ValueError(f"{path}: [[monitor_finding]] {entry.get('id', entry)}: missing {missing or '-'}, "
                             f"unknown keys {sorted(unknown) or '-'}, kind must be one of {FINDING_KINDS}")
        for key in ("modules", "match"):
            if key in entry:
                re.compile(entry[key])
    return entries


FINDING_KINDS = ("model", "monitor-false-positive")


def declared_finding(entries, model_type, cls_name, step, finding):
    """The ``[[monitor_finding]]`` entry that allows ``finding`` on this class and Trainer step, or None: same code,
    the model type in ``arch``, the class in ``classes`` and the step in ``steps`` (when given), ``match`` (a regex)
    found in the message, and every module the finding names (``trainable_without_grad``) matching ``modules``."""
    for entry in entries:
        arch = entry["arch"]
        if entry["code"] != finding["code"] or (arch != "*" and model_type not in (arch if isinstance(arch, list) else [arch])):
            continue
        if entry.get("classes") and cls_name not in entry["classes"]:
            continue
        if entry.get("steps") and step not in entry["steps"]:
            continue
        if entry.get("match") and not re.search(entry["match"], finding["message"]):
            continue
        if entry.get("modules") and not (finding.get("modules") and all(
                re.search(entry["modules"], module) for module in finding["modules"])):
            continue
        return entry
    return None


def monitor_summary(args, results):
    """The monitor's findings on the shimmed Trainer steps: printed, and the undeclared ones as failures."""
    declared = load_declared_findings(args.declared)
    steps_ran, classes_ran, findings, raised, cpu = 0, 0, [], [], 0.0
    for r in results:
        for cls_name, c in r["classes"].items():
            watched = c.get("monitor") or {}
            ran = [s for s, m in watched.items() if m.get("ran")]
            steps_ran += len(ran)
            classes_ran += bool(ran)
            cpu += sum(m.get("t_cpu", 0.0) for m in watched.values()) + sum((c.get("trainer_cpu") or {}).values())
            for step, m in sorted(watched.items()):
                for f in m.get("findings", []):
                    item = {"model_type": r["model_type"], "class": cls_name, "step": step, **f}
                    if not m.get("ran"):
                        # the step raised (as in the plain run: the class's Trainer path is not tested); the monitor
                        # judged an unfinished step at on_train_end: listed, not judged
                        raised.append(item)
                        continue
                    entry = declared_finding(declared, r["model_type"], cls_name, step, f)
                    item["declared"] = entry.get("id") if entry else None
                    item["declared_kind"] = entry.get("kind") if entry else None
                    findings.append(item)
    undeclared = [f for f in findings if not f["declared"]]
    canaries = [(f"{r['model_type']}:{cn}", c["monitor_canary"]) for r in results for cn, c in r["classes"].items()
                if c.get("monitor_canary")]
    blind = [(where, can) for where, can in canaries if CANARY_CODE not in can["codes"]]
    by_code = defaultdict(set)
    for f in findings:
        by_code[f["code"]].add(f"{f['model_type']}:{f['class']}")
    if args.no_monitor:
        print(f"\nzoo gate: monitor not attached (--no-monitor); shimmed Trainer steps {cpu:.1f}s CPU")
    else:
        kinds = ", ".join(f"{sum(f['declared_kind'] == k for f in findings)} declared {k}" for k in FINDING_KINDS)
        n_classes = len({(f["model_type"], f["class"]) for f in findings})
        print(f"\nzoo gate: monitor attached to {steps_ran} Trainer steps of {classes_ran} classes: {len(findings)} "
              f"finding{'s' if len(findings) != 1 else ''} on {n_classes} classes ({kinds}, {len(undeclared)} "
              f"undeclared); shimmed Trainer steps {cpu:.1f}s CPU")
    for code, where in sorted(by_code.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        shown = sorted(where)
        print(f"  {code}: {len(shown)} classes: {', '.join(shown[:8])}{' ...' if len(shown) > 8 else ''}")
    per_class = defaultdict(list)  # one line per class and code (both Trainer steps usually say the same)
    for f in findings:
        per_class[(not f["declared"], f["declared"] or "", f["model_type"], f["class"], f["code"])].append(f)
    for (bad, entry, mt, cls_name, code), items in sorted(per_class.items(), key=lambda kv: (not kv[0][0], kv[0][1:])):
        tag = "UNDECLARED" if bad else f"declared {items[0]['declared_kind']}: {entry}"
        print(f"  [{tag}] {mt} {cls_name} {'+'.join(f['step'] for f in items)}: [{code}] "
              f"{items[0]['message'][:400 if bad else 220]}")
    for f in raised:
        print(f"  [step raised, not judged] {f['model_type']} {f['class']} {f['step']}: [{f['code']}] {f['message'][:200]}")
    if not args.no_monitor:
        if not canaries:
            print("  canary: not run (no decoder class ran its Trainer steps)")
        for where, can in canaries:
            seen = ", ".join(can["codes"]) or "nothing"
            verdict = "ok" if CANARY_CODE in can["codes"] else f"MONITOR BLIND: {CANARY_CODE} expected"
            print(f"  canary ({where}, trainer_ga2 with a micro-batch of -100 labels): {seen}: {verdict}"
                  + (f" ({can['exc'][:160]})" if can.get("exc") else ""))
    return {"attached": not args.no_monitor, "steps": steps_ran, "classes": classes_ran, "cpu_s": round(cpu, 2),
            "by_code": {code: sorted(where) for code, where in by_code.items()}, "findings": findings,
            "on_raised_steps": raised,
            "undeclared": len(undeclared), "canaries": dict(canaries), "blind": len(blind)}


def step_trigger(step_key):
    parts = step_key.split("|")
    attn, dtype, inp = (parts + ["", "", ""])[:3]
    triggers = set()
    if dtype == "bf16":
        triggers.add("bf16_cast")
    if inp == "packed":
        triggers.add("packed")
    if inp == "main":
        triggers.update({"left_pad", "long", "main"})
    if inp == "compile":
        triggers.add("compile")
    if inp.startswith("trainer"):
        triggers.add("trainer")
    return triggers


def predicate_holds(pred, st, cls_name):
    if not pred:
        return True
    c = st["classes"][cls_name]
    if pred == "decoder-lm":
        return "causal_lm" in c["labels"]
    if pred == "rope":
        return bool(c.get("has_rope"))
    if pred == "hidden-act-gelu":  # the config, or its text sub-config, says hidden_act "gelu" (exact GELU)
        config = st.get("config")
        return any(getattr(cfg, "hidden_act", None) == "gelu" for cfg in (config, getattr(config, "text_config", None)))
    return False


def matching_declarations(declared, st, cls_name, step_key, kinds):
    found = []
    for entry in declared:
        arch = entry.get("arch", "*")
        if arch != "*" and st["model_type"] not in (arch if isinstance(arch, list) else [arch]):
            continue
        if not predicate_holds(entry.get("predicate"), st, cls_name):
            continue
        if entry.get("trigger") not in step_trigger(step_key):
            continue
        allowed = set(entry.get("differs", ["out", "grads"]))
        if not set(kinds) <= allowed:
            continue
        found.append(entry)
    return found


def run_check(name, plain_rec, shim_rec):
    """A declared change's direction check: ("better" | "same" | "worse", detail).

    "same": the metric did not move: the declared shim did not act on this step (another declared shim did).
    """
    import torch

    pp, sp = plain_rec.get("probe") or {}, shim_rec.get("probe") or {}
    if name == "rope_error_down":
        pe, se = pp.get("rope_err") or {}, sp.get("rope_err") or {}
        if not pe or not se:
            return "worse", "no rotary module could be probed"
        # Per rotary module: a multimodal model may hold one the shim repairs (the text tower's) and
        # one it leaves alone (a 2D vision RoPE): the change holds when one got better and none worse.
        worse = [n for n in pe if n in se and se[n] > pe[n]]
        better = [n for n in pe if n in se and se[n] < pe[n]]
        shown = better[0] if better else max(pe, key=pe.get)
        detail = f"cos/sin error vs fp64 reference of {shown}: plain {pe[shown]:.3g}, shimmed {se.get(shown, float('nan')):.3g}"
        if worse:
            return "worse", detail + f" (worse on {worse[0]})"
        return ("better" if better else "same"), detail
    if name == "gelu_tanh_gap_closed":
        pg, sg = pp.get("gelu_gap"), sp.get("gelu_gap")
        if pg is None or sg is None:
            return "worse", "no GemmaMLP measured"
        detail = f"max |GemmaMLP - tanh-GELU MLP (transformers 5.18's)|: plain {pg:.3g}, shimmed {sg:.3g}"
        return ("better" if sg == 0 < pg else "same" if sg == pg else "worse"), detail
    if name == "packed_gap_down":
        pg, sg = pp.get("packed_gap"), sp.get("packed_gap")
        if pg is None or sg is None:
            return "worse", "packed gap not measured"
        detail = f"packed-vs-alone logits gap: plain {pg:.3g}, shimmed {sg:.3g}"
        return ("better" if sg < pg else "same" if sg == pg else "worse"), detail
    if name == "num_items_scored":
        # The count must become the number of labels the model's own loss scores: all of them when its loss
        # scores position 0 (measured: trainer_step.first_label_scored), else those after position 0.
        pn, sn, first = pp.get("num_items"), sp.get("num_items"), pp.get("first_label_scored")
        if pn == sn:
            return "same", f"num_items_in_batch: {pn} in both runs"  # the shim did not act on this step
        if pn is None or sn is None or first is None:
            return "worse", f"num_items_in_batch not comparable (plain {pn}, shimmed {sn}, position 0 scored: {first})"
        scored = pp["labels_all"] if first else pp["labels_shifted"]
        detail = (f"num_items_in_batch: plain {pn}, shimmed {sn}; the model's loss scores {scored} of "
                  f"{pp['labels_all']} labels (position 0 {'scored' if first else 'never scored'})")
        return ("better" if sn == scored != pn else "same" if sn == pn else "worse"), detail
    if name == "ga_loss_divided":
        # A model whose loss ignores num_items_in_batch (measured: trainer_step.loss_probe) must have each
        # micro-batch loss divided by the accumulation steps: shimmed losses and gradients half the plain ones
        # (exactly when no other shim changed the step; halving is exact in floating point), the count itself
        # unchanged. Unchanged scales (ratio 1): the shim did not act here (another declared shim did).
        uses = pp.get("uses_num_items")
        p_out, s_out = plain_rec.get("out") or [], shim_rec.get("out") or []
        grads, shim_grads = plain_rec.get("grads") or {}, shim_rec.get("grads") or {}
        # the shimmed run may have gradients the plain run lacks (grads_gained: another declared shim); the scale is
        # judged on the parameters both have
        if len(p_out) != len(s_out) or not p_out or not set(grads) <= set(shim_grads):
            return "worse", "steps not comparable"
        losses = list(zip(s_out[:-1], p_out[:-1]))  # the last output is the count: num_items_scored's business
        detail = (f"step losses: plain {[round(float(p), 5) for _, p in losses]}, shimmed "
                  f"{[round(float(s), 5) for s, _ in losses]}; the model's loss "
                  f"{ {True: 'uses', False: 'ignores', None: 'refuses'}[uses]} num_items_in_batch")
        if uses or pp.get("step") == "trainer_lossfn":
            # the shim stays out of losses that read the count and of compute_loss_func runs
            return "same", detail
        if all(bool((s * 2 == p).all()) for s, p in losses) and all(
                bool((shim_grads[n] * 2 == g).all()) for n, g in grads.items()):
            return ("better" if uses is False else "worse"), detail + "; losses and gradients exactly halved"
        norm = sum(float(g.double().abs().sum()) for g in grads.values())
        shim_norm = sum(float(g.double().abs().sum()) for g in shim_grads.values())
        ratios = [float(s) / float(p) for s, p in losses if float(p)] + ([shim_norm / norm] if norm else [])
        detail += f"; scale ratios {[round(r, 4) for r in ratios]}"
        if ratios and all(abs(r - 1.0) < 0.005 for r in ratios):
            return "same", detail
        if ratios and all(abs(r - 0.5) < 0.005 for r in ratios) and uses is False:
            return "better", detail
        return "worse", detail
    if name == "grads_gained":
        # A shim that gives parameters the gradient upstream cut off (RecurrentGemma's k_proj/v_proj, whose keys and
        # values came from a @torch.no_grad() cache update): the shimmed run must have gradients for parameters the
        # plain run had none for, and lose none. The other gradients change with them (the gained path reaches the
        # earlier layers). The outputs are not judged here: another declared shim may change them on the same step
        # (num_items_in_batch_overcount's count); the shim's own tests prove its forward bit-identical, and the
        # rerun without the declared shims proves the difference is theirs.
        grads, shim_grads = plain_rec.get("grads") or {}, shim_rec.get("grads") or {}
        gained, lost = sorted(set(shim_grads) - set(grads)), sorted(set(grads) - set(shim_grads))
        detail = (f"{len(gained)} parameters gained a gradient ({', '.join(gained[:2])}"
                  f"{', ...' if len(gained) > 2 else ''}), {len(lost)} lost one")
        if lost:
            return "worse", detail
        return ("better" if gained else "same"), detail
    return "worse", f"unknown check {name!r}"


# ----------------------------------------------------------------------------------------------- worker

def worker_main(args):
    import torch
    import transformers

    import ftshims

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_warning()
    # transformers' own stderr handler: keep its records (we capture them) but not the noise
    for h in list(logging.getLogger("transformers").handlers):
        h.setLevel(logging.CRITICAL + 1)
    declared = load_declared(args.declared)
    only = set(args.only.split(",")) if args.only else None
    tasks, _, _ = enumerate_tasks(only)
    chunks = [tasks[i:i + args.chunk] for i in range(0, len(tasks), args.chunk)]
    runner = TaskRunner(args, declared)
    out_path = Path(args.tmp) / f"worker-{args.worker}.jsonl"
    bisect_budget = args.bisect_budget
    ftshims.revert()
    with open(out_path, "a") as out:
        for idx, chunk in enumerate(chunks):
            try:
                fd = os.open(str(Path(args.tmp) / f"claim-{idx}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                os.close(fd)
            except FileExistsError:
                continue
            results, bisect_budget = process_chunk(runner, chunk, declared, args, bisect_budget)
            for res in results:
                out.write(json.dumps(res, default=str) + "\n")
            out.flush()


_CANARY = {"done": False}  # one canary step per worker process
CANARY_CODE = "labels_all_ignored"


def monitor_canary(runner, states):
    """The monitor's positive control, once per worker: the first decoder class that ran gets one more Trainer step
    (``trainer_ga2`` on a fresh build) whose second micro-batch has every label -100; the monitor must report
    ``labels_all_ignored`` there. Without it, "0 findings" could mean that the monitor saw no step at all (an event
    or hook a release stopped firing). Stored as the class's ``monitor_canary``."""
    import trainer_step as zts

    for st in states:
        for cls_name, c in st["classes"].items():
            if c["status"] != "run" or c["plan"].get("trainer_kind") != "decoder" or not c.get("monitor"):
                continue
            first, second = (dict(b) for b in c["inputs"]["trainer"])
            second["labels"] = second["labels"].clone().fill_(-100)
            try:
                with time_limit(runner.args.group_timeout), capture():
                    model = build(c["cls"], st["config"], c["plan"]["trainer_attn"])
                    rec = trainer_record(model, [first, second], "trainer_ga2", "decoder", monitor=True)
            except Exception as e:  # noqa: BLE001 - reported as a canary that saw nothing
                rec = {"exc": exc_record(e), "monitor": {"findings": []}}
            _CANARY["done"] = True
            c["monitor_canary"] = {"codes": sorted({f["code"] for f in rec["monitor"]["findings"]}),
                                   "exc": (rec.get("exc") or {}).get("text")}
            return


def _active_ids(report):
    return [e.id for e in report if e.active]


def process_chunk(runner, chunk, declared, args, bisect_budget):
    import ftshims

    states = []
    for task in chunk:
        t = time.time()
        st = runner.prepare(task)
        st["t_plain"] = time.time() - t
        states.append(st)
    # shimmed phase
    report = None if args.control else ftshims.apply()
    active = _active_ids(report) if report is not None else []
    diffs_by = {}  # (state idx, cls, step) -> [diffs]
    try:
        for si, st in enumerate(states):
            t = time.time()
            for cls_name, c in st["classes"].items():
                if c["status"] != "run":
                    continue
                # the healthy setup: shims applied, and the monitor watching its Trainer steps (the plain run, the
                # reference, runs without it: a monitor that changed what a step computes would be a difference here)
                shim = runner.rerun(st, cls_name, monitor=not args.no_monitor)
                c["shim_keys"] = sorted(shim)
                c["monitor"] = {key.split("|")[2]: rec["monitor"] for key, rec in shim.items() if "monitor" in rec}
                c["trainer_cpu"] = {key.split("|")[2]: rec["t_cpu"] for key, rec in shim.items() if "t_cpu" in rec}
                for key in sorted(set(c["plain"]) | set(shim)):
                    p = c["plain"].get(key, {"exc": {"text": "step missing in plain run"}, "warn": []})
                    s = shim.get(key, {"exc": {"text": "step missing in shimmed run"}, "warn": []})
                    d = compare(p, s)
                    if d:
                        diffs_by[(si, cls_name, key)] = {"diffs": d, "plain": p, "shim": s}
            st["t_shim"] = time.time() - t
        if not args.no_monitor and not _CANARY["done"]:
            monitor_canary(runner, states)
    finally:
        if report is not None:
            ftshims.revert()
    # classify: declared (to be confirmed) or undeclared
    confirm = defaultdict(set)  # frozenset(excluded shims) -> {(si, cls, key)}
    for where, info in diffs_by.items():
        si, cls_name, key = where
        kinds = [d["kind"] for d in info["diffs"]]
        entries = matching_declarations(declared, states[si], cls_name, key, kinds)
        entries = [e for e in entries if e["shim"] in active]
        info["declared"] = entries
        if entries:
            confirm[frozenset(e["shim"] for e in entries)].add(where)
    # Where several declared shims match one step, keep only those that changed it by themselves:
    # a bf16 packed step of a family the packing shim does not cover moves by RoPE's fix alone,
    # and its packed gap moving with it is no claim of the packing shim's.
    shared = defaultdict(set)  # shim id -> steps it shares with another declared shim
    for where, info in diffs_by.items():
        # (not the Trainer steps: their checks measure what each shim does, the count or the loss scale, and
        # say "same" for a shim that did not act; rerunning each of them alone would double their cost)
        if len(info.get("declared") or []) > 1 and "trainer" not in step_trigger(where[2]):
            for entry in info["declared"]:
                shared[entry["shim"]].add(where)
    for shim_id, wheres in shared.items():
        ftshims.apply(only=[shim_id])
        try:
            reruns = _rerun_many(runner, states, wheres)
        finally:
            ftshims.revert()
        for where in wheres:
            info = diffs_by[where]
            alone = reruns.get(where)
            if alone is not None and not compare(info["plain"], alone):
                info["declared"] = [e for e in info["declared"] if e["shim"] != shim_id]
    confirm = defaultdict(set)
    for where, info in diffs_by.items():
        if info.get("declared") and _exactly_halved(info["plain"], info["shim"]):
            # every loss and gradient exactly half the plain one: nothing but the Trainer's loss scale changed, no
            # other shim can have acted; the rerun without the declared shims would only confirm it
            info["exact"] = True
            continue
        if info.get("declared"):
            confirm[frozenset(e["shim"] for e in info["declared"])].add(where)
    for where, info in diffs_by.items():
        if info.get("exact"):
            si, cls_name, key = where
            info["plain"].setdefault("probe", {}).update(runner.loss_probe(states[si], cls_name))
            info["checks"] = []
            for entry in info["declared"]:
                verdict, detail = run_check(entry["check"], info["plain"], info["shim"])
                info["checks"].append({"id": entry.get("id"), "shim": entry["shim"], "check": entry["check"],
                                       "verdict": verdict, "detail": detail})
    for excluded, wheres in confirm.items():
        ftshims.apply(exclude=sorted(excluded))
        try:
            reruns = _rerun_many(runner, states, wheres)
        finally:
            ftshims.revert()
        for where in wheres:
            si, cls_name, key = where
            info = diffs_by[where]
            rest = reruns.get(where)
            left = compare(info["plain"], rest) if rest is not None else [{"kind": "exception", "detail": "rerun missing"}]
            left = [d for d in left if not _replay_warning(d, states[si], cls_name)]
            checks = []
            for entry in info["declared"]:
                if entry["check"] in ("num_items_scored", "ga_loss_divided") \
                        and "first_label_scored" not in info["plain"].get("probe", {}):
                    info["plain"].setdefault("probe", {}).update(runner.loss_probe(states[si], cls_name))
                verdict, detail = run_check(entry["check"], info["plain"], info["shim"])
                checks.append({"id": entry.get("id"), "shim": entry["shim"], "check": entry["check"],
                               "verdict": verdict, "detail": detail})
            info["checks"] = checks
            if left:
                info["leftover"] = left  # the declared shims do not explain the whole difference
    # attribution of undeclared differences: hints from tracebacks/warning origins, else bisect
    to_bisect = {}
    for where, info in diffs_by.items():
        pending = info.get("leftover") if info.get("declared") else info["diffs"]
        if not pending:
            continue
        hints = {d.get("shim_hint") for d in pending if d.get("shim_hint")}
        if hints and all(d.get("shim_hint") for d in pending):
            info["culprits"] = sorted(hints)
        else:
            to_bisect[where] = info
    if to_bisect and not args.control:
        t0 = time.time()
        if bisect_budget > 0:
            culprits = defaultdict(list)
            for shim_id in active:
                ftshims.apply(only=[shim_id])
                try:
                    reruns = _rerun_many(runner, states, set(to_bisect))
                finally:
                    ftshims.revert()
                for where, info in to_bisect.items():
                    rr = reruns.get(where)
                    if rr is not None and compare(info["plain"], rr):
                        culprits[where].append(shim_id)
            for where, info in to_bisect.items():
                info["culprits"] = culprits.get(where) or ["(none alone: a combination)"]
            bisect_budget -= time.time() - t0
        else:
            for info in to_bisect.values():
                info["culprits"] = ["(not bisected: budget spent)"]
    # results
    results = []
    for si, st in enumerate(states):
        res = {"model_type": st["model_type"], "skip": st.get("skip"), "t_plain": round(st.get("t_plain", 0), 3),
               "t_shim": round(st.get("t_shim", 0), 3), "active_shims": active, "classes": {}}
        for cls_name, c in st["classes"].items():
            entry = {"labels": c["labels"], "primary": c["primary"], "status": c["status"], "reason": c["reason"],
                     "notes": c["notes"], "groups": c.get("groups", []),
                     "steps": sorted(k for k in c.get("plain", {})), "failures": [], "declared_ok": []}
            # the plain Trainer steps: None when they ran, else what they raised (identical in both phases is
            # no failure, but then the class's Trainer path is not tested)
            entry["trainer"] = {} if c["status"] != "run" else {
                k.split("|")[2]: ((r.get("exc") or {}).get("text")) for k, r in c.get("plain", {}).items()
                if k.split("|")[2:3] and k.split("|")[2].startswith("trainer")}
            entry["monitor"] = c.get("monitor") or {}
            if c.get("monitor_canary"):
                entry["monitor_canary"] = c["monitor_canary"]
            entry["trainer_cpu"] = c.get("trainer_cpu") or {}
            for (sj, cn, key), info in diffs_by.items():
                if sj != si or cn != cls_name:
                    continue
                item = {"step": key, "diffs": info["diffs"], "culprits": info.get("culprits"),
                        "plain_exc": (info["plain"].get("exc") or {}).get("text"),
                        "shim_exc": (info["shim"].get("exc") or {}).get("text")}
                if info.get("declared"):
                    item["checks"] = info.get("checks", [])
                    verdicts = [ch["verdict"] for ch in item["checks"]]
                    bad_checks = "worse" in verdicts or "better" not in verdicts
                    if info.get("leftover"):
                        item["leftover"] = info["leftover"]
                    if bad_checks or info.get("leftover"):
                        entry["failures"].append(item)
                    else:
                        entry["declared_ok"].append(item)
                else:
                    entry["failures"].append(item)
            res["classes"][cls_name] = entry
        results.append(res)
    return results, bisect_budget


def _exactly_halved(plain, shim):
    """A Trainer step whose shimmed losses and gradients are all exactly half the plain ones (same count)."""
    p_out, s_out = plain.get("out") or [], shim.get("out") or []
    grads, shim_grads = plain.get("grads") or {}, shim.get("grads") or {}
    if plain.get("exc") or shim.get("exc") or len(p_out) < 2 or len(p_out) != len(s_out) or not grads \
            or set(grads) != set(shim_grads) or "num_items" not in (plain.get("probe") or {}):
        return False
    if {w for w, _ in shim.get("warn", [])} - {w for w, _ in plain.get("warn", [])}:
        return False
    return bool((s_out[-1] == p_out[-1]).all()) and all(bool((s * 2 == p).all()) for s, p in zip(s_out[:-1], p_out[:-1])) \
        and all(bool((shim_grads[n] * 2 == g).all()) for n, g in grads.items())


def _replay_warning(diff, st, cls_name):
    """A warning of a partial rerun (a fresh model running only some steps) that the plain run also gave, in an
    earlier step of the same model: a model's own once-per-instance warning (big_bird switching to full attention
    on short inputs), not a change."""
    if diff["kind"] != "warning":
        return False
    plain = st["classes"][cls_name].get("plain", {})
    return any(diff["detail"] == text for rec in plain.values() for text, _ in rec.get("warn", []))


def _rerun_many(runner, states, wheres):
    by_class = defaultdict(set)
    for si, cls_name, key in wheres:
        by_class[(si, cls_name)].add(key)
    out = {}
    for (si, cls_name), keys in by_class.items():
        recs = runner.rerun(states[si], cls_name, keys)
        for key in keys:
            if key in recs:
                out[(si, cls_name, key)] = recs[key]
    return out


# ----------------------------------------------------------------------------------------------- main

def versions():
    from importlib import metadata

    out = {}
    for dist in ("torch", "transformers", "peft", "trl", "accelerate", "tokenizers", "huggingface-hub"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated model types (e.g. llama,clip)")
    ap.add_argument("--verbose", action="store_true", help="print a per-model table")
    ap.add_argument("--json", help="write the JSON summary here")
    ap.add_argument("--skips", help="write the skipped architectures (one line each, with the reason) here")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=12, help="model types per apply()/revert() cycle")
    ap.add_argument("--group-timeout", type=int, default=GROUP_TIMEOUT_S)
    ap.add_argument("--bisect-budget", type=float, default=90.0, help="seconds per worker for attributing differences")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-trainer", action="store_true", help="skip the Trainer steps (trainer_step.py)")
    ap.add_argument("--no-monitor", action="store_true",
                    help="run the shimmed Trainer steps without ftshims.monitor attached (for timing)")
    ap.add_argument("--compile-backend", default="eager",
                    help="torch.compile backend of the fullgraph step: eager (dynamo tracing only, default), aot_eager, inductor")
    ap.add_argument("--declared", default=str(HERE / "declared_changes.toml"))
    ap.add_argument("--stack", default=os.environ.get("FTSHIMS_STACK", "local"))
    ap.add_argument("--control", action="store_true", help="do not apply shims in the second phase (checks the gate itself)")
    ap.add_argument("--min-causal", type=float, default=0.0, help="fail when causal-LM coverage is below this fraction")
    ap.add_argument("--min-overall", type=float, default=0.0, help="fail when overall coverage is below this fraction")
    ap.add_argument("--min-image-text", type=float, default=0.0,
                    help="fail when image-text-to-text coverage is below this fraction")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--tmp", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        worker_main(args)
        return 0
    load_declared_findings(args.declared)  # a malformed [[monitor_finding]] fails now, not after the run
    t0 = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="zoo-gate-"))
    cmd_base = [sys.executable, str(Path(__file__).resolve())]
    passthrough = []
    for flag in ("only", "chunk", "group_timeout", "bisect_budget", "compile_backend", "declared"):
        value = getattr(args, flag)
        if value is not None:
            passthrough += [f"--{flag.replace('_', '-')}", str(value)]
    if args.no_compile:
        passthrough.append("--no-compile")
    if args.no_trainer:
        passthrough.append("--no-trainer")
    if args.no_monitor:
        passthrough.append("--no-monitor")
    if args.control:
        passthrough.append("--control")
    procs = []
    for k in range(max(1, args.workers)):
        log = open(tmp / f"worker-{k}.log", "w")
        procs.append((subprocess.Popen(cmd_base + passthrough + ["--worker", str(k), "--tmp", str(tmp)],
                                       stdout=log, stderr=subprocess.STDOUT), log))
    crashed = []
    for k, (proc, log) in enumerate(procs):
        rc = proc.wait()
        log.close()
        if rc != 0:
            crashed.append((k, rc, (tmp / f"worker-{k}.log").read_text()[-3000:]))
    results = []
    for k in range(len(procs)):
        path = tmp / f"worker-{k}.jsonl"
        if path.exists():
            results += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return report(args, results, crashed, time.time() - t0, tmp)


def report(args, results, crashed, wall, tmp):
    sys.path.insert(0, str(HERE))
    import transformers  # noqa: F401  (enumeration only)

    only = set(args.only.split(",")) if args.only else None
    tasks, totals, mapping_names = enumerate_tasks(only)
    by_type = {r["model_type"]: r for r in results}
    status = {}  # (label, model_type) -> (ok, reason)
    for label, types in totals.items():
        for mt in types:
            if only and mt not in only:
                continue
            r = by_type.get(mt)
            if r is None:
                status[(label, mt)] = (False, "not run (worker crashed or time limit)")
                continue
            if r.get("skip"):
                status[(label, mt)] = (False, r["skip"])
                continue
            cls = next((c for c in r["classes"].values() if label in c["labels"]), None)
            if cls is None:
                status[(label, mt)] = (False, "class not found")
            elif cls["status"] == "run":
                status[(label, mt)] = (True, None)
            else:
                status[(label, mt)] = (False, cls["reason"] or cls["status"])
    coverage = {}
    for label in totals:
        items = [(mt, ok) for (lb, mt), (ok, _) in status.items() if lb == label]
        coverage[label] = {"mapping": mapping_names[label], "run": sum(ok for _, ok in items), "total": len(items)}
    n_run = sum(v["run"] for v in coverage.values())
    n_total = sum(v["total"] for v in coverage.values())
    failures = []
    declared_ok = []
    for r in results:
        for cls_name, c in r["classes"].items():
            for f in c["failures"]:
                failures.append({"model_type": r["model_type"], "class": cls_name, **f})
            for f in c["declared_ok"]:
                declared_ok.append({"model_type": r["model_type"], "class": cls_name, "step": f["step"],
                                    "checks": f.get("checks")})
    skips = sorted({(mt, reason) for (lb, mt), (ok, reason) in status.items() if not ok})
    skip_lines = []
    for mt, reason in skips:
        labels = sorted(lb for (lb, m), (ok, _) in status.items() if m == mt and not ok)
        skip_lines.append(f"{mt} [{','.join(labels)}]: {reason}")
    active = next((r["active_shims"] for r in results if r.get("active_shims")), [])
    vers = versions()
    print(f"zoo gate: stack {args.stack}, transformers {vers['transformers']}, torch {vers['torch']}; "
          f"shims active: {', '.join(active) or '(none)'}{' [CONTROL RUN: no shims]' if args.control else ''}")
    print("coverage (built and run / listed):")
    for label, cov in coverage.items():
        pct = 100.0 * cov["run"] / cov["total"] if cov["total"] else 100.0
        print(f"  {label:<20} {cov['mapping']:<50} {cov['run']:>4}/{cov['total']:<4} {pct:5.1f}%")
    pct_all = 100.0 * n_run / n_total if n_total else 100.0
    print(f"  {'overall':<20} {'':<50} {n_run:>4}/{n_total:<4} {pct_all:5.1f}%")
    trainer_classes = [(r["model_type"], cn, c["trainer"]) for r in results for cn, c in r["classes"].items()
                       if c.get("trainer")]
    refused = defaultdict(list)
    for mt, cn, steps in trainer_classes:
        for step, text in steps.items():
            if text:
                refused[re.sub(r"[-+]?\d[\d.e+-]*", "#", text)[:120]].append(f"{mt}:{step}")
    n_steps = sum(len(steps) for _, _, steps in trainer_classes)
    print(f"  {'trainer steps':<20} {'ran plain / built (classes with a loss)':<50} "
          f"{n_steps - sum(map(len, refused.values())):>4}/{n_steps:<4} ({len(trainer_classes)} classes)")
    if args.verbose:
        print("\nper model:")
        print(f"  {'model_type':<32} {'class':<48} {'status':<8} {'steps':>5} {'fail':>4} {'decl':>4}  s(plain/shim)  note")
        for r in sorted(results, key=lambda r: r["model_type"]):
            if r.get("skip"):
                print(f"  {r['model_type']:<32} {'-':<48} {'skip':<8} {'':>5} {'':>4} {'':>4}  {'':13}  {r['skip'][:90]}")
                continue
            for cls_name, c in r["classes"].items():
                note = c["reason"] or "; ".join(c["notes"])[:90]
                print(f"  {r['model_type']:<32} {cls_name[:48]:<48} {c['status']:<8} {len(c['steps']):>5} "
                      f"{len(c['failures']):>4} {len(c['declared_ok']):>4}  {r['t_plain']:5.2f}/{r['t_shim']:5.2f}  {note[:90]}")
    print(f"\nskipped: {len(skip_lines)} architectures" + (f" (list: {args.skips})" if args.skips else ""))
    if args.verbose or not args.skips:
        for line in skip_lines:
            print("  " + line)
    if declared_ok:
        by_check = defaultdict(int)
        for d in declared_ok:
            for ch in d.get("checks") or []:
                if ch["verdict"] == "better":
                    by_check[(ch["shim"], ch["check"])] += 1
        print("\ndeclared changes seen, direction checks holding:")
        for (shim, check), n in sorted(by_check.items()):
            print(f"  {shim} / {check}: {n} steps")
    monitor = monitor_summary(args, results)
    extra = [f"{monitor['undeclared']} undeclared monitor findings"] if monitor["undeclared"] else []
    extra += [f"{monitor['blind']} monitor canaries without {CANARY_CODE}"] if monitor["blind"] else []
    print(f"\nfailures: {len(failures)}" + (f" (and {'; '.join(extra)})" if extra else ""))
    grouped = defaultdict(list)
    for f in failures:
        culprits = ",".join(f.get("culprits") or []) or "?"
        first = (f.get("leftover") or f["diffs"])[0]
        kind = first["kind"]
        detail = first["detail"]
        if f.get("checks") and not f.get("leftover"):
            bad = [ch for ch in f["checks"] if ch["verdict"] == "worse"] or [
                ch for ch in f["checks"] if ch["verdict"] != "better"]
            kind, detail = "declared check failed", "; ".join(f"{ch['check']}: {ch['detail']}" for ch in bad)
            culprits = ",".join(sorted({ch["shim"] for ch in bad})) or culprits
        key = (culprits, kind, re.sub(r"[-+]?\d[\d.e+-]*", "#", detail)[:160])
        grouped[key].append((f, detail))
    for (culprits, kind, _), pairs in sorted(grouped.items(), key=lambda kv: (kv[0][0], -len(kv[1]))):
        items = [f for f, _ in pairs]
        sample, detail = pairs[0]
        print(f"  [{culprits}] {kind}: {len(items)} steps, e.g. {sample['model_type']} {sample['class']} {sample['step']}")
        print(f"      {detail[:300]}")
        steps = sorted({f"{f['model_type']}:{f['step']}" for f in items})
        print(f"      where: {', '.join(steps[:12])}{' ...' if len(steps) > 12 else ''}")
    if refused and args.verbose:
        print("\nTrainer steps that raise in the plain run too (not tested there):")
        for text, where in sorted(refused.items(), key=lambda kv: -len(kv[1])):
            print(f"  {len(where)} steps: {text}\n      where: {', '.join(where[:10])}{' ...' if len(where) > 10 else ''}")
    if crashed:
        print("\nworker crashes:")
        for k, rc, tail in crashed:
            print(f"  worker {k} exit {rc}:\n" + "\n".join("    " + l for l in tail.splitlines()[-20:]))
    cov_causal = coverage.get("causal_lm", {"run": 0, "total": 0})
    frac_causal = cov_causal["run"] / cov_causal["total"] if cov_causal["total"] else 1.0
    frac_all = n_run / n_total if n_total else 1.0
    cov_itt = coverage.get("image_text_to_text", {"run": 0, "total": 0})
    frac_itt = cov_itt["run"] / cov_itt["total"] if cov_itt["total"] else 1.0
    coverage_fail = frac_causal < args.min_causal or frac_all < args.min_overall or frac_itt < args.min_image_text
    print(f"\nwall time {wall:.1f}s; worker logs in {tmp}")
    if coverage_fail:
        print(f"COVERAGE BELOW GOAL: causal-LM {100 * frac_causal:.1f}% (min {100 * args.min_causal:.0f}%), "
              f"image-text-to-text {100 * frac_itt:.1f}% (min {100 * args.min_image_text:.0f}%), "
              f"overall {100 * frac_all:.1f}% (min {100 * args.min_overall:.0f}%)")
    summary = {
        "stack": args.stack, "versions": vers, "active_shims": active, "control": args.control,
        "coverage": coverage, "overall": {"run": n_run, "total": n_total},
        "skipped": [{"model_type": mt, "reason": reason} for mt, reason in skips],
        "failures": failures, "declared_ok": declared_ok, "wall_s": round(wall, 1),
        "trainer_steps": {"built": n_steps, "refused": {k: v for k, v in refused.items()}},
        "crashed_workers": [{"worker": k, "rc": rc} for k, rc, _ in crashed],
        "monitor": monitor,
        "models": results,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1, default=str) + "\n")
    if args.skips:
        Path(args.skips).write_text("\n".join(skip_lines) + "\n")
    ok = not failures and not crashed and not coverage_fail and not monitor["undeclared"] and not monitor["blind"]
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
