"""slotserve: an OpenAI-compatible inference server with continuous batching."""

__version__ = "0.1.0"
