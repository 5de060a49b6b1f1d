"""``slotserve bench``: a load generator for any OpenAI-compatible server (SPEC B1, B2)."""
