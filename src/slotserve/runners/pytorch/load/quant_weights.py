"""Projections whose weights stay quantized (the weight format of ``weight_format.py``): a GGUF
file's blocks as stored (an AWQ or GPTQ folder's weights as the blocks they equal:
``int4_checkpoint.py``), or an HF checkpoint's weights rounded at load (``--quantization``),
multiplied by the CPU kernels' ``quant_linear`` (``csrc/quant_gemm.h``) and looked up by
``quant_rows`` for the embedding.

The pieces of a fused projection (q, k, v; gate, up) may come in different types, as in a
Q4_K_M file: each run of rows of one type is one packed part, multiplied on its own and the
outputs concatenated (a row's sums never cross parts). A matrix that reaches the format dense
(a type the kernels do not multiply, a converter change that is more than a row order, an
expert cut from a stacked tensor) is rounded to Q8_0. The embedding stays quantized too; a
tied LM head multiplies the same packed blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from gguf import GGMLQuantizationType
from torch import nn

from slotserve.runners.pytorch.cpu_kernels import CpuKernels
from slotserve.runners.pytorch.load.weight_format import ProjectionRows
from slotserve.runners.pytorch.model.decoder import Decoder
from slotserve.runners.pytorch.model.layers import Projection, QuantPart
from slotserve.runners.pytorch.quant.formats import FORMATS, GROUP
from slotserve.runners.pytorch.quant.tensor import QuantTensor, quantized

# What a matrix given dense is rounded to where the format names none (--quantization auto).
DENSE_AS = GGMLQuantizationType.Q8_0


class QuantEmbedding(nn.Module):
    """An embedding whose table stays quantized: each token's row dequantized on lookup, the
    values the dequantized path would hold."""

    def __init__(self, kernels: CpuKernels, part: QuantPart, k: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.kernels, self.part, self.k = kernels, part, k
        self.weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        p = self.part
        rows = self.kernels.quant_rows(p.packed, token_ids.reshape(-1), p.format, p.rows, self.k)
        return rows.view(*token_ids.shape, self.k)


@dataclass(frozen=True)
class _Piece:
    """A checkpoint tensor's rows of a projection, as its blocks until the projection is packed
    (a file's blocks are then read once, from its mapping)."""

    start: int
    blocks: QuantTensor

    @property
    def rows(self) -> int:
        return self.blocks.shape[0]


class QuantWeights:
    """``stored``: the checkpoint whose blocks are read as stored, a GGUF file or an AWQ or GPTQ
    folder (else every tensor comes dense); ``dense_as``: the type a dense matrix is rounded to,
    but for the LM head ``head`` and the embedding, kept in Q8_0 as llama.cpp's quantizer keeps
    them in more bits."""

    name = "quantized"

    def __init__(
        self,
        kernels: CpuKernels,
        head: Projection,
        stored: Any = None,
        dense_as: Any = DENSE_AS,
    ) -> None:
        self.kernels, self.head, self.stored, self.dense_as = kernels, head, stored, dense_as
        self.pieces: dict[Projection, list[_Piece]] = {}
        self.embedding: _Piece | None = None

    def tensors(self, source: Any) -> Iterator[tuple[str, Any]]:
        if self.stored is not None and source is self.stored:
            return self.stored.quantized_tensors()  # type: ignore[no-any-return]
        return source.tensors()  # type: ignore[no-any-return]

    def store(self, place: ProjectionRows | torch.Tensor, tensor: Any) -> None:
        if isinstance(place, ProjectionRows):
            kind = DENSE_AS if place.projection is self.head else self.dense_as
            blocks = tensor if isinstance(tensor, QuantTensor) else quantized(tensor, kind)
            piece = _Piece(place.rows.start or 0, blocks)
            self.pieces.setdefault(place.projection, []).append(piece)
            return
        # The one other matrix the load hands over: the embedding's table.
        blocks = tensor if isinstance(tensor, QuantTensor) else quantized(tensor, DENSE_AS)
        self.embedding = _Piece(0, blocks)

    def head_rows(self, model: Decoder, rows: list[int]) -> torch.Tensor:
        """The LM head's vocabulary ``rows`` in float32, the dequantized path's values: only
        those rows packed (the whole head is packed once, by :meth:`prepare`)."""
        head = model.lm_head
        pieces = [self.embedding] if model.config.tie_word_embeddings else self.pieces[head]
        ids, out = torch.tensor(rows), torch.empty(len(rows), head.in_features)
        for piece in [p for p in pieces if p is not None]:
            mine = (ids >= piece.start) & (ids < piece.start + piece.rows)
            if not mine.any():
                continue
            blocks = piece.blocks.take_rows((ids[mine] - piece.start).numpy())
            packed = self.kernels.quant_pack(blocks.kind, blocks.raw, blocks.k, order=blocks.order)
            count = blocks.shape[0]
            values = self.kernels.quant_rows(
                packed, torch.arange(count), FORMATS[blocks.kind], count, head.in_features
            )
            out[mine] = values.float()
        return out

    def prepare(self, model: Decoder, invariant_matmul: bool) -> None:
        assert not invariant_matmul, "the quantized kernels are the CPU's"
        if self.embedding is None:
            raise ValueError("the checkpoint's embedding never reached the quantized format")
        runs = {p: _runs(p, pieces) for p, pieces in self.pieces.items()}
        table_runs = _runs(model.lm_head, [self.embedding])
        self.pieces, self.embedding = {}, None
        # One buffer for every part: small matrices then sit on huge pages too
        # (CpuKernels.huge_page_buffer), and a step streams the weights in the order packed.
        sizes = [_packed_bytes(run) for some in [*runs.values(), table_runs] for run in some]
        memory = _Memory(self.kernels.huge_page_buffer(sum(_aligned(n) for n in sizes)))
        for projection in list(runs):  # each projection's blocks dropped once packed
            projection.quantize(self.kernels, self._pack(projection, runs.pop(projection), memory))
        part = self._pack(model.lm_head, table_runs, memory, bias=False)[0]
        # The decoder calls its embedding as a module; this one keeps its table quantized.
        k = table_runs[0][0].blocks.k
        model.embed = QuantEmbedding(self.kernels, part, k, model.dtype)  # type: ignore[assignment]
        if model.config.tie_word_embeddings:
            model.lm_head.quantize(self.kernels, [part])

    def _pack(
        self, projection: Projection, runs: list[list[_Piece]], memory: _Memory, bias: bool = True
    ) -> list[QuantPart]:
        """Each run of pieces (``_runs``) packed into its own stretch of ``memory``, one part."""
        parts = []
        for run in runs:
            kind, k = run[0].blocks.kind, run[0].blocks.k
            f, start, rows = FORMATS[kind], run[0].start, sum(p.rows for p in run)
            packed = memory.take(_packed_bytes(run))
            at = 0
            for piece in run:  # every piece but the last of whole groups: its records' slice
                size = f.packed_bytes(piece.rows, k)
                blocks, place = piece.blocks, packed[at : at + size]
                self.kernels.quant_pack(kind, blocks.raw, k, out=place, order=blocks.order)
                at += size
            b = projection.bias if bias else None
            part_bias = None if b is None else b.detach()[start : start + rows].float().clone()
            parts.append(QuantPart(packed, f, rows, part_bias))
        return parts

    def kinds(self) -> list[str]:
        """The types of the matrices stored so far (for the log)."""
        kinds = {piece.blocks.kind.name for pieces in self.pieces.values() for piece in pieces}
        if self.embedding is not None:
            kinds.add(self.embedding.blocks.kind.name)
        return sorted(kinds)


def _runs(projection: Projection, pieces: list[_Piece]) -> list[list[_Piece]]:
    """Runs of pieces of one type (joined where whole groups of 16 rows: packed records of
    whole groups concatenate), each to be packed into one part."""
    runs: list[list[_Piece]] = []
    covered = 0
    for piece in sorted(pieces, key=lambda p: p.start):
        if piece.start != covered:
            raise ValueError(f"rows {covered}..{piece.start} of a projection never loaded")
        last = runs[-1] if runs else []
        whole = sum(p.rows for p in last) % GROUP == 0
        if last and last[0].blocks.kind == piece.blocks.kind and whole:
            last.append(piece)
        else:
            runs.append([piece])
        covered += piece.rows
    if covered != projection.out_features:
        raise ValueError(f"{covered} of a projection's {projection.out_features} rows loaded")
    return runs


def _packed_bytes(run: list[_Piece]) -> int:
    blocks = run[0].blocks
    return FORMATS[blocks.kind].packed_bytes(sum(p.rows for p in run), blocks.k)


def _aligned(size: int) -> int:
    """Each part from a cache line's start, as a buffer of its own would be."""
    return -(-size // 64) * 64


class _Memory:
    """Consecutive stretches of one buffer, handed out in order."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer, self.used = buffer, 0

    def take(self, size: int) -> torch.Tensor:
        stretch = self.buffer[self.used : self.used + size]
        self.used += _aligned(size)
        return stretch
