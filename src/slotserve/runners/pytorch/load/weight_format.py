"""How a projection's weight is stored and multiplied: the one seam where a weight format plugs
into the load.

Every checkpoint tensor that becomes a projection's weight (or its piece of a fused one: q, k or
v of the fused q/k/v, gate or up of gate/up) passes through a single call,
:meth:`WeightFormat.store`, made by :func:`weights.load_into` with the projection and the rows
the tensor fills (:class:`ProjectionRows`), and so does the embedding's table; every other
tensor (norms, biases, a convolution) is copied as it stands. Once every weight is in,
:meth:`WeightFormat.prepare` makes each projection ready to multiply on the compute path the
load plan chose
(``shard/model_shard.py``: the CPU kernels, or not; ``--batch-invariant``).

Two formats: :class:`DenseWeights`, a dense matrix in the model's dtype (a GGUF file's
quantised blocks dequantised to float by its reader, ``gguf_file.gguf_tensors``), multiplied by
the CPU kernels' GEMM (packed once), oneDNN (split and prepacked), the invariant Triton matmul
or torch; and ``quant_weights.QuantWeights``, the weights kept quantized (a GGUF file's blocks
as stored, or rounded at load by ``--quantization``) for the CPU kernels' quantized GEMM,
chosen by ``format_choice.weight_format``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from slotserve.runners.pytorch.cpu_kernels import CpuKernels
from slotserve.runners.pytorch.model.decoder import Decoder
from slotserve.runners.pytorch.model.layers import INVARIANT_MAX_K, Projection, onednn_bf16


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

    def tensors(self, source: Any) -> Iterator[tuple[str, Any]]:
        """``source``'s tensors as this format reads them (a ``weights.WeightSource``)."""
        ...

    def store(self, place: ProjectionRows | torch.Tensor, tensor: Any) -> None:
        """Puts a checkpoint tensor, as its reader gives it and of ``place``'s shape, into
        ``place``: a projection's rows, or (a quantized table) the embedding's."""
        ...

    def head_rows(self, model: Decoder, rows: list[int]) -> torch.Tensor:
        """Rows of the LM head in float32, read before :meth:`prepare`."""
        ...

    def prepare(self, model: Decoder, invariant_matmul: bool) -> None:
        """After every weight is stored: each projection made ready for the compute path
        (``model.kernels``: the CPU kernels where they serve; ``invariant_matmul``: the
        Triton matmul of ``--batch-invariant``)."""
        ...


class DenseWeights:
    name = "dense"

    def tensors(self, source: Any) -> Iterator[tuple[str, Any]]:
        return source.tensors()  # type: ignore[no-any-return]

    def store(self, place: ProjectionRows | torch.Tensor, tensor: Any) -> None:
        target = place.projection.weight[place.rows] if isinstance(place, ProjectionRows) else place
        target.copy_(tensor)

    def head_rows(self, model: Decoder, rows: list[int]) -> torch.Tensor:
        return model.lm_head.weight[rows].float().clone()

    def prepare(self, model: Decoder, invariant_matmul: bool) -> None:
        """The invariant matmul; on CPU in bfloat16 the kernels' GEMM, whose weights are packed
        once, else oneDNN's projections split where their input is long and prepacked (batch
        invariance holds in bfloat16 on CPU only: ``model/attention.py``)."""
        projections = [m for m in model.modules() if isinstance(m, Projection)]
        if invariant_matmul:  # gpu_matmul.invariant_linear: GPUs, and Triton's interpreter
            for projection in projections:
                projection.invariant = True
            return
        if model.embed.weight.device.type != "cpu" or model.dtype != torch.bfloat16:
            return
        kernels = model.kernels
        if kernels is not None and kernels.has_gemm:
            _pack(model, projections, kernels)
            return
        # oneDNN: long-input projections split their reduction (see ``Projection``); a tied
        # head keeps sharing the embedding, but for hidden sizes above the limit: a copy.
        for projection in projections:
            if projection is not model.lm_head:
                projection.split_k()
        if model.config.hidden_size > INVARIANT_MAX_K:
            if model.config.tie_word_embeddings:
                model.lm_head.weight = nn.Parameter(model.embed.weight.clone(), requires_grad=False)
            model.lm_head.split_k()
        if torch.backends.mkldnn.is_available() and onednn_bf16():  # type: ignore[no-untyped-call]
            _pack(model, projections, None)


def _pack(model: Decoder, projections: list[Projection], kernels: CpuKernels | None) -> None:
    """Every projection's weights packed once: for the CPU kernels' GEMM, which is invariant
    for any input size, or without ``kernels`` in oneDNN's blocked layout, where oneDNN has
    bfloat16 kernels for this CPU (AVX-512 or AVX-NE-CONVERT; elsewhere torch's own matmul
    serves, unpacked). A tied head keeps the embedding's weight."""
    for projection in projections:
        tied = projection is model.lm_head and model.lm_head.weight is model.embed.weight
        if kernels is not None:
            projection.pack(kernels, keep_weight=tied)
        else:
            projection.prepack(keep_weight=tied)
