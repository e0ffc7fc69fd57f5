"""Batch generation with ragged prompts: each sequence of a batch generates, greedily, exactly its batch-1 tokens
(batch-1 runs of the same engine are the reference; they are tested against independent references elsewhere),
for every policy, block-wise and one-shot; EOS stops one sequence and not the others; compiled, a batch never
recompiles."""
import pytest
import torch

import policies
from engine import generate, generate_batch, prefill_protocol, setup, setup_batch
from runtime import model_step, prefill_step
from loading import load_model
from errors import UserError

pytestmark = pytest.mark.usefixtures("one_thread")
EAGER = (prefill_step, model_step)
NEW, BLOCK = 10, 8


def ids_of(n, seed, vocab=512):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# Lengths chosen so that the batch is ragged in every way: a prompt past the budget (evicts during prefill), one
# that ends inside the first block (all-padding blocks after), one that ends mid-block.
PROMPTS = [ids_of(37, 1), ids_of(9, 2), ids_of(22, 3)]
LONG_PROMPTS = [ids_of(37, 1), ids_of(30, 2), ids_of(22, 3)]  # SAGE-KV: every prompt gets the same layout

CASES = [  # (policy spec, --prefill, budget)
    ("full", "block", 60), ("full", "one-shot", 60), ("keydiff", "block", 16), ("keydiff", "one-shot", 16),
    ("h2o", "block", 16), ("h2o", "one-shot", 16), ("snapkv:window=8", "block", 16), ("tova", "block", 16),
    ("sink", "block", 16), ("keynorm", "block", 16), ("random", "block", 16), ("caote:h2o", "block", 16),
    ("fastcaote:snapkv:window=8", "block", 16), ("caote:tova", "block", 16), ("caote:keydiff", "block", 16),
    ("snapkv++:window=4", "one-shot", 24), ("rocketkv:read=12,window=4", "one-shot", 24),
    ("exact-topk:k=8", "block", 60), ("kvec:window=4,obs_window=4,long_window=8", "one-shot", 24),
    ("sagekv", "one-shot", 24),
]


def batch_one(model, spec, prefill, budget, prompts, new=NEW, eos_ids=(), device="cpu"):
    outs = []
    for p in prompts:
        setup(model, policies.make(spec), budget, len(p), new, BLOCK, prefill=prefill)
        outs.append(generate(model, p, new, block_size=BLOCK, steps=EAGER, one_shot=prefill == "one-shot",
                             eos_ids=eos_ids, device=device)[0])
    return outs


def batched(model, spec, prefill, budget, prompts, new=NEW, eos_ids=(), steps=EAGER, device="cpu"):
    setup_batch(model, policies.make(spec), budget, [len(p) for p in prompts], new, BLOCK, prefill=prefill)
    return generate_batch(model, prompts, new, block_size=BLOCK, steps=steps, one_shot=prefill == "one-shot",
                          eos_ids=eos_ids, device=device)


@pytest.mark.parametrize("spec,prefill,budget", CASES, ids=[f"{s}-{p}" for s, p, _ in CASES])
def test_each_sequence_generates_its_batch_one_tokens(hf_tiny, spec, prefill, budget):
    _, ckpt = hf_tiny("llama")
    model = load_model(ckpt, torch.float32, "cpu")
    assert prefill_protocol(policies.make(spec), prefill) == prefill
    prompts = LONG_PROMPTS if spec == "sagekv" else PROMPTS
    with torch.inference_mode():
        want = batch_one(model, spec, prefill, budget, prompts)
        got, stats = batched(model, spec, prefill, budget, prompts)
    assert got == want
    assert len({tuple(o) for o in want}) == len(prompts)  # the sequences differ: a mix-up between rows would show
    assert stats["batch_size"] == 3 and stats["generated_tokens"] == [NEW] * 3
    assert stats["decode_tokens"] == 3 * (NEW - 1)
    c = model.layers[0].attention.kv_cache
    assert c.k.shape[0] == 3 and c.k.shape[2] == c.spec.budget + BLOCK  # one static buffer [batch, kv_heads, C, D]


VARIANTS = [("keydiff", dict(kv_dtype=torch.int8), 16), ("h2o", dict(evict_before_attend=True), 16),
            ("snapkv:window=8", dict(evict_before_attend=True), 16), ("full", dict(kv_dtype=torch.int8), 60),
            ("rocketkv:read=12,window=4", dict(kv_dtype=torch.int8, prefill="one-shot"), 24)]


@pytest.mark.parametrize("spec,options,budget", VARIANTS, ids=[f"{s}-{sorted(o)}" for s, o, _ in VARIANTS])
def test_int8_cache_and_evict_before_attend_batch(hf_tiny, spec, options, budget):
    """The int8 buffer (per-row scales written per row) and --evict-before-attend batch alike."""
    _, ckpt = hf_tiny("llama")
    model = load_model(ckpt, torch.float32, "cpu")
    one_shot = options.get("prefill") == "one-shot"
    with torch.inference_mode():
        want = []
        for p in PROMPTS:
            setup(model, policies.make(spec), budget, len(p), NEW, BLOCK, **options)
            want.append(generate(model, p, NEW, block_size=BLOCK, steps=EAGER, one_shot=one_shot)[0])
        setup_batch(model, policies.make(spec), budget, [len(p) for p in PROMPTS], NEW, BLOCK, **options)
        got, _ = generate_batch(model, PROMPTS, NEW, block_size=BLOCK, steps=EAGER, one_shot=one_shot)
    assert got == want


def test_sliding_window_batch(hf_tiny):
    """Mistral's window masks per sequence too (each query at its own position)."""
    _, ckpt = hf_tiny("mistral")
    model = load_model(ckpt, torch.float32, "cpu")
    prompts = [ids_of(70, 4), ids_of(12, 5)]  # past the window of 48
    with torch.inference_mode():
        for spec, budget in (("full", 90), ("keydiff", 16)):
            assert batched(model, spec, "block", budget, prompts)[0] == batch_one(model, spec, "block", budget,
                                                                                   prompts)


def test_eos_stops_one_sequence_and_not_the_others(hf_tiny):
    """The EOS is the 4th token sequence 0 generates alone: it stops there (EOS included, as generate() does) and
    the others go on with their own batch-1 tokens, each cut at its own first EOS if any."""
    _, ckpt = hf_tiny("llama")
    model = load_model(ckpt, torch.float32, "cpu")
    with torch.inference_mode():
        free = batch_one(model, "keydiff", "block", 16, PROMPTS)
        eos = {free[0][3]}
        want = batch_one(model, "keydiff", "block", 16, PROMPTS, eos_ids=eos)
        got, stats = batched(model, "keydiff", "block", 16, PROMPTS, eos_ids=eos)
    assert got == want
    assert len(got[0]) == 4 and max(map(len, got)) == NEW  # one stopped early, another ran to the end
    assert stats["decode_tokens"] == sum(len(o) - 1 for o in got)


def test_batch_of_one_prompt_repeated_is_its_batch_one_output(hf_tiny):
    _, ckpt = hf_tiny("llama")
    model = load_model(ckpt, torch.float32, "cpu")
    with torch.inference_mode():
        want = batch_one(model, "h2o", "block", 16, PROMPTS[:1])
        assert batched(model, "h2o", "block", 16, PROMPTS[:1] * 3)[0] == want * 3


def test_plans_that_differ_by_prompt_length_are_refused(hf_tiny):
    """SAGE-KV's layout and RocketKV's default read depend on the prompt's length; a batch decodes with one plan."""
    _, ckpt = hf_tiny("llama")
    model = load_model(ckpt, torch.float32, "cpu")
    with pytest.raises(UserError, match="sagekv plans a 9-token and a 22-token prompt differently"):
        setup_batch(model, policies.make("sagekv"), 24, [9, 22], NEW, BLOCK, prefill="one-shot")
    with pytest.raises(UserError, match="give rocketkv:read=N"):
        setup_batch(model, policies.make("rocketkv:window=4"), 24, [22, 60], NEW, BLOCK, prefill="one-shot")


@pytest.mark.parametrize("spec,prefill,budget", [("keydiff", "block", 16), ("sagekv", "one-shot", 24)])
def test_compiled_batch_never_recompiles(hf_tiny, spec, prefill, budget):
    """Both steps compiled (fullgraph=True) under error_on_recompile: the batch size is static and the prompts'
    lengths are no shape (one-shot prompts are re-planned one by one: the decode step's guards still hold).
    Compiled == eager. One policy per protocol: the batch's shapes and guards are the protocol's, and
    test_conformance compiles every policy's own steps."""
    from runtime import compile_steps
    _, ckpt = hf_tiny("llama")
    model = load_model(ckpt, torch.float32, "cpu")
    prompts = LONG_PROMPTS if spec == "sagekv" else PROMPTS
    with torch.inference_mode():
        want, _ = batched(model, spec, prefill, budget, prompts)
    torch._dynamo.reset()
    steps = compile_steps("cpu")
    try:
        with torch._dynamo.config.patch(error_on_recompile=True), torch.inference_mode():
            got, _ = batched(model, spec, prefill, budget, prompts, steps=steps)
            again, _ = generate_batch(model, prompts, NEW, block_size=BLOCK, steps=steps,
                                      one_shot=prefill == "one-shot")  # a second batch, same caches: no recompile
    finally:
        torch._inductor.config.freezing = False
        torch._dynamo.reset()
    assert got == want and again == want


def test_empty_prompt_in_a_batch_is_refused_before_any_step(hf_tiny):
    _, ckpt = hf_tiny("llama")
    model = load_model(ckpt, torch.float32, "cpu")
    setup_batch(model, policies.make("keydiff"), 16, [3, 1], NEW, BLOCK)
    calls = []

    def step(model, idx, pos):
        calls.append(1)
        return model_step(model, idx, pos)
    with pytest.raises(UserError, match="no prompt may be empty"):
        generate_batch(model, [[1, 2, 3], []], NEW, block_size=BLOCK, steps=(step, step))
    assert calls == []


@pytest.mark.cuda
def test_compiled_batch_replays_as_cuda_graphs(hf_tiny):
    """On a GPU: a batch's decode step under CUDA graphs (compile_steps' default there), prefill compiled, under
    error_on_recompile: no cudagraph skip, and each sequence's tokens are its eager batch-1 tokens."""
    from torch._dynamo.utils import counters

    from runtime import compile_steps
    _, ckpt = hf_tiny("llama")
    torch.backends.cuda.matmul.allow_tf32 = False
    model = load_model(ckpt, torch.float32, "cuda")
    with torch.inference_mode():
        want = batch_one(model, "keydiff", "block", 16, PROMPTS, device="cuda")
    torch._dynamo.reset()
    counters.clear()
    try:
        steps = compile_steps("cuda")
        with torch._dynamo.config.patch(error_on_recompile=True), torch.inference_mode():
            got, _ = batched(model, "keydiff", "block", 16, PROMPTS, steps=steps, device="cuda")
            again, _ = generate_batch(model, PROMPTS, NEW, block_size=BLOCK, steps=steps, device="cuda")
    finally:
        torch._dynamo.reset()
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert got == want and again == want
