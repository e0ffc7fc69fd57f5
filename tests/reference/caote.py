"""An independent reference of CAOTE / FastCAOTE: a base policy's scores re-ranked by the closed-form change of the
attention output when a token is evicted.

caote_reference writes the closed form out directly for one KV head; RefCAOTE is the RefPolicy that computes the
base's per-query-head scores and protected set (H2O, TOVA, SnapKV or KeyDiff, as in blockwise.py) and re-ranks them.
"""
import math

import torch
from torch import Tensor

from .blockwise import RefSnapKV, _get, keydiff_scores, snapkv_pool
from .model import INF, RefPolicy, attention_probs


def caote_reference(h: Tensor, V: Tensor, fast: bool) -> Tensor:
    """CAOTE's closed form written out directly for one KV head: h [G, n] >= 0 base scores of its query heads,
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
        default = {"h2o": 0.5, "keydiff": 0.2}.get(self.base, 0.0)  # the bases' documented recent windows
        r = int(math.floor(_get(self.params, "window_frac", default) * layer.budget))
        if self.base == "tova":
            last = int(torch.argmax(q_pos))
            h = A[:, last]                                                            # [Hq, n]
            if _get(self.params, "keep_last", False):
                protected = P > newest - 1
        elif self.base == "h2o":
            h = torch.stack([layer.slot_state[f"acc{i}"] for i in range(g)], 1).reshape(Hkv * g, n)
            protected = P > newest - r if r > 0 else protected
        elif self.base == "snapkv":
            rq, rp = layer.layer_state["ring_q"], layer.layer_state["ring_pos"]
            votes = attention_probs(rq, K, P, rp, layer.sliding_window).sum(dim=1)     # [Hq, n]
            w = self.snap.window()
            pooled = snapkv_pool(votes, P.repeat_interleave(g, 0), newest, w, _get(self.params, "kernel", 7))
            protected = P > newest - w
            h = torch.where(protected.repeat_interleave(g, 0), votes, pooled)
        else:  # keydiff: 1 - cos
            h = (1 + keydiff_scores(K, _get(self.params, "anchor", "raw"))).repeat_interleave(g, 0)
            protected = P > newest - r if r > 0 else protected
        V = layer.cand_V
        c = torch.stack([caote_reference(h[j * g:(j + 1) * g], V[j], self.fast) for j in range(Hkv)])
        return c.masked_fill(protected, INF)
