"""scripts/bench_batch.py (throughput at a memory cap): a batch whose every row is a copy of one prefilled
sequence's cache state decodes, greedily, each row exactly as that sequence does alone (batch-1 generate()); the
end-to-end run on tiny random-weight shapes writes one row per (policy, batch), stops at the first batch whose
estimate (weights + whole cache) exceeds --memory-cap, and names the largest batch that fits."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import policies
from engine import generate, load_model, model_step, prefill, prefill_protocol, prefill_step, setup, setup_batch
from scripts import bench_batch

pytestmark = pytest.mark.usefixtures("one_thread")
REPO = Path(__file__).resolve().parent.parent
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
        setup_batch(model, policies.make(spec), budget, [L] * 3, NEW, BLOCK, prefill=protocol)
        bench_batch.copy_rows(model, state)
        _, rows = bench_batch.decode_rows(model, first, L, 3, NEW - 1, model_step, "cpu")
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


def test_batch_run_stops_at_the_cap(tiny_config_dir, tmp_path):
    """The cap's search end to end: full fits a batch of 1 (0.546 MiB), not 2 (0.685); KeyDiff's 64-slot rows fit 2
    (0.488), not 4 (0.569). Full's rows across batch sizes: test_copied_rows_decode_as_the_batch_one_sequence[full]
    (3 copied rows decode its batch-1 tokens) and test_step_flops_by_hand (FLOPs per sequence)."""
    out, png, cap = tmp_path / "batch.json", tmp_path / "batch.png", 0.56
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_batch.py"), "--checkpoint", str(tiny_config_dir),
                        "--random-weights", "--policies", "keydiff", "--prompt-tokens", "256", "--budget",
                        "64", "--block-size", "16", "--decode-steps", "3", "--threads", "1", "--memory-cap", str(cap),
                        "--json", str(out), "--plot", str(png)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "each row a copy of one prefilled sequence" in r.stderr + r.stdout
    assert "| keydiff |" in r.stdout and "| full |" in r.stdout
    saved = json.loads(out.read_text())
    rows, summary = saved["rows"], saved["summary"]
    assert saved["memory_cap_mib"] == cap and saved["settings"]["mode"] == "batch"
    for label in ("full", "keydiff"):
        mine = [x for x in rows if x["label"] == label]
        assert [x["batch"] for x in mine] == [2 ** i for i in range(len(mine))]  # 1, 2, 4, ... in order
        *fit, over = mine
        assert fit and all(x["fits"] and x["measured"] and x["estimate_mib"] <= cap for x in fit)
        assert not over["fits"] and not over["measured"] and over["estimate_mib"] > cap  # decided, not run
        assert "decode_tok_s" not in over
        assert all(x["rows_identical"] and x["decode_tok_s"] > 0 and x["ideal_tok_s"] > 0 for x in fit)
        # the roofline adds the FLOPs' time to the reads': never above the bandwidth model
        assert all(0 < x["roofline_tok_s"] <= x["ideal_tok_s"] and x["products_ms"] > 0 for x in fit)
        assert [x["flops"] / x["batch"] for x in fit] == [fit[0]["flops"]] * len(fit)  # per sequence: the same
        assert [x["estimate_mib"] for x in mine] == sorted(x["estimate_mib"] for x in mine)
        assert summary[label]["batch"] == fit[-1]["batch"]
        assert len({tuple(x["tokens"]) for x in fit}) == 1  # every batch size decodes the same sequence
    # keydiff's 64-slot rows are smaller than full's 256 + decode: more of them fit under the same cap
    assert summary["keydiff"]["batch"] > summary["full"]["batch"]
    assert summary["keydiff"]["ideal_vs_full"] > 1
    k, f = summary["keydiff"], summary["full"]
    assert k["of_roofline_ratio"] == pytest.approx(k["vs_full"] / (k["roofline_tok_s"] / f["roofline_tok_s"]))
    # at ms_for_85 ms per step, keydiff's ratio to full's measured tok/s is 85% of the bandwidth model's ratio
    assert k["batch"] / (k["ms_for_85"] / 1e3) / f["decode_tok_s"] == pytest.approx(0.85 * k["ideal_vs_full"])
    assert saved["gemm_gflop_s"] > 0 and "roofline" in r.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
