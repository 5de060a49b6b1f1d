"""GGUF weights kept quantized: their formats (``formats.py``), a matrix's blocks on the way
from a checkpoint (``tensor.py``), repacked once at load for the CPU kernels (``packing.py``)."""
