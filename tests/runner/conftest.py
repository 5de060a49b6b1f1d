from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from slotserve.runners.llama_cpp_runner import LlamaCppRunner

FLASH_ATTN = True  # the server's default; references must use the same attention kernel


@pytest.fixture(scope="session")
def runner(model_path: Path) -> Iterator[LlamaCppRunner]:
    """One real runner for all runner tests (each test builds its own engine over it, which
    starts by emptying every slot's KV)."""
    r = LlamaCppRunner(
        model_path, num_slots=8, ctx_size=8 * 2048, max_batch_tokens=512, flash_attn=FLASH_ATTN
    )
    yield r
    r.close()
