"""GGUF weights kept quantized: their formats (``formats.py``), repacked once at load for the
CPU kernels (``packing.py``), and a projection's weight as the kernels multiply it
(``weight.py``)."""
