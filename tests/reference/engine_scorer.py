"""The reference's dynamic cache driven by an engine policy's own score function, for any registered scorer.

blockwise.py and caote.py score with independent re-implementations of the known policies. A newly registered policy
has none, but its in-place mechanics (slot layout, hole filling, padding, masks, per-slot state moving with its slot,
one-shot compression) must still equal plain concatenate / sort / gather. This adapter gives RefLayer the policy's
`observe` and `score`, called on a fresh KVCache that holds the reference's candidates in position order (no holes,
no padding, no tail), so only the scoring function is shared with the engine.
"""
import torch

from cache import CacheSpec, KVCache


class EngineScorer:
    """A RefLayer policy (observe / score over the candidates K, P) from an engine scorer, for layer `layer`.
    budget: the engine's --budget (a recent window is a fraction of it); keep: what a one-shot compression keeps;
    shared: the cross-layer dict of one forward (K-VEC); one_shot: the candidates are a one-shot prefill's prompt
    (the state a policy declares for its prefill scratch)."""

    def __init__(self, policy, layer: int, budget: int, keep: int | None = None, shared: dict | None = None,
                 one_shot: bool = False):
        self.policy, self.layer, self.budget, self.keep = policy, layer, budget, keep or budget
        self.one_shot = one_shot
        self.shared = {} if shared is None else shared
        self.view = None

    def observe(self, layer, q, pos, A, K, P):
        Hkv, n, D = K.shape
        c = KVCache(CacheSpec(1, Hkv, D, n, 0, "scratch" if self.one_shot else None, self.policy,
                              window=layer.sliding_window, n_heads=layer.n_heads, keep_budget=self.budget,
                              layer=self.layer))
        c.k[0], c.v[0], c.pos[0] = K, layer.cand_V, P.to(torch.int32)
        b = pos.numel()
        for name, t in c.state.items():  # the kept tokens' state, then zeros for the block's new tokens
            old = layer.slot_state.get(name)
            if old is not None:
                t[0, :, :n - b] = old
        for name, t in c.layer_state.items():
            if name in layer.layer_state:
                t.copy_(layer.layer_state[name])
        self.view = c.view(n, q=q[None].float(), input_pos=pos, query_pos=pos, shared=self.shared, keep=self.keep)
        self.policy.observe(self.view)
        layer.slot_state = {name: t[0].clone() for name, t in c.state.items()}
        layer.layer_state = {name: t.clone() for name, t in c.layer_state.items()}

    def score(self, layer, q, pos, A, K, P):
        return self.policy.score(self.view)[0]
