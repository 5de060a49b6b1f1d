"""The PyTorch runner (HF safetensors folders and GGUF files; CPU and CUDA)."""
