"""nothing_trainable, trainable_without_grad, frozen_param_changed: real Trainer runs.

Each catalogue-linked scenario runs with the shim excluded (the bug present where the registry says it
exists) and then with ``ftshims.apply()``; on a stack outside the shim's range the first run is the
negative control: no finding at all.
"""

import torch

import ftshims
from ftshims.monitor import catalogue

from .runs import assert_explains, corpus, default_stack_only, rows_dataset, train


def _lora_with_trainable_head():
    """LoRA on q/v plus a trainable lm_head (modules_to_save): the head, after the checkpointed layers, keeps the
    loss differentiable under reentrant checkpointing, so the run trains while the LoRA weights get nothing."""
    from peft import LoraConfig, get_peft_model

    from ftshims import tiny

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"],
                        lora_dropout=0.0, task_type="CAUSAL_LM")
    with tiny.quiet():
        return get_peft_model(tiny.tiny_llama(), config)


def test_lora_under_reentrant_checkpointing_gets_no_gradient():
    shim = "lora_reentrant_checkpointing"
    data = rows_dataset(corpus(n=32, seq=16))
    ftshims.apply(exclude=[shim])
    broken = train(_lora_with_trainable_head(), data, gradient_checkpointing=True)
    assert broken.error is None, broken.error  # the silent form: the run trains
    if not catalogue.exists_here(shim):  # transformers >= 5.0: non-reentrant by default, the hook installed
        broken.none()
        return
    finding = broken.only("trainable_without_grad")
    assert_explains(finding, shim)
    assert finding.explains == [shim]
    assert finding.step == 4 and finding.detail["steps"] == 4  # grad_steps
    assert finding.detail["gradient_checkpointing"] == "reentrant"
    assert set(finding.detail["modules"]) == {f"base_model.model.model.layers.{i}.self_attn.{p}"
                                              for i in (0, 1) for p in ("q_proj", "v_proj")}
    assert "LoRA weights got no gradient in 4 optimizer steps" in finding.message
    ftshims.revert()
    ftshims.apply()
    train(_lora_with_trainable_head(), data, gradient_checkpointing=True).none()


def test_kbit_prepared_peft_model_has_nothing_trainable():
    shim = "kbit_prep_keeps_adapters_trainable"
    import peft  # prepare_model_for_kbit_training through the package: apply() wraps that alias

    from ftshims import tiny

    data = rows_dataset(corpus(n=16, seq=16))
    ftshims.apply(exclude=[shim])
    model = tiny.lora(tiny.tiny_llama())
    with tiny.quiet():
        peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    broken = train(model, data, max_steps=2)
    finding = broken.only("nothing_trainable")
    assert finding.step == 0 and finding.detail["adapters"] is True
    assert_explains(finding, shim)
    assert broken.error is not None  # then the backward fails: nothing requires grad
    ftshims.revert()
    ftshims.apply()
    model = tiny.lora(tiny.tiny_llama())
    with tiny.quiet():
        peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    fixed = train(model, data, max_steps=2)
    assert fixed.error is None, fixed.error
    fixed.none()


def test_resize_after_get_peft_model_trains_frozen_embeddings():
    """transformers < 4.36: resize_token_embeddings on a PeftModel builds new, trainable embeddings; they train
    although PEFT froze them (and the adapter will not save them)."""
    shim = "resize_embeddings_keeps_frozen"
    from ftshims import tiny

    data = rows_dataset(corpus(n=16, seq=16))
    ftshims.apply(exclude=[shim])
    model = tiny.lora(tiny.tiny_llama())
    with tiny.quiet():
        model.resize_token_embeddings(model.config.vocab_size + 8)
    broken = train(model, data, max_steps=2)
    assert broken.error is None, broken.error
    if not catalogue.exists_here(shim):  # the flags survive the resize: nothing moved
        broken.none()
        return
    finding = broken.only("frozen_param_changed")
    assert finding.explains == [shim]
    assert_explains(finding, shim)
    assert finding.detail["embeddings"] and set(finding.detail["embeddings"]) <= set(finding.detail["peft_base_weights_trainable"])
    ftshims.revert()
    ftshims.apply()
    model = tiny.lora(tiny.tiny_llama())
    with tiny.quiet():
        model.resize_token_embeddings(model.config.vocab_size + 8)
    train(model, data, max_steps=2).none()


@default_stack_only
def test_frozen_parameter_changed_in_place_names_it_and_nothing_known():
    from transformers import TrainerCallback

    from ftshims import tiny

    class Nudge(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 2:
                with torch.no_grad():
                    model.model.norm.weight.add_(1.0)  # frozen, and changed behind the optimizer's back

    ftshims.apply()
    model = tiny.tiny_llama()
    model.model.norm.weight.requires_grad_(False)
    result = train(model, rows_dataset(corpus(n=16, seq=16)), max_steps=3, callbacks=[Nudge()],
                   monitor={"frozen_samples": 1})
    finding = result.only("frozen_param_changed")
    assert finding.detail["changed"] == ["model.norm.weight"] and finding.explains == []
    assert finding.step == 2 and "no known bug of this stack" in finding.message


def _llama_with_an_unused_module():
    """A full fine-tune whose model carries a trainable module no forward calls (like a pooler the head never
    reads, or a standalone decoder's cross-attention): its parameters never get a gradient, by design."""
    from ftshims import tiny

    with tiny.quiet():
        model = tiny.tiny_llama()
    model.model.unused_pooler = torch.nn.Linear(model.config.hidden_size, model.config.hidden_size)
    return model


@default_stack_only
def test_full_fine_tune_parameters_unused_by_design_are_not_a_finding():
    """The zoo gate's false positives (a pooler, cross-attention, a vision tower's tail: 50 healthy classes on 4.57,
    82 on 5.25): without adapters and without checkpointing, a parameter without a gradient is one the loss does not
    depend on, which nothing in the catalogue produces."""
    with ftshims.applied():  # the stack's own bugs fixed (4.57's label count): only the unused module is left
        result = train(_llama_with_an_unused_module(), rows_dataset(corpus(n=32, seq=16)))
    assert result.error is None, result.error
    assert result.trainer.model.model.unused_pooler.weight.grad is None  # the situation is there
    result.none()


@default_stack_only
def test_full_fine_tune_under_reentrant_checkpointing_with_frozen_embeddings_is_a_finding():
    """Still judged under checkpointing: frozen input embeddings and reentrant checkpointing cut every decoder
    layer's gradient while the final norm and head train (the run is silent, the same bug as with LoRA): the layers
    are named and lora_reentrant_checkpointing explains it; with it applied (its input-grad hook), no finding."""
    from ftshims import tiny

    shim = "lora_reentrant_checkpointing"

    def run(**apply):
        with tiny.quiet():
            model = tiny.tiny_llama()
        model.get_input_embeddings().requires_grad_(False)
        with ftshims.applied(**apply):
            return train(model, rows_dataset(corpus(n=32, seq=16)), gradient_checkpointing=True,
                         gradient_checkpointing_kwargs={"use_reentrant": True})

    broken = run(exclude=[shim])
    assert broken.error is None, broken.error
    finding = broken.only("trainable_without_grad")
    assert finding.detail["gradient_checkpointing"] == "reentrant"
    assert {m.split(".")[2] for m in finding.detail["modules"]} == {"0", "1"}, finding.detail["modules"]
    assert finding.explains == [shim]
    run().none()
