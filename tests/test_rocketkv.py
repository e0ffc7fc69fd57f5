"""RocketKV and Exact-TopK: the hand-checkable cases of the paper's rules on the pure functions and a bare KVCache,
then the engine on the tiny model against the independent reference (tests/reference/rocketkv.py: the positions
each query head attends and the logits at every decode step), stage 2 with k = every slot equals dense attention
over the kept cache, a budget >= the context reproduces `full`; on CUDA the decode step replays as a CUDA graph
(compiled == eager on CPU: test_conformance.py).
"""
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import generate_compiled, make_policy, one_shot_equals_reference
import torch.nn.functional as F

import policies
from cache import CacheSpec, KVCache, compress_into
from engine import generate, setup
from runtime import model_step, prefill_step
from loading import load_model
from errors import UserError
from policies import (ExactTopK, RocketKV, SnapKVPlusPlus, adaptive_kernel, build_pages, hybrid_scores, pool_votes,
                      rocket_params, rocket_sizes, stable_topk, token_scores, update_page)
from reference.model import RefModel
from reference.rocketkv import RefRocketLayer
from scripts.bench_figure import paper_peak_memory
from test_cli import tiny_ckpt  # noqa: F401  (fixture)

EAGER = (prefill_step, model_step)
INF = float("inf")


def top(scores, n):
    return sorted(stable_topk(scores, n).flatten().tolist())


# ------------------------------------------------------------------------------- stage 1: pooling and selection

def test_group_sum_then_max_pool_selects_the_top_prompt_tokens():
    """Hkv=1, G=2, w=2, T=10: group sum of the window-summed head scores, max-pooled, P=5 keeps {1,2,3} + window."""
    h0 = torch.tensor([0, 0, 5, 0, 0, 0, 0, 1.0, 0, 0])
    h1 = torch.tensor([0, 0, 0, 0, 0, 0, 3, 0.0, 0, 0])
    votes, pos = (h0 + h1).view(1, 1, 10), torch.arange(10).view(1, 1, 10)
    s3 = pool_votes(votes, pos, torch.tensor(9), 2, 3, "max")
    assert s3[0, 0, :8].tolist() == [0, 5, 5, 5, 0, 3, 3, 3] and (s3[0, 0, 8:] == INF).all()
    assert top(s3, 5) == [1, 2, 3, 8, 9]
    assert top(pool_votes(votes, pos, torch.tensor(9), 2, 1, "max"), 5) == [2, 6, 7, 8, 9]
    avg = pool_votes(votes, pos, torch.tensor(9), 2, 3, "avg")[0, 0, :8]
    assert torch.allclose(avg, torch.tensor([0, 5 / 3, 5 / 3, 5 / 3, 0, 1, 4 / 3, 4 / 3]))


def test_snapkv_selects_per_query_head_snapkvpp_per_group():
    """Original SnapKV picks per query head (head 0 keeps 2, head 1 keeps 6); SnapKV++ keeps one set per group."""
    h = torch.tensor([[0, 0, 5, 0, 0, 0, 0, 1.0, 0, 0], [0, 0, 0, 0, 0, 0, 3, 0.0, 0, 0]])
    pos = torch.arange(10).expand(1, 2, 10)
    per_head = pool_votes(h.view(1, 2, 10), pos, torch.tensor(9), 2, 1, "max")
    assert stable_topk(per_head, 3)[0].tolist() == [[2, 8, 9], [6, 8, 9]]
    group = pool_votes(h.sum(0).view(1, 1, 10), pos[:, :1], torch.tensor(9), 2, 1, "max")
    assert top(group, 3) == [2, 8, 9]


def last_view(c, S):
    """The view a one-shot compression scores: the scratch's first S slots with its last block's queries."""
    q, input_pos, query_pos = c.last_step
    return c.view(S, q=q, input_pos=input_pos, query_pos=query_pos)


def scratch_with(T, w, G=2, D=8, kernel=3, seed=0):
    """A one-shot scratch (Hkv=1, G query heads) holding T random tokens, its query ring filled by observe."""
    g = torch.Generator().manual_seed(seed)
    pol = SnapKVPlusPlus(window=w, kernel=kernel)
    c = KVCache(CacheSpec(1, 1, D, T, T, policy=pol, n_heads=G, mode="scratch"))
    q, k, v = torch.randn(1, G, T, D, generator=g), torch.randn(1, 1, T, D, generator=g), torch.randn(1, 1, T, D)
    pos = torch.arange(T)
    c.update(q, k, v, pos, pos)
    c.evict(q, pos, pos)
    return c, pol, q, k


def test_window_votes_are_causal_and_summed_over_the_group():
    T, w, G, D = 10, 4, 2, 8
    c, pol, q, k = scratch_with(T, w, G, D)
    ring_pos = c.layer_state["ring_pos"][0]  # [batch, w]: one sequence
    assert sorted(ring_pos.tolist()) == list(range(T - w, T))  # the ring holds the last w queries
    A = c.view(T).attention(c.layer_state["ring_q"], ring_pos)[:, :, ring_pos.argsort()]  # [1, 1, w, T]
    for i in range(w):
        assert (A[0, 0, i, T - w + i + 1:] == 0).all()
    assert torch.allclose(A.sum(-1), torch.ones(1, 1, w))
    # the spec's pseudo-code, literally: per head softmax with the causal window mask, window columns dropped,
    # summed over window queries and group heads, max-pooled (-inf padding)
    logits = q[0, :, T - w:] @ k[0, 0].T / math.sqrt(D)
    causal = torch.arange(T)[None, :] > torch.arange(T - w, T)[:, None]
    s2 = logits.masked_fill(causal, -INF).softmax(-1)[..., :T - w].sum(1).sum(0)
    s3 = F.max_pool1d(s2.view(1, 1, -1), 3, 1, 1)[0, 0]
    score = pol.score(last_view(c, T))[0, 0]
    assert torch.allclose(score[:T - w], s3, atol=1e-6) and (score[T - w:] == INF).all()


def test_stage1_keeps_the_prompt_budget_in_position_order():
    """Compression keeps exactly P per KV head: selected prefix positions strictly increasing, then the window."""
    T, w, P = 40, 8, 20
    c, pol, _, k = scratch_with(T, w)
    want = top(pol.score(last_view(c, T)), P)
    dst = KVCache(CacheSpec(1, 1, 8, P + 4, 1, policy=pol, n_heads=2, keep=P))
    compress_into(c, dst)
    kept = dst.pos[0, 0, :P].tolist()
    assert kept == want and (dst.pos[0, 0, P:] == -1).all() and kept[-w:] == list(range(T - w, T))
    assert all(a < b for a, b in zip(kept, kept[1:]))
    assert torch.equal(dst.k[0, 0, :P], k[0, 0, kept])  # keys (and values) moved with their positions


def test_prompt_within_budget_is_copied_unchanged():
    T, w = 12, 4
    c, pol, _, k = scratch_with(T, w)
    dst = KVCache(CacheSpec(1, 1, 8, 20, 1, policy=pol, n_heads=2, keep=16))
    compress_into(c, dst)
    assert dst.pos[0, 0, :T].tolist() == list(range(T)) and torch.equal(dst.k[0, 0, :T], k[0, 0])
    assert rocket_params(S=1000, t=1000, D=64, N=10).sparse is False  # t >= S: c = 1, dense


def test_adaptive_kernel_by_prompt_length_and_model():
    llama31, longchat = (SimpleNamespace(rope_scaling={"rope_type": r}) for r in ("llama3", "linear"))
    mistral = SimpleNamespace(rope_scaling=None)
    assert adaptive_kernel(47_999, llama31) == 63 and adaptive_kernel(64_000, llama31) == 511
    assert adaptive_kernel(96 * 1024, mistral) == 63
    assert adaptive_kernel(8_000, longchat) == 63 and adaptive_kernel(16_000, longchat) == 511


# --------------------------------------------------------------------------------------- stage 2: page min/max

KEYS = torch.tensor([[1, -2], [3, 0], [-1, 4], [2, 2], [0, -5]], dtype=torch.float32)


def pages_of(keys, C=8, p=2):
    k = torch.zeros(1, 1, C, 2)
    k[0, 0, :len(keys)] = keys
    valid = (torch.arange(C) < len(keys)).view(1, 1, C)
    return build_pages(k, valid, p), k


def test_page_min_max_build_and_update():
    pages, k = pages_of(KEYS)
    assert pages.shape == (1, 1, 4, 4)
    assert pages[0, 0, :2, :3].T.tolist() == [[1, -2], [-1, 2], [0, -5]]  # min rows, channel-major
    assert pages[0, 0, 2:, :3].T.tolist() == [[3, 0], [2, 4], [0, -5]]  # max rows
    update_page(pages, torch.tensor([4.0, -6]).view(1, 1, 1, 2), torch.tensor([5]), 2)
    assert pages[0, 0, :2, 2].tolist() == [0, -6] and pages[0, 0, 2:, 2].tolist() == [4, -5]
    update_page(pages, torch.tensor([7.0, 8]).view(1, 1, 1, 2), torch.tensor([6]), 2)  # a new page: min = max = key
    assert pages[0, 0, :2, 3].tolist() == [7, 8] and pages[0, 0, 2:, 3].tolist() == [7, 8]
    assert pages[0, 0, :, :2].tolist() == build_pages(k, (torch.arange(8) < 5).view(1, 1, 8), 2)[0, 0, :, :2].tolist()


def test_hybrid_approximate_scores():
    keys = torch.cat([KEYS, torch.tensor([[4.0, -6]])])
    pages, _ = pages_of(keys, C=6)
    Q = torch.tensor([[1.0, -3], [2, -1]]).view(1, 1, 2, 2)
    s, tau = hybrid_scores(Q, pages, 1)
    assert s[0, 0].tolist() == [[6, -6, 18], [2, -2, 6]]
    assert torch.allclose(tau.flatten(), torch.tensor([math.sqrt(2 * 3 / 4), math.sqrt(2 * 1 / 3)]))
    s, tau = hybrid_scores(Q, pages, 2)
    assert s[0, 0].tolist() == [[9, -4, 22], [8, 2, 14]] and torch.allclose(tau, torch.full_like(tau, 2 ** 0.5))
    exact = (Q[0, 0] @ keys.T).view(2, 3, 2)  # [head, page, token]
    assert exact.view(2, 6).tolist() == [[7, 3, -13, -4, 15, 22], [4, 6, -6, 2, 5, 14]]
    assert (s[0, 0] >= exact.amax(-1)).all()
    agg = token_scores(s, tau, torch.ones(1, 1, 6, dtype=torch.bool), 2)
    assert stable_topk(agg, 2)[0, 0].tolist() == [4, 5]


def test_page_score_is_an_upper_bound():
    g = torch.Generator().manual_seed(0)
    D, C, p, G, r = 16, 40, 4, 3, 5
    for _ in range(20):
        k = torch.randn(1, 1, C, D, generator=g)
        Q = torch.randn(1, 1, G, D, generator=g)
        i1 = Q.abs().sum(2).topk(r, -1).indices[0, 0]
        sign = Q[0, 0].sum(0)[i1].sign()
        Q[0, 0][:, i1] = Q[0, 0][:, i1].abs() * sign  # every head agrees with the group-sum sign on i1
        pages = build_pages(k, torch.ones(1, 1, C, dtype=torch.bool), p)
        s, _ = hybrid_scores(Q, pages, r)
        exact = (Q[0, 0][:, i1] @ k[0, 0][:, i1].T).view(G, C // p, p)
        assert (s[0, 0] >= exact.amax(-1) - 1e-5).all()


def test_stable_topk_breaks_ties_to_the_lower_slot():
    """The token top-k is deterministic (A12): equal to a stable descending argsort, on ties, zeros, denormals."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2000, generator=g)
    cases = [x, torch.randint(0, 4, (3, 2000), generator=g).float(), -x.round(), x * 1e-39,
             torch.where(x > 0, 0.0, x.abs() * 1e-39), F.pad(x, (4, 0), value=-INF)]
    for c in cases:
        for k in (1, 10, 500):
            want = c.argsort(dim=-1, descending=True, stable=True)[..., :k].sort().values
            assert torch.equal(stable_topk(c, k), want)
    assert stable_topk(torch.tensor([[0.0, 1, 1, 0, 2, 2]]), 3).tolist() == [[1, 4, 5]]


# -------------------------------------------------------------------- stage 2 through the cache: selection

def rocket_cache(rp, G=2, D=8, n=30, seed=0):
    """A RocketKV cache (Hkv=2) after compression with n random tokens at positions 0..n-1, sorted, pages built."""
    g = torch.Generator().manual_seed(seed)
    pol = RocketKV(window=4)
    pol.rp = rp
    c = KVCache(CacheSpec(1, 2, D, rp.C, 1, policy=pol, n_heads=2 * G, keep=rp.P))
    c.k[:, :, :n] = torch.randn(1, 2, n, D, generator=g)
    c.v[:, :, :n] = torch.randn(1, 2, n, D, generator=g)
    c.pos[:, :, :n] = torch.arange(n, dtype=torch.int32)
    pol.prepare(c.view(c.spec.budget))  # slots already in position order, as after stage 1
    return c, pol, g


def decode_step(c, g, G=2, D=8, n=30):
    q = torch.randn(1, 2 * G, 1, D, generator=g)
    k, v = torch.randn(1, 2, 1, D, generator=g), torch.randn(1, 2, 1, D, generator=g)
    pos = torch.tensor([n])
    keys, values, mask = c.update(q, k, v, pos, pos)
    out = F.scaled_dot_product_attention(q.view(1, 2, G, D), keys, values, attn_mask=mask.expand(1, 2, G, -1))
    return q, keys, values, mask, out


def dense(c, q, G=2, D=8):
    valid = (c.pos[:, :, None, :] >= 0).expand(1, 2, G, -1)
    return F.scaled_dot_product_attention(q.view(1, 2, G, D), c.k, c.v, attn_mask=valid)


def test_selection_shared_by_the_group_equals_dense_over_the_selected():
    rp = rocket_params(S=256, t=16, D=8, N=4)
    assert (rp.C, rp.p, rp.r, rp.k) == (64, 2, 4, 8)
    c, pol, g = rocket_cache(rp)
    q, keys, values, mask, out = decode_step(c, g)
    assert keys.shape == (1, 2, rp.k, 8)  # one selection per KV head, shared by its G query heads
    assert c.pos[0, 0, 30] == 30  # the new token was appended at slot n_valid = 30
    # reference: masked softmax over the full cache restricted to the selected slots
    for h in range(2):
        chosen = torch.isin(c.k[0, h], keys[0, h]).all(-1)
        assert chosen.sum() == rp.k
        ref = F.scaled_dot_product_attention(q.view(1, 2, 2, 8)[:, h], c.k[:, h], c.v[:, h],
                                             attn_mask=chosen.expand(2, -1))
        assert torch.allclose(out[:, h], ref, atol=1e-6)


def test_degenerate_parameters_equal_dense():
    """r = D, p = 1, k = every slot: hybrid attention equals dense attention over the compressed cache."""
    rp = rocket_params(S=64, t=16, D=8, N=4)
    rp = dataclasses.replace(rp, p=1, r=8, k=rp.C, Np=rp.C)
    c, pol, g = rocket_cache(rp)
    for _ in range(2):
        q, keys, values, mask, out = decode_step(c, g, n=int((c.pos[0, 0] >= 0).sum()))
        assert torch.allclose(out, dense(c, q), atol=1e-6)


def test_storage_and_page_arithmetic():
    def params(S, t, **kw):
        rp = rocket_params(S, t, D=128, N=kw.pop("N", 50), **kw)
        return rp.C, rp.p, rp.r, rp.k, rp.Np
    assert params(4096, 256) == (1024, 2, 64, 128, 512)
    assert rocket_params(4096, 256, 128, 50).P == 1024 - 50
    assert rocket_params(4096, 256, 128, 50).approx_tokens == 128
    assert params(65536, 256)[:4] == (4096, 4, 32, 128)
    assert params(96312, 256) == (4965, 5, 33, 128, 993)
    assert round(rocket_params(96312, 256, 128, 50).approx_tokens, 1) == 128.0
    assert params(96312, 256, alpha="icml")[:3] == (1401, 3, 70)
    assert params(96312, 512, alpha="icml")[:3] == (3145, 3, 63)
    assert params(1024, 512)[:4] == (724, 1, 91, 256)
    # spec section 4's worked table (v1)
    assert params(16440, 256)[:3] == (2051, 3, 48) and params(31800, 256)[:3] == (2853, 4, 46)
    assert params(65592, 256)[:3] == (4097, 5, 40) and params(96312, 512)[:3] == (7022, 4, 37)
    assert round(rocket_params(96312, 512, 128, 50).approx_tokens) == 254
    assert params(300, 64, N=200)[0] == 300  # C >= min(2N, S)


def test_storage_and_read_reproduce_the_papers_parameters():
    """--budget C with read = t gives exactly the sizes the paper's parameterisation by t gives (C = sqrt(S t)),
    including C == t (sparse, p = 1); dense only when t >= S or when t exceeds the storage."""
    for S, t, N in [(4096, 256, 50), (96312, 512, 50), (4146, 4145, 50), (300, 64, 200), (1024, 512, 10)]:
        rp = rocket_params(S, t, 128, N)
        assert rocket_sizes(rp.C, t, 128, N, S) == rp
    assert rocket_params(4146, 4145, 128, 50).sparse and rocket_params(4146, 4145, 128, 50).C == 4145
    assert not rocket_sizes(100, 101, 128, 10, 1000).sparse and not rocket_sizes(100, 50, 128, 10, 50).sparse


def test_decode_slot_arithmetic_and_overflow(hf_tiny):
    _, ckpt = hf_tiny("llama")
    model = load_model(ckpt, torch.float32, "cpu")
    prompt, N = ids_of(120), 10
    pol = RocketKV(window=8, kernel=7, read=24)
    C = rocket_params(len(prompt) + N, 24, model.args.head_dim, N).C  # the paper's t = 24: C = sqrt(S t)
    setup(model, pol, C, len(prompt), N, 16, prefill="one-shot")
    P = pol.rp.P
    assert pol.rp.sparse and P < len(prompt) and P == C - N
    generate(model, prompt, 1, block_size=16, steps=EAGER, one_shot=True)  # prefill only
    after_prefill = [(l.attention.kv_cache.pos.clone(), l.attention.kv_cache.k.clone()) for l in model.layers]
    assert all((pos >= 0).sum(-1).eq(P).all() for pos, _ in after_prefill)  # n_valid = P after stage 1
    generate(model, prompt, N, block_size=16, steps=EAGER, one_shot=True)
    c = model.layers[0].attention.kv_cache
    assert c.pos[0, 0, P:P + N - 1].tolist() == list(range(120, 120 + N - 1))  # token n at slot P+n, position T+n
    for l, (pos, k) in zip(model.layers, after_prefill):  # no prompt slot [0, P) is ever overwritten
        c = l.attention.kv_cache
        assert torch.equal(c.pos[:, :, :P], pos[:, :, :P]) and torch.equal(c.k[:, :, :P], k[:, :, :P])
    with pytest.raises(UserError, match="exceed"):
        generate(model, prompt, C - P + 2, block_size=16, steps=EAGER, one_shot=True)


def test_paper_peak_memory_model():
    dense, rocket = paper_peak_memory(96256, 50, 256)
    assert abs(dense / 1e9 - 37.99) < 0.01 and abs(rocket / 1e9 - 26.15) < 0.01
    assert abs(1 - rocket / dense - 0.312) < 0.003
    dense, rocket = paper_peak_memory(96256, 50, 512)
    assert abs(1 - rocket / dense - 0.302) < 0.003
    dense, rocket = paper_peak_memory(96256, 50, 256, mask=False)
    assert abs(1 - rocket / dense - 0.41) < 0.01
    dense, rocket = paper_peak_memory(96256, 50, 256, alpha="icml")
    assert abs(1 - rocket / dense - 0.326) < 0.003


def test_exact_topk_is_dense_at_large_k_and_each_query_heads_argmax_at_k_1():
    g = torch.Generator().manual_seed(1)
    pol = ExactTopK()
    c = KVCache(CacheSpec(1, 2, 8, 20, 1, policy=pol, n_heads=4))
    c.k[:, :, :12], c.v[:, :, :12] = torch.randn(2, 1, 2, 12, 8, generator=g)
    c.pos[:, :, :12] = torch.arange(12, dtype=torch.int32)
    q = torch.randn(1, 4, 1, 8, generator=g)
    pos = torch.tensor([12])
    pol.k = 32  # >= n_valid: dense
    keys, values, mask = c.update(q, *torch.randn(2, 1, 2, 1, 8, generator=g), pos, pos)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    assert torch.allclose(out, dense(c, q).view(1, 4, 1, 8), atol=1e-6)
    pol.k = 1  # one token per query head: the value of its argmax logit
    keys, values, mask = pol_step = c.gather(pol.select(c.view(c.spec.budget, q=q, input_pos=pos, query_pos=pos)), pos)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    best = (q.view(1, 2, 2, 8) @ c.k[:, :, :13].transpose(-1, -2)).argmax(-1)  # [1, 2, G]
    want = torch.stack([c.v[0, h, best[0, h]] for h in range(2)]).view(1, 4, 1, 8)
    assert torch.allclose(out, want) and pol_step[0].shape == (1, 4, 1, 8)


# ----------------------------------------------------------------------------------- the engine, tiny model

def ids_of(n, seed=3, vocab=512):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(model, name, prompt, N, t, block=16, steps=EAGER, k=None, device="cpu"):
    """One-shot generation with policy `name` at the paper's token budget t: rocketkv holds C = sqrt(S t) slots
    (the paper's even split) and reads t per step, exact-topk holds everything and attends its top t, snapkv++
    holds t slots. k overrides RocketKV's top-k."""
    S, D = len(prompt) + N, model.args.head_dim
    pol = make_policy(name, dict(window=8))
    if name == "rocketkv":
        pol, C = policies.RocketKV(window=8, read=t), policies.rocket_params(S, t, D, N).C
    elif name == "exact-topk":
        pol, C = policies.ExactTopK(k=t), S
    else:
        C = S if name == "full" else t
    setup(model, pol, C, len(prompt), N, block, prefill="one-shot")
    if k is not None:
        pol.rp = dataclasses.replace(pol.rp, k=k)
    out, _ = generate(model, prompt, N, block_size=block, steps=steps, one_shot=True, device=device)
    return out, pol


@pytest.fixture(scope="module")
def tiny(hf_tiny):
    _, ckpt = hf_tiny("llama")
    return load_model(ckpt, torch.float32, "cpu")


def test_stage2_with_every_slot_selected_equals_dense_over_the_kept_cache(tiny):
    """k = C (every slot): RocketKV's decode attends exactly the cache SnapKV++ (stage 1 alone, dense attention)
    keeps with the same P, so the greedy tokens and the kept positions are identical."""
    prompt, N = ids_of(150, seed=4), 20
    out_r, pol = run(tiny, "rocketkv", prompt, N, 24, k=10 ** 6)
    C, P = pol.rp.C, pol.rp.P
    assert pol.rp.sparse and P < len(prompt) and "pages" in tiny.layers[0].attention.kv_cache.layer_state
    kept_r = [l.attention.kv_cache.pos.clone() for l in tiny.layers]
    out_s, pol_s = run(tiny, "snapkv++", prompt, N, C)
    assert pol_s.prompt_keep(policies.Run(C, len(prompt), N)) == P
    assert out_r == out_s
    assert all(torch.equal(a, l.attention.kv_cache.pos) for a, l in zip(kept_r, tiny.layers))


def compare_with_reference(model, spec, budget, T, N, seed):
    """Engine (one-shot prefill, N eager greedy decode steps) and the independent reference side by side."""
    a = model.args
    ids = ids_of(T, seed)
    pol = policies.make(spec)
    setup(model, pol, budget, T, N, 16, prefill="one-shot")
    ref = RefModel(model, budget=10 ** 9, policy_name=None)
    if isinstance(pol, ExactTopK):
        sizes = dict(exact_k=pol.k)
    else:
        sizes = dict(window=pol.window, kernel=pol.run_kernel, rp=pol.rp, local_window=pol.local_window)
    ref.layers = [RefRocketLayer(a.n_heads, a.n_kv_heads, a.head_dim, **sizes) for _ in range(a.n_layers)]
    one_shot_equals_reference(model, ref, ids, N, 16, spec)
    return pol


@pytest.mark.parametrize("spec,budget,T,N", [
    ("rocketkv:read=16,window=8,kernel=7", 64, 150, 24),      # pages of 2, the paper's even split
    ("rocketkv:read=12,window=8", 96, 150, 24),               # the adaptive kernel (63), pages of 2
    ("rocketkv:read=10,window=4,kernel=5,local_window=3", 72, 120, 20),  # the 3 newest always attended
    ("rocketkv:read=1000,window=8,kernel=7", 64, 150, 12),    # read >= budget: dense over the kept cache
    ("exact-topk:k=8", 150 + 24, 150, 24),
    ("exact-topk:k=1", 100 + 8, 100, 8),
])
def test_engine_equals_the_independent_reference(tiny, spec, budget, T, N):
    pol = compare_with_reference(tiny, spec, budget, T, N, seed=budget + T)
    if isinstance(pol, RocketKV):
        assert pol.rp.P < T  # the prompt was compressed
        assert pol.rp.sparse == ("read=1000" not in spec)


@pytest.mark.parametrize("slack", [0, 20])
@pytest.mark.parametrize("name", ["rocketkv", "snapkv++", "exact-topk"])
def test_budget_covering_the_context_reproduces_full(tiny, name, slack):
    """t >= S: no compression (c = 1), dense decode (spec 11.4); the same greedy tokens as `full`."""
    prompt, N = ids_of(100, seed=5), 16
    ref, _ = run(tiny, "full", prompt, N, 0)
    out, _ = run(tiny, name, prompt, N, len(prompt) + N + slack)
    assert out == ref


@pytest.mark.parametrize("name", ["snapkv++", "exact-topk"])
def test_padding_past_prompt_plus_new_tokens_reproduces_full(tiny, name):
    """A prompt of 100 in blocks of 16 pads to 112 scratch slots, more than the 100 + 4 an uncompressed cache
    holds: the one-shot compression drops only the padding (Exact-TopK has no scores to drop by)."""
    prompt, N = ids_of(100, seed=5), 4
    ref, _ = run(tiny, "full", prompt, N, 0)
    out, _ = run(tiny, name, prompt, N, len(prompt) + N)
    assert out == ref


def test_small_budget_compresses_and_differs_from_full(tiny):
    """The negative control: at t = 16 RocketKV keeps P < T prompt tokens and attends k = 8 per step."""
    prompt, N = ids_of(200, seed=6), 24
    out, pol = run(tiny, "rocketkv", prompt, N, 16)
    c = tiny.layers[0].attention.kv_cache
    assert pol.rp.k == 8 and (c.n_valid() == pol.rp.P + N - 1).all() and pol.rp.P < 200
    assert c.read_tokens() == pol.rp.k + pol.rp.approx_tokens


@pytest.mark.cuda
def test_cuda_decode_replays_as_a_cuda_graph(hf_tiny):
    """On CUDA the decode step compiles with mode="reduce-overhead": RocketKV's step (in-place page update, hybrid
    top-k, gathered sparse attention) must be captured as a CUDA graph (inductor skips none) and equal eager."""
    from torch._dynamo.utils import counters
    _, ckpt = hf_tiny("qwen2")
    model = load_model(ckpt, torch.float32, "cuda")
    prompt, N = ids_of(200, seed=7), 40
    out_e, _ = run(model, "rocketkv", prompt, N, 32, device="cuda")
    counters.clear()
    out_c = generate_compiled(model, prompt, N, 16, one_shot=True, device="cuda")
    assert out_c == out_e and len(out_c) == N
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


def test_cli_defaults_to_one_shot_and_refuses_block_prefill(tiny_ckpt, capsys):
    import json
    import generate as cli
    base = ["--checkpoint", str(tiny_ckpt), "--prompt", "the quick brown fox jumps over the lazy dog, " * 6,
            "--max-new-tokens", "8", "--budget", "40", "--no-chat"]
    assert cli.main(base + ["--policy", "rocketkv:read=16,window=8", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["prefill"] == "one-shot" and stats["budget"] == stats["slots"] == 40
    assert stats["prompt_tokens"] > 40
    rp = rocket_sizes(40, 16, 16, 8, stats["prompt_tokens"] + 8)  # C = --budget, t = read: k = 8 + the page scan
    assert stats["slots_read_per_step"] == rp.k + rp.approx_tokens < 16 + 1
    assert cli.main(base + ["--policy", "snapkv++", "--prefill", "block"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--prefill one-shot" in err[0]
