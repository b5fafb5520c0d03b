"""Shared helpers of the client tests: a tiny local model and dataset, client subprocesses run with
and without ftshims, and what they leave behind (the in-process probe, logs, adapter weights).

How ftshims' state is read inside a client's training process: the subprocess gets
``tests/clients/site`` first on ``PYTHONPATH``. Its ``sitecustomize`` runs after the
``ftshims-auto.pth`` start-up hook (so with ``FTSHIMS_AUTO=1`` the shims are applied already) and,
with ``FTSHIMS_CLIENT_PROBE`` set, arms ``ftshims_client_probe``: each process appends one JSON
line with ``ftshims.status().to_dict()`` and what it observed (see that module).
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SITE = HERE / "site"
CLIENTS_ENV = "FTSHIMS_CLIENTS"
# Whole-run limit of one client subprocess; the runs themselves take 20-120 s on 2 shared cores.
RUN_TIMEOUT = int(os.environ.get("FTSHIMS_CLIENT_TIMEOUT", "420"))

SPECIAL = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3}
VOCAB = 128


def require(client: str, module: str) -> None:
    """Skip the calling test module unless ``module`` imports; fail instead when the session said
    this client must be tested (``FTSHIMS_CLIENTS=llamafactory,liger,...``)."""
    import importlib.util

    wanted = {c.strip() for c in os.environ.get(CLIENTS_ENV, "").split(",") if c.strip()}
    if importlib.util.find_spec(module) is not None:
        return
    if client in wanted:
        raise RuntimeError(f"{CLIENTS_ENV} names {client!r} but {module!r} is not importable in {sys.executable}")
    pytest.skip(f"{module} is not installed here (the nox session 'clients' builds its venv)", allow_module_level=True)


def hook_installed() -> bool:
    return (Path(sysconfig.get_path("purelib")) / "ftshims-auto.pth").is_file()


# ---------------------------------------------------------------------------
# the tiny model, tokenizer and dataset


def tiny_tokenizer():
    """Word-level tokenizer over ``w4 .. w127`` plus the specials; unknown words (template text) -> <unk>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = dict(SPECIAL)
    vocab.update({f"w{i}": i for i in range(len(SPECIAL), VOCAB)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def save_tiny_llama(directory: Path) -> Path:
    """``LlamaForCausalLM`` from a tiny config (2 layers, hidden 32, GQA) and the tokenizer, saved to ``directory``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory


def alpaca_rows(n: int = 16, seed: int = 0) -> List[dict]:
    """Short instruction/response pairs over the tokenizer's words (8-20 tokens each with a template)."""
    rng = random.Random(seed)

    def words(lo, hi):
        return " ".join(f"w{rng.randrange(len(SPECIAL), VOCAB)}" for _ in range(rng.randrange(lo, hi)))

    return [{"instruction": words(3, 9), "input": "", "output": words(2, 7)} for _ in range(n)]


# ---------------------------------------------------------------------------
# running a client


@dataclass
class Run:
    name: str
    ftshims: bool
    returncode: int
    seconds: float
    workdir: Path
    output_dir: Path
    log: str
    probes: List[dict] = field(default_factory=list)

    @property
    def trainer(self) -> Optional[dict]:
        """The probe record of the process that trained (a launcher process writes its own record)."""
        for record in self.probes:
            if record.get("steps") or record.get("model"):
                return record
        return None

    def status(self, record: Optional[dict] = None) -> Dict[str, dict]:
        record = record or self.trainer or (self.probes[0] if self.probes else {})
        return {entry["id"]: entry for entry in record.get("status", {}).get("shims", [])}

    def active(self, record: Optional[dict] = None) -> List[str]:
        return sorted(i for i, e in self.status(record).items() if e["status"] in ("applied", "deferred"))

    def losses(self) -> List[float]:
        """Per-step training losses: trainer_state.json when the client wrote one, else the printed log dicts."""
        state = self.output_dir / "trainer_state.json"
        if state.is_file():
            history = json.loads(state.read_text()).get("log_history", [])
            return [float(h["loss"]) for h in history if "loss" in h]
        losses = []
        for line in self.log.splitlines():
            start = line.find("{'loss': ")
            if start >= 0:
                value = line[start + len("{'loss': ") :].split(",", 1)[0].strip("'\" ")
                losses.append(float(value))
        return losses

    def adapter(self) -> dict:
        from safetensors.torch import load_file

        return load_file(str(self.output_dir / "adapter_model.safetensors"))

    def explain(self) -> str:
        return f"{self.name} (ftshims={self.ftshims}) exited {self.returncode} after {self.seconds:.0f} s; log tail:\n" + "\n".join(
            self.log.splitlines()[-40:]
        )


def client_env(ftshims: bool, probe: Path, extra_path: Optional[List[Path]] = None, **extra) -> dict:
    env = dict(os.environ)
    for name in ("FTSHIMS_AUTO", "FTSHIMS_DISABLE", "FTSHIMS_EVIDENCE_OUT", "FTSHIMS_STACK"):
        env.pop(name, None)
    python_path = [str(SITE)] + [str(p) for p in (extra_path or [])] + [str(ROOT)]
    if os.environ.get("PYTHONPATH"):
        python_path.append(os.environ["PYTHONPATH"])
    env.update(
        PYTHONPATH=os.pathsep.join(python_path),
        PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        FTSHIMS_CLIENT_PROBE=str(probe),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        DO_NOT_TRACK="1",
        PYTHONUNBUFFERED="1",
    )
    if ftshims:
        env["FTSHIMS_AUTO"] = "1"
    env.update(extra)
    return env


def start(name: str, argv: List[str], workdir: Path, output_dir: Path, ftshims: bool, **env_extra):
    """Start one client process; ``finish()`` waits for it. The log goes to ``workdir/log``."""
    workdir.mkdir(parents=True, exist_ok=True)
    probe = workdir / "probe.jsonl"
    if probe.exists():
        probe.unlink()
    log = open(workdir / "log", "w")
    env = client_env(ftshims, probe, **env_extra)
    process = subprocess.Popen(argv, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
    return (name, ftshims, process, log, workdir, output_dir, time.monotonic())


def finish(started) -> Run:
    name, ftshims, process, log, workdir, output_dir, t0 = started
    try:
        returncode = process.wait(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        returncode = process.wait()
    log.close()
    probes = []
    probe = workdir / "probe.jsonl"
    if probe.is_file():
        probes = [json.loads(line) for line in probe.read_text().splitlines() if line.strip()]
    return Run(name, ftshims, returncode, time.monotonic() - t0, workdir, output_dir,
               (workdir / "log").read_text(errors="replace"), probes)


def run_pair(name: str, make_argv, root: Path) -> Dict[bool, Run]:
    """The same client run with and without ftshims, side by side (two processes, two cores)."""
    started = []
    for on in (True, False):
        workdir = root / f"{name}-{'ftshims' if on else 'plain'}"
        argv, output_dir, env_extra = make_argv(workdir)
        started.append(start(name, argv, workdir, output_dir, on, **env_extra))
    runs = [finish(s) for s in started]
    return {run.ftshims: run for run in runs}


# The LLaMA-Factory YAML of the client tests: LoRA on every linear layer, template default, 3 steps, fp32.
LLAMAFACTORY_BASE = {
    "stage": "sft",
    "do_train": True,
    "finetuning_type": "lora",
    "lora_target": "all",
    "lora_rank": 4,
    "dataset": "tiny",
    "template": "default",
    "cutoff_len": 64,
    "overwrite_cache": True,
    "overwrite_output_dir": True,
    "per_device_train_batch_size": 2,
    "learning_rate": 1.0e-2,
    "max_steps": 3,
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
    "bf16": False,
    "fp16": False,
    "seed": 0,
    "dataloader_num_workers": 0,
    "preprocessing_num_workers": None,
}


def llamafactory_fixture(root: Path) -> Path:
    """``root`` with the tiny model (``model/``) and the alpaca dataset (``data/``, with its ``dataset_info.json``)."""
    save_tiny_llama(root / "model")
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    (data / "tiny.json").write_text(json.dumps(alpaca_rows()))
    (data / "dataset_info.json").write_text(json.dumps({"tiny": {"file_name": "tiny.json"}}))
    return root


def llamafactory_pairs(fixture_dir: Path, settings_for, env_for=None):
    """``runs(config)`` -> ``{True: Run with ftshims, False: Run without}`` of ``llamafactory-cli train``, each
    pair run once, side by side. ``settings_for(config)`` gives the YAML's settings (model, dataset and output
    paths are filled in here); ``env_for(config, ftshims)`` the runs' extra environment (``extra_path`` included)."""
    assert hook_installed(), "ftshims-auto.pth is not in this venv's site-packages (install ftshims non-editable)"
    cli = Path(sys.executable).parent / "llamafactory-cli"
    done = {}

    def get(config: str):
        if config not in done:

            def make_argv(workdir: Path):
                settings = dict(settings_for(config), model_name_or_path=str(fixture_dir / "model"),
                                dataset_dir=str(fixture_dir / "data"), output_dir=str(workdir / "out"))
                yaml = workdir / "train.yaml"
                yaml.parent.mkdir(parents=True, exist_ok=True)
                yaml.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in settings.items() if v is not None))
                env = env_for(config, workdir.name.endswith("-ftshims"), workdir) if env_for else {}
                return [str(cli), "train", str(yaml)], workdir / "out", env

            done[config] = run_pair(config, make_argv, fixture_dir / "runs")
        return done[config]

    return get


def finite(values) -> bool:
    return bool(values) and all(math.isfinite(v) for v in values)


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def identical(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------
# foreign-patch scenarios (foreign_scenario.py, one fresh process each)


@dataclass
class Scenario:
    steps: str
    facts: dict
    tensors: Optional[dict]
    log: str

    def objects(self, after_revert: bool = False) -> dict:
        return self.facts["after_revert"]["objects"] if after_revert else self.facts["objects"]

    def status(self, shim: str) -> dict:
        return self.facts["status"][shim]


def run_scenarios(specs: Dict[str, dict], root: Path, weights: Optional[Path] = None, workers: int = 2) -> Dict[str, Scenario]:
    """Run ``{key: {"steps": "liger,ftshims", "forward": bool, "liger_full": bool, "interpret": bool}}``,
    ``workers`` processes at a time; returns ``{key: Scenario}``."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    root.mkdir(parents=True, exist_ok=True)

    def one(key: str) -> Scenario:
        spec = specs[key]
        prefix = root / key
        argv = [sys.executable, str(HERE / "foreign_scenario.py"), spec["steps"], str(prefix)]
        if spec.get("forward"):
            argv.append("--forward")
        if spec.get("liger_full"):
            argv.append("--liger-full")
        if weights is not None:
            argv += ["--weights", str(weights)]
        env = client_env(False, root / "unused-probe")
        env.pop("FTSHIMS_CLIENT_PROBE")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env["TRITON_INTERPRET"] = "1" if spec.get("interpret") else "0"
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
        log = done.stdout + done.stderr
        if done.returncode != 0:
            raise AssertionError(f"scenario {key} ({spec['steps']}) failed:\n{log[-4000:]}")
        facts = json.loads(Path(str(prefix) + ".json").read_text())
        tensors = torch.load(str(prefix) + ".pt") if spec.get("forward") else None
        return Scenario(spec["steps"], facts, tensors, log)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = dict(zip(specs, pool.map(one, specs)))
    return results


def same_numbers(a: dict, b: dict, atol: float = 0.0) -> bool:
    """Loss and gradients of one measured batch (``tensors[stage][batch]``) equal (``atol=0``: bit for bit)."""
    import torch

    if atol == 0.0:
        return torch.equal(a["loss"], b["loss"]) and torch.equal(a["grads"], b["grads"])
    return bool(torch.allclose(a["loss"], b["loss"], atol=atol, rtol=0) and torch.allclose(a["grads"], b["grads"], atol=atol, rtol=0))


def gap(a: dict, b: dict) -> float:
    return max(float((a["loss"] - b["loss"]).abs()), float((a["grads"] - b["grads"]).abs().max()))
