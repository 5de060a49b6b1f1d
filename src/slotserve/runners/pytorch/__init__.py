"""The PyTorch runner (HF safetensors folders and GGUF files; CPU and CUDA). Nothing here
imports torch: options can name this package's choices without loading it."""

# --attention-backend: where the CPU kernels do not serve, the Triton kernels reading the paged
# KV pool in place (gpu_kernels.py) or torch's operators over gathered K/V (model/attention.py).
ATTENTION_BACKENDS = ("auto", "torch", "triton")
