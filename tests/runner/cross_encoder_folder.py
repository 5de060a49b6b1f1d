"""A random-weight BERT cross-encoder (``BertForSequenceClassification``, one label) with the
MiniLM package's tokenizer, written to a folder: the reference is sentence-transformers'
``CrossEncoder`` on the same folder, so the weights need not mean anything."""

from __future__ import annotations

from pathlib import Path

from tests.runner.minilm import minilm_path


def write_cross_encoder(folder: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522,  # the MiniLM tokenizer's
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        # Wider than BERT's 0.02, so that scores spread and an order is worth checking.
        initializer_range=0.2,
    )
    config.num_labels = 1  # one logit: the relevance score (a keyword mypy's stubs lack)
    BertForSequenceClassification(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(minilm_path())).save_pretrained(folder)
    return folder
