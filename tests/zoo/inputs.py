"""Inputs that hit the shims' triggers, shaped for each model from its forward signature and its tiny config.

Two input sets per model (``make_inputs``):

* ``main``: the triggers that do not interfere, in one batch of 3 rows of
  ``TEXT_LEN`` (60) tokens, close to the 64-position text limit and longer
  than every vision/audio position table of the tiny models (17 / 16):
  row 0 full (with the image tokens of a multimodal model), row 1 left-padded
  (24 pad tokens), row 2 fully padded. Vision/audio models get pixel values /
  features of the tiny sizes; encoder-decoders a 20-token decoder input.
* ``packed`` (decoder LMs whose forward takes ``position_ids``): one row,
  two examples of 28 and 32 tokens, positions restarting at 0, all-ones 2D
  mask. ``packed_parts`` keeps each example alone, for the ``packed_gap_down``
  check.

Everything is generated from fixed seeds: plain and shimmed runs get the very
same tensors.
"""

from __future__ import annotations

import inspect
import re
from typing import Dict, Optional

import torch

TEXT_LEN = 60
PAD_LEFT = 24
DECODER_LEN = 20
PACK = (28, 32)
LOW_ID, HIGH_ID = 16, 200  # token ids that are never special ids of the tiny configs (see shrink.IdMap)


class InputError(Exception):
    """The model's inputs could not be made (an unsupported input recipe): a skip, not a failure."""


def forward_params(model) -> Dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return {}


def _cfg(config, *names, default=None):
    """The first of ``names`` found on ``config`` or on its sub-configs (text first, then vision/audio)."""
    for owner in _owners(config):
        for name in names:
            value = getattr(owner, name, None)
            if value is not None:
                return value
    return default


def _owners(config):
    yield config
    for sub in ("text_config", "decoder", "language_config", "llm_config", "vision_config", "audio_config",
                "encoder", "speech_config", "encoder_config", "vision_encoder_config", "audio_encoder_config"):
        value = getattr(config, sub, None)
        if value is not None and hasattr(value, "to_dict"):
            yield value


def _sub(config, names):
    for name in names:
        value = getattr(config, name, None)
        if value is not None and hasattr(value, "to_dict"):
            return value
    return None


def vision_config(config):
    return _sub(config, ("vision_config", "vision_encoder_config", "image_config", "visual_config")) or config


def pad_id(config) -> int:
    value = _cfg(config, "pad_token_id")
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return int(value) if isinstance(value, int) and value >= 0 else 0


def vocab_size(config) -> int:
    text = _sub(config, ("text_config", "decoder", "language_config", "llm_config"))
    for owner in (config, text):
        value = getattr(owner, "vocab_size", None) if owner is not None else None
        if isinstance(value, int) and value > 0:
            return value
    return 256


def text_ids(gen: torch.Generator, config, shape) -> torch.Tensor:
    high = min(HIGH_ID, vocab_size(config) - 1)
    low = min(LOW_ID, max(3, high - 1))
    return torch.randint(low, max(low + 1, high), shape, generator=gen)


def image_token_id(config) -> Optional[int]:
    for name in ("image_token_id", "image_token_index", "image_token"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


def image_tensor(gen, config, n: int) -> torch.Tensor:
    vc = vision_config(config)
    size = getattr(vc, "image_size", None) or getattr(config, "image_size", None) or 32
    if isinstance(size, (list, tuple)):
        h, w = int(size[0]), int(size[-1])
    elif isinstance(size, dict):
        h, w = int(size.get("height", 32)), int(size.get("width", 32))
    else:
        h = w = int(size)
    channels = getattr(vc, "num_channels", None) or getattr(vc, "in_channels", None) or 3
    return torch.randn((n, int(channels), h, w), generator=gen)


def qwen_vl_pixels(gen, config, n_images: int = 1):
    """Qwen2-VL style flattened patches and ``image_grid_thw`` (a 4x4 patch grid, 1 frame)."""
    vc = vision_config(config)
    patch = int(getattr(vc, "patch_size", 8) or 8)
    temporal = int(getattr(vc, "temporal_patch_size", 2) or 2)
    channels = int(getattr(vc, "in_channels", None) or getattr(vc, "in_chans", None) or getattr(vc, "num_channels", 3) or 3)
    merge = int(getattr(vc, "spatial_merge_size", 2) or 2)
    side = 2 * merge
    grid = torch.tensor([[1, side, side]] * n_images)
    pixels = torch.randn((n_images * side * side, channels * temporal * patch * patch), generator=gen)
    return pixels, grid


def patchified_pixels(gen, config, n_images: int = 1):
    """Gemma 4 style pre-patchified images: ``(images, patches, channels * patch * patch)`` and the ``(x, y)`` grid
    position of each patch; a square grid of 2 x ``pooling_kernel_size`` patches per side pools to 4 soft tokens."""
    vc = vision_config(config)
    patch = int(getattr(vc, "model_patch_size", None) or getattr(vc, "patch_size", 8) or 8)
    channels = int(getattr(vc, "num_channels", 3) or 3)
    side = 2 * int(getattr(vc, "pooling_kernel_size", 2) or 2)
    ys, xs = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    positions = torch.stack([xs.flatten(), ys.flatten()], dim=-1).unsqueeze(0).repeat(n_images, 1, 1)
    pixels = torch.rand((n_images, side * side, channels * patch * patch), generator=gen)
    return pixels, positions


def audio_inputs(gen, config, params, batch: int) -> Dict[str, torch.Tensor]:
    out = {}
    if "input_features" in params:
        mel = _cfg(config, "num_mel_bins", "feature_size", "input_feat_per_channel", "n_mels", default=80)
        positions = _cfg(config, "max_source_positions", default=None)
        if hasattr(config, "input_feat_per_channel") and hasattr(config, "input_channels"):  # speech_to_text
            out["input_features"] = torch.randn(
                (batch, 32, int(config.input_feat_per_channel) * int(config.input_channels)), generator=gen)
        elif positions:
            out["input_features"] = torch.randn((batch, int(mel), 2 * int(positions)), generator=gen)
        else:
            out["input_features"] = torch.randn((batch, int(mel), 32), generator=gen)
    elif "input_values" in params:
        out["input_values"] = torch.randn((batch, 4000), generator=gen)
    return out


def eos_id(config) -> Optional[int]:
    value = _cfg(config, "eos_token_id")
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return int(value) if isinstance(value, int) and value >= 0 else None


def make_inputs(model, config, *, decoder_lm: bool, seed: int = 0) -> Dict[str, dict]:
    """``{"main": kwargs, "packed": kwargs, "packed_parts": [kwargs, kwargs]}`` (packed only for decoder LMs)."""
    gen = torch.Generator().manual_seed(seed)
    params = forward_params(model)
    if not params:
        raise InputError("forward signature unreadable")
    takes = set(params)
    batch = 3
    main: dict = {}
    text = "input_ids" in takes
    pixel = "pixel_values" in takes
    image_token = image_token_id(config) if (text and pixel) else None
    if image_token is None and text and pixel and "image_embeds_position_mask" in takes:
        image_token = LOW_ID  # kosmos-2: the image positions are given by a mask; their ids are ordinary tokens
    if text:
        ids = text_ids(gen, config, (batch, TEXT_LEN))
        mask = torch.ones((batch, TEXT_LEN), dtype=torch.long)
        mask[1, :PAD_LEFT] = 0
        mask[2, :] = 0
        pid = pad_id(config)
        ids[1, :PAD_LEFT] = pid
        ids[2, :] = pid
        head = type(model).__name__
        classifier = head.endswith(("ForSequenceClassification", "ForQuestionAnswering", "ForTokenClassification"))
        if classifier and eos_id(config) is not None:  # BART-style heads pool at the (single) eos of every row
            ids[:, -1] = eos_id(config)
        main["input_ids"] = ids
        if "attention_mask" in takes:
            main["attention_mask"] = mask
        if "qformer_input_ids" in takes:  # instructblip: the instruction, tokenized for the Q-Former too
            qformer = _sub(config, ("qformer_config",))
            qvocab = getattr(qformer, "vocab_size", None) or 256
            main["qformer_input_ids"] = torch.randint(LOW_ID, max(LOW_ID + 1, min(HIGH_ID, qvocab - 1)), (batch, 8),
                                                      generator=gen)
            main["qformer_attention_mask"] = torch.ones((batch, 8), dtype=torch.long)
        if "bbox" in takes and getattr(config, "model_type", "") == "udop":
            # udop has no default layout (LayoutLM's default is all-zero boxes): normalised (x0, y0, x1, y1) boxes
            corner = torch.rand((batch, TEXT_LEN, 2), generator=gen) * 0.5
            main["bbox"] = torch.cat([corner, corner + 0.25], dim=-1)
        state_dim = _cfg(config, "max_state_dim")
        if "state" in takes and isinstance(state_dim, int):  # pi0: the robot state the action expert conditions on
            main["state"] = torch.randn((batch, state_dim), generator=gen)
        if "lang_ids" in takes:  # xmod: the language adapter of each row (a model without a default language)
            main["lang_ids"] = torch.zeros(batch, dtype=torch.long)
        codebooks = getattr(config, "num_codebooks", None)
        if getattr(config, "model_type", "").startswith("musicgen") and isinstance(codebooks, int) and codebooks > 1:
            # musicgen decoders: one row of audio codes per codebook, (batch * codebooks, length)
            main["input_ids"] = ids.repeat_interleave(codebooks, dim=0)
    if pixel:
        if "image_grid_thw" in takes:
            pixels, grid = qwen_vl_pixels(gen, config)
            main["pixel_values"], main["image_grid_thw"] = pixels, grid
        elif "image_position_ids" in takes:
            main["pixel_values"], main["image_position_ids"] = patchified_pixels(gen, config)
        elif image_token is not None:
            main["pixel_values"] = image_tensor(gen, config, 1)
            if "image_sizes" in takes and _cfg(config, "image_grid_pinpoints") is not None:
                # llava-next style any-resolution: base view + one 1x1 grid tile of the same size
                pix = main["pixel_values"]
                h, w = pix.shape[-2:]
                main["pixel_values"] = torch.stack([pix[0], pix[0].flip(-1)]).unsqueeze(0)
                main["image_sizes"] = torch.tensor([[h, w]])
        elif "state" in takes and "pixel_attention_mask" in takes:
            # pi0: every row sees its camera images, (batch, cameras, C, H, W) and which cameras are real
            main["pixel_values"] = image_tensor(gen, config, batch).unsqueeze(1)
            main["pixel_attention_mask"] = torch.ones((batch, 1), dtype=torch.bool)
        else:
            main["pixel_values"] = image_tensor(gen, config, 2 if text else batch)
    if "qformer_input_ids" in main and isinstance(main.get("pixel_values"), torch.Tensor):
        for key in ("qformer_input_ids", "qformer_attention_mask"):  # one instruction per image
            main[key] = main[key][: main["pixel_values"].shape[0]]
    if not text and not pixel:
        main.update(audio_inputs(gen, config, takes, 2))
        if not main:
            raise InputError("no input recipe for forward(" + ", ".join(list(takes)[:6]) + ", ...)")
    elif "input_features" in takes or "input_values" in takes:
        if not text:
            main.update(audio_inputs(gen, config, takes, batch))
    head_name = type(model).__name__
    pooled = head_name.endswith(("ForSequenceClassification", "ForQuestionAnswering"))
    if not pooled and (getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in takes and text or (
            not text and "decoder_input_ids" in takes)):
        main["decoder_input_ids"] = text_ids(gen, config, (main_batch(main), DECODER_LEN))
    if image_token is not None:
        main["__image_token__"] = image_token
    out = {"main": main}
    if decoder_lm and text and "position_ids" in takes and not pixel:
        a, b = PACK
        ids = text_ids(gen, config, (1, a + b))
        pos = torch.cat([torch.arange(a), torch.arange(b)]).unsqueeze(0)
        packed = {"input_ids": ids, "position_ids": pos}
        if "attention_mask" in takes:
            packed["attention_mask"] = torch.ones_like(ids)
        out["packed"] = packed
        parts = []
        for start, length in ((0, a), (a, b)):
            part = {"input_ids": ids[:, start:start + length].clone(),
                    "position_ids": torch.arange(length).unsqueeze(0)}
            if "attention_mask" in takes:
                part["attention_mask"] = torch.ones((1, length), dtype=torch.long)
            parts.append(part)
        out["packed_parts"] = parts
    return out


def fallbacks(main: dict):
    """Simpler variants of the main batch, for models that refuse it: without the fully padded row, then unpadded."""
    ids = main.get("input_ids")
    if ids is None or ids.shape[0] < 3:
        return []
    out = []
    two = {k: (v[:2] if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == ids.shape[0] else v)
           for k, v in main.items()}
    out.append(("rows 0-1 (no fully padded row)", two))
    if "attention_mask" in main:
        one = {k: (v[:1] if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == ids.shape[0] else v)
               for k, v in main.items()}
        out.append(("row 0 only (no padding)", one))
    return out


def main_batch(main: dict) -> int:
    for key in ("input_ids", "input_features", "input_values", "pixel_values"):
        if key in main:
            return int(main[key].shape[0]) if key != "pixel_values" or "input_ids" not in main else int(main["input_ids"].shape[0])
    return 1


FEATURES_RE = re.compile(r"features:?\s*(\d+)|(\d+)\s*features", re.I)


def place_image_tokens(main: dict, n_tokens: int, takes=(), config=None) -> dict:
    """Put ``n_tokens`` image tokens (one image) in row 0, after a few text tokens, between the vision start and
    end tokens where the config has them (Qwen-VL processors; the Omni thinkers count images from them); with the
    ``mm_token_type_ids`` the processors of M-RoPE models return (1 = image) when the forward takes them."""
    token = main.pop("__image_token__")
    ids = main["input_ids"]
    if n_tokens + 4 > ids.shape[1]:
        raise InputError(f"{n_tokens} image tokens do not fit {ids.shape[1]} text tokens")
    ids[0, 2:2 + n_tokens] = token
    for name, where in (("vision_start_token_id", 1), ("vision_end_token_id", 2 + n_tokens)):
        value = getattr(config, name, None) if config is not None else None
        if isinstance(value, int) and 0 <= value < vocab_size(config):
            ids[0, where] = value
    main["input_ids"] = ids
    placed = torch.zeros_like(ids, dtype=torch.bool)
    placed[0, 2:2 + n_tokens] = True
    if "mm_token_type_ids" in takes:
        main["mm_token_type_ids"] = placed.to(torch.int32)
    if "image_embeds_position_mask" in takes:
        main["image_embeds_position_mask"] = placed.to(torch.long)
    return main


IMAGE_KEYS = ("pixel_values", "image_sizes", "image_grid_thw", "image_position_ids", "pixel_attention_mask",
              "spatial_shapes", "image_merge_sizes", "image_grid_hw", "qformer_input_ids", "qformer_attention_mask")


def count_image_tokens(model, main: dict) -> Optional[int]:
    """How many image tokens the model wants for ``main['pixel_values']``: from get_image_features when it exists.

    When the first layout is refused, the other layouts processors produce are tried (``image_layouts``), and
    ``main`` is changed to the first one the model's ``get_image_features`` accepts.
    """
    n = _count_image_tokens(model, main)
    if n is not None:
        return n
    for extra in image_layouts(model, main):
        n = _count_image_tokens(model, {**main, **extra})
        if n is not None:
            main.update(extra)
            return n
    return None


def image_layouts(model, main: dict) -> list:
    """Other layouts of the same image, as the processors of other model families produce them."""
    takes = set(forward_params(model))
    vc = vision_config(model.config)
    patch = getattr(vc, "patch_size", None)
    pix = main.get("pixel_values")
    grid = main.get("image_grid_thw")
    out = []
    if not isinstance(pix, torch.Tensor):
        return out
    if pix.dim() == 2 and isinstance(grid, torch.Tensor):
        # Qwen-VL style flattened patches of 2 frames; towers without temporal patches want one frame (dots3),
        # as (patches, C * p * p), (patches, C, p, p) (kimi_k25) or (1, patches, C, p, p) (paddleocr_vl)
        one = pix[:, : pix.shape[-1] // 2].contiguous() if pix.shape[-1] % 2 == 0 else pix
        layouts = [one]
        if isinstance(patch, int) and one.shape[-1] % (patch * patch) == 0:
            square = one.reshape(one.shape[0], -1, patch, patch)
            layouts += [square, square.unsqueeze(0)]
        merge = int(getattr(vc, "spatial_merge_size", None) or getattr(vc, "merge_size", None) or 2)
        for layout in layouts:
            out.append({"pixel_values": layout})
            # video_llama_3: the merge size of each image
            out.append({"pixel_values": layout, "image_merge_sizes": torch.tensor([merge] * grid.shape[0])})
        if isinstance(patch, int) and grid[:, 1:].remainder(merge).eq(0).all():
            # inkling2: one (merge * p, merge * p, C) pixel block per language-model token, the grid counted in tokens
            tokens = int((grid[:, 0] * grid[:, 1] * grid[:, 2]).sum()) // (merge * merge)
            side = merge * patch
            if one.numel() >= tokens * side * side * 3:
                block = one.flatten()[: tokens * side * side * 3].reshape(tokens, side, side, 3)
                out.append({"pixel_values": block, "image_grid_thw": grid // torch.tensor([1, merge, merge])})
    if pix.dim() == 4:
        n, c, h, w = pix.shape
        if "image_sizes" in takes and "image_sizes" not in main:  # pixtral/mistral3 towers: the size of each image
            out.append({"image_sizes": torch.tensor([[h, w]] * n)})
        # idefics2/3, smolvlm: a 5D batch of one image per row, with idefics3's pixel mask or granite_docling's tile mask
        plain = {"pixel_values": pix.unsqueeze(1)}
        masked = [{**plain, "pixel_attention_mask": torch.ones((n, 1, h, w), dtype=torch.bool)},
                  {**plain, "pixel_attention_mask": torch.ones((n, 1), dtype=torch.bool)}]
        out += masked + [plain] if "pixel_attention_mask" in takes else [plain] + masked
        if isinstance(patch, int) and patch > 0 and h % patch == 0 and w % patch == 0:
            # fuyu: the image as a sequence of flattened patches, (images, patches, patch * patch * channels);
            # siglip2 naflex towers (lfm2_vl) with the patch grid and the patch mask
            flat = pix.reshape(n, c, h // patch, patch, w // patch, patch).permute(0, 2, 4, 3, 5, 1)
            flat = flat.reshape(n, (h // patch) * (w // patch), patch * patch * c)
            out.append({"pixel_values": flat})
            # nemotron_h_omni: the patches of all images concatenated, with each image's patch grid
            out.append({"pixel_values": flat.reshape(-1, flat.shape[-1]),
                        "image_grid_hw": torch.tensor([[h // patch, w // patch]] * n)})
            out.append({"pixel_values": flat, "spatial_shapes": torch.tensor([[h // patch, w // patch]] * n),
                        "pixel_attention_mask": torch.ones(flat.shape[:2], dtype=torch.long)})
    return out


def _count_image_tokens(model, main: dict) -> Optional[int]:
    kwargs = {k: v for k, v in main.items() if k in IMAGE_KEYS}
    for owner in (model, getattr(model, "model", None)):
        fn = getattr(owner, "get_image_features", None)
        if fn is None:
            continue
        try:
            with torch.no_grad():
                feats = fn(**kwargs)
        except Exception:
            try:
                with torch.no_grad():
                    feats = fn(kwargs["pixel_values"])
            except Exception:
                continue
        n = _count_rows(feats)
        if n:
            return n
    return None


def _count_rows(feats) -> Optional[int]:
    if hasattr(feats, "pooler_output") and isinstance(getattr(feats, "pooler_output"), (torch.Tensor, list, tuple)):
        feats = feats.pooler_output
    elif hasattr(feats, "last_hidden_state") and not isinstance(feats, torch.Tensor):
        feats = feats.last_hidden_state
    if isinstance(feats, torch.Tensor):
        return int(feats.numel() // feats.shape[-1]) if feats.dim() >= 2 else None
    if isinstance(feats, (list, tuple)) and feats and all(isinstance(f, torch.Tensor) for f in feats):
        return int(sum(f.numel() // f.shape[-1] for f in feats))
    if isinstance(feats, (list, tuple)) and feats:
        return _count_rows(feats[0])
    return None


def tokens_from_error(message: str) -> Optional[int]:
    match = FEATURES_RE.search(message)
    if match:
        return int(match.group(1) or match.group(2))
    return None


def cast(inputs: dict, dtype) -> dict:
    """Floating inputs (pixels, audio) in the model's dtype; ids and masks untouched."""
    return {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in inputs.items()}
