"""``python -m ftshims.doctor --checkpoint DIR [--reload] [--json]``: a checkpoint saved under the monitor is sound;
a flipped byte names its file; a missing optimizer state, a save_only_model checkpoint, an adapter config that
does not match its weights, a tokenizer beyond the embedding rows and a reload that does not give back the saved
model are findings (exit 1); a directory that is not a checkpoint is unusable (exit 2)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ftshims import tiny

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    os.environ.get("FTSHIMS_STACK") not in (None, "local", "t4_57", "t5_25"),
    reason="the checkpoint check reads Trainer files: the default stack and the newest")


def doctor(*args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTSHIMS_")}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-m", "ftshims.doctor", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=300)
    return done.returncode, done.stdout, done.stderr


def doctor_json(directory, *extra):
    code, out, err = doctor("--checkpoint", directory, "--json", *extra)
    assert out.strip(), err[-2000:]
    report = json.loads(out)["checkpoint"]
    return code, report, {f["code"]: f for f in report["findings"]}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two monitored runs (a full fine-tune with a tokenizer saved beside it; LoRA with modules_to_save on resized
    embeddings), checkpoints at steps 2 and 4, and a save_only_model run."""
    import ftshims.monitor
    from transformers import Trainer, TrainingArguments

    root = tmp_path_factory.mktemp("saved")
    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": r, "labels": r.clone()} for r in torch.randint(3, 128, (8, 8), generator=g)]
    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(4, 128)]
    tokenizer = tiny.word_tokenizer(words, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    runs = {}
    for name, extra in (("full", {}), ("lora", {}), ("only", {"save_only_model": True})):
        model = tiny.tiny_llama(attn="sdpa")
        if name == "lora":
            from peft import LoraConfig, get_peft_model

            with tiny.quiet():
                model.resize_token_embeddings(136)
                model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                         modules_to_save=["embed_tokens", "lm_head"], task_type="CAUSAL_LM"))
        args = TrainingArguments(str(root / name), per_device_train_batch_size=2, max_steps=4, save_steps=2,
                                 report_to=[], use_cpu=True, disable_tqdm=True, logging_strategy="no",
                                 learning_rate=1e-2, **extra)
        with tiny.quiet():
            Trainer(model=model, args=args, train_dataset=rows, callbacks=[ftshims.monitor.callback()],
                    processing_class=tokenizer if name == "full" else None).train()
        runs[name] = root / name / "checkpoint-4"
    return runs


def copy_of(source, tmp_path):
    target = tmp_path / source.name
    shutil.copytree(source, target)
    return target


def test_a_monitored_checkpoint_is_sound_and_reloads_bit_identically(saved):
    code, report, found = doctor_json(saved["full"], "--reload")
    assert code == 0, report["findings"]
    assert report["facts"]["reload"] == {"max_abs_diff": 0.0, "identical": True, "tolerance": 0.0}
    assert report["facts"]["manifest"]["written_by"] == "ftshims.monitor"


def test_a_flipped_byte_names_its_file(saved, tmp_path):
    folder = copy_of(saved["full"], tmp_path)
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one weight
    path.write_bytes(bytes(data))
    code, report, found = doctor_json(folder)
    assert code == 1
    assert found["file-changed"]["file"] == "model.safetensors", report["findings"]
    assert [f["code"] for f in report["findings"] if f["severity"] == "error"] == ["file-changed"]
    code, text, _ = doctor("--checkpoint", folder)
    assert code == 1 and "[file-changed] model.safetensors" in text


def test_a_missing_optimizer_state_is_a_finding(saved, tmp_path):
    folder = copy_of(saved["full"], tmp_path)
    (folder / "optimizer.pt").unlink()
    code, report, found = doctor_json(folder)
    assert code == 1
    assert "optimizer state (optimizer.pt)" in found["resume-incomplete"]["message"]
    assert found["file-missing"]["file"] == "optimizer.pt"  # the manifest listed it too


def test_save_only_model_is_named_not_resumable(saved):
    code, report, found = doctor_json(saved["only"])
    assert code == 1 and set(found) == {"not-resumable"}, report["findings"]


def test_adapter_config_against_its_weights(saved, tmp_path):
    code, report, found = doctor_json(saved["lora"])
    assert set(found) == {"adapter-base-unrecorded"}, report["findings"]  # built from a config: no base recorded
    folder = copy_of(saved["lora"], tmp_path)
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(target_modules=["q_proj", "v_proj", "k_proj"], modules_to_save=["embed_tokens", "lm_head", "score"], r=8)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    code, report, found = doctor_json(folder)
    assert code == 1
    assert "'k_proj'" in found["adapter-target-missing"]["message"]
    assert "'score'" in found["adapter-modules-to-save-missing"]["message"]
    assert "r=8" in found["adapter-rank-mismatch"]["message"]
    assert found["file-changed"]["file"] == "adapter_config.json"


def test_tokenizer_beyond_the_embedding_rows(saved, tmp_path):
    folder = copy_of(saved["full"], tmp_path)
    data = json.loads((folder / "tokenizer.json").read_text())
    data["added_tokens"].append({"id": 130, "content": "<extra>", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True})
    (folder / "tokenizer.json").write_text(json.dumps(data))
    code, report, found = doctor_json(folder)
    assert code == 1 and "ids up to 130" in found["tokenizer-beyond-embeddings"]["message"]
    assert "128 rows" in found["tokenizer-beyond-embeddings"]["message"]


def test_reload_that_does_not_give_back_the_saved_model(saved, tmp_path):
    """Weights changed and the manifest re-written (as a tool that rewrites a checkpoint would): the hashes agree,
    the reloaded logits do not; a dropped tensor is reported missing by the loader."""
    from safetensors.torch import load_file, save_file

    from ftshims.checkpoint import manifest

    folder = copy_of(saved["full"], tmp_path)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] *= 1.01
    del tensors["model.norm.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    found_manifest, _ = manifest.read(str(folder))
    manifest.write(str(folder), "test", tensors=None, reference=found_manifest["reference"], global_step=4)
    code, report, found = doctor_json(folder, "--reload")
    assert code == 1
    assert "model.norm.weight" in found["reload-missing-weights"]["message"]
    assert report["facts"]["reload"]["max_abs_diff"] > 0 and "reload-logits-differ" in found


def test_unusable_directories_and_usage(tmp_path):
    assert doctor_json(tmp_path / "absent")[0] == 2
    (tmp_path / "empty").mkdir()
    code, report, found = doctor_json(tmp_path / "empty")
    assert code == 2 and "checkpoint-unusable" in found
    assert doctor("--reload")[0] == 2  # --reload needs --checkpoint
    assert doctor("--checkpoint", tmp_path, "--reload-tolerance", "-1")[0] == 2


def test_every_code_is_documented():
    """docs/doctor-json.md's checkpoint table lists every code with its severity, and nothing else."""
    import re

    from ftshims.checkpoint.offline import CODES

    text = (ROOT / "docs" / "doctor-json.md").read_text(encoding="utf-8")
    table = text[text.index("## `--checkpoint DIR --json`"):]
    rows = dict(re.findall(r"^\| `([a-z-]+)` \| (error|warning|info) \|", table, flags=re.M))
    assert rows == {code: severity for code, (severity, _) in CODES.items()}


def test_an_adapter_reloads_on_its_local_base_with_resized_embeddings(tmp_path):
    """LoRA with modules_to_save on resized embeddings over a base saved in a local directory: --reload builds the
    base, resizes it to the adapter's embedding rows, loads the adapter and gives back the reference logits."""
    import ftshims.monitor
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    tiny.tiny_llama(attn="sdpa").save_pretrained(tmp_path / "base")
    with tiny.quiet():
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="sdpa")
        torch.manual_seed(3)
        model.resize_token_embeddings(136)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 modules_to_save=["embed_tokens", "lm_head"], task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": r, "labels": r.clone()} for r in torch.randint(3, 136, (4, 8), generator=g)]
    args = TrainingArguments(str(tmp_path / "run"), per_device_train_batch_size=2, max_steps=2, save_steps=2,
                             report_to=[], use_cpu=True, disable_tqdm=True, logging_strategy="no", learning_rate=1e-2)
    with tiny.quiet():
        Trainer(model=model, args=args, train_dataset=rows, callbacks=[ftshims.monitor.callback()]).train()
    code, report, found = doctor_json(tmp_path / "run" / "checkpoint-2", "--reload")
    assert code == 0, report["findings"]
    assert report["facts"]["reload"]["identical"], report["facts"]["reload"]
