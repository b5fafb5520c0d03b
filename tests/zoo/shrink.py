"""A generic config shrinker: any transformers config -> a tiny one of the same architecture.

The config is turned into a dict (``to_dict()``), every level of it (the top
config and every nested sub-config: ``text_config``, ``vision_config``,
``audio_config``, ``encoder``/``decoder`` ...) is shrunk by *key name*, and the
config class is rebuilt from the result, so that values the constructor derives
(``head_dim``, layer patterns, ...) are derived again from the tiny values.

Targets (one place to change them):

* hidden 64 = 4 heads x head_dim 16; intermediate 128; 2 layers (more only to
  keep one layer of each distinct ``layer_types`` entry, at most 4);
* GQA kept: kv heads = heads if they were equal, 1 if MQA, else 2 (ratio 2);
* vocab 256, every special token id (``*_token_id``/``*_token_index``...) that
  would not fit is remapped, consistently across sub-configs, to the top ids;
* text positions 64 (``TEXT_POSITIONS``); vision towers 32 px images of 8 px
  patches: 16 patches, 17 positions with a CLS token, so that the vision
  position table is *smaller* than the text one and a 60-token text runs
  through a model whose smallest position table has 17 rows; audio encoders
  16 source positions;
* experts 4, top-k 2, one shared expert, groups 1.

Nothing here imports torch; transformers is imported by the caller.
"""

from __future__ import annotations

import copy
import math
import re
from typing import Any, Dict, Optional

HEADS = 4
HEAD_DIM = 16
HIDDEN = HEADS * HEAD_DIM
INTER = 128
LAYERS = 2
MAX_LAYERS = 4
VOCAB = 256
TEXT_POSITIONS = 64
IMAGE_SIZE = 32
PATCH = 8
AUDIO_POSITIONS = 16
EXPERTS = 4
TOPK = 2

HIDDEN_KEYS = {
    "hidden_size", "d_model", "n_embd", "n_embed", "embed_dim", "dim", "model_dim", "word_embed_proj_dim",
    "embedding_size", "emb_dim", "embedding_dim", "d_embed", "projection_dim", "text_embed_dim",
    "vision_embed_dim", "encoder_hidden_size", "decoder_hidden_size", "out_hidden_size",
    "cross_attention_hidden_size", "audio_hidden_size", "vision_hidden_size", "text_hidden_size", "lru_width",
    "attention_hidden_size", "projector_hidden_size", "encoder_embed_dim", "decoder_embed_dim",
    "output_hidden_size", "image_text_hidden_size", "hidden_size_global", "decoder_dim", "enc_dim",
    "audio_embed_dim", "lang_embed_dim", "d_latents", "cross_hidden_size", "xvector_output_dim",
    "classifier_proj_size", "codevector_dim", "proj_codevector_dim", "mm_hidden_size", "vision_feature_dim",
    "text_config_hidden_size", "input_embedding_size", "hidden_dim_global", "pooler_hidden_size",
    "adapter_in_dim", "adapter_input_size", "adapter_out_dim", "mm_embed_dim", "output_proj_dims",
    "vision_output_dim", "projector_input_dim", "projector_output_dim", "image_token_embed_dim", "output_dim",
    "post_conv_in_channels", "post_conv_out_channels", "post_conv_mid_channels", "output_channels",
    "downsample_hidden_size", "projection_hidden_size",
}
INTER_KEYS = {
    "intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "n_inner", "d_ff", "d_inner",
    "dim_feedforward", "decoder_intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
    "expert_ffn_hidden_size", "ffn_hidden_size", "hidden_dim", "intermediate_size_mlp", "dense_intermediate_size",
    "encoder_feedforward_dim", "decoder_dim_feedforward", "encoder_dim_feedforward", "linear_units",
    "feed_forward_size", "encoder_linear_units", "decoder_linear_units", "dff", "dim_ff", "mlp_dim",
    "vision_intermediate_size", "text_intermediate_size", "alignment_intermediate_size",
    "projector_intermediate_size", "decoder_hidden_dim", "encoder_hidden_dim", "moe_shared_expert_intermediate_size",
    "moe_hidden_size", "projection_hidden_dim",
}
HEADS_KEYS = {
    "num_attention_heads", "n_head", "num_heads", "encoder_attention_heads", "decoder_attention_heads",
    "attention_heads", "n_heads", "encoder_num_attention_heads", "decoder_num_attention_heads",
    "cross_num_attention_heads", "conf_num_attention_heads", "decoder_num_heads", "num_attention_heads_text",
    "decoder_self_attention_heads", "decoder_cross_attention_heads", "linear_num_heads",
    "memory_attention_num_attention_heads", "kv_n_heads_total",
}
KV_KEYS = {
    "num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num", "encoder_num_key_value_heads",
    "decoder_num_key_value_heads", "cross_num_key_value_heads", "kv_n_heads", "num_query_groups",
}
HEAD_DIM_KEYS = {
    "head_dim", "attention_head_size", "kv_channels", "d_kv", "d_head", "dim_head", "attention_head_dim",
    "cross_head_dim", "v_head_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_head_dim",
}
LAYER_KEYS = {
    "num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
    "num_decoder_layers", "num_encoder_layers", "depth", "decoder_num_hidden_layers", "encoder_num_hidden_layers",
    "vision_layers", "num_text_layers", "text_layers", "conf_num_hidden_layers", "decoder_num_layers",
    "num_vision_layers", "num_audio_layers", "encoder_num_layers", "memory_attention_num_layers",
}
VOCAB_KEYS = {"vocab_size", "text_vocab_size", "input_vocab_size", "decoder_vocab_size", "n_vocab",
              "vocab_size_per_layer_input"}
TEXT_POS_KEYS = {
    "max_position_embeddings", "n_positions", "n_ctx", "max_target_positions", "max_text_positions",
    "max_decoder_position_embeddings", "max_encoder_position_embeddings", "max_text_len", "max_seq_len",
}
AUDIO_POS_KEYS = {"max_source_positions", "max_speech_positions"}
EXPERT_KEYS = {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts"}
TOPK_KEYS = {"num_experts_per_tok", "moe_topk", "num_selected_experts", "top_k", "moe_k", "num_experts_per_token",
             "top_k_experts"}
INDEX_LIST_KEYS = {
    "global_attn_indexes", "full_attn_idxs", "mlp_only_layers", "moe_layers", "fullatt_block_indexes",
    "window_block_indexes", "window_block_indices", "deepstack_visual_indexes", "cross_attention_layers",
    "intermediate_hidden_state_indices", "intermediate_layers_indices", "global_attention_blocks",
    "hybrid_layer_ids", "kv_source_layers", "vision_feature_layers", "extract_layers", "backbone_out_indices",
}
# ids: remapped when they do not fit the tiny vocab (values >= SMALL_ID stay if they fit)
SPECIAL_ID_RE = re.compile(r"(^|_)(token_id|token_index|token_ids|id)$|_token_id$|_token_index$|^(pad|bos|eos|sep|cls|mask|unk)_id$")
NOT_IDS = {"lang_id", "layer_id", "insert_layer_id", "decode_index", "default_prompt_id"}


def _heads(orig: int) -> int:
    if orig >= HEADS:
        return HEADS
    if orig >= 2:
        return 2
    return max(1, orig)


def _pow2_le(value: int, cap: int) -> int:
    out = 1
    while out * 2 <= min(value, cap):
        out *= 2
    return out


class IdMap:
    """Remaps special token ids that do not fit the tiny vocab, the same old id to the same new id everywhere."""

    def __init__(self, vocab: int = VOCAB):
        self.vocab = vocab
        self.map: Dict[int, int] = {}
        self.next = vocab - 1

    def __call__(self, value: int) -> int:
        if value < 0:
            return value
        if value < 16:  # pad/bos/eos 0..3 are common and fine as they are
            return value
        if value not in self.map:
            self.map[value] = self.next
            self.next -= 1
        return self.map[value]

    def fresh(self) -> int:
        """A top id no special id was remapped to."""
        value = self.next
        self.next -= 1
        return value


def _is_subconfig(value: Any) -> bool:
    return isinstance(value, dict) and "model_type" in value


TYPE_LIST_RE = re.compile(r"(_types?|_block_type)$")


def _type_lists(d: dict, orig_layers: int) -> list:
    """The per-layer type lists of a config level (``layer_types``, ``layers_block_type``, ``mlp_layer_types``,
    ``block_types`` ...): lists of names, one per layer."""
    return [k for k, v in d.items() if TYPE_LIST_RE.search(k) and isinstance(v, list) and len(v) == orig_layers
            and v and all(isinstance(x, (str, type(None), list)) for x in v)]


def _shrink_layer_lists(d: dict, orig_layers: int) -> Optional[list]:
    """Pick the layers to keep: the first layers that show each value of the per-layer type lists (a hybrid keeps
    one attention and one Mamba/linear-attention layer, an MoE one dense and one sparse layer; one layer may show
    one value of each list), at least LAYERS, at most MAX_LAYERS."""
    keys = _type_lists(d, orig_layers) if orig_layers > 0 else []
    if not keys:
        return None
    sig = [tuple(repr(d[k][i]) for k in keys) for i in range(orig_layers)]
    first = []
    for idx in range(orig_layers):
        if sig[idx] not in {sig[i] for i in first}:
            first.append(idx)
    keep = []
    for idx in first:  # greedy: layers that add a type not seen yet
        if any(sig[idx][j] not in {sig[i][j] for i in keep} for j in range(len(keys))):
            keep.append(idx)
    for idx in first + list(range(orig_layers)):
        if len(keep) >= LAYERS:
            break
        if idx not in keep:
            keep.append(idx)
    return sorted(keep[:MAX_LAYERS])


def _shrink_layer_pattern(d: dict, n_layers: int, main_layers: int) -> int:
    """Layer patterns that are cycled over the stack (recurrent_gemma's ``block_types``: recurrent, recurrent,
    attention) and (period, offset) pairs (jamba/zamba: one attention layer every ``attn_layer_period`` layers from
    ``attn_layer_offset``): the tiny stack must still hold each kind. Returns the number of layers needed."""
    for key, v in d.items():
        if TYPE_LIST_RE.search(key) and isinstance(v, list) and 1 < len(v) < min(16, main_layers) \
                and all(isinstance(x, str) for x in v):
            firsts = {x: v.index(x) for x in v}
            n_layers = max(n_layers, min(MAX_LAYERS, max(firsts.values()) + 1))
    for key in list(d):
        if key.endswith("_layer_period") and _int(d[key]) and d[key] > LAYERS:
            offset_key = key[: -len("period")] + "offset"
            d[key] = LAYERS
            if _int(d.get(offset_key)) is not None:
                d[offset_key] = min(d[offset_key], LAYERS - 1)
    return n_layers


def _shrink_per_layer(pl: dict, keep: list, ids: "IdMap", path: str) -> dict:
    """``per_layer_config`` (gemma4: ``{"05": {"head_dim": 512}}``, dots3: MLA sizes of the sliding layers): the
    entries of the kept layers, renumbered to their tiny index (same key format), their values shrunk like a level."""
    out = {}
    for new_idx, old_idx in enumerate(keep):
        for key, value in pl.items():
            if str(key).isdigit() and int(key) == old_idx:
                new_key = f"{new_idx:0{len(key)}d}" if isinstance(key, str) else new_idx
                out[new_key] = shrink_dict(value, ids, path + "per_layer_config.") if isinstance(value, dict) else value
    for key, value in pl.items():  # keyed by layer type, not index
        if not str(key).isdigit():
            out[key] = shrink_dict(value, ids, path + "per_layer_config.") if isinstance(value, dict) else value
    return out


LAYER_GROUP_RE = re.compile(r"^(n|num)_\w+_layers$")


def _shrink_layer_groups(d: dict, main_layers: int) -> None:
    """Layer counts that partition the stack (dory: ``n_input_layers + n_recurrent_layers + n_output_layers ==
    num_hidden_layers``): one layer per group, the total kept equal to their sum."""
    groups = {k: v for k, v in d.items() if LAYER_GROUP_RE.match(k) and k not in LAYER_KEYS and _int(v) and v > 0}
    if len(groups) < 2 or sum(groups.values()) != main_layers or "num_hidden_layers" not in d:
        return
    for key in groups:
        d[key] = 1
    d["num_hidden_layers"] = len(groups)


def shrink_dict(d: dict, ids: IdMap, path: str = "") -> dict:
    d = dict(d)
    for key in ("out_features", "out_indices", "stage_names"):  # rebuilt by the constructor from the tiny depth
        d.pop(key, None)
    orig_heads = next((d[k] for k in ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads", "n_heads")
                       if isinstance(d.get(k), int) and not isinstance(d.get(k), bool)), None)
    is_vision = any(k in d for k in ("image_size", "patch_size", "num_channels", "in_channels", "spatial_merge_size"))
    is_audio = any(k in d for k in ("num_mel_bins", "max_source_positions", "conv_dim", "feature_size"))
    orig = _orig_dims(d, orig_heads)
    hierarchical = isinstance(d.get("depths"), list) and len(d["depths"]) >= 3  # before the stage lists are cut
    # layers
    orig_layers = {}
    for key in list(d):
        v = d[key]
        if key in LAYER_KEYS and isinstance(v, int) and not isinstance(v, bool) and v > 0:
            orig_layers[key] = v
    main_layers = orig_layers.get("num_hidden_layers") or (max(orig_layers.values()) if orig_layers else None)
    keep = _shrink_layer_lists(d, main_layers) if main_layers else None
    n_layers = _shrink_layer_pattern(d, len(keep) if keep else LAYERS, main_layers or 0)
    for key, v in orig_layers.items():
        d[key] = min(v, n_layers) if key in ("num_hidden_layers",) or v == main_layers else min(v, LAYERS)
    if main_layers:
        new_main = min(main_layers, n_layers)
        for key, v in list(d.items()):
            if isinstance(v, list) and len(v) == main_layers and main_layers > 1 and key not in INDEX_LIST_KEYS \
                    and not key.endswith("_names") and key not in ("out_features", "out_indices"):
                idx = keep if keep else list(range(new_main))
                d[key] = [v[i] for i in idx]
        for key in INDEX_LIST_KEYS:
            v = d.get(key)
            if isinstance(v, list) and v and all(isinstance(x, int) for x in v):
                mapped = sorted({min(max(0, x * new_main // main_layers), new_main - 1) if x >= 0 else max(x, -new_main)
                                 for x in v})
                d[key] = mapped
        for key in ("num_blocks",):  # xlstm: a second name of the layer count
            if d.get(key) == main_layers and key not in orig_layers:
                d[key] = new_main
        for key in ("max_window_layers",):
            if isinstance(d.get(key), int):
                d[key] = min(d[key], new_main)
        for key in ("first_k_dense_replace", "num_dense_layers"):  # MoE: one dense layer, the others MoE
            if isinstance(d.get(key), int) and d[key] > 0:
                d[key] = min(d[key], 1)
        _shrink_layer_groups(d, main_layers)
    types = [x for k in _type_lists(d, main_layers or 0) for x in d[k] if isinstance(x, str)]
    if any("sliding" in x for x in types) and "sliding_window" in d and d["sliding_window"] is None:
        d["sliding_window"] = 32  # step3p7: sliding layers, and a default config without their window
    pl = d.get("per_layer_config")
    if isinstance(pl, dict) and main_layers:
        d["per_layer_config"] = _shrink_per_layer(pl, keep or list(range(min(main_layers, n_layers))), ids, path)
    if orig_heads is not None:
        for key in ("head_dim",):
            if key in d and d[key] is None:
                d[key] = HEAD_DIM
        for key in ("num_key_value_heads",):
            if key in d and d[key] is None:
                d[key] = _heads(orig_heads)
    # Mamba-2 style mixers: heads * head_dim must equal expand * hidden
    for heads_key, dim_key, expand_key, marker in (("mamba_n_heads", "mamba_d_head", "mamba_expand", "mamba_n_heads"),
                                                   ("n_mamba_heads", "mamba_headdim", "mamba_expand", "n_mamba_heads"),
                                                   ("mamba_num_heads", "mamba_head_dim", "expand", "mamba_num_heads"),
                                                   ("num_heads", "head_dim", "expand", "state_size")):
        if isinstance(d.get(heads_key), int) and marker in d:
            expand = d.get(expand_key) if isinstance(d.get(expand_key), int) else 2
            d[dim_key] = HEAD_DIM
            d[heads_key] = max(1, expand * HIDDEN // HEAD_DIM)
            d["_mamba_heads_set"] = heads_key
    # MoE defaults left as None by some configs (the model then fails on topk(k=None) / range(None))
    has_moe = any(isinstance(d.get(k), int) and not isinstance(d.get(k), bool) for k in EXPERT_KEYS) or \
        any(k in d for k in ("moe_intermediate_size", "expert_ffn_hidden_size"))
    if has_moe:
        for key in EXPERT_KEYS:
            if key in d and d[key] is None and key in ("n_routed_experts", "num_experts"):
                d[key] = EXPERTS
        if "n_shared_experts" in d and d["n_shared_experts"] is None:
            d["n_shared_experts"] = 1
        for key in ("num_experts_per_tok", "top_k_experts"):
            if key in d and d[key] is None:
                d[key] = TOPK
        if "moe_intermediate_size" in d and d["moe_intermediate_size"] is None:
            d["moe_intermediate_size"] = INTER
    for key in ("mamba_d_state", "state_size", "ssm_state_size"):
        if isinstance(d.get(key), int) and d[key] > 16:
            d[key] = 16
    for key in ("mamba_chunk_size", "chunk_size"):
        if isinstance(d.get(key), int) and d[key] > 16:
            d[key] = 16
    for key in ("mamba_n_groups", "n_groups"):
        if isinstance(d.get(key), int) and d[key] > 1:
            d[key] = 1
    if isinstance(d.get("time_step_rank"), int) and d["time_step_rank"] > 8:
        d["time_step_rank"] = 8
    if isinstance(d.get("channel_multiplier"), list) and _int(d.get("base_channels")):
        # VQ-GAN image tokenizers (emu3, chameleon, janus): the narrowest width their GroupNorm(32) allows at every
        # stage, one residual block per stage, a 32-code codebook
        d["base_channels"] = min(d["base_channels"], 32)
        d["channel_multiplier"] = [1] * len(d["channel_multiplier"])  # as many stages (the same downsampling)
        for key, cap in (("num_res_blocks", 1), ("codebook_size", 32), ("num_embeddings", 32), ("latent_channels", 8),
                         ("embed_dim", 8), ("resolution", IMAGE_SIZE)):
            if _int(d.get(key)) and d[key] > cap:
                d[key] = cap
        if _int(d.get("hidden_size")):  # emu3: the mid-block attention runs at the widest stage's width
            d["hidden_size"] = d["base_channels"] * max(d["channel_multiplier"])
        d["_vq_set"] = True
    # hierarchical vision backbones (swin, focalnet, ...): stage widths are embed_dim * 2**i, windows of 8 px tokens
    if hierarchical and _int(d.get("embed_dim")) and d["embed_dim"] > 16:
        d["embed_dim"] = 16
        d["_embed_set"] = True
    if hierarchical and _int(d.get("window_size")) and d["window_size"] > 2:
        d["window_size"] = 2
    # width/depth multipliers of convolutional nets (efficientnet, mobilenet): channel counts come from them
    for key, cap in (("width_coefficient", 0.25), ("depth_coefficient", 1.0), ("depth_multiplier", 0.25),
                     ("width_multiplier", 0.25)):
        if isinstance(d.get(key), float) and d[key] > cap:
            d[key] = cap
    if isinstance(d.get("width_coefficient"), float) and _int(d.get("hidden_dim")) and _int(d.get("depth_divisor")):
        # efficientnet: the head's width is round_filters(1280), not a free size
        div = d["depth_divisor"]
        d["hidden_dim"] = max(div, int(1280 * d["width_coefficient"] + div / 2) // div * div)
        d["_hidden_dim_set"] = True
    if _int(d.get("num_query_pool")) and isinstance(d.get("depths"), list):  # hiera: < number of stages
        d["num_query_pool"] = min(d["num_query_pool"], max(0, len(d["depths"]) - 1))
    if _int(d.get("num_groups")) and d["num_groups"] > 4 and "hidden_sizes" in d:  # bit: group norm groups
        d["num_groups"] = 4
    if d.get("is_encoder_decoder") is True and d.get("decoder_start_token_id") is None \
            and _int(d.get("pad_token_id")) is not None:
        # t5: classification heads and labels shift right with it; 5.x T5Config no longer declares it, and the
        # checkpoints' config.json carry it
        d["decoder_start_token_id"] = d["pad_token_id"]
    for key in ("vision_feature_layer", "feature_layer", "select_layer", "vision_feature_layers"):
        v = d.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            d[key] = -1 if v < 0 else 0 if v == 0 else LAYERS - 1
        elif isinstance(v, list) and all(isinstance(x, int) for x in v):
            d[key] = sorted({-1 if x < 0 else min(x, LAYERS - 1) for x in v})
    for key, v in list(d.items()):
        if isinstance(v, bool) or v is None:
            continue
        if _is_subconfig(v):
            d[key] = shrink_dict(v, ids, path + key + ".")
            continue
        if isinstance(v, dict) and key in ("encoder", "decoder") and v:
            d[key] = shrink_dict(v, ids, path + key + ".")
            continue
        if isinstance(v, int):
            if key == d.get("_mamba_heads_set") or (key == "head_dim" and d.get("_mamba_heads_set") == "num_heads"):
                continue
            if (key == "embed_dim" and (d.get("_embed_set") or d.get("_vq_set"))) \
                    or (key == "hidden_size" and d.get("_vq_set")) or (key == "hidden_dim" and d.get("_hidden_dim_set")):
                continue
            if key in HIDDEN_KEYS and v > HIDDEN:
                d[key] = HIDDEN
            elif key in INTER_KEYS and v > INTER:
                d[key] = INTER
            elif key in HEADS_KEYS:
                d[key] = _heads(v)
            elif key in KV_KEYS:
                if orig_heads is None or v >= orig_heads:
                    d[key] = _heads(v)
                elif v == 1:
                    d[key] = 1
                else:
                    d[key] = max(1, _heads(orig_heads) // 2)
            elif key in HEAD_DIM_KEYS and v > HEAD_DIM:
                d[key] = HEAD_DIM
            elif (key in VOCAB_KEYS or key.endswith("vocab_size") or key.endswith("_vocab")) and v > VOCAB:
                d[key] = VOCAB
            elif key in TEXT_POS_KEYS and v > TEXT_POSITIONS:
                d[key] = TEXT_POSITIONS if not is_vision or key != "max_position_embeddings" else 16 + 1
            elif key in AUDIO_POS_KEYS and v > AUDIO_POSITIONS:
                d[key] = AUDIO_POSITIONS
            elif key in EXPERT_KEYS and v > EXPERTS:
                d[key] = EXPERTS
            elif key in TOPK_KEYS and v > TOPK:
                d[key] = TOPK
            elif key == "n_shared_experts" and v > 1:
                d[key] = 1
            elif key in ("n_group", "topk_group", "num_expert_group"):
                d[key] = 1
            elif key in ("image_size", "img_size", "crop_size", "max_image_size", "min_image_size", "max_img_size") \
                    and v > IMAGE_SIZE:
                d[key] = IMAGE_SIZE
            elif key in ("patch_size", "model_patch_size") and v > PATCH:
                d[key] = PATCH
            elif key in ("rotary_dim", "rotary_emb_dim") and orig.get("head_dim") and v > HEAD_DIM // 2:
                # partial rotary (gpt-j, codegen): keep it partial, and never wider than the tiny head
                d[key] = HEAD_DIM if v >= orig["head_dim"] else HEAD_DIM // 2
            elif key == "hidden_size_per_layer_input" and v > HEAD_DIM:
                d[key] = HEAD_DIM
            elif key in ("resampler_n_latents", "latent_query_num") and v > 8:
                d[key] = 8  # idefics2: image tokens per image
            elif key == "zero_expert_num" and v > 2:
                d[key] = 2
            elif key == "mm_tokens_per_image" and v > 4:
                # gemma3: pooled to sqrt(mm_tokens) per side from (IMAGE_SIZE / PATCH) patches per side
                d[key] = 4
            elif key == "num_kv_shared_layers" and v > 0:
                d[key] = 0  # gemma3n: the shared tail needs an earlier layer of each type; a 2-layer model has none
            elif key in ("qk_nope_head_dim", "qk_rope_head_dim") and v > HEAD_DIM // 2:
                d[key] = HEAD_DIM // 2
            elif key == "qk_head_dim" and v > HEAD_DIM:
                d[key] = HEAD_DIM
            elif key in ("kv_lora_rank", "q_lora_rank") and v > 2 * HIDDEN // 4:
                d[key] = 32
            elif key in ("sliding_window", "attention_chunk_size", "local_attention_window_len",
                         "attention_window_size") and v > 32:
                d[key] = 32
            elif key in ("position_embedding_size", "mm_posemb_size") and is_vision and v > TEXT_POSITIONS:
                d[key] = TEXT_POSITIONS  # gemma4: rows per axis of the 2D patch position table
            elif key == "attention_window" and v > 8:
                d[key] = 8
            elif key in ("num_conv_pos_embeddings", "conv_pos_kernel_size") and v > 16:
                d[key] = 16
            elif key == "num_conv_pos_embedding_groups" and v > 2:
                d[key] = 2
            elif key in ("original_max_position_embeddings",) and v > TEXT_POSITIONS // 2:
                d[key] = TEXT_POSITIONS // 2
            elif (SPECIAL_ID_RE.search(key) and key not in NOT_IDS and not key.startswith("num_")):
                d[key] = ids(v)
        elif isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            if key in ("conv_dim", "tdnn_dim"):
                d[key] = [min(x, 32) for x in v]
            elif key in ("hidden_sizes", "embed_dims", "neck_hidden_sizes", "encoder_hidden_sizes", "embed_dim",
                         "embed_dim_per_stage", "stage_out_channels", "stage_in_channels", "stage_mid_channels",
                         "fusion_hidden_sizes", "backbone_channel_list"):
                d[key] = [min(x, 16 * (i + 1)) for i, x in enumerate(v)]
            elif key == "downsample_channels":
                # SAM necks of the OCR models: the last one feeds the next encoder (hidden size), halving before it
                d[key] = [HIDDEN >> (len(v) - 1 - i) for i in range(len(v))]
            elif key in ("depths", "num_block_repeats", "blocks_per_stage", "stage_num_blocks", "block_repeats",
                         "stage_numb_of_layers", "depth"):
                d[key] = [min(x, 1) for x in v]
            elif key in ("num_heads", "num_attention_heads", "num_attention_heads_per_stage"):
                d[key] = [_pow2_le(x, 2) for x in v]
            elif key in ("image_size", "crop_size") and all(x > IMAGE_SIZE for x in v):
                d[key] = [IMAGE_SIZE] * len(v)
            elif key == "patch_size" and all(x > PATCH for x in v):
                d[key] = [PATCH] * len(v)
            elif key in ("eos_token_id", "bos_token_id", "pad_token_id") or key.endswith("_token_ids"):
                d[key] = [ids(x) for x in v]
            elif key in ("intermediate_size", "moe_intermediate_size"):
                d[key] = [min(x, INTER) for x in v]
        elif key == "image_grid_pinpoints" and isinstance(v, list):
            d[key] = [[IMAGE_SIZE, IMAGE_SIZE]]
    d.pop("_mamba_heads_set", None)
    d.pop("_embed_set", None)
    d.pop("_hidden_dim_set", None)
    d.pop("_vq_set", None)
    _derived_dims(d, orig)
    for key in ("rope_scaling", "rope_parameters"):  # after the head size is shrunk: sections sum to its half
        if isinstance(d.get(key), dict):
            d[key] = _shrink_rope(d[key], _rotary_half(d))
    if isinstance(d.get("mrope_section"), list):
        d["mrope_section"] = _scale_sections(d["mrope_section"], _rotary_half(d), force=True)
    return d


def _int(v) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _orig_dims(d: dict, orig_heads: Optional[int]) -> dict:
    """The original dimensions that derived values (head_dim of MLA, mamba_d_ssm, ...) are checked against."""
    hidden = next((_int(d.get(k)) for k in ("hidden_size", "d_model", "n_embd", "n_embed", "dim") if _int(d.get(k))), None)
    head_dim = _int(d.get("head_dim")) or _int(d.get("attention_head_size"))
    if head_dim is None and hidden and orig_heads:
        head_dim = hidden // orig_heads
    return {"head_dim": head_dim, "qk_rope_head_dim": _int(d.get("qk_rope_head_dim")),
            "qk_nope_head_dim": _int(d.get("qk_nope_head_dim")), "qk_head_dim": _int(d.get("qk_head_dim")),
            "hidden": hidden, "attention_hidden_size": _int(d.get("attention_hidden_size"))}


def _derived_dims(d: dict, orig: dict) -> None:
    """Values that must stay consistent with other, already shrunk values of the same level."""
    rope, nope = _int(d.get("qk_rope_head_dim")), _int(d.get("qk_nope_head_dim"))
    if rope is not None and nope is not None:  # multi-head latent attention (deepseek v2/v3, longcat)
        if "qk_head_dim" in d:
            d["qk_head_dim"] = rope + nope
        if _int(d.get("head_dim")) and orig.get("head_dim") == orig.get("qk_rope_head_dim"):
            d["head_dim"] = rope  # the rotary dim of MLA configs
    heads, dhead = _int(d.get("mamba_n_heads")), _int(d.get("mamba_d_head"))
    if heads and dhead and _int(d.get("mamba_d_ssm")):  # falcon-h1: d_ssm = heads x head dim
        d["mamba_d_ssm"] = heads * dhead
    if orig.get("hidden") and orig.get("attention_hidden_size") == 2 * orig["hidden"] and _int(d.get("hidden_size")):
        # zamba/zamba2: the shared attention block reads [hidden states, input embeddings] concatenated
        d["attention_hidden_size"] = 2 * d["hidden_size"]
        heads = _int(d.get("num_attention_heads"))
        if heads and _int(d.get("attention_head_dim")):
            d["attention_head_dim"] = d["attention_hidden_size"] // heads


def _rotary_half(d: dict) -> int:
    """Half the rotary dim of this (already shrunk) config level: what an mrope section must sum to."""
    if isinstance(d.get("qk_rope_head_dim"), int):
        return d["qk_rope_head_dim"] // 2
    head_dim = d.get("head_dim") if isinstance(d.get("head_dim"), int) else HEAD_DIM
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    factor = d.get("partial_rotary_factor") or (rope.get("partial_rotary_factor") if isinstance(rope, dict) else None) or 1.0
    return max(1, int(head_dim * factor) // 2)


def _scale_sections(sections: list, total: int, force: bool = False) -> list:
    orig = sum(sections)
    if orig == total or (orig < total and not force):
        return sections
    out = [max(1, round(s * total / orig)) for s in sections]
    while sum(out) > total:
        out[out.index(max(out))] -= 1
    while sum(out) < total:
        out[out.index(min(out))] += 1
    return out


def _shrink_rope(rope: dict, half: int = HEAD_DIM // 2) -> dict:
    rope = copy.deepcopy(rope)
    if rope and all(isinstance(v, dict) for v in rope.values()):  # per layer type (gemma3, ...)
        return {k: _shrink_rope(v, half) for k, v in rope.items()}
    for key, v in list(rope.items()):
        if key in ("short_factor", "long_factor") and isinstance(v, list):
            # phi3 longrope: one factor per rotary frequency (rotary_dim / 2)
            rope[key] = v[:half] if len(v) > half else v
        elif key == "mrope_section" and isinstance(v, list):
            rope[key] = _scale_sections(v, half, force=True)
        elif key == "original_max_position_embeddings" and isinstance(v, int) and v > TEXT_POSITIONS // 2:
            rope[key] = TEXT_POSITIONS // 2
    return rope


def shrink_config(config, overrides: Optional[dict] = None):
    """A tiny config of the same class as ``config``; ``overrides`` (nested dict) is merged in last."""
    d = config.to_dict()
    for noisy in ("id2label", "label2id", "_name_or_path", "transformers_version", "architectures"):
        d.pop(noisy, None)
    _fill_optional_vision(config, d)
    _drop_base_defaults(d)
    ids = IdMap()
    d = shrink_dict(d, ids)
    d = _drop_sub_labels(d)
    _default_pad(d)
    _default_image_token(d, ids)
    if overrides:
        d = _merge(d, overrides)
    cls = type(config)
    d.pop("model_type", None)
    new = _build(cls, d)
    patch = _mrope_refit(new.to_dict())
    if patch:  # sections the constructors filled in from their full-size defaults
        new = _build(cls, _merge(d, patch))
    return new


def _build(cls, d: dict):
    try:
        return cls.from_dict(copy.deepcopy(d))
    except TypeError:
        return cls(**copy.deepcopy(d))


def _mrope_refit(d: dict) -> dict:
    """M-RoPE sections that a constructor set from its defaults (glm46v, glm_ocr, paddleocr_vl: ``mrope_section``
    [8, 12, 12] for a 64-dim rotary half) and that do not fit the tiny head: ``{path: rope dict}`` to merge in."""
    patch = {}
    for key, v in d.items():
        if isinstance(v, dict) and key in ("rope_scaling", "rope_parameters"):
            sec = v.get("mrope_section")
            half = _rotary_half(d)
            if isinstance(sec, list) and sec and sum(sec) != half:
                patch[key] = {**v, "mrope_section": _scale_sections(sec, half, force=True)}
        elif isinstance(v, dict):
            sub = _mrope_refit(v)
            if sub:
                patch[key] = sub
    return patch


def _fill_optional_vision(config, d: dict) -> None:
    """A composite whose vision tower is optional and absent by default (Gemma 4: ``vision_config`` None, a
    text-only model) gets its vision sub-config's defaults, shrunk like any other: the image-text classes are
    built with a vision tower, as from a multimodal checkpoint."""
    subs = getattr(config, "sub_configs", None)
    sub_cls = subs.get("vision_config") if isinstance(subs, dict) else None
    if sub_cls is not None and d.get("vision_config", 0) is None:
        try:
            d["vision_config"] = sub_cls().to_dict()
        except Exception:  # noqa: BLE001 - a sub-config without usable defaults: the model stays text-only
            return


def _drop_base_defaults(d: dict) -> None:
    """Nested config dicts of classes without a model type (dbrx's ``attn_config``/``ffn_config``) serialise every
    ``PretrainedConfig`` attribute, and some of those classes refuse them back as unknown kwargs: drop the ones
    still at the base default."""
    try:
        from transformers import PretrainedConfig

        base = PretrainedConfig().to_dict()
    except Exception:  # noqa: BLE001
        return
    for key, v in list(d.items()):
        if isinstance(v, dict) and v.get("model_type") == "" and key.endswith("_config"):
            d[key] = {k: x for k, x in v.items()
                      if k == "model_type" or k not in base or (x != base[k] and k not in ("_name_or_path",))}


def _default_pad(d: dict) -> None:
    """pad_token_id None -> 0 (top level and text sub-config): classification heads need one for batches."""
    if "pad_token_id" in d and d["pad_token_id"] is None and isinstance(d.get("vocab_size"), int):
        d["pad_token_id"] = 0
    for key in ("text_config", "decoder", "language_config"):
        sub = d.get(key)
        if isinstance(sub, dict) and sub.get("pad_token_id", 0) is None and isinstance(sub.get("vocab_size"), int):
            sub["pad_token_id"] = 0


def _default_image_token(d: dict, ids: IdMap) -> None:
    """A Q-Former composite whose default config leaves its image placeholder id None (blip-2, instructblip: the
    checkpoints set ``image_token_index``) gets a free top id of the tiny vocab, as the other remapped special ids.
    (Not every None placeholder means that: minicpm-v finds its images without one.)"""
    if isinstance(d.get("qformer_config"), dict) and "image_token_index" in d and d["image_token_index"] is None:
        d["image_token_index"] = ids.fresh()


def _drop_sub_labels(d: dict) -> dict:
    for key, v in list(d.items()):
        if _is_subconfig(v):
            v = dict(v)
            v.pop("id2label", None)
            v.pop("label2id", None)
            v.pop("transformers_version", None)
            d[key] = _drop_sub_labels(v)
    return d


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], v)
        else:
            out[key] = v
    return out


def rotary_dim_ok(config) -> bool:  # pragma: no cover - helper for overrides
    return True


def ceil_div(a: int, b: int) -> int:
    return int(math.ceil(a / b))
