"""Gated DeltaNet linear attention (Qwen3.5's ``linear_attention`` layers) and the per-slot
state it keeps instead of KV.

Per token ``t`` of a sequence and per value head (key head ``j // (n_v / n_k)``):
``x_t`` → ``q, k, v`` through a causal depthwise convolution over the last ``kernel`` inputs
(SiLU), ``q`` and ``k`` L2-normalised (``q`` also × 1/√d_k), and the recurrence over a
``[d_k, d_v]`` float32 matrix ``S``::

    S' = exp(g_t) S            g_t = -exp(A_log) softplus(a_t + dt_bias)   (decay)
    u  = β_t (v_t - S'ᵀ k_t)   β_t = sigmoid(b_t)                          (delta rule)
    S  = S' + k_t uᵀ,  o_t = Sᵀ q_t

then ``o`` is RMS-normalised per head (plain ``w``), gated by ``silu(z_t)`` and projected
out. A sequence's state is the convolution's last ``kernel - 1`` inputs and ``S`` per layer
(``shard/pools.py``: ``LinearStatePool``, one row per slot, zeroed when a sequence starts at
position 0).

Two forms of the same recurrence. A decoded token takes the step above, batched over the
step's decoding sequences. Prompt chunks take the chunked form: blocks of ``BLOCK`` tokens,
each solved at once (a unit lower-triangular system gives the block's ``u``; then matmuls
give its outputs and the state after it), the state carried from block to block. Blocks sit
on a grid anchored at position 0, the prompt's last block taking the odd part; the runner's
chunk policy cuts prompts on the same grid, so a prompt's blocks, and their bits, are the
same however the scheduler cut it and whatever ran beside it (batch invariance), and the
state at a multiple of ``BLOCK`` is the same for every prompt through that prefix: a
snapshot of it (a spare row of ``LinearStatePool``) lets the prefix cache resume
another prompt from there. The two forms agree to float32 rounding, not bit for bit: a
preempted sequence recomputing its output tokens as a prompt may differ from its first pass
in the last bits.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from slotserve.runners.pytorch.model.config import ModelConfig
from slotserve.runners.pytorch.model.layers import Projection, RmsNorm

BLOCK = 64  # tokens per block of the chunked form (and the runner's chunk grain)


class LinearAttention(nn.Module):
    """A Gated DeltaNet layer's weights: the four input projections fused into one
    (``[qkv | z | b | a]``, as they read the same input), the convolution, the decay
    parameters (float32), the gated norm and the output projection."""

    def __init__(self, c: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        heads = c.linear_num_value_heads
        value_dim = heads * c.linear_value_head_dim
        channels = c.linear_conv_channels
        self.in_proj = Projection(
            c.hidden_size, channels + value_dim + 2 * heads, bias=False, dtype=dtype
        )
        self.conv_weight = nn.Parameter(
            torch.zeros(channels, c.linear_conv_kernel), requires_grad=False
        )
        self.A_log = nn.Parameter(torch.zeros(heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.zeros(heads), requires_grad=False)
        self.norm = RmsNorm(c.linear_value_head_dim, c.rms_norm_eps, False, dtype)
        self.out_proj = Projection(value_dim, c.hidden_size, bias=False, dtype=dtype)


@dataclass
class LinearStep:
    """Where each sequence's tokens sit in the step: the decoded tokens first (rows
    ``0 .. len(decode_slots) - 1``), then each prompt chunk as (first row, tokens, slot, its
    first position); ``saves``: (slot, position, pool row): copy the slot's state after
    ``position`` tokens, which its chunk reaches on the block grid, into that row."""

    decode_slots: torch.Tensor  # [decoding sequences], int64
    prefills: list[tuple[int, int, int, int]]
    saves: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def num_decode(self) -> int:
        return int(self.decode_slots.shape[0])


def linear_attention(
    layer: LinearAttention,
    x: torch.Tensor,
    step: LinearStep,
    state: tuple[torch.Tensor, torch.Tensor],
    c: ModelConfig,
) -> torch.Tensor:
    """``x``: the step's normalised hidden states [tokens, hidden]; updates ``state``."""
    conv_state, recurrent = state
    heads, dv = c.linear_num_value_heads, c.linear_value_head_dim
    channels, value_dim = c.linear_conv_channels, heads * dv
    tokens = x.shape[0]
    projected = layer.in_proj(x)
    mixed = projected[:, :channels]
    z = projected[:, channels : channels + value_dim]
    b = projected[:, channels + value_dim : channels + value_dim + heads]
    a = projected[:, channels + value_dim + heads :]
    beta = torch.sigmoid(b).float()
    decay = -layer.A_log.exp() * F.softplus(a.float() + layer.dt_bias)
    out = torch.empty(tokens, heads, dv, dtype=torch.float32, device=x.device)
    n = step.num_decode
    if n:
        slots = step.decode_slots
        window = torch.cat([conv_state[slots], mixed[:n, None]], dim=1)  # [n, kernel, C]
        conv_state[slots] = window[:, 1:]
        q, k, v = _heads(_causal_conv(window, layer.conv_weight, 1)[:, 0], c)
        out[:n], recurrent[slots] = _recurrent_step(q, k, v, decay[:n], beta[:n], recurrent[slots])
    for first, length, slot, start in step.prefills:
        rows = slice(first, first + length)
        window = torch.cat([conv_state[slot], mixed[rows]])  # [kernel - 1 + length, C]
        marks = {pos - start: row for s, pos, row in step.saves if s == slot}
        for offset, row in marks.items():  # the inputs before position start + offset
            conv_state[row] = window[offset : offset + conv_state.shape[1]]
        conv_state[slot] = window[length:]
        q, k, v = _heads(_causal_conv(window[None], layer.conv_weight, length)[0], c)
        out[rows], recurrent[slot], marked = _chunked(
            q, k, v, decay[rows], beta[rows], recurrent[slot], start, list(marks)
        )
        for offset, row in marks.items():
            recurrent[row] = marked[offset]
    normed = layer.norm(out.to(x.dtype))
    gated = (normed * F.silu(z.view(tokens, heads, dv).float())).to(x.dtype)
    return layer.out_proj(gated.view(tokens, value_dim))  # type: ignore[no-any-return]


def _causal_conv(window: torch.Tensor, weight: torch.Tensor, length: int) -> torch.Tensor:
    """``window``: [batch, kernel - 1 + length, C], the inputs before the chunk then the
    chunk's; SiLU of each position's weighted sum of its last ``kernel`` inputs, summed tap by
    tap in float32, so every position gets the same bits whatever chunk it is in."""
    kernel = weight.shape[1]
    total = window[:, :length].float() * weight[:, 0]
    for tap in range(1, kernel):
        total = total + window[:, tap : tap + length].float() * weight[:, tap]
    return F.silu(total).to(window.dtype)


def _heads(conv: torch.Tensor, c: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[tokens, C] → q, k [tokens, value heads, d_k] (normalised; value head j reads key head
    j // (n_v / n_k)) and v [tokens, value heads, d_v], in float32."""
    nk, nv = c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    tokens = conv.shape[0]
    q, k, v = torch.split(conv.float(), [nk * dk, nk * dk, nv * dv], dim=-1)
    q = _l2_normalise(q.reshape(tokens, nk, dk)) * dk**-0.5
    k = _l2_normalise(k.reshape(tokens, nk, dk))
    if nv != nk:
        q, k = q.repeat_interleave(nv // nk, dim=1), k.repeat_interleave(nv // nk, dim=1)
    return q, k, v.reshape(tokens, nv, dv)


def _l2_normalise(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of ``n`` sequences: q, k [n, heads, d_k], v [n, heads, d_v], decay
    and beta [n, heads], state [n, heads, d_k, d_v] → outputs [n, heads, d_v], new state."""
    state = state * decay.exp()[..., None, None]
    predicted = (k[..., None, :] @ state)[..., 0, :]
    update = beta[..., None] * (v - predicted)
    state = state + k[..., :, None] * update[..., None, :]
    return (q[..., None, :] @ state)[..., 0, :], state


def _chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    start: int,
    marks: list[int],
) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """The tokens of one sequence's chunk (q, k [T, heads, d_k], v [T, heads, d_v], decay and
    beta [T, heads]) from ``state`` [heads, d_k, d_v], the chunk's first token at position
    ``start``, in blocks on the grid of ``BLOCK`` positions from 0. Also the state after each
    of the chunk's first ``marks`` tokens (each must end a block)."""
    total = q.shape[0]
    cuts = sorted({0, total, *range(-start % BLOCK, total, BLOCK)})
    assert set(marks) <= set(cuts[1:]), f"states kept off the block grid: {marks}"
    outputs, kept = [], {}
    for begin, end in itertools.pairwise(cuts):
        rows = slice(begin, end)
        block_out, state = _block(q[rows], k[rows], v[rows], decay[rows], beta[rows], state)
        outputs.append(block_out)
        if end in marks:
            kept[end] = state
    return torch.cat(outputs), state, kept


def _block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block at once. With ``G`` the cumulative log decay, ``S_0`` the state before the
    block and ``u_i`` the delta-rule updates, the state before token i's update is
    ``e^{G_i} S_0 + Σ_{j<i} e^{G_i - G_j} k_j u_jᵀ``, so the ``u`` solve the unit
    lower-triangular system ``u_i + β_i Σ_{j<i} e^{G_i - G_j} (k_i·k_j) u_j =
    β_i (v_i - e^{G_i} S_0ᵀ k_i)``; outputs and the final state follow by matmuls."""
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, L, d]
    cumulative = decay.transpose(0, 1).cumsum(dim=-1)  # [heads, L]
    size = q.shape[1]
    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    gaps = cumulative[:, :, None] - cumulative[:, None, :]  # G_i - G_j
    # Exponents are <= 0 where kept: no overflow; -inf above the diagonal gives exact zeros.
    ratios = gaps.masked_fill(~causal, float("-inf")).exp()
    scaled_keys = k * beta.transpose(0, 1)[..., None]
    system = ((scaled_keys @ k.transpose(1, 2)) * ratios).tril(-1)
    system = system + torch.eye(size, dtype=system.dtype, device=system.device)
    right = torch.cat(
        [v * beta.transpose(0, 1)[..., None], scaled_keys * cumulative.exp()[..., None]], dim=-1
    )
    solved = torch.linalg.solve_triangular(system, right, upper=False, unitriangular=True)
    updates = solved[..., : v.shape[-1]] - solved[..., v.shape[-1] :] @ state  # [heads, L, d_v]
    scores = (q @ k.transpose(1, 2)) * ratios
    out = (q * cumulative.exp()[..., None]) @ state + scores @ updates
    last = cumulative[:, -1:]
    carried = (k * (last - cumulative).exp()[..., None]).transpose(1, 2) @ updates
    state = state * last.exp()[..., None] + carried
    return out.transpose(0, 1), state
