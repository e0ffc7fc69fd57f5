"""The conformance suite: every registered policy, by being registered, is checked here.

- kept sets and logits equal a plain dynamic-shape reference (concatenate, score, sort, gather) after every prefill
  block and decode step, under every protocol the policy allows. The reference calls the policy's own `observe` and
  `score` on its own dynamic cache (tests/reference/engine_scorer.py), so this checks the in-place mechanics; the
  independent scores of the known policies are checked in test_policy_reference.py, test_caote.py, test_kvec.py,
  test_rocketkv.py and test_sagekv.py. Policies with a layout or a selector of their own (`keep_slots`, `select`)
  are covered by their family's reference there.
- compiled == eager (fullgraph=True, inductor) with error_on_recompile over 2 x 69 decode steps (of the CAOTE
  variants, which share one scoring function, one CAOTE and one FastCAOTE): every policy's decode step, and the
  prefill-block step of the four policies whose prefill blocks run all the policy code the others' do;
- a budget that holds everything reproduces `full`, under both protocols;
- int8 and bf16 KV keep exactly the sets of fp32 KV holding the same rounded values.
"""
import copy

import pytest
import torch
from conftest import REPO, make_policy

import policies
from cache import KVCache, dequantize_rows, is_scorer, is_selector, quantize_rows
from engine import block_inputs, generate, prefill_one_shot, setup
from runtime import compile_steps, model_step, prefill_step
from loading import load_model
from reference.engine_scorer import EngineScorer
from reference.model import RefModel

EAGER = (prefill_step, model_step)


def params_of(cls, **extra) -> dict:
    """Small windows, so that a tiny budget works for every policy (make_policy takes those its class has)."""
    if issubclass(cls, policies.KVec):
        window = dict(window=4, obs_window=4, long_window=8)
    elif issubclass(cls, policies.SnapKVPlusPlus):  # RocketKV's stage 1 too; the pooling kernel its own rule's
        window = dict(window=8)
    elif issubclass(cls, policies.SnapKV):  # the CAOTE variants over it too
        window = dict(window=8, kernel=7)
    else:
        window = {}
    return dict(window_frac=0.1, anchor="raw", n_sink=4, seed=0, **window, **extra)


def readme_example() -> tuple[type | None, str]:
    """The "Adding a policy" example of README.md, run as written in policies' namespace: (its class, "") or (None,
    what is wrong). The docs' code is tested by this suite as if it had been registered; once it is (a reader
    followed the README into policies.py), the registered class is tested as every registered policy is."""
    text = (REPO / "README.md").read_text()
    try:
        code = text.split("## Adding a policy", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
        namespace = dict(vars(policies))
        exec(code, namespace)
    except Exception as e:  # a broken example fails its test below, not the collection of the whole suite
        return None, f"the README example does not run: {e!r}"
    new = [v for k, v in namespace.items() if isinstance(v, type) and v is not vars(policies).get(k)]
    if len(new) != 1 or not issubclass(new[0], policies.Scorer):
        return None, f"the README example defines one scorer, not {new}"
    return new[0], ""


EXAMPLE, EXAMPLE_PROBLEM = readme_example()
CLASSES = dict(policies.REGISTRY)
if EXAMPLE is not None and EXAMPLE.name not in CLASSES:
    CLASSES[EXAMPLE.name] = EXAMPLE
NAMES = list(CLASSES)


def test_readme_example_is_one_scorer_tested_here():
    assert not EXAMPLE_PROBLEM, EXAMPLE_PROBLEM
    assert EXAMPLE.name in NAMES


pytestmark = pytest.mark.usefixtures("one_thread")


def ids_of(n, seed=3, vocab=512):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def protocols(name) -> list[str]:
    return ["one-shot"] if CLASSES[name].protocol == "one-shot" else ["block", "one-shot"]


def engine_kept(model) -> list[list[list[int]]]:
    return [[sorted(p for p in head.tolist() if p >= 0) for head in layer.attention.kv_cache.pos[0]]
            for layer in model.layers]


@pytest.fixture(scope="module")
def tiny(hf_tiny):
    _, ckpt = hf_tiny("qwen2")
    return load_model(ckpt, torch.float32, "cpu")


# ------------------------------------------------------------------------------ the dynamic-shape reference

MECHANICS = [(n, p) for n in NAMES for p in protocols(n)
             if is_scorer(CLASSES[n]) and CLASSES[n].keep_slots is policies.Policy.keep_slots
             and not is_selector(CLASSES[n])]


@pytest.mark.parametrize("name,protocol", MECHANICS, ids=[f"{n}-{p}" for n, p in MECHANICS])
def test_kept_sets_equal_the_dynamic_reference(tiny, name, protocol):
    """A 70-token prompt in blocks of 16 (the last one padded) at budget 24, then 8 decode steps."""
    model, T, N, budget, block = tiny, 70, 8, 24, 16
    ids, decode_ids = ids_of(T, seed=21), ids_of(N, seed=22)
    policy = make_policy(CLASSES[name], params_of(CLASSES[name]))
    if policy.decode == "append":  # a policy that appends holds its prompt share plus the new tokens
        budget += N
    setup(model, policy, budget, T, N, block, prefill=protocol)
    keep = policy.prompt_keep(policies.Run(budget, T, N, block, model.args))
    ref = RefModel(model, budget, None)
    shared = {}
    for i, layer in enumerate(ref.layers):
        layer.policy = EngineScorer(copy.deepcopy(policy), i, budget, keep, shared, protocol == "one-shot")
    prompt = torch.tensor(ids)

    def check(step, logits, ref_logits):
        assert engine_kept(model) == ref.kept(), f"{name} ({protocol}) {step}: kept sets differ"
        err = (logits[0] - ref_logits).abs().max().item()
        assert err <= 1e-4, f"{name} ({protocol}) {step}: logits differ by {err:.3g}"

    with torch.inference_mode():
        if protocol == "block":
            for start in range(0, T, block):
                logits = model_step(model, *block_inputs(prompt, start, block))
                ref_logits = ref.block(ids[start:start + block], range(start, min(start + block, T)))
                check(f"block at {start}", logits, ref_logits)
        else:  # dense prompt then one compression to `keep`, then decode evicts or appends
            for layer in ref.layers:
                layer.budget = keep
            logits = prefill_one_shot(model, prompt, block)
            ref_logits = ref.block(ids, range(T))
            check("one-shot prefill", logits, ref_logits)
            for layer in ref.layers:
                layer.budget = budget
                if policy.decode == "append":
                    layer.policy = None
        for t, tok in enumerate(decode_ids):
            logits = model_step(model, torch.tensor([[tok]]), torch.tensor([T + t]))
            check(f"decode step {t}", logits, ref.block([tok], [T + t]))


# --------------------------------------------------------------------------------- compiled == eager

def kept_state(model, name) -> list[torch.Tensor]:
    """Positions and every per-slot and per-layer state tensor of every layer, in slot order. For keynorm only
    layer 0's sorted kept key norms: a token repeated by greedy decoding has the same key norm at every position up
    to RoPE's rounding (measured: 2e-7 apart), so eager and inductor may keep different copies of it, and the layers
    above then see different inputs."""
    if name == "keynorm":
        c = model.layers[0].attention.kv_cache
        return [c.k[c.pos >= 0].norm(dim=-1).sort().values]
    out = []
    for layer in model.layers:
        c = layer.attention.kv_cache
        out += [c.pos.clone(), *(t.clone() for t in c.state.values()), *(t.clone() for t in c.layer_state.values())]
    return out


# CAOTE is one function (caote_scores) over its base's per-query-head scores, so one CAOTE and one FastCAOTE variant
# compile it: caote:h2o (H2O's sums per query head, moved with their slots) and fastcaote:snapkv (SnapKV's votes
# pooled per query head over the query ring). The pieces the other six add are compiled in the rows of their bases:
# TOVA's last-row attention (tova; per query head in fastcaote:snapkv's window votes) and KeyDiff's cosine (keydiff).
# All eight run eager against the dynamic reference above and against the independent one in test_caote.py.
COMPILED_CAOTE = ("caote:h2o", "fastcaote:snapkv")
COMPILED = [n for n in NAMES if not issubclass(CLASSES[n], policies.CAOTE) or n in COMPILED_CAOTE]

# The prefill-block step is compiled too for the block-wise policies whose prefill block runs code of their own: a
# stateless scorer (keydiff: the block's eviction and hole filling, by a score of keys and positions), the last real
# query of a padded block (tova), per-slot state summed from a block's attention (h2o) and a query ring refilled from
# a block (snapkv). The others' prefill blocks run that code (their rule is the one their decode step compiles):
# sink, keynorm, random and the README's valuenorm score keys, values and positions statelessly as keydiff does;
# caote:h2o sums per query head as h2o does (the attention's padding rule is shared), fastcaote:snapkv fills
# snapkv's ring; exact-topk's selector acts only at decode (its prefill block runs no policy code). Those compile
# their decode step alone, as one-shot policies do (their dense prefill is never compiled). A new policy compiles both.
DECODE_ONLY = ("sink", "keynorm", "random", "valuenorm", "caote:h2o", "fastcaote:snapkv", "exact-topk")
STATELESS = ("sink", "keynorm", "random", "valuenorm")


def own_hooks(cls) -> list[str]:
    """The hooks beyond `score` a policy class overrides (those the cache calls in a prefill block among them)."""
    hooks = ("observe", "slot_state", "layer_state", "keep_slots", "selector_state", "prepare", "select")
    return [h for h in hooks if getattr(cls, h, None) is not getattr(policies.Policy, h, None)]


def test_decode_only_rows_add_no_prefill_code():
    """What DECODE_ONLY's comment says of each class, checked: a change to one of them (state, a ring, a layout of
    its own) moves it back to a row that compiles its prefill block."""
    for name in STATELESS:
        if name in CLASSES:  # valuenorm: while the README example runs
            assert is_scorer(CLASSES[name]) and own_hooks(CLASSES[name]) == [], name
    assert own_hooks(CLASSES["exact-topk"]) == ["select"] and not is_scorer(CLASSES["exact-topk"])
    for name, base in (("caote:h2o", policies.H2O), ("fastcaote:snapkv", policies.SnapKV)):
        cls = CLASSES[name]
        assert issubclass(cls, base) and all(getattr(cls, h) is getattr(base, h) for h in own_hooks(cls)), name
        assert own_hooks(cls) == own_hooks(base), name


@pytest.mark.parametrize("name", COMPILED)
def test_compiled_matches_eager_and_never_recompiles(tiny, name):
    """Fullgraph compile of the decode step (and of the prefill-block step unless DECODE_ONLY) gives the eager
    tokens and state, and holds error_on_recompile over 2 x 69 decode steps: one prompt crosses the budget during
    decode, one in prefill."""
    model, block, N = tiny, 16, 70
    protocol = protocols(name)[0]
    one_shot = protocol == "one-shot"  # planned for one prompt length (SAGE-KV's layout): one prompt
    cases = [ids_of(100, seed=6)] if one_shot else [ids_of(40, seed=5), ids_of(100, seed=6)]
    policy = make_policy(CLASSES[name], params_of(CLASSES[name]))
    budget = 48 if is_scorer(policy) else 100 + N
    if policy.decode == "append":
        budget = 40 + N
    setup(model, policy, budget, 100, N, block, prefill=protocol)
    eager = []
    for prompt in cases:
        out, _ = generate(model, prompt, N, block_size=block, steps=EAGER, one_shot=one_shot)
        eager.append((out, kept_state(model, name)))
    torch._dynamo.reset()
    steps = compile_steps("cpu", prefill=not one_shot and name not in DECODE_ONLY)
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            for prompt, (out_e, state_e) in zip(cases, eager):
                out_c, _ = generate(model, prompt, N, block_size=block, steps=steps, one_shot=one_shot)
                assert out_c == out_e
                for a, b in zip(kept_state(model, name), state_e):
                    assert torch.equal(a, b) if not a.is_floating_point() else torch.allclose(a, b, atol=1e-5)
    finally:
        torch._inductor.config.freezing = False
        torch._dynamo.reset()


# ------------------------------------------------------------------------------ a budget that holds everything

@pytest.fixture(scope="module")
def full_tokens(tiny) -> dict:
    """`full`'s greedy tokens for the prompt below, per protocol, generated once for every policy's row."""
    model, T, N = tiny, 70, 12
    out = {}
    for protocol in ("block", "one-shot"):
        setup(model, None, T + N, T, N, 16)
        out[protocol], _ = generate(model, ids_of(T, seed=9), N, block_size=16, steps=EAGER,
                                    one_shot=protocol == "one-shot")
    return out


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("protocol", ["block", "one-shot"])
def test_budget_holding_everything_reproduces_full(tiny, full_tokens, name, protocol):
    model, T, N = tiny, 70, 12
    if protocol not in protocols(name):
        pytest.skip(f"{name} runs one-shot only")
    prompt, ref = ids_of(T, seed=9), full_tokens[protocol]
    params = params_of(CLASSES[name], skip_if_fits=True)  # SAGE-KV's literal rule selects even when all fits
    setup(model, make_policy(CLASSES[name], params), T + N, T, N, 16, prefill=protocol)
    out, _ = generate(model, prompt, N, block_size=16, steps=EAGER, one_shot=protocol == "one-shot")
    assert out == ref
    for layer in model.layers:
        assert (layer.attention.kv_cache.n_valid() == T + N - 1).all()


# ------------------------------------------------------------------------------------- int8 KV

def run_kv(model, name, kv_dtype):
    policy = make_policy(CLASSES[name], params_of(CLASSES[name]))
    if name == "rocketkv":
        policy.read = 16  # sparse: k = 8 of the 40 slots
    if name == "exact-topk":
        policy.k = 16
    prompt, new = ids_of(90, seed=11), 8
    protocol = protocols(name)[0]
    budget = 40 if is_scorer(policy) else len(prompt) + new  # exact-topk holds everything
    setup(model, policy, budget, len(prompt), new, 16, prefill=protocol, kv_dtype=kv_dtype)
    out, _ = generate(model, prompt, new, block_size=16, steps=EAGER, one_shot=protocol == "one-shot")
    return out, [layer.attention.kv_cache.pos[0].sort(-1).values.clone() for layer in model.layers]


ROUNDINGS = {torch.int8: lambda x: dequantize_rows(*quantize_rows(x), x.dtype),
             torch.bfloat16: lambda x: x.bfloat16().to(x.dtype)}


@pytest.mark.parametrize("kv_dtype", list(ROUNDINGS), ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_narrow_kv_keeps_the_fp32_sets(tiny, name, kv_dtype, monkeypatch):
    """Against fp32 KV holding exactly the values int8 (bf16) KV represents (each K/V row rounded to its int8 grid,
    or to bf16, before it is written): every score and attention is computed from the same numbers, so the kept sets
    and tokens are identical; only the storage differs (int8 + scales, or bf16, moved through hole filling,
    sorting, compression and gathers)."""
    out_q, kept_q = run_kv(tiny, name, kv_dtype)
    assert tiny.layers[0].attention.kv_cache.k.dtype == kv_dtype
    update, rounded = KVCache.update, ROUNDINGS[kv_dtype]

    def rounded_update(self, q, k, v, input_pos, query_pos):
        return update(self, q, rounded(k), rounded(v), input_pos, query_pos)
    monkeypatch.setattr(KVCache, "update", rounded_update)
    out_fp, kept_fp = run_kv(tiny, name, None)
    assert tiny.layers[0].attention.kv_cache.k.dtype == torch.float32
    for layer, (a, b) in enumerate(zip(kept_fp, kept_q)):
        assert torch.equal(a, b), f"{name}: layer {layer} keeps different positions with {kv_dtype} KV"
    assert out_fp == out_q
