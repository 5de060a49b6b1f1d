"""GGUF weights kept quantized: their formats (``formats.py``) and a matrix's blocks on the way
from a checkpoint (``tensor.py``), repacked once at load by the CPU kernels' ``quant_pack``."""
