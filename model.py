"""The transformer: Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5 and SmolLM2 from one set of modules.

Every hyper-parameter comes from the checkpoint's `config.json` (`config.parse_config`), never from a name.
Weights are in Hugging Face layout (q/k rows not permuted), so RoPE rotates halves (`apply_rope`), as HF does.
The KV cache and everything a policy does live in `cache.py`; this file only calls `cache.update` before attention
and `cache.evict` after it. The products and attention run on kernels.py's forms (`Linear`, `attention`). While layer
regions are on (`set_layer_regions`, runtime.py's decision), each block runs as a compile region: a compiled step
traces one layer and stamps its graph out for every later layer that reads the same. Two forwards: `forward` (one block through every layer:
block-wise prefill and decode) and `prefill_layer_major` (the whole prompt through one layer at a time, with a
scratch cache per layer: the one-shot prefill).
"""
import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from cache import last_real
from kernels import Linear, attention, tp_sum


@dataclass
class ModelArgs:
    """The model's shape and options, read from config.json by config.parse_config."""
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    rope_theta: float
    max_seq_len: int
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear", ...} as in config.json
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    sliding_window: int | None = None


@contextmanager
def on_meta():
    """Build modules on the meta device with their parameters left uninitialised (a load assigns them, as
    transformers' no_init_weights does): an init op on a meta tensor runs a Python reference kernel that imports
    the compiler, memory and seconds that an eager run never needs."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_", "xavier_uniform_",
             "xavier_normal_", "ones_", "zeros_", "constant_")
    saved = {n: getattr(nn.init, n) for n in names}
    try:
        for n in names:
            setattr(nn.init, n, lambda tensor, *args, **kwargs: tensor)
        with torch.device("meta"):
            yield
    finally:
        for n, fn in saved.items():
            setattr(nn.init, n, fn)


def rope_inv_freq(args: ModelArgs) -> Tensor:
    """Inverse frequencies [head_dim/2], fp32, including llama3 / linear scaling read from the config."""
    d = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = args.rope_scaling
    if s is None:
        return inv_freq
    if s["rope_type"] == "linear":
        return inv_freq / s["factor"]
    # llama3: long wavelengths are slowed down by `factor`, short ones kept, the band between interpolated.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_ctx / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def rope_cos_sin(pos: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin [..., T, head_dim] for absolute positions `pos` [..., T]; computed per step, so no table grows with
    context."""
    freqs = pos.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, H, T, D]; rotate-half layout (HF), so HF q/k weights need no permutation."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32 like the reference implementations, then cast back before the weight.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.tp_group = None  # tensor parallel (tp.apply_tp): this rank's heads' output is summed over the group
        qkv_out = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        self.wqkv = Linear(args.dim, qkv_out, bias=args.qkv_bias)
        self.wo = Linear(args.n_heads * args.head_dim, args.dim, bias=args.o_bias)
        self.kv_cache = None  # a cache.KVCache, attached by cache.setup_caches

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, input_pos: Tensor, query_pos: Tensor,
                cache=None) -> Tensor:
        """cache: the KVCache to use instead of the layer's own (a one-shot prefill's scratch)."""
        cache = cache if cache is not None else self.kv_cache
        B, T, _ = x.shape
        hq, hkv, d = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.wqkv(x).split([hq * d, hkv * d, hkv * d], dim=-1)
        q = apply_rope(q.view(B, T, hq, d).transpose(1, 2), cos, sin)
        k = apply_rope(k.view(B, T, hkv, d).transpose(1, 2), cos, sin)
        v = v.view(B, T, hkv, d).transpose(1, 2)

        keys, values, mask = cache.update(q, k, v, input_pos, query_pos)
        out = attention(q, keys, values, mask, evicting=cache.spec.mode == "evict")
        # Attend, then let the policy evict (the block-wise protocol; a no-op without a scorer).
        cache.evict(q, input_pos, query_pos)
        out = out.transpose(1, 2).reshape(B, T, hq * d)  # CUDA's SDPA: not contiguous
        return tp_sum(self.wo(out), self.tp_group)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w13 = Linear(args.dim, 2 * args.intermediate_size, bias=False)  # gate and up, fused
        self.w2 = Linear(args.intermediate_size, args.dim, bias=False)
        self.tp_group = None  # tensor parallel (tp.apply_tp): this rank's slice of the MLP is summed over the group

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return tp_sum(self.w2(F.silu(gate) * up), self.tp_group)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x, cos, sin, input_pos, query_pos, cache=None) -> Tensor:
        return (block_region if regions_on() else block_layer)(self, x, cos, sin, input_pos, query_pos, cache)


def block_layer(block: TransformerBlock, x, cos, sin, input_pos, query_pos, cache=None) -> Tensor:
    x = x + block.attention(block.attention_norm(x), cos, sin, input_pos, query_pos, cache)
    return x + block.feed_forward(block.ffn_norm(x))


# A layer region (torch.compiler.nested_compile_region): a compiled step traces one layer and reuses its graph for
# every later layer whose inputs and whatever it reads of its modules match (a layer that differs, say a policy
# reading the layer's index, is traced again); one reuse entry per distinct layer trace. Eager, it is the function.
block_region = torch.compiler.nested_compile_region(block_layer, max_reuse_entries=1024)
layer_regions = False


def set_layer_regions(on: bool) -> None:
    """Whether the next traced step runs each block as a layer region; also marks regions_on a constant for dynamo
    (here, not at import: the marker imports dynamo, which an eager run does not need)."""
    global layer_regions
    layer_regions = on
    torch.compiler.assume_constant_result(regions_on)


def regions_on() -> bool:
    """layer_regions, read when dynamo traces a step and not guarded: steps traced with and without regions in one
    process both keep running without a recompile."""
    return layer_regions


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        with torch.device("cpu"):  # computed on the host, then moved (on the meta device, its ops import dynamo)
            inv_freq = rope_inv_freq(args)
        self.register_buffer("inv_freq", inv_freq.to(self.tok_embeddings.weight.device), persistent=False)

    def rope(self, input_pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(query_pos, cos, sin) for input_pos [T] (shared by the batch) or [B, T] (each sequence its own).
        Padding (-1) queries as its sequence's last real token: every row then sees at least one key (no NaN rows
        in SDPA), and its own slots carry position -1, so no real token ever attends to them. A sequence whose
        whole block is padding queries at -1 (cache.attention_mask lets it see every valid slot). cos, sin
        [T, head_dim] or [B, 1, T, head_dim]."""
        query_pos = torch.where(input_pos >= 0, input_pos, input_pos.amax(-1, keepdim=True))
        cos, sin = rope_cos_sin(query_pos, self.inv_freq, self.tok_embeddings.weight.dtype)
        if input_pos.dim() == 2:  # per sequence: broadcast over the heads of [B, H, T, D]
            cos, sin = cos[:, None], sin[:, None]
        return query_pos, cos, sin

    def last_logits(self, x: Tensor, input_pos: Tensor) -> Tensor:
        """Logits [B, vocab] (fp32) of each sequence's last real position of hidden states x [B, T, dim]."""
        B, _, dim = x.shape
        last = last_real(input_pos).view(-1, 1, 1).expand(B, 1, dim)
        return self.output(self.norm(x.gather(1, last)))[:, 0].float()

    def forward(self, idx: Tensor, input_pos: Tensor, every_position: bool = False) -> Tensor:
        """idx [B, T] token ids; input_pos [T] absolute positions shared by the batch, or [B, T] each sequence's
        own; -1 for padding (at the end of a short block, or a whole block once a sequence's prompt has ended).

        Returns logits [B, vocab] of each sequence's last real position only: nothing here grows with the prompt.
        every_position: logits [B, T, vocab] (fp32) of every position instead (speculative decoding's verification
        block, a few tokens).
        """
        query_pos, cos, sin = self.rope(input_pos)
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, cos, sin, input_pos, query_pos)
        if every_position:
            return self.output(self.norm(x)).float()
        return self.last_logits(x, input_pos)

    def prefill_layer_major(self, idx: Tensor, input_pos: Tensor, block_size: int, scratch, done) -> Tensor:
        """The one-shot prefill: all blocks of the prompt through layer 0, then through layer 1, ..., carrying the
        hidden states [B, T, dim]. Layer i attends with the cache `scratch(i)` (one layer's full-length K/V, the
        only scratch), then `done(i, cache)` compresses it into the layer's own. idx [B, T], input_pos [T] or
        [B, T] padded to a multiple of block_size (-1 = padding). Returns the last real position's logits [B, vocab]."""
        query_pos, cos, sin = self.rope(input_pos)
        x = self.tok_embeddings(idx)
        for i, layer in enumerate(self.layers):
            cache = scratch(i)
            for start in range(0, idx.shape[1], block_size):
                blk = slice(start, start + block_size)
                x[:, blk] = layer(x[:, blk], cos[..., blk, :], sin[..., blk, :], input_pos[..., blk],
                                  query_pos[..., blk], cache)
            done(i, cache)
        return self.last_logits(x, input_pos)
