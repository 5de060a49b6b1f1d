"""Backend-agnostic engine core.

NOTE: nothing in this package may import torch or llama_cpp (a test enforces it); runners
implement :class:`slotserve.engine.runner_interface.Runner` and are handed in from outside.
"""
