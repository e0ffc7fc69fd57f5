"""An independent, dynamic-shape reference of block-wise KV eviction (shared/specs/keydiff.md sections 2.3, 3, 7).

Nothing here comes from cache.py or policies.py: the reference has its own forward pass (plain fp32 matmuls), its
own attention weights and its own policy scores, and its cache is a list-like tensor per layer that is
concatenated, scored, top-k'ed and gathered exactly as in the spec's pseudocode (2.3):

    for each block (prompt in blocks of b from 0, last one partial; then one token per decode step), per layer:
        project, RoPE at absolute positions, concatenate to the cache        (n = n_prev + b candidates)
        attend: block queries over cache U block, mask P_j <= p_i (and the sliding window, if any)
        policy.observe (H2O running sums, SnapKV query ring)
        if n > budget: score every candidate per KV head (fp32), keep the `budget` best, gather
    attention happens BEFORE eviction (spec 2.2, decision 3).

Tie rule (decision 10): among equal scores the newer position is kept. Implemented as "order candidates by position,
stable-argsort the scores ascending, evict the first n - budget".

Only `model.Transformer` is read (its state_dict, args and inv_freq) so that both sides run the same weights.
"""
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

INF = float("inf")


# ----------------------------------------------------------------------------------------------- pure helpers

def attention_probs(q: Tensor, K: Tensor, P: Tensor, q_pos: Tensor, window: int | None = None) -> Tensor:
    """Per query head softmax weights, fp32.

    q [Hq, R, d] (post-RoPE), K [Hkv, n, d], P [Hkv, n] positions, q_pos [R]. Query head h reads KV head
    h // (Hq / Hkv). Query i sees candidate j iff P_j <= p_i (and p_i - P_j < window). Returns [Hq, R, n];
    a row that sees nothing is all zeros.
    """
    Hq, R, d = q.shape
    Hkv, n, _ = K.shape
    g = Hq // Hkv
    Kx = K.float().repeat_interleave(g, dim=0)                                   # [Hq, n, d]
    Px = P.repeat_interleave(g, dim=0)                                           # [Hq, n]
    logits = torch.matmul(q.float(), Kx.transpose(1, 2)) / math.sqrt(d)           # [Hq, R, n]
    vis = Px[:, None, :] <= q_pos[None, :, None]
    if window is not None:
        vis = vis & (Px[:, None, :] > q_pos[None, :, None] - window)
    logits = logits.masked_fill(~vis, -INF)
    probs = torch.softmax(logits, dim=-1)
    return torch.nan_to_num(probs, nan=0.0)  # rows with no visible key -> zeros


def group_mean(A: Tensor, n_kv_heads: int) -> Tensor:
    """[Hq, R, n] -> [Hkv, R, n]: mean over the query heads of each GQA group (spec 3, 'aggregated by average')."""
    Hq, R, n = A.shape
    return A.reshape(n_kv_heads, Hq // n_kv_heads, R, n).mean(dim=1)


def keep_indices(scores: Tensor, P: Tensor, budget: int) -> Tensor:
    """Per row (KV head): indices of the `budget` kept candidates, in ascending position order.

    Higher score = keep; among equal scores the older position is evicted first (spec decision 10).
    scores, P: [Hkv, n].
    """
    Hkv, n = scores.shape
    assert not torch.isnan(scores).any(), "NaN score"
    rows = []
    for h in range(Hkv):
        by_pos = torch.argsort(P[h], stable=True)                     # chronological candidate order
        s = scores[h][by_pos]
        evict_first = torch.argsort(s, stable=True)                   # ascending score; ties: older first
        kept = by_pos[evict_first[n - budget:]]
        rows.append(kept[torch.argsort(P[h][kept])])                  # chronological
    return torch.stack(rows)


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


class RefPolicy:
    """observe() may extend per-slot state (self-owned dict of [Hkv, n] tensors on the layer); score() -> [Hkv, n]."""
    def __init__(self, params=None):
        self.params = params

    def observe(self, layer: "RefLayer", q, q_pos, A, K, P):
        pass

    def score(self, layer: "RefLayer", q, q_pos, A, K, P) -> Tensor:
        raise NotImplementedError


class RefKeyDiff(RefPolicy):
    def score(self, layer, q, q_pos, A, K, P):
        s = keydiff_scores(K, _get(self.params, "anchor", "raw"))
        r = int(math.floor(_get(self.params, "window_frac", 0.0) * layer.budget))
        return protect_recent(s, P, int(q_pos.max()), r)


class RefSink(RefPolicy):
    def score(self, layer, q, q_pos, A, K, P):
        return sink_scores(P, _get(self.params, "n_sink", 4))


class RefKeyNorm(RefPolicy):
    def score(self, layer, q, q_pos, A, K, P):
        return keynorm_scores(K)


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
        r = int(math.floor(_get(self.params, "window_frac", 0.0) * layer.budget))
        return protect_recent(s, P, int(q_pos.max()), r)


class RefSnapKV(RefPolicy):
    """Observation window = the `snap_window` most recent queries this layer has seen (a ring across blocks and
    decode steps); each votes with its own softmax over the current candidates (only keys at or before it)."""
    def window(self):
        return _get(self.params, "snap_window", 32)

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
        return snapkv_pool(votes, P, int(q_pos.max()), self.window(), _get(self.params, "snap_kernel", 7))


class RefRandom(RefPolicy):
    def score(self, layer, q, q_pos, A, K, P):
        return random_scores(P, _get(self.params, "seed", 0))


def caote_reference(h: Tensor, V: Tensor, fast: bool) -> Tensor:
    """CAOTE spec 1.1-1.5 written out directly for one KV head: h [G, n] >= 0 base scores of its query heads,
    V [n, d]. Per head: h~ = h / sum h, X = sum h~ v (FastCAOTE: the mean value), c = h~/(1-h~) ||v - X||;
    the group combines as sqrt(sum_g c_g^2). Returns [n]."""
    c2 = torch.zeros(V.shape[0], dtype=torch.float64)
    for hg in h.double():
        hn = hg / hg.sum()
        X = V.double().mean(0) if fast else hn @ V.double()
        c2 += (hn / (1 - hn).clamp_min(1e-6) * (V.double() - X).norm(dim=-1)) ** 2
    return c2.sqrt().float()


class RefCAOTE(RefPolicy):
    """`caote:<base>` / `fastcaote:<base>`: the base's per-query-head scores h [Hq, n] and protected set, re-ranked
    by caote_reference."""
    def __init__(self, params=None, base="tova", fast=False):
        super().__init__(params)
        self.base, self.fast = base, fast
        self.snap = RefSnapKV(params)

    def observe(self, layer, q, q_pos, A, K, P):
        g = layer.n_heads // layer.n_kv_heads
        if self.base == "h2o":  # per query head sums; entry i holds query head j*g + i of KV head j
            n = K.shape[1]
            for i in range(g):
                acc = layer.slot_state.get(f"acc{i}", torch.zeros(layer.n_kv_heads, 0))
                acc = torch.cat([acc, torch.zeros(layer.n_kv_heads, n - acc.shape[1])], dim=1)
                layer.slot_state[f"acc{i}"] = acc + A.sum(dim=1).view(layer.n_kv_heads, g, n)[:, i]
        if self.base == "snapkv":
            self.snap.observe(layer, q, q_pos, A, K, P)

    def score(self, layer, q, q_pos, A, K, P):
        Hkv, n = P.shape
        g = layer.n_heads // Hkv
        newest = int(q_pos.max())
        protected = torch.zeros(Hkv, n, dtype=torch.bool)
        r = int(math.floor(_get(self.params, "window_frac", 0.0) * layer.budget))
        if self.base == "tova":
            last = int(torch.argmax(q_pos))
            h = A[:, last]                                                            # [Hq, n]
            if _get(self.params, "tova_keep_last", False):
                protected = P > newest - 1
        elif self.base == "h2o":
            h = torch.stack([layer.slot_state[f"acc{i}"] for i in range(g)], 1).reshape(Hkv * g, n)
            protected = P > newest - r if r > 0 else protected
        elif self.base == "snapkv":
            rq, rp = layer.layer_state["ring_q"], layer.layer_state["ring_pos"]
            votes = attention_probs(rq, K, P, rp, layer.sliding_window).sum(dim=1)     # [Hq, n]
            w = self.snap.window()
            pooled = snapkv_pool(votes, P.repeat_interleave(g, 0), newest, w, _get(self.params, "snap_kernel", 7))
            protected = P > newest - w
            h = torch.where(protected.repeat_interleave(g, 0), votes, pooled)
        else:  # keydiff: 1 - cos
            h = (1 + keydiff_scores(K, _get(self.params, "anchor", "raw"))).repeat_interleave(g, 0)
            protected = P > newest - r if r > 0 else protected
        V = layer.cand_V
        c = torch.stack([caote_reference(h[j * g:(j + 1) * g], V[j], self.fast) for j in range(Hkv)])
        return c.masked_fill(protected, INF)


REF_POLICIES = {"keydiff": RefKeyDiff, "sink": RefSink, "keynorm": RefKeyNorm, "tova": RefTOVA, "h2o": RefH2O,
                "snapkv": RefSnapKV, "random": RefRandom}
for _base in ["h2o", "tova", "snapkv", "keydiff"]:
    for _kind in ["caote", "fastcaote"]:
        REF_POLICIES[f"{_kind}:{_base}"] = (lambda b, f: lambda params=None: RefCAOTE(params, b, f))(
            _base, _kind == "fastcaote")


# ------------------------------------------------------------------------------------------------- one layer

@dataclass
class RefLayer:
    """One layer's dynamic cache: K, V [Hkv, n, d], P [Hkv, n] (chronological per head) and policy state."""
    n_heads: int
    n_kv_heads: int
    head_dim: int
    budget: int
    policy: RefPolicy | None
    sliding_window: int | None = None
    K: Tensor = None
    V: Tensor = None
    P: Tensor = None
    slot_state: dict = field(default_factory=dict)
    layer_state: dict = field(default_factory=dict)
    last_scores: Tensor | None = None     # scores of the last eviction (for diagnosis)
    last_cand: Tensor | None = None       # candidate positions of the last eviction

    def __post_init__(self):
        self.K = torch.zeros(self.n_kv_heads, 0, self.head_dim)
        self.V = torch.zeros(self.n_kv_heads, 0, self.head_dim)
        self.P = torch.zeros(self.n_kv_heads, 0, dtype=torch.long)

    def step(self, q: Tensor, k: Tensor, v: Tensor, pos: Tensor) -> Tensor:
        """q [Hq, b, d], k, v [Hkv, b, d] (post-RoPE), pos [b] -> attention output [Hq, b, d] (before eviction)."""
        pos = pos.long()
        K = torch.cat([self.K, k.float()], dim=1)
        V = torch.cat([self.V, v.float()], dim=1)
        P = torch.cat([self.P, pos[None].expand(self.n_kv_heads, -1)], dim=1)
        A = attention_probs(q, K, P, pos, self.sliding_window)                            # [Hq, b, n]
        g = self.n_heads // self.n_kv_heads
        out = torch.matmul(A, V.repeat_interleave(g, dim=0))
        n = K.shape[1]
        self.cand_V = V  # the candidates' values (CAOTE reads them)
        if self.policy is not None:
            self.policy.observe(self, q, pos, A, K, P)
        if self.policy is not None and n > self.budget:
            s = self.policy.score(self, q, pos, A, K, P).float()
            self.last_scores, self.last_cand = s, P
            keep = keep_indices(s, P, self.budget)                                          # [Hkv, budget]
            K = torch.gather(K, 1, keep[..., None].expand(-1, -1, self.head_dim))
            V = torch.gather(V, 1, keep[..., None].expand(-1, -1, self.head_dim))
            P = torch.gather(P, 1, keep)
            self.slot_state = {name: torch.gather(t, 1, keep) for name, t in self.slot_state.items()}
        self.K, self.V, self.P = K, V, P
        return out

    def kept(self) -> list[list[int]]:
        return [sorted(self.P[h].tolist()) for h in range(self.n_kv_heads)]


# ------------------------------------------------------------------------------------------------- the model

def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return w * (x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps))


def rope(x: Tensor, pos: Tensor, inv_freq: Tensor) -> Tensor:
    """HF rotate-half RoPE; x [H, b, d], pos [b]."""
    ang = pos.float()[:, None] * inv_freq[None, :]                    # [b, d/2]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    h = x.shape[-1] // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
    return x * cos + rot * sin


class RefModel:
    """The same network as an engine `Transformer` (weights read from it), run with the dynamic reference cache."""

    def __init__(self, model, budget: int, policy_name: str | None, params=None):
        a = model.args
        self.args = a
        sd = {k: v.detach().float().clone() for k, v in model.state_dict().items() if "kv_cache" not in k}
        self.w = sd
        self.inv_freq = model.inv_freq.detach().float().clone()
        self.hq, self.hkv, self.d = a.n_heads, a.n_kv_heads, a.head_dim
        self.layers = [RefLayer(a.n_heads, a.n_kv_heads, a.head_dim, budget,
                                REF_POLICIES[policy_name](params) if policy_name else None, a.sliding_window)
                       for _ in range(a.n_layers)]

    def block(self, tokens, positions) -> Tensor:
        """Run one block of real tokens at absolute positions; returns the last token's logits [vocab] fp32."""
        w, a = self.w, self.args
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        pos = torch.as_tensor(positions, dtype=torch.long)
        b = tokens.numel()
        h = w["tok_embeddings.weight"][tokens]                                          # [b, dim]
        for i, layer in enumerate(self.layers):
            pre = f"layers.{i}."
            x = rms_norm(h, w[pre + "attention_norm.weight"], a.norm_eps)
            qkv = x @ w[pre + "attention.wqkv.weight"].T
            if pre + "attention.wqkv.bias" in w:
                qkv = qkv + w[pre + "attention.wqkv.bias"]
            nq, nk = self.hq * self.d, self.hkv * self.d
            q = qkv[:, :nq].reshape(b, self.hq, self.d).transpose(0, 1)
            k = qkv[:, nq:nq + nk].reshape(b, self.hkv, self.d).transpose(0, 1)
            v = qkv[:, nq + nk:].reshape(b, self.hkv, self.d).transpose(0, 1)
            q, k = rope(q, pos, self.inv_freq), rope(k, pos, self.inv_freq)
            o = layer.step(q, k, v, pos)                                                  # [Hq, b, d]
            o = o.transpose(0, 1).reshape(b, nq) @ w[pre + "attention.wo.weight"].T
            if pre + "attention.wo.bias" in w:
                o = o + w[pre + "attention.wo.bias"]
            h = h + o
            x = rms_norm(h, w[pre + "ffn_norm.weight"], a.norm_eps)
            gu = x @ w[pre + "feed_forward.w13.weight"].T
            gate, up = gu[:, :gu.shape[1] // 2], gu[:, gu.shape[1] // 2:]
            h = h + (F.silu(gate) * up) @ w[pre + "feed_forward.w2.weight"].T
        x = rms_norm(h[-1], w["norm.weight"], a.norm_eps)
        out_w = w.get("output.weight", w["tok_embeddings.weight"])
        return x @ out_w.T

    def kept(self) -> list[list[list[int]]]:
        """[layer][kv_head] -> sorted kept positions."""
        return [layer.kept() for layer in self.layers]


def run_stream(policy, keys, budget: int, block: int, prompt_len: int | None = None, queries=None,
               n_heads: int = 1, values=None):
    """Policy simulator on a synthetic stream of one layer (spec section 8 B/C): keys [L, Hkv, d] (or [L, d] for one
    KV head), queries [L, Hq, d] (zeros if None). The first prompt_len tokens (default all) go in blocks of `block`,
    the rest one at a time. Returns the list of kept position sets (per KV head) after every block/step."""
    keys = torch.as_tensor(keys, dtype=torch.float32)
    if keys.dim() == 2:
        keys = keys[:, None]
    L, Hkv, d = keys.shape
    if queries is None:
        queries = torch.zeros(L, n_heads, d)
    queries = torch.as_tensor(queries, dtype=torch.float32)
    Hq = queries.shape[1]
    values = torch.zeros(L, Hkv, d) if values is None else torch.as_tensor(values, dtype=torch.float32)
    layer = RefLayer(Hq, Hkv, d, budget, policy)
    prompt_len = L if prompt_len is None else prompt_len
    spans = [(s, min(s + block, prompt_len)) for s in range(0, prompt_len, block)]
    spans += [(p, p + 1) for p in range(prompt_len, L)]
    history = []
    for s, e in spans:
        layer.step(queries[s:e].transpose(0, 1), keys[s:e].transpose(0, 1), values[s:e].transpose(0, 1),
                   torch.arange(s, e))
        history.append(layer.kept())
    return history, layer
