"""The encoder runner (BERT): embeddings and a cross-encoder's scores, never generation."""
