"""KV-cache policies: each scores the slots of one layer; cache.py keeps the `budget` best and moves them.

A policy's `score(cache, q, input_pos, query_pos, S)` returns fp32 [batch, n_kv_heads, S] over the first S slots
(the kept tokens plus the block just written). Higher = keep, +inf = protected; empty slots are set to -inf by
cache.py. `observe` updates policy state before scoring (H2O's running sums, SnapKV's query ring). q is the
block's post-RoPE queries [batch, n_heads, T, head_dim]; input_pos [T] their positions (-1 = padding).
Every rule is a static-shaped tensor op so that a step compiles with fullgraph=True.
Rules and defaults follow shared/specs/keydiff.md (sections 1, 3 and 7), which the docstrings cite.
"""
import torch
import torch.nn.functional as F
from torch import Tensor

from cache import attention_weights

INF = float("inf")


class PolicyError(ValueError):
    """An unknown policy or parameters that cannot work; the message is one line for the user."""


class Policy:
    name = ""
    help = ""

    def __init__(self, args=None):
        self.args = args

    def param(self, name, default):
        return getattr(self.args, name, default) if self.args is not None else default

    def slot_state(self) -> dict:
        """Per-slot state moved with its slot: name -> (extra shape, dtype)."""
        return {}

    def layer_state(self, cache) -> dict:
        """Per-layer state that stays put: name -> (shape, dtype, fill value)."""
        return {}

    def check(self, budget: int, block_size: int) -> None:
        """Raise PolicyError for parameters that cannot work with this budget and block size."""

    def observe(self, cache, q: Tensor, input_pos: Tensor, query_pos: Tensor, S: int) -> None:
        """Update policy state with this block (before scoring)."""

    def score(self, cache, q: Tensor, input_pos: Tensor, query_pos: Tensor, S: int) -> Tensor:
        raise NotImplementedError


def protect_recent(scores: Tensor, slot_pos: Tensor, query_pos: Tensor, n_recent: int) -> Tensor:
    """+inf on the slots holding the `n_recent` latest positions seen so far (query_pos.max() is the newest)."""
    if n_recent <= 0:
        return scores
    return scores.masked_fill(slot_pos > query_pos.max() - n_recent, INF)


def last_query(q: Tensor, input_pos: Tensor, query_pos: Tensor) -> tuple[Tensor, Tensor]:
    """The block's last real query [B, Hq, 1, D] and its position [1]."""
    last = (input_pos >= 0).sum().sub(1).reshape(1)
    return q.index_select(2, last), query_pos.index_select(0, last)


class WindowMixin:
    """`--window-frac p`: the floor(p * budget) most recent tokens are always kept (KeyDiff + SW, spec 1.8)."""

    def n_recent(self, cache) -> int:
        return int(self.param("window_frac", 0.0) * cache.budget)

    def check(self, budget, block_size):
        p = self.param("window_frac", 0.0)
        if not 0.0 <= p < 1.0:
            raise PolicyError(f"--window-frac must be in [0, 1), got {p}")


class KeyDiff(WindowMixin, Policy):
    """KeyDiff (Park et al., arXiv 2504.15364, Eq. 8 and section 3.2): keep the keys least similar to the anchor.

    score_j = -cos(k_j, mu), mu = mean of the raw post-RoPE keys of the head (cache + block): the paper's
    experimental choice (spec 1.4; `--anchor normalized` = mean of unit keys = Eq. 7's ranking = kvpress).
    Never reads queries or attention weights, so attention stays SDPA/flash. Optional recent window.
    """
    name = "keydiff"
    help = "key diversity: -cos(key, mean key); --anchor raw|normalized, --window-frac"

    def check(self, budget, block_size):
        super().check(budget, block_size)
        if self.param("anchor", "raw") not in ("raw", "normalized"):
            raise PolicyError(f"--anchor must be raw or normalized, got {self.param('anchor', 'raw')!r}")

    def score(self, cache, q, input_pos, query_pos, S):
        pos = cache.pos[:, :, :S]
        k = cache.k[:, :, :S].float()
        norms = k.norm(dim=-1).clamp_min(1e-8)
        src = k if self.param("anchor", "raw") == "raw" else k / norms[..., None]
        valid = (pos >= 0)[..., None].float()
        mu = (src * valid).sum(-2) / valid.sum(-2).clamp_min(1.0)
        cos = (k @ mu[..., None])[..., 0] / (norms * mu.norm(dim=-1, keepdim=True).clamp_min(1e-8))
        return protect_recent(-cos, pos, query_pos, self.n_recent(cache))


class KeyNorm(Policy):
    """KeyL2Norm (Devoto et al. 2024; KeyDiff spec section 3): keep the keys with the smallest L2 norm."""
    name = "keynorm"
    help = "keep the smallest key L2 norms"

    def score(self, cache, q, input_pos, query_pos, S):
        return -cache.k[:, :, :S].float().norm(dim=-1)


class Sink(Policy):
    """StreamingLLM (Xiao et al. 2023): the first `--n-sink` positions (4) plus the most recent tokens.
    Positions are not re-assigned inside the cache (spec 3, decision 8)."""
    name = "sink"
    help = "attention sinks + recent window; --n-sink (4)"

    def check(self, budget, block_size):
        n = self.param("n_sink", 4)
        if n < 0 or budget <= n:
            raise PolicyError(f"--budget {budget} must exceed the {n} sink tokens (and --n-sink >= 0)")

    def score(self, cache, q, input_pos, query_pos, S):
        pos = cache.pos[:, :, :S]
        sink = (pos >= 0) & (pos < self.param("n_sink", 4))
        return pos.float().masked_fill(sink, INF)


class TOVA(Policy):
    """TOVA (Oren et al. 2024), block-wise as in KeyDiff App. F.2: the attention of the block's last query,
    averaged over the query heads of each KV group (not over all heads), evicted per KV head.

    Two options reproduce kvpress's TOVAPress (tests/test_kvpress.py), which differs from this default:
    `--tova-heads all` averages over all query heads of the layer and gives every KV head that one score, so the
    heads keep one shared set (the official TOVA code, src/tova_cache.py, and kvpress do this). Every head then
    evicts identically from identical slot layouts, so slot s holds the same position in every head and the
    per-slot mean over KV heads is the mean over positions. `--tova-keep-last` always keeps the newest position
    (kvpress pads the last token's score with max + 1; the paper and the official code do not protect it).
    """
    name = "tova"
    help = "attention of the last query, group mean; --tova-heads group|all, --tova-keep-last"

    def check(self, budget, block_size):
        if self.param("tova_heads", "group") not in ("group", "all"):
            raise PolicyError(f"--tova-heads must be group or all, got {self.param('tova_heads', 'group')!r}")

    def score(self, cache, q, input_pos, query_pos, S):
        q_last, p_last = last_query(q, input_pos, query_pos)
        w = attention_weights(cache, q_last, p_last, S)[:, :, 0]  # [B, H_kv, S], mean over each group
        if self.param("tova_heads", "group") == "all":  # groups are equal-sized: mean of group means = mean
            w = w.mean(1, keepdim=True).expand_as(w).contiguous()
        return protect_recent(w, cache.pos[:, :, :S], query_pos, 1 if self.param("tova_keep_last", False) else 0)


class H2O(WindowMixin, Policy):
    """H2O (Zhang et al. 2023) as used by KeyDiff/CAOTE (spec 3, decisions 12-13): raw running sum of the group-mean
    attention each slot received from every query since it entered, current block included; no recent window
    by default (`--window-frac` adds one, as in the original H2O)."""
    name = "h2o"
    help = "accumulated attention (heavy hitters); --window-frac"

    def slot_state(self):
        return {"acc": ((), torch.float32)}

    def observe(self, cache, q, input_pos, query_pos, S):
        acc = cache.state["acc"]
        acc[:, :, :S] += attention_weights(cache, q, input_pos, S).sum(2)  # padding rows (-1) weigh nothing

    def score(self, cache, q, input_pos, query_pos, S):
        return protect_recent(cache.state["acc"][:, :, :S].clone(), cache.pos[:, :, :S], query_pos,
                              self.n_recent(cache))


class SnapKV(Policy):
    """SnapKV (Li et al. 2024), block-wise as in KeyDiff (spec 3, decisions 15-16): the last `--snap-window` (32)
    queries vote with their attention; votes are average-pooled (kernel 7, stride 1, zero padding counted) along
    the candidates in position order; the window's own tokens are always kept. The last queries live in a ring
    per layer, so decode steps (one query) still vote with 32."""
    name = "snapkv"
    help = "observation-window attention, pooled; --snap-window (32), --snap-kernel (7)"

    def window(self):
        return self.param("snap_window", 32)

    def check(self, budget, block_size):
        w, k = self.window(), self.param("snap_kernel", 7)
        if w < 1 or k < 1 or k % 2 == 0:
            raise PolicyError(f"--snap-window must be >= 1 and --snap-kernel odd, got {w} and {k}")
        if budget <= w:
            raise PolicyError(f"--budget {budget} must exceed the SnapKV observation window ({w})")

    def layer_state(self, cache):
        B, H, _, D = cache.k.shape
        return {"ring_q": ((B, cache.n_heads, self.window(), D), torch.float32, 0.0),
                "ring_pos": ((self.window(),), torch.long, -1)}

    def observe(self, cache, q, input_pos, query_pos, S):
        """Keep the `window` latest queries of ring + block (the top positions; padding is -1)."""
        ring_q, ring_pos = cache.layer_state["ring_q"], cache.layer_state["ring_pos"]
        cand_pos = torch.cat([ring_pos, input_pos.long()])
        newest = cand_pos.topk(self.window()).indices
        ring_q.copy_(torch.cat([ring_q, q.float()], dim=2).index_select(2, newest))
        ring_pos.copy_(cand_pos.index_select(0, newest))

    def score(self, cache, q, input_pos, query_pos, S):
        pos = cache.pos[:, :, :S]
        ring_q, ring_pos = cache.layer_state["ring_q"], cache.layer_state["ring_pos"]
        votes = attention_weights(cache, ring_q, ring_pos, S).sum(2)
        window = pos > query_pos.max() - self.window()
        votes = votes.masked_fill(window, 0.0)  # the window is excluded from pooling (zero padding at its edge)
        order = pos.argsort(dim=-1)  # position order; empty slots (-1, zero votes) first act as padding
        k = self.param("snap_kernel", 7)
        B, H, _ = votes.shape
        pooled = F.avg_pool1d(votes.gather(-1, order).view(B * H, 1, S), k, 1, k // 2, count_include_pad=True)
        return torch.zeros_like(votes).scatter(-1, order, pooled.view(B, H, S)).masked_fill(window, INF)


class RandomScores(Policy):
    """A seeded hash of (position, head): the floor every real policy must beat, and a neutral scorer for testing
    the cache mechanics. Static and deterministic (no RNG state), so compiled == eager."""
    name = "random"
    help = "seeded random eviction (--seed)"

    def score(self, cache, q, input_pos, query_pos, S):
        pos = cache.pos[:, :, :S].double()
        head = torch.arange(pos.shape[1], device=pos.device, dtype=torch.float64)[None, :, None]
        x = torch.sin(pos * 12.9898 + head * 78.233 + self.param("seed", 0) * 37.719) * 43758.5453
        return (x - x.floor()).float()


REGISTRY = {p.name: p for p in [KeyDiff, Sink, TOVA, SnapKV, H2O, KeyNorm, RandomScores]}


def describe() -> str:
    return "full (no eviction); " + "; ".join(f"{n} ({p.help})" for n, p in REGISTRY.items())


def lookup(name: str):
    """The policy class for `name`, None for full; unknown names raise a one-line error."""
    if name == "full":
        return None
    if name not in REGISTRY:
        raise PolicyError(f"unknown policy {name!r}; known: full, {', '.join(REGISTRY)}")
    return REGISTRY[name]
