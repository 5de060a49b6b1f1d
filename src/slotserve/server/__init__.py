"""HTTP layer: OpenAI-compatible routes over the engine's async bridge."""
