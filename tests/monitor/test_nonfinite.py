"""nonfinite_loss localized to its module, expand_mask_clamp's fp16 NaN explained, and a learning-rate jump
caught as loss_spike within two steps."""

import pytest
import torch

import ftshims
from ftshims.monitor import catalogue
from ftshims.versions import in_range, installed_version

from .runs import assert_explains, corpus, default_stack_only, rows_dataset, train


class _NanAt:
    """A forward hook on one module that turns its output into NaN during optimizer step ``step``."""

    def __init__(self, module, step):
        from transformers import TrainerCallback

        self.step = step
        self.on = False
        module.register_forward_hook(lambda m, a, out: out * float("nan") if self.on else out)
        outer = self

        class Switch(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                outer.on = state.global_step + 1 == outer.step

        self.callback = Switch()


@default_stack_only
@pytest.mark.parametrize("read", ["auto", "log"])
def test_injected_nan_is_localized_to_its_module(read):
    """``auto`` on the CPU reads every step: the re-run sees the weights that gave the NaN. ``log`` reads at
    the logging step (as on a GPU): the update already ran, the finding still has the right step and says the
    weights are no longer finite."""
    from ftshims import tiny

    ftshims.apply()
    model = tiny.tiny_llama()
    nan = _NanAt(model.model.layers[1].mlp, step=3)
    result = train(model, rows_dataset(corpus(n=32, seq=16)), max_steps=5, logging_steps=5 if read == "log" else 1,
                   callbacks=[nan.callback], monitor={"read": read})
    finding = result.only("nonfinite_loss")
    assert finding.step == 3 and finding.explains == []
    if read == "auto":
        assert finding.detail["module"] == "model.layers.1.mlp", finding.detail
        assert finding.detail["inputs_finite"] is True and "nonfinite_parameters" not in finding.detail
        assert "in model.layers.1.mlp (LlamaMLP)" in finding.message
    else:
        assert finding.detail["nonfinite_parameters"], finding.detail  # the NaN step's update poisoned them
        assert "weights were already non-finite" in finding.message


def test_fp16_left_padding_nan_is_explained_by_expand_mask_clamp():
    shim = "expand_mask_clamp"
    if not in_range(installed_version("transformers"), ">=4.31"):
        pytest.skip("Llama on transformers 4.30 still clamps its scores (PR #24561): no NaN to see")
    from ftshims.shims import expand_mask_clamp

    ids, mask, _ = expand_mask_clamp.padded_batch("llama")
    rows = {"input_ids": ids.repeat(8, 1), "attention_mask": mask.repeat(8, 1)}
    rows["labels"] = rows["input_ids"].masked_fill(rows["attention_mask"] == 0, -100)

    def model():
        built = expand_mask_clamp.build("llama", attn="eager", dtype="float16").train()
        for name, p in built.named_parameters():  # q/k are forced to constants by the build's hooks
            if "q_proj" in name or "k_proj" in name:
                p.requires_grad_(False)
        return built

    ftshims.apply(exclude=[shim])
    # one step: pure-fp16 AdamW turns weights with zero gradients into NaN later (0 / (0 + eps underflowed)),
    # which is not this bug
    broken = train(model(), rows_dataset(rows), max_steps=1)
    finding = broken.only("nonfinite_loss")
    assert_explains(finding, shim)
    assert finding.explains == [shim] and finding.step == 1
    assert finding.detail["module"] == "model.layers.0.self_attn", finding.detail
    assert finding.detail["fp16"] and finding.detail["padded_batch"] and finding.detail["attention"] == "eager"
    ftshims.revert()
    ftshims.apply()
    assert catalogue.exists_here(shim)
    train(model(), rows_dataset(rows), max_steps=1).none()


@default_stack_only
def test_learning_rate_jump_gives_loss_spike_within_two_steps():
    from transformers import TrainerCallback

    from ftshims import tiny

    class Jump(TrainerCallback):
        def on_step_end(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
            if state.global_step == 40:  # from step 41 on the learning rate is 300 times larger
                lr_scheduler.base_lrs = [0.3 for _ in lr_scheduler.base_lrs]
                for group in optimizer.param_groups:
                    group["lr"] = 0.3

    ftshims.apply()
    result = train(tiny.tiny_llama(attn="sdpa"), rows_dataset(corpus(n=512)), max_steps=46, per_device_train_batch_size=8,
                   learning_rate=1e-3, lr_scheduler_type="constant", callbacks=[Jump()], logging_steps=10)
    spikes = [f for f in result.findings if f.code == "loss_spike"]
    assert spikes, [f.line() for f in result.findings]
    assert 41 <= spikes[0].step <= 42, spikes[0].line()
    assert spikes[0].detail["value"] > spikes[0].detail["threshold"] and spikes[0].explains == []
    assert all(f.step > 40 for f in result.findings), [f.line() for f in result.findings]


class _GradHookAt:
    """A gradient hook on one weight that multiplies its gradient by ``factor`` during optimizer step ``step``."""

    def __init__(self, weight, step, factor):
        from transformers import TrainerCallback

        self.on = False
        weight.register_hook(lambda grad: grad * factor if self.on else grad)
        outer = self

        class Switch(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                outer.on = state.global_step + 1 == step

        self.callback = Switch()


@default_stack_only
def test_nonfinite_gradient_with_a_finite_loss_names_its_module():
    from ftshims import tiny

    ftshims.apply()
    model = tiny.tiny_llama()
    hook = _GradHookAt(model.model.layers[0].mlp.down_proj.weight, step=3, factor=float("nan"))
    result = train(model, rows_dataset(corpus(n=32, seq=16)), max_steps=5, callbacks=[hook.callback])
    finding = result.only("nonfinite_grad")  # the next steps' NaN loss is the same event: not reported again
    assert finding.step == 3 and finding.explains == []
    assert finding.detail["module"] == "model.layers.0.mlp.down_proj", finding.detail


@default_stack_only
def test_gradient_norm_jump_gives_grad_norm_spike_at_its_step():
    from ftshims import tiny

    ftshims.apply()
    model = tiny.tiny_llama(attn="sdpa")
    hook = _GradHookAt(model.model.layers[1].mlp.down_proj.weight, step=35, factor=1000.0)
    result = train(model, rows_dataset(corpus(n=512)), max_steps=40, per_device_train_batch_size=8, logging_steps=10,
                   callbacks=[hook.callback])
    finding = result.only("grad_norm_spike")
    assert finding.step == 35 and finding.detail["value"] > 10 * finding.detail["median"], finding.detail
