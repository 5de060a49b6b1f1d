"""The llama.cpp runner (``runner.py``) and what the API process keeps of it (``frontend.py``).
Its options are declared in ``runners/options.py``."""
