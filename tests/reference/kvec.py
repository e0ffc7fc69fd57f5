"""An independent reference of K-VEC's one-shot prompt compression, layer by layer, with plain loops and sorts.

ref_layer, one layer of one prompt of T tokens with B prompt slots: the last W tokens are always kept. Each KV head
scores the other candidates by the attention of the last O queries (averaged over them and over its GQA group,
max-pooled); the `delta` heads whose scores spread least over the candidates take those of the last O' queries
instead. A focus term, the attention of the last O queries maxed over all query heads and averaged over the queries,
discounted by 1 - n / (layer + 1) where n counts the earlier layers that kept the token (a counter shared by the
layers), is added with weight lambda. The min(beta B, B - W) best candidates by the unbiased score are pinned (their
score set to the pin value); the B - W best biased scores are kept, ties to the newer position. A prompt that fits
(T <= B) is kept whole. OneShotKVecLayer / reference_for: RefModel with its layers replaced by a dense prompt step,
then ref_layer's sets, then decode steps that append.
"""
import math

import torch
import torch.nn.functional as F

from .model import INF, RefLayer, RefModel


def best(scores: list, k: int) -> set:
    """The k highest scores; among equal scores the newer position wins (the engine's keep rule)."""
    return set(sorted(range(len(scores)), key=lambda t: (scores[t], t), reverse=True)[:k])


def ref_layer(q, K, layer, n_cov, B, p):
    """K-VEC on one layer of one prompt, the paper's per-layer algorithm written out plainly: q [Hq, T, d], K
    [Hkv, T, d] post-RoPE prompt queries and keys at positions 0..T-1; n_cov a list of T counts, updated in place;
    p the parameters. Returns the kept positions per KV head (sorted) and the pinned ones."""
    Hq, T, d = q.shape
    Hkv = K.shape[0]
    G = Hq // Hkv
    if T <= B:  # the prompt fits: nothing is scored, every token counts as kept
        n_cov[:] = [c + 1 for c in n_cov]
        return [list(range(T))] * Hkv, [[]] * Hkv
    W, O, O2, k = p["W"], p["O"], p["O2"], p["kernel"]
    C = T - W
    R = min(max(O, O2), T)
    logits = q[:, T - R:].float() @ K.float().repeat_interleave(G, 0).transpose(1, 2) / math.sqrt(d)
    future = torch.arange(T)[None, :] > torch.arange(T - R, T)[:, None]
    A = logits.masked_fill(future, -INF).softmax(-1)  # [Hq, R, T]
    AO, AO2 = A[:, R - min(O, T):, :C], A[:, R - min(O2, T):, :C]
    P = AO.mean(1).view(Hkv, G, C).mean(1)
    P2 = AO2.mean(1).view(Hkv, G, C).mean(1)
    P, P2 = (F.max_pool1d(x[:, None], k, 1, k // 2)[:, 0] for x in (P, P2))
    sigma = P.std(-1, correction=0).tolist()
    for h in sorted(range(Hkv), key=lambda h: (sigma[h], h))[:p["delta"]]:
        P[h] = P2[h]
    I = AO.amax(0).mean(0)
    focus_t = I * (1 - torch.tensor(n_cov[:C], dtype=torch.float32) / (layer + 1))
    K_pin = min(int(p["beta"] * B), B - W)
    kept, pins = [], []
    for h in range(Hkv):
        pin = best(P[h].tolist(), K_pin)
        biased = (P[h] + p["lam"] * focus_t).tolist()
        biased = [p["pin"] if t in pin else biased[t] for t in range(C)]
        kept.append(sorted(best(biased, B - W)) + list(range(C, T)))
        pins.append(sorted(pin))
    for t in set().union(*kept):
        n_cov[t] += 1
    return kept, pins


class OneShotKVecLayer(RefLayer):
    """The reference's dynamic cache for one layer: a dense prompt step (attention over the whole prompt), then
    K-VEC keeps its per-head sets (ref_layer, reading the counter shared by the layers); decode steps append."""
    index: int = 0
    counter: list = None
    params: dict = None
    B: int = 0
    pins: list = None

    def step(self, q, k, v, pos):
        out = super().step(q, k, v, pos)  # no policy, unbounded budget: append and attend
        if pos.numel() > 1:  # the prompt: compress once, after its attention
            kept, self.pins = ref_layer(q, self.K, self.index, self.counter, self.B, self.params)
            idx = torch.tensor(kept)
            self.K, self.V = (torch.stack([x[h, idx[h]] for h in range(len(kept))]) for x in (self.K, self.V))
            self.P = torch.gather(self.P, 1, idx)
        return out


def reference_for(model, T, B, p):
    ref = RefModel(model, 10 ** 9, None)
    counter = [0] * T
    a = model.args
    ref.layers = []
    for i in range(a.n_layers):
        layer = OneShotKVecLayer(a.n_heads, a.n_kv_heads, a.head_dim, 10 ** 9, None, a.sliding_window)
        layer.index, layer.counter, layer.params, layer.B = i, counter, p, B
        ref.layers.append(layer)
    return ref, counter
