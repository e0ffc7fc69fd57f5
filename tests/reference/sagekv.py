"""An independent, dynamic-shape reference of SAGE-KV: one-time per-query-head top-k selection after the prompt.

Every token's K/V is kept in plain tensors and each query head's visible set is built explicitly: the sink (the first
S positions), its own top-k of the candidates between the sink and the recent window (by the last prompt query's
logits q . k, ties to the lower position), and the ring of the W latest positions counting the current one. The
prompt itself is attended densely (one block), then the selection is made once.
"""
import math

import torch


def reference_selection(keys, q_last, n_sink, rs, kk):
    """Each query head's top-kk candidates in [n_sink, rs) by fp32 logits q . k, ties to the lower position
    (a stable descending argsort), as sorted position lists."""
    Hq, H = q_last.shape[0], keys.shape[0]
    sel = []
    for h in range(Hq):
        logits = keys[h // (Hq // H), n_sink:rs].double() @ q_last[h].double()
        order = torch.argsort(-logits, stable=True)[:kk]
        sel.append(sorted((order + n_sink).tolist()))
    return sel


def reference_attend(q, K, V, visible):
    """Softmax attention of query head h over exactly the positions visible[h] of its KV head."""
    Hq, D = q.shape
    g = Hq // K.shape[0]
    out = []
    for h in range(Hq):
        idx = torch.tensor(visible[h])
        w = torch.softmax(K[h // g, idx] @ q[h] / math.sqrt(D), dim=0)
        out.append(w @ V[h // g, idx])
    return torch.stack(out)


def ref_sizes(B, G, S=None, k=None):
    """The paper's size rule, literally: sink S = B // 4, k = the largest power of two <= B / (2 G) per query head,
    recent window W = the rest (B = S + G k + W); S and k can be given."""
    S = B // 4 if S is None else S
    k = 1 << int(math.floor(math.log2(B / (2 * G)))) if k is None else k
    return S, k, B - S - G * k


class RefSageLayer:
    """One layer of SAGE-KV as the paper's layout reads, dynamic shapes: every token's K/V kept in plain tensors, and
    each query head's visible set built explicitly: sink [0, S_eff), its own top-k of [S_eff, rs), and the ring
    [max(rs, p - W + 1), p] of W positions counting the current one. `dense` = the skip-if-fits case."""

    def __init__(self, n_heads, n_kv_heads, d, S, k, W, N, dense=False):
        self.hq, self.hkv, self.d, self.N, self.dense = n_heads, n_kv_heads, d, N, dense
        self.S, self.k, self.W = S, k, W
        self.K, self.V = torch.zeros(n_kv_heads, 0, d), torch.zeros(n_kv_heads, 0, d)
        self.sel, self.seen = None, []

    def step(self, q, k, v, pos):
        self.K, self.V = torch.cat([self.K, k.float()], 1), torch.cat([self.V, v.float()], 1)
        p = int(pos[-1])
        if pos[0] == 0:  # the whole prompt in one block: full causal attention, then the one-time selection
            assert p == self.N - 1
            visible = [[list(range(i + 1)) for i in range(self.N)]] * self.hq
            self.select(q[:, -1])
        else:
            visible = [[self.visible(h, p)] for h in range(self.hq)]
            self.seen.append([rows[0] for rows in visible])
        g = self.hq // self.hkv
        out = torch.zeros(self.hq, q.shape[1], self.d)
        for h in range(self.hq):
            for r, vis in enumerate(visible[h]):
                idx = torch.tensor(vis)
                w = torch.softmax(self.K[h // g, idx] @ q[h, r].float() / math.sqrt(self.d), dim=0)
                out[h, r] = w @ self.V[h // g, idx]
        return out

    def select(self, q_last):
        self.s_eff = min(self.S, self.N)
        self.rs = max(self.s_eff, self.N - self.W)
        kk = min(self.k, self.rs - self.s_eff)
        self.sel = reference_selection(self.K, q_last.float(), self.s_eff, self.rs, kk)

    def visible(self, h, p):
        if self.dense:
            return list(range(p + 1))
        ring = range(max(self.rs, p - self.W + 1), p + 1)
        return sorted(set(range(self.s_eff)) | set(self.sel[h]) | set(ring))
