"""SAGE-KV: the hand-checkable cases of its implementation spec (T1-T9, T11-T13) on the size rule
and a bare KVCache, then the engine on tiny random GQA models against an independent dynamic-shape reference
(tests/reference/sagekv.py: every token kept in plain tensors, each query head's visible
positions an explicit set): which positions every query head attends and the logits, step by step over >= 64 decode
steps.
Then `full` equivalence and the CLI (compiled == eager: test_conformance.py).

The engine keeps B - 1 slots between steps and writes the current token to the tail slot (policies.SageLayout), so
a stored ring holds W - 1 tokens where the spec's holds W; what any query attends is the same (the spec's oldest
ring token is overwritten before the next query runs). Slot-level expectations below are the engine's; attended
sets and outputs are the spec's.
"""
from types import SimpleNamespace

import pytest
import torch
from conftest import make_policy, one_shot_equals_reference
import torch.nn.functional as F

from cache import CacheSpec, KVCache, compress_into
from engine import prefill_one_shot, setup
from runtime import model_step, prefill_step
from loading import load_model
from model import ModelArgs, Transformer
from policies import PolicyError, Run, SageKV, SageLayout, sage_sizes
from reference.model import RefModel
from reference.sagekv import RefSageLayer, ref_sizes, reference_attend, reference_selection
from test_cli import tiny_ckpt  # noqa: F401  (fixture)

EAGER = (prefill_step, model_step)


pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------------------- T1: the size rule

def test_size_rule_matches_the_papers_table():
    """Spec 1.2's table (S / k / W; the B = 8192 rows are the paper's App. A.3 numbers)."""
    table = {(512, 4): (128, 64, 128), (1024, 4): (256, 128, 256), (2048, 4): (512, 256, 512),
             (4096, 4): (1024, 512, 1024), (8192, 4): (2048, 1024, 2048),
             (512, 7): (128, 32, 160), (1024, 7): (256, 64, 320), (2048, 7): (512, 128, 640),
             (4096, 7): (1024, 256, 1280), (8192, 7): (2048, 512, 2560)}
    for (B, G), want in table.items():
        S, k, W = sage_sizes(B, G)
        assert (S, k, W) == want and S + G * k + W == B, (B, G)
    assert sage_sizes(24, 2, sink=3, topk=5) == (3, 5, 11)
    assert sage_sizes(24, 2, topk=0) == (6, 0, 18)  # StreamLLM_Abs: sink + window


def test_bad_sizes_raise_one_line():
    for args, match in [((3, 2), "below 2 x the GQA group"), ((16, 2, 14), "leaves no recent window"),
                        ((16, 2, 4, 6), "leaves no recent window")]:
        with pytest.raises(PolicyError, match=match) as e:
            sage_sizes(*args)
        assert "\n" not in str(e.value)
    for name in ("sink", "topk"):
        with pytest.raises(PolicyError, match=f"{name} must be >= 0"):
            SageKV(**{name: -1})


def test_layout_regions_hand_values():
    """Spec 1.3 with the T2 / T7 / T8 sizes: sink, candidate range, kept per head, slots kept between steps."""
    lay = SageLayout(S=2, k=3, W=4, G=2, N=20)  # T2
    assert (lay.n_sink, lay.rs, lay.kk, lay.ring_start, lay.budget) == (2, 16, 3, 8, 11)
    lay = SageLayout(S=4, k=20, W=8, G=2, N=30)  # T7: n_E = 18 < k
    assert (lay.n_sink, lay.rs, lay.kk, lay.ring_start, lay.budget) == (4, 22, 18, 40, 47)
    lay = SageLayout(S=2, k=3, W=4, G=2, N=5)  # T8: n_E = 0, no selection region
    assert (lay.n_sink, lay.rs, lay.kk, lay.ring_start, lay.budget) == (2, 2, 0, 2, 5)
    lay = SageLayout(S=2, k=3, W=4, G=2, N=1)  # T8: shorter than the sink
    assert (lay.n_sink, lay.rs, lay.kk, lay.budget) == (1, 1, 0, 4)
    lay = SageLayout(S=2048, k=512, W=2560, G=7, N=100_000)  # the paper's Qwen setting: B - 1 kept, + 1 decoding
    assert lay.budget == 8191


# ------------------------------------------------------------------------------------- a bare SAGE-KV cache

def bare(keys, values, q_last, S, k, W, max_new=8):
    """A SAGE-KV cache compressed from a prompt with keys, values [H_kv, N, D] and last query q_last [H_q, D]:
    the one-shot scratch written and observed as prefill_one_shot does, then compress_into."""
    H, N, D = keys.shape
    Hq = q_last.shape[0]
    pol = SageKV(sink=S, topk=k)  # the paper's B = S + G k + W counts the current token: --budget B - 1
    C = pol.plan(Run(S + Hq // H * k + W - 1, N, max_new, args=SimpleNamespace(n_heads=Hq, n_kv_heads=H)))
    scratch = KVCache(CacheSpec(1, H, D, N, N, policy=pol, n_heads=Hq, mode="scratch"))
    q = torch.zeros(1, Hq, N, D)
    q[0, :, -1] = q_last
    pos = torch.arange(N)
    scratch.update(q, keys[None], values[None], pos, pos)
    scratch.evict(q, pos, pos)
    cache = KVCache(CacheSpec(1, H, D, C, 1, policy=pol, n_heads=Hq))
    compress_into(scratch, cache)
    return cache, pol


def decode(cache, q, k, v, p):
    """One decode step as model.py runs it: write, attend (per query head when the policy selects), evict.
    q [H_q, D], k, v [H_kv, D]; the LAST value channel must hold the position: it names what each head saw.
    Returns the attention output [H_q, D] and each query head's attended positions."""
    Hq, D = q.shape
    pos = torch.tensor([p])
    q4 = q.view(1, Hq, 1, D)
    keys, values, mask = cache.update(q4, k.view(1, -1, 1, D), v.view(1, -1, 1, D), pos, pos)
    h = keys.shape[1]
    g = Hq // h
    out = F.scaled_dot_product_attention(q.view(1, h, g, D), keys, values, attn_mask=mask.expand(1, h, g, -1))
    seen = [values[0, i // g, mask[0, i // g, 0], -1].tolist() for i in range(Hq)]
    cache.evict(q4, pos, pos)
    assert all(len(set(s)) == len(s) for s in seen)  # no head sees a token twice
    return out.reshape(Hq, D), [sorted(int(x) for x in s) for s in seen]


def line_keys(n, D=4):
    """T2's data: k_i = [i, 0, ...], v_i = [i, i, ...] for positions 0..n-1."""
    i = torch.arange(n, dtype=torch.float32)
    keys = torch.zeros(1, n, D)
    keys[0, :, 0] = i
    return keys, i.view(1, n, 1).expand(1, n, D).clone()


def t2_cache():
    keys, values = line_keys(20)
    q_last = torch.tensor([[1.0, 0, 0, 0], [-1, 0, 0, 0]])
    return bare(keys, values, q_last, S=2, k=3, W=4)


def token(p, D=4):
    k = torch.zeros(1, D)
    k[0, 0] = p
    return k, torch.full((1, D), float(p))


def test_partition_and_selection_layout():
    """Head 0 (q = +e0) keeps the largest candidates {13, 14, 15}, head 1 (q = -e0) the smallest {2, 3, 4}; the
    ring keeps the W - 1 = 3 newest prompt positions (the spec's 4th, 16, is overwritten by position 20 before any
    query sees it)."""
    cache, pol = t2_cache()
    assert cache.spec.budget == 11
    assert cache.pos[0, 0].tolist() == [0, 1, 13, 14, 15, 2, 3, 4, 17, 18, 19, -1]
    assert torch.equal(cache.k[0, 0, :11, 0], cache.pos[0, 0, :11].float())  # keys moved with their positions
    assert torch.equal(cache.v[0, 0, :11, 3], cache.pos[0, 0, :11].float())


def test_ring_slides_and_each_head_sees_its_own_selection():
    cache, pol = t2_cache()
    q = torch.zeros(2, 4)  # T5: a zero query attends uniformly
    out, seen = decode(cache, q, *token(20), 20)
    assert seen == [[0, 1, 13, 14, 15, 17, 18, 19, 20], [0, 1, 2, 3, 4, 17, 18, 19, 20]]  # T4
    assert torch.allclose(out[:, 0], torch.tensor([117 / 9, 84 / 9]))  # T5: 13.0 and 9.333...
    assert cache.pos[0, 0].tolist() == [0, 1, 13, 14, 15, 2, 3, 4, 20, 18, 19, -1]  # 17 dropped, 20 in its slot
    out, seen = decode(cache, q, *token(21), 21)
    assert cache.pos[0, 0].tolist() == [0, 1, 13, 14, 15, 2, 3, 4, 20, 21, 19, -1]
    for p in range(22, 40):  # T3: the ring always holds the newest positions; sink and selection never change
        out, seen = decode(cache, q, *token(p), p)
        assert seen[0] == [0, 1, 13, 14, 15, p - 3, p - 2, p - 1, p]
        assert seen[1] == [0, 1, 2, 3, 4, p - 3, p - 2, p - 1, p]
        assert cache.pos[0, 0, :8].tolist() == [0, 1, 13, 14, 15, 2, 3, 4]
        assert sorted(cache.pos[0, 0, 8:11].tolist()) == [p - 2, p - 1, p]


def test_slot_ownership_with_seven_query_heads_per_group():
    """H_kv = 1, H_q = 7: query head g attends exactly its own selection block [S + g k, S + (g+1) k)."""
    S, k, W, G = 3, 4, 6, 7
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 50, 8, generator=g), torch.randn(1, 50, 8, generator=g)
    cache, pol = bare(keys, values, torch.randn(G, 8, generator=g), S, k, W)
    idx = pol.select(cache.view(cache.spec.budget, q=torch.zeros(1, G, 1, 8), query_pos=torch.tensor([50]),
                                slot=torch.tensor([cache.spec.budget])))
    ring = list(range(S + G * k, cache.spec.budget))
    for h in range(G):
        assert idx[0, h].tolist() == list(range(S + h * k, S + (h + 1) * k)) + [0, 1, 2] + ring + [cache.spec.budget]


@pytest.mark.parametrize("N,S,W,G,k,H", [(50, 4, 8, 2, 5, 2), (50, 3, 6, 7, 4, 1), (40, 3, 5, 3, 6, 2)])
def test_decode_equals_explicit_per_head_attention(N, S, W, G, k, H):
    """Random data, 16 decode steps (the ring wraps twice): every head attends sink + its own top-k + the last W
    positions, and its output equals softmax attention over exactly those positions."""
    D = 8
    g = torch.Generator().manual_seed(N + G)
    T = N + 16
    K, V = torch.randn(H, T, D, generator=g), torch.randn(H, T, D, generator=g)
    V[..., -1] = torch.arange(T, dtype=torch.float32)  # the last channel names the position
    q_last = torch.randn(H * G, D, generator=g)
    cache, _ = bare(K[:, :N], V[:, :N], q_last, S, k, W)
    sel = reference_selection(K[:, :N], q_last, S, N - W, k)
    for p in range(N, T):
        q = torch.randn(H * G, D, generator=g)
        out, seen = decode(cache, q, K[:, p], V[:, p], p)
        visible = [sorted(set(range(S)) | set(sel[h]) | set(range(p - W + 1, p + 1))) for h in range(H * G)]
        assert seen == visible, p
        assert torch.allclose(out, reference_attend(q, K, V, visible), atol=1e-5), p


def test_keep_everything_but_the_ring_eviction():
    """k = 20 >= n_E = 18: every head keeps all of E; at p = 30 the output is dense attention over everything
    except position 22 = N - W (pushed out of the ring)."""
    D, N = 8, 30
    g = torch.Generator().manual_seed(7)
    K, V = torch.randn(1, N + 1, D, generator=g), torch.randn(1, N + 1, D, generator=g)
    V[..., -1] = torch.arange(N + 1, dtype=torch.float32)
    cache, _ = bare(K[:, :N], V[:, :N], torch.randn(2, D, generator=g), S=4, k=20, W=8)
    q = torch.randn(2, D, generator=g)
    out, seen = decode(cache, q, K[:, N], V[:, N], N)
    everything_but_22 = [p for p in range(N + 1) if p != 22]
    assert seen == [everything_but_22] * 2
    assert torch.allclose(out, reference_attend(q, K, V, seen), atol=1e-5)


def test_no_candidates_is_dense_until_the_ring_wraps():
    D, N = 8, 10
    g = torch.Generator().manual_seed(8)
    K, V = torch.randn(1, N + 3, D, generator=g), torch.randn(1, N + 3, D, generator=g)
    V[..., -1] = torch.arange(N + 3, dtype=torch.float32)
    cache, _ = bare(K[:, :N], V[:, :N], torch.randn(2, D, generator=g), S=4, k=20, W=8)
    for p in (10, 11):
        q = torch.randn(2, D, generator=g)
        out, seen = decode(cache, q, K[:, p], V[:, p], p)
        assert seen == [list(range(p + 1))] * 2
        dense = F.scaled_dot_product_attention(q.view(1, 1, 2, D), K[None, :, :p + 1], V[None, :, :p + 1])
        assert torch.allclose(out, dense.view(2, D), atol=1e-6)
    out, seen = decode(cache, torch.randn(2, D, generator=g), K[:, 12], V[:, 12], 12)
    assert seen == [[0, 1, 2, 3] + list(range(5, 13))] * 2  # position 4 left the ring


def test_short_prompt_and_empty_ring_slots():
    keys, values = line_keys(5)
    cache, pol = bare(keys, values, torch.ones(2, 4), S=2, k=3, W=4)
    assert cache.pos[0, 0].tolist() == [0, 1, 2, 3, 4, -1]  # no selection region: n_E = 0
    q = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    out, seen = decode(cache, q, *token(5), 5)
    assert seen == [list(range(6))] * 2  # nothing dropped before attending: dense
    K, V = line_keys(6)
    dense = F.scaled_dot_product_attention(q.view(1, 1, 2, 4), K[None], V[None])
    assert torch.allclose(out, dense.view(2, 4), atol=1e-6)
    assert cache.pos[0, 0].tolist() == [0, 1, 5, 3, 4, -1]  # position 2 was the oldest ring token
    out, seen = decode(cache, q, *token(6), 6)
    assert seen == [[0, 1, 3, 4, 5, 6]] * 2

    keys, values = line_keys(1)  # N = 1: only the sink slot is valid, the ring starts empty
    cache, pol = bare(keys, values, torch.ones(2, 4), S=2, k=3, W=4)
    assert cache.pos[0, 0].tolist() == [0, -1, -1, -1, -1]
    for p in range(1, 6):
        out, seen = decode(cache, q, *token(p), p)
        assert seen[0] == [0] + list(range(max(1, p - 3), p + 1))


def test_selection_invariants_and_ties():
    g = torch.Generator().manual_seed(9)
    S, k, W, G, H, N, D = 3, 6, 5, 3, 2, 40, 8
    for _ in range(5):
        K = torch.randn(H, N, D, generator=g)
        q_last = torch.randn(H * G, D, generator=g)
        cache, pol = bare(K, torch.randn(H, N, D, generator=g), q_last, S, k, W)
        lay = pol.layout
        want = reference_selection(K, q_last, lay.n_sink, lay.rs, lay.kk)
        for h in range(H * G):
            j, blk = divmod(h, G)
            got = cache.pos[0, j, lay.n_sink + blk * k:lay.n_sink + (blk + 1) * k].tolist()
            assert got == want[h] and all(a < b for a, b in zip(got, got[1:]))  # unique, sorted
            assert len(got) == min(k, lay.rs - lay.n_sink) and S <= got[0] and got[-1] < N - W
            assert torch.equal(cache.k[0, j, lay.n_sink + blk * k:lay.n_sink + (blk + 1) * k], K[j, got])
    # all logits equal (zero keys): stable mode picks positions S .. S + k - 1 in every head
    cache, pol = bare(torch.zeros(H, N, D), torch.randn(H, N, D, generator=g), torch.randn(H * G, D, generator=g),
                      S, k, W)
    assert cache.pos[0, 0, S:S + G * k].tolist() == list(range(S, S + k)) * G


# ------------------------------------------------------------------- the independent reference on a model

def ids_of(n, seed, vocab=256):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def compare_with_reference(model, params, B, N, T, block=16, seed=0):
    """Engine (one-shot prefill, T eager decode steps) and reference side by side, greedy on the engine's logits:
    the first token's logits, then at every decode step each (layer, query head)'s attended positions and the
    logits (atol 1e-4)."""
    a = model.args
    ids = ids_of(N, seed, a.vocab_size)
    pol = make_policy("sagekv", params)  # the paper's B counts the decoding token: --budget B - 1
    setup(model, pol, B - 1, N, T, block, prefill="one-shot")
    S, k, W = ref_sizes(B, a.n_heads // a.n_kv_heads, params.get("sink"), params.get("topk"))
    dense = params.get("skip_if_fits", False) and N + T <= B
    ref = RefModel(model, budget=10 ** 9, policy_name=None)
    ref.layers = [RefSageLayer(a.n_heads, a.n_kv_heads, a.head_dim, S, k, W, N, dense) for _ in range(a.n_layers)]
    one_shot_equals_reference(model, ref, ids, T, block)
    return pol, ref


@pytest.fixture(scope="module")
def tiny(hf_tiny):
    """The tiny Llama: 2 layers, 4 query heads, 2 KV heads (G = 2), head_dim 16."""
    _, ckpt = hf_tiny("llama")
    return load_model(ckpt, torch.float32, "cpu")


@pytest.fixture(scope="module")
def tiny_g3():
    """A random GQA model with G = 3 (6 query heads, 2 KV heads, head_dim 8) and q/k/v bias, built directly."""
    args = ModelArgs(vocab_size=256, dim=48, n_layers=2, n_heads=6, n_kv_heads=2, head_dim=8, intermediate_size=96,
                     norm_eps=1e-5, rope_theta=10000.0, max_seq_len=2048, qkv_bias=True)
    torch.manual_seed(3)
    model = Transformer(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    return model.eval()


CASES = [  # params, budget, prompt length, decode steps
    ({}, 32, 100, 70),                                   # the paper's rule: S 8, k 8 per head, W 8
    ({"sink": 3, "topk": 5}, 24, 60, 64),      # W = 11
    ({"topk": 0}, 24, 60, 64),                      # T13: k = 0 is StreamLLM_Abs (sink + window)
    ({}, 32, 20, 64),                                    # n_E = 4 < k: every head keeps all candidates
    ({}, 32, 5, 64),                                     # prompt shorter than the sink
    ({"skip_if_fits": True}, 140, 70, 64),          # A5's flag: fits, so dense
]


@pytest.mark.parametrize("params,B,N,T", CASES, ids=lambda c: str(c))
def test_engine_equals_reference_tiny_llama(tiny, params, B, N, T):
    pol, _ = compare_with_reference(tiny, params, B, N, T, seed=B + N)
    assert tiny.layers[0].attention.kv_cache.spec.budget == pol.layout.budget


def test_engine_equals_reference_with_groups_of_3(tiny_g3):
    """G = 3: S = 12, k = 8 per query head, W = 12; 3 selection blocks per KV head."""
    pol, ref = compare_with_reference(tiny_g3, {}, 48, 90, 66, block=32, seed=1)
    assert (pol.layout.n_sink, pol.layout.kk, pol.layout.W) == (12, 8, 12)
    sel = ref.layers[1].sel
    assert any(sel[0] != sel[h] for h in range(1, 3))  # the heads of a group really select differently


def test_one_shot_block_size_does_not_change_the_selection(tiny):
    ids = ids_of(100, 12)
    kept, logits = [], []
    for block in (7, 64):
        pol = SageKV()
        setup(tiny, pol, 31, 100, 8, block, prefill="one-shot")
        with torch.inference_mode():
            logits.append(prefill_one_shot(tiny, torch.tensor(ids), block))
        kept.append([l.attention.kv_cache.pos[:, :, :pol.layout.budget].clone() for l in tiny.layers])
    assert all(torch.equal(a, b) for a, b in zip(*kept))
    assert torch.allclose(*logits, atol=1e-5)


# ----------------------------------------------------------------------------------- equivalence with full

def step_logits(model, policy, budget, ids, T, block=16):
    setup(model, policy, budget, len(ids), T, block, prefill="one-shot")
    out = []
    with torch.inference_mode():
        logits = prefill_one_shot(model, torch.tensor(ids), block)
        out.append(logits)
        for p in range(len(ids), len(ids) + T):
            logits = model_step(model, logits.argmax(-1).view(1, 1), torch.tensor([p]))
            out.append(logits)
    return torch.cat(out)


@pytest.mark.parametrize("params,B", [({"skip_if_fits": True}, 100 + 64),
                                      ({"sink": 16}, 400)])  # literal rule: S + W = 272 >= N + T
def test_budget_covering_the_context_reproduces_full(tiny, params, B):
    """Spec T11 / A5: with --sage-skip-if-fits and N + T <= B, or under the literal rule while nothing leaves the
    ring (N + T <= S + W), every step's logits equal `full`'s."""
    ids, T = ids_of(100, 11), 64
    want = step_logits(tiny, None, 100 + T, ids, T)
    got = step_logits(tiny, make_policy("sagekv", params), B - 1, ids, T)
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_literal_rule_compresses_a_prompt_that_fits(tiny):
    """The negative control (A5): without the flag, B = N + T still selects, so the logits leave `full`'s."""
    ids, T = ids_of(100, 11), 16
    want = step_logits(tiny, None, 100 + T, ids, T)
    pol = SageKV()
    got = step_logits(tiny, pol, 100 + T - 1, ids, T)
    assert pol.layout.kk > 0 and torch.allclose(got[0], want[0], atol=1e-5)  # the first token is full attention
    assert (got[1:] - want[1:]).abs().max() > 1e-3


# --------------------------------------------------------------------------------------------- compile, CLI

def test_cli_runs_one_shot_and_rejects_bad_parameters(tiny_ckpt, capsys):
    import json
    import generate as cli
    base = ["--checkpoint", str(tiny_ckpt), "--prompt", "the quick brown fox jumps over the lazy dog, " * 6,
            "--max-new-tokens", "8", "--no-chat"]
    assert cli.main(base + ["--policy", "sagekv", "--budget", "15", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["prefill"] == "one-shot" and stats["generated_tokens"] == 8 and stats["prompt_tokens"] > 16
    assert stats["budget"] == stats["slots"] == 15  # the paper's B = 16 counts the decoding token
    bad = [(["--policy", "sagekv", "--budget", "2"], "below 2 x the GQA group"),
           (["--policy", "sagekv:sink=14", "--budget", "15"], "leaves no recent window"),
           (["--policy", "sagekv:topk=-1", "--budget", "15"], "topk must be >= 0"),
           (["--policy", "sagekv:sink=-2", "--budget", "15"], "sink must be >= 0"),
           (["--policy", "sagekv", "--budget", "15", "--prefill", "block"], "--prefill one-shot")]
    for args, msg in bad:
        assert cli.main(base + args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0], err
