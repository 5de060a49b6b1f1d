"""R2: the PyTorch runner (HF safetensors folders and GGUF files; CPU and CUDA)."""
