"""The per-layer static KV buffer and its mechanics: write a block, build the mask, evict by scores (hole filling).

Layout of one layer (allocated once, before the first token):
    k, v   [batch, n_kv_heads, C, head_dim]   C = budget + block, keys stored after RoPE (Storage: float, bf16, int8)
    pos    [batch, n_kv_heads, C] int32        absolute position of each slot, -1 = empty
    state  per-slot policy tensors [batch, n_kv_heads, C, ...], moved with their slot

A cache is built from one CacheSpec, whose `mode` says how a block is written and what follows attention (MODES).
An evicting scorer keeps its tokens in slots [0, budget) (in any order) and writes the incoming block to the tail
[budget, budget + T). After attention the scorer scores all budget + T slots, the lowest T are dropped, and the
surviving tail tokens move into the dropped slots of [0, budget): at most T copies per step, never a compaction of
the whole buffer. Without a scorer (`full`, a selector alone) each token is written at slot == its position, as in
gpt-fast, and nothing is ever evicted. After a one-shot compression (`compress_into`) a scorer with
`decode = "append"` appends new tokens after the kept ones (slots fill in order) instead of evicting.

Decode-time sparse attention: when a selector's `select` returns slot indices for a decode step, `update` returns
the gathered keys/values/mask of just those slots (per KV head, or per query head), so model.py's SDPA attends
over the selection with no policy-specific code. A policy sees a layer through a `View` (read-only, state
excepted); every buffer write happens here.

Everything is a static-shaped tensor op: the shapes depend only on budget and T, never on the data. The one
exception is the caller's to make: blocks it runs eagerly may attend only the slots filled so far (fill_eagerly).
"""
import copy
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

from errors import UserError


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


class Storage:
    """How K and V rows are stored: in the compute dtype, in bfloat16 (half an fp32 buffer; policies read the rows
    widened, attention gets them as stored: model.attention widens), or in int8 with one scale per row and head
    (about half of bf16; every reader gets them dequantized). The buffers are the cache's; this converts rows."""

    def __init__(self, dtype: torch.dtype, kv_dtype: torch.dtype | None = None):
        self.dtype, self.kv_dtype = dtype, kv_dtype or dtype
        self.scaled = self.kv_dtype == torch.int8

    def allocate(self, shape: tuple, device) -> dict[str, Tensor]:
        """Empty buffers by name: k, v [*shape] (and k_scale, v_scale [*shape[:-1]] when int8)."""
        out = {name: torch.zeros(shape, dtype=self.kv_dtype, device=device) for name in ("k", "v")}
        if self.scaled:
            out.update({f"{name}_scale": torch.zeros(shape[:-1], dtype=self.dtype, device=device) for name in "kv"})
        return out

    def encode(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """Rows x [..., D] as stored, and their scales (None unless int8)."""
        return quantize_rows(x) if self.scaled else (x.to(self.kv_dtype), None)

    def decode(self, rows: Tensor, scale: Tensor | None, widen: bool = True) -> Tensor:
        """Stored rows in the compute dtype (int8 dequantized; widen=False leaves bfloat16 as stored)."""
        if self.scaled:
            return dequantize_rows(rows, scale, self.dtype)
        return rows.to(self.dtype) if widen else rows


def position_order(pos: Tensor) -> Tensor:
    """Slot indices [..., S] that list slots by ascending position, empty slots (-1) last."""
    return torch.where(pos >= 0, pos, torch.iinfo(pos.dtype).max).argsort(dim=-1)


def flat_rows(slot: Tensor, C: int) -> Tensor:
    """Row numbers [B*H*n] in a [B, H, C, ...] buffer viewed as [B*H*C, ...] of per-head slots slot [B, H, n]: one
    index_select over rows (on CPU cheaper than an element-wise gather)."""
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
    # flat rows, a scatter_) makes inductor copy the whole K and V buffers onto themselves in every layer and step,
    # O(budget) traffic the hole filling exists to avoid (tests/test_engine.py checks the kernels).
    B, H = drop.shape[:2]
    b = torch.arange(B, device=drop.device).view(B, 1, 1).expand_as(drop)
    h = torch.arange(H, device=drop.device).view(1, H, 1).expand_as(drop)
    for buf in [pos, *buffers]:
        buf.index_put_((b, h, drop), buf[b, h, src])
    pos[:, :, budget:S] = -1


def attention_weights(q: Tensor, q_pos: Tensor, keys: Tensor, pos: Tensor, window: int | None,
                      group_mean: bool = True) -> Tensor:
    """Softmax attention of query rows q [B, Hq, R, D] (positions q_pos [R] or [B, R], -1 = ignore the row) over
    keys [B, H_kv, S, D] at slot positions pos [B, H_kv, S], fp32, averaged over the query heads of each KV group:
    [B, H_kv, R, S] (group_mean=False: per query head, [B, H_kv, G, R, S]). A small separate matmul for the few
    rows a policy needs, so the main attention stays SDPA/flash. Masked rows come out all zero."""
    B, Hq, R, D = q.shape
    k = keys.float()
    H = k.shape[1]
    logits = torch.einsum("bhgrd,bhsd->bhgrs", q.float().view(B, H, Hq // H, R, D), k).div_(D ** 0.5)
    mask = attention_mask(pos, q_pos, window)
    w = logits.masked_fill_(~mask[:, :, None], torch.finfo(torch.float32).min).softmax(-1)
    # A row that sees no slot (or is ignored) comes out zero. The rest equal softmax(...) * mask exactly (a masked
    # entry's exp underflows to 0), so the row's flag multiplies the G-times smaller group mean, not every weight.
    rows = (mask.any(-1) & (per_row(q_pos) >= 0)[:, None, :]).float()[..., None]  # [B, H_kv, R, 1]
    return w.mean(2) * rows if group_mean else w * rows[:, :, None]


class View:
    """What a policy sees of one layer's cache in one step: the first S slots, read-only (state excepted).

    What most scorers read: `keys`, `values` [B, H_kv, S, D] (compute dtype: int8 dequantized, bf16 widened), `pos`
    [B, H_kv, S] int32 (each slot's absolute position, -1 = empty), `newest` (each sequence's newest position,
    [1 or B, 1, 1]: recent windows count back from it), `budget` (the slots the layer holds: windows are fractions of
    it) and `attention(q, q_pos)` / `last_query()` (a small separate softmax for the few query rows a rule needs).

    The rest: q [B, H_q, T, D] the step's post-RoPE queries, input_pos [T] (shared by the batch) or [B, T] (each
    sequence its own) their positions (-1 = padding), query_pos of the same shape (padding rows query as their
    sequence's last real token), slot [T] the slots just written (or [B, T] when the sequences wrote different slots:
    a batch with `full` or appending after a one-shot compression); state: the per-slot tensors the policy declared,
    [B, H_kv, S, ...] (observe may update them in place); layer_state: its per-layer tensors; shared: cross-layer
    state the engine owns for one forward (a dict, fresh for each one-shot prefill); keep: how many slots a one-shot
    compression keeps (the prompt's share of the budget); head0, tp_group: tensor parallel's first KV head here and the
    group a rule that reads every head gathers over."""

    def __init__(self, cache: "KVCache", S: int, q=None, input_pos=None, query_pos=None, slot=None, shared=None,
                 budget: int | None = None, keep: int | None = None):
        spec = cache.spec
        self.S, self.q, self.input_pos, self.query_pos, self.slot = S, q, input_pos, query_pos, slot
        self.shared = {} if shared is None else shared
        self.n_heads, self.n_kv_heads, self.head_dim, self.dtype = spec.n_heads, spec.kv_heads, spec.head_dim, spec.dtype
        # tensor parallel: the model's index of the first KV head here (not 0 on rank > 0), the group of all ranks
        self.head0, self.tp_group, self.window = spec.head0, spec.tp_group, spec.window
        self.budget = budget or spec.keep_budget
        self.keep = keep or self.budget
        self.pos = cache.pos[:, :, :S]
        self.state = {name: t[:, :, :S] for name, t in cache.state.items()}
        self.layer_state = cache.layer_state
        self._spec, self._storage, self._k, self._v = spec, cache.storage, cache.rows("k"), cache.rows("v")

    @property
    def layer(self) -> int:
        """This layer's index in the model (read only where a rule depends on it: a compiled step whose layers
        differ in nothing they read traces one layer and reuses it)."""
        return self._spec.layer

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    @property
    def keys(self) -> Tensor:
        return self._storage.decode(*(t if t is None else t[:, :, :self.S] for t in self._k))

    @property
    def values(self) -> Tensor:
        return self._storage.decode(*(t if t is None else t[:, :, :self.S] for t in self._v))

    @property
    def newest(self) -> Tensor:
        """The newest position each sequence has seen so far (its last real query's): [1 or B, 1, 1]."""
        return newest(self.query_pos)

    def key_rows(self, slot: Tensor) -> Tensor:
        """Keys [B, H, n, D] of the slots `slot` [n] (the same in every sequence) or [B, n] (compute dtype)."""
        return self._storage.decode(*(t if t is None else take_rows(t, slot) for t in self._k))

    def attention(self, q: Tensor, q_pos: Tensor, group_mean: bool = True) -> Tensor:
        """Softmax attention of query rows q [B, H_q, R, D] at positions q_pos [R] (-1 = ignore) over the S slots:
        fp32 [B, H_kv, R, S] (mean over each KV group) or [B, H_kv, G, R, S] (group_mean=False)."""
        return attention_weights(q, q_pos, self.keys, self.pos, self.window, group_mean)

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
    """Whether a policy (or policy class; None: full) declares itself a scorer (policies.Policy.scores)."""
    return policy is not None and policy.scores


def is_selector(policy) -> bool:
    """Whether it declares itself a selector (policies.Policy.selects)."""
    return policy is not None and policy.selects


# How a cache writes a block and what follows attention:
#   dense     slot == position, nothing evicted (full; a selector alone, e.g. Exact-TopK)
#   evict     the block goes to the tail [budget, budget + T), then the scorer drops the lowest T (hole filling)
#   no-evict  written as evict, nothing dropped: the `no-evict` baseline (the same buffer, scoring-free steps)
#   append    after the valid slots, nothing dropped (a scorer with decode = "append", after its compression)
#   scratch   a one-shot prefill's whole-prompt buffer: written as append (a fresh one: slot == position), observed
#             after each block, compressed once into the layer's cache (compress_into); no selector
MODES = ("dense", "evict", "no-evict", "append", "scratch")


def cache_mode(policy, evict: bool = True) -> str:
    """The mode of a layer cache for `policy` (None: full); evict=False: the no-evict baseline."""
    if not is_scorer(policy):
        return "dense"
    if policy.decode == "append":
        return "append"
    return "evict" if evict else "no-evict"


@dataclass(frozen=True)
class CacheSpec:
    """What one layer's buffer is, fixed at setup (None fields take the default named beside them)."""
    batch: int
    kv_heads: int
    head_dim: int
    budget: int  # the slots held; the buffer has budget + block
    block: int  # the most tokens one step writes (the tail)
    mode: str | None = None  # MODES (None: cache_mode(policy))
    policy: Any = None  # None: full
    dtype: torch.dtype = torch.float32  # the compute dtype
    storage: torch.dtype | None = None  # K and V as stored (Storage): None (the compute dtype), int8 or bfloat16
    device: Any = "cpu"
    n_heads: int | None = None  # query heads (kv_heads)
    window: int | None = None  # sliding-window attention (Mistral): the latest positions a query sees
    layer: int = 0  # this layer's index in the model
    keep: int | None = None  # the prompt slots a one-shot compression into this cache keeps (budget)
    keep_budget: int | None = None  # the budget a recent window is a fraction of (budget; a scratch: its layer's)
    evict_first: bool = False  # --evict-before-attend: evict, then attend over the kept slots only
    head0: int = 0  # tensor parallel (tp.py): the model's index of this buffer's first KV head
    tp_group: str | None = None  # the group a rule that reads every head of a layer gathers over (None: one device)

    def __post_init__(self):
        defaults = dict(mode=cache_mode(self.policy), n_heads=self.kv_heads, keep=self.budget,
                        keep_budget=self.budget)
        for name, value in defaults.items():
            if not getattr(self, name):
                object.__setattr__(self, name, value)
        if self.mode not in MODES:
            raise ValueError(f"cache mode {self.mode!r} is none of {', '.join(MODES)}")


class KVCache(nn.Module):
    """One layer's static buffer, built from a CacheSpec and driven by its policy (None for `full`): a scorer
    (`score`) evicts, a selector (`select`) picks the slots each decode step attends; a policy may be both
    (RocketKV, SAGE-KV). The spec's mode says where a block is written and whether the scorer evicts (MODES)."""

    # Attributes no compiled step reads (the policy's plan is the policy's own attributes): aoti.step_key leaves them
    # out of a package's name, so that a prompt of another length loads the same package.
    UNTRACED = ("run", "last_step", "eager")

    def __init__(self, spec: CacheSpec):
        super().__init__()
        self.spec, self.policy, self.storage = spec, spec.policy, Storage(spec.dtype, spec.storage)
        self.scorer = spec.policy if is_scorer(spec.policy) else None
        self.selector = spec.policy if is_selector(spec.policy) and spec.mode != "scratch" else None
        self.run = None  # the policies.Run that engine.setup planned the policy for (a batch re-plans per prompt)
        self.last_step = None  # a scratch's last block (q, input_pos, query_pos): its queries score the compression
        self.eager = None  # fill_eagerly's [next slot, end, one mask] while the caller runs blocks eagerly
        shape = (spec.batch, spec.kv_heads, spec.budget + spec.block)
        for name, t in self.storage.allocate((*shape, spec.head_dim), spec.device).items():
            self.register_buffer(name, t)
        self.register_buffer("pos", torch.full(shape, -1, dtype=torch.int32, device=spec.device))
        # Per-slot policy state (e.g. H2O's accumulated attention) moves with its slot on eviction; per-layer state
        # (e.g. SnapKV's ring of recent queries) stays put. Policies declare both; they are allocated here, once.
        self._state_names, decl = [], {}
        if self.scorer is not None:
            for name, (extra, dtype) in spec.policy.slot_state().items():
                extra = [spec.n_heads // spec.kv_heads if d == "group" else d for d in extra]
                self.register_buffer(f"state_{name}", torch.zeros(*shape, *extra, dtype=dtype, device=spec.device))
                self._state_names.append(name)
            decl.update(spec.policy.layer_state(spec))
        if self.selector is not None:
            decl.update(spec.policy.selector_state(spec))
        for name, (size, dtype, fill) in decl.items():
            self.register_buffer(f"layer_{name}", torch.full(size, fill, dtype=dtype, device=spec.device))
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

    def kv_buffers(self) -> list[Tensor]:
        """The key and value buffers as stored (and their int8 scales)."""
        return [self.k, self.v, *([self.k_scale, self.v_scale] if self.storage.scaled else [])]

    def slot_buffers(self) -> list[Tensor]:
        """Every [B, H, C, ...] tensor whose slots move together: keys, values (+ their int8 scales), policy state."""
        return [*self.kv_buffers(), *self.state.values()]

    def rows(self, name: str, S: int | None = None) -> tuple[Tensor, Tensor | None]:
        """Buffer `name` ("k" or "v") as stored, its first S slots (all when None), and their scales (None unless
        int8)."""
        scale = getattr(self, f"{name}_scale")[:, :, :S] if self.storage.scaled else None
        return getattr(self, name)[:, :, :S], scale

    def keys(self, S: int | None = None) -> Tensor:
        """Keys of the first S slots (all when None) in the compute dtype."""
        return self.storage.decode(*self.rows("k", S))

    def values(self, S: int | None = None) -> Tensor:
        return self.storage.decode(*self.rows("v", S))

    def reset(self) -> None:
        self.pos.fill_(-1)
        for t in self.state.values():
            t.zero_()
        for name, (_, _, fill) in self._layer_state_decl.items():
            self.layer_state[name].fill_(fill)

    def forget_from(self, position: int) -> None:
        """Forget every token at a position >= `position`: its slots become empty (pos -1) and a per-layer ring of
        positions (`*_pos` layer state: SnapKV's query ring) forgets it too; what it made a policy evict or
        accumulate stays. Static-shaped, on the device (speculative.py's rollback of rejected drafts; chat.py: a
        step cut short by an exception). An evicting cache's empty slot is the first dropped at its next step; an
        appending cache's valid slots still fill [0, n) in position order."""
        self.pos.masked_fill_(self.pos >= position, -1)
        for name, t in self.layer_state.items():
            if name.endswith("_pos"):
                t.masked_fill_(t >= position, -1)

    def slots(self, T: int) -> int:
        """How many leading slots a step of T tokens reads: the budget and the block's tail (a cache that does not
        evict holds every real token below `budget`: its tail only ever holds padding)."""
        return self.spec.budget + T

    def view(self, S: int | None = None, **step) -> View:
        return View(self, self.k.shape[2] if S is None else S, **step)

    def read_tokens(self) -> float:
        """Token-equivalents (K+V pairs) one decode step reads per KV head: the slots attended, or what a
        selector reads (RocketKV: exact top-k plus its page scan)."""
        n = self.selector.read_tokens(self.view(self.spec.budget)) if self.selector is not None else None
        return self.slots(1) if n is None else n

    def destinations(self, input_pos: Tensor) -> Tensor:
        """The slots [1 or B, T] a block at positions input_pos ([T] or [B, T], -1 = padding) is written to: the
        tail (evict, no-evict: the same slots in every sequence), slot == position (dense), or after each sequence's
        valid slots (append, scratch); padding goes to the tail, which no real position reaches."""
        ip, budget = per_row(input_pos), self.spec.budget
        T = ip.shape[1]
        tail = torch.arange(budget, budget + T, device=ip.device)
        if self.spec.mode in ("evict", "no-evict"):
            return tail[None]
        if self.spec.mode == "dense":
            return torch.where(ip >= 0, ip, tail)
        n = (self.pos[:, 0, :budget] >= 0).sum(-1, keepdim=True)  # the valid slots fill [0, n) in order
        return torch.where(ip >= 0, n + torch.arange(T, device=ip.device), tail)

    def fill_eagerly(self, start: int, end: int, one_mask: bool = True) -> None:
        """The caller's choice for blocks it runs eagerly (never in a compiled step), filling slots from `start` in
        order up to `end`: a block of T > 1 attends only the slots filled so far (a causal triangle's cost, not the
        buffer's), with one mask for all heads when they hold the same positions (one_mask). eager = None: off."""
        self.eager = [start, end, one_mask]

    def update(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor, query_pos: Tensor):
        """Write a block k, v [B, H, T, D] at positions input_pos [T] (shared by the batch) or [B, T] (each sequence
        its own; -1 = padding); return what to attend: keys and values as stored (model.attention widens a
        bfloat16 cache), int8 dequantized. With evict_first the policy evicts first and the block attends over the
        kept slots only."""
        B, H, T = k.shape[:3]
        dst = self.destinations(input_pos)
        for name, x in (("k", k), ("v", v)):
            rows, scale = self.storage.encode(x)
            write_slots(getattr(self, name), dst, rows)
            if scale is not None:
                write_slots(getattr(self, f"{name}_scale"), dst, scale)
        write_slots(self.pos, dst, per_row(input_pos).to(torch.int32)[:, None, :].expand(B, H, T))
        for t in self.state.values():  # a new token starts with zero state
            write_slots(t, dst, 0)
        S, one_mask = self.slots(T), False
        if self.eager is not None:
            self.eager[0] += T
            if T > 1:
                S, one_mask = min(S, *self.eager[:2]), self.eager[2]
        if self.spec.evict_first:
            self._evict(q, input_pos, query_pos)
        if T == 1 and self.selector is not None:  # decode: the selector picks the slots
            slot = dst[0] if dst.shape[0] == 1 else dst
            view = self.view(self.spec.budget, q=q, input_pos=input_pos, query_pos=query_pos, slot=slot)
            idx = self.selector.select(view)
            if idx is not None:
                return self.gather(idx, query_pos)
        pos = self.pos[:, :, :S]  # one mask [B, 1, T, S] for all heads where they agree (model.py: GQA)
        keys, values = (self.storage.decode(*self.rows(name, S), widen=False) for name in ("k", "v"))
        return keys, values, attention_mask(pos[:, :1] if one_mask else pos, query_pos, self.spec.window)

    def gather(self, idx: Tensor, query_pos: Tensor):
        """Keys, values [B, Hs, k, D] (as `update` returns them) and mask [B, Hs, 1, k] of slots idx [B, Hs, k]; Hs =
        the KV heads (one selection per group) or the query heads (one per head; model.py then attends per query
        head)."""
        B, H, C, D = self.k.shape
        g, n = idx.shape[1] // H, idx.shape[2]
        flat = flat_rows(idx.view(B, H, g * n), C)

        def take(t, *row):
            return t.view(B * H * C, *row).index_select(0, flat).view(B, H * g, n, *row)
        k, v = (self.storage.decode(take(t, D), None if s is None else take(s), widen=False)
                for t, s in (self.rows("k"), self.rows("v")))
        return k, v, attention_mask(take(self.pos), query_pos, self.spec.window)

    def evict(self, q: Tensor, input_pos: Tensor, query_pos: Tensor) -> None:
        """After attention (the default order): score the budget + T slots and drop the lowest T."""
        if not self.spec.evict_first:
            self._evict(q, input_pos, query_pos)

    def _evict(self, q, input_pos, query_pos):
        if self.scorer is None or self.spec.mode not in ("evict", "scratch"):
            return
        view = self.view(self.slots(q.shape[2]), q=q, input_pos=input_pos, query_pos=query_pos)
        self.scorer.observe(view)
        if self.spec.mode == "scratch":  # one-shot prefill scores the whole prompt with its last block (compress_into)
            self.last_step = (q, input_pos, query_pos)
        else:
            self.drop_to(self.spec.budget, self.scorer.score(view))

    def drop_to(self, budget: int, scores: Tensor) -> None:
        """Keep the `budget` best of the first scores.shape[-1] slots (empty slots are never kept over real ones)."""
        S = scores.shape[-1]
        scores = scores.float().masked_fill(self.pos[:, :, :S] < 0, float("-inf"))
        evict_fill_holes(scores, budget, self.slot_buffers(), self.pos)

    def n_valid(self) -> Tensor:
        return (self.pos >= 0).sum(-1)


def compress_into(scratch: KVCache, dst: KVCache, shared: dict | None = None) -> None:
    """One-shot prefill: `scratch` holds a whole prompt (in position order); keep dst.spec.keep of it in dst.

    The policy either names the scratch slots to keep (`keep_slots(view)` -> [B, H, n], a layout of its own:
    SAGE-KV) or scores them (the last block's queries stand for the prompt's end) and the keep best are
    kept, then sorted by position. Then a selector prepares its decode-time state (`prepare`: RocketKV's pages).
    """
    S, policy, keep = scratch.spec.budget, dst.policy, dst.spec.keep
    view = View(scratch, S, *scratch.last_step, shared=shared, budget=dst.spec.keep_budget, keep=keep)
    pairs = [(scratch.pos, dst.pos), *zip(scratch.slot_buffers(), dst.slot_buffers(), strict=True)]
    idx = policy.keep_slots(view)
    if idx is not None:
        n = idx.shape[-1]
        for src_t, dst_t in pairs:
            dst_t[:, :, :n] = take_slots(src_t, idx)
        dst.pos[:, :, n:] = -1
    else:
        n_real = int(scratch.n_valid().max())
        scores = policy.score(view)  # scored even when all fits: a policy may record what it keeps (K-VEC)
        if n_real > keep:
            scratch.drop_to(keep, scores)
        n = min(S, keep)
        for src_t, dst_t in pairs:
            dst_t[:, :, :n] = src_t[:, :, :n]
        sort_slots(dst, n)
    for name, t in scratch.layer_state.items():
        if name in dst.layer_state:
            dst.layer_state[name].copy_(t)
    if dst.selector is not None:
        dst.selector.prepare(dst.view(dst.spec.budget))


def sort_slots(cache: KVCache, n: int) -> None:
    """Permute the first n slots of a cache (and their state) into ascending position order, empty slots last (so
    that appending at the valid count stays correct), e.g. after compress_into."""
    order = position_order(cache.pos[:, :, :n])
    for buf in [cache.pos, *cache.slot_buffers()]:
        extra = buf.shape[3:]
        idx = order.view(*order.shape, *([1] * len(extra))).expand(*order.shape, *extra)
        buf[:, :, :n] = buf[:, :, :n].gather(2, idx)


def row_cache(cache: KVCache, b: int) -> KVCache:
    """Sequence b of a batch cache as a batch-1 cache whose every buffer (K, V, positions, per-slot and per-layer
    state, all batch-first) is a view of row b: what is written to it lands in the batch buffer. A one-shot
    prefill compresses each sequence of a batch through one (engine.prefill_one_shot)."""
    row = copy.copy(cache)
    row._buffers = {name: t[b:b + 1] for name, t in cache._buffers.items()}  # state, layer_state read these
    return row


def scratch_cache(cache: KVCache, slots: int, end: int) -> KVCache:
    """A one-shot prefill's scratch for the layer cache `cache`: one sequence, `slots` slots in mode scratch (the
    policy's prefill state, no selector). The caller runs its blocks eagerly (model.prefill_layer_major): they
    fill it from slot 0 up to `end` (fill_eagerly)."""
    spec = cache.spec
    scratch = KVCache(replace(spec, batch=1, budget=slots, mode="scratch", keep=None, keep_budget=spec.budget,
                              evict_first=False))
    scratch.fill_eagerly(0, end)
    return scratch


@contextmanager
def eager_blocks(model, start: int, end: int, eager: bool = True):
    """While the caller runs blocks eagerly (eager=True: its own choice, never for a compiled step) over the model's
    caches of mode dense (slot == position), from position `start` up to `end` (padding only past it): each block
    attends only the slots filled so far (fill_eagerly). Every head of such a cache holds the same positions: one
    mask for all. Other caches keep the static budget + T."""
    caches = [layer.attention.kv_cache for layer in model.layers]
    for c in caches if eager and all(c.spec.mode == "dense" for c in caches) else []:
        c.fill_eagerly(start, end)
    try:
        yield
    finally:
        for c in caches:
            c.eager = None


def take_rows(x: Tensor, slot: Tensor) -> Tensor:
    """x[b, h, slot[j]] for x [B, H, C, ...] and slots [n] (the same in every sequence) or [B, n]: [B, H, n, ...]."""
    if slot.dim() == 1:
        return x.index_select(2, slot)
    return take_slots(x, slot[:, None, :].expand(-1, x.shape[1], -1))


def take_slots(x: Tensor, idx: Tensor) -> Tensor:
    """x[b, h, idx[b, h, j]] for x [B, H, C, ...] and idx [B, H, n]: whole slots, one index_select over the flat
    rows (on CPU cheaper than torch.gather, which indexes element by element)."""
    B, H, C = x.shape[:3]
    return x.reshape(B * H * C, *x.shape[3:]).index_select(0, flat_rows(idx, C)).view(B, H, idx.shape[-1], *x.shape[3:])


def setup_caches(model, batch: int, budget: int, block_size: int, policy=None, evict_before_attend=False,
                 kv_dtype: torch.dtype | None = None, keep: int | None = None, evict: bool = True) -> None:
    """Attach a fresh KVCache to every attention layer of `model` (kv_dtype: the buffer's storage, int8 or
    bfloat16; None: the model's dtype).
    keep: the prompt slots a one-shot compression keeps (default budget); evict=False: the `no-evict` baseline,
    the same buffer with eviction switched off."""
    args, p = model.args, model.tok_embeddings.weight
    spec = CacheSpec(batch, args.n_kv_heads, args.head_dim, budget, block_size, cache_mode(policy, evict), policy,
                     p.dtype, kv_dtype, p.device, args.n_heads, args.sliding_window, keep=keep,
                     evict_first=evict_before_attend, head0=getattr(model, "kv_head0", 0),
                     tp_group=getattr(model, "tp_group", None))
    for i, layer in enumerate(model.layers):
        layer.attention.kv_cache = KVCache(replace(spec, layer=i))


def kv_bytes(model) -> int:
    """Bytes of the key and value buffers of all layers, int8 scales included (positions and policy state not)."""
    return sum(t.nbytes for layer in model.layers for t in layer.attention.kv_cache.kv_buffers())


def check_kv_dtype(kv_dtype):
    """kv_dtype as the caches' storage: None (the compute dtype), torch.int8 or a float dtype; UserError naming it."""
    if kv_dtype is not None and not (isinstance(kv_dtype, torch.dtype) and
                                     (kv_dtype == torch.int8 or kv_dtype.is_floating_point)):
        raise UserError(f"kv_dtype={kv_dtype!r} is not None, torch.int8 or a float torch.dtype (generate_text and "
                        "the command line take the names)")
    return kv_dtype


def run_caches(run, model) -> list:
    """Every layer's cache that `run` (an engine.Generation) reads on `model`, and on a Speculation's draft model:
    what its setup() made, and check_set_up compares with what the models hold."""
    models = [model] + ([run.draft] if getattr(run, "draft", None) is not None else [])
    return [getattr(layer.attention, "kv_cache", None) for m in models for layer in m.layers]


def check_set_up(run, model, prompts: list | None = None) -> None:
    """UserError unless the models hold the caches run.setup() made (not set up yet, or replaced since by another
    run or Chat on the same model: they would be read with another run's plan) and `prompts` are the prompts they
    were planned for (their count and lengths: SAGE-KV's layout, RocketKV's read are sized from them)."""
    made, lens = run.set_up or (None, None)
    now = run_caches(run, model)
    if made is None or len(now) != len(made) or any(a is not b for a, b in zip(now, made)):
        raise UserError("model= does not hold this run's caches: call setup(model) first (again after another run "
                        "or Chat set up caches on the same model)")
    if prompts is not None and [len(p) for p in prompts] != lens:
        raise UserError(f"prompts= of {[len(p) for p in prompts]} tokens, but setup() planned the caches for prompts "
                        f"of {lens} tokens: make a run for these prompts")
