"""KV-cache policies: each scores the slots of one layer; cache.py keeps the `budget` best and moves them.

A policy's `score(cache, q, input_pos, query_pos, S)` returns fp32 [batch, n_kv_heads, S] over the first S slots
(the kept tokens plus the block just written). Higher = keep, +inf = protected; empty slots are set to -inf by
cache.py. `observe` updates policy state before scoring (H2O's running sums, SnapKV's query ring). q is the
block's post-RoPE queries [batch, n_heads, T, head_dim]; input_pos [T] their positions (-1 = padding).
Every rule is a static-shaped tensor op so that a step compiles with fullgraph=True.
Rules and defaults follow shared/specs/keydiff.md (sections 1, 3 and 7), which the docstrings cite; SnapKV++,
RocketKV and Exact-TopK follow shared/specs/rocketkv.md. Those three are compress-once (`evicts = False`): `plan`
sizes them from the prompt length, and RocketKV / Exact-TopK pick the decode step's slots with `select`.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from cache import attention_mask, attention_weights, drop_lowest, position_order

INF = float("inf")


class PolicyError(ValueError):
    """An unknown policy or parameters that cannot work; the message is one line for the user."""


class Policy:
    name = ""
    help = ""
    evicts = True  # False: compress once (one-shot prefill), then only append (SnapKV++, RocketKV, Exact-TopK)
    one_shot = False  # True: the protocol is a dense prefill then one compression (generate.py defaults to it)

    def __init__(self, args=None):
        self.args = args

    def param(self, name, default):
        return getattr(self.args, name, default) if self.args is not None else default

    def slot_state(self) -> dict:
        """Per-slot state moved with its slot: name -> (extra shape, dtype); "group" in the shape stands for the
        query heads per KV head (per-query-head state)."""
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

    def plan(self, budget: int, prompt_len: int, max_new_tokens: int, model_args=None) -> int:
        """Size the run once its prompt length is known; returns the cache budget (slots kept per KV head)."""
        return budget

    def prompt_slots(self, cache) -> int:
        """How many prompt tokens a one-shot compression keeps (the rest of the budget is left for new tokens)."""
        return cache.budget

    def compress(self, scratch, cache) -> bool:
        """One-shot prefill: write the kept prompt tokens of `scratch` (the whole prompt, dense, with its last
        step's queries in scratch.last_step) into `cache` with a layout of the policy's own and return True; the
        default returns False and cache.compress_into keeps prompt_slots(cache) slots by `score`."""
        return False

    def compressed(self, cache, n: int) -> None:
        """After a one-shot compression wrote n slots into cache (e.g. sort them, build decode-time state)."""

    def select(self, cache, q: Tensor, query_pos: Tensor, slot: Tensor) -> Tensor | None:
        """Decode-time sparse attention: slot indices [B, H_kv or H_q, k] the query attends (the new token, just
        written at `slot`, is a candidate), or None for dense attention over the cache."""
        return None

    def read_tokens(self, cache) -> float | None:
        """Token-equivalents one decode step reads per KV head when it differs from the slots attended."""
        return None


def protect_recent(scores: Tensor, slot_pos: Tensor, query_pos: Tensor, n_recent: int) -> Tensor:
    """+inf on the slots holding the `n_recent` latest positions seen so far (query_pos.max() is the newest)."""
    if n_recent <= 0:
        return scores
    return scores.masked_fill(recent_mask(slot_pos, query_pos, n_recent), INF)


def recent_mask(slot_pos: Tensor, query_pos: Tensor, n_recent: int) -> Tensor:
    """True on the slots holding the `n_recent` latest positions seen so far (the ones protect_recent protects)."""
    return slot_pos > query_pos.max() - n_recent


def last_query(q: Tensor, input_pos: Tensor, query_pos: Tensor) -> tuple[Tensor, Tensor]:
    """The block's last real query [B, Hq, 1, D] and its position [1]."""
    last = (input_pos >= 0).sum().sub(1).reshape(1)
    return q.index_select(2, last), query_pos.index_select(0, last)


class WindowMixin:
    """`--window-frac p`: the floor(p * budget) most recent tokens are always kept (KeyDiff + SW, spec 1.8)."""

    def n_recent(self, cache) -> int:
        return int(self.param("window_frac", 0.0) * cache.keep_budget)

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

    def cosine(self, cache, S):
        """cos(k_j, mu) [B, H, S] of the first S slots."""
        pos = cache.pos[:, :, :S]
        k = cache.keys(S).float()
        norms = k.norm(dim=-1).clamp_min(1e-8)
        src = k if self.param("anchor", "raw") == "raw" else k / norms[..., None]
        valid = (pos >= 0)[..., None].float()
        mu = (src * valid).sum(-2) / valid.sum(-2).clamp_min(1.0)
        return (k @ mu[..., None])[..., 0] / (norms * mu.norm(dim=-1, keepdim=True).clamp_min(1e-8))

    def score(self, cache, q, input_pos, query_pos, S):
        return protect_recent(-self.cosine(cache, S), cache.pos[:, :, :S], query_pos, self.n_recent(cache))

    def head_scores(self, cache, q, input_pos, query_pos, S):
        """For CAOTE: 1 - cos >= 0 (CAOTE spec A8's affine map), the same for every query head of a group."""
        h = 1.0 - self.cosine(cache, S)
        G = cache.n_heads // h.shape[1]
        return h[:, :, None].expand(-1, -1, G, -1), recent_mask(cache.pos[:, :, :S], query_pos, self.n_recent(cache))


class KeyNorm(Policy):
    """KeyL2Norm (Devoto et al. 2024; KeyDiff spec section 3): keep the keys with the smallest L2 norm."""
    name = "keynorm"
    help = "keep the smallest key L2 norms"

    def score(self, cache, q, input_pos, query_pos, S):
        return -cache.keys(S).float().norm(dim=-1)


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

    def head_scores(self, cache, q, input_pos, query_pos, S):
        """For CAOTE: each query head's own last-row attention [B, H, G, S] (sums to 1: CAOTE's exact case)."""
        q_last, p_last = last_query(q, input_pos, query_pos)
        w = attention_weights(cache, q_last, p_last, S, group_mean=False)[:, :, :, 0]
        return w, recent_mask(cache.pos[:, :, :S], query_pos, 1 if self.param("tova_keep_last", False) else 0)


class H2O(WindowMixin, Policy):
    """H2O (Zhang et al. 2023) as used by KeyDiff/CAOTE (spec 3, decisions 12-13): raw running sum of the group-mean
    attention each slot received from every query since it entered, current block included; no recent window
    by default (`--window-frac` adds one, as in the original H2O)."""
    name = "h2o"
    help = "accumulated attention (heavy hitters); --window-frac"
    per_head = False  # CAOTE needs each query head's own sums: acc [B, H, C, G] instead of the group mean [B, H, C]

    def slot_state(self):
        return {"acc": (("group",) if self.per_head else (), torch.float32)}

    def observe(self, cache, q, input_pos, query_pos, S):
        acc = cache.state["acc"]
        w = attention_weights(cache, q, input_pos, S, group_mean=not self.per_head)  # padding rows (-1) weigh 0
        acc[:, :, :S] += w.sum(3).transpose(-1, -2) if self.per_head else w.sum(2)

    def score(self, cache, q, input_pos, query_pos, S):
        return protect_recent(cache.state["acc"][:, :, :S].clone(), cache.pos[:, :, :S], query_pos,
                              self.n_recent(cache))

    def head_scores(self, cache, q, input_pos, query_pos, S):
        return (cache.state["acc"][:, :, :S].transpose(-1, -2),
                recent_mask(cache.pos[:, :, :S], query_pos, self.n_recent(cache)))


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
        return pool_votes(window_votes(cache, S), cache.pos[:, :, :S], query_pos.max(), self.window(),
                          self.param("snap_kernel", 7), "avg")

    def head_scores(self, cache, q, input_pos, query_pos, S):
        """For CAOTE: each query head's pooled votes; the protected window keeps its raw votes, so that the
        pseudo-output X~ still counts the attention the window receives (CAOTE spec 1.6)."""
        votes = window_votes(cache, S, group_mean=False)  # [B, H, G, S]
        B, H, G, _ = votes.shape
        pos = cache.pos[:, :, :S]
        pooled = pool_votes(votes.reshape(B, H * G, S), pos.repeat_interleave(G, 1), query_pos.max(),
                            self.window(), self.param("snap_kernel", 7), "avg").view(B, H, G, S)
        win = recent_mask(pos, query_pos, self.window())
        return torch.where(win[:, :, None], votes, pooled), win


def window_votes(cache, S: int, group_mean: bool = True) -> Tensor:
    """Softmax attention of the ring's window queries over the first S slots (causal: each query sees positions up
    to its own), summed over the window queries, averaged over each KV group's query heads: [B, H_kv, S]
    (group_mean=False: per query head, [B, H_kv, G, S])."""
    ring_q, ring_pos = cache.layer_state["ring_q"], cache.layer_state["ring_pos"]
    return attention_weights(cache, ring_q, ring_pos, S, group_mean).sum(-2)


def pool_votes(votes: Tensor, pos: Tensor, newest: Tensor, window: int, kernel: int, pool: str) -> Tensor:
    """SnapKV's pooling of votes [B, H, S] along positions (stride 1, same length): `avg` (zero padding counted)
    or `max`. The window (the `window` newest positions) is excluded from the votes (zero, i.e. padding at its
    edge) and protected (+inf). Empty slots (position -1, zero votes) sort first and act as padding too; for max
    pooling of votes >= 0, zero padding equals -inf padding."""
    win = pos > newest - window
    votes = votes.masked_fill(win, 0.0)
    order = pos.argsort(dim=-1)
    B, H, S = votes.shape
    v = votes.gather(-1, order).view(B * H, 1, S)
    if pool == "avg":
        pooled = F.avg_pool1d(v, kernel, 1, kernel // 2, count_include_pad=True)
    else:
        pooled = F.max_pool1d(v, kernel, 1, kernel // 2)
    return torch.zeros_like(votes).scatter(-1, order, pooled.view(B, H, S)).masked_fill(win, INF)


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


# --------------------------------------------------------------------------------------------------------- CAOTE
# CAOTE (Goel et al., arXiv 2504.14051) as specified in shared/specs/caote.md: a modifier of any score-based policy.


def caote_scores(h: Tensor, v: Tensor, valid: Tensor, fast: bool = False) -> Tensor:
    """CAOTE's eviction error (paper Eq. 8, 21; spec 1.1-1.3, 1.5): if slot j alone left, the (pseudo) attention
    output of query head g would move by c_gj = h~_gj / (1 - h~_gj) * ||X~_g - v_j||, where h~ = the base scores
    h [B, H, G, S] (>= 0) normalised over the valid slots and X~_g = sum_j h~_gj v_j (the real output when h is an
    attention row: TOVA). FastCAOTE (Eq. 23): X~ = the plain mean of the valid values, shared by the group (A9).
    A group's errors combine as the L2 norm of their concatenation (spec 1.5, agg `l2`, A2): [B, H, S].
    Values v [B, H, S, D] fp32. ||X - v||^2 is expanded around the mean value (no [G, S, D] temporary; centring
    keeps the cancellation small when v_j is close to X)."""
    h = h * valid[:, :, None]
    hn = h / h.sum(-1, keepdim=True).clamp_min(1e-12)
    w = hn / (1 - hn).clamp_min(1e-6)
    n = valid.sum(-1)[..., None, None].clamp_min(1)
    vbar = (v * valid[..., None]).sum(2, keepdim=True) / n  # [B, H, 1, D]
    vc = (v - vbar) * valid[..., None]
    x = torch.zeros_like(vbar) if fast else hn @ vc  # centred X~: [B, H, 1 or G, D]
    d2 = (vc * vc).sum(-1)[:, :, None] - 2 * (x @ vc.transpose(-1, -2)) + (x * x).sum(-1, keepdim=True)
    c = w * d2.clamp_min(0).sqrt()
    return c.square().sum(2).sqrt()


class CAOTE(Policy):
    """CAOTE over a base policy (`--policy caote:h2o|tova|snapkv|keydiff`, `fastcaote:...`; paper 3.2-3.3):
    the base scores each query head's slots (`head_scores`: non-negative, plus the slots it protects), CAOTE
    re-ranks them by the error their eviction would cause in that head's attention output, and the lowest are
    dropped, each scored independently (paper App. A, spec A4). The base keeps its own state (H2O's sums, per query
    head here; SnapKV's query ring) and its protection (+inf). Block-wise, after each block and decode step, like
    the base. KeyDiff enters as 1 - cos (A8); SnapKV's protected window enters X~ with its raw votes.
    The bases are this engine's policies as the KeyDiff spec defines them, not CAOTE spec A7's block-wise SnapKV:
    `snapkv` keeps a ring of the last 32 queries across blocks and decode steps, average-pools (kernel 7) and
    protects its window, where A7 recommends the block's own min(32, block) queries (decode: the current row),
    max-pooling and no protection; results with caote:snapkv are therefore not the paper's SnapKV+CAOTE exactly.
    Ties keep the newer token (the engine's rule; the spec's base-score tie-break, A15, is not applied)."""
    base_cls = None
    fast = False

    def __init__(self, args=None):
        super().__init__(args)
        self.base = self.base_cls(args)
        self.base.per_head = True

    def slot_state(self):
        return self.base.slot_state()

    def layer_state(self, cache):
        return self.base.layer_state(cache)

    def check(self, budget, block_size):
        self.base.check(budget, block_size)
        if self.param("tova_heads", "group") != "group" and self.base.name == "tova":
            raise PolicyError(f"{self.name} scores each query head: --tova-heads all is not supported")

    def observe(self, cache, q, input_pos, query_pos, S):
        self.base.observe(cache, q, input_pos, query_pos, S)

    def score(self, cache, q, input_pos, query_pos, S):
        h, protected = self.base.head_scores(cache, q, input_pos, query_pos, S)
        c = caote_scores(h, cache.values(S).float(), cache.pos[:, :, :S] >= 0, self.fast)
        return c.masked_fill(protected, INF)


def caote_policies():
    """caote:<base> and fastcaote:<base> for every base the spec covers (and KeyDiff, its extension)."""
    out = []
    for base in [H2O, TOVA, SnapKV, KeyDiff]:
        for fast in (False, True):
            kind = "fastcaote" if fast else "caote"
            what = "mean-value " if fast else ""
            out.append(type(f"{kind}_{base.name}", (CAOTE,), dict(
                name=f"{kind}:{base.name}", base_cls=base, fast=fast,
                help=f"CAOTE ({what}attention-output error) over {base.name}'s scores")))
    return out


# ------------------------------------------------------------------------------------------------------- RocketKV
# RocketKV (Behnam et al., arXiv 2502.14051 v1) as specified in shared/specs/rocketkv.md: stage 1 SnapKV++ compresses
# the prompt once after a dense prefill (paper 3.3, spec 2); stage 2 hybrid attention picks k tokens of the kept cache
# at every decode step (paper 3.4, spec 3). Exact-TopK is the oracle (paper 4.1, spec 7). Ambiguities follow the
# spec's recommendations (section 10); each docstring names the ones it resolves.


def adaptive_kernel(prompt_len: int, model_args=None) -> int:
    """SnapKV++'s pooling kernel (paper 4.4.2, App. A.3; spec 2.3): 511 for long prompts, else 63. Thresholds
    compare T with 48*1024 for Llama-3.1 and 12*1024 for LongChat (A5); the model is told apart by its RoPE scaling
    (llama3 / linear x8); Mistral and unknown models (Qwen, SmolLM2) always get 63 (spec 2.3's recommendation)."""
    scaling = (getattr(model_args, "rope_scaling", None) or {}).get("rope_type")
    threshold = {"llama3": 48 * 1024, "linear": 12 * 1024}.get(scaling)
    return 511 if threshold is not None and prompt_len >= threshold else 63


@dataclass(frozen=True)
class RocketParams:
    """One run's static sizes (spec 4): storage C per KV head, prompt budget P = C - N, page size p, channels r,
    exact top-k k, pages Np = ceil(C / p). sparse=False when t >= S (c = 1: no compression, dense attention)."""
    S: int
    t: int
    D: int
    C: int
    P: int
    p: int
    r: int
    k: int
    Np: int
    sparse: bool = True

    @property
    def approx_tokens(self) -> float:
        """Token-equivalents of the page scan: r rows of Np (one of min/max per channel) over 2D per token."""
        return self.Np * self.r / (2 * self.D) if self.sparse else 0.0


def rocket_params(S: int, t: int, D: int, N: int, alpha="0.5") -> RocketParams:
    """Derive the run's sizes from S = prompt + new tokens, token budget t (per KV head per decode step, traffic incl.
    the approximation's reads), head_dim D and N new tokens, exactly as spec section 4:
    c = S/t; C = floor(S / c^a) (a = 0.5, v1's even split, A1; `icml` = a = min(0.2 + 0.06 log2 c, 0.8));
    C >= min(2N, S) (A2); P = C - N; c2 = C/t; p = min(floor(c2), ceil(sqrt(c2))); r = clamp(round(D p / c2), 1, D);
    k = round(t / 2) (A3). With a = 0.5, C = isqrt(S t) exactly (no float floor error)."""
    c = max(1.0, S / t)
    if c == 1.0:
        return RocketParams(S, t, D, C=S, P=S - N, p=1, r=D, k=S, Np=S, sparse=False)
    a = min(0.2 + 0.06 * math.log2(c), 0.8) if str(alpha) == "icml" else float(alpha)
    C = math.isqrt(S * t) if a == 0.5 else math.floor(S / c ** a)
    C = max(C, min(2 * N, S))
    c2 = max(1.0, C / t)
    p = min(math.floor(c2), math.ceil(math.sqrt(c2)))
    r = min(max(round(D * p / c2), 1), D)
    return RocketParams(S, t, D, C=C, P=C - N, p=p, r=r, k=min(round(t / 2), C), Np=-(-C // p))


def build_pages(k: Tensor, valid: Tensor, p: int) -> Tensor:
    """Per-page element-wise key min and max (paper 3.4, spec 3.2) of keys k [B, H, C, D] over pages of p slots,
    aligned to slot 0 (A8), only valid slots counted; stored channel-major: [B, H, 2D, Np], rows [0, D) = min,
    [D, 2D) = max. Pages with no valid slot hold 0 (never read: their tokens are masked)."""
    B, H, C, D = k.shape
    Np = -(-C // p)
    pad = Np * p - C
    inf = torch.tensor(INF, dtype=k.dtype, device=k.device)
    valid = F.pad(valid, (0, pad), value=False)[..., None]
    kp = F.pad(k, (0, 0, 0, pad))
    kmin = torch.where(valid, kp, inf).view(B, H, Np, p, D).amin(3)
    kmax = torch.where(valid, kp, -inf).view(B, H, Np, p, D).amax(3)
    empty = ~valid.view(B, H, Np, p).any(-1, keepdim=True)
    return torch.cat([kmin, kmax], -1).masked_fill(empty, 0.0).transpose(-1, -2)


def update_page(pages: Tensor, k_new: Tensor, slot: Tensor, p: int) -> None:
    """Fold the key k_new [B, H, 1, D] just written at slot [1] into page slot // p, in place (spec 3.3); the page's
    first slot overwrites min and max (A8: no +-inf arithmetic, same result)."""
    D = k_new.shape[-1]
    j = torch.div(slot, p, rounding_mode="floor").clamp_max(pages.shape[-1] - 1)
    kn = k_new.transpose(-1, -2).to(pages.dtype)  # [B, H, D, 1]
    col = pages.index_select(3, j)
    first = (slot % p == 0).view(1, 1, 1, 1)
    lo = torch.where(first, kn, torch.minimum(col[:, :, :D], kn))
    hi = torch.where(first, kn, torch.maximum(col[:, :, D:], kn))
    pages.index_copy_(3, j, torch.cat([lo, hi], 2))


def hybrid_scores(Q: Tensor, pages: Tensor, r: int) -> tuple[Tensor, Tensor]:
    """Approximate page scores of queries Q [B, H, G, D] (the G query heads of each KV group), paper 3.4 Algorithm 2,
    spec 3.3: i1 = top-r channels of the group-summed |q| (A10, shared by the group); per channel the max row where
    the group-summed q >= 0, else the min row (A9: >= 0 as in Algorithm 2); each head's own q[i1] times those rows.
    Returns page scores [B, H, G, Np] and the SparQ temperature tau = sqrt(D |q[i1]|_1 / |q|_1) [B, H, G, 1]."""
    B, H, G, D = Q.shape
    i1 = Q.abs().sum(2).topk(r, dim=-1).indices  # [B, H, r]
    rows = i1 + D * (Q.sum(2).gather(-1, i1) >= 0)
    Kh = take_rows(pages, rows).float()  # [B, H, r, Np]
    Qh = Q.gather(-1, i1[:, :, None].expand(B, H, G, r))
    tau = (D * Qh.abs().sum(-1, keepdim=True) / Q.abs().sum(-1, keepdim=True).clamp_min(1e-30)).sqrt()
    return Qh @ Kh, tau


def take_rows(x: Tensor, idx: Tensor) -> Tensor:
    """x[b, h, idx[b, h, j]] for x [B, H, R, ...] and idx [B, H, n]: whole rows, as one index_select over the
    flattened rows (on CPU ~3x faster than torch.gather, which indexes element by element)."""
    B, H, R = x.shape[:3]
    flat = idx + R * torch.arange(B * H, device=idx.device).view(B, H, 1)
    return x.reshape(B * H * R, *x.shape[3:]).index_select(0, flat.view(-1)).view(B, H, idx.shape[-1], *x.shape[3:])


def stable_topk(scores: Tensor, k: int) -> Tensor:
    """Indices of the k highest fp32 scores along the last dim, ties to the lower index (A12: the selection never
    depends on torch.topk's tie order), in ascending order (contiguous reads). A stable argsort costs ~8x a topk on
    CPU, so the topk runs on a float64 key that breaks ties without reordering distinct fp32 scores:
    s - |s| i 2^-50 + (n - i) 2^-1000 for index i < n <= 2^20 (the first term moves a score by < 2^-30 of itself,
    below fp32's spacing; the second only separates exact zeros). +-inf scores stay +-inf."""
    n = scores.shape[-1]
    i = torch.arange(n, device=scores.device, dtype=torch.float64)
    s = scores.double()
    key = s - s.abs().nan_to_num(posinf=0.0) * (i * 2.0 ** -50) + (n - i) * 2.0 ** -1000
    return key.topk(k, dim=-1).indices.sort(dim=-1).values


def token_scores(page_scores: Tensor, tau: Tensor, valid: Tensor, p: int) -> Tensor:
    """Per-slot selection scores [B, H, C] for the token top-k (spec 3.3): page scores broadcast to their p slots,
    slots not attendable (valid [B, H, C] False) at -inf, per-head softmax(scores / tau) summed over the group
    (A11); slots not attendable then score -1, below every attendable one."""
    B, H, G, Np = page_scores.shape
    C = valid.shape[-1]
    St = page_scores[..., None].expand(B, H, G, Np, p).reshape(B, H, G, Np * p)[..., :C]
    St = St.masked_fill(~valid[:, :, None], -INF)
    return (St / tau).softmax(-1).sum(2).masked_fill(~valid, -1.0)


class SnapKVPlusPlus(SnapKV):
    """SnapKV++ (RocketKV stage 1, paper 3.3 and Algorithm 1; spec 2.2), one-shot: after a dense prefill each layer
    keeps, per KV head, the window (the last `--snap-window` 32 prompt tokens, A16/A17: the last prompt token
    included) plus the P - w prompt tokens of highest window attention, softmax in fp32 (A6), summed over the window
    queries and over the group's query heads (one set per KV head), max-pooled along positions (A4) with the
    adaptive kernel (`--rocket-kernel`, default spec 2.3's rule, A5). The kept slots are sorted by position, window
    last (A7). Never evicts during decode: generated tokens are appended (spec 6).
    Budget (paper's SnapKV+GQA baseline, spec 7): `--budget t` slots per KV head including the N new tokens, so
    P = t - N prompt tokens; t <= N + w cannot keep the window (the paper's N/A)."""
    name = "snapkv++"
    help = "RocketKV stage 1 only: one-shot GQA SnapKV, max-pool kernel 63/511; --snap-window (32), --rocket-kernel"
    evicts = False
    one_shot = True
    P = None
    kernel = None

    def check(self, budget, block_size):
        w, k = self.window(), self.param("rocket_kernel", None)
        if w < 1 or (k is not None and (k < 1 or k % 2 == 0)):
            raise PolicyError(f"--snap-window must be >= 1 and --rocket-kernel odd, got {w} and {k}")

    def plan(self, budget, prompt_len, max_new_tokens, model_args=None):
        self.P = budget - max_new_tokens
        self.check_prompt_budget(prompt_len, f"--budget {budget} - --max-new-tokens {max_new_tokens}")
        self.kernel = self.kernel_for(prompt_len, model_args)
        return budget

    def kernel_for(self, prompt_len, model_args=None):
        return self.param("rocket_kernel", None) or adaptive_kernel(prompt_len, model_args)

    def check_prompt_budget(self, prompt_len, how):
        if prompt_len > self.P and self.P < self.window():
            raise PolicyError(f"{self.name} keeps {how} = {self.P} prompt tokens, fewer than its observation window "
                              f"({self.window()}): raise --budget")

    def prompt_slots(self, cache):
        return cache.budget if self.P is None else self.P

    def layer_state(self, cache):
        return super().layer_state(cache) if cache.scratch else {}  # the query ring lives in the prefill scratch

    def observe(self, cache, q, input_pos, query_pos, S):
        if cache.scratch:
            super().observe(cache, q, input_pos, query_pos, S)

    def score(self, cache, q, input_pos, query_pos, S):
        G = cache.n_heads // cache.k.shape[1]  # attention_weights averages a group; x G = the spec's group sum
        return pool_votes(window_votes(cache, S) * G, cache.pos[:, :, :S], query_pos.max(), self.window(),
                          self.kernel or self.kernel_for(S), "max")

    def compressed(self, cache, n):
        cache.sort_slots(n)


class RocketKV(SnapKVPlusPlus):
    """RocketKV (paper 3, spec 2-4): SnapKV++ keeps P = C - N prompt tokens, then at every decode step hybrid
    attention (paper 3.4) attends exactly over k = t/2 tokens picked by page min/max (sequence reduction, page p)
    and the top-r channels of |q| (head-dim reduction), all selections per KV head and shared by its group.
    `--budget t` is the per-KV-head traffic budget of one decode step (spec 4); storage C = floor(sqrt(S t)) with
    S = prompt + --max-new-tokens (`--rocket-alpha`: 0.5 = v1's even split, A1; `icml` = the ICML rule).
    Page state: `pages` [B, H_kv, 2D, Np] per layer (min rows then max rows, channel-major), over SLOT order; the
    slots are sorted by position after stage 1 (A7) and new tokens are appended, so slot order is position order
    and pages group positional neighbours, aligned to slot 0 (A8); updated in place each decode step. The new token
    is a candidate, nothing else is forced in (A13; `--rocket-local-window n` pins the n newest, inside k). No
    SparQ mean-value reallocation. Tie-break: stable top-k (A12). p = 1 keeps min/max rows too (equal to K^T).
    Generation past C raises in generate.generate (A14). With t >= S it is dense (no compression, spec 4)."""
    name = "rocketkv"
    help = ("SnapKV++ then hybrid top-k attention each decode step; --budget = tokens read per step; "
            "--rocket-alpha (0.5), --rocket-kernel, --rocket-local-window (0)")
    rp = None

    def check(self, budget, block_size):
        super().check(budget, block_size)
        alpha = str(self.param("rocket_alpha", "0.5"))
        if alpha != "icml":
            try:
                ok = 0 < float(alpha) <= 1
            except ValueError:
                ok = False
            if not ok:
                raise PolicyError(f"--rocket-alpha must be in (0, 1] or icml, got {alpha!r}")
        if self.param("rocket_local_window", 0) < 0:
            raise PolicyError("--rocket-local-window must be >= 0")

    def plan(self, budget, prompt_len, max_new_tokens, model_args=None):
        D = model_args.head_dim
        self.rp = rocket_params(prompt_len + max_new_tokens, budget, D, max_new_tokens,
                                self.param("rocket_alpha", "0.5"))
        self.P = self.rp.P
        self.check_prompt_budget(prompt_len, f"C - N = {self.rp.C} - {max_new_tokens}")
        if self.param("rocket_local_window", 0) > self.rp.k:
            raise PolicyError(f"--rocket-local-window must not exceed k = {self.rp.k} (it is counted in the budget)")
        self.kernel = self.kernel_for(prompt_len, model_args)
        return self.rp.C

    def layer_state(self, cache):
        state = super().layer_state(cache)
        if not cache.scratch and self.rp is not None and self.rp.sparse:
            B, H, _, D = cache.k.shape
            state["pages"] = ((B, H, 2 * D, -(-cache.budget // self.rp.p)), cache.dtype, 0.0)
        return state

    def compressed(self, cache, n):
        super().compressed(cache, n)
        if "pages" in cache.layer_state:
            C = cache.budget
            cache.layer_state["pages"].copy_(build_pages(cache.keys(C), cache.pos[:, :, :C] >= 0, self.rp.p))

    def select(self, cache, q, query_pos, slot):
        if "pages" not in cache.layer_state:
            return None
        rp, pages, C = self.rp, cache.layer_state["pages"], cache.budget
        update_page(pages, cache.key_rows(slot), slot, rp.p)
        B, Hq, _, D = q.shape
        H = cache.k.shape[1]
        scores, tau = hybrid_scores(q.float().reshape(B, H, Hq // H, D), pages, rp.r)
        pos = cache.pos[:, :, :C]
        agg = token_scores(scores, tau, attention_mask(pos, query_pos, cache.window)[:, :, 0], rp.p)
        agg = protect_recent(agg, pos, query_pos, self.param("rocket_local_window", 0))
        return stable_topk(agg, min(rp.k, C))

    def read_tokens(self, cache):
        if self.rp is None or not self.rp.sparse or cache.scratch:
            return None
        return self.rp.k + self.rp.approx_tokens


class ExactTopK(Policy):
    """Exact-TopK, the accuracy ceiling (paper 4.1, spec 7): each decode step computes the exact attention logits
    over the whole cache (no compression: storage = prompt + new tokens, like `full`) and attends, per QUERY head
    (A20: the official code's oracle selects per head, so a group's union can exceed t), over its top t = --budget
    tokens; the selection itself is counted as free. Prefill is dense (spec 7's common rule)."""
    name = "exact-topk"
    help = "oracle: exact attention over each query head's top --budget tokens of the full cache"
    evicts = False
    k = None

    def plan(self, budget, prompt_len, max_new_tokens, model_args=None):
        self.k = budget
        return prompt_len + max_new_tokens

    def select(self, cache, q, query_pos, slot):
        B, Hq, _, D = q.shape
        H, S = cache.k.shape[1], cache.k.shape[2]
        logits = torch.einsum("bhgd,bhsd->bhgs", q.float().reshape(B, H, Hq // H, D), cache.keys().float())
        valid = attention_mask(cache.pos, query_pos, cache.window)[:, :, 0]
        logits = logits.masked_fill(~valid[:, :, None], -INF)
        k = min(self.k or S, S)
        return stable_topk(logits, k).view(B, Hq, k)

    def read_tokens(self, cache):  # each query head reads its own top-k: up to G k per KV head
        return None if self.k is None else min(cache.n_heads // cache.k.shape[1] * self.k, cache.k.shape[2])


# ------------------------------------------------------------------------------------------------------- SAGE-KV
# SAGE-KV (Wang et al., "LLMs Know What to Drop", arXiv 2503.08879, section 2 and App. A.3) as specified in
# shared/specs/sagekv.md: a dense one-shot prefill, then ONE token- and head-level top-k per layer from the last
# prompt token's query; during decode only the recent window slides. Ambiguities follow the spec's section 5.


def sage_sizes(B: int, G: int, sink: int | None = None, topk: int | None = None) -> tuple[int, int, int]:
    """(S, k, W) for budget B and GQA group G (paper App. A.3, spec 1.2): sink S = B/4, k = B/(2G) per query head
    floored to a power of two (A2: Qwen's 585 -> 512), ring W = B - S - G k, counting the current token (A3), so
    that S + G k + W = B slots per KV head exactly. --sage-sink / --sage-topk override S / k (k = 0: StreamLLM_Abs)."""
    S = B // 4 if sink is None else sink
    if topk is None:
        if B < 2 * G:
            raise PolicyError(f"sagekv: --budget {B} is below 2 x the GQA group ({G}): no token to select per "
                              "query head (--sage-topk 0 keeps sink + recent only)")
        topk = 1 << ((B // (2 * G)).bit_length() - 1)  # the largest power of two <= B / (2G)
    W = B - S - G * topk
    if W < 1:
        raise PolicyError(f"sagekv: --budget {B} leaves no recent window: sink {S} + {G} query heads x top-k {topk} "
                          f"= {S + G * topk} slots")
    return S, topk, W


@dataclass(frozen=True)
class SageLayout:
    """One run's slot layout per KV head, fixed once the prompt length N is known (spec 1.3 and 1.7):

        [0, n_sink)                          sink: positions 0 .. n_sink-1
        [n_sink, ring_start)                 G blocks of kk: block g = the top-kk of query head j G + g
        [ring_start, ring_start + W - 1)     the recent ring: the W - 1 newest tokens
        slot `budget` (the decode tail)      the current token, so a decode step attends S + kk + W per query head

    n_sink = min(S, N), kk = min(k, n_E) with candidates E = [n_sink, rs), rs = max(n_sink, N - W): the sink and
    selection hold no empty slot (the spec's masked empty slots are left out, not stored), so that decode eviction
    can only ever replace a ring token (empty slots score -inf in cache.drop_to)."""
    S: int
    k: int
    W: int
    G: int
    N: int

    @property
    def n_sink(self) -> int:
        return min(self.S, self.N)

    @property
    def rs(self) -> int:
        return max(self.n_sink, self.N - self.W)

    @property
    def kk(self) -> int:
        return min(self.k, self.rs - self.n_sink)

    @property
    def ring_start(self) -> int:
        return self.n_sink + self.G * self.kk

    @property
    def budget(self) -> int:
        return self.ring_start + self.W - 1


class SageKV(Policy):
    """SAGE-KV (paper section 2, Steps 1-4; App. A.3; spec 1): after a dense one-shot prefill, each layer keeps
    the sink [0, S), for EVERY QUERY HEAD its own top-k of the candidates E = [S, N - W) by the attention logits
    of the last prompt token's post-RoPE query (A6: q_last . k_i in fp32, no softmax or 1/sqrt(d), same ranking;
    A7: that one query, no window), and the recent ring. Decode: a query head attends sink + its own k + the ring;
    each new token enters the ring and the oldest ring token is gone for good (Step 4, A10: never re-scored).

    Resolved ambiguities (spec section 5, each the spec's recommendation):
    A1 per-query-head private blocks (G k selected slots per KV head; a token picked by two heads is stored twice);
    A2 k floored to a power of two; A3 ring W = B - S - G k includes the last prompt token and the current token,
    so --budget B counts every slot a decode step reads per KV head (the spec's R = W - 1); A4 keys keep their
    absolute RoPE positions; A5 the literal rule by default (`--sage-skip-if-fits` keeps a prompt with
    N + --max-new-tokens <= B dense); A6 ties go to the lower position (stable_topk); A8 all layers; A9 one-shot
    layer-major prefill; A11 each head's selection in ascending position order; A16 write then attend.
    Engine form (spec 1.6-1.7): the cache keeps B - 1 slots between steps (SageLayout); a decode token is written to
    the tail slot B - 1, attends through `select` (a constant slot pattern per query head), then `score` protects
    sink and selection (+inf) and ranks the ring by recency, so cache.py drops the oldest ring token and the new
    token takes its slot: the ring stays in the ring slots. Extra memory: none beyond the budget (no policy state)."""
    name = "sagekv"
    help = ("SAGE-KV: one-shot top-k per query head from the last prompt query + sink B/4 + sliding recent window; "
            "--sage-sink, --sage-topk, --sage-skip-if-fits")
    one_shot = True
    layout = None

    def check(self, budget, block_size):
        for flag in ("sage_sink", "sage_topk"):
            value = self.param(flag, None)
            if value is not None and value < 0:
                raise PolicyError(f"--{flag.replace('_', '-')} must be >= 0, got {value}")

    def plan(self, budget, prompt_len, max_new_tokens, model_args=None):
        G = model_args.n_heads // model_args.n_kv_heads
        S, k, W = sage_sizes(budget, G, self.param("sage_sink", None), self.param("sage_topk", None))
        if self.param("sage_skip_if_fits", False) and prompt_len + max_new_tokens <= budget:
            S, k, W = prompt_len, 0, budget - prompt_len  # the whole prompt as "sink": nothing is ever dropped
        self.layout = SageLayout(S, k, W, G, prompt_len)
        return self.layout.budget

    def compress(self, scratch, cache):
        """Steps 1-3 for one layer: sink, each query head's top-kk of E, the W - 1 newest prompt tokens."""
        lay = self.layout
        B, H, _, D = scratch.k.shape
        dev = scratch.k.device
        pos = scratch.pos[:, :, :scratch.budget]
        by_pos = position_order(pos)[..., :lay.N]  # the slot of position i
        keep = [torch.arange(lay.n_sink, device=dev).expand(B, H, -1)]
        if lay.kk > 0:
            q_last, _ = last_query(*scratch.last_step)  # [B, Hq, 1, D], post-RoPE at position N - 1
            cand = take_rows(scratch.keys(), by_pos[..., lay.n_sink:lay.rs]).float()  # [B, H, n_E, D]
            logits = torch.einsum("bhgd,bhnd->bhgn", q_last.float().view(B, H, lay.G, D), cand)
            keep.append((stable_topk(logits, lay.kk) + lay.n_sink).view(B, H, lay.G * lay.kk))
        keep.append(torch.arange(max(lay.rs, lay.N - lay.W + 1), lay.N, device=dev).expand(B, H, -1))
        keep = torch.cat(keep, dim=-1)  # positions, in slot order
        n = keep.shape[-1]
        src = by_pos.gather(-1, keep)
        for dst_t, src_t in zip(cache.slot_buffers(), scratch.slot_buffers()):  # K, V (+ int8 scales)
            dst_t[:, :, :n] = take_rows(src_t, src)
        cache.pos[:, :, :n] = keep.to(cache.pos.dtype)
        cache.pos[:, :, n:] = -1
        return True

    def select(self, cache, q, query_pos, slot):
        """Query head j G + g attends the sink, its own block g of the selection, the ring and the new token."""
        lay = self.layout
        if lay.kk == 0:  # no selection: every head sees the same slots, i.e. dense attention
            return None
        B, Hq = q.shape[:2]
        G, kk, dev = lay.G, lay.kk, q.device
        own = lay.n_sink + kk * torch.arange(G, device=dev)[:, None] + torch.arange(kk, device=dev)  # [G, kk]
        shared = torch.cat([torch.arange(lay.n_sink, device=dev), torch.arange(lay.ring_start, cache.budget,
                                                                                device=dev), slot])
        per_head = torch.cat([own, shared.expand(G, -1)], dim=1)  # [G, n]
        return per_head.repeat(Hq // G, 1).expand(B, -1, -1).contiguous()

    def score(self, cache, q, input_pos, query_pos, S):
        """Decode: +inf on sink and selection, recency (the position) on the ring and the new token: the oldest
        ring token is dropped. In the one-shot scratch the budget holds the whole prompt: only empty slots go."""
        recency = cache.pos[:, :, :S].float()
        if cache.scratch:
            return recency
        return recency.masked_fill(torch.arange(S, device=recency.device) < self.layout.ring_start, INF)


SAGEKV_POLICIES = [SageKV]

# --------------------------------------------------------------------------------------------------------- K-VEC
# K-VEC ("Coverage-Driven KV Cache Eviction for Efficient and Improved Inference of LLM", anonymous TMLR submission,
# shared/papers/002_*.txt) as specified in shared/specs/kvec.md: one-shot SnapKV-style selection per layer (paper 4,
# Eq. 8) plus a cross-head module (paper 4.1) and a cross-layer coverage bonus (paper 4.2) computed layer by layer in
# the prefill pass. The equations are pure functions below; the class wires them to the one-shot engine.


def window_means(A: Tensor, q_pos: Tensor, O: int, O2: int) -> tuple[Tensor, Tensor, Tensor]:
    """Eqs. 8, 11, 13 from per-query-head attention rows A [B, H_kv, G, R, S] of queries at positions q_pos [R]
    (-1 = unused row; rows in any order). P, P2 [B, H_kv, S]: mean attention each slot receives from the last O and
    last O2 queries, averaged over each KV group's query heads (A4). I [B, S]: max over ALL query heads, then the mean
    over the last O queries (Eq. 13, A8; not max_h P, test T3). Means, not SnapKV's sums (A9), over the queries that
    exist (a prompt shorter than the window has fewer)."""
    newest = q_pos.max()

    def last(x, n):  # mean over the rows (dim -2) of the n newest queries
        rows = ((q_pos >= 0) & (q_pos > newest - n)).to(x.dtype)
        return (x * rows[:, None]).sum(-2) / rows.sum().clamp_min(1)
    A_kv = A.mean(2)
    return last(A_kv, O), last(A_kv, O2), last(A.amax(dim=(1, 2)), O)


def head_spread(P: Tensor, cand: Tensor) -> Tensor:
    """Eq. 10: sigma [B, H], the population std of each head's score over its candidate slots only (A3)."""
    n = cand.sum(-1).clamp_min(1)
    x = P.masked_fill(~cand, 0.0)
    mean = x.sum(-1, keepdim=True) / n[..., None]
    return ((x - mean).masked_fill(~cand, 0.0) ** 2).sum(-1).div(n).sqrt()


def cross_head(P: Tensor, P2: Tensor, cand: Tensor, delta: int) -> Tensor:
    """Eqs. 9-11 (Alg. 1 lines 2-7): the delta heads of LOWEST sigma (least focused: spec 1.3, against Alg. 1's
    comment; ties to the lower head index, A3), measured on P (A20), take their long-window score P2."""
    if delta <= 0:
        return P
    low = head_spread(P, cand).argsort(dim=-1, stable=True)[..., :delta]
    chosen = torch.zeros(P.shape[:2], dtype=torch.bool, device=P.device).scatter(-1, low, True)
    return torch.where(chosen[..., None], P2, P)


def focus(I: Tensor, n: Tensor, layer: int) -> Tensor:
    """Eqs. 12 and 14: I_t (1 - n_t / (l + 1)); n_t = how many layers before l (0-based, A7, A12) kept t."""
    return I * (1 - n.to(I.dtype) / (layer + 1))


def best_slots(scores: Tensor, pos: Tensor, k: int) -> Tensor:
    """Bool mask [B, H, S] of the k best scores per head; among equal scores the newer position wins, exactly as
    cache.drop_to keeps slots (cache.drop_lowest)."""
    drop = drop_lowest(scores, pos, scores.shape[-1] - k)
    return torch.ones_like(scores, dtype=torch.bool).scatter(-1, drop, False)


def biased_scores(P: Tensor, focus_t: Tensor, cand: Tensor, pos: Tensor, lam: float, K: int,
                  pin_value: float) -> Tensor:
    """Eqs. 15-16: P' = P + lambda focus (focus broadcast over heads), then each head's own top K candidates by the
    unbiased P (per head, A5) score pin_value (A6: +inf; the paper's 1.0 can lose to P + lambda focus > 1, test T8).
    Non-candidates keep P's value (the window's +inf)."""
    out = P + lam * focus_t
    if K > 0:
        pinned = best_slots(P.masked_fill(~cand, -INF), pos, K) & cand
        out = out.masked_fill(pinned, pin_value)
    return out


def kept_any(pos: Tensor, length: int) -> Tensor:
    """Alg. 1 line 14 (A15): [B, length] int32, 1 at every position some head keeps in slot positions pos
    [B, H, n] (-1 = empty): a token kept by several heads counts once per layer (test T9)."""
    idx = torch.where(pos >= 0, pos, length).long().flatten(1)  # empty slots go to a dump column
    hit = torch.zeros(pos.shape[0], length + 1, dtype=torch.bool, device=pos.device).scatter(1, idx, True)
    return hit[:, :length].int()


class KVec(SnapKVPlusPlus):
    """K-VEC (paper 4, Alg. 1; spec 1), one-shot: after the dense prefill of layer l (attention first, so the
    prompt's hidden states and first logits are untouched, spec 1.7) each KV head keeps B = --budget prompt tokens:
    the W = --kvec-window latest plus the best B - W candidates (positions [0, T - W)) by
        P'_t = P_t + lambda I_t (1 - n_t / (l + 1)),   the head's top K = min(floor(beta B), B - W) by P pinned,
    where P is SnapKV's window score (Eq. 8: mean attention from the last O queries, group mean) max-pooled along
    positions (A2), except for the delta heads of lowest std of P, which use the last O' queries (Eq. 11); I is the
    per-token max over query heads averaged over the O window (Eq. 13); n_t counts the layers before l that kept t in
    any head (a per-position counter zeroed at layer 0 and updated after each layer, so layer l reads the decisions of
    layers 0..l-1 in the same forward pass; no second pass, A15). Never evicts during decode: generated tokens are
    appended (spec 1.7). lambda = 0 with delta = 0 is SnapKV (snapkv++ with --snap-window W = O, kernel 7).

    Spec ambiguities, resolved by its recommendations: O = 16, O' = 32, W = 16 independent of O (A1); max-pool
    kernel 7 on P and P2, the O' score (window excluded; not on I or the focus, A2); sigma = population std over candidates, on the
    pooled score, lowest sigma chosen, ties to the lower head (A3, A20); GQA: P and sigma per KV head from the group
    mean, I from the max over all query heads (A4, 1.6); pins per head (A5) at +inf (A6; --kvec-pin-value 1 is the
    paper's literal value); n counts layers strictly before l, once per layer however many heads keep a token, the
    window included, denominator l + 1 with l 0-based (A7, A12); I over O, unpooled (A8); means, not sums (A9);
    B per KV head includes the window and excludes generated tokens (A10: the cache holds B + --max-new-tokens);
    T <= B keeps everything and counts every token as kept (A11); delta > H_kv re-scores every head (A21: delta = 3
    whatever the model); softmax in fp32 (attention_weights). One deviation: A17 asks for deterministic ties and
    suggests keeping the lower position; the cache's shared rule (the newer position is kept, used by every policy
    here) is just as deterministic and makes lambda = 0, delta = 0 equal snapkv++ tie for tie, so pins and
    selection use it. Not implemented: the chunked-prefill and decode-eviction extensions (A13, A14), padding
    inside a batch (A16: the engine runs batch 1; block padding is excluded), --gqa max (A4's alternative).

    Layer index: the policy object is shared by all layers; `compress` (called first for every layer by
    cache.compress_into) numbers each destination cache in order of first compression. generate.prefill_one_shot
    compresses layers 0..L-1 in order, so that is the module's place in the stack for every later prompt too (the
    same caches); plan() forgets the numbering (new caches follow). Cross-layer state: `n_cov` [batch, padded
    prompt] int32, allocated when layer 0 starts a prompt; `coverage()` is the paper's coverage metric (A23)."""
    name = "kvec"
    help = ("K-VEC: one-shot SnapKV + cross-head (lowest-std heads over a longer window) + cross-layer coverage "
            "bonus; --kvec-lambda (1), --kvec-delta (3), --kvec-beta (0.25), --kvec-window (16), --kvec-obs-window "
            "(16), --kvec-long-window (32), --kvec-kernel (7), --kvec-pin-value (inf)")
    layer = 0  # index of the layer being compressed
    keep = None  # B: prompt slots per KV head of the layer being compressed
    n_cov = None  # [batch, padded prompt] int32: for each position, how many layers so far kept it (any head)
    prompt = None  # [batch, padded prompt] bool: real prompt positions (for coverage())

    def __init__(self, args=None):
        super().__init__(args)
        self.layer_of = {}  # destination KVCache -> its layer index

    def recent(self):
        return self.param("kvec_window", 16)

    def obs(self):
        return self.param("kvec_obs_window", 16)

    def long_obs(self):
        return self.param("kvec_long_window", 32)

    def window(self):  # SnapKV's query ring (layer_state, observe) holds the last max(O, O') prompt queries
        return max(self.obs(), self.long_obs())

    def check(self, budget, block_size):
        lam, delta, beta = self.param("kvec_lambda", 1.0), self.param("kvec_delta", 3), self.param("kvec_beta", 0.25)
        W, O, O2, k = self.recent(), self.obs(), self.long_obs(), self.param("kvec_kernel", 7)
        if not lam >= 0:
            raise PolicyError(f"--kvec-lambda must be >= 0, got {lam}")
        if delta < 0:
            raise PolicyError(f"--kvec-delta must be >= 0, got {delta}")
        if not 0 <= beta <= 1:
            raise PolicyError(f"--kvec-beta must be in [0, 1], got {beta}")
        if W < 0 or O < 1 or O2 < O:
            raise PolicyError(f"need --kvec-window >= 0, --kvec-obs-window >= 1 and --kvec-long-window >= "
                              f"--kvec-obs-window, got {W}, {O} and {O2}")
        if k < 1 or k % 2 == 0:
            raise PolicyError(f"--kvec-kernel must be odd and >= 1, got {k}")
        if not self.param("kvec_pin_value", INF) > 0:
            raise PolicyError(f"--kvec-pin-value must be > 0, got {self.param('kvec_pin_value', INF)}")
        if budget <= W:
            raise PolicyError(f"--budget {budget} must exceed the K-VEC recent window --kvec-window ({W})")

    def plan(self, budget, prompt_len, max_new_tokens, model_args=None):
        self.P = budget  # prompt_slots: B prompt tokens per KV head (A10)
        self.layer_of = {}
        return budget + max_new_tokens  # generated tokens are appended, never charged to B (A10, A14)

    def compress(self, scratch, cache):
        """Start of one layer's compression (the default layout follows: score, then compressed)."""
        self.layer = self.layer_of.setdefault(cache, len(self.layer_of))
        if self.layer == 0:  # a new prompt: no layer has kept anything yet (A7)
            B, S = scratch.pos.shape[0], scratch.budget  # the scratch's slot s holds position s (or padding)
            self.n_cov = torch.zeros(B, S, dtype=torch.int32, device=scratch.pos.device)
            self.prompt = scratch.pos[:, 0, :S] >= 0
        self.keep = self.prompt_slots(cache)
        return False

    def score(self, cache, q, input_pos, query_pos, S):
        pos, newest, W = cache.pos[:, :, :S], query_pos.max(), self.recent()
        ring_q, ring_pos = cache.layer_state["ring_q"], cache.layer_state["ring_pos"]
        A = attention_weights(cache, ring_q, ring_pos, S, group_mean=False)  # [B, H_kv, G, R, S], fp32
        P, P2, I = window_means(A, ring_pos, self.obs(), self.long_obs())
        kernel = self.param("kvec_kernel", 7)
        P, P2 = (pool_votes(x, pos, newest, W, kernel, "max") for x in (P, P2))  # window slots +inf
        cand = (pos >= 0) & (pos <= newest - W)
        P = cross_head(P, P2, cand, self.param("kvec_delta", 3))
        n = self.n_cov.gather(1, pos.clamp_min(0).long().flatten(1)).view_as(pos)
        K = min(int(self.param("kvec_beta", 0.25) * self.keep), self.keep - W)
        return biased_scores(P, focus(I[:, None], n, self.layer), cand, pos, self.param("kvec_lambda", 1.0), K,
                             self.param("kvec_pin_value", INF))

    def compressed(self, cache, n):
        super().compressed(cache, n)  # slots sorted by position (A18)
        self.n_cov += kept_any(cache.pos[:, :, :n], self.n_cov.shape[1])

    def coverage(self) -> Tensor:
        """A23 (paper Tables 6-7): share of the prompt's positions kept by >= 1 head in >= 1 layer so far, [batch]."""
        return (self.n_cov > 0).sum(-1) / self.prompt.sum(-1)


KVEC_POLICIES = [KVec]

# ---------------------------------------------------------------------------------------------------------------
REGISTRY = {p.name: p for p in [KeyDiff, Sink, TOVA, SnapKV, H2O, KeyNorm, RandomScores, SnapKVPlusPlus, RocketKV,
                                ExactTopK, *caote_policies(), *SAGEKV_POLICIES, *KVEC_POLICIES]}


def describe() -> str:
    plain = "; ".join(f"{n} ({p.help})" for n, p in REGISTRY.items() if not issubclass(p, CAOTE))
    return (f"full (no eviction); {plain}; caote:BASE, fastcaote:BASE (CAOTE's attention-output-error score over "
            f"BASE = h2o, tova, snapkv or keydiff; fast = mean value)")


def lookup(name: str):
    """The policy class for `name`, None for full; unknown names raise a one-line error."""
    if name == "full":
        return None
    if name not in REGISTRY:
        raise PolicyError(f"unknown policy {name!r}; known: full, {', '.join(REGISTRY)}")
    return REGISTRY[name]
