"""The per-layer static KV buffer and its mechanics: write a block, build the mask, evict by scores (hole filling).

Layout of one layer (allocated once, before the first token):
    k, v   [batch, n_kv_heads, C, head_dim]   C = budget + block_size, keys stored after RoPE
    pos    [batch, n_kv_heads, C] int32        absolute position of each slot, -1 = empty
    state  per-slot policy tensors [batch, n_kv_heads, C, ...], moved with their slot

With an evicting policy, slots [0, budget) hold the kept tokens (in any order) and the incoming block is written
to the tail [budget, budget + T). After attention the policy scores all budget + T slots, the lowest T are dropped,
and the surviving tail tokens move into the dropped slots of [0, budget): at most T copies per step, never a
compaction of the whole buffer. Without a policy (`full`) each token is written at slot == its position, as in
gpt-fast, and nothing is ever evicted. A compress-once policy (`policy.evicts = False`: SnapKV++, RocketKV,
Exact-TopK) never evicts either: new tokens are appended after the kept ones (slots fill in order), and its only
compression is `compress_into` at the end of a one-shot prefill.

Decode-time sparse attention (RocketKV stage 2, Exact-TopK): when the policy's `select` returns slot indices for a
decode step, `update` returns the gathered keys/values/mask of just those slots (per KV head, or per query head),
so model.py's SDPA attends over the selection with no policy-specific code.

Everything is a static-shaped tensor op: the shapes depend only on budget and T, never on the data.
"""
import torch
import torch.nn as nn
from torch import Tensor


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per row (one key or value of one head): x [..., D] -> (int8 [..., D], scale [...]) with
    x ~= q * scale, scale = max|x| / 127; the error of an element is at most scale / 2."""
    # Stored as x.dtype, so quantize with that; floored at its smallest normal after the cast (in fp16 a tiny row's
    # scale would round to 0, and 0 / 0 is NaN).
    scale = (x.float().abs().amax(-1) / 127).to(x.dtype).clamp_min(torch.finfo(x.dtype).tiny)
    q = (x.float() / scale.float()[..., None]).round().clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_rows(q: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return (q.float() * scale.float()[..., None]).to(dtype)  # fp32 product: one rounding, at the final cast


def position_order(pos: Tensor) -> Tensor:
    """Slot indices [..., S] that list slots by ascending position, empty slots (-1) last."""
    return torch.where(pos >= 0, pos, torch.iinfo(pos.dtype).max).argsort(dim=-1)


def flat_rows(slot: Tensor, C: int) -> Tensor:
    """Row numbers [B*H*n] in a [B, H, C, ...] buffer viewed as [B*H*C, ...] of per-head slots slot [B, H, n]: one
    index_select over rows (on CPU ~3x faster than an element-wise gather)."""
    B, H = slot.shape[:2]
    return (slot + C * torch.arange(B * H, device=slot.device).view(B, H, 1)).view(-1)


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
    holes copy each dropped tail slot onto itself (both lists end with those slots in order): harmless, and the tail
    is cleared after.
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
    # index_put_ on each buffer itself, never through a view: compiled, a mutation through a view (an index_copy_ of
    # flat rows; before that a scatter_) made inductor copy the whole K and V buffers onto themselves in every layer
    # and step, O(budget) traffic the hole filling exists to avoid (tests/test_engine.py checks the kernels).
    B, H = drop.shape[:2]
    b = torch.arange(B, device=drop.device).view(B, 1, 1).expand_as(drop)
    h = torch.arange(H, device=drop.device).view(1, H, 1).expand_as(drop)
    for buf in [pos, *buffers]:
        buf.index_put_((b, h, drop), buf[b, h, src])
    pos[:, :, budget:S] = -1


def attention_weights(cache: "KVCache", q: Tensor, q_pos: Tensor, S: int, group_mean: bool = True) -> Tensor:
    """Softmax attention of query rows q [B, Hq, R, D] (positions q_pos [R], -1 = ignore the row) over the first
    S slots, fp32, averaged over the query heads of each KV group: [B, H_kv, R, S] (group_mean=False: per query
    head, [B, H_kv, G, R, S]). A small separate matmul for the few rows a policy needs, so the main attention
    stays SDPA/flash. Masked rows come out all zero."""
    B, Hq, R, D = q.shape
    k = cache.keys(S).float()
    H = k.shape[1]
    logits = torch.einsum("bhgrd,bhsd->bhgrs", q.float().view(B, H, Hq // H, R, D), k) / D ** 0.5
    mask = attention_mask(cache.pos[:, :, :S], q_pos, cache.window) & (q_pos >= 0)[None, None, :, None]
    mask = mask[:, :, None]
    w = logits.masked_fill(~mask, torch.finfo(torch.float32).min).softmax(-1) * mask
    return w.mean(2) if group_mean else w


class KVCache(nn.Module):
    """One layer's static buffer. `policy` is None for `full` (no eviction)."""

    def __init__(self, batch: int, n_kv_heads: int, head_dim: int, budget: int, block_size: int,
                 dtype: torch.dtype, device, policy=None, window: int | None = None, n_heads: int | None = None,
                 scratch: bool = False, kv_dtype: torch.dtype | None = None, keep_budget: int | None = None):
        super().__init__()
        # kv_dtype int8: K and V stored as int8 with one scale per token and head (the buffer shrinks ~2x vs
        # bf16, ~4x vs fp32); `keys`/`values` dequantize to `dtype` for attention and for every policy's scores.
        self.dtype, self.kv_dtype = dtype, kv_dtype or dtype
        self.quantized = self.kv_dtype == torch.int8
        self.budget, self.block_size, self.window, self.policy = budget, block_size, window, policy
        # The budget the policy keeps to, which a recent window is a fraction of: a one-shot scratch's budget is
        # the prompt, its keep_budget the destination cache's.
        self.keep_budget = keep_budget or budget
        self.scratch = scratch  # a one-shot prefill's full-length scratch: always dense, no decode-time state
        self.n_heads = n_heads or n_kv_heads  # query heads, for policies that keep queries
        C = budget + block_size
        self.register_buffer("k", torch.zeros(batch, n_kv_heads, C, head_dim, dtype=self.kv_dtype, device=device))
        self.register_buffer("v", torch.zeros(batch, n_kv_heads, C, head_dim, dtype=self.kv_dtype, device=device))
        if self.quantized:
            self.register_buffer("k_scale", torch.zeros(batch, n_kv_heads, C, dtype=dtype, device=device))
            self.register_buffer("v_scale", torch.zeros(batch, n_kv_heads, C, dtype=dtype, device=device))
        self.register_buffer("pos", torch.full((batch, n_kv_heads, C), -1, dtype=torch.int32, device=device))
        self.evict_before_attend = False
        # Per-slot policy state (e.g. H2O's accumulated attention) moves with its slot on eviction; per-layer state
        # (e.g. SnapKV's ring of recent queries) stays put. Policies declare both; they are allocated here, once.
        self.state, self.layer_state = {}, {}
        if policy is not None:
            for name, (extra_shape, state_dtype) in policy.slot_state().items():
                extra_shape = [self.n_heads // n_kv_heads if d == "group" else d for d in extra_shape]
                t = torch.zeros(batch, n_kv_heads, C, *extra_shape, dtype=state_dtype, device=device)
                self.register_buffer(f"state_{name}", t)
                self.state[name] = t
            for name, (shape, state_dtype, fill) in policy.layer_state(self).items():
                t = torch.full(shape, fill, dtype=state_dtype, device=device)
                self.register_buffer(f"layer_{name}", t)
                self.layer_state[name] = t

    def slot_buffers(self) -> list[Tensor]:
        """Every [B, H, C, ...] tensor whose slots move together: keys, values (+ their int8 scales), policy state."""
        scales = [self.k_scale, self.v_scale] if self.quantized else []
        return [self.k, self.v, *scales, *self.state.values()]

    def keys(self, S: int | None = None) -> Tensor:
        """Keys of the first S slots (all when None) in the compute dtype (dequantized when stored as int8)."""
        k = self.k if S is None else self.k[:, :, :S]
        return dequantize_rows(k, self.k_scale[:, :, :k.shape[2]], self.dtype) if self.quantized else k

    def values(self, S: int | None = None) -> Tensor:
        v = self.v if S is None else self.v[:, :, :S]
        return dequantize_rows(v, self.v_scale[:, :, :v.shape[2]], self.dtype) if self.quantized else v

    def key_rows(self, slot: Tensor) -> Tensor:
        """Keys [B, H, n, D] of the slots `slot` [n] (compute dtype)."""
        k = self.k.index_select(2, slot)
        return dequantize_rows(k, self.k_scale.index_select(2, slot), self.dtype) if self.quantized else k

    def reset(self) -> None:
        self.pos.fill_(-1)
        for t in self.state.values():
            t.zero_()
        for name, (_, _, fill) in self.policy.layer_state(self).items() if self.policy else ():
            self.layer_state[name].fill_(fill)

    def slots(self, T: int) -> int:
        """How many leading slots a step of T tokens reads: the whole buffer for `full` and compress-once policies,
        else budget + T."""
        return self.k.shape[2] if self.policy is None or not self.policy.evicts else self.budget + T

    def read_tokens(self) -> float:
        """Token-equivalents (K+V pairs) one decode step reads per KV head: the slots attended, or what a
        selecting policy reads (RocketKV: exact top-k plus its page scan)."""
        n = self.policy.read_tokens(self) if self.policy is not None and not self.scratch else None
        return self.slots(1) if n is None else n

    def update(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor, query_pos: Tensor):
        """Write a block k, v [B, H, T, D] at positions input_pos [T] (-1 = padding); return what to attend.
        With evict_before_attend the policy evicts first and the block attends over the kept slots only."""
        T = k.shape[2]
        tail = torch.arange(self.budget, self.budget + T, device=k.device)
        if self.policy is None or self.scratch:
            # full, and a one-shot scratch (which holds the whole prompt): slot == position; padding goes to the
            # tail, which no real position reaches. The scratch never evicts until compress_into.
            dst = torch.where(input_pos >= 0, input_pos, tail)
        elif not self.policy.evicts:  # compress-once: append after the valid slots, which fill [0, n) in order
            n = (self.pos[0, 0, :self.budget] >= 0).sum()
            dst = torch.where(input_pos >= 0, n + torch.arange(T, device=k.device), tail)
        else:
            dst = tail
        if self.quantized:
            (k, k_scale), (v, v_scale) = quantize_rows(k), quantize_rows(v)
            self.k_scale.index_copy_(2, dst, k_scale)
            self.v_scale.index_copy_(2, dst, v_scale)
        self.k.index_copy_(2, dst, k)
        self.v.index_copy_(2, dst, v)
        self.pos.index_copy_(2, dst, input_pos.to(torch.int32).expand(*self.pos.shape[:2], T))
        for t in self.state.values():  # a new token starts with zero state
            t.index_fill_(2, dst, 0)
        S = self.slots(T)
        if self.evict_before_attend:
            self._evict(q, input_pos, query_pos)
        if T == 1 and self.policy is not None and not self.scratch:  # decode: the policy may pick the slots
            idx = self.policy.select(self, q, query_pos, dst)
            if idx is not None:
                return self.gather(idx, query_pos)
        return self.keys(S), self.values(S), attention_mask(self.pos[:, :, :S], query_pos, self.window)

    def gather(self, idx: Tensor, query_pos: Tensor):
        """Keys, values [B, Hs, k, D] and mask [B, Hs, 1, k] of slots idx [B, Hs, k]; Hs = the KV heads (one
        selection per group) or the query heads (one per head; model.py then attends per query head)."""
        B, H, C, D = self.k.shape
        g, n = idx.shape[1] // H, idx.shape[2]
        flat = flat_rows(idx.view(B, H, g * n), C)
        k, v = (t.view(B * H * C, D).index_select(0, flat).view(B, H * g, n, D) for t in (self.k, self.v))
        pos = self.pos.view(B * H * C).index_select(0, flat).view(B, H * g, n)
        if self.quantized:
            k, v = (dequantize_rows(t, s.view(B * H * C).index_select(0, flat).view(B, H * g, n), self.dtype)
                    for t, s in ((k, self.k_scale), (v, self.v_scale)))
        return k, v, attention_mask(pos, query_pos, self.window)

    def evict(self, q: Tensor, input_pos: Tensor, query_pos: Tensor) -> None:
        """After attention (the default order): score the budget + T slots and drop the lowest T."""
        if not self.evict_before_attend:
            self._evict(q, input_pos, query_pos)

    def _evict(self, q, input_pos, query_pos):
        if self.policy is None:
            return
        S = self.slots(q.shape[2])
        self.policy.observe(self, q, input_pos, query_pos, S)
        if self.scratch:  # one-shot prefill scores the whole prompt with its last block (compress_into)
            self.last_step = (q, input_pos, query_pos)
        elif self.policy.evicts:
            self.drop_to(self.budget, self.policy.score(self, q, input_pos, query_pos, S))

    def drop_to(self, budget: int, scores: Tensor) -> None:
        """Keep the `budget` best of the first scores.shape[-1] slots (empty slots are never kept over real ones)."""
        S = scores.shape[-1]
        scores = scores.float().masked_fill(self.pos[:, :, :S] < 0, float("-inf"))
        evict_fill_holes(scores, budget, self.slot_buffers(), self.pos)

    def compress_into(self, dst: "KVCache") -> None:
        """One-shot prefill: this scratch cache holds a whole prompt; keep `policy.prompt_slots(dst)` of it (dst.budget
        unless the policy reserves room for generated tokens) by the policy's scores (the last block's queries
        stand for the prompt's end), copy the survivors into dst's slots, then let the policy finish
        (`policy.compressed`: e.g. RocketKV sorts the slots by position and builds its page min/max)."""
        if dst.policy.compress(self, dst):  # a policy with its own slot layout (SAGE-KV) wrote dst itself
            return
        S = self.budget
        keep = dst.policy.prompt_slots(dst)
        n = min(S, keep)
        # A compress-once scratch fills [0, n_real) in order: with only the last block's padding beyond `keep`
        # (Exact-TopK: keep = prompt + new tokens) there is nothing to drop (and Exact-TopK has no scores).
        n_real = S if self.policy.evicts else int(self.n_valid().max())
        if n_real > keep:
            self.drop_to(keep, self.policy.score(self, *self.last_step, S))
        for src_t, dst_t in [(self.pos, dst.pos), *zip(self.slot_buffers(), dst.slot_buffers(), strict=True)]:
            dst_t[:, :, :n] = src_t[:, :, :n]
        for name, t in self.layer_state.items():
            if name in dst.layer_state:  # decode-time state (RocketKV's pages) exists in dst only
                dst.layer_state[name].copy_(t)
        dst.policy.compressed(dst, n)

    def sort_slots(self, n: int) -> None:
        """Permute the first n slots (and their state) into ascending position order, empty slots last (so that
        appending at the valid count stays correct), e.g. after compress_into."""
        pos = self.pos[:, :, :n]
        order = position_order(pos)
        for buf in [self.pos, *self.slot_buffers()]:
            extra = buf.shape[3:]
            idx = order.view(*order.shape, *([1] * len(extra))).expand(*order.shape, *extra)
            buf[:, :, :n] = buf[:, :, :n].gather(2, idx)

    def n_valid(self) -> Tensor:
        return (self.pos >= 0).sum(-1)


def make_cache(model, batch: int, budget: int, block_size: int, policy=None, scratch=False,
               kv_dtype: torch.dtype | None = None, keep_budget: int | None = None) -> KVCache:
    args, p = model.args, model.tok_embeddings.weight
    return KVCache(batch, args.n_kv_heads, args.head_dim, budget, block_size, p.dtype, p.device, policy,
                   args.sliding_window, args.n_heads, scratch, kv_dtype, keep_budget)


def setup_caches(model, batch: int, budget: int, block_size: int, policy=None, evict_before_attend=False,
                 kv_dtype: torch.dtype | None = None) -> None:
    """Attach a fresh KVCache to every attention layer of `model` (kv_dtype torch.int8: the quantized buffer)."""
    for layer in model.layers:
        layer.attention.kv_cache = make_cache(model, batch, budget, block_size, policy, kv_dtype=kv_dtype)
        layer.attention.kv_cache.evict_before_attend = evict_before_attend


def kv_bytes(model) -> int:
    """Bytes of the key and value buffers of all layers, int8 scales included (positions and policy state not)."""
    return sum(t.nbytes for l in model.layers for t in l.attention.kv_cache.slot_buffers()[:4 if
               l.attention.kv_cache.quantized else 2])
