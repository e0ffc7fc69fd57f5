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

from cache import attention_mask, attention_weights

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
        return pool_votes(window_votes(cache, S), cache.pos[:, :, :S], query_pos.max(), self.window(),
                          self.param("snap_kernel", 7), "avg")


def window_votes(cache, S: int) -> Tensor:
    """Softmax attention of the ring's window queries over the first S slots (causal: each query sees positions up
    to its own), summed over the window queries, averaged over each KV group's query heads: [B, H_kv, S]."""
    ring_q, ring_pos = cache.layer_state["ring_q"], cache.layer_state["ring_pos"]
    return attention_weights(cache, ring_q, ring_pos, S).sum(2)


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
            state["pages"] = ((B, H, 2 * D, -(-cache.budget // self.rp.p)), cache.k.dtype, 0.0)
        return state

    def compressed(self, cache, n):
        super().compressed(cache, n)
        if "pages" in cache.layer_state:
            C = cache.budget
            cache.layer_state["pages"].copy_(build_pages(cache.k[:, :, :C], cache.pos[:, :, :C] >= 0, self.rp.p))

    def select(self, cache, q, query_pos, slot):
        if "pages" not in cache.layer_state:
            return None
        rp, pages, C = self.rp, cache.layer_state["pages"], cache.budget
        update_page(pages, cache.k.index_select(2, slot), slot, rp.p)
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
        logits = torch.einsum("bhgd,bhsd->bhgs", q.float().reshape(B, H, Hq // H, D), cache.k.float())
        valid = attention_mask(cache.pos, query_pos, cache.window)[:, :, 0]
        logits = logits.masked_fill(~valid[:, :, None], -INF)
        k = min(self.k or S, S)
        return stable_topk(logits, k).view(B, Hq, k)

    def read_tokens(self, cache):  # each query head reads its own top-k: up to G k per KV head
        return None if self.k is None else min(cache.n_heads // cache.k.shape[1] * self.k, cache.k.shape[2])


# ------------------------------------------------------------------------------------------------------- SAGE-KV
SAGEKV_POLICIES = []

# --------------------------------------------------------------------------------------------------------- K-VEC
KVEC_POLICIES = []

# ---------------------------------------------------------------------------------------------------------------
REGISTRY = {p.name: p for p in [KeyDiff, Sink, TOVA, SnapKV, H2O, KeyNorm, RandomScores, SnapKVPlusPlus, RocketKV,
                                ExactTopK, *SAGEKV_POLICIES, *KVEC_POLICIES]}


def describe() -> str:
    return "full (no eviction); " + "; ".join(f"{n} ({p.help})" for n, p in REGISTRY.items())


def lookup(name: str):
    """The policy class for `name`, None for full; unknown names raise a one-line error."""
    if name == "full":
        return None
    if name not in REGISTRY:
        raise PolicyError(f"unknown policy {name!r}; known: full, {', '.join(REGISTRY)}")
    return REGISTRY[name]
