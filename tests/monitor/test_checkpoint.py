"""The monitor verifies each Trainer save (detectors/checkpoint.py): the files against the weights in memory, a
manifest with SHA-256 and reference logits beside them; a healthy run gives no finding and trains bit-identically
with the monitor on and off; a broken save gives one finding per kind, naming the tensor; the codes turn off like
the others (and then nothing is written)."""

import json
import os

import pytest
import torch

from ftshims import tiny
from ftshims.checkpoint import MANIFEST_NAME

from .runs import default_stack_only

pytestmark = [default_stack_only]

CODES = ("checkpoint_key_missing", "checkpoint_tensor_empty", "checkpoint_tensor_changed")


def rows(n=8):
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": r, "labels": r.clone()} for r in torch.randint(3, 128, (n, 8), generator=g)]


def model_for(kind):
    model = tiny.tiny_llama(attn="sdpa", tie_word_embeddings=kind == "tied", attention_dropout=0.1)
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(3)
        with tiny.quiet():
            model.resize_token_embeddings(136)
            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                     modules_to_save=["embed_tokens", "lm_head"], task_type="CAUSAL_LM"))
    return model


def train(out, kind="tied", callbacks=(), monitor=True, **options):
    import ftshims.monitor
    from transformers import Trainer, TrainingArguments

    callback = ftshims.monitor.callback(**options) if monitor else None
    args = TrainingArguments(str(out), per_device_train_batch_size=2, max_steps=4, save_steps=2, report_to=[],
                             use_cpu=True, disable_tqdm=True, logging_strategy="no", learning_rate=1e-2, seed=0)
    losses = []

    class Losses(Trainer):
        def compute_loss(self, model, inputs, *a, **k):
            loss = super().compute_loss(model, inputs, *a, **k)
            losses.append(float(loss.detach()))
            return loss

    every = list(callbacks) + ([callback] if callback else [])
    with tiny.quiet():
        trainer = Losses(model=model_for(kind), args=args, train_dataset=rows(), callbacks=every)
        trainer.train()
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return callback, losses, weights


@pytest.mark.parametrize("kind", ["tied", "lora"])
def test_healthy_saves_verified_manifest_written_and_training_unchanged(tmp_path, kind):
    """Full fine-tune with tied embeddings and dropout; LoRA with modules_to_save on resized embeddings: no finding,
    a manifest listing every file of each checkpoint with its SHA-256, reference logits; the run with the monitor
    equals the run without it bit for bit (the save's 4-token eval forward draws no random number)."""
    from ftshims.checkpoint import manifest

    callback, losses, weights = train(tmp_path / "on", kind)
    _, plain_losses, plain_weights = train(tmp_path / "off", kind, monitor=False)
    assert [f.code for f in callback.findings if f.code in CODES] == []
    assert losses == plain_losses
    assert all(torch.equal(weights[n], plain_weights[n]) for n in weights)
    for step in (2, 4):
        folder = tmp_path / "on" / f"checkpoint-{step}"
        found, why = manifest.read(str(folder))
        assert why is None and found["written_by"] == "ftshims.monitor" and found["global_step"] == step
        assert set(found["files"]) == set(manifest.files_under(str(folder)))
        assert manifest.check(str(folder), found) == []
        assert found["reference"]["file"] == manifest.REFERENCE_NAME and found["tensors"]
    assert not (tmp_path / "off" / "checkpoint-2" / MANIFEST_NAME).exists()


def test_broken_save_gives_one_finding_per_kind(tmp_path):
    """A callback that runs before the monitor rewrites the saved weights: one tensor dropped, one zeroed, one cast
    to float16 and one with other values. Each kind is named with its tensor."""
    from safetensors.torch import load_file, save_file
    from transformers import TrainerCallback

    class BreakTheSave(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}", "model.safetensors")
            tensors = load_file(path)
            del tensors["model.norm.weight"]
            tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros_like(tensors["model.layers.0.mlp.up_proj.weight"])
            tensors["model.layers.1.self_attn.o_proj.weight"] = tensors["model.layers.1.self_attn.o_proj.weight"].half()
            tensors["model.layers.1.mlp.down_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"] + 1e-3
            save_file(tensors, path, metadata={"format": "pt"})

    callback, _, _ = train(tmp_path, "tied", callbacks=[BreakTheSave()])
    found = {f.code: f for f in callback.findings if f.code in CODES}
    assert set(found) == set(CODES), [f.line() for f in callback.findings]
    assert found["checkpoint_key_missing"].detail["tensors"] == ["model.norm.weight"]
    assert found["checkpoint_tensor_empty"].detail["tensors"] == ["model.layers.0.mlp.up_proj.weight"]
    assert sorted(found["checkpoint_tensor_changed"].detail["tensors"]) == ["model.layers.1.mlp.down_proj.weight",
                                                                    "model.layers.1.self_attn.o_proj.weight"]
    assert "float16 [64, 64] on disk, float32 [64, 64] in memory" in found["checkpoint_tensor_changed"].message
    assert found["checkpoint_key_missing"].step == 2 and "checkpoint-2" in found["checkpoint_key_missing"].message


def test_codes_turn_off_like_the_others(tmp_path):
    callback, _, _ = train(tmp_path, "tied", off=list(CODES))
    assert callback.findings == [] or all(f.code not in CODES for f in callback.findings)
    assert not (tmp_path / "checkpoint-2" / MANIFEST_NAME).exists()
    with pytest.raises(ValueError, match="checkpoint_key_mising"):
        import ftshims.monitor

        ftshims.monitor.callback(off=["checkpoint_key_mising"])


def test_custom_loop_saved(tmp_path):
    """Monitor.saved() after a save_pretrained in a custom loop: the same check and manifest."""
    import ftshims.monitor

    model = model_for("tied")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = ftshims.monitor.Monitor(model, optimizer)
    batch = tiny.batch()
    with tiny.quiet():
        model(**batch).loss.backward()
    optimizer.step()
    mon.after_step()
    model.save_pretrained(tmp_path)
    mon.saved(str(tmp_path))
    mon.close()
    assert [f.code for f in mon.findings if f.code in CODES] == []
    assert json.loads((tmp_path / MANIFEST_NAME).read_text())["global_step"] == 1


def test_a_save_that_renames_tensors_is_compared_on_the_shared_names_only():
    """transformers 5 saves MoE experts one tensor each where the model holds them fused: no false 'missing'; the
    tensors both name are still compared."""
    from ftshims.checkpoint.verify import compare_saved

    memory = {"a": torch.ones(2), "experts.gate_up_proj": torch.ones(2, 4, 3)}
    disk = {"a": torch.ones(2), "experts.0.w1.weight": torch.ones(3, 2), "experts.0.w3.weight": torch.ones(3, 2)}
    assert compare_saved(disk, memory) == ([], ["experts.0.w1.weight", "experts.0.w3.weight"])
    disk["a"] = torch.zeros(2)
    problems, renamed = compare_saved(disk, memory)
    assert [p["problem"] for p in problems] == ["zero"] and renamed
    problems, renamed = compare_saved({"a": torch.ones(2)}, memory)  # same naming: a missing tensor is reported
    assert [(p["problem"], p["key"]) for p in problems] == [("missing", "experts.gate_up_proj")] and renamed == []


def test_mixtral_saves_verified_without_a_false_finding(tmp_path):
    """A tiny Mixtral through the Trainer (on transformers 5 its experts are saved one tensor each)."""
    import ftshims.monitor
    from transformers import Trainer, TrainingArguments

    model = tiny.causal_lm("MixtralConfig", attn="sdpa", vocab_size=128, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, num_local_experts=2)
    callback = ftshims.monitor.callback()
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=2, max_steps=2, save_steps=2, report_to=[],
                             use_cpu=True, disable_tqdm=True, logging_strategy="no")
    with tiny.quiet():
        Trainer(model=model, args=args, train_dataset=rows(4), callbacks=[callback]).train()
    assert [f.code for f in callback.findings if f.code in CODES] == []
    assert (tmp_path / "checkpoint-2" / MANIFEST_NAME).is_file()
