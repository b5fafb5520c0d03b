"""LLaMA-Factory's argument and template names, as data (LLaMA-Factory is not imported, nor needed).

Extracted from the released ``llamafactory 0.9.5`` wheel (``pip download
--no-deps llamafactory==0.9.5``): the dataclass fields of
``llamafactory/hparams/{model,data,finetuning,generating,training}_args.py``
(the ones ``get_train_args`` parses; fields declared ``init=False`` —
``compute_dtype``, ``device_map``, ``model_max_length``, ``block_diag_attn`` —
are set by LLaMA-Factory itself and rejected in a config), and the names passed
to ``register_template`` in ``llamafactory/data/template.py``. The training
arguments also accept every field of the installed transformers'
``Seq2SeqTrainingArguments``; the lint adds those at run time.

LLaMA-Factory parses a YAML with ``HfArgumentParser.parse_dict(...,
allow_extra_keys=False)`` unless ``ALLOW_EXTRA_ARGS=1``: an unknown key stops
the run with ``ValueError: Some keys are not used by the HfArgumentParser``.
"""

VERSION = "0.9.5"

ARGUMENTS = frozenset(
    """
    adapter_folder adapter_name_or_path add_special_tokens add_tokens additional_target apollo_layerwise
    apollo_proj apollo_proj_type apollo_rank apollo_scale apollo_scale_front apollo_scale_type apollo_target
    apollo_update_interval asft_alpha audio_sampling_rate badam_mask_mode badam_mode badam_start_block
    badam_switch_interval badam_switch_mode badam_update_ratio badam_verbose buffer_size cache_dir
    compute_accuracy create_new_adapter crop_to_patches cutoff_len data_shared_file_system dataset dataset_dir
    default_system disable_gradient_checkpointing disable_shuffling do_sample double_quantization
    dpo_label_smoothing eaft_alpha early_stopping_steps enable_liger_kernel enable_thinking enable_torch_profiler
    eval_dataset eval_num_beams eval_on_each_dataset export_device export_dir export_hub_model_id
    export_legacy_format export_quantization_bit export_quantization_dataset export_quantization_maxlen
    export_quantization_nsamples export_size finetuning_type flash_attn fp8 fp8_backend
    fp8_enable_fsdp_float8_all_gather freeze_extra_modules freeze_language_model freeze_multi_modal_projector
    freeze_trainable_layers freeze_trainable_modules freeze_vision_tower galore_layerwise galore_proj_type
    galore_rank galore_scale galore_target galore_update_interval hf_hub_token hyper_parallel_args
    ignore_pad_token_for_loss image_do_pan_and_scan image_max_pixels image_min_pixels
    include_effective_tokens_per_second infer_backend infer_dtype init_special_tokens interleave_probs
    kt_expert_checkpoint_path kt_lora_expert_intermediate_size kt_lora_expert_num kt_use_lora_experts
    kt_weight_path kto_chosen_weight kto_rejected_weight ld_alpha length_penalty lora_alpha lora_dropout lora_rank
    lora_target loraplus_lr_embedding loraplus_lr_ratio low_cpu_mem_usage mask_history master_addr master_port
    max_length max_new_tokens max_samples media_dir mix_strategy mixture_of_depths model_name_or_path
    model_revision module_dropout moe_aux_loss_coef ms_hub_token neat_packing new_special_tokens_config num_beams
    offload_folder oft_block_size oft_rank oft_target om_hub_token overwrite_cache overwrite_output_dir packing
    pissa_convert pissa_init pissa_iter plot_loss ppo_buffer_size ppo_epochs ppo_score_norm ppo_target
    ppo_whiten_rewards pref_bco_weight pref_beta pref_ftx pref_loss preprocessing_batch_size
    preprocessing_num_workers preserve_thinking print_param_status profile_modules profiler_active_steps
    profiler_output_dir profiler_profile_memory profiler_record_shapes profiler_repeat profiler_wait_steps
    profiler_warmup_steps profiler_with_stack pure_bf16 quantization_bit quantization_device_map
    quantization_method quantization_type ray_init_kwargs ray_num_workers ref_model ref_model_adapters
    ref_model_quantization_bit repetition_penalty resize_vocab reward_model reward_model_adapters
    reward_model_quantization_bit reward_model_type rope_scaling sglang_config sglang_lora_backend sglang_maxlen
    sglang_mem_fraction sglang_tp_size shift_attn simpo_gamma skip_special_tokens split_special_tokens stage
    streaming swanlab_api_key swanlab_lark_secret swanlab_lark_webhook_url swanlab_logdir swanlab_mode
    swanlab_project swanlab_run_name swanlab_workspace temperature template tokenized_path tool_format top_k top_p
    train_from_scratch train_on_prompt trust_remote_code upcast_layernorm upcast_lmhead_output use_adam_mini
    use_apollo use_asft_loss use_audio_in_video use_badam use_dft_loss use_dora use_eaft_loss use_fast_tokenizer
    use_galore use_hyper_parallel use_kt use_kv_cache use_llama_pro use_mca use_muon use_reentrant_gc use_rslora
    use_swanlab use_unsloth use_unsloth_gc use_v1_kernels val_size video_fps video_max_pixels video_maxlen
    video_min_pixels vllm_config vllm_enforce_eager vllm_gpu_util vllm_max_lora_rank vllm_maxlen
    """.split()
)

TEMPLATES = frozenset(
    """
    custom alpaca bailing bailing_v2 breeze chatglm3 chatml chatml_de cohere cpm4 dbrx deepseek deepseek3
    deepseekr1 hy3 deepseekcoder default dots_ocr empty ernie ernie_nothink ernie_vl exaone falcon falcon_h1
    fewshot gemma gemma2 gemma3 gemma3n gemma4 gemma4n glm4 glm4_moe glm4v glm4_5v glm_ocr glm4_7 glmz1 gpt_oss
    granite3 granite3_vision granite4 index hunyuan hunyuan_small intern2 intern_vl intern_s1 keye_vl kimi_vl lfm2
    lfm2_vl llama2 llama2_zh llama3 llama4 mllama moonlight llava llava_next llava_next_llama3 llava_next_mistral
    llava_next_qwen llava_next_yi llava_next_video llava_next_video_mistral llava_next_video_yi mimo mimo_v2
    mimo_vl minicpm_v minicpm_v_4_6 minicpm_o minimax1 minimax2 ministral mistral mistral_small ministral3 olmo
    openchat openchat-3.6 opencoder paligemma paligemma_chat phi phi_small phi4 phi4_mini pixtral qwen qwen3
    qwen3_nothink qwen2_audio qwen2_omni qwen3_omni qwen3_omni_nothink qwen2_vl qwen3_vl qwen3_vl_nothink qwen3_5
    qwen3_5_nothink qwen3_6 sailor seed_coder seed_oss smollm smollm2 solar starchat telechat2 vicuna video_llava
    xuanyuan yi yi_vl youtu youtu_vl yuan zephyr aeva
    """.split()
)

# Keys that only LLaMA-Factory configs use: their presence tells a LLaMA-Factory YAML from a TRL/transformers one.
MARKERS = frozenset(
    (
        "stage",
        "finetuning_type",
        "lora_target",
        "cutoff_len",
        "template",
        "neat_packing",
        "flash_attn",
        "additional_target",
        "lora_rank",
        "dataset_dir",
        "disable_gradient_checkpointing",
        "use_reentrant_gc",
        "quantization_bit",
    )
)

# DataArguments.cutoff_len, FinetuningArguments.stage / finetuning_type / lora_target, ModelArguments.flash_attn
DEFAULTS = {
    "cutoff_len": 2048,
    "stage": "sft",
    "finetuning_type": "lora",
    "lora_target": "all",
    "flash_attn": "auto",
    "disable_gradient_checkpointing": False,
    "use_reentrant_gc": True,
}

# ModelArguments.flash_attn (extras/constants.py AttentionFunction) -> transformers attn_implementation
FLASH_ATTN = {"auto": None, "disabled": "eager", "sdpa": "sdpa", "fa2": "flash_attention_2", "fa3": "flash_attention_3"}
