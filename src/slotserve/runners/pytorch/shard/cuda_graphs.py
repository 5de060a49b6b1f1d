"""Decode steps replayed from CUDA graphs, captured at load for batch-size buckets (1, 2, 4, 8,
then every 16 up to the slot count), as vLLM and nano-vllm do: a step of one-token chunks
launches one graph instead of a kernel per operator, which on a GPU is most of a small
model's decode step.

Each bucket owns its inputs, one int64 tensor on the device laid out as [token ids | positions
| cache rows | block tables (bucket × width)], filled in pinned host memory and copied once per
step. A step of ``n`` sequences runs the smallest bucket of at least ``n``; the rows past
``n`` are ballast: token 0 at position 0, attending over nothing but position 0 of block 0 and
writing its K/V to a block that no sequence owns (``KvPool.ballast_row``). Only the Triton
attention is captured: it reads the block tables in place and its launch shape depends on the
bucket alone, where the gathered path's shapes follow the longest sequence.

What capturing means is passed in (:data:`Capture`), so the bookkeeping runs and is tested
without a GPU, replaying by running the same code over the same buffers again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from slotserve.runners.pytorch import gpu_kernels
from slotserve.runners.pytorch.model.attention import PagedStep, StepAttention
from slotserve.runners.pytorch.model.decoder import Decoder
from slotserve.runners.pytorch.shard.pools import KvPool

SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 16


class Graph(Protocol):
    def replay(self) -> None: ...


# Runs a step once over its static inputs and returns what replays it, with the tensor each
# replay writes the logits into.
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Graph, torch.Tensor]]
# (token ids, positions, cache rows, block tables) → float32 logits, one row per token.
DecodeForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16, up to and including ``max_batch``."""
    sizes = {size for size in SMALL_BUCKETS if size < max_batch}
    sizes.update(range(BUCKET_STEP, max_batch, BUCKET_STEP))
    sizes.add(max_batch)
    return sorted(sizes)


def cuda_capture(device: torch.device) -> Capture:
    """Capture with ``torch.cuda.CUDAGraph``, every bucket in one memory pool (captured
    largest first, the smaller ones reuse its blocks). Each step runs once on a side stream
    first: Triton compiles its kernels and cuBLAS picks its own outside the capture."""
    pool = torch.cuda.graph_pool_handle()

    def capture(run: Callable[[], torch.Tensor]) -> tuple[Graph, torch.Tensor]:
        side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = run()
        return graph, logits

    return capture


@dataclass
class _Bucket:
    size: int
    inputs: torch.Tensor  # on the device: what the graph reads
    staged: torch.Tensor  # pinned host memory: the next step's inputs
    graph: Graph
    logits: torch.Tensor  # [size, vocab]: what each replay writes


class DecodeGraphs:
    def __init__(
        self,
        forward: DecodeForward,
        max_batch: int,
        width: int,
        ballast_row: int,
        device: torch.device,
        capture: Capture,
    ) -> None:
        """``width``: the most blocks a sequence's table holds; ``ballast_row``: the cache
        row that ballast tokens write."""
        self.width = width
        self.ballast_row = ballast_row
        # Held for as long as the graphs: the tensors ``forward`` closes over are ones they
        # read (freed, their memory would go to other tensors under the graphs' feet).
        self._forward = forward
        self._buckets: dict[int, _Bucket] = {}
        pinned = device.type == "cuda"
        for size in reversed(batch_buckets(max_batch)):
            staged = torch.empty(size * (3 + width), dtype=torch.int64, pin_memory=pinned)
            self._stage(staged.numpy(), size, [], [], [], [])
            inputs = staged.to(device)
            views = _views(inputs, size, width)
            graph, logits = capture(lambda views=views: forward(*views))  # type: ignore[misc]
            self._buckets[size] = _Bucket(size, inputs, staged, graph, logits)
        self.sizes = sorted(self._buckets)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def takes(self, tokens: int, tables: Sequence[Sequence[int]]) -> bool:
        return tokens <= self.max_batch and all(len(table) <= self.width for table in tables)

    def replay(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        rows: Sequence[int],
        tables: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """The logits of one token per sequence (``takes`` said yes), a view valid until the
        next replay."""
        n = len(tokens)
        bucket = self._buckets[next(size for size in self.sizes if size >= n)]
        self._stage(bucket.staged.numpy(), bucket.size, tokens, positions, rows, tables)
        # The host buffer is written again only after the step's results were read, which
        # waits for this copy.
        bucket.inputs.copy_(bucket.staged, non_blocking=True)
        bucket.graph.replay()
        return bucket.logits[:n]

    def _stage(
        self,
        staged: np.ndarray,
        size: int,
        tokens: Sequence[int],
        positions: Sequence[int],
        rows: Sequence[int],
        tables: Sequence[Sequence[int]],
    ) -> None:
        n = len(tokens)
        staged[:] = 0
        staged[:n] = tokens
        staged[size : size + n] = positions
        staged[2 * size : 2 * size + n] = rows
        staged[2 * size + n : 3 * size] = self.ballast_row
        blocks = staged[3 * size :].reshape(size, self.width)
        for i, table in enumerate(tables):
            blocks[i, : len(table)] = table


def _views(
    inputs: torch.Tensor, size: int, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        inputs[:size],
        inputs[size : 2 * size],
        inputs[2 * size : 3 * size],
        inputs[3 * size :].view(size, width),
    )


@torch.inference_mode()
def capture_decode(
    model: Decoder, pool: KvPool, max_batch: int, max_seq_len: int, capture: Capture
) -> DecodeGraphs:
    """Decode steps of up to ``max_batch`` sequences of ``model`` over ``pool``, as graphs."""
    device = model.embed.weight.device
    # The attention kernel takes int32 numbers, as the eager steps give it (one compiled
    # kernel for both).
    order = torch.arange(max_batch, dtype=torch.int32, device=device)
    ones = torch.ones(max_batch, dtype=torch.int32, device=device)
    block_size = pool.block_size

    def logits(
        tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, tables: torch.Tensor
    ) -> torch.Tensor:
        size = tokens.shape[0]
        paged = PagedStep(tables.int(), order[:size], positions.int(), rows, block_size)
        tiles = gpu_kernels.RowTiles(order[:size], order[:size], ones[:size])
        step = StepAttention(rows, [], paged, tiles)
        hidden = model(tokens, positions, step, pool.layers)
        return model.logits(hidden)

    width = -(-max_seq_len // block_size)
    return DecodeGraphs(logits, max_batch, width, pool.ballast_row, device, capture)
