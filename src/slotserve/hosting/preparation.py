"""Where a request's preparation runs: tokenizing, rendering templates and compiling grammars
for a large request take long enough to stall every other request if done on the event loop.
A few threads bound how many such jobs run at once (the tokenizers release the GIL while they
work); large requests have threads of their own, so a small one never queues behind a few
prompts of megabytes. ``ModelHost.off_loop`` leases its model around a job."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

_P = ParamSpec("_P")
_T = TypeVar("_T")

_POOLS = {
    large: ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"slotserve-prepare-{name}")
    for large, name in ((False, "small"), (True, "large"))
}


async def prepared(large: bool, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """``fn(*args, **kwargs)`` on the preparation threads, those of large requests where
    ``large``."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_POOLS[large], functools.partial(fn, *args, **kwargs))
