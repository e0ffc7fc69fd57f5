"""The device kernels model.py calls, and the choice among them by shapes, dtype and device.

Two choices, each made in one place: `Linear.forward` for the weight products (CPU steps of a few rows stream the
weight) and `attention` for attention (SDPA, or on CUDA two batched products, or on CPU row-wise scores). Plus
`tp_sum`, the tensor-parallel sum of a row-parallel product. Why each form wins where it does: docs/performance.md.

The environment's BUDGETKV_ATTENTION overrides the attention choice for a whole process, for scripts/gpu_check.py to
measure forms against the default choice: `flex` takes `flex_attention_form` (torch's flex_attention, a candidate
for CUDA steps) for every attention, `sdpa` takes SDPA for every attention (gpt-fast's decode: masked SDPA over
the static buffer). Unset (the default), `attention` chooses.
"""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from errors import UserError

ROWWISE_MAX_ROWS = 8  # past it the row-wise loop is compute-bound and MKL's GEMM wins (docs/performance.md)
ROWWISE_MAX_QUERY_ROWS = 16  # past it SDPA's kernel wins (docs/performance.md)
MATMUL_MAX_QUERY_ROWS = 64  # CUDA: up to a verification block of a few tokens times the GQA group
MATMUL_EAGER_MIN_SLOTS = 8192  # CUDA eager: SDPA's one kernel wins at 2K slots, the products at 16K (performance.md)
FORM = os.environ.get("BUDGETKV_ATTENTION", "")  # "flex" or "sdpa": every attention in that form; "": chosen


def check_form() -> None:
    """UserError for a BUDGETKV_ATTENTION that names no form (checked by every run before its first step)."""
    if FORM not in ("", "flex", "sdpa"):
        raise UserError(f"BUDGETKV_ATTENTION={FORM!r} names no attention form: flex, sdpa, or leave it unset")


class Linear(nn.Linear):
    """nn.Linear, except on CPU for 1 to 16 rows, where MKL's GEMV and GEMM read the weight far below the memory's
    bandwidth (docs/performance.md):
    - 1 to 8 rows (batch-1 decode, a small batch, a speculative verification block) in a compiled step:
      `rowwise_linear`, one reduction per row that inductor fuses into one vectorised loop streaming the weight;
    - 2 to 16 rows otherwise (eager, or 9-16 rows compiled): y = (W @ x^T)^T, the weight as the GEMM's left
      operand: MKL packs a GEMM's right operand, and for a few rows packing the whole weight costs several times
      the product itself."""

    def forward(self, x: Tensor) -> Tensor:
        rows = x.numel() // x.shape[-1] if x.device.type == "cpu" else 0
        if rowwise_rows(rows):
            return rowwise_linear(x, self.weight, self.bias)
        if 1 < rows <= 16:
            # contiguous: a transposed result would reach SDPA as a query whose last dim has stride `rows`, which
            # sends it to the slow math path
            y = (self.weight @ x.reshape(rows, x.shape[-1]).T).T.contiguous().reshape(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)


def rowwise_rows(rows: int) -> bool:
    """Whether a CPU product of `rows` rows takes rowwise_linear: in a compiled step, 1 to ROWWISE_MAX_ROWS rows."""
    return 1 <= rows <= ROWWISE_MAX_ROWS and torch.compiler.is_compiling()


def rowwise_product(x: Tensor, weight: Tensor) -> Tensor:
    """x @ weight^T for x (..., R, d) and weight (..., N, d) (batch dims broadcast), written as one reduction
    sum(weight * row, -1) per row of x: compiled, inductor fuses the R reductions into one vectorised loop that reads
    each weight row once. Eager it would materialise the products: for compiled steps of a few rows only.

    The rows are first written to a buffer of their own (a no-op as_strided, which inductor cannot inline): else
    inductor inlines x's producer (a norm, SiLU * up, RoPE) into the loop and recomputes it for every weight row."""
    x = x.contiguous()
    x = x.as_strided(x.shape, x.stride())
    return torch.stack([(weight * x[..., r, None, :]).sum(-1) for r in range(x.shape[-2])], -2)


def rowwise_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """y = x @ weight.T + bias as rowwise_product over x's rows (all leading dims flattened): for rowwise_rows."""
    y = rowwise_product(x.reshape(-1, x.shape[-1]), weight).reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


def attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, evicting: bool = False) -> Tensor:
    """softmax(q keys^T / sqrt(d), where mask is False: -inf) values, for q (B, hq, T, d), keys and values
    (B, h, S, d) with h dividing hq (grouped-query attention; h == hq when the keys are per query head), mask
    (B, h or 1, T, S) bool; returns (B, hq, T, d).

    One mask for every head (an eager prefill block of a cache without eviction): SDPA, which groups the heads
    itself and broadcasts the mask. Otherwise the g = hq / h query heads of a KV group become g*T query rows of that
    KV head, without copying K/V, and those R rows take SDPA, except in steps of a few rows (a decode step, a
    verification block):
    - on CUDA, up to MATMUL_MAX_QUERY_ROWS rows, compiled or (eager) over MATMUL_EAGER_MIN_SLOTS slots or more:
      matmul_attention. SDPA's masked kernel runs one block per head and block of query rows there, a handful of
      blocks for a whole GPU;
    - on CPU, in a compiled step of 1 to ROWWISE_MAX_QUERY_ROWS rows: rowwise_attention. SDPA's kernel runs a
      small GEMM per block of keys there and reads the cache far below the memory's bandwidth.

    evicting: the caller's cache scores these same keys later in the step (an evicting policy): inductor would fuse
    that scoring's per-head reductions with the row-wise loop into one kernel parallel over the KV heads only,
    slower than SDPA, so the CPU row-wise form is not taken then. The caller computes it from its cache; the
    choice reads nothing else but shapes, dtype and device.

    FORM "flex": every call takes flex_attention_form; "sdpa": SDPA."""
    if FORM == "flex":
        return flex_attention_form(q, keys, values, mask)
    B, hq, T, d = q.shape
    h, S = keys.shape[1], keys.shape[2]
    g = hq // h
    if mask.shape[1] == 1 < h:  # folded rows would copy the mask g * h times (and SDPA widen each copy)
        return F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask,
                                              enable_gqa=g > 1)
    q = q.reshape(B, h, g * T, d)
    mask = mask[:, :, None].expand(B, h, g, T, S).reshape(B, h, g * T, S)
    R = g * T
    if FORM == "sdpa":
        out = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask)
    elif q.device.type == "cuda" and R <= MATMUL_MAX_QUERY_ROWS and (
            torch.compiler.is_compiling() or S >= MATMUL_EAGER_MIN_SLOTS):
        out = matmul_attention(q, keys.to(q.dtype), values.to(q.dtype), mask)
    elif (not evicting and q.device.type == "cpu" and torch.compiler.is_compiling()
            and R <= ROWWISE_MAX_QUERY_ROWS):
        out = rowwise_attention(q, keys, values, mask)
    else:
        out = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask)
    return out.reshape(B, hq, T, d)


def flex_attention_form(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """attention's result by torch.nn.attention.flex_attention, for the same arguments: the grouped query heads by
    its enable_gqa, and a mask_mod that reads the cache's mask (built from the slots' positions: a valid slot at or
    before the query's position, within the model's sliding window) at the query head's KV head, or at the one
    mask of every head. Eager it runs flex's unfused reference; compiled, one fused kernel (on CUDA its decoding
    kernel splits the slots for a few query rows). The mask is written to a buffer of its own (a no-op as_strided,
    which inductor cannot inline), and on CPU the query, keys and values are copied too: compiled there (torch
    2.13), a mask or query computed in the step finds no kernel and keys sliced from the cache's buffer give wrong
    results."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if q.device.type == "cpu":
        q, keys, values = (t.clone(memory_format=torch.contiguous_format) for t in (q, keys, values))
        q, keys, values = (t.as_strided(t.shape, t.stride()) for t in (q, keys, values))
    mask = mask.contiguous()
    mask = mask.as_strided(mask.shape, mask.stride())
    B, hq, T, _ = q.shape
    h, S = keys.shape[1], keys.shape[2]
    g = hq // h if mask.shape[1] > 1 else hq  # query heads per mask head

    def mask_mod(b, head, q_idx, kv_idx):
        return mask[b, head // g, q_idx, kv_idx]
    block_mask = create_block_mask(mask_mod, B, hq, T, S, device=q.device)
    return flex_attention(q, keys.to(q.dtype), values.to(q.dtype), block_mask=block_mask, enable_gqa=hq > h)


def matmul_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """softmax(q keys^T / sqrt(d), where mask is False: -inf) values as two batched products in the inputs' dtype
    and a softmax in fp32 (the precision of HF transformers' eager attention): the products parallelise over the
    cache's slots, where a fused attention kernel parallelises over query rows and heads only (a decode step has a
    few rows per KV head). A row that sees no slot gives NaN where SDPA gives zeros; the engine never makes one."""
    scores = ((q * q.shape[-1] ** -0.5) @ keys.transpose(-1, -2)).float()  # scaled first: fp16's range
    return weighted_values(scores, mask, values)


def rowwise_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """Attention for a compiled CPU step of a few query rows: the scores by rowwise_product (one loop streaming the
    keys, widened to fp32 in the loop) and the softmax, both in fp32, then the weighted sum of values as one batched
    GEMM in the values' dtype (SDPA's CPU kernel rounds the weights so too); the result in q's dtype."""
    scores = rowwise_product(q.float() * q.shape[-1] ** -0.5, keys.float())  # keys widened in the loop
    return weighted_values(scores, mask, values).to(q.dtype)


def weighted_values(scores: Tensor, mask: Tensor, values: Tensor) -> Tensor:
    """softmax(scores, where mask is False: -inf) over the slots in fp32, then the weighted sum of values as one
    batched product in the values' dtype."""
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return weights.to(values.dtype) @ values


def tp_sum(x: Tensor, group: str | None) -> Tensor:
    """x summed over the ranks of a tensor-parallel group (tp.py: each rank holds a slice of the heads or of the
    MLP, and its row-parallel Linear a partial sum; group: its name); x itself when group is None (one device: the
    code path and its graphs unchanged). A functional collective, so that a compiled step keeps it in its graph."""
    if group is None:
        return x
    from torch.distributed._functional_collectives import all_reduce
    return all_reduce(x, "sum", group)
