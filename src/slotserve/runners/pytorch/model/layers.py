"""The building blocks every layer kind shares: batch-invariant projections, RMSNorm, the MLP
activations."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from slotserve.runners.pytorch.cpu_kernels import CpuKernels
from slotserve.runners.pytorch.gpu_matmul import invariant_linear

if TYPE_CHECKING:
    from slotserve.runners.pytorch.quant.formats import QuantFormat

# oneDNN's bfloat16 matmuls give every row the same bits whatever the batch while the reduced
# dimension is at most this long (measured up to 600 rows); beyond it some row counts switch to
# a split-K schedule that sums in another order.
INVARIANT_MAX_K = 1024

# The rows of prompt tokens in the step a decoder is running (``Decoder.forward``), which its
# layers' quantized projections multiply in the dequantized arithmetic (``quant_linear``).
_PROMPT_ROWS: ContextVar[torch.Tensor | None] = ContextVar("prompt_rows", default=None)


@contextmanager
def prompt_rows(rows: torch.Tensor | None) -> Iterator[None]:
    """``rows`` (bool, one per row of the step) are a prompt's tokens inside the block."""
    token = _PROMPT_ROWS.set(rows)
    try:
        yield
    finally:
        _PROMPT_ROWS.reset(token)


def onednn_bf16() -> bool:
    """Whether oneDNN has bfloat16 matmuls for this CPU (its prepacked layout needs them)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _packed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    # contiguous(): a no-op for every input the decoder passes, kept for safety's sake.
    out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return out  # type: ignore[no-any-return]


@dataclass(frozen=True)
class QuantPart:
    """Consecutive output rows of a projection whose weight stays quantized: ``packed`` by
    ``quant_pack`` in ``format`` for the CPU kernels' ``quant_linear``."""

    packed: torch.Tensor
    format: QuantFormat
    rows: int
    bias: torch.Tensor | None


class Projection(nn.Linear):
    """A linear layer that is batch-invariant on CPU in one of two ways. :meth:`pack` hands it
    to the CPU kernels' GEMM, whose every output sums its inputs in order whatever the rows.
    Without it, oneDNN serves: :meth:`split_k` cuts a long input dimension into equal chunks of
    at most ``INVARIANT_MAX_K``, whose bfloat16 products are summed in float32 in a fixed
    order, and :meth:`prepack` stores the weights in oneDNN's blocked layout once, instead of
    oneDNN reordering them on every call."""

    chunks: list[torch.Tensor] | None = None
    chunks_packed = False
    packed: torch.Tensor | None = None  # the whole weight, prepacked for oneDNN
    kernels: CpuKernels | None = None
    kernel_weight: torch.Tensor | None = None  # the whole weight, packed for the kernels
    kernel_bias: torch.Tensor | None = None  # the bias in float32, as the GEMM adds it
    invariant = False  # through ``gpu_matmul.invariant_linear`` (--batch-invariant on GPUs)
    quant_parts: list[QuantPart] | None = None  # the weight kept quantized, rows in order
    # A layer's own projection, whose rows are the step's tokens: kept quantized, it
    # multiplies a prompt's rows in the dequantized arithmetic and generated ones in the
    # integer one (a row's kind, never its batch, chooses; ``csrc/quant_linear.cpp``).
    by_role = False

    def reset_parameters(self) -> None:
        """Nothing: every weight is loaded (``load/weights.py`` refuses a checkpoint that
        lacks one), and a weight that stays quantized is never written, so never resident."""

    def quantize(self, kernels: CpuKernels, parts: list[QuantPart]) -> None:
        """The kernels' quantized GEMM from now on, over ``parts``' rows in order."""
        self.quant_parts, self.kernels = parts, kernels
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def pack(self, kernels: CpuKernels, keep_weight: bool = False) -> None:
        """The kernels' GEMM from now on (CPU, bfloat16). ``keep_weight``: as :meth:`prepack`."""
        self.kernel_weight = kernels.pack_weight(self.weight.detach())
        if self.bias is not None:
            self.kernel_bias = self.bias.detach().float()
        self.kernels = kernels
        if not keep_weight:
            self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def split_k(self) -> None:
        k = self.in_features
        parts = -(-k // INVARIANT_MAX_K)
        if parts == 1 or k % parts:
            return
        step = k // parts
        self.chunks = [self.weight[:, i * step : (i + 1) * step].contiguous() for i in range(parts)]
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def prepack(self, keep_weight: bool = False) -> None:
        """oneDNN's prepacked bfloat16 matmul: measured bit-identical to ``F.linear`` for every
        row count from 1 to 600 (so batch invariance is unchanged) and faster, most at one row
        (a decode step of one sequence). ``keep_weight``: the weight is shared
        (a tied embedding)."""
        reorder = torch.ops.mkldnn._reorder_linear_weight
        if self.chunks is not None:
            self.chunks = [reorder(chunk, 1) for chunk in self.chunks]
            self.chunks_packed = True
            return
        self.packed = reorder(self.weight.detach(), 1)
        if not keep_weight:
            self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def _chunk(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.chunks_packed:
            return _packed_linear(x, weight, None)
        return F.linear(x, weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.invariant:
            return invariant_linear(x, self.weight, self.bias)
        if self.kernels is not None:
            # The decoder's rows come flat: each of a step's hundred-odd calls then skips a
            # reshape and a view back, a fair share of a small projection's time.
            rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
            if rows.stride(-1) != 1:
                rows = rows.contiguous()
            if self.quant_parts is not None:
                prompts = _PROMPT_ROWS.get() if self.by_role else None
                out = self._quant_linear(rows, self.kernels, self.quant_parts, prompts)
            else:
                assert self.kernel_weight is not None
                out = self.kernels.linear(
                    rows, self.kernel_weight, self.kernel_bias, self.out_features
                )
            return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)
        if self.packed is not None:
            return _packed_linear(x, self.packed, self.bias)
        if self.chunks is None:
            return F.linear(x, self.weight, self.bias)
        step = self.in_features // len(self.chunks)
        total = self._chunk(x[:, :step], self.chunks[0]).float()
        for i, chunk in enumerate(self.chunks[1:], start=1):
            total += self._chunk(x[:, i * step : (i + 1) * step], chunk).float()
        if self.bias is not None:
            total += self.bias.float()
        return total.to(x.dtype)

    @staticmethod
    def _quant_linear(
        x: torch.Tensor, kernels: CpuKernels, parts: list[QuantPart], prompts: torch.Tensor | None
    ) -> torch.Tensor:
        outs = [
            kernels.quant_linear(x, p.packed, p.format, p.rows, p.bias, prompt_rows=prompts)
            for p in parts
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


class Embedding(nn.Embedding):
    """The token embedding, its table written by the load (or replaced by a quantized one)."""

    def reset_parameters(self) -> None:
        """Nothing, as :meth:`Projection.reset_parameters`: a random table would be written
        (and made resident) only to be overwritten."""


class RmsNorm(nn.Module):
    """RMSNorm as HF computes it: normalised in float32; Llama-style weights multiply in the
    model dtype, Gemma- and Qwen3.5-style ones are stored as (w - 1) and multiply ``1 + w`` in
    float32 (``plus_one``)."""

    def __init__(self, size: int, eps: float, plus_one: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.plus_one = plus_one
        self.weight = nn.Parameter(torch.zeros(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.plus_one:
            return (hidden * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * hidden.to(x.dtype)


def activation(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "silu":
        return F.silu(x)
    if kind == "gelu_pytorch_tanh":
        return F.gelu(x, approximate="tanh")
    return F.gelu(x)
