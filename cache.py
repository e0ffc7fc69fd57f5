"""The per-layer static KV buffer and its mechanics: write a block, build the mask, evict by scores (hole filling).

Layout of one layer (allocated once, before the first token):
    k, v   [batch, n_kv_heads, C, head_dim]   C = budget + block_size, keys stored after RoPE
    pos    [batch, n_kv_heads, C] int32        absolute position of each slot, -1 = empty
    state  per-slot policy tensors [batch, n_kv_heads, C, ...], moved with their slot

With an evicting policy, slots [0, budget) hold the kept tokens (in any order) and the incoming block is written
to the tail [budget, budget + T). After attention the policy scores all budget + T slots, the lowest T are dropped,
and the surviving tail tokens move into the dropped slots of [0, budget): at most T copies per step, never a
compaction of the whole buffer. Without a policy (`full`) each token is written at slot == its position, as in
gpt-fast, and nothing is ever evicted.

Everything is a static-shaped tensor op: the shapes depend only on budget and T, never on the data.
"""
import torch
import torch.nn as nn
from torch import Tensor


def attention_mask(slot_pos: Tensor, query_pos: Tensor, window: int | None) -> Tensor:
    """Bool mask [B, H, T, S]: a query sees every valid slot at or before its position (within the window)."""
    sp = slot_pos[:, :, None, :]
    qp = query_pos[None, None, :, None]
    mask = (sp >= 0) & (sp <= qp)
    if window is not None:
        mask = mask & (sp > qp - window)  # Mistral: a query sees its `window` most recent positions
    return mask


def evict_fill_holes(scores: Tensor, budget: int, buffers: list[Tensor], pos: Tensor) -> None:
    """Keep the `budget` highest-scoring of the first S slots of every head; drop the other T = S - budget.

    scores: fp32 [B, H, S] over slots [0, S); +inf = protected, -inf = empty. buffers: tensors [B, H, C, ...]
    whose slots move together (keys, values, policy state); pos [B, H, C] moves too and its tail is then cleared.
    The i-th dropped slot below `budget` (a hole) receives the i-th surviving tail slot. Pairs past the number of
    holes copy a dropped tail slot onto another dropped tail slot, which is harmless: the tail is cleared after.
    """
    S = scores.shape[-1]
    T = S - budget
    drop = scores.topk(T, dim=-1, largest=False).indices.sort(dim=-1).values  # holes (< budget) come first
    in_tail = drop >= budget
    tail_dropped = torch.zeros_like(drop).scatter_add_(-1, (drop - budget).clamp_min(0), in_tail.long())
    # Stable sort puts the surviving tail slots (flag 0) first, in slot order: they pair with the holes.
    src = budget + torch.argsort(tail_dropped.clamp_max(1), dim=-1, stable=True)
    for buf in [pos, *buffers]:
        extra = buf.shape[3:]
        shape = (*src.shape, *extra)
        idx_src = src.view(*src.shape, *([1] * len(extra))).expand(shape)
        idx_dst = drop.view(*drop.shape, *([1] * len(extra))).expand(shape)
        buf.scatter_(2, idx_dst, buf.gather(2, idx_src))
    pos[:, :, budget:S] = -1


class KVCache(nn.Module):
    """One layer's static buffer. `policy` is None for `full` (no eviction)."""

    def __init__(self, batch: int, n_kv_heads: int, head_dim: int, budget: int, block_size: int,
                 dtype: torch.dtype, device, policy=None, window: int | None = None):
        super().__init__()
        self.budget, self.block_size, self.window, self.policy = budget, block_size, window, policy
        C = budget + block_size
        self.register_buffer("k", torch.zeros(batch, n_kv_heads, C, head_dim, dtype=dtype, device=device))
        self.register_buffer("v", torch.zeros(batch, n_kv_heads, C, head_dim, dtype=dtype, device=device))
        self.register_buffer("pos", torch.full((batch, n_kv_heads, C), -1, dtype=torch.int32, device=device))
        # Per-slot policy state, e.g. H2O's accumulated attention; moved with the slot on eviction.
        self.state = {}
        if policy is not None:
            for name, (extra_shape, state_dtype) in policy.slot_state().items():
                t = torch.zeros(batch, n_kv_heads, C, *extra_shape, dtype=state_dtype, device=device)
                self.register_buffer(f"state_{name}", t)
                self.state[name] = t

    def reset(self) -> None:
        self.pos.fill_(-1)
        for t in self.state.values():
            t.zero_()

    def slots(self, T: int) -> int:
        """How many leading slots a step of T tokens reads: the whole buffer for `full`, else budget + T."""
        return self.k.shape[2] if self.policy is None else self.budget + T

    def update(self, k: Tensor, v: Tensor, input_pos: Tensor, query_pos: Tensor):
        """Write a block k, v [B, H, T, D] at positions input_pos [T] (-1 = padding); return what to attend."""
        T = k.shape[2]
        tail = torch.arange(self.budget, self.budget + T, device=k.device)
        # full: slot == position; padding goes to the tail, which no real position reaches (budget >= all tokens)
        dst = tail if self.policy is not None else torch.where(input_pos >= 0, input_pos, tail)
        self.k.index_copy_(2, dst, k)
        self.v.index_copy_(2, dst, v)
        self.pos.index_copy_(2, dst, input_pos.to(torch.int32).expand(*self.pos.shape[:2], T))
        for t in self.state.values():  # a new token starts with zero state
            t.index_fill_(2, dst, 0)
        S = self.slots(T)
        return self.k[:, :, :S], self.v[:, :, :S], attention_mask(self.pos[:, :, :S], query_pos, self.window)

    def evict(self, q: Tensor, query_pos: Tensor) -> None:
        """After attention: score the budget + T slots with the policy and drop the lowest T."""
        if self.policy is None:
            return
        S = self.slots(q.shape[2])
        scores = self.policy.score(self, q, query_pos, S).float()
        scores = scores.masked_fill(self.pos[:, :, :S] < 0, float("-inf"))
        evict_fill_holes(scores, self.budget, [self.k, self.v, *self.state.values()], self.pos)

    def n_valid(self) -> Tensor:
        return (self.pos >= 0).sum(-1)


def setup_caches(model, batch: int, budget: int, block_size: int, policy=None, dtype=None, device=None) -> None:
    """Attach a fresh KVCache to every attention layer of `model`."""
    args = model.args
    p = model.tok_embeddings.weight
    for layer in model.layers:
        layer.attention.kv_cache = KVCache(batch, args.n_kv_heads, args.head_dim, budget, block_size,
                                           dtype or p.dtype, device or p.device, policy, args.sliding_window)


def kv_bytes(model) -> int:
    """Bytes of the key and value buffers of all layers (positions and policy state not included)."""
    return sum(l.attention.kv_cache.k.nbytes + l.attention.kv_cache.v.nbytes for l in model.layers)
