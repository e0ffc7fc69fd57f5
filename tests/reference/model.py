"""An independent, dynamic-shape reference of block-wise KV eviction: forward pass, one layer's cache, keep rule.

Nothing here comes from cache.py or policies.py: the reference has its own forward pass (plain fp32 matmuls), its
own attention weights and (in blockwise.py and caote.py) its own policy scores, and its cache is a list-like tensor
per layer that is concatenated, scored, top-k'ed and gathered, plainly:

    for each block (prompt in blocks of b from 0, last one partial; then one token per decode step), per layer:
        project, RoPE at absolute positions, concatenate to the cache        (n = n_prev + b candidates)
        attend: block queries over cache U block, mask P_j <= p_i (and the sliding window, if any)
        policy.observe (H2O running sums, SnapKV query ring)
        if n > budget: score every candidate per KV head (fp32), keep the `budget` best, gather
    attention happens BEFORE eviction: a block's queries see every candidate, including those it then evicts.

Tie rule: among equal scores the newer position is kept. Implemented as "order candidates by position,
stable-argsort the scores ascending, evict the first n - budget".

Only `model.Transformer` is read (its state_dict, args and inv_freq) so that both sides run the same weights.
RefModel looks its policy up by name in blockwise.REF_POLICIES.
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


def keep_indices(scores: Tensor, P: Tensor, budget: int) -> Tensor:
    """Per row (KV head): indices of the `budget` kept candidates, in ascending position order.

    Higher score = keep; among equal scores the older position is evicted first (the tie rule above).
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


# ------------------------------------------------------------------------------------------ the policy interface

class RefPolicy:
    """observe() may extend per-slot state (self-owned dict of [Hkv, n] tensors on the layer); score() -> [Hkv, n]."""
    def __init__(self, params=None):
        self.params = params

    def observe(self, layer: "RefLayer", q, q_pos, A, K, P):
        pass

    def score(self, layer: "RefLayer", q, q_pos, A, K, P) -> Tensor:
        raise NotImplementedError


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
            self.slot_state = {name: torch.gather(t, 1, keep.view(*keep.shape, *[1] * (t.dim() - 2)).expand(
                -1, -1, *t.shape[2:])) for name, t in self.slot_state.items()}
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
        from .blockwise import REF_POLICIES  # here, not at the top: blockwise.py builds on this module
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
    """Policy simulator on a synthetic stream of one layer (for the hand-checked stream cases): keys [L, Hkv, d]
    (or [L, d] for one KV head), queries [L, Hq, d] (zeros if None). The first prompt_len tokens (default all) go in
    blocks of `block`, the rest one at a time. Returns the list of kept position sets (per KV head) after every
    block/step."""
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
