"""The per-layer static KV buffer and its mechanics: write a block, build the mask, evict by scores (hole filling).

Layout of one layer (allocated once, before the first token):
    k, v   [batch, n_kv_heads, C, head_dim]   C = budget + block_size, keys stored after RoPE
    pos    [batch, n_kv_heads, C] int32        absolute position of each slot, -1 = empty
    state  per-slot policy tensors [batch, n_kv_heads, C, ...], moved with their slot

With a scorer that evicts, slots [0, budget) hold the kept tokens (in any order) and the incoming block is written
to the tail [budget, budget + T). After attention the scorer scores all budget + T slots, the lowest T are dropped,
and the surviving tail tokens move into the dropped slots of [0, budget): at most T copies per step, never a
compaction of the whole buffer. Without a scorer (`full`, a selector alone) each token is written at slot == its
position, as in gpt-fast, and nothing is ever evicted. After a one-shot compression (`compress_into`) a scorer with
`decode = "append"` appends new tokens after the kept ones (slots fill in order) instead of evicting.

Decode-time sparse attention: when a selector's `select` returns slot indices for a decode step, `update` returns
the gathered keys/values/mask of just those slots (per KV head, or per query head), so model.py's SDPA attends
over the selection with no policy-specific code. A policy sees a layer through a `View` (read-only, state
excepted); every buffer write happens here.

Everything is a static-shaped tensor op: the shapes depend only on budget and T, never on the data.
"""
import copy

import torch
import torch.nn as nn
from torch import Tensor


KV_DTYPES = {"int8": torch.int8, "bfloat16": torch.bfloat16}  # --kv-dtype's storage choices besides the compute dtype


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


def per_row(positions: Tensor) -> Tensor:
    """Positions [T] (one row shared by the whole batch) or [B, T] (each sequence its own) as [1 or B, T]."""
    return positions.reshape(-1, positions.shape[-1])


def newest(query_pos: Tensor) -> Tensor:
    """The newest position of each sequence's step, [1 or B, 1, 1] (broadcasts over [B, H, S]); -1 for a row that
    is all padding."""
    return per_row(query_pos).amax(-1).view(-1, 1, 1)


def attention_mask(slot_pos: Tensor, query_pos: Tensor, window: int | None) -> Tensor:
    """Bool mask [B, H, T, S]: a query sees every valid slot at or before its position (within the window).
    query_pos [T] or [B, T]. A query at -1 (a sequence whose whole block is padding: its prompt ended in an earlier
    block) sees every valid slot, so that its (discarded) output stays finite; no real query ever sees a pad."""
    sp = slot_pos[:, :, None, :]
    qp = per_row(query_pos)[:, None, :, None]
    seen = (sp <= qp) if window is None else (sp <= qp) & (sp > qp - window)  # Mistral: `window` latest positions
    if query_pos.dim() == 2:  # per sequence: a row may be all padding (positions [T] always hold a real one)
        seen = seen | (qp < 0)
    return (sp >= 0) & seen


def drop_lowest(scores: Tensor, pos: Tensor, T: int) -> Tensor:
    """Slots [B, H, T] of the T lowest scores, ascending by slot. Ties drop the older position (the newer is kept);
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
    """Softmax attention of query rows q [B, Hq, R, D] (positions q_pos [R] or [B, R], -1 = ignore the row) over the first
    S slots, fp32, averaged over the query heads of each KV group: [B, H_kv, R, S] (group_mean=False: per query
    head, [B, H_kv, G, R, S]). A small separate matmul for the few rows a policy needs, so the main attention
    stays SDPA/flash. Masked rows come out all zero."""
    B, Hq, R, D = q.shape
    k = cache.keys(S).float()
    H = k.shape[1]
    logits = torch.einsum("bhgrd,bhsd->bhgrs", q.float().view(B, H, Hq // H, R, D), k).div_(D ** 0.5)
    mask = attention_mask(cache.pos[:, :, :S], q_pos, cache.window)
    w = logits.masked_fill_(~mask[:, :, None], torch.finfo(torch.float32).min).softmax(-1)
    # A row that sees no slot (or is ignored) comes out zero. The rest equal softmax(...) * mask exactly (a masked
    # entry's exp underflows to 0), so the row's flag multiplies the G-times smaller group mean, not every weight.
    rows = (mask.any(-1) & (per_row(q_pos) >= 0)[:, None, :]).float()[..., None]  # [B, H_kv, R, 1]
    return w.mean(2) * rows if group_mean else w * rows[:, :, None]


class View:
    """What a policy sees of one layer's cache in one step: the first S slots, read-only (state excepted).

    keys, values [B, H_kv, S, D] in the compute dtype (dequantized when stored as int8, widened from bf16); pos
    [B, H_kv, S] int32 (-1 = empty); state: the per-slot tensors the policy declared, [B, H_kv, S, ...] (observe may
    update them in place); layer_state: its per-layer tensors; shared: cross-layer state the engine owns for one
    forward (a dict, fresh for each one-shot prefill). The step: q [B, H_q, T, D] post-RoPE queries, input_pos [T]
    (shared by the batch) or [B, T] (each sequence its own) their positions (-1 = padding), query_pos of the same
    shape (padding rows query as their sequence's last real token), slot [T] the slots just written (or [B, T] when
    the sequences wrote different slots: a batch with `full` or appending after a one-shot compression).
    budget: the slots the layer holds (--budget); keep: how many of the prompt a one-shot compression keeps."""

    def __init__(self, cache: "KVCache", S: int, q=None, input_pos=None, query_pos=None, slot=None, shared=None,
                 budget: int | None = None, keep: int | None = None):
        self.cache, self.S = cache, S
        self.q, self.input_pos, self.query_pos, self.slot = q, input_pos, query_pos, slot
        self.shared = {} if shared is None else shared
        self.n_heads, self.n_kv_heads = cache.n_heads, cache.k.shape[1]
        # tensor parallel: the model's index of the first KV head here (not 0 on rank > 0), the group of all ranks
        self.head0, self.tp_group = cache.head0, cache.tp_group
        self.head_dim, self.dtype = cache.k.shape[3], cache.dtype
        self.budget = budget or cache.keep_budget
        self.keep = keep or self.budget
        self.layer_state, self.window = cache.layer_state, cache.window

    @property
    def layer(self) -> int:
        """This layer's index in the model (read only where a rule depends on it: a compiled step whose layers
        differ in nothing they read traces one layer and reuses it)."""
        return self.cache.layer

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    @property
    def pos(self) -> Tensor:
        return self.cache.pos[:, :, :self.S]

    @property
    def keys(self) -> Tensor:
        return self.cache.keys(self.S)

    @property
    def values(self) -> Tensor:
        return self.cache.values(self.S)

    @property
    def state(self) -> dict:
        return {name: t[:, :, :self.S] for name, t in self.cache.state.items()}

    @property
    def newest(self) -> Tensor:
        """The newest position each sequence has seen so far (its last real query's): [1 or B, 1, 1]."""
        return newest(self.query_pos)

    def key_rows(self, slot: Tensor) -> Tensor:
        return self.cache.key_rows(slot)

    def attention(self, q: Tensor, q_pos: Tensor, group_mean: bool = True) -> Tensor:
        """Softmax attention of query rows q [B, H_q, R, D] at positions q_pos [R] (-1 = ignore) over the S slots:
        fp32 [B, H_kv, R, S] (mean over each KV group) or [B, H_kv, G, R, S] (group_mean=False)."""
        return attention_weights(self.cache, q, q_pos, self.S, group_mean)

    def last_query(self) -> tuple[Tensor, Tensor]:
        """Each sequence's last real query of the step [B, H_q, 1, D] and its position [1 or B, 1]."""
        last = last_real(self.input_pos)
        B, Hq, _, D = self.q.shape
        q_last = self.q.gather(2, last.view(-1, 1, 1, 1).expand(B, Hq, 1, D))
        return q_last, per_row(self.query_pos).gather(-1, last.view(-1, 1))


def last_real(input_pos: Tensor) -> Tensor:
    """Index [1 or B] of each row's last real (non-padding) entry of positions [T] or [B, T]; 0 for a row that is
    all padding."""
    return (per_row(input_pos) >= 0).sum(-1).sub(1).clamp_min(0)


def write_slots(buf: Tensor, dst: Tensor, x: Tensor | int) -> None:
    """buf[b, :, dst[b, t]] = x[b, :, t] for buf [B, H, C, ...], dst [1 or B, T] (one row: the same slots in every
    sequence, one index_copy_), x [B, H, T, ...] or a number (a fill)."""
    if dst.shape[0] == 1:
        if isinstance(x, Tensor):
            buf.index_copy_(2, dst[0], x)
        else:
            buf.index_fill_(2, dst[0], x)
        return
    B, H = buf.shape[:2]
    b = torch.arange(B, device=buf.device).view(B, 1, 1)
    h = torch.arange(H, device=buf.device).view(1, H, 1)
    buf.index_put_((b, h, dst[:, None, :]), x if isinstance(x, Tensor) else buf.new_full((), x))


def is_scorer(policy) -> bool:
    return policy is not None and hasattr(policy, "score")


def is_selector(policy) -> bool:
    return policy is not None and hasattr(policy, "select")


class KVCache(nn.Module):
    """One layer's static buffer, driven by `policy` (None for `full`): a scorer (`score`) evicts, a selector
    (`select`) picks the slots each decode step attends; a policy may be both (RocketKV, SAGE-KV).

    Slot layout: without a scorer (full, Exact-TopK) and in a one-shot scratch each token sits at slot ==
    position and nothing is evicted. An evicting scorer keeps its tokens in [0, budget) and writes each block to
    the tail [budget, budget + T), then drops the lowest T (hole filling). After a one-shot compression a scorer
    with `decode = "append"` (SnapKV++, RocketKV, K-VEC) appends new tokens after the kept ones instead."""

    # Attributes no compiled step reads (the policy's plan is the policy's own attributes): aoti.step_key leaves them
    # out of a package's name, so that a prompt of another length loads the same package.
    UNTRACED = ("run", "last_step")

    def __init__(self, batch: int, n_kv_heads: int, head_dim: int, budget: int, block_size: int,
                 dtype: torch.dtype, device, policy=None, window: int | None = None, n_heads: int | None = None,
                 scratch: bool = False, kv_dtype: torch.dtype | None = None, keep_budget: int | None = None,
                 layer: int = 0, keep: int | None = None, head0: int = 0, tp_group: str | None = None):
        super().__init__()
        # Tensor parallel (tp.py): this buffer holds KV heads [head0, head0 + n_kv_heads) of the model's, and the
        # few policies that read every head of a layer gather them over tp_group (None: one device)
        self.head0, self.tp_group = head0, tp_group
        # kv_dtype int8: K and V stored as int8 with one scale per token and head (the buffer shrinks ~2x vs
        # bf16, ~4x vs fp32); `keys`/`values` dequantize to `dtype` for attention and for every policy's scores.
        # kv_dtype bfloat16 under fp32 compute: half the buffer; policies score the keys widened to `dtype`;
        # attention gets the stored bf16 (model.attention: widened copies for SDPA and on CUDA; on CPU a compiled
        # decode step widens the keys in its loop and takes the values' product in bf16).
        self.dtype, self.kv_dtype = dtype, kv_dtype or dtype
        self.quantized = self.kv_dtype == torch.int8
        self.budget, self.block_size, self.window, self.policy = budget, block_size, window, policy
        self.layer = layer  # this layer's index in the model
        self.run = None  # the policies.Run that engine.setup planned the policy for (a batch re-plans per prompt)
        # The budget a recent window is a fraction of: a one-shot scratch's budget is the prompt, its keep_budget
        # the destination cache's. keep: the prompt slots a one-shot compression into this cache keeps.
        self.keep_budget = keep_budget or budget
        self.keep = keep or budget
        self.scratch = scratch  # a one-shot prefill's full-length scratch: always dense, no decode-time state
        # Without eviction a token goes to slot position - slot_base: 0, except in a scratch that re-compresses a
        # kept history plus a new chat turn (chat.py), whose turn starts after the history's slots.
        self.slot_base = 0
        self.n_heads = n_heads or n_kv_heads  # query heads, for policies that keep queries
        self.scorer = policy if is_scorer(policy) else None
        self.selector = policy if is_selector(policy) and not scratch else None
        self.evicts = self.scorer is not None and not scratch and getattr(policy, "decode", "evict") == "evict"
        self.appends = self.scorer is not None and not scratch and not self.evicts
        self.dense = not (self.evicts or self.appends)  # every token at slot == position - slot_base
        self.evict_enabled = True  # False: the `no-evict` baseline (same buffer, nothing dropped)
        C = budget + block_size
        self.register_buffer("k", torch.zeros(batch, n_kv_heads, C, head_dim, dtype=self.kv_dtype, device=device))
        self.register_buffer("v", torch.zeros(batch, n_kv_heads, C, head_dim, dtype=self.kv_dtype, device=device))
        if self.quantized:
            self.register_buffer("k_scale", torch.zeros(batch, n_kv_heads, C, dtype=dtype, device=device))
            self.register_buffer("v_scale", torch.zeros(batch, n_kv_heads, C, dtype=dtype, device=device))
        self.register_buffer("pos", torch.full((batch, n_kv_heads, C), -1, dtype=torch.int32, device=device))
        self.evict_before_attend = False
        self.last_step = None  # a scratch's last block (q, input_pos, query_pos): its queries score the compression
        # Per-slot policy state (e.g. H2O's accumulated attention) moves with its slot on eviction; per-layer state
        # (e.g. SnapKV's ring of recent queries) stays put. Policies declare both; they are allocated here, once.
        self._state_names, self._layer_state_decl = [], {}
        if self.scorer is not None:
            for name, (extra_shape, state_dtype) in policy.slot_state().items():
                extra_shape = [self.n_heads // n_kv_heads if d == "group" else d for d in extra_shape]
                t = torch.zeros(batch, n_kv_heads, C, *extra_shape, dtype=state_dtype, device=device)
                self.register_buffer(f"state_{name}", t)
                self._state_names.append(name)
        if policy is not None:
            decl = dict(policy.layer_state(self) if self.scorer is not None else {})
            if self.selector is not None and hasattr(policy, "selector_state"):
                decl.update(policy.selector_state(self))
            for name, (shape, state_dtype, fill) in decl.items():
                self.register_buffer(f"layer_{name}", torch.full(shape, fill, dtype=state_dtype, device=device))
            self._layer_state_decl = decl

    # Both read the registered buffers on each access, so that a step run with the buffers swapped for others
    # (aoti.py exports the step with every buffer an input) reads and writes the swapped ones.
    @property
    def state(self) -> dict[str, Tensor]:
        """Per-slot policy state by name: [B, H, C, ...] tensors."""
        return {name: getattr(self, f"state_{name}") for name in self._state_names}

    @property
    def layer_state(self) -> dict[str, Tensor]:
        """Per-layer policy state by name."""
        return {name: getattr(self, f"layer_{name}") for name in self._layer_state_decl}

    def slot_buffers(self) -> list[Tensor]:
        """Every [B, H, C, ...] tensor whose slots move together: keys, values (+ their int8 scales), policy state."""
        scales = [self.k_scale, self.v_scale] if self.quantized else []
        return [self.k, self.v, *scales, *self.state.values()]

    def keys(self, S: int | None = None) -> Tensor:
        """Keys of the first S slots (all when None) in the compute dtype (dequantized when stored as int8,
        widened when stored as bfloat16)."""
        k = self.k if S is None else self.k[:, :, :S]
        return dequantize_rows(k, self.k_scale[:, :, :k.shape[2]], self.dtype) if self.quantized else k.to(self.dtype)

    def values(self, S: int | None = None) -> Tensor:
        v = self.v if S is None else self.v[:, :, :S]
        return dequantize_rows(v, self.v_scale[:, :, :v.shape[2]], self.dtype) if self.quantized else v.to(self.dtype)

    def key_rows(self, slot: Tensor) -> Tensor:
        """Keys [B, H, n, D] of the slots `slot` [n] (the same in every sequence) or [B, n] (compute dtype)."""
        if slot.dim() == 1:
            k = self.k.index_select(2, slot)
            scale = self.k_scale.index_select(2, slot) if self.quantized else None
        else:
            idx = slot[:, None, :].expand(-1, self.k.shape[1], -1)
            k = take_slots(self.k, idx)
            scale = take_slots(self.k_scale, idx) if self.quantized else None
        return dequantize_rows(k, scale, self.dtype) if self.quantized else k.to(self.dtype)

    def reset(self) -> None:
        self.pos.fill_(-1)
        for t in self.state.values():
            t.zero_()
        for name, (_, _, fill) in self._layer_state_decl.items():
            self.layer_state[name].fill_(fill)

    def slots(self, T: int) -> int:
        """How many leading slots a step of T tokens reads: the budget and the block's tail (a cache that does not
        evict holds every real token below `budget`: its tail only ever holds padding)."""
        return self.budget + T

    def view(self, S: int | None = None, **step) -> View:
        return View(self, self.k.shape[2] if S is None else S, **step)

    def read_tokens(self) -> float:
        """Token-equivalents (K+V pairs) one decode step reads per KV head: the slots attended, or what a
        selector reads (RocketKV: exact top-k plus its page scan)."""
        read = getattr(self.selector, "read_tokens", None)
        n = read(self.view(self.budget)) if read is not None else None
        return self.slots(1) if n is None else n

    def destinations(self, input_pos: Tensor) -> Tensor:
        """The slots [1 or B, T] a block at positions input_pos ([T] or [B, T], -1 = padding) is written to: the
        tail (an evicting scorer: the same slots in every sequence), after each sequence's valid slots (appending),
        or slot == position (full, selector-only, a one-shot scratch); padding goes to the tail, which no real
        position reaches."""
        ip = per_row(input_pos)
        T = ip.shape[1]
        tail = torch.arange(self.budget, self.budget + T, device=ip.device)
        if self.evicts:
            return tail[None]
        if self.appends:  # after a one-shot compression: append after the valid slots, which fill [0, n) in order
            n = (self.pos[:, 0, :self.budget] >= 0).sum(-1, keepdim=True)
            return torch.where(ip >= 0, n + torch.arange(T, device=ip.device), tail)
        # slot == position - slot_base: 0, except in a chat's re-compression scratch (chat.py)
        return torch.where(ip >= 0, ip - self.slot_base, tail)

    def update(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor, query_pos: Tensor):
        """Write a block k, v [B, H, T, D] at positions input_pos [T] (shared by the batch) or [B, T] (each sequence
        its own; -1 = padding); return what to attend: keys and values as stored (model.attention widens a
        bfloat16 cache), int8 dequantized. With evict_before_attend the policy evicts first and the
        block attends over the kept slots only."""
        B, H, T = k.shape[:3]
        dst = self.destinations(input_pos)
        if self.quantized:
            (k, k_scale), (v, v_scale) = quantize_rows(k), quantize_rows(v)
            write_slots(self.k_scale, dst, k_scale)
            write_slots(self.v_scale, dst, v_scale)
        write_slots(self.k, dst, k.to(self.kv_dtype))
        write_slots(self.v, dst, v.to(self.kv_dtype))
        write_slots(self.pos, dst, per_row(input_pos).to(torch.int32)[:, None, :].expand(B, H, T))
        for t in self.state.values():  # a new token starts with zero state
            write_slots(t, dst, 0)
        S = self.slots(T)
        filled_prefix = T > 1 and self.dense and not torch.compiler.is_compiling()
        if filled_prefix:
            # Eager prefill block, slot == position - slot_base: no slot past the block's newest position is valid,
            # so attend only the filled prefix (a causal triangle's cost instead of the whole buffer's). Compiled
            # graphs keep the static budget + T. (One host read of the newest position per layer and block.)
            S = min(S, int(input_pos.max()) + 1 - self.slot_base)
        if self.evict_before_attend:
            self._evict(q, input_pos, query_pos)
        if T == 1 and self.selector is not None:  # decode: the selector picks the slots
            slot = dst[0] if dst.shape[0] == 1 else dst
            view = self.view(self.budget, q=q, input_pos=input_pos, query_pos=query_pos, slot=slot)
            idx = self.selector.select(view)
            if idx is not None:
                return self.gather(idx, query_pos)
        pos = self.pos[:, :, :S]
        if filled_prefix and bool((pos == pos[:, :1]).all()):
            pos = pos[:, :1]  # every head holds the same positions: one mask [B, 1, T, S] for all (model.py: GQA)
        keys, values = (self.keys(S), self.values(S)) if self.quantized else (self.k[:, :, :S], self.v[:, :, :S])
        return keys, values, attention_mask(pos, query_pos, self.window)

    def gather(self, idx: Tensor, query_pos: Tensor):
        """Keys, values [B, Hs, k, D] (as `update` returns them) and mask [B, Hs, 1, k] of slots idx [B, Hs, k]; Hs =
        the KV heads (one selection per group) or the query heads (one per head; model.py then attends per query
        head)."""
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
        if self.scorer is None or not (self.scratch or self.evicts and self.evict_enabled):
            return
        view = self.view(self.slots(q.shape[2]), q=q, input_pos=input_pos, query_pos=query_pos)
        if hasattr(self.scorer, "observe"):
            self.scorer.observe(view)
        if self.scratch:  # one-shot prefill scores the whole prompt with its last block (compress_into)
            self.last_step = (q, input_pos, query_pos)
        else:
            self.drop_to(self.budget, self.scorer.score(view))

    def drop_to(self, budget: int, scores: Tensor) -> None:
        """Keep the `budget` best of the first scores.shape[-1] slots (empty slots are never kept over real ones)."""
        S = scores.shape[-1]
        scores = scores.float().masked_fill(self.pos[:, :, :S] < 0, float("-inf"))
        evict_fill_holes(scores, budget, self.slot_buffers(), self.pos)

    def compress_into(self, dst: "KVCache", shared: dict | None = None) -> None:
        """One-shot prefill: this scratch holds a whole prompt (slot == position); keep dst.keep of it in dst.

        The policy either names the scratch slots to keep (`keep_slots(view)` -> [B, H, n], a layout of its own:
        SAGE-KV) or scores them (the last block's queries stand for the prompt's end) and the dst.keep best are
        kept, then sorted by position. Then a selector prepares its decode-time state (`prepare`: RocketKV's pages).
        """
        S, policy = self.budget, dst.policy
        q, input_pos, query_pos = self.last_step
        view = View(self, S, q, input_pos, query_pos, shared=shared, budget=dst.keep_budget, keep=dst.keep)
        if hasattr(policy, "keep_slots"):
            idx = policy.keep_slots(view)
            n = idx.shape[-1]
            for src_t, dst_t in [(self.pos, dst.pos), *zip(self.slot_buffers(), dst.slot_buffers(), strict=True)]:
                dst_t[:, :, :n] = take_slots(src_t, idx)
            dst.pos[:, :, n:] = -1
        else:
            n_real = int(self.n_valid().max())
            scores = policy.score(view)  # scored even when all fits: a policy may record what it keeps (K-VEC)
            if n_real > dst.keep:
                self.drop_to(dst.keep, scores)
            n = min(S, dst.keep)
            for src_t, dst_t in [(self.pos, dst.pos), *zip(self.slot_buffers(), dst.slot_buffers(), strict=True)]:
                dst_t[:, :, :n] = src_t[:, :, :n]
            dst.sort_slots(n)
        for name, t in self.layer_state.items():
            if name in dst.layer_state:
                dst.layer_state[name].copy_(t)
        if dst.selector is not None and hasattr(dst.selector, "prepare"):
            dst.selector.prepare(dst.view(dst.budget))

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


def row_cache(cache: KVCache, b: int) -> KVCache:
    """Sequence b of a batch cache as a batch-1 cache whose every buffer (K, V, positions, per-slot and per-layer
    state, all batch-first) is a view of row b: what is written to it lands in the batch buffer. A one-shot
    prefill compresses each sequence of a batch through one (engine.prefill_one_shot)."""
    row = copy.copy(cache)
    row._buffers = {name: t[b:b + 1] for name, t in cache._buffers.items()}  # state, layer_state read these
    return row


def take_slots(x: Tensor, idx: Tensor) -> Tensor:
    """x[b, h, idx[b, h, j]] for x [B, H, C, ...] and idx [B, H, n]: whole slots, one index_select over the flat
    rows (on CPU ~3x faster than torch.gather, which indexes element by element)."""
    B, H, C = x.shape[:3]
    return x.reshape(B * H * C, *x.shape[3:]).index_select(0, flat_rows(idx, C)).view(B, H, idx.shape[-1], *x.shape[3:])


def make_cache(model, batch: int, budget: int, block_size: int, policy=None, scratch=False,
               kv_dtype: torch.dtype | None = None, keep_budget: int | None = None, layer: int = 0,
               keep: int | None = None) -> KVCache:
    args, p = model.args, model.tok_embeddings.weight
    return KVCache(batch, args.n_kv_heads, args.head_dim, budget, block_size, p.dtype, p.device, policy,
                   args.sliding_window, args.n_heads, scratch, kv_dtype, keep_budget, layer, keep,
                   getattr(model, "kv_head0", 0), getattr(model, "tp_group", None))


def setup_caches(model, batch: int, budget: int, block_size: int, policy=None, evict_before_attend=False,
                 kv_dtype: torch.dtype | None = None, keep: int | None = None, evict: bool = True) -> None:
    """Attach a fresh KVCache to every attention layer of `model` (kv_dtype: the buffer's storage, int8 or
    bfloat16; None: the model's dtype).
    keep: the prompt slots a one-shot compression keeps (default budget); evict=False: the `no-evict` baseline,
    the same buffer with eviction switched off."""
    for i, layer in enumerate(model.layers):
        cache = make_cache(model, batch, budget, block_size, policy, kv_dtype=kv_dtype, layer=i, keep=keep)
        cache.evict_before_attend = evict_before_attend
        cache.evict_enabled = evict
        layer.attention.kv_cache = cache


def kv_bytes(model) -> int:
    """Bytes of the key and value buffers of all layers, int8 scales included (positions and policy state not)."""
    return sum(t.nbytes for l in model.layers for t in l.attention.kv_cache.slot_buffers()[:4 if
               l.attention.kv_cache.quantized else 2])
