"""How a projection's weight is stored and multiplied: the one seam where a weight format plugs
into the load.

Every checkpoint tensor that becomes a projection's weight (or its piece of a fused one: q, k or
v of the fused q/k/v, gate or up of gate/up) passes through a single call,
:meth:`WeightFormat.store`, made by :func:`weights.load_into` with the projection and the rows
the tensor fills (:class:`ProjectionRows`); every other tensor (embeddings, norms, biases, a
convolution) is copied as it stands. Once every weight is in, :meth:`WeightFormat.prepare`
makes each projection ready to multiply on the compute path the load plan chose
(``shard/model_shard.py``: the CPU kernels, or not; ``--batch-invariant``).

Today's one format is :class:`DenseWeights`: a dense matrix in the model's dtype (a GGUF file's
quantised blocks are dequantised to float by its reader, ``gguf_file.gguf_tensors``),
multiplied by the CPU kernels' GEMM (packed once), oneDNN (split and prepacked), the
invariant Triton matmul or torch.

A quantised format (GGUF's Q4_K, Q8_0, ... kept as raw blocks and packed for our own C++
kernels) is another implementation of :class:`WeightFormat`, chosen in
:func:`weight_format`: the GGUF reader then hands a projection's tensor over undequantised
(its blocks, with their type and the logical shape), ``store`` keeps the blocks of each piece,
``prepare`` packs them for the kernels, and the projection multiplies through them. Nothing
else in the load changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from slotserve.runners.pytorch.model.decoder import Decoder
from slotserve.runners.pytorch.model.layers import Projection


@dataclass(frozen=True)
class ProjectionRows:
    """Where a checkpoint tensor goes: ``rows`` of ``projection``'s weight (every row of an
    unfused projection)."""

    projection: Projection
    rows: slice

    @property
    def shape(self) -> torch.Size:
        """The tensor's logical shape, [rows, inputs]."""
        return self.projection.weight[self.rows].shape


class WeightFormat(Protocol):
    name: str

    def store(self, place: ProjectionRows, tensor: torch.Tensor) -> None:
        """Puts a checkpoint tensor, as its reader gives it and of ``place``'s shape, into
        ``place``."""
        ...

    def prepare(self, model: Decoder, invariant_matmul: bool) -> None:
        """After every weight is stored: each projection made ready for the compute path
        (``model.kernels``: the CPU kernels where they serve; ``invariant_matmul``: the
        Triton matmul of ``--batch-invariant``)."""
        ...


class DenseWeights:
    name = "dense"

    def store(self, place: ProjectionRows, tensor: torch.Tensor) -> None:
        place.projection.weight[place.rows].copy_(tensor)

    def prepare(self, model: Decoder, invariant_matmul: bool) -> None:
        """The invariant matmul; on CPU in bfloat16 the kernels' GEMM, whose weights are packed
        once, else oneDNN's projections split where their input is long and prepacked (batch
        invariance holds in bfloat16 on CPU only: ``model/attention.py``)."""
        if invariant_matmul:
            model.use_invariant_matmul()
            return
        if model.embed.weight.device.type != "cpu" or model.dtype != torch.bfloat16:
            return
        kernels = model.kernels
        if kernels is not None and kernels.has_gemm:
            model.prepack(kernels)
            return
        model.make_batch_invariant()
        if torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
            model.prepack()


def weight_format() -> WeightFormat:
    """The format projections are stored in: dense, the one there is. Where a quantised format
    is chosen (by a flag, and the checkpoint's tensor types)."""
    return DenseWeights()
