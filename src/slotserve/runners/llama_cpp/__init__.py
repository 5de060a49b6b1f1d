"""The llama.cpp runner (``runner.py``) and what the API process keeps of it (``frontend.py``).
Nothing here imports llama_cpp: options can name this package's choices without loading it."""

# --repack: ggml's extra weight buffer types on, off, or on where they are safe (cpu.py).
REPACK_CHOICES = ("auto", "on", "off")
