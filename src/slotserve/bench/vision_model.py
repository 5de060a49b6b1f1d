"""Random-weight Qwen2.5-VL, Qwen3-VL and Gemma 3 checkpoints saved by transformers itself,
with SmolLM2's tokenizer given the models' image tokens and a chat template that writes them:
no vision checkpoint ships offline. The tests' tiny models (the references for parity), the
benchmark's real-sized vision tower beside SmolLM2-135M's decoder, and images drawn with
PIL."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np

from slotserve.bench.model_shapes import SMOLLM2_135M

# Qwen2-VL's chat template, reduced to what the tests and benchmarks send: ChatML, images as
# <|vision_start|><|image_pad|><|vision_end|> where they stand in a message.
VL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]

TINY_TEXT: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
    "initializer_range": 0.08,
}
TINY_VISION: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "fullatt_block_indexes": [1],
    "window_size": 56,
    "initializer_range": 0.08,
}
# Qwen3-VL's: Qwen3's decoder (its own head_dim), interleaved M-RoPE; a tower with learned
# position embeddings and deepstack features from its first two blocks.
TINY_QWEN3_TEXT: dict[str, Any] = TINY_TEXT | {
    "head_dim": 32,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 5000000.0,
        "mrope_section": [6, 5, 5],
        "mrope_interleaved": True,
    },
}
TINY_QWEN3_VISION: dict[str, Any] = {
    "depth": 3,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 2,
    "patch_size": 16,
    "num_position_embeddings": 64,
    "deepstack_visual_indexes": [0, 1],
    "initializer_range": 0.08,
}
# Qwen3-VL MoE's: Qwen3-MoE's decoder (4 experts, 2 per token, every layer sparse) with Qwen3-VL's
# M-RoPE; its tower is Qwen3-VL's.
TINY_QWEN3_MOE_TEXT: dict[str, Any] = TINY_QWEN3_TEXT | {
    "moe_intermediate_size": 48,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
}
# model_type → transformers' configuration and model classes, the image processor's patch.
FAMILIES = {
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", 14),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", 16),
    "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration", 16),
}
# SmolLM2-135M's decoder with M-RoPE over its 64-dim heads (the vocabulary is the tokenizer's,
# the head untied as Qwen2.5-VL's).
SMOLLM2_TEXT: dict[str, Any] = {
    key: value
    for key, value in SMOLLM2_135M.items()
    if key not in ("vocab_size", "rope_theta", "tie_word_embeddings")
} | {
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": SMOLLM2_135M["rope_theta"],
        "mrope_section": [8, 12, 12],
    },
}

# Qwen2.5-VL's vision tower as every size of it ships (3B to 72B: 32 blocks of 1280).
QWEN2_5_VL_VISION: dict[str, Any] = {
    "depth": 32,
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "fullatt_block_indexes": [7, 15, 23, 31],
    "window_size": 112,
}


def qwen_vl_folder(
    tokenizer_source: Path,
    out_dir: Path,
    text: dict[str, Any] = TINY_TEXT,
    vision: dict[str, Any] = TINY_VISION,
    max_pixels: int = 28 * 28 * 48,
    dtype: str = "float32",
    family: str = "qwen2_5_vl",
) -> Path:
    """A random Qwen2.5-VL (or ``family`` qwen3_vl, qwen3_vl_moe) folder: ``tokenizer_source``
    an HF folder or a GGUF file (its tokenizer); ``max_pixels`` the image processor's bound."""
    import torch
    import transformers
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    source = tokenizer_source
    tokenizer: Any = (
        AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
        if source.is_file()
        else AutoTokenizer.from_pretrained(str(source))
    )
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = VL_TEMPLATE
    start, end, pad = (tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS)
    vocab = (len(tokenizer) + 63) // 64 * 64
    config_class, model_class, patch = FAMILIES[family]
    config = getattr(transformers, config_class)(
        text_config={
            "vocab_size": vocab,
            "rms_norm_eps": 1e-6,
            "bos_token_id": 1,
            "eos_token_id": 2,
        }
        | text,
        vision_config={"out_hidden_size": text["hidden_size"]} | vision,
        image_token_id=pad,
        video_token_id=vocab - 1,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model: Any = getattr(transformers, model_class)(config)
    model.to(getattr(torch, dtype)).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    normal: dict[str, Any] = (
        {"image_mean": [0.5] * 3, "image_std": [0.5] * 3} if family != "qwen2_5_vl" else {}
    )
    processor = Qwen2VLImageProcessorPil(
        min_pixels=(2 * patch) ** 2 * 4, max_pixels=max_pixels, patch_size=patch, **normal
    )
    processor.save_pretrained(out_dir)
    return out_dir


# Gemma 3's: a sliding layer (window 16) then a global one; SigLIP on 64×64 images in 8×8
# patches, pooled into 16 image tokens.
TINY_GEMMA3_TEXT: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "query_pre_attn_scalar": 32,
    "sliding_window": 16,
    "layer_types": ["sliding_attention", "full_attention"],
    "max_position_embeddings": 2048,
    "initializer_range": 0.08,
}
TINY_SIGLIP: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": 64,
    "patch_size": 8,
    "vision_use_head": False,
}
GEMMA3_IMAGE_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
GEMMA3_TEMPLATE = VL_TEMPLATE.replace(
    "<|vision_start|><|image_pad|><|vision_end|>", "<start_of_image>"
)


def gemma3_vl_folder(tokenizer_source: Path, out_dir: Path, tokens_per_image: int = 16) -> Path:
    """A random Gemma 3 with SigLIP (``Gemma3ForConditionalGeneration``): ``tokenizer_source``
    an HF folder (its tokenizer, given Gemma 3's image tokens and a template writing
    ``<start_of_image>``). The projector and the norms, which transformers starts at zero,
    are drawn at random too, so that images and norms matter."""
    import torch
    from transformers import (
        AutoTokenizer,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessorPil,
    )

    tokenizer: Any = AutoTokenizer.from_pretrained(str(tokenizer_source))
    tokenizer.add_special_tokens({"additional_special_tokens": GEMMA3_IMAGE_TOKENS})
    tokenizer.chat_template = GEMMA3_TEMPLATE
    boi, eoi, soft = (tokenizer.convert_tokens_to_ids(t) for t in GEMMA3_IMAGE_TOKENS)
    vocab = (len(tokenizer) + 63) // 64 * 64
    config = Gemma3Config(
        text_config=TINY_GEMMA3_TEXT
        | {"vocab_size": vocab, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
        vision_config=TINY_SIGLIP,
        mm_tokens_per_image=tokens_per_image,
        boi_token_index=boi,
        eoi_token_index=eoi,
        image_token_index=soft,
    )
    torch.manual_seed(0)
    model: Any = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "mm_input_projection_weight" in name:
                weight.normal_(0, 0.5)
            elif "norm" in name and "layernorm" not in name and weight.dim() == 1:
                weight.normal_(0, 0.1)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    side = TINY_SIGLIP["image_size"]
    Gemma3ImageProcessorPil(size={"height": side, "width": side}).save_pretrained(out_dir)
    return out_dir


def picture(width: int, height: int, seed: int, kind: str = "PNG") -> bytes:
    """An image of random colour blocks (PIL), ``width`` × ``height``, encoded as ``kind``."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (max(height // 8, 1), max(width // 8, 1), 3), dtype=np.uint8)
    image = Image.fromarray(blocks).resize((width, height), Image.Resampling.NEAREST)
    out = io.BytesIO()
    image.save(out, format=kind)
    return out.getvalue()
