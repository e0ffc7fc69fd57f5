"""The engine's policies on the hand-checkable cases of the KeyDiff implementation spec (section 8; no model needed):
keys (and queries) are fed straight into a KVCache, block by block, and the kept position sets are compared."""
import math

import pytest
import torch

import cache as cache_module
import policies
from cache import CacheSpec, KVCache


def stream(policy, keys, budget, block, queries=None, n_heads=1):
    """Feed keys [n, D] (one KV head) through a KVCache in blocks; returns the kept positions after each block."""
    keys = torch.as_tensor(keys, dtype=torch.float32)
    n, D = keys.shape
    queries = torch.zeros(n, n_heads, D) if queries is None else torch.as_tensor(queries, dtype=torch.float32)
    cache = KVCache(CacheSpec(1, 1, D, budget, block, policy=policy, n_heads=n_heads))
    kept = []
    for start in range(0, n, block):
        T = min(block, n - start)
        pos = torch.arange(start, start + T)
        k = keys[start:start + T].view(1, 1, T, D)
        q = queries[start:start + T].permute(1, 0, 2).reshape(1, n_heads, T, D)
        cache.update(q, k, k.clone(), pos, pos)
        cache.evict(q, pos, pos)
        p = cache.pos[0, 0]
        kept.append(sorted(p[p >= 0].tolist()))
        assert torch.equal(cache.v[0, 0, p >= 0], keys[p[p >= 0].long()])  # values moved with their keys
    return kept, cache


def keydiff(**kw):
    """Vanilla KeyDiff (no recent window), the rule the hand-checked cases state."""
    return policies.KeyDiff(**{"window_frac": 0.0, **kw})


@pytest.mark.parametrize("anchor,expect", [("raw", [2, 3, 4]), ("normalized", [2, 3, 4])])
def test_keydiff_keeps_the_keys_least_similar_to_the_anchor(anchor, expect):
    keys = [(1, 0), (1, 0.2), (0, 1), (1, -0.5), (-1, 0.3)]
    assert stream(keydiff(anchor=anchor), keys, 3, 5)[0][-1] == expect


def test_keydiff_scores_are_the_cosines():
    keys = torch.tensor([(1, 0), (1, 0.2), (0, 1), (1, -0.5), (-1, 0.3)], dtype=torch.float32)
    cache = KVCache(CacheSpec(1, 1, 2, 5, 5, policy=keydiff()))
    cache.update(torch.zeros(1, 1, 5, 2), keys.view(1, 1, 5, 2), keys.view(1, 1, 5, 2), torch.arange(5),
                 torch.arange(5))
    s = keydiff().score(cache.view(10, query_pos=torch.arange(5)))[0, 0, 5:]
    assert torch.allclose(-s, torch.tensor([0.8944, 0.9648, 0.4472, 0.6000, -0.7282]), atol=1e-4)


@pytest.mark.parametrize("anchor,expect", [("raw", [1, 2]), ("normalized", [0, 1])])
def test_keydiff_raw_and_normalized_anchor_differ(anchor, expect):
    assert stream(keydiff(anchor=anchor), [(10, 0), (0, 1), (0.1, 1)], 2, 3)[0][-1] == expect


def test_keydiff_evicts_repeated_keys_before_distinct_ones():
    e = torch.eye(4)
    assert stream(keydiff(), torch.stack([e[0], e[0], e[0], e[1], e[2]]), 2, 5)[0][-1] == [3, 4]


def test_keydiff_identical_keys_keep_the_newest():
    kept, cache = stream(keydiff(), torch.ones(10, 4), 4, 3)
    assert kept[-1] == [6, 7, 8, 9]
    assert torch.isfinite(keydiff().score(cache.view(4, query_pos=torch.arange(1)))).all()


def test_keydiff_zero_keys_give_finite_scores():
    _, cache = stream(keydiff(), torch.zeros(6, 4), 3, 2)
    assert torch.isfinite(keydiff().score(cache.view(5, query_pos=torch.arange(1)))[cache.pos[:, :, :5] >= 0]).all()


B_STREAM = [(0, -1), (-2, 0), (2, 1), (-2, 2), (1, 2), (2, -2)]


@pytest.mark.parametrize("block,expect", [(2, [[0, 1], [0, 1, 2], [0, 1, 4]]), (6, [[0, 1, 5]]),
                                          (1, [[0], [0, 1], [0, 1, 2], [0, 1, 2], [0, 1, 2], [0, 1, 2]])])
def test_keydiff_block_size_changes_the_selection(block, expect):
    assert stream(keydiff(), B_STREAM, 3, block)[0] == expect


def test_keydiff_recent_window_is_kept():
    keys = [(1, 0), (0, 1), (1, 0.1), (1, -0.1), (-1, 0), (0.9, 0.05)]
    assert stream(keydiff(window_frac=1 / 3), keys, 3, 2)[0] == [[0, 1], [0, 1, 3], [1, 4, 5]]
    assert stream(keydiff(), keys, 3, 2)[0][-1] == [1, 3, 4]


def test_keydiff_holds_the_budget_after_every_block():
    kept, _ = stream(keydiff(), torch.randn(600, 8, generator=torch.Generator().manual_seed(0)), 300, 128)
    assert [len(k) for k in kept] == [128, 256, 300, 300, 300]


@pytest.mark.parametrize("block", [4, 3])
def test_sink_keeps_the_first_and_the_newest_tokens(block):
    policy = policies.Sink(n_sink=4)
    kept, cache = stream(policy, torch.randn(20, 2), 8, block)
    assert kept[-1] == [0, 1, 2, 3, 16, 17, 18, 19]
    for p in range(20, 23):  # three decode steps
        k = torch.randn(1, 1, 1, 2)
        cache.update(k, k, k, torch.tensor([p]), torch.tensor([p]))
        cache.evict(k, torch.tensor([p]), torch.tensor([p]))
    assert sorted(cache.pos[0, 0][cache.pos[0, 0] >= 0].tolist()) == [0, 1, 2, 3, 19, 20, 21, 22]


def test_h2o_accumulates_from_the_first_block_and_favours_old_tokens():
    policy = policies.H2O(window_frac=0.0)  # heavy hitters only: the hand-checked rule
    keys = torch.randn(10, 4, generator=torch.Generator().manual_seed(1))
    cache = KVCache(CacheSpec(1, 1, 4, 4, 2, policy=policy))
    for start in range(0, 10, 2):
        pos = torch.arange(start, start + 2)
        k = keys[start:start + 2].view(1, 1, 2, 4)
        q = torch.zeros(1, 1, 2, 4)  # zero queries: uniform attention over the visible keys
        cache.update(q, k, k, pos, pos)
        if start == 4:  # running sums at block {4, 5}, before selection, current block included
            policy.observe(cache.view(6, q=q, input_pos=pos, query_pos=pos))
            acc = {int(p): float(a) for p, a in zip(cache.pos[0, 0, :6], cache.state["acc"][0, 0, :6]) if p >= 0}
            expect = {0: 2.45, 1: 1.45, 2: 0.95, 3: 0.6167, 4: 0.3667, 5: 0.1667}
            assert all(abs(acc[p] - v) < 1e-3 for p, v in expect.items()), acc
            cache.drop_to(4, policy.score(cache.view(6, q=q, input_pos=pos, query_pos=pos)))
        else:
            cache.evict(q, pos, pos)
    assert sorted(cache.pos[0, 0][cache.pos[0, 0] >= 0].tolist()) == [0, 1, 2, 3]


def test_tova_averages_within_the_gqa_group():
    keys = [(3, 0), (0, 2), (1.8, 1.8), (0, 0)]
    queries = torch.zeros(4, 2, 2)
    queries[3] = torch.tensor([[math.sqrt(2), 0], [0, math.sqrt(2)]])  # last query of heads a and b
    kept, _ = stream(policies.TOVA(), keys, 2, 4, queries=queries, n_heads=2)
    assert kept[-1] == [0, 2]


def test_snapkv_pools_window_votes(monkeypatch):
    row6 = [0.5, 0, 0.05, 0.3, 0, 0, 0.15, 0]
    row7 = [0.4, 0, 0.05, 0, 0, 0.45, 0.05, 0.05]
    weights = torch.tensor([row6, row7]).view(1, 1, 2, 8)
    monkeypatch.setattr(cache_module.View, "attention", lambda view, q, q_pos, group_mean=True: weights)
    policy = policies.SnapKV(window=2, kernel=3)
    cache = KVCache(CacheSpec(1, 1, 2, 4, 4, policy=policy))
    pos = torch.arange(8)
    k = torch.randn(1, 1, 8, 2)
    cache.pos[0, 0, :8] = pos  # candidates 0..7 in slots 0..7
    scores = policy.score(cache.view(8, q=k, input_pos=pos, query_pos=pos))[0, 0]
    assert torch.allclose(scores[:6], torch.tensor([0.3, 0.3333, 0.1333, 0.1333, 0.25, 0.15]), atol=1e-4)
    cache.drop_to(4, policy.score(cache.view(8, q=k, input_pos=pos, query_pos=pos)))
    assert sorted(cache.pos[0, 0, :4].tolist()) == [0, 1, 6, 7]


def test_snapkv_window_always_kept():
    policy = policies.SnapKV(window=8, kernel=7)
    n = 120
    g = torch.Generator().manual_seed(2)
    kept, _ = stream(policy, torch.randn(n, 4, generator=g), 20, 16, queries=torch.randn(n, 2, 4, generator=g),
                     n_heads=2)
    for i, k in enumerate(kept):
        newest = min(n, (i + 1) * 16)
        assert set(range(newest - 8, newest)) <= set(k)


def test_keynorm_keeps_the_smallest_key_norms():
    keys = [(3, 0), (0, 1), (2, 0), (0.5, 0)]
    assert stream(policies.KeyNorm(window_frac=0.0), keys, 2, 4)[0][-1] == [1, 3]


def test_snapkv_ring_keeps_the_latest_queries():
    policy = policies.SnapKV(window=4, kernel=3)
    _, cache = stream(policy, torch.randn(11, 2), 6, 3, queries=torch.arange(11.0).view(11, 1, 1).expand(11, 1, 2))
    assert sorted(cache.layer_state["ring_pos"][0].tolist()) == [7, 8, 9, 10]  # [batch, window]
    assert sorted(cache.layer_state["ring_q"][0, 0, :, 0].tolist()) == [7.0, 8.0, 9.0, 10.0]


@pytest.mark.parametrize("spec,budget,message", [
    ("sink:n_sink=4", 4, "must exceed the 4 sink tokens"),
    ("snapkv:window=32,kernel=7", 32, "must exceed the observation window"),
    ("snapkv:window=32,kernel=6", 64, "odd"),
    ("keydiff:window_frac=1.0", 64, "window_frac"),
    ("h2o:window_frac=-0.1", 64, "window_frac"),
    ("keydiff:anchor=median", 64, "anchor"),
    ("snapkv:kernel=9223372036854775807", 64, "kernel must be between -2\\*\\*31 and 2\\*\\*31"),
    ("rocketkv:kernel=2147483649", 64, "kernel must be between"),
    ("random:seed=-9223372036854775808", 64, "seed must be between"),
    ("sink:n_sink=18446744073709551616", 64, "n_sink must be between"),
])
def test_bad_parameters(spec, budget, message):
    """Parameters are checked when the policy is made, and against a run's budget in plan."""
    with pytest.raises(policies.PolicyError, match=message):
        policies.make(spec).plan(policies.Run(budget, 100, 10))


@pytest.mark.parametrize("pool", ["max", "avg"])
def test_a_kernel_wider_than_the_slots_pools_over_all_of_them(pool):
    """A kernel of 2**31 - 1 (odd, in range) costs no more than one of 2 S + 1: every window covers all S slots, so
    max pooling gives each slot outside the window the largest vote (a hand-computed reference), and average
    pooling the sum of the votes over the kernel's width 2 S + 1."""
    S, window = 50, 4
    votes = torch.rand(1, 2, S, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(S).flip(0).repeat(1, 2, 1)  # slot order is not position order
    newest = torch.tensor([S - 1]).view(1, 1, 1)
    got = policies.pool_votes(votes, pos, newest, window, 2 ** 31 - 1, pool)
    inside = pos > S - 1 - window
    outside = votes.masked_fill(inside, 0.0)
    want = (outside.amax(-1, keepdim=True) if pool == "max" else outside.sum(-1, keepdim=True) / (2 * S + 1))
    want = want.expand(1, 2, S).masked_fill(inside, float("inf"))
    torch.testing.assert_close(got, want)
