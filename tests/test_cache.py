"""cache.py mechanics against a plain dynamic-shape reference (concatenate, top-k, gather), step by step."""
import pytest
import torch

from cache import CacheSpec, KVCache, attention_mask, attention_weights, evict_fill_holes
from policies import Scorer


class TableScores(Scorer):
    """Scores from a fixed table indexed by (head, position); some positions protected with +inf."""

    def __init__(self, table):
        self.table = table  # [H, max_pos] fp32

    def slot_state(self):
        return {"acc": ((), torch.float32), "vec": ((3,), torch.float32)}

    def score(self, view):
        pos = view.pos.long().clamp_min(0)
        return torch.gather(self.table[None].expand(pos.shape[0], -1, -1), 2, pos)


def run_stream(budget, block, prompt_len, n_decode, H=3, D=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = prompt_len + n_decode
    table = torch.rand(H, total, generator=g)
    n_protected = min(3, budget - 1)  # never more protected tokens than the budget (ties among +inf)
    table[:, torch.arange(0, total, 11)[:n_protected]] = float("inf")
    policy = TableScores(table)
    cache = KVCache(CacheSpec(1, H, D, budget, block, policy=policy))
    ref = [[] for _ in range(H)]  # per head: kept positions, the dynamic reference

    def step(positions):
        T = block if len(positions) > 1 or prompt_len > 0 and positions[0] < prompt_len else 1
        pos = torch.full((T,), -1)
        pos[:len(positions)] = torch.tensor(positions)
        # keys/values encode (head, position) so that we can check they moved together with `pos`
        k = (pos.float()[None, None, :, None] + 1000 * torch.arange(H).float()[None, :, None, None]).expand(1, H, T, D)
        v = -k
        before = cache.pos[:, :, :budget].clone()
        qpos = torch.where(pos >= 0, pos, pos.max())
        q = torch.zeros(1, H, T, D)
        keys, values, mask = cache.update(q, k.clone(), v.clone(), pos, qpos)
        for name, t in cache.state.items():  # state tags: the position + 0.5, to follow it through moves
            sl = t[:, :, budget:budget + T]
            sl.copy_((pos.float() + 0.5).view(1, 1, T, *([1] * (t.dim() - 3))).expand_as(sl))
        cache.evict(q, pos, qpos)
        changed = (cache.pos[:, :, :budget] != before).sum(-1)
        assert (changed <= len(positions)).all(), "more than one block of slots was rewritten"
        for h in range(H):
            cand = ref[h] + list(positions)
            s = table[h, torch.tensor(cand)]
            keep = s.topk(min(budget, len(cand))).indices
            ref[h] = sorted(cand[i] for i in keep.tolist())
            got = cache.pos[0, h]
            valid = got[got >= 0]
            assert len(valid) == min(budget, len(cand))
            assert (got[budget:] == -1).all()  # the tail is empty after eviction
            assert sorted(valid.tolist()) == ref[h]
            kept = got >= 0
            assert torch.equal(cache.k[0, h, kept, 0], valid.float() + 1000 * h)
            assert torch.equal(cache.v[0, h, kept, 0], -(valid.float() + 1000 * h))
            assert torch.equal(cache.state["acc"][0, h, kept], valid.float() + 0.5)
            assert torch.equal(cache.state["vec"][0, h, kept, 2], valid.float() + 0.5)
            assert all(p in ref[h] for p in range(0, len(cand)) if table[h, p] == float("inf"))

    for start in range(0, prompt_len, block):
        step(list(range(start, min(start + block, prompt_len))))
    for p in range(prompt_len, total):
        step([p])
    return cache


@pytest.mark.parametrize("budget,block,prompt_len,n_decode", [
    (16, 8, 50, 20),    # prompt overflows the budget in prefill
    (40, 8, 20, 40),    # fills up during decode: crosses the budget boundary one token at a time
    (16, 16, 16, 5),    # exactly one block fills the budget
    (7, 5, 23, 9),      # odd sizes, partial last block
    (1, 4, 9, 3),       # budget 1
])
def test_eviction_matches_dynamic_reference(budget, block, prompt_len, n_decode):
    run_stream(budget, block, prompt_len, n_decode)


def test_fill_holes_pairs_holes_with_tail_survivors():
    # budget 4, block 3: slots 0..3 kept, 4..6 new. Drop slots 1, 3 and 5 -> 4 and 6 fill holes 1 and 3.
    pos = torch.arange(7, dtype=torch.int32).view(1, 1, 7)
    k = torch.arange(7.0).view(1, 1, 7, 1)
    scores = torch.tensor([[[5.0, 0.1, 5.0, 0.2, 5.0, 0.3, 5.0]]])
    evict_fill_holes(scores, 4, [k], pos)
    assert pos.flatten().tolist() == [0, 4, 2, 6, -1, -1, -1]
    assert k.flatten()[:4].tolist() == [0.0, 4.0, 2.0, 6.0]


def test_mask_causal_window_and_empty():
    slot_pos = torch.tensor([[[0, 5, -1, 3, 9]]])
    qpos = torch.tensor([4, 9])
    m = attention_mask(slot_pos, qpos, None)[0, 0]
    assert m.tolist() == [[True, False, False, True, False], [True, True, False, True, True]]
    m = attention_mask(slot_pos, qpos, 5)[0, 0]  # window 5: positions > q - 5
    assert m.tolist() == [[True, False, False, True, False], [False, True, False, False, True]]


def test_ties_keep_the_newer_position():
    """Spec tie rule: among equal scores the older position is dropped, whatever the slot order."""
    pos = torch.tensor([[[5, 2, 9, 7, 1, 8]]], dtype=torch.int32)
    k = pos.float().view(1, 1, 6, 1).clone()
    evict_fill_holes(torch.zeros(1, 1, 6), 3, [k], pos)
    assert sorted(pos.flatten()[:3].tolist()) == [7, 8, 9]
    assert torch.equal(k.flatten()[:3], pos.flatten()[:3].float())


@pytest.mark.parametrize("window", [None, 4])
def test_attention_weights_equal_the_masked_softmax_bitwise(window):
    """attention_weights = softmax of the masked logits times the mask, averaged over each KV group, bit for bit;
    a row that sees no slot, or whose position is -1, is all zero (batch rows with their own positions)."""
    g = torch.Generator().manual_seed(0)
    B, H, G, R, D, C = 2, 2, 3, 5, 16, 12
    cache = KVCache(CacheSpec(B, H, D, C - 2, 2, window=window, n_heads=H * G))
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.pos.copy_(torch.randint(-1, 20, cache.pos.shape, generator=g, dtype=torch.int32))
    q = 3 * torch.randn(B, H * G, R, D, generator=g)
    q_pos = torch.tensor([[-1, 0, 7, 19, 25], [3, -1, 12, 2, 30]])
    mask = attention_mask(cache.pos[:, :, :C], q_pos, window) & (q_pos >= 0)[:, None, :, None]
    logits = torch.einsum("bhgrd,bhsd->bhgrs", q.view(B, H, G, R, D), cache.k) / D ** 0.5
    ref = logits.masked_fill(~mask[:, :, None], torch.finfo(torch.float32).min).softmax(-1) * mask[:, :, None]
    keys, pos = cache.keys(C), cache.pos[:, :, :C]
    per_head = attention_weights(q, q_pos, keys, pos, window, group_mean=False)
    assert torch.equal(per_head, ref) and torch.equal(attention_weights(q, q_pos, keys, pos, window), ref.mean(2))
    assert (per_head[0, :, :, 0] == 0).all() and (per_head[1, :, :, 1] == 0).all()


@pytest.mark.parametrize("mode,first", [("dense", 0), ("scratch", 3)])
def test_eager_prefill_block_attends_only_the_filled_prefix(mode, first):
    """Blocks the caller runs eagerly (fill_eagerly) on a cache without eviction (dense: slot == position; a
    scratch: appended from slot 0, here positions from `first`, as a chat turn after its history) read only the
    slots filled so far: the same attention as over the whole buffer, whose other slots are empty."""
    torch.manual_seed(0)
    H, D, budget, T = 2, 8, 40, 4
    cache = KVCache(CacheSpec(1, H, D, budget, T, mode))
    cache.fill_eagerly(0, budget)
    for start in (first, first + T, first + 2 * T):
        pos = torch.arange(start, start + T)
        q, k, v = (torch.randn(1, H, T, D) for _ in range(3))
        keys, values, mask = cache.update(q, k, v, pos, pos)
        assert keys.shape[2] == start + T - first  # the filled prefix, not budget + T
        assert mask.shape[1] == 1  # every head holds the same positions: one mask for all
        whole = attention_mask(cache.pos, pos, None)
        ref = torch.nn.functional.scaled_dot_product_attention(q, cache.k, cache.v, attn_mask=whole)
        out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        torch.testing.assert_close(out, ref)
    decode_keys, _, _ = cache.update(q[:, :, :1], k[:, :, :1], v[:, :, :1], pos[-1:] + 1, pos[-1:] + 1)
    assert decode_keys.shape[2] == budget + 1  # decode keeps the static budget + 1 (what a compiled step reads)
    cache.fill_eagerly(3 * T + 1, budget, one_mask=False)  # heads that hold different positions: a mask per head
    start = int(pos[-1]) + 2
    _, _, mask = cache.update(q, k, v, torch.arange(start, start + T), torch.arange(start, start + T))
    assert mask.shape[1] == H
    cache.eager = None  # a compiled step's reads: the static budget + T
    start += T
    keys, _, mask = cache.update(q, k, v, torch.arange(start, start + T), torch.arange(start, start + T))
    assert keys.shape[2] == budget + T and mask.shape[1] == H
