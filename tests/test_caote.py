"""CAOTE / FastCAOTE: the hand-checked cases of its implementation spec (section 7), the closed form against a
brute-force re-softmax, and every `caote:<base>` / `fastcaote:<base>` on the in-place engine against the dynamic
reference (tests/reference/caote.py: RefCAOTE) at every block and decode step."""
import itertools
import math

import pytest
import torch

import policies
from policies import caote_scores
from reference.caote import caote_reference
from reference.model import attention_probs
from test_policy_reference import compare_run, tiny_model  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

V_T1 = [[1.4, 0.0], [1.0, 1.0], [0.0, 3.5]]


def engine(h, V, fast=False, valid=None):
    """caote_scores for one KV head: h [G, S] (or [S]), V [S, D] -> [S]."""
    h = torch.tensor(h, dtype=torch.float32)
    h = h[None] if h.dim() == 1 else h
    V = torch.tensor(V, dtype=torch.float32)
    valid = torch.ones(V.shape[0], dtype=torch.bool) if valid is None else torch.tensor(valid)
    return caote_scores(h[None, None], V[None, None], valid[None, None], fast)[0, 0]


def brute_force(alpha, V, drop):
    """||o - o'|| when the tokens `drop` are removed and the softmax renormalises (logits = ln alpha)."""
    alpha, V = torch.tensor(alpha, dtype=torch.float64), torch.tensor(V, dtype=torch.float64)
    o = alpha @ V
    keep = torch.ones(len(alpha), dtype=torch.bool)
    keep[list(drop)] = False
    a2 = torch.softmax(alpha.log().masked_fill(~keep, -math.inf), 0)
    return float((o - a2 @ V).norm())


def test_closed_form_equals_brute_force_and_differs_from_tova():
    alpha = [0.5, 0.3, 0.2]
    c = engine(alpha, V_T1)
    assert c.tolist() == pytest.approx([1.077033, 0.0, 0.673146], abs=1e-4)
    assert [brute_force(alpha, V_T1, [j]) for j in range(3)] == pytest.approx([1.077033, 0.0, 0.673146], abs=1e-6)
    assert int(c.argmin()) == 1  # CAOTE evicts token 2 (v2 = o); TOVA would evict token 3 (lowest alpha)
    assert int(torch.tensor(alpha).argmin()) == 2
    fast = engine(alpha, V_T1, fast=True)
    assert fast.tolist() == pytest.approx([1.615549, 0.230793, 0.538516], abs=1e-5)


def test_closed_form_and_brute_force_on_a_second_hand_case():
    alpha, V = [0.5, 0.3, 0.2], [[1, 0], [0, 1], [1, 1]]
    assert engine(alpha, V).tolist() == pytest.approx([0.583095, 0.368671, 0.145774], abs=1e-5)
    assert [brute_force(alpha, V, [j]) for j in range(3)] == pytest.approx([0.583095, 0.368671, 0.145774], abs=1e-6)
    assert engine(alpha, V, fast=True).tolist() == pytest.approx([0.745356, 0.319438, 0.117851], abs=1e-5)


def test_multi_token_eviction_is_independent():
    """Two evictions at once rank each token by its single-token score (paper App. A): {2, 3} go, although the
    pair {1, 3} has zero joint error (the set formula equals brute force for every pair)."""
    alpha = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    V = torch.tensor(V_T1, dtype=torch.float64)
    c = engine(alpha.tolist(), V_T1)
    assert sorted(c.argsort()[:2].tolist()) == [1, 2]
    o = alpha @ V
    for pair, want in {(0, 1): 2.692582, (0, 2): 0.0, (1, 2): 1.077033}.items():
        a_s = alpha[list(pair)].sum()
        set_formula = float((alpha[list(pair), None] * (V[list(pair)] - o)).sum(0).norm() / (1 - a_s))
        assert set_formula == pytest.approx(want, abs=1e-5)
        assert brute_force(alpha.tolist(), V_T1, pair) == pytest.approx(want, abs=1e-5)


def test_h2o_accumulation_and_normalisation():
    A1 = torch.tensor([[1, 0], [0.6, 0.4]])
    A2 = torch.tensor([[0.5, 0.1, 0.4, 0], [0.3, 0.1, 0.2, 0.4]])
    acc = torch.cat([A1.sum(0), torch.zeros(2)]) + A2.sum(0)
    assert acc.tolist() == pytest.approx([2.4, 0.6, 0.6, 0.4]) and acc.sum() == pytest.approx(4.0)  # Thm B.1
    V = [[1, 0], [0, 1], [0.6, 0.4], [-2, 0]]
    assert int(acc.argmin()) == 3  # H2O evicts t4
    c = engine(acc.tolist(), V)
    assert c.tolist() == pytest.approx([0.827315, 0.164051, 0.038743, 0.277649], abs=1e-5)
    assert int(c.argmin()) == 2  # H2O+CAOTE evicts t3
    fast = engine(acc.tolist(), V, fast=True)
    assert fast.tolist() == pytest.approx([1.731509, 0.116055, 0.123844, 0.214663], abs=1e-5)
    assert int(fast.argmin()) == 1  # FastCAOTE evicts t2
    tova = engine(A2[1].tolist(), V)
    assert tova.tolist() == pytest.approx([0.596438, 0.100419, 0.251098, 1.086646], abs=1e-5)
    assert int(tova.argmin()) == 1


def test_scale_invariant_not_shift_invariant():
    acc, V = [2.4, 0.6, 0.6, 0.4], [[1, 0], [0, 1], [0.6, 0.4], [-2, 0]]
    base = engine(acc, V)
    assert torch.allclose(engine([7 * a for a in acc], V), base, atol=1e-6)
    assert not torch.allclose(engine([a + 1 for a in acc], V), base, atol=1e-3)  # spec A8: a shift changes c


def test_gqa_l2_is_the_concatenated_error():
    a1, a2 = [0.5, 0.3, 0.2], [0.2, 0.3, 0.5]
    c = engine([a1, a2], V_T1)
    assert c.tolist() == pytest.approx([1.210240, 0.484665, 1.700595], abs=1e-5)
    both = [math.hypot(brute_force(a1, V_T1, [j]), brute_force(a2, V_T1, [j])) for j in range(3)]
    assert c.tolist() == pytest.approx(both, abs=1e-5)
    assert engine([a1, a2], V_T1, fast=True).tolist() == pytest.approx([1.665270, 0.326390, 2.220360], abs=1e-5)


def test_renormalisation_theorem_on_random_logits():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(9, generator=g, dtype=torch.float64)
    alpha = logits.softmax(0)
    V = torch.randn(9, 5, generator=g, dtype=torch.float64)
    for j in range(9):
        masked = logits.clone()
        masked[j] = -math.inf
        want = alpha / (1 - alpha[j])
        want[j] = 0
        assert torch.allclose(masked.softmax(0), want, atol=1e-12)
    c = engine(alpha.tolist(), V.tolist())
    assert c.tolist() == pytest.approx([brute_force(alpha.tolist(), V.tolist(), [j]) for j in range(9)], rel=1e-4)


def test_one_valid_slot_empty_slots_and_equal_values():
    # T = 1 (alpha = 1): the clamp gives no NaN/inf; an empty slot never outranks a valid one (cache.py sets
    # empty slots to -inf); all-equal values give c = 0 everywhere.
    c = engine([1.0, 0.0, 0.0], [[1, 2], [3, 4], [5, 6]], valid=[True, False, False])
    assert torch.isfinite(c).all() and not torch.isnan(c).any()
    assert c[1:].tolist() == [0.0, 0.0]
    assert engine([0.2, 0.5, 0.3], [[1, 1]] * 3).abs().max() < 1e-6
    # invalid slots do not enter the normalisation, X~ or the FastCAOTE mean
    with_empty = engine([0.5, 0.3, 9.0, 0.2], V_T1[:2] + [[50, 50]] + V_T1[2:], valid=[True, True, False, True])
    assert with_empty[[0, 1, 3]].tolist() == pytest.approx(engine([0.5, 0.3, 0.2], V_T1).tolist(), abs=1e-5)
    fast_empty = engine([0.5, 0.3, 9.0, 0.2], V_T1[:2] + [[50, 50]] + V_T1[2:], fast=True,
                        valid=[True, True, False, True])
    assert fast_empty[[0, 1, 3]].tolist() == pytest.approx(engine([0.5, 0.3, 0.2], V_T1, fast=True).tolist(),
                                                           abs=1e-5)


def test_fp32_scores_against_fp64_on_random_inputs():
    g = torch.Generator().manual_seed(16)
    for trial in range(20):
        h = torch.rand(3, 40, generator=g, dtype=torch.float64)
        V = torch.randn(40, 16, generator=g, dtype=torch.float64) * 3 + 2
        want = caote_reference(h, V, fast=trial % 2 == 1).double()
        got = engine(h.tolist(), V.tolist(), fast=trial % 2 == 1).double()
        assert ((got - want).abs() / want.abs().max()).max() < 1e-3
        assert int(got.argmin()) == int(want.argmin())


def test_scores_are_permutation_invariant():
    g = torch.Generator().manual_seed(18)
    h, V = torch.rand(2, 12, generator=g), torch.randn(12, 4, generator=g)
    perm = torch.randperm(12, generator=g)
    for fast in (False, True):
        assert torch.allclose(engine(h[:, perm].tolist(), V[perm].tolist(), fast),
                              engine(h.tolist(), V.tolist(), fast)[perm], atol=1e-6)


def test_tova_pseudo_output_is_the_attention_output():
    """With TOVA's per-head last-row attention, X~ = sum h~ v is that query's SDPA output."""
    g = torch.Generator().manual_seed(17)
    q, K, V = torch.randn(2, 1, 8, generator=g), torch.randn(1, 6, 8, generator=g), torch.randn(1, 6, 8, generator=g)
    A = attention_probs(q, K, torch.arange(6)[None], torch.tensor([5]))[:, 0]         # [2, 6], rows sum to 1
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, K.expand(2, -1, -1), V.expand(2, -1, -1))[:, 0]
    assert torch.allclose(A @ V[0], sdpa, atol=1e-6)
    # the brute-force error of dropping each token from head 0's real output equals CAOTE's closed form
    c = engine(A[:1].tolist(), V[0].tolist())
    for j in range(6):
        keep = torch.arange(6) != j
        o2 = torch.nn.functional.scaled_dot_product_attention(q[:1], K[:, keep], V[:, keep])[0, 0]
        assert float((sdpa[0] - o2).norm()) == pytest.approx(float(c[j]), abs=1e-5)


# ------------------------------------------------------------------------------------ engine == reference

BASES = ["h2o", "tova", "snapkv", "keydiff"]
CASES = [(f"{kind}:{base}", {"window": 4, "kernel": 3} if base == "snapkv" else {})
         for base, kind in itertools.product(BASES, ["caote", "fastcaote"])]


def _id(case):
    return case[0] + "".join(f"-{k}={v}" for k, v in case[1].items())


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_engine_equals_reference_on_a_small_budget(tiny_model, case):  # noqa: F811
    name, params = case
    ids = torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(37)).tolist()
    compare_run(tiny_model, name, params, ids, budget=8, block=5, n_decode=6)


@pytest.mark.parametrize("case", [("caote:h2o", {}), ("fastcaote:tova", {}), ("caote:snapkv", {}),
                                  ("caote:keydiff", {"window_frac": 0.2}), ("caote:tova", {"keep_last": True})],
                         ids=_id)
def test_engine_equals_reference_on_a_1000_token_prompt(tiny_model, case):  # noqa: F811
    name, params = case
    ids = torch.randint(0, 512, (1000,), generator=torch.Generator().manual_seed(1000)).tolist()
    ref = compare_run(tiny_model, name, params, ids, budget=96, block=32, n_decode=8)
    assert all(len(h) == 96 for layer in ref.kept() for h in layer)


@pytest.mark.parametrize("case", [("caote:tova", {}), ("fastcaote:h2o", {})], ids=_id)
def test_engine_equals_reference_fill_during_decode(tiny_model, case):  # noqa: F811
    name, params = case
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(40)).tolist()
    compare_run(tiny_model, name, params, ids, budget=48, block=16, n_decode=14)


def test_caote_changes_the_decision(tiny_model):  # noqa: F811
    """Negative control: CAOTE is not its base in disguise (the kept sets differ somewhere on a 300-token run)."""
    ids = torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    base = compare_run(tiny_model, "tova", {}, ids, budget=64, block=32, n_decode=2).kept()
    caote = compare_run(tiny_model, "caote:tova", {}, ids, budget=64, block=32, n_decode=2).kept()
    assert base != caote


def test_bad_parameters():
    with pytest.raises(policies.PolicyError, match="unknown policy"):
        policies.make("caote:sink")
    with pytest.raises(policies.PolicyError, match="heads=all"):
        policies.make("caote:tova:heads=all")
    with pytest.raises(policies.PolicyError, match="observation window"):
        policies.make("fastcaote:snapkv").plan(policies.Run(32, 100, 10))
    with pytest.raises(policies.PolicyError, match="window_frac"):
        policies.make("caote:h2o:window_frac=-0.1")
