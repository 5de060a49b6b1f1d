"""The PyTorch runner (HF safetensors folders and GGUF files; CPU and CUDA): ``runner.py``
loads a model in one pass and runs its steps. Its options are declared in
``runners/options.py``."""
