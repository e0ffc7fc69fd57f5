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


def drop_lowest(scores: Tensor, pos: Tensor, T: int) -> Tensor:
    """Slots [B, H, T] of the T lowest scores, ascending by slot. Ties drop the older position (spec: keep newer);
    torch.topk's order among equal values is unspecified, so rank by (score, position)."""
    if T == 1:  # decode: a lexicographic argmin, O(S) without sorting
        lowest = scores == scores.min(dim=-1, keepdim=True).values
        return torch.where(lowest, pos, torch.iinfo(pos.dtype).max).argmin(dim=-1, keepdim=True)
    by_pos = pos.argsort(dim=-1, stable=True)
    rank = scores.gather(-1, by_pos).argsort(dim=-1, stable=True)[..., :T]
    return by_pos.gather(-1, rank).sort(dim=-1).values


def evict_fill_holes(scores: Tensor, budget: int, buffers: list[Tensor], pos: Tensor) -> None:
    """Keep the `budget` highest-scoring of the first S slots of every head; drop the other T = S - budget.

    scores: fp32 [B, H, S] over slots [0, S); +inf = protected, -inf = empty. buffers: tensors [B, H, C, ...]
    whose slots move together (keys, values, policy state); pos [B, H, C] moves too and its tail is then cleared.
    The i-th dropped slot below `budget` (a hole) receives the i-th surviving tail slot. Pairs past the number of
    holes copy a dropped tail slot onto another dropped tail slot, which is harmless: the tail is cleared after.
    """
    S = scores.shape[-1]
    T = S - budget
    drop = drop_lowest(scores, pos[:, :, :S], T)  # ascending: holes (< budget) come first
    if T == 1:  # decode: the one new token fills the hole (or is itself the one dropped: a self-copy)
        src = torch.full_like(drop, budget)
    else:
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


def attention_weights(cache: "KVCache", q: Tensor, q_pos: Tensor, S: int) -> Tensor:
    """Softmax attention of query rows q [B, Hq, R, D] (positions q_pos [R], -1 = ignore the row) over the first
    S slots, fp32, averaged over the query heads of each KV group: [B, H_kv, R, S]. A small separate matmul for
    the few rows a policy needs, so the main attention stays SDPA/flash. Masked rows come out all zero."""
    B, Hq, R, D = q.shape
    k = cache.k[:, :, :S].float()
    H = k.shape[1]
    logits = torch.einsum("bhgrd,bhsd->bhgrs", q.float().view(B, H, Hq // H, R, D), k) / D ** 0.5
    mask = attention_mask(cache.pos[:, :, :S], q_pos, cache.window) & (q_pos >= 0)[None, None, :, None]
    mask = mask[:, :, None]
    w = logits.masked_fill(~mask, torch.finfo(torch.float32).min).softmax(-1) * mask
    return w.mean(2)


class KVCache(nn.Module):
    """One layer's static buffer. `policy` is None for `full` (no eviction)."""

    def __init__(self, batch: int, n_kv_heads: int, head_dim: int, budget: int, block_size: int,
                 dtype: torch.dtype, device, policy=None, window: int | None = None, n_heads: int | None = None):
        super().__init__()
        self.budget, self.block_size, self.window, self.policy = budget, block_size, window, policy
        self.n_heads = n_heads or n_kv_heads  # query heads, for policies that keep queries
        C = budget + block_size
        self.register_buffer("k", torch.zeros(batch, n_kv_heads, C, head_dim, dtype=dtype, device=device))
        self.register_buffer("v", torch.zeros(batch, n_kv_heads, C, head_dim, dtype=dtype, device=device))
        self.register_buffer("pos", torch.full((batch, n_kv_heads, C), -1, dtype=torch.int32, device=device))
        self.evict_before_attend = False
        # Per-slot policy state (e.g. H2O's accumulated attention) moves with its slot on eviction; per-layer state
        # (e.g. SnapKV's ring of recent queries) stays put. Policies declare both; they are allocated here, once.
        self.state, self.layer_state = {}, {}
        if policy is not None:
            for name, (extra_shape, state_dtype) in policy.slot_state().items():
                t = torch.zeros(batch, n_kv_heads, C, *extra_shape, dtype=state_dtype, device=device)
                self.register_buffer(f"state_{name}", t)
                self.state[name] = t
            for name, (shape, state_dtype, fill) in policy.layer_state(self).items():
                t = torch.full(shape, fill, dtype=state_dtype, device=device)
                self.register_buffer(f"layer_{name}", t)
                self.layer_state[name] = t

    def reset(self) -> None:
        self.pos.fill_(-1)
        for t in self.state.values():
            t.zero_()
        for name, (_, _, fill) in self.policy.layer_state(self).items() if self.policy else ():
            self.layer_state[name].fill_(fill)

    def slots(self, T: int) -> int:
        """How many leading slots a step of T tokens reads: the whole buffer for `full`, else budget + T."""
        return self.k.shape[2] if self.policy is None else self.budget + T

    def update(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor, query_pos: Tensor):
        """Write a block k, v [B, H, T, D] at positions input_pos [T] (-1 = padding); return what to attend.
        With evict_before_attend the policy evicts first and the block attends over the kept slots only."""
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
        if self.evict_before_attend:
            self._evict(q, input_pos, query_pos)
        return self.k[:, :, :S], self.v[:, :, :S], attention_mask(self.pos[:, :, :S], query_pos, self.window)

    def evict(self, q: Tensor, input_pos: Tensor, query_pos: Tensor) -> None:
        """After attention (the default order): score the budget + T slots and drop the lowest T."""
        if not self.evict_before_attend:
            self._evict(q, input_pos, query_pos)

    def _evict(self, q, input_pos, query_pos):
        if self.policy is None:
            return
        S = self.slots(q.shape[2])
        self.policy.observe(self, q, input_pos, query_pos, S)
        self.last_step = (q, input_pos, query_pos)  # one-shot prefill scores the whole prompt with the last block
        self.drop_to(self.budget, self.policy.score(self, q, input_pos, query_pos, S))

    def drop_to(self, budget: int, scores: Tensor) -> None:
        """Keep the `budget` best of the first scores.shape[-1] slots (empty slots are never kept over real ones)."""
        S = scores.shape[-1]
        scores = scores.float().masked_fill(self.pos[:, :, :S] < 0, float("-inf"))
        evict_fill_holes(scores, budget, [self.k, self.v, *self.state.values()], self.pos)

    def compress_into(self, dst: "KVCache") -> None:
        """One-shot prefill: this scratch cache holds a whole prompt; keep dst.budget of it by the policy's scores
        (the last block's queries stand for the prompt's end) and copy the survivors into dst's slots."""
        S = self.budget
        n = min(S, dst.budget)
        if S > dst.budget:
            self.drop_to(dst.budget, self.policy.score(self, *self.last_step, S))
        for src_t, dst_t in [(self.k, dst.k), (self.v, dst.v), (self.pos, dst.pos),
                             *((self.state[k], dst.state[k]) for k in self.state)]:
            dst_t[:, :, :n] = src_t[:, :, :n]
        for name, t in self.layer_state.items():
            dst.layer_state[name].copy_(t)

    def n_valid(self) -> Tensor:
        return (self.pos >= 0).sum(-1)


def make_cache(model, batch: int, budget: int, block_size: int, policy=None) -> KVCache:
    args, p = model.args, model.tok_embeddings.weight
    return KVCache(batch, args.n_kv_heads, args.head_dim, budget, block_size, p.dtype, p.device, policy,
                   args.sliding_window, args.n_heads)


def setup_caches(model, batch: int, budget: int, block_size: int, policy=None, evict_before_attend=False) -> None:
    """Attach a fresh KVCache to every attention layer of `model`."""
    for layer in model.layers:
        layer.attention.kv_cache = make_cache(model, batch, budget, block_size, policy)
        layer.attention.kv_cache.evict_before_attend = evict_before_attend


def kv_bytes(model) -> int:
    """Bytes of the key and value buffers of all layers (positions and policy state not included)."""
    return sum(l.attention.kv_cache.k.nbytes + l.attention.kv_cache.v.nbytes for l in model.layers)
