"""The generation loop: block-size invariance, compiled == eager with eviction, no recompiles, bounded memory."""
import json
import re
import subprocess
import sys

import pytest
import torch
from conftest import REPO

from cache import setup_caches
from engine import generate, setup
from loading import load_model
from model import set_layer_regions
from runtime import compile_steps, model_step, prefill_step
import policies
from policies import RandomScores
from sampling import Sampling

EAGER = (prefill_step, model_step)


def ids_of(n, seed=3, vocab=512):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def padded_blocks(model, idx, input_pos):
    """The eager step, but not runtime.prefill_step itself: engine.prefill then pads every block to block_size."""
    return prefill_step(model, idx, input_pos)


def test_block_size_invariance(hf_tiny):
    """With a budget >= prompt + new tokens, any block size gives the same tokens as one block."""
    _, ckpt = hf_tiny("llama")
    model = load_model(ckpt, torch.float32, "cpu")
    prompt = ids_of(300)
    outs = {}
    for block in (1, 7, 64, 300):
        setup_caches(model, 1, 300 + 16, block)
        outs[block], _ = generate(model, prompt, 16, block_size=block, steps=(padded_blocks, model_step))
    assert len(set(map(tuple, outs.values()))) == 1, outs


def test_decode_on_step_sees_each_steps_logits_and_time(hf_tiny):
    """engine.decode's on_step (the benchmarks' per-step clock): called once per step, after its tokens, with the
    logits that chose them and a positive time; the tokens are those of a decode without it."""
    from engine import decode, prefill
    from sampling import first_tokens
    _, ckpt = hf_tiny("llama")
    model = load_model(ckpt, torch.float32, "cpu")
    prompt = ids_of(40)
    runs = []
    for hook in (False, True):
        seen = []
        setup(model, None, 40 + 8, 40, 8, 16)
        with torch.inference_mode():
            token, outs = first_tokens(prefill(model, torch.tensor(prompt), 16))
            n = decode(model, model_step, token, outs, [40], 8,
                       on_step=(lambda logits, s: seen.append((logits.argmax(-1).tolist(), s))) if hook else None)
        runs.append(outs[0])
    assert n == 7 and runs[0] == runs[1] and len(runs[1]) == 8
    assert [tok for (tok,), _ in seen] == runs[1][1:] and all(s > 0 for _, s in seen)


@pytest.mark.parametrize("spec", ["full", "exact-topk:k=64", "keydiff"])
def test_eager_prefill_without_eviction_takes_unpadded_chunks(hf_tiny, spec):
    """engine.prefill's eager step over caches that hold every token at slot == position takes the prompt in
    unpadded chunks of EAGER_CHUNK tokens, whatever the block size, and fills the caches as 64-token padded blocks
    do; a cache that evicts keeps its padded blocks."""
    from engine import EAGER_CHUNK, prefill
    _, ckpt = hf_tiny("llama")
    model = load_model(ckpt, torch.float32, "cpu")
    prompt = torch.tensor(ids_of(1100))
    policy = None if spec == "full" else policies.make(spec)
    budget = 1200 if spec != "keydiff" else 96
    shapes = []
    model.register_forward_pre_hook(lambda m, args: shapes.append(args[0].shape[1]))
    with torch.inference_mode():
        setup(model, policy, budget, 1100, 8, 64)
        chunked = prefill(model, prompt, 64)
        kept = [(c.k.clone(), c.pos.clone()) for c in (layer.attention.kv_cache for layer in model.layers)]
        calls, shapes[:] = list(shapes), []
        setup(model, policy, budget, 1100, 8, 64)
        padded = prefill(model, prompt, 64, step=padded_blocks)
    if spec == "keydiff":
        assert calls == [64] * 18
        return
    assert calls == [EAGER_CHUNK, EAGER_CHUNK, 1100 - 2 * EAGER_CHUNK] and shapes == [64] * 18
    torch.testing.assert_close(chunked, padded, rtol=1e-5, atol=1e-5)
    for (k, pos), layer in zip(kept, model.layers):
        c = layer.attention.kv_cache
        assert torch.equal(pos, c.pos)  # padding went to the tail, whose keys no query sees
        torch.testing.assert_close(k[..., :1100, :], c.k[..., :1100, :], rtol=1e-5, atol=1e-5)


def test_budget_bounds_every_layer(hf_tiny):
    _, ckpt = hf_tiny("llama")
    model = load_model(ckpt, torch.float32, "cpu")
    setup_caches(model, 1, 48, 16, RandomScores())
    generate(model, ids_of(100), 20, block_size=16, steps=EAGER)
    for layer in model.layers:
        c = layer.attention.kv_cache
        assert c.k.shape[2] == 48 + 16
        assert (c.n_valid() == 48).all()
        assert (c.pos[..., 48:] == -1).all()
        assert c.pos.max() == 100 + 20 - 2  # the newest written token is the one before the last sampled


def test_compiled_decode_never_copies_a_whole_kv_buffer(hf_tiny):
    """Hole filling stays in place when compiled: no kernel of the compiled decode step loops over a whole K or V
    buffer (B*H*C*D elements, C = budget + block, where a decode step reads budget + 1 slots). A mutation through
    a view of the buffer (the former index_copy_ of flat rows) made inductor copy each buffer onto itself in every
    layer and step: O(budget) traffic per step, which DESIGN's hole filling rules out. With that code this test
    fails (checked when it was written). One evicting policy: the hole filling (write_slots, evict_fill_holes) is
    the same code under every policy; H2O's, whose per-slot scores move with K and V, is the fullest."""
    policy = "h2o"
    from torch._inductor.utils import run_and_get_code
    _, ckpt = hf_tiny("llama")
    model = load_model(ckpt, torch.float32, "cpu")
    setup_caches(model, 1, 40, 8, policies.make(policy))
    generate(model, ids_of(60), 2, block_size=8, steps=EAGER)  # past the budget: the step evicts
    numel = model.layers[0].attention.kv_cache.k.numel()
    torch._dynamo.reset()
    _, decode = compile_steps("cpu")
    try:
        with torch.inference_mode():
            _, code = run_and_get_code(decode, model, torch.zeros(1, 1, dtype=torch.long), torch.tensor([61]))
    finally:
        torch._inductor.config.freezing = False
        torch._dynamo.reset()
    src = "\n".join(code)
    assert "argmin" in src  # the decode eviction (drop_lowest) is in the captured kernels
    assert "subgraph_0" in src  # the layers' region, compiled once
    # a constant that inductor's lowering makes inside a region reached the CPU int4 kernel wrong (torch 2.13)
    assert not re.search(r"subgraph_\d+_constant", src), "a constant made inside a layer region"
    assert f"<static_cast<int64_t>({numel}L)" not in src, "a kernel loops over a whole K/V buffer"


@pytest.mark.parametrize("policy", [None, "keydiff", "snapkv", "rocketkv"])
def test_compiled_step_traces_one_layer_for_every_layer(hf_tiny, policy):
    """A compiled step traces the first layer and stamps its graph out for the others (engine.block_region): one
    trace, the step's graph calls one subgraph once per layer. A per-layer read in the traced code (the cache view
    copying the layer's index did: dynamo guarded on it and traced every layer again, into an identical graph)
    fails the trace count. Regions off (as for a frozen step): every layer inline, no subgraph."""
    from torch._dynamo.utils import compilation_time_metrics  # dynamo_timed's record of each trace and stamp-out
    _, ckpt = hf_tiny("llama")
    model = load_model(ckpt, torch.float32, "cpu")
    assert len(model.layers) >= 2
    prompt, one_shot = ids_of(60), policy == "rocketkv"  # RocketKV: a one-shot compression, then its selection
    setup(model, policy and policies.make(policy), 40 if policy else 70, len(prompt), 8, 8,
          prefill="one-shot" if one_shot else "block")
    generate(model, prompt, 2, block_size=8, steps=EAGER, one_shot=one_shot)  # past the budget: the step evicts
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def subgraph_calls():
        return [n for n in graphs[-1].graph.nodes if n.op == "call_function"
                and n.target is torch.ops.higher_order.invoke_subgraph]
    try:
        for regions in (True, False):
            set_layer_regions(regions)
            torch._dynamo.reset()
            compilation_time_metrics.clear()
            step = torch.compile(model_step, fullgraph=True, dynamic=False, backend=capture)
            with torch.inference_mode():
                step(model, torch.zeros(1, 1, dtype=torch.long), torch.tensor([61]))
            calls = subgraph_calls()
            if regions:
                assert len(compilation_time_metrics.get("invoke_subgraph_trace", [])) == 1, "a layer traced again"
                assert len(compilation_time_metrics["invoke_subgraph_reuse_stamp_out"]) == len(model.layers) - 1
                assert len(calls) == len(model.layers)
                assert len({n.args[0].target for n in calls}) == 1, "a layer was traced again"
            else:
                assert calls == []
    finally:
        set_layer_regions(True)
        torch._dynamo.reset()


def test_a_layer_that_reads_its_index_is_traced_again(hf_tiny):
    """Negative control of the layer regions: a policy whose rule reads the layer's index (keys of smallest norm in
    layer 0, of largest in the others) gets each layer traced on its own, and the traced step keeps what eager keeps
    in every layer. A region reused across layers would score layer 1 as layer 0 does. The trace is the claim:
    aot_eager runs the functionalized graph with its regions as dynamo and AOTAutograd made them (inductor's
    lowering of a step's regions: test_compiled_decode_never_copies_a_whole_kv_buffer)."""
    from dataclasses import dataclass
    from torch._dynamo.utils import compilation_time_metrics

    @dataclass
    class LayerFlip(policies.KeyNorm):
        window_frac: float = 0.0

        def score(self, view):
            s = super().score(view)
            return s if view.layer == 0 else -s

    _, ckpt = hf_tiny("llama")
    models = [load_model(ckpt, torch.float32, "cpu") for _ in range(2)]
    for model in models:
        setup(model, LayerFlip(), 40, 60, 8, 8)
        generate(model, ids_of(60), 2, block_size=8, steps=EAGER)  # past the budget: each step evicts
    try:
        torch._dynamo.reset()
        compilation_time_metrics.clear()
        step = torch.compile(model_step, fullgraph=True, dynamic=False, backend="aot_eager")
        with torch.inference_mode():
            for i in range(3):
                tok, pos = torch.tensor([[5 + i]]), torch.tensor([61 + i])
                want = model_step(models[0], tok, pos)
                got = step(models[1], tok, pos)
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert len(compilation_time_metrics["invoke_subgraph_trace"]) == len(models[0].layers)
        for a, b in zip(models[0].layers, models[1].layers):
            pa, pb = a.attention.kv_cache.pos, b.attention.kv_cache.pos
            assert torch.equal(pa.sort(-1).values, pb.sort(-1).values)  # the same positions kept, in any slots
    finally:
        torch._dynamo.reset()


def test_steps_traced_with_and_without_regions_alternate_without_recompiling(hf_tiny):
    """The regions switch is read when dynamo traces and not guarded (engine.regions_on), like inductor's freezing
    flag: a step traced with regions and one traced without (a frozen twin, bench.py --freezing-twins) keep
    alternating in one process under error_on_recompile, each its own graph."""
    _, ckpt = hf_tiny("llama")
    models = [load_model(ckpt, torch.float32, "cpu") for _ in range(2)]
    for model in models:
        setup(model, policies.make("keydiff"), 40, 60, 8, 8)
        generate(model, ids_of(60), 2, block_size=8, steps=EAGER)
    graphs = []

    def compiled():  # each configuration its own compiled step, as compile_steps gives (a backend of its own)
        def capture(gm, example_inputs):
            graphs.append(gm)
            return gm.forward
        return torch.compile(model_step, fullgraph=True, dynamic=False, backend=capture)

    def step_inputs(i):
        return torch.zeros(1, 1, dtype=torch.long), torch.tensor([61 + i])
    try:
        torch._dynamo.reset()
        steps = [compiled(), compiled()]
        with torch.inference_mode():
            for step, model, regions in zip(steps, models, (True, False)):
                set_layer_regions(regions)
                step(model, *step_inputs(0))
            assert [any(n.target is torch.ops.higher_order.invoke_subgraph for n in g.graph.nodes)
                    for g in graphs] == [True, False]
            with torch._dynamo.config.patch(error_on_recompile=True):
                for i in range(1, 3):
                    for step, model in zip(steps, models):
                        step(model, *step_inputs(i))
        assert len(graphs) == 2
    finally:
        set_layer_regions(True)
        torch._dynamo.reset()


def test_recompile_check_can_fail(hf_tiny):
    """Negative control: a block shape the compiled step has not seen does trip error_on_recompile."""
    _, ckpt = hf_tiny("llama")
    model = load_model(ckpt, torch.float32, "cpu")
    setup_caches(model, 1, 32, 8, RandomScores())
    torch._dynamo.reset()
    step = torch.compile(model_step, fullgraph=True, dynamic=False, backend="eager")
    try:
        with torch._dynamo.config.patch(error_on_recompile=True), torch.inference_mode():
            step(model, torch.zeros(1, 8, dtype=torch.long), torch.arange(8))
            with pytest.raises(Exception, match="[Rr]ecompil"):
                step(model, torch.zeros(1, 4, dtype=torch.long), torch.arange(4))
    finally:
        torch._dynamo.reset()


PEAK_SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, {repo!r}); sys.path.insert(0, {tests!r})
from conftest import make_hf_checkpoint
from cache import setup_caches
from engine import generate, PeakMemory
from runtime import model_step, prefill_step
from loading import load_model
import policies
from policies import RandomScores
from pathlib import Path
model = load_model(Path({ckpt!r}), torch.float32, "cpu")
budget, block = 64, 32


def peak(prompt_len, mode):
    ids = torch.randint(0, 512, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    if mode == "blockwise":
        setup_caches(model, 1, budget, block, RandomScores())
        _, stats = generate(model, ids, 2, block_size=block, steps=(prefill_step, model_step))
        return stats["prefill_peak_bytes"]
    setup_caches(model, 1, prompt_len, prompt_len)  # negative control: one dense block holding the whole prompt
    mem = PeakMemory("cpu"); mem.reset()
    model(torch.tensor([ids]), torch.arange(prompt_len))
    return mem.peak()


with torch.inference_mode():  # 2x budget and 8x budget (4x further), block-wise, then the dense control
    print(json.dumps([peak(n, mode) for mode in ("blockwise", "dense") for n in (2 * budget, 8 * budget * 4)]))
"""


def test_peak_memory_does_not_grow_with_prompt(tmp_path):
    """Process peak RSS (VmHWM, reset at the start of prefill) at prompt 8x budget within 10% of 2x budget.

    The four measurements run in one fresh process, each prompt after a smaller one: the reset sets the peak to the
    process's RSS at that moment (what earlier runs left allocated counts), so a prefill that holds more than the
    smaller one did raises it. The model is sized so that what a dense prefill would hold (scores [heads, T, T],
    activations [T, hidden]) is large at 8x budget; the negative control, measured last, shows the measure sees it.
    """
    from conftest import FAMILIES, make_hf_checkpoint
    FAMILIES["mem"] = dict(FAMILIES["llama"], hidden_size=256, intermediate_size=1024, num_attention_heads=8,
                           num_key_value_heads=2, num_hidden_layers=2)
    make_hf_checkpoint("mem", tmp_path)
    script = tmp_path / "peak.py"
    script.write_text(PEAK_SCRIPT.format(repo=str(REPO), tests=str(REPO / "tests"), ckpt=str(tmp_path)))

    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True)
    small, large, dense_small, dense_large = json.loads(r.stdout.strip().splitlines()[-1])
    assert large <= 1.10 * small, (small, large)
    assert dense_large > 1.10 * dense_small, (dense_small, dense_large)  # the measure does see growth


def test_one_shot_window_is_a_fraction_of_the_budget(hf_tiny):
    """KeyDiff + SW under --prefill one-shot keeps the floor(p * budget) newest tokens and the best-scored rest (the
    paper's SW variant), as block-wise does. The window was once a fraction of the one-shot scratch (the whole padded prompt), which
    protected more tokens than the budget holds and left pure recency. Reference: the raw-anchor KeyDiff scores of
    every prompt key, read from a `full` one-shot prefill (slot == position), and a plain top-k."""
    from engine import prefill_one_shot
    _, ckpt = hf_tiny("llama")
    model = load_model(ckpt, torch.float32, "cpu")
    L, N, p, block = 200, 40, 0.2, 16
    prompt = torch.tensor(ids_of(L, seed=5))
    window = int(p * N)
    with torch.inference_mode():
        setup_caches(model, 1, L, block)
        prefill_one_shot(model, prompt, block)
        keys = [layer.attention.kv_cache.k[0, :, :L].clone() for layer in model.layers]  # [H, L, D] per layer
        setup_caches(model, 1, N, block, policies.KeyDiff(window_frac=p))
        prefill_one_shot(model, prompt, block)
    for layer, k in zip(model.layers, keys):
        pos = layer.attention.kv_cache.pos[0]
        for h in range(k.shape[0]):
            score = -torch.cosine_similarity(k[h], k[h].mean(0, keepdim=True), dim=-1)
            best = score[:L - window].topk(N - window).indices.tolist()
            want = sorted(best + list(range(L - window, L)))
            assert sorted(pos[h][pos[h] >= 0].tolist()) == want


def test_non_finite_logits_stop_generation(hf_tiny):
    """A decode step whose logits are not finite stops generate() with one line (UserError) after the tokens that
    were good, instead of sampling token 0 from NaN."""
    from errors import UserError
    _, ckpt = hf_tiny("llama")
    model = load_model(ckpt, torch.float32, "cpu")
    setup_caches(model, 1, 64, 8)
    seen, calls = [], []

    def decode(model, idx, pos):
        calls.append(1)
        logits = model_step(model, idx, pos)
        return logits if len(calls) < 3 else logits.masked_fill(torch.arange(logits.shape[-1]) == 7, float("inf"))
    with pytest.raises(UserError, match="not finite .* at generated token 4: generation stopped"):
        generate(model, ids_of(20), 10, block_size=8, steps=(prefill_step, decode), sampling=Sampling(0.7),
                 on_token=lambda out: seen.append(list(out)))
    assert len(seen[-1]) == 3  # the first token and two decode steps, nothing from the bad step


@pytest.mark.parametrize("kv_dtype", [None, torch.int8, torch.bfloat16])
def test_kv_estimate_is_what_setup_allocates(hf_tiny, kv_dtype):
    """loading.kv_cache_estimate (what a random model must leave free) counts the bytes the caches then hold."""
    from cache import kv_bytes
    from loading import kv_cache_estimate
    _, ckpt = hf_tiny("llama")
    model = load_model(ckpt, torch.float32, "cpu")
    setup_caches(model, 3, 40, 8, RandomScores(), kv_dtype=kv_dtype)
    assert kv_bytes(model) == 3 * kv_cache_estimate(model.args, 48, torch.float32, kv_dtype) > 0
