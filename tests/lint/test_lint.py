"""Setup lint (``--model/--adapter/--tokenizer/--deepspeed/--train-config``): every rule fires on a fixture made to
trigger it and stays silent on one that does not. Fixtures: tests/fixtures/lint/ (tiny configs; the models are
built on the meta device from config.json, tokenizers are tiny WordLevel ones)."""

from __future__ import annotations

import builtins
import json
import re
import os
import sys
from pathlib import Path

import pytest

from ftshims import lint
from ftshims.doctor import cli
from ftshims.lint import findings as findings_mod
from ftshims.lint import rules as rules_mod

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "lint"
LLAMA = str(FIX / "models" / "llama_tiny")
GPT2 = str(FIX / "models" / "gpt2_tiny")
SEQCLS = str(FIX / "models" / "llama_seqcls")


def p(*parts: str) -> str:
    return str(FIX.joinpath(*parts))


def run(**inputs):
    shim_rows = inputs.pop("shim_rows", None)
    return lint.run(lint.Inputs(**inputs), shim_rows=shim_rows)


def rules_of(found, rule=None):
    return [f for f in found if rule is None or f["rule"] == rule]


# (rule, trigger inputs, clean inputs, expected severity of the trigger)
CASES = [
    ("config-invalid", dict(adapter=p("adapters", "broken.json")), dict(adapter=p("adapters", "ok.json")), "error"),
    ("file-unreadable", dict(deepspeed=p("ds", "missing.json")), dict(deepspeed=p("ds", "ok_z3.json")), "error"),
    ("config-invalid", dict(train_config=p("train", "broken.yaml")), dict(train_config=p("train", "lf_ok.yaml")), "error"),
    ("config-invalid", dict(train_config=p("train", "hf_invalid.json")), dict(train_config=p("train", "hf_ok.json")), "error"),
    ("file-unreadable", dict(tokenizer=p("tokenizers", "nope")), dict(tokenizer=p("tokenizers", "pad_ok")), "error"),
    ("model-config-invalid", dict(model=p("models", "unknown_type")), dict(model=LLAMA), "error"),
    ("model-config-invalid", dict(model=p("models", "no_type")), dict(model=GPT2), "error"),
    ("train-config-unknown-key", dict(train_config=p("train", "lf_unknown_key.yaml")), dict(train_config=p("train", "lf_ok.yaml")), "warning"),
    ("train-config-unknown-key", dict(train_config=p("train", "hf_unknown_key.json")), dict(train_config=p("train", "hf_mismatch.json")), "warning"),
    ("adapter-config-unknown-key", dict(adapter=p("adapters", "unknown_key.json")), dict(adapter=p("adapters", "ok.json")), "warning"),
    ("lora-target-no-match", dict(model=LLAMA, adapter=p("adapters", "no_match.json")), dict(model=LLAMA, adapter=p("adapters", "ok.json")), "error"),
    ("lora-target-no-match", dict(model=LLAMA, adapter=p("adapters", "regex_no_match.json")), dict(model=GPT2, adapter=p("adapters", "gpt2_ok.json")), "error"),
    ("lora-target-partial-match", dict(model=LLAMA, adapter=p("adapters", "typo.json")), dict(model=LLAMA, adapter=p("adapters", "ok.json")), "warning"),
    ("lora-target-partial-match", dict(model=LLAMA, train_config=p("train", "lf_lora_target_typo.yaml")), dict(model=LLAMA, train_config=p("train", "lf_ok.yaml")), "warning"),
    ("lora-target-unsupported-module", dict(model=LLAMA, adapter=p("adapters", "blocks.json")), dict(model=LLAMA, adapter=p("adapters", "ok.json")), "error"),
    ("modules-to-save-tied", dict(model=GPT2, adapter=p("adapters", "gpt2_tied.json")), dict(model=GPT2, adapter=p("adapters", "gpt2_ok.json")), "warning"),
    ("tokenizer-load-failed", dict(tokenizer=p("tokenizers", "broken")), dict(tokenizer=p("tokenizers", "no_pad")), "error"),
    ("tokenizer-no-pad", dict(tokenizer=p("tokenizers", "no_pad")), dict(tokenizer=p("tokenizers", "pad_ok")), "warning"),
    ("tokenizer-no-pad", dict(tokenizer=p("tokenizers", "no_pad"), train_config=p("train", "lf_ok.yaml")), dict(tokenizer=p("tokenizers", "pad_eos"), train_config=p("train", "lf_ok.yaml")), "info"),
    ("pad-is-eos", dict(tokenizer=p("tokenizers", "pad_eos")), dict(tokenizer=p("tokenizers", "pad_ok")), "warning"),
    ("label-smoothing-unshifted", dict(model=p("models", "qwen1_remote"), train_config=p("train", "hf_label_smoothing.json")), dict(model=LLAMA, train_config=p("train", "hf_label_smoothing.json")), "warning"),
    ("chat-template-missing", dict(tokenizer=p("tokenizers", "no_pad"), train_config=p("train", "hf_chat.json")), dict(tokenizer=p("tokenizers", "pad_ok"), train_config=p("train", "hf_chat.json")), "error"),
    ("chat-template-missing", dict(tokenizer=p("tokenizers", "no_pad"), train_config=p("train", "lf_no_template.yaml")), dict(tokenizer=p("tokenizers", "pad_ok"), train_config=p("train", "lf_no_template.yaml")), "warning"),
    ("chat-template-missing", dict(train_config=p("train", "lf_bad_template.yaml")), dict(train_config=p("train", "lf_ok.yaml")), "warning"),
    ("seq-len-exceeds-positions", dict(model=GPT2, train_config=p("train", "lf_long.yaml")), dict(model=GPT2, train_config=p("train", "lf_ok.yaml")), "error"),
    ("seq-len-exceeds-positions", dict(model=LLAMA, train_config=p("train", "hf_long.json")), dict(model=LLAMA, train_config=p("train", "hf_ok.json")), "warning"),
    ("ds-unknown-key", dict(deepspeed=p("ds", "unknown.json")), dict(deepspeed=p("ds", "ok_z3.json")), "error"),
    ("ds-misplaced-key", dict(deepspeed=p("ds", "misplaced.json")), dict(deepspeed=p("ds", "ok_z3.json")), "error"),
    ("ds-misplaced-key", dict(deepspeed=p("ds", "misplaced_params.json")), dict(deepspeed=p("ds", "mismatch.json")), "error"),
    ("ds-zero3-device-map", dict(train_config=p("train", "hf_zero3_load.json")), dict(train_config=p("train", "lf_ok.yaml")), "error"),
    ("ds-offload-stage", dict(deepspeed=p("ds", "offload_stage.json")), dict(deepspeed=p("ds", "ok_z3.json")), "error"),
    ("ds-offload-stage", dict(deepspeed=p("ds", "offload_stage0.json")), dict(deepspeed=p("ds", "misplaced_params.json")), "error"),
    ("ds-fp16-bf16-both", dict(deepspeed=p("ds", "both_precisions.json")), dict(deepspeed=p("ds", "ok_z3.json")), "error"),
    ("ds-train-mismatch", dict(deepspeed=p("ds", "mismatch.json"), train_config=p("train", "hf_mismatch.json")), dict(deepspeed=p("ds", "ok_z3.json"), train_config=p("train", "hf_mismatch.json")), "error"),
    ("packing-contamination", dict(train_config=p("train", "lf_packing_fa2.yaml")), dict(train_config=p("train", "lf_ok.yaml")), "warning"),
    ("full-finetune-half-weights", dict(model=LLAMA, train_config=p("train", "trl_full_bf16.json")), dict(model=LLAMA, train_config=p("train", "hf_ok.json")), "warning"),
    ("llamafactory-packing-cutoff-len", dict(train_config=p("train", "lf_packing_cutoff_odd.yaml")), dict(train_config=p("train", "lf_ok.yaml")), "error"),
]


@pytest.mark.parametrize("rule,trigger,clean,severity", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_rule_triggers_and_stays_silent(rule, trigger, clean, severity):
    hits = rules_of(run(**trigger), rule)
    assert hits, f"{rule} did not fire on {trigger}"
    assert severity in {h["severity"] for h in hits}, hits
    for hit in hits:
        assert hit["message"] and hit["fix"] and hit["ref"], hit
        assert set(hit) == {"rule", "severity", "message", "fix", "ref", "file", "key", "explain"}
        assert hit["explain"] == f"python -m ftshims.doctor --explain {rule}"
        assert hit["ref"].startswith(("https://", "python -m ftshims.doctor --explain"))  # an installed package has no docs/
    assert not rules_of(run(**clean), rule), f"{rule} fired on the clean fixture {clean}"


def test_every_rule_has_a_trigger_and_a_clean_case():
    covered = {case[0] for case in CASES} | {"yaml-unsupported", "gc-peft-reentrant", "lint-rule-failed", "seqcls-pad-in-text"}
    assert covered == set(findings_mod.RULES)


# -- rules whose trigger depends on the stack or the environment ------------------------------------

LORA_SHIM = "lora_reentrant_checkpointing"


@pytest.mark.parametrize(
    "verdict,severity", [("unpatched", "error"), ("patched", "info")], ids=["shim-not-applied", "shim-applied"]
)
def test_gc_peft_reentrant(verdict, severity):
    rows = [{"id": LORA_SHIM, "affected": True, "verdict": verdict, "status": "disabled" if verdict == "unpatched" else "applied",
             "reason": "disabled by FTSHIMS_DISABLE" if verdict == "unpatched" else "transformers 4.57.6"}]
    hits = rules_of(run(train_config=p("train", "hf_gc.json"), adapter=p("adapters", "ok.json"), shim_rows=rows), "gc-peft-reentrant")
    assert [h["severity"] for h in hits] == [severity]
    assert "use_reentrant" in hits[0]["fix"]
    if verdict == "unpatched":
        assert "not applied here: disabled" in hits[0]["message"]
    # clean: non-reentrant checkpointing; LLaMA-Factory (its own checkpointing function); a stack outside the range
    assert not rules_of(run(train_config=p("train", "hf_ok.json"), adapter=p("adapters", "ok.json"), shim_rows=rows), "gc-peft-reentrant")
    assert not rules_of(run(train_config=p("train", "lf_gc.yaml"), shim_rows=rows), "gc-peft-reentrant")
    outside = [dict(rows[0], affected=False, verdict="not affected")]
    assert not rules_of(run(train_config=p("train", "hf_gc.json"), adapter=p("adapters", "ok.json"), shim_rows=outside), "gc-peft-reentrant")


def test_gc_peft_reentrant_from_the_registry_on_this_stack():
    """Without the doctor's rows the registry decides: it fires exactly where the shim's range says so."""
    from ftshims.probing import in_affected_range

    hits = rules_of(run(train_config=p("train", "hf_gc.json"), adapter=p("adapters", "ok.json")), "gc-peft-reentrant")
    assert bool(hits) == in_affected_range(LORA_SHIM)[0]


def test_yaml_without_pyyaml_is_an_info_finding(monkeypatch):
    real_import = builtins.__import__

    def no_yaml(name, *args, **kwargs):
        if name == "yaml":
            raise ImportError("no yaml here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_yaml)
    monkeypatch.delitem(sys.modules, "yaml", raising=False)
    found = run(train_config=p("train", "lf_ok.yaml"))
    assert [f["rule"] for f in found] == ["yaml-unsupported"] and found[0]["severity"] == "info"
    assert not rules_of(run(train_config=p("train", "hf_ok.json")), "yaml-unsupported")  # JSON needs no PyYAML


def test_a_rule_that_raises_is_reported_and_the_others_run(monkeypatch):
    def broken(ctx):
        raise RuntimeError("rule bug")

    monkeypatch.setattr(rules_mod, "CHECKS", (broken,) + tuple(rules_mod.CHECKS))
    found = run(model=LLAMA, adapter=p("adapters", "typo.json"))
    failed = rules_of(found, "lint-rule-failed")
    assert len(failed) == 1 and "RuntimeError: rule bug" in failed[0]["message"]
    assert rules_of(found, "lora-target-partial-match")  # the other rules still ran
    monkeypatch.undo()
    assert not rules_of(run(model=LLAMA, adapter=p("adapters", "ok.json")), "lint-rule-failed")


# -- packing x versions (the registry's packing shims) ----------------------------------------------


def with_versions(monkeypatch, **versions):
    import ftshims.versions as v

    real = v.installed_versions

    def fake(names):
        out = real(names)
        out.update({k.replace("_", "-"): val for k, val in versions.items()})
        return out

    monkeypatch.setattr(v, "installed_versions", fake)


def packing_rows(applies: bool):
    return [
        {"id": shim, "affected": True, "verdict": "patched" if applies else "unpatched", "status": "applied" if applies else "disabled",
         "reason": "in range" if applies else "disabled by FTSHIMS_DISABLE"}
        for shim in ("packing_block_mask", "trl_padding_free_position_ids")
    ]


def test_pad_is_eos_depends_on_the_collator(monkeypatch):
    with_versions(monkeypatch, trl="0.24.0")
    sft = run(tokenizer=p("tokenizers", "pad_eos"), train_config=p("train", "hf_packing_fa2.json"))
    assert [h["severity"] for h in rules_of(sft, "pad-is-eos")] == ["info"]  # TRL >= 0.16.1 pads labels by position
    with_versions(monkeypatch, trl="0.12.2")
    sft = run(tokenizer=p("tokenizers", "pad_eos"), train_config=p("train", "hf_packing_fa2.json"))
    assert [h["severity"] for h in rules_of(sft, "pad-is-eos")] == ["warning"]
    assert not rules_of(run(tokenizer=p("tokenizers", "pad_eos"), train_config=p("train", "lf_ok.yaml")), "pad-is-eos")


def test_packing_by_design_contamination_in_old_trl(monkeypatch):
    with_versions(monkeypatch, trl="0.12.2", transformers="4.46.3")
    hits = rules_of(run(train_config=p("train", "hf_packing.json")), "packing-contamination")
    assert [h["severity"] for h in hits] == ["warning"] and "ConstantLengthDataset" in hits[0]["message"]


@pytest.mark.parametrize("applies,severity", [(True, "info"), (False, "error")])
def test_packing_fixed_by_a_shim_or_not(monkeypatch, applies, severity):
    with_versions(monkeypatch, trl="0.19.1", transformers="4.53.3")
    hits = rules_of(run(train_config=p("train", "hf_packing.json"), shim_rows=packing_rows(applies)), "packing-contamination")
    assert [h["severity"] for h in hits] == [severity]
    assert "trl_padding_free_position_ids" in hits[0]["message"]
    # LLaMA-Factory's non-neat packing under sdpa: the block-mask shim
    hits = rules_of(run(train_config=p("train", "lf_packing_sdpa.yaml"), shim_rows=packing_rows(applies)), "packing-contamination")
    assert [h["severity"] for h in hits] == [severity] and "packing_block_mask" in hits[0]["message"]


def test_packing_isolated_stacks_are_clean(monkeypatch):
    with_versions(monkeypatch, trl="0.24.0", transformers="4.57.6", torch="2.13.0")
    assert not rules_of(run(train_config=p("train", "hf_packing.json")), "packing-contamination")
    with_versions(monkeypatch, trl="0.19.1", transformers="4.53.3")
    assert not rules_of(run(train_config=p("train", "hf_packing_fa2.json")), "packing-contamination")  # FA varlen
    with_versions(monkeypatch, trl="0.24.0", transformers="4.57.6", torch="2.5.1")
    hits = rules_of(run(train_config=p("train", "hf_packing.json"), shim_rows=packing_rows(True)), "packing-contamination")
    assert hits and "torch 2.5.1" in hits[0]["message"]  # 4.53.1-4.57 skip packed-sequence detection below torch 2.6


def test_zero3_low_cpu_mem_usage_depends_on_transformers(monkeypatch):
    with_versions(monkeypatch, transformers="4.46.3")
    hits = rules_of(run(train_config=p("train", "hf_zero3_load.json")), "ds-zero3-device-map")
    assert sorted(h["severity"] for h in hits) == ["error", "error"]  # device_map, and low_cpu_mem_usage < 4.51
    with_versions(monkeypatch, transformers="4.57.6")
    hits = rules_of(run(train_config=p("train", "hf_zero3_load.json")), "ds-zero3-device-map")
    assert sorted(h["severity"] for h in hits) == ["error", "info"]


def shim_rows_for(shim: str, applies: bool, affected: bool = True):
    return [{"id": shim, "affected": affected, "verdict": "patched" if applies else ("unpatched" if affected else "not affected"),
             "status": "applied" if applies else "disabled", "reason": "in range" if applies else "disabled by FTSHIMS_DISABLE"}]


# -- sequence-classification heads on transformers < 4.49 (seqcls_pools_before_first_pad) ---------------

SEQCLS_SHIM = "seqcls_pools_before_first_pad"


@pytest.mark.parametrize("applies,severity", [(True, "info"), (False, "warning")], ids=["shim-applied", "shim-not-applied"])
def test_seqcls_pad_in_text_fires_below_4_49(monkeypatch, applies, severity):
    with_versions(monkeypatch, transformers="4.46.3")
    rows = shim_rows_for(SEQCLS_SHIM, applies)
    pad_eos = p("tokenizers", "pad_eos")
    for trigger, source in (
        (dict(model=SEQCLS), "LlamaForSequenceClassification"),  # config.json architectures
        (dict(train_config=p("train", "hf_reward.json")), "center_rewards_coefficient"),  # a TRL RewardConfig, model unknown
        (dict(model=LLAMA, train_config=p("train", "hf_reward.json")), "center_rewards_coefficient"),  # reward head on a causal LM config
        (dict(model=LLAMA, adapter=p("adapters", "seq_cls.json")), "task_type: SEQ_CLS"),
    ):
        hits = rules_of(run(tokenizer=pad_eos, shim_rows=rows, **trigger), "seqcls-pad-in-text")
        assert [h["severity"] for h in hits] == [severity], (trigger, hits)
        (hit,) = hits
        assert source in hit["message"] and "4.46.3" in hit["message"] and "0.693" in hit["message"]
        assert SEQCLS_SHIM in hit["message"] and ("not applied here" in hit["message"]) == (not applies)
        assert "ftshims.apply()" in hit["fix"] and "distinct pad token" in hit["fix"] and ">= 4.49" in hit["fix"]
        assert hit["file"] == pad_eos and hit["key"] == "pad_token"
    # clean: a distinct pad token; a causal LM; LLaMA-Factory stage rm (value head, pooled by the attention mask);
    # an encoder-free unknown model without any reward hint
    assert not rules_of(run(model=SEQCLS, tokenizer=p("tokenizers", "pad_ok"), shim_rows=rows), "seqcls-pad-in-text")
    assert not rules_of(run(model=LLAMA, tokenizer=pad_eos, shim_rows=rows), "seqcls-pad-in-text")
    assert not rules_of(run(model=GPT2, tokenizer=pad_eos, train_config=p("train", "hf_ok.json"), shim_rows=rows), "seqcls-pad-in-text")
    assert not rules_of(run(tokenizer=pad_eos, train_config=p("train", "lf_rm.yaml"), shim_rows=rows), "seqcls-pad-in-text")


def test_seqcls_pad_in_text_follows_trls_pad_token_setting(monkeypatch, tmp_path):
    with_versions(monkeypatch, transformers="4.46.3")
    config = tmp_path / "reward.json"
    rows = shim_rows_for(SEQCLS_SHIM, True)
    config.write_text(json.dumps({"output_dir": "out", "center_rewards_coefficient": 0.01, "pad_token": "<pad>"}))
    assert not rules_of(run(model=SEQCLS, tokenizer=p("tokenizers", "pad_eos"), train_config=str(config), shim_rows=rows), "seqcls-pad-in-text")
    config.write_text(json.dumps({"output_dir": "out", "center_rewards_coefficient": 0.01, "pad_token": "</s>"}))
    (hit,) = rules_of(run(model=SEQCLS, tokenizer=p("tokenizers", "pad_ok"), train_config=str(config), shim_rows=rows), "seqcls-pad-in-text")
    assert hit["file"] == str(config) and hit["key"] == "pad_token"


def test_seqcls_pad_in_text_is_silent_from_4_49(monkeypatch):
    for version in ("4.49.0", "4.57.6"):
        with_versions(monkeypatch, transformers=version)
        found = run(model=SEQCLS, tokenizer=p("tokenizers", "pad_eos"), shim_rows=shim_rows_for(SEQCLS_SHIM, False, affected=False))
        assert not rules_of(found, "seqcls-pad-in-text"), version


def test_seqcls_pad_in_text_reads_config_pad_without_a_tokenizer(monkeypatch, tmp_path):
    with_versions(monkeypatch, transformers="4.46.3")
    data = json.loads((FIX / "models" / "llama_seqcls" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(data, pad_token_id=2, eos_token_id=[2, 5])))
    (hit,) = rules_of(run(model=str(tmp_path), shim_rows=shim_rows_for(SEQCLS_SHIM, True)), "seqcls-pad-in-text")
    assert hit["severity"] == "info" and "pad_token_id 2 is an eos id" in hit["message"] and hit["key"] == "pad_token_id"
    (tmp_path / "config.json").write_text(json.dumps(dict(data, pad_token_id=0, eos_token_id=2)))
    assert not rules_of(run(model=str(tmp_path), shim_rows=shim_rows_for(SEQCLS_SHIM, True)), "seqcls-pad-in-text")


def test_seqcls_pad_in_text_on_this_stack():
    """Without faked versions or the doctor's rows: fires exactly below 4.49, info where apply() would fix it."""
    from packaging.version import Version

    from ftshims.versions import installed_version

    hits = rules_of(run(model=SEQCLS, tokenizer=p("tokenizers", "pad_eos")), "seqcls-pad-in-text")
    assert bool(hits) == (Version(installed_version("transformers")) < Version("4.49"))
    if hits:
        state = lint.Context(lint.Inputs()).shim_state(SEQCLS_SHIM)
        assert [h["severity"] for h in hits] == ["info" if state["applies"] else "warning"]


# -- label smoothing x PEFT (label_smoothing_peft_unshifted) -------------------------------------------

LS_SHIM = "label_smoothing_peft_unshifted"
LS_TRAIN = p("train", "hf_label_smoothing.json")


def label_smoothing(adapter, rows, **extra):
    return rules_of(run(model=LLAMA, adapter=p("adapters", adapter), train_config=LS_TRAIN, shim_rows=rows, **extra),
                    "label-smoothing-unshifted")


@pytest.mark.parametrize("applies,severity", [(True, "info"), (False, "warning")], ids=["shim-applied", "shim-not-applied"])
def test_label_smoothing_peft_versions(monkeypatch, applies, severity):
    rows = shim_rows_for(LS_SHIM, applies)
    # (transformers, adapter) -> fires: LoRA-style unshifted < 4.36; prefix tuning < 4.32 and from 4.36
    table = [
        ("4.31.0", "ok.json", True), ("4.35.2", "ok.json", True), ("4.36.2", "ok.json", False), ("4.57.6", "ok.json", False),
        ("4.31.0", "prefix.json", True), ("4.33.3", "prefix.json", False), ("4.35.2", "prefix.json", False),
        ("4.36.2", "prefix.json", True), ("4.57.6", "prefix.json", True),
    ]
    for version, adapter, fires in table:
        with_versions(monkeypatch, transformers=version)
        hits = label_smoothing(adapter, rows)
        assert bool(hits) == fires, (version, adapter, hits)
        if hits:
            (hit,) = hits
            assert hit["severity"] == severity, (version, adapter)
            assert LS_SHIM in hit["message"] and LS_SHIM in hit["fix"] and version in hit["message"]
            assert ("not applied here" in hit["message"]) == (not applies)
            assert hit["file"] == LS_TRAIN and hit["key"] == "label_smoothing_factor"
            assert ("headless backbone" in hit["message"]) == (adapter == "prefix.json" and version >= "4.36")


@pytest.mark.parametrize("applies,severity", [(True, "info"), (False, "warning")], ids=["shim-applied", "shim-not-applied"])
def test_label_smoothing_prompt_tuning_is_a_shape_error_on_every_version(monkeypatch, applies, severity):
    """Every version raises the shape error; label_smoothing_peft_unshifted (0.2.0) fixes it where it applies."""
    for version in ("4.31.0", "4.35.2", "4.57.6"):
        with_versions(monkeypatch, transformers=version)
        (hit,) = label_smoothing("prompt_tuning.json", shim_rows_for(LS_SHIM, applies))
        assert hit["severity"] == severity and "shape error" in hit["message"] and "PROMPT_TUNING" in hit["message"]
        assert LS_SHIM in hit["message"] and LS_SHIM in hit["fix"]
        assert ("not applied here" in hit["message"]) == (not applies)


def test_label_smoothing_cases_no_shim_covers(monkeypatch):
    with_versions(monkeypatch, transformers="4.35.2")
    rows = shim_rows_for(LS_SHIM, True)
    # remote-code causal LM + LoRA: the shim needs a registered causal LM inside, so it stays a warning
    found = run(model=p("models", "qwen1_remote"), adapter=p("adapters", "ok.json"), train_config=LS_TRAIN, shim_rows=rows)
    (hit,) = rules_of(found, "label-smoothing-unshifted")
    assert hit["severity"] == "warning" and "QWenLMHeadModel" in hit["message"] and "No shim covers" in hit["message"]
    # a sequence-classification adapter is not a causal LM: nothing to shift
    assert not label_smoothing("seq_cls.json", rows)
    # no PEFT at all
    assert not rules_of(run(model=LLAMA, train_config=LS_TRAIN, shim_rows=rows), "label-smoothing-unshifted")


def test_label_smoothing_reads_the_training_configs_peft(monkeypatch, tmp_path):
    rows = shim_rows_for(LS_SHIM, True)
    config = tmp_path / "train.json"
    with_versions(monkeypatch, transformers="4.57.6")
    config.write_text(json.dumps({"output_dir": "out", "label_smoothing_factor": 0.1,
                                  "peft_config": {"peft_type": "PREFIX_TUNING", "task_type": "CAUSAL_LM"}}))
    (hit,) = rules_of(run(model=LLAMA, train_config=str(config), shim_rows=rows), "label-smoothing-unshifted")
    assert hit["severity"] == "info" and "headless backbone" in hit["message"]
    with_versions(monkeypatch, transformers="4.35.2")
    config.write_text(json.dumps({"output_dir": "out", "label_smoothing_factor": 0.1, "use_peft": True}))
    (hit,) = rules_of(run(model=LLAMA, train_config=str(config), shim_rows=rows), "label-smoothing-unshifted")
    assert hit["severity"] == "info" and "LORA" in hit["message"]


# -- details --------------------------------------------------------------------------------------


def test_lora_suggestions_name_the_linear_layers():
    (hit,) = rules_of(run(model=LLAMA, adapter=p("adapters", "no_match.json")), "lora-target-no-match")
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert name in hit["message"]
    assert "lm_head" not in hit["message"]
    (hit,) = rules_of(run(model=LLAMA, adapter=p("adapters", "typo.json")), "lora-target-partial-match")
    assert "'v_prj' → 'v_proj'" in hit["fix"]
    (hit,) = rules_of(run(model=LLAMA, adapter=p("adapters", "blocks.json")), "lora-target-unsupported-module")
    # the attention class is LlamaAttention, or LlamaSdpaAttention on 4.36-4.47
    assert re.search(r"Llama\w*Attention", hit["message"]) and "LlamaRMSNorm" in hit["message"] and "q_proj" in hit["fix"]


def test_deepspeed_details():
    found = run(deepspeed=p("ds", "unknown.json"))
    by_key = {f["key"]: f for f in rules_of(found, "ds-unknown-key")}
    assert by_key["steps_per_prnt"]["severity"] == "warning" and "steps_per_print" in by_key["steps_per_prnt"]["fix"]
    assert by_key["zero_optimization.stage3_prefetch_bucket"]["severity"] == "error"
    (hit,) = rules_of(run(deepspeed=p("ds", "misplaced.json")), "ds-misplaced-key")
    assert hit["key"] == "optimizer.offload" and "zero_optimization.offload_optimizer" in hit["message"]
    found = run(deepspeed=p("ds", "mismatch.json"), train_config=p("train", "hf_mismatch.json"))
    keys = sorted(f["key"] for f in rules_of(found, "ds-train-mismatch"))
    assert keys == ["gradient_clipping", "optimizer.params.lr", "train_batch_size", "train_micro_batch_size_per_gpu"]


def test_deepspeed_file_is_found_through_the_training_config():
    found = run(train_config=p("train", "hf_zero3_load.json"))
    assert all(f["file"] != p("train", "hf_zero3_load.json") or f["rule"] != "file-unreadable" for f in found)
    assert rules_of(found, "ds-zero3-device-map")  # ZeRO-3 came from ../ds/ok_z3.json, relative to the config


def test_a_missing_referenced_deepspeed_file_is_a_warning(tmp_path):
    config = tmp_path / "train.json"
    config.write_text(json.dumps({"output_dir": "out", "deepspeed": "configs/ds_z3.json"}))
    (hit,) = rules_of(run(train_config=str(config)), "file-unreadable")
    assert hit["severity"] == "warning" and "--deepspeed" in hit["fix"]
    config.write_text(json.dumps({"output_dir": "out", "deepspeed": {"zero_optimization": {"stage": 3, "offload": {}}}}))
    (hit,) = rules_of(run(train_config=str(config)), "ds-misplaced-key")  # an inline DeepSpeed dict is linted too
    assert "(inline `deepspeed`)" in hit["file"]


def test_model_found_through_model_name_or_path():
    found = run(train_config=p("train", "lf_lora_target_typo.yaml").replace("lf_lora_target_typo", "lf_ok"))
    assert not rules_of(found, "model-config-invalid")


def test_skeleton_model_is_on_meta_and_fast():
    import time

    from ftshims.lint.model import build_model

    data = json.loads((FIX / "realistic" / "model" / "config.json").read_text())
    started = time.perf_counter()
    model = build_model(data)
    assert time.perf_counter() - started < 20
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert model.config.num_hidden_layers == 32


# -- the realistic setup, through the CLI -----------------------------------------------------------


def test_realistic_setup_report(capsys):
    real = FIX / "realistic"
    cwd = os.getcwd()
    os.chdir(real)
    try:
        code = cli.main(
            ["--json", "--no-flash-attn", "--no-import", "--model", "model", "--adapter", "adapter", "--tokenizer", "tokenizer",
             "--train-config", "llamafactory_sft.yaml"]
        )
    finally:
        os.chdir(cwd)
    data = json.loads(capsys.readouterr().out)
    rules = {f["rule"]: f for f in data["findings"]}
    assert code == 1 == data["summary"]["exit_code"]
    assert rules["ds-misplaced-key"]["key"] == "optimizer.offload"
    assert rules["ds-train-mismatch"]["key"] == "train_micro_batch_size_per_gpu"
    assert "'o_prj' → 'o_proj'" in rules["lora-target-partial-match"]["fix"]
    assert rules["seq-len-exceeds-positions"]["severity"] == "warning"  # RoPE
    assert rules["tokenizer-no-pad"]["severity"] == "info"  # LLaMA-Factory sets pad = eos itself
    assert "packing-contamination" in rules
    assert {p["id"] for p in data["summary"]["problems"] if p["source"] == "finding"} == {"ds-misplaced-key", "ds-train-mismatch"}
    assert data["options"]["model"] == "model" and data["options"]["train_config"] == "llamafactory_sft.yaml"
    assert [f["severity"] for f in data["findings"]] == sorted(
        (f["severity"] for f in data["findings"]), key=["error", "warning", "info"].index
    )


def test_lint_without_files_is_clean_and_exit_0(capsys):
    code = cli.main(["--json", "--no-flash-attn", "--no-import", "--model", LLAMA, "--adapter", p("adapters", "ok.json"),
                     "--tokenizer", p("tokenizers", "pad_ok"), "--train-config", p("train", "hf_mismatch.json")])
    data = json.loads(capsys.readouterr().out)
    assert data["findings"] == [], data["findings"]
    assert "Setup lint: no findings." in data["summary"]["message"]


def test_version_dependent_training_keys():
    """gradient_checkpointing_kwargs exists from transformers 4.35: the lint judges keys by the installed version."""
    from ftshims.versions import installed_version
    from packaging.version import Version

    hits = rules_of(run(train_config=p("train", "hf_ok.json")), "train-config-unknown-key")
    expected = Version(installed_version("transformers")) < Version("4.35")
    assert bool(hits) == expected, hits
    if hits:
        assert "gradient_checkpointing_kwargs" in hits[0]["message"]


def test_invalid_configs_get_config_invalid_with_the_location(tmp_path):
    (hit,) = rules_of(run(train_config=p("train", "hf_invalid.json")), "config-invalid")
    assert "not valid JSON at line 5, column 3" in hit["message"] and "delimiter" in hit["message"]
    assert '"gradient_accumulation_steps": 8' in hit["message"]  # the offending line
    assert hit["fix"].startswith("fix the JSON syntax at line 5, column 3") and "comma" in hit["fix"]
    pytest.importorskip("yaml")
    (hit,) = rules_of(run(train_config=p("train", "broken.yaml")), "config-invalid")
    assert re.search(r"not valid YAML at line \d+, column \d+", hit["message"]), hit
    assert hit["fix"].startswith("fix the YAML syntax at line") and "indent" in hit["fix"]
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n- b\n")
    (hit,) = rules_of(run(train_config=str(listed)), "config-invalid")
    assert "not a mapping" in hit["message"]


def test_missing_or_unreadable_files_stay_file_unreadable(tmp_path):
    found = run(train_config=str(tmp_path / "nope.json"))
    assert [f["rule"] for f in found] == ["file-unreadable"]
    assert "no such file" in found[0]["message"]
    undecodable = tmp_path / "latin1.json"
    undecodable.write_bytes(b'{"a": "\xff\xfe\xe9"}')
    assert [f["rule"] for f in run(train_config=str(undecodable))] == ["file-unreadable"]


def test_explain_prints_a_rule_from_the_package(capsys):
    assert cli.main(["--explain", "config-invalid"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("config-invalid (default severity: error)")
    assert findings_mod.FIRES_WHEN["config-invalid"] in out
    assert cli.main(["--explain", "lora-target-no-match"]) == 0
    assert "https://huggingface.co/docs/peft" in capsys.readouterr().out  # the rule's reference


def test_explain_an_unknown_rule_is_a_usage_error_naming_close_matches(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--explain", "confg-invalid"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown rule 'confg-invalid'" in err and "config-invalid" in err and "model-config-invalid" in err
    with pytest.raises(SystemExit) as exc:
        cli.main(["--explain", "zzz"])
    assert exc.value.code == 2
    assert "known rules: file-unreadable" in capsys.readouterr().err  # nothing close: all of them


def test_rule_explanations_are_the_documented_table():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "doctor-json.md").read_text()
    table = doc.split("### Lint rules")[1].split("\n## ")[0]
    rows = {m.group(1): (m.group(2), m.group(3)) for m in re.finditer(r"^\| `([a-z0-9-]+)` \| (\w+) \| (.*) \|$", table, re.M)}
    assert list(rows) == list(findings_mod.RULES)
    for rule, (severity, fires_when) in rows.items():
        assert severity == findings_mod.RULES[rule].severity, rule
        assert fires_when == findings_mod.FIRES_WHEN[rule], rule


def test_rules_and_finding_keys_are_documented():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "doctor-json.md").read_text()
    for rule in findings_mod.RULES:
        assert f"| `{rule}` |" in doc, rule
    for key in ("rule", "severity", "message", "fix", "ref", "file", "key", "explain"):
        assert f"| `{key}` |" in doc, key
    for key in ("model", "adapter", "tokenizer", "deepspeed", "train_config", "probe_timeout", "probe_jobs"):
        assert f"| `{key}` |" in doc, key


# -- weights' precision (transformers 5's dtype="auto" default) ---------------------------------------------

BF16_MODEL = p("models", "llama_bf16")


def _train(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("transformers,severity", [("5.0.0", "warning"), ("5.25.0", "warning"), ("4.57.6", None)])
def test_half_weights_by_default_from_transformers_5(monkeypatch, transformers, severity):
    """No dtype anywhere, a bf16 checkpoint, a plain TrainingArguments config: from_pretrained() loads bf16 from 5.0."""
    with_versions(monkeypatch, transformers=transformers)
    hits = rules_of(run(model=BF16_MODEL, train_config=p("train", "hf_ok.json")), "full-finetune-half-weights")
    assert [h["severity"] for h in hits] == ([severity] if severity else []), hits
    if severity:
        assert "bfloat16" in hits[0]["message"] and "dtype=torch.float32" in hits[0]["fix"]


def test_half_weights_is_info_for_trl_and_silent_with_adapters_lf_or_float32(monkeypatch, tmp_path):
    with_versions(monkeypatch, transformers="5.25.0")
    trl = rules_of(run(model=BF16_MODEL, train_config=p("train", "hf_packing.json")), "full-finetune-half-weights")
    assert [h["severity"] for h in trl] == ["info"] and "model object" in trl[0]["message"]
    silent = [
        dict(model=BF16_MODEL, adapter=p("adapters", "ok.json"), train_config=p("train", "hf_ok.json")),  # LoRA
        dict(model=BF16_MODEL, train_config=p("train", "lf_ok.yaml")),  # LLaMA-Factory upcasts trainable params
        dict(model=LLAMA, train_config=p("train", "hf_ok.json")),  # a float32 checkpoint
        dict(model=BF16_MODEL, train_config=_train(tmp_path, "fp32.json", {"output_dir": "o",
                                                   "model_init_kwargs": {"dtype": "float32"}})),
    ]
    for inputs in silent:
        assert not rules_of(run(**inputs), "full-finetune-half-weights"), inputs


def test_explicit_auto_or_half_dtype_fires_on_every_version(monkeypatch, tmp_path):
    with_versions(monkeypatch, transformers="4.57.6")
    auto = _train(tmp_path, "auto.json", {"output_dir": "o", "model_init_kwargs": {"dtype": "auto"}})
    hits = rules_of(run(model=BF16_MODEL, train_config=auto), "full-finetune-half-weights")
    assert [h["severity"] for h in hits] == ["warning"] and hits[0]["key"] == "model_init_kwargs.dtype"
    assert not rules_of(run(model=LLAMA, train_config=auto), "full-finetune-half-weights")  # auto on a fp32 checkpoint
    cli_half = _train(tmp_path, "cli.json", {"output_dir": "o", "model_name_or_path": "x", "dtype": "bfloat16"})
    assert rules_of(run(train_config=cli_half), "full-finetune-half-weights")  # no model config needed


@pytest.mark.parametrize("installed,fires", [(None, True), ("0.9.5", True), ("0.9.3", True), ("0.9.6", False),
                                             ("0.9.2", False)])
def test_llamafactory_packing_cutoff_len_by_version(monkeypatch, installed, fires):
    with_versions(monkeypatch, llamafactory=installed)
    hits = rules_of(run(train_config=p("train", "lf_packing_cutoff_odd.yaml")), "llamafactory-packing-cutoff-len")
    assert bool(hits) == fires
    if fires:
        assert "(1008)" in hits[0]["message"] and "1000 or 1008" in hits[0]["fix"]
