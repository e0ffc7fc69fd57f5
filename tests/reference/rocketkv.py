"""An independent, dynamic-shape reference of RocketKV (SnapKV++ then hybrid top-k attention) and of Exact-TopK.

Every kept token's K/V is held in plain tensors in position order (the order the engine's slots hold them after the
one-shot compression, new tokens appended), and each decode step builds what each query head attends explicitly:

- SnapKV++ (stage 1), once after the dense prompt: the window = the last w prompt positions; every earlier position
  is voted for by the window queries' causal softmax attention (fp64), summed over the window queries and over the
  group's query heads, then max-pooled along positions with the kernel (the window's votes left out); each KV head
  keeps the P - w best (ties to the newer position, the engine's keep rule) and the window. A prompt of at most P
  tokens is kept whole.
- RocketKV (stage 2), every decode step, per KV head: pages of p consecutive kept tokens (from the first); per page
  and channel the min and max key; the r channels of largest group-summed |q|; per channel the max row where the
  group-summed q is >= 0, else the min row; each query head's page scores q[i1] . row and its temperature
  tau = sqrt(D |q[i1]|_1 / |q|_1); a token scores the sum over the group of softmax(page score / tau) over the
  kept tokens; the local_window newest always win; the group attends the k best (ties to the lower position).
- Exact-TopK, every decode step: each query head attends its own k tokens of largest q . k (ties to the lower
  position), nothing evicted.

`seen` records, per decode step, the positions each query head attended.
"""
import math

import torch


def top(scores: list, k: int, newer_wins: bool = False) -> list:
    """Indices of the k highest scores, ties to the lower index (newer_wins: the higher), in ascending order."""
    return sorted(sorted(range(len(scores)), key=lambda i: (-scores[i], -i if newer_wins else i))[:k])


def snapkvpp_keep(q, K, w: int, kernel: int, P: int) -> list[list[int]]:
    """SnapKV++'s kept prompt positions per KV head (sorted): q [Hq, T, d], K [Hkv, T, d], post-RoPE."""
    Hq, T, d = q.shape
    Hkv = K.shape[0]
    g = Hq // Hkv
    if T <= P:
        return [list(range(T)) for _ in range(Hkv)]
    causal = torch.arange(T)[None, :] <= torch.arange(T - w, T)[:, None]  # [w, T]: window query i sees t <= i
    kept = []
    for j in range(Hkv):
        logits = q[j * g:(j + 1) * g, T - w:].double() @ K[j].double().T / math.sqrt(d)  # [g, w, T]
        votes = logits.masked_fill(~causal, -math.inf).softmax(-1).sum((0, 1))[:T - w].tolist()
        half = kernel // 2
        pooled = [max(votes[max(0, t - half):t + half + 1]) for t in range(T - w)]
        kept.append(top(pooled, P - w, newer_wins=True) + list(range(T - w, T)))
    return kept


def rocket_select(q, K, k: int, p: int, r: int, newest: set) -> list[int]:
    """Stage 2's k attended tokens of one KV head: q [G, D] its query heads, K [n, D] its kept keys in position
    order, newest the indices that always win (the local window)."""
    G, D = q.shape
    n = K.shape[0]
    q, K = q.double(), K.double()
    pages = [K[s:s + p] for s in range(0, n, p)]
    lo = torch.stack([page.amin(0) for page in pages])  # [Np, D]
    hi = torch.stack([page.amax(0) for page in pages])
    i1 = q.abs().sum(0).topk(r).indices
    rows = torch.where(q.sum(0)[i1] >= 0, hi[:, i1], lo[:, i1])  # [Np, r]
    score = torch.zeros(n, dtype=torch.float64)
    for h in range(G):
        page_score = rows @ q[h, i1]  # [Np]
        tau = math.sqrt(D * q[h, i1].abs().sum().item() / q[h].abs().sum().item())
        score += torch.softmax(page_score.repeat_interleave(p)[:n] / tau, dim=0)
    score = [math.inf if t in newest else s for t, s in enumerate(score.tolist())]
    return top(score, min(k, n))


class RefRocketLayer:
    """One layer of RocketKV (or, with exact_k, Exact-TopK): the prompt in one dense block, then decode steps.
    Sizes as the engine's RocketParams (P, p, r, k, sparse) or exact_k, the query heads' own top-k."""

    def __init__(self, n_heads, n_kv_heads, d, window=None, kernel=None, rp=None, local_window=0, exact_k=None):
        self.hq, self.hkv, self.d = n_heads, n_kv_heads, d
        self.window, self.kernel, self.rp, self.local_window, self.exact_k = window, kernel, rp, local_window, exact_k
        self.K = self.V = self.P = None  # per KV head: [n, d], [n, d], positions (lists of tensors)
        self.seen = []

    def step(self, q, k, v, pos):
        g, d = self.hq // self.hkv, self.d
        if pos[0] == 0:  # the whole prompt: dense causal attention, then stage 1
            T = len(pos)
            causal = torch.ones(T, T, dtype=torch.bool).tril()
            out = torch.stack([torch.softmax((q[h] @ k[h // g].T / math.sqrt(d)).masked_fill(~causal, -math.inf),
                                             -1) @ v[h // g] for h in range(self.hq)])
            if self.exact_k is None:
                keep = snapkvpp_keep(q, k, self.window, self.kernel, self.rp.P)
            else:
                keep = [list(range(T)) for _ in range(self.hkv)]
            self.K = [k[j, keep[j]].float() for j in range(self.hkv)]
            self.V = [v[j, keep[j]].float() for j in range(self.hkv)]
            self.P = [list(keep[j]) for j in range(self.hkv)]
            return out
        p = int(pos[0])
        for j in range(self.hkv):
            self.K[j] = torch.cat([self.K[j], k[j].float()])
            self.V[j] = torch.cat([self.V[j], v[j].float()])
            self.P[j].append(p)
        attended = []
        for j in range(self.hkv):
            n = len(self.P[j])
            if self.exact_k is not None:
                for h in range(j * g, (j + 1) * g):
                    attended.append(top((self.K[j].double() @ q[h, 0].double()).tolist(), min(self.exact_k, n)))
            else:
                if self.rp.sparse:
                    newest = {t for t, at in enumerate(self.P[j]) if at > p - self.local_window}
                    sel = rocket_select(q[j * g:(j + 1) * g, 0], self.K[j], self.rp.k, self.rp.p, self.rp.r, newest)
                else:
                    sel = list(range(n))
                attended += [sel] * g
        out = torch.zeros(self.hq, 1, d)
        for h in range(self.hq):
            idx = torch.tensor(attended[h])
            w = torch.softmax(self.K[h // g][idx] @ q[h, 0].float() / math.sqrt(d), dim=0)
            out[h, 0] = w @ self.V[h // g][idx]
        self.seen.append([sorted(self.P[h // g][t] for t in attended[h]) for h in range(self.hq)])
        return out
