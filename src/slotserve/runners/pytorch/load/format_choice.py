"""Which weight format a load stores its projections in (``weight_format.py``): dense, or kept
quantized (``quant_weights.py``), by ``--quantization``, the checkpoint and what serves the
load."""

from __future__ import annotations

import logging
from typing import Any

from slotserve.runners.pytorch.cpu_kernels import CpuKernels
from slotserve.runners.pytorch.load.gguf_file import GgufFile
from slotserve.runners.pytorch.load.quant_weights import QuantWeights
from slotserve.runners.pytorch.load.weight_format import DenseWeights, WeightFormat
from slotserve.runners.pytorch.model.decoder import Decoder
from slotserve.runners.pytorch.model.layers import Projection
from slotserve.runners.pytorch.quant.formats import FORMATS
from slotserve.runners.pytorch.quant.tensor import QUANTIZE_TO

logger = logging.getLogger(__name__)
# The GGUF types the quantized kernels multiply.
QUANTIZED_TYPES = {kind.name for kind in FORMATS}


def weight_format(
    quantization: str,
    checkpoint: Any,
    model: Decoder,
    kernels: CpuKernels | None,
    refusal: str | None,
) -> WeightFormat:
    """The format projections are stored in, for ``--quantization`` (``auto``: a GGUF file's
    quantized types kept as stored, everything else dense; ``none``: dense; a type: every
    matrix rounded to it at load). ``checkpoint``: the GGUF file or HF folder (None: random
    weights); ``refusal``: why the quantized kernels cannot serve this load, if they cannot."""
    is_gguf = isinstance(checkpoint, GgufFile)
    if quantization == "none":
        return DenseWeights()
    if quantization != "auto" and is_gguf:
        raise ValueError(
            f"--quantization {quantization}: a GGUF file keeps its own types (auto serves them "
            "quantized; none dequantizes them)"
        )
    why_not = refusal or _uneven_inputs(model)
    if quantization == "auto":
        if not is_gguf or not checkpoint.quantized_types() & QUANTIZED_TYPES:
            return DenseWeights()
        if why_not is not None:
            logger.info("weights: dequantized to %s (%s)", model.dtype, why_not)
            return DenseWeights()
        assert kernels is not None
        return QuantWeights(kernels, model.lm_head, checkpoint)
    if why_not is not None:
        raise ValueError(f"--quantization {quantization}: {why_not}")
    assert kernels is not None
    return QuantWeights(kernels, model.lm_head, None, QUANTIZE_TO[quantization])


def _uneven_inputs(model: Decoder) -> str | None:
    for module in model.modules():
        if isinstance(module, Projection) and module.in_features % 32:
            return f"a projection's {module.in_features} inputs are not whole blocks of 32"
    return None
