"""Which weight format a load stores its projections in (``weight_format.py``): dense, or kept
quantized (``quant_weights.py``), by ``--quantization``, the checkpoint and what serves the
load."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from slotserve.runners.options import KERNEL_SPELLINGS
from slotserve.runners.pytorch.cpu_kernels import CpuKernels, load_cpu_kernels
from slotserve.runners.pytorch.load.gguf_file import GgufFile
from slotserve.runners.pytorch.load.int4_checkpoint import METHODS
from slotserve.runners.pytorch.load.quant_weights import QuantWeights
from slotserve.runners.pytorch.load.weight_format import DenseWeights, WeightFormat
from slotserve.runners.pytorch.model.config import UnsupportedModelError
from slotserve.runners.pytorch.model.decoder import Decoder
from slotserve.runners.pytorch.model.layers import Projection
from slotserve.runners.pytorch.quant.formats import FORMATS
from slotserve.runners.pytorch.quant.tensor import QUANTIZE_TO

logger = logging.getLogger(__name__)
# The GGUF types the quantized kernels multiply.
QUANTIZED_TYPES = {kind.name for kind in FORMATS}
# The GGUF types a load stores as they are read, in the model's dtype (bfloat16).
DENSE_TYPES = {"F32", "F16", "BF16"}


def weight_format(
    quantization: str,
    checkpoint: Any,
    model: Decoder,
    kernels: CpuKernels | None,
    refusal: str | None,
) -> WeightFormat:
    """The format projections are stored in, for ``--quantization`` (``auto``: a GGUF file's
    quantized types, or a 4-bit AWQ, GPTQ or compressed-tensors folder's, kept as stored,
    everything else dense; ``awq``, ``gptq``, ``compressed-tensors``: auto, for a folder of that
    method; ``none``: dense; a type: every matrix rounded to it at load). ``checkpoint``: the
    GGUF file or HF folder (None: random weights); ``refusal``: why the quantized kernels cannot
    serve this load, if they cannot."""
    if quantization == "none":
        return DenseWeights()
    method = KERNEL_SPELLINGS.get(quantization, quantization)
    if method in METHODS:  # an HF folder's own (``int4_checkpoint.py``)
        q = checkpoint.raw_config.get("quantization_config") if checkpoint is not None else None
        named = str((q or {}).get("quant_method", "no")).lower()
        if named != method:
            raise ValueError(
                f"--quantization {quantization}: the checkpoint's config.json names {named} "
                "quantization"
            )
        quantization = "auto"
    own_types = checkpoint.quantized_types() & QUANTIZED_TYPES if checkpoint is not None else set()
    if quantization != "auto" and own_types:
        kind = "GGUF file" if isinstance(checkpoint, GgufFile) else "quantized checkpoint"
        raise ValueError(
            f"--quantization {quantization}: a {kind} keeps its own types (auto serves them "
            "quantized; none dequantizes them)"
        )
    why_not = refusal or _uneven_inputs(model)
    if quantization == "auto":
        if not own_types:
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


def gguf_refusal(path: Path, device: str) -> str | None:
    """Why this runner would not serve the GGUF file at ``path`` on ``device`` (a ``--device``
    value) from its weights as stored, or None: ``--runner auto``'s question of a .gguf file.
    On a GPU its matrices are dequantized, and it serves any file whose architecture it has."""
    checkpoint = GgufFile(path)
    try:
        config = checkpoint.config
    except UnsupportedModelError:
        architecture = checkpoint.header.fields.get("general.architecture")
        return f"no family for its architecture {architecture!r}"
    except Exception as exc:  # not a GGUF file it can read: llama.cpp's load will say more
        return f"the file could not be read ({type(exc).__name__})"
    if device != "cpu" and (device != "auto" or torch.cuda.is_available()):
        return None
    if config.head_dim % 16:
        return f"its head size {config.head_dim} is not a multiple of 16, as the CPU kernels need"
    if load_cpu_kernels() is None:
        return "the CPU kernels cannot run here (the warning above says why)"
    dequantized = checkpoint.quantized_types() - QUANTIZED_TYPES - DENSE_TYPES
    if dequantized:
        return f"its {', '.join(sorted(dequantized))} matrices would be dequantized"
    return None
