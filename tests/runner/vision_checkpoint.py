"""A tiny random Qwen2.5-VL saved by transformers itself (the reference for parity tests),
with SmolLM2's tokenizer given Qwen's vision tokens and a chat template that writes them, and
images drawn with PIL."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np

# Qwen2-VL's chat template, reduced to what the tests send: ChatML, images as
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


def tiny_qwen_vl(tokenizer_dir: Path, out_dir: Path) -> Path:
    import torch
    from transformers import (
        AutoTokenizer,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )

    tokenizer: Any = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = VL_TEMPLATE
    start, end, pad = (tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS)
    vocab = (len(tokenizer) + 63) // 64 * 64
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": vocab,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [4, 6, 6],
            },
            "bos_token_id": 1,
            "eos_token_id": 2,
            "initializer_range": 0.08,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 128,
            "fullatt_block_indexes": [1],
            "window_size": 56,
            "initializer_range": 0.08,
        },
        image_token_id=pad,
        video_token_id=vocab - 1,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model: Any = Qwen2_5_VLForConditionalGeneration(config)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 48).save_pretrained(
        out_dir
    )
    return out_dir


def picture(width: int, height: int, seed: int) -> bytes:
    """A PNG of random colour blocks (PIL), ``width`` × ``height``."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (max(height // 8, 1), max(width // 8, 1), 3), dtype=np.uint8)
    image = Image.fromarray(blocks).resize((width, height), Image.Resampling.NEAREST)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()
