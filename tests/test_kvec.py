"""K-VEC: the hand-checkable cases of its implementation spec (T1-T23) on the equation functions, a bare scratch
cache and the cache's own keep rule; then the engine on tiny random GQA models against an independent dynamic-shape
reference (tests/reference/kvec.py: plain loops and sorts: kept positions per layer and KV head, the
coverage counter, logits over decode steps), the reduction to SnapKV (lambda = 0, delta = 0 == snapkv++), a budget >=
the prompt == `full` and the parameter errors (compiled == eager: test_conformance.py).
"""
import json

import pytest
import torch
import policies
import torch.nn.functional as F

from cache import CacheSpec, KVCache, compress_into
from engine import block_inputs, generate, prefill_one_shot, setup
from runtime import model_step, prefill_step
from model import ModelArgs, Transformer
from policies import (KVec, PolicyError, Run, SnapKVPlusPlus, biased_scores, cross_head, focus, head_spread, kept_any,
                      kvec_coverage, pool_votes, window_means)
from reference.kvec import ref_layer, reference_for
from test_cli import tiny_ckpt  # noqa: F401  (fixture)

EAGER = (prefill_step, model_step)
INF = float("inf")


pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------- the spec's cases on the equations

def select(P, I, n, layer, W, B, lam, beta, kernel=1, pin=INF):
    """One KV head, one layer, scores given (spec T7, T8, T10, T23): the engine's pooling / focus / bias / pin
    functions, then the cache's own drop_to keeps B of the T slots. Returns (kept positions, P' on candidates)."""
    T = len(P)
    pos = torch.arange(T, dtype=torch.int32).view(1, 1, T)
    Pp = pool_votes(torch.tensor(P).view(1, 1, T), pos, torch.tensor(T - 1), W, kernel, "max")
    cand = pos < T - W
    K = min(int(beta * B), B - W)
    f = focus(torch.tensor(I).view(1, 1, T), torch.tensor(n).view(1, 1, T), layer)
    scores = biased_scores(Pp, f, cand, pos, lam, K, pin)
    c = KVCache(CacheSpec(1, 1, 1, B, T - B))
    c.pos.copy_(pos)
    c.drop_to(B, scores)
    return sorted(c.pos[0, 0, :B].tolist()), scores[0, 0, :T - W].tolist()


def test_window_score_and_causal_mask():
    """q = k = 0: each query attends uniformly to its causal prefix; O = 2 -> P = [7/24, 7/24, 7/24, 1/8]."""
    pol = KVec(obs_window=2, long_window=2)
    c = KVCache(CacheSpec(1, 1, 1, 4, 4, policy=pol, n_heads=1, mode="scratch"))
    pos = torch.arange(4)
    c.update(torch.zeros(1, 1, 4, 1), torch.zeros(1, 1, 4, 1), torch.zeros(1, 1, 4, 1), pos, pos)
    c.evict(torch.zeros(1, 1, 4, 1), pos, pos)  # observe: the query ring keeps the last max(O, O') = 2 queries
    ring_pos = c.layer_state["ring_pos"]
    A = c.view(4).attention(c.layer_state["ring_q"], ring_pos, group_mean=False)
    P, P2, I = window_means(A, ring_pos, 2, 2)
    assert torch.allclose(P[0, 0], torch.tensor([7 / 24, 7 / 24, 7 / 24, 1 / 8]))
    assert torch.allclose(P2, P) and torch.allclose(I[0], P[0, 0])  # one head: max over heads = the head


def test_gqa_group_mean_and_importance_max_over_query_heads():
    rows = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]])
    A = rows.view(1, 2, 2, 1, 3)  # [B, H_kv, G, R, S]: query head h -> KV head h // 2
    P, _, I = window_means(A, torch.tensor([2]), 1, 1)
    assert torch.allclose(P[0], torch.tensor([[0.40, 0.25, 0.35], [0.20, 0.55, 0.25]]))
    assert torch.allclose(I[0], torch.tensor([0.6, 0.8, 0.6]))  # not max over the KV scores [0.40, 0.55, 0.35]


def test_importance_is_max_then_mean():
    A = torch.tensor([[[0.9, 0.1], [0.1, 0.9]], [[0.5, 0.5], [0.5, 0.5]]]).view(1, 1, 2, 2, 2)
    P, _, I = window_means(A, torch.tensor([0, 1]), 2, 2)
    assert torch.allclose(I[0], torch.tensor([0.7, 0.7]))
    assert torch.allclose(P[0, 0], torch.tensor([0.5, 0.5]))  # mean-then-max would give 0.5


def test_lowest_std_heads_take_the_long_window():
    P = torch.tensor([[.25, .25, .25, .25], [.7, .1, .1, .1], [.4, .3, .2, .1]]).view(1, 3, 4)
    cand = torch.ones(1, 3, 4, dtype=torch.bool)
    assert torch.allclose(head_spread(P, cand)[0], torch.tensor([0.0, 0.2598, 0.1118]), atol=1e-4)
    P2 = torch.tensor([0.1, 0.2, 0.3, 0.4]).expand(1, 3, 4)

    def replaced(delta):
        out = cross_head(P, P2, cand, delta)[0]
        return [h for h in range(3) if torch.equal(out[h], P2[0, h])]
    assert replaced(0) == [] and replaced(1) == [0] and replaced(2) == [0, 2] and replaced(5) == [0, 1, 2]
    assert torch.equal(cross_head(P, P, cand, 1), P)  # O' = O: P2 == P, nothing changes
    # sigma over candidates only: a huge non-candidate value (a window slot) must not make head 0 look focused
    wide = torch.cat([P, torch.tensor([INF, 0, 0]).view(1, 3, 1)], -1)
    wide_cand = torch.cat([cand, torch.zeros(1, 3, 1, dtype=torch.bool)], -1)
    assert torch.allclose(head_spread(wide, wide_cand), head_spread(P, cand))


def test_coverage_and_focus():
    I, n = torch.tensor([0.6, 0.3, 0.3]), torch.tensor([2, 1, 0])
    assert torch.allclose(focus(I, n, 2), torch.tensor([0.2, 0.2, 0.3]))
    assert torch.equal(focus(I, torch.zeros(3, dtype=torch.long), 0), I)


def test_one_layer_scores_pool_focus_and_pins():
    P = [0.30, 0.20, 0.05, 0.10, 0.15, 0.02, 0, 0]
    I = [0.40, 0.30, 0.10, 0.28, 0.20, 0.05, 0, 0]
    n = [1, 1, 0, 0, 1, 0, 0, 0]
    kept, Pp = select(P, I, n, 1, W=2, B=4, lam=1.0, beta=0.25)
    assert kept == [0, 3, 6, 7]
    assert Pp[0] == INF and torch.allclose(torch.tensor(Pp[1:]), torch.tensor([0.35, 0.15, 0.38, 0.25, 0.07]))
    assert select(P, I, n, 1, W=2, B=4, lam=1.0, beta=0.5)[0] == [0, 1, 6, 7]  # K = 2 pins {0, 1}
    assert select(P, I, n, 1, W=2, B=4, lam=0.0, beta=0.25)[0] == [0, 1, 6, 7]  # SnapKV


def test_pin_value_inf_against_the_papers_one():
    P, I = [0.5, 0.45, 0], [0.1, 0.9, 0]
    kept, Pp = select(P, I, [0, 0, 0], 0, W=1, B=2, lam=1.0, beta=0.5)
    assert kept == [0, 2] and Pp == [INF, pytest.approx(1.35)]
    assert select(P, I, [0, 0, 0], 0, W=1, B=2, lam=1.0, beta=0.5, pin=1.0)[0] == [1, 2]  # 1.35 > 1.0


def test_counter_counts_a_token_once_per_layer():
    pos = torch.tensor([[0, 3, 6, 7, -1], [0, 2, 6, 7, -1]]).view(1, 2, 5)
    assert kept_any(pos, 8)[0].tolist() == [1, 0, 1, 1, 0, 0, 1, 1]  # 0 is +1, not +2; empty slots add nothing


def run_T10(lam):
    P, I = [0.30, 0.25, 0.20, 0.05, 0.05, 0], [0.30, 0.25, 0.20, 0.10, 0.05, 0]
    n = torch.zeros(1, 6, dtype=torch.int32)
    rows = []
    for layer in range(3):
        kept, Pp = select(P, I, n[0].tolist(), layer, W=1, B=3, lam=lam, beta=0.0)
        rows.append((Pp, kept))
        n += kept_any(torch.tensor(kept).view(1, 1, 3), 6)
    return rows, n[0].tolist()


def test_three_layer_recursion_raises_coverage():
    rows, n = run_T10(1.0)
    want = [([0.60, 0.50, 0.40, 0.15, 0.10], [0, 1, 5]),
            ([0.45, 0.375, 0.40, 0.15, 0.10], [0, 2, 5]),
            ([0.40, 0.25 + 0.25 * 2 / 3, 0.20 + 0.20 * 2 / 3, 0.15, 0.10], [0, 1, 5])]
    for (Pp, kept), (want_Pp, want_kept) in zip(rows, want):
        assert kept == want_kept and torch.allclose(torch.tensor(Pp), torch.tensor(want_Pp))
    assert n == [3, 2, 1, 0, 0, 3] and sum(c > 0 for c in n) / 6 == pytest.approx(4 / 6)  # coverage 66.7%
    rows, n = run_T10(0.0)
    assert all(kept == [0, 1, 5] for _, kept in rows)
    assert n == [3, 3, 0, 0, 0, 3] and sum(c > 0 for c in n) / 6 == 0.5  # SnapKV: 3/6


def test_max_pooling_and_snapkv_without_pooling():
    one_hot = torch.zeros(1, 1, 10)
    one_hot[0, 0, 3] = 1
    pos = torch.arange(10).view(1, 1, 10)
    assert pool_votes(one_hot, pos, torch.tensor(9), 0, 7, "max")[0, 0].tolist() == [1] * 7 + [0] * 3
    scores = [0.10, 0.50, 0.05, 0.30, 0.20, 0.01, 0.02, 0.40, 0, 0]
    assert select(scores, [0] * 10, [0] * 10, 0, W=2, B=5, lam=0.0, beta=0.0)[0] == [1, 3, 7, 8, 9]


# ------------------------------------------------------ scratch compression against the reference of one layer

DEFAULTS = dict(W=16, O=16, O2=32, delta=3, lam=1.0, beta=0.25, kernel=7, pin=INF)


def kvec(p):
    return KVec(window=p["W"], obs_window=p["O"], long_window=p["O2"], delta=p["delta"], lam=p["lam"],
                beta=p["beta"], kernel=p["kernel"], pin_value=p["pin"])


def random_scratch(pol, T, Hkv=2, G=2, D=8, block=None, seed=0):
    """A one-shot scratch of `pol` holding T random tokens, written in blocks as prefill_one_shot does (the last one
    padded), its query ring filled by observe. Returns (scratch, q, k, v) with q, k, v [H, T, D]."""
    g = torch.Generator().manual_seed(seed)
    block = block or T
    n_blocks = -(-T // block)
    S = n_blocks * block
    scratch = KVCache(CacheSpec(1, Hkv, D, S, block, policy=pol, n_heads=Hkv * G, mode="scratch"))
    q, k, v = (torch.randn(1, H, S, D, generator=g) for H in (Hkv * G, Hkv, Hkv))
    for b in range(n_blocks):
        _, pos = block_inputs(torch.zeros(T, dtype=torch.long), b * block, block)
        qp = torch.where(pos >= 0, pos, T - 1)
        blk = slice(b * block, (b + 1) * block)
        scratch.update(q[:, :, blk], k[:, :, blk], v[:, :, blk], pos, qp)
        scratch.evict(q[:, :, blk], pos, qp)
    return scratch, q[0, :, :T], k[0, :, :T], v[0, :, :T]


def compress_random(T, B, p, Hkv=2, G=2, D=8, block=None, seed=0):
    """A random scratch compressed by K-VEC with parameters p into a fresh destination cache (--budget B + 1: B
    prompt slots and one new token), as layer 0. Returns (the engine's cross-layer state, dst, q, k, v)."""
    pol = kvec(p)
    run = Run(B + 1, T, 1, block or T)
    pol.plan(run)
    scratch, q, k, v = random_scratch(pol, T, Hkv, G, D, block, seed)
    dst = KVCache(CacheSpec(1, Hkv, D, B + 1, block or T, policy=pol, n_heads=Hkv * G, keep=pol.prompt_keep(run)))
    shared = {}
    compress_into(scratch, dst, shared)
    return shared, dst, q, k, v


def kept_sets(cache):
    return [sorted(x for x in cache.pos[0, h].tolist() if x >= 0) for h in range(cache.pos.shape[1])]


@pytest.mark.parametrize("p,B,block", [
    (dict(DEFAULTS, W=4, O=4, O2=8, delta=1), 16, 16),
    (dict(DEFAULTS, W=4, O=4, O2=8, delta=1, kernel=1, pin=1.0, lam=3.0), 12, 7),
    (DEFAULTS, 24, 64),
])
def test_scratch_compression_equals_the_reference_and_keeps_its_invariants(p, B, block):
    """A random layer (T = 40, Hq = 4, Hkv = 2): the engine keeps the reference's sets; every head holds exactly B
    tokens, the last W among them, no position twice, every pinned token; block padding is never counted."""
    T = 40
    shared, dst, q, k, v = compress_random(T, B, p, block=block)
    n_ref = [0] * T
    want, pins = ref_layer(q, k, 0, n_ref, B, p)
    got = kept_sets(dst)
    assert got == want
    for h, kept in enumerate(got):
        assert len(kept) == B == len(set(kept)) and set(range(T - p["W"], T)) <= set(kept)
        assert set(pins[h]) <= set(kept) or p["pin"] != INF  # the paper's pin value 1.0 can lose (T8)
    assert shared["n_cov"][0, :T].tolist() == n_ref and (shared["n_cov"][0, T:] == 0).all()
    assert kvec_coverage(shared).item() == pytest.approx(sum(c > 0 for c in n_ref) / T)
    assert dst.pos[0, :, :B].tolist() == got  # slots sorted by position (A18), new tokens go after them


def test_kept_keys_and_values_attend_like_the_masked_full_prompt():
    T, B = 30, 10
    _, dst, q, k, v = compress_random(T, B, dict(DEFAULTS, W=4, O=4, O2=8))
    kept = torch.zeros(2, T, dtype=torch.bool)
    for h, s in enumerate(kept_sets(dst)):
        kept[h, s] = True
    qd = torch.randn(1, 4, 1, 8)
    compact = F.scaled_dot_product_attention(qd.view(1, 2, 2, 8), dst.k[:, :, :B], dst.v[:, :, :B])
    masked = F.scaled_dot_product_attention(qd.view(1, 2, 2, 8), k[None], v[None], attn_mask=kept[None, :, None])
    assert torch.allclose(compact, masked, atol=1e-6)
    assert torch.equal(dst.k[0, 0, :B], k[0, kept_sets(dst)[0]])


def test_short_prompt_keeps_everything_and_counts_it():
    """T = 5 <= B = 8: nothing is dropped; slots 0..4 hold positions 0..4, the rest are empty; n = 1 after layer 0.
    With block padding (scratch of 16 slots > B) the scores run but can only drop the padding: same result."""
    for block in (5, 16):
        shared, dst, q, k, v = compress_random(5, 8, dict(DEFAULTS, W=2, O=2, O2=4), block=block)
        assert dst.pos[0, :, :5].tolist() == [list(range(5))] * 2 and (dst.pos[0, :, 5:] == -1).all()
        assert shared["n_cov"][0, :5].tolist() == [1] * 5 and (shared["n_cov"][0, 5:] == 0).all()


def test_huge_lambda_makes_every_head_keep_the_same_set():
    _, dst, *_ = compress_random(40, 12, dict(DEFAULTS, W=4, O=4, O2=8, delta=0, beta=0.0, lam=1e6))
    a, b = kept_sets(dst)
    assert a == b
    _, dst, *_ = compress_random(40, 12, dict(DEFAULTS, W=4, O=4, O2=8, delta=0, beta=0.0, lam=0.0))
    a, b = kept_sets(dst)
    assert a != b  # the control: without the shared focus term the heads differ


@pytest.mark.parametrize("O2", [4, 32])
@pytest.mark.parametrize("beta", [0.0, 0.25, 1.0])
def test_lambda_zero_without_cross_head_is_snapkv(beta, O2):
    """Seeded random layer (T = 64, Hq = 8, Hkv = 2, B = 16, W = O = 4, max-pool 7): K-VEC with lambda = 0 and delta = 0
    (any beta, any O') keeps exactly what snapkv++ keeps with the same window, kernel and prompt slots."""
    p = dict(DEFAULTS, W=4, O=4, O2=O2, delta=0, lam=0.0, beta=beta)
    for seed in range(3):
        _, dst, *_ = compress_random(64, 16, p, Hkv=2, G=4, block=16, seed=seed)
        snap = SnapKVPlusPlus(window=4, kernel=7)
        run = Run(17, 64, 1, 16)
        snap.plan(run)
        assert snap.prompt_keep(run) == 16
        scratch, *_ = random_scratch(snap, 64, Hkv=2, G=4, block=16, seed=seed)  # the same tokens and queries
        snap_dst = KVCache(CacheSpec(1, 2, 8, 17, 16, policy=snap, n_heads=8, keep=16))
        compress_into(scratch, snap_dst)
        assert kept_sets(dst) == kept_sets(snap_dst)


# ------------------------------------------------------------------------ the engine against the reference

def random_gqa_model(n_layers=4, seed=0):
    """A random Llama-style model (Hq = 4, Hkv = 2, head_dim 16) with 4 layers, so the counter reaches n = 3."""
    args = ModelArgs(vocab_size=256, dim=64, n_layers=n_layers, n_heads=4, n_kv_heads=2, head_dim=16,
                     intermediate_size=128, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=1024)
    g = torch.Generator().manual_seed(seed)
    model = Transformer(args)
    with torch.no_grad():
        for name, t in model.named_parameters():
            t.copy_(1 + 0.1 * torch.randn(t.shape, generator=g) if "norm" in name else
                    0.15 * torch.randn(t.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="module")
def gqa_model():
    return random_gqa_model()


def ids_of(n, seed=3, vocab=256):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine_kept(model):
    return [kept_sets(layer.attention.kv_cache) for layer in model.layers]


ENGINE_CASES = [
    (DEFAULTS, 150, 48, 16),
    (dict(DEFAULTS, W=8, O=8, O2=16, delta=1), 150, 24, 16),
    (dict(DEFAULTS, W=8, O=8, O2=24, delta=1, lam=2.0, pin=1.0, kernel=3, beta=0.5), 131, 20, 32),
    (dict(DEFAULTS, W=8, O=8, delta=0, lam=0.0), 120, 24, 16),
    (DEFAULTS, 40, 48, 16),  # the prompt fits: nothing dropped
]


@pytest.mark.parametrize("p,T,B,block", ENGINE_CASES)
def test_engine_equals_reference(gqa_model, p, T, B, block):
    """One-shot prefill then 6 decode steps: the engine's kept positions per layer and KV head, the coverage counter
    and the logits of every step equal the independent reference's."""
    model, ids, n_decode = gqa_model, ids_of(T), 6
    pol = kvec(p)  # B prompt slots, and room for the new tokens: --budget B + n_decode + 1
    setup(model, pol, B + n_decode + 1, T, n_decode + 1, block, prefill="one-shot")
    ref, counter = reference_for(model, T, B, p)
    shared = {}
    with torch.inference_mode():
        logits = prefill_one_shot(model, torch.tensor(ids), block, shared)
        ref_logits = ref.block(ids, range(T))
        assert engine_kept(model) == ref.kept()
        assert shared["n_cov"][0, :T].tolist() == counter
        assert torch.allclose(logits[0], ref_logits, atol=1e-4)
        for i, layer in enumerate(ref.layers):  # every pinned token survived (with pins at +inf)
            for h, pins in enumerate(layer.pins):
                assert set(pins) <= set(engine_kept(model)[i][h]) or p["pin"] != INF
        for t in range(n_decode):
            tok = int(logits[0].argmax())
            logits = model_step(model, torch.tensor([[tok]]), torch.tensor([T + t]))
            ref_logits = ref.block([tok], [T + t])
            assert torch.allclose(logits[0], ref_logits, atol=1e-4), f"decode step {t}"
        assert engine_kept(model) == ref.kept()  # the new tokens were appended at positions T, T + 1, ...
    if T > B:
        assert all(len(h) == B + n_decode for layer in engine_kept(model) for h in layer)
        assert model.layers[0].attention.kv_cache.pos[0, 0, B].item() == T  # T16(c): first decode token at T


def test_coverage_modules_change_the_choice_and_coverage_is_measured(gqa_model):
    """The negative control of the reference comparison: K-VEC's defaults keep other sets than its lambda = 0,
    delta = 0 reduction. coverage() (A23) is the share of prompt positions some layer and head kept, counted here
    from the kept sets. (Whether coverage rises is an empirical claim about trained models: on this random model
    the shared focus term pulls the two heads of a layer together, the paper's Fig. 4 "dark dots", and it falls.)"""
    T, B = 150, 32
    kept = {}
    for lam, delta in [(1.0, 3), (0.0, 0)]:
        pol = kvec(dict(DEFAULTS, lam=lam, delta=delta))
        setup(gqa_model, pol, B + 1, T, 1, 16, prefill="one-shot")
        shared = {}
        with torch.inference_mode():
            prefill_one_shot(gqa_model, torch.tensor(ids_of(T)), 16, shared)
        kept[lam] = engine_kept(gqa_model)
        covered = {t for layer in kept[lam] for head in layer for t in head}
        assert kvec_coverage(shared).item() == pytest.approx(len(covered) / T)
    assert kept[1.0] != kept[0.0]


def test_lambda_zero_without_cross_head_equals_snapkv_on_the_engine(gqa_model):
    """lambda = 0, delta = 0, W = O = snapkv++'s window, kernel 7: the same kept sets and tokens as snapkv++ with the
    same prompt slots (snapkv++ --budget = K-VEC's B + the new tokens)."""
    T, B, N = 150, 24, 8
    ids = ids_of(T, seed=5)
    pol = kvec(dict(DEFAULTS, W=8, O=8, delta=0, lam=0.0))
    setup(gqa_model, pol, B + N, T, N, 16, prefill="one-shot")
    out_k, _ = generate(gqa_model, ids, N, block_size=16, steps=EAGER, one_shot=True)
    kept_k = engine_kept(gqa_model)
    snap = SnapKVPlusPlus(window=8, kernel=7)
    setup(gqa_model, snap, B + N, T, N, 16, prefill="one-shot")
    out_s, _ = generate(gqa_model, ids, N, block_size=16, steps=EAGER, one_shot=True)
    assert out_k == out_s and kept_k == engine_kept(gqa_model)


def test_repeated_prompts_restart_the_counter(gqa_model):
    """Layer numbering survives several prompts on the same caches (no re-plan): the second prompt's kept sets and
    counter equal those of a fresh run."""
    T, B = 100, 24
    p = dict(DEFAULTS, W=8, O=8, O2=16, delta=1)

    def run(prompts):
        setup(gqa_model, kvec(p), B + 2, T, 2, 16, prefill="one-shot")
        for ids in prompts:
            shared = {}
            generate(gqa_model, ids, 2, block_size=16, steps=EAGER, one_shot=True, shared=shared)
        return engine_kept(gqa_model), shared["n_cov"].clone()
    fresh_kept, fresh_n = run([ids_of(T, seed=12)])
    again_kept, again_n = run([ids_of(T, seed=11), ids_of(T, seed=12)])
    assert again_kept == fresh_kept and torch.equal(again_n, fresh_n)


# ------------------------------------------------------------------------------- full, compile, parameters

def test_budget_covering_the_prompt_reproduces_full(gqa_model):
    """T16(a, b): B >= T drops nothing: every step's logits equal `full`'s; with B < T the first token's logits are
    still `full`'s (compression happens after the prompt's attention)."""
    T, N = 90, 10
    ids = ids_of(T, seed=8)

    def logits_of(policy, budget):
        setup(gqa_model, policy, budget, T, N, 16, prefill="one-shot")
        out = []
        with torch.inference_mode():
            logits = prefill_one_shot(gqa_model, torch.tensor(ids), 16)
            for t in range(N):
                out.append(logits[0])
                logits = model_step(gqa_model, logits.argmax(-1).view(1, 1), torch.tensor([T + t]))
        return torch.stack(out)
    full = logits_of(None, T + N)
    for B in (T, T + 7):  # B prompt slots: --budget B + N
        assert torch.allclose(logits_of(KVec(), B + N), full, atol=1e-5)
    small = logits_of(KVec(), 24 + N)
    assert torch.allclose(small[0], full[0], atol=1e-5) and not torch.allclose(small, full, atol=1e-3)


@pytest.mark.parametrize("spec,budget,message", [
    ("kvec:lam=-1", 64, "lam must be finite and >= 0"),
    ("kvec:lam=inf", 64, "lam must be finite and >= 0"),
    ("kvec:lam=nan", 64, "lam must be a number"),
    ("kvec:delta=-1", 64, "delta must be >= 0"),
    ("kvec:beta=1.5", 64, "beta must be in"),
    ("kvec:window=-1", 64, "window must be >= 0"),
    ("kvec:obs_window=0", 64, "obs_window >= 1"),
    ("kvec:long_window=8", 64, "long_window >= obs_window"),
    ("kvec:kernel=4", 64, "kernel must be odd"),
    ("kvec:pin_value=0", 64, "pin_value must be > 0"),
    ("kvec", 17, "must exceed the recent window"),
])
def test_bad_parameters(spec, budget, message):
    with pytest.raises(PolicyError, match=message):
        policies.make(spec).plan(Run(budget, 100, 1))


def test_cli_runs_kvec_one_shot_and_refuses_a_bad_parameter(tiny_ckpt, capsys):  # noqa: F811
    import generate as cli
    base = ["--checkpoint", str(tiny_ckpt), "--prompt", "the quick brown fox jumps over the lazy dog, " * 6,
            "--max-new-tokens", "8", "--budget", "32", "--no-chat"]
    assert cli.main(base + ["--json", "--policy", "kvec:delta=1"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["prefill"] == "one-shot" and stats["prompt_tokens"] > 24 and stats["slots"] == 32
    assert cli.main(base + ["--policy", "kvec:beta=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "beta" in err[0]
