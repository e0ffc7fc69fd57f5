"""scripts/bench_batch.py (throughput at a memory cap): a batch whose every row is a copy of one prefilled
sequence's cache state decodes, greedily, each row exactly as that sequence does alone (batch-1 generate()), and the
FLOPs of a step by hand. The script end to end (one row per (policy, batch), stopping at the first batch whose
estimate exceeds --memory-cap, the largest batch that fits, its plot): gpu_check's batch section runs it,
test_gpu_check.py::test_batch_section_runs_bench_batch_to_the_cap."""
import pytest
import torch

import policies
from engine import Generation, generate, prefill, prefill_protocol, setup, setup_batch
from runtime import model_step, prefill_step
from loading import load_model
from scripts import bench_batch

pytestmark = pytest.mark.usefixtures("one_thread")
BLOCK, NEW = 8, 10
PROMPT = torch.randint(0, 512, (45,), generator=torch.Generator().manual_seed(7)).tolist()

CASES = [  # (policy spec, cache budget): full, block-wise evicting with per-slot state (h2o) and a query ring
    # (snapkv), one-shot compressions whose decode appends (snapkv++, rocketkv with its selector pages)
    ("full", len(PROMPT) + NEW), ("keydiff", 16), ("h2o", 16), ("snapkv:window=8", 16), ("tova", 16),
    ("snapkv++:window=4", 24), ("rocketkv:read=12,window=4", 24)]
STATEFUL = {"h2o", "snapkv:window=8", "rocketkv:read=12,window=4"}


@pytest.mark.parametrize("spec,budget", CASES, ids=[c[0] for c in CASES])
def test_copied_rows_decode_as_the_batch_one_sequence(hf_tiny, spec, budget):
    _, ckpt = hf_tiny("llama")
    model = load_model(ckpt, torch.float32, "cpu")
    protocol = prefill_protocol(policies.make(spec), None)
    one_shot = protocol == "one-shot"
    L = len(PROMPT)
    with torch.inference_mode():
        setup(model, policies.make(spec), budget, L, NEW, BLOCK, prefill=protocol)
        want = generate(model, PROMPT, NEW, block_size=BLOCK, steps=(prefill_step, model_step),
                        one_shot=one_shot)[0]
        # what bench_batch.py does: one batch-1 prefill, its cache state copied into every row of a fresh batch
        setup_batch(model, policies.make(spec), budget, [L], NEW, BLOCK, prefill=protocol)
        first = int(prefill(model, torch.tensor(PROMPT), BLOCK, one_shot=one_shot).argmax(-1)[0])
        state = bench_batch.cache_state(model)
        gen = Generation(model.args, policies.make(spec), [L] * 3, budget=budget, max_new_tokens=NEW, block_size=BLOCK,
                         prefill=protocol)
        gen.setup(model)
        bench_batch.copy_rows(model, state)
        _, rows = bench_batch.decode_rows(model, gen, first, L, 3)
    assert len(want) == NEW and len(set(want)) > 1  # a real sequence, not one token repeated
    assert rows == [want] * 3
    # the cases with policy state beyond K, V and positions (per slot, per layer): it travelled with the rows
    assert bool(set(state[0]) - {"k", "v", "pos"}) == (spec in STATEFUL)


def test_copy_rows_refuses_a_cache_of_another_shape(hf_tiny):
    _, ckpt = hf_tiny("llama")
    model = load_model(ckpt, torch.float32, "cpu")
    setup(model, policies.make("h2o"), 16, 20, 4, BLOCK)
    state = bench_batch.cache_state(model)
    setup_batch(model, policies.make("h2o"), 24, [20, 20], 4, BLOCK)  # 24 slots, not 16
    with pytest.raises(ValueError, match="is not one row of"):
        bench_batch.copy_rows(model, state)
    setup_batch(model, None, 16, [8, 8], 4, BLOCK)  # full: the same slots, no policy state
    with pytest.raises(ValueError, match="cache buffers differ"):
        bench_batch.copy_rows(model, state)


def test_step_flops_by_hand(hf_tiny):
    """2 FLOPs per weight per sequence for every product (the tied head included) plus 4 x head_dim per query head
    per attended slot, counted from the config by hand."""
    _, ckpt = hf_tiny("llama")
    model = load_model(ckpt, torch.float32, "cpu")
    a = model.args
    setup_batch(model, policies.make("keydiff"), 16, [20, 20, 20], 4, BLOCK)
    d, hq, hkv = a.head_dim, a.n_heads, a.n_kv_heads
    per_layer = a.dim * (hq + 2 * hkv) * d + hq * d * a.dim + a.dim * 2 * a.intermediate_size \
        + a.intermediate_size * a.dim
    products = a.n_layers * per_layer + a.dim * a.vocab_size
    slots = model.layers[0].attention.kv_cache.read_tokens()
    assert bench_batch.step_flops(model, 3) == 3 * (2 * products + a.n_layers * 4 * hq * d * slots)
    assert bench_batch.products_ms(model, 3, "cpu") > 0
