"""Independent re-implementations of the block-wise policies' scores, as RefPolicy subclasses that RefLayer drives.

KeyDiff (negative cosine to the mean key), StreamingLLM's sink + recency, key L2 norm, TOVA (the last query's
attention), H2O (accumulated attention), SnapKV (an observation window's votes, pooled) and a hash-based random score,
each written from its paper's rule with plain tensor code; higher score = keep. REF_POLICIES maps the engine's policy
names to them, `caote:<base>` / `fastcaote:<base>` included (caote.py, imported on first use).
"""
import math

import torch
from torch import Tensor

from .model import INF, RefPolicy, attention_probs


# ----------------------------------------------------------------------------------------------- pure helpers

def group_mean(A: Tensor, n_kv_heads: int) -> Tensor:
    """[Hq, R, n] -> [Hkv, R, n]: mean over the query heads of each GQA group (a group's scores are averaged)."""
    Hq, R, n = A.shape
    return A.reshape(n_kv_heads, Hq // n_kv_heads, R, n).mean(dim=1)


def protect_recent(scores: Tensor, P: Tensor, newest: int, n_recent: int) -> Tensor:
    """+inf on candidates whose position is one of the `n_recent` latest positions seen (newest = latest)."""
    if n_recent <= 0:
        return scores
    return scores.masked_fill(P > newest - n_recent, INF)


def keydiff_scores(K: Tensor, anchor: str = "raw", eps: float = 1e-8) -> Tensor:
    """-cos(k_j, mu) per KV head; mu = mean of the raw keys (anchor='raw') or of the unit keys ('normalized').
    K [Hkv, n, d] -> [Hkv, n] fp32."""
    K = K.float()
    norms = torch.sqrt((K * K).sum(-1)).clamp_min(eps)                # [Hkv, n]
    src = K if anchor == "raw" else K / norms[..., None]
    mu = src.sum(dim=1) / K.shape[1]                                   # [Hkv, d]
    mu_norm = torch.sqrt((mu * mu).sum(-1)).clamp_min(eps)             # [Hkv]
    cos = torch.einsum("hnd,hd->hn", K, mu) / (norms * mu_norm[:, None])
    return -cos


def sink_scores(P: Tensor, n_sink: int = 4) -> Tensor:
    """Recency (the position itself) with positions 0..n_sink-1 protected."""
    return P.float().masked_fill(P < n_sink, INF)


def keynorm_scores(K: Tensor) -> Tensor:
    """-||k_j||_2 (keep the smallest norms)."""
    K = K.float()
    return -torch.sqrt((K * K).sum(-1))


def random_scores(P: Tensor, seed: int = 0) -> Tensor:
    """frac(sin(pos*12.9898 + head*78.233 + seed*37.719) * 43758.5453) in float64, as float32; head = KV head."""
    Hkv = P.shape[0]
    head = torch.arange(Hkv, dtype=torch.float64)[:, None]
    x = torch.sin(P.double() * 12.9898 + head * 78.233 + seed * 37.719) * 43758.5453
    return (x - torch.floor(x)).float()


def avg_pool_zero_pad(x: Tensor, kernel: int) -> Tensor:
    """1-D average pooling, stride 1, zero padding kernel // 2 on both sides counted in the denominator.

    Each output sums its in-range inputs one by one in index order (padding adds exact zeros), so two outputs
    whose windows cover the same inputs are bitwise equal. That matters: with few pooled candidates (<= 6 for
    kernel 7) several windows cover the whole run and their scores tie exactly, so the tie rule must decide, not
    the rounding of a vectorised sum."""
    pad, n = kernel // 2, x.numel()
    out = x.new_zeros(n)
    for i in range(n):
        acc = x.new_zeros(())
        for j in range(max(0, i - pad), min(n, i + pad + 1)):
            acc = acc + x[j]
        out[i] = acc / kernel
    return out


def snapkv_pool(votes: Tensor, P: Tensor, newest: int, window: int = 32, kernel: int = 7) -> Tensor:
    """SnapKV's score from the summed window votes [Hkv, n]: the `window` latest positions get +inf; the others are
    average-pooled in position order among themselves (window tokens are not pooling neighbours)."""
    out = torch.full_like(votes, INF)
    for h in range(votes.shape[0]):
        rest = (P[h] <= newest - window).nonzero().flatten()
        rest = rest[torch.argsort(P[h][rest])]
        if rest.numel():
            out[h, rest] = avg_pool_zero_pad(votes[h, rest], kernel)
    return out


# --------------------------------------------------------------------------------------------------- policies

def _get(params, name, default):
    if params is None:
        return default
    if isinstance(params, dict):
        return params.get(name, default)
    return getattr(params, name, default)


class RefKeyDiff(RefPolicy):
    def score(self, layer, q, q_pos, A, K, P):
        s = keydiff_scores(K, _get(self.params, "anchor", "raw"))
        r = int(math.floor(_get(self.params, "window_frac", 0.2) * layer.budget))  # default: KeyDiff + SW 0.2
        return protect_recent(s, P, int(q_pos.max()), r)


class RefSink(RefPolicy):
    def score(self, layer, q, q_pos, A, K, P):
        return sink_scores(P, _get(self.params, "n_sink", 4))


class RefKeyNorm(RefPolicy):
    def score(self, layer, q, q_pos, A, K, P):
        r = int(math.floor(_get(self.params, "window_frac", 0.2) * layer.budget))  # default: 20% recent window
        return protect_recent(keynorm_scores(K), P, int(q_pos.max()), r)


class RefTOVA(RefPolicy):
    def score(self, layer, q, q_pos, A, K, P):
        last = int(torch.argmax(q_pos))  # the block's last real query (highest position)
        return group_mean(A[:, last:last + 1], layer.n_kv_heads)[:, 0]


class RefH2O(RefPolicy):
    def observe(self, layer, q, q_pos, A, K, P):
        n = K.shape[1]
        acc = layer.slot_state.get("acc", torch.zeros(layer.n_kv_heads, 0))
        acc = torch.cat([acc, torch.zeros(layer.n_kv_heads, n - acc.shape[1])], dim=1)
        layer.slot_state["acc"] = acc + group_mean(A, layer.n_kv_heads).sum(dim=1)

    def score(self, layer, q, q_pos, A, K, P):
        s = layer.slot_state["acc"].clone()
        r = int(math.floor(_get(self.params, "window_frac", 0.5) * layer.budget))  # default: H2O's heavy/recent split
        return protect_recent(s, P, int(q_pos.max()), r)


class RefSnapKV(RefPolicy):
    """Observation window = the `window` most recent queries this layer has seen (a ring across blocks and
    decode steps); each votes with its own softmax over the current candidates (only keys at or before it)."""
    def window(self):
        return _get(self.params, "window", 32)

    def observe(self, layer, q, q_pos, A, K, P):
        rq = layer.layer_state.get("ring_q", q.new_zeros(q.shape[0], 0, q.shape[2]))
        rp = layer.layer_state.get("ring_pos", q_pos.new_zeros(0))
        rq, rp = torch.cat([rq, q.float()], dim=1), torch.cat([rp, q_pos])
        w = self.window()
        layer.layer_state["ring_q"], layer.layer_state["ring_pos"] = rq[:, -w:], rp[-w:]  # positions ascend

    def score(self, layer, q, q_pos, A, K, P):
        rq, rp = layer.layer_state["ring_q"], layer.layer_state["ring_pos"]
        W = attention_probs(rq, K, P, rp, layer.sliding_window)              # [Hq, w, n]
        votes = group_mean(W, layer.n_kv_heads).sum(dim=1)                   # [Hkv, n]
        return snapkv_pool(votes, P, int(q_pos.max()), self.window(), _get(self.params, "kernel", 7))


class RefRandom(RefPolicy):
    def score(self, layer, q, q_pos, A, K, P):
        return random_scores(P, _get(self.params, "seed", 0))


def _caote(params, base, fast):
    from .caote import RefCAOTE  # here, not at the top: caote.py builds on RefSnapKV (an import cycle otherwise)
    return RefCAOTE(params, base, fast)


REF_POLICIES = {"keydiff": RefKeyDiff, "sink": RefSink, "keynorm": RefKeyNorm, "tova": RefTOVA, "h2o": RefH2O,
                "snapkv": RefSnapKV, "random": RefRandom}
for _base in ["h2o", "tova", "snapkv", "keydiff"]:
    for _kind in ["caote", "fastcaote"]:
        REF_POLICIES[f"{_kind}:{_base}"] = (lambda b, f: lambda params=None: _caote(params, b, f))(
            _base, _kind == "fastcaote")
