"""scripts/gpu_check.py's logic on this CPU: what decides pass or fail, every section's orchestration of the benchmark
scripts and the peer end to end at tiny shapes, the warm-up order before a CUDA graph capture, the compile modes, and
the one line on a machine without CUDA. Its GPU measurements themselves run on a GPU only (bash
scripts/gpu_check.sh)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import FAMILIES, REPO
import policies
from engine import Generation
from runtime import step_modes
from errors import UserError
from scripts import gpu_check as gc


def result(**kw):
    base = dict(policy="keydiff", eager=[1, 2, 3], compiled=[1, 2, 3], recompiled=None, step_ms=1.0, eager_step_ms=2.0,
                graphs=1, cudagraph_skips=0)
    return base | kw


@pytest.mark.parametrize("kw, problem", [
    ({}, None),
    ({"cudagraph_skips": 2}, "2 cudagraph skip(s)"),
    ({"compiled": [1, 5, 3]}, "tokens differ from eager at 1"),
    ({"compiled": [1, 2]}, "tokens differ from eager at 2"),
    ({"compiled": None, "step_ms": None, "recompiled": "size mismatch"}, "recompiled: size mismatch"),
    ({"graphs": 2}, "2 graphs compiled"),
])
def test_graph_row_fails_on_a_skip_a_recompile_or_other_tokens(kw, problem):
    r = gc.graph_row(result(**kw))
    assert r["ok"] is (problem is None)
    assert (problem or "") in r["detail"] and (problem is not None or r["detail"] == "")


# The graphs section's shapes in tiny_sections' run (the tests' llama, a 200-token prompt, 8 new tokens, blocks of
# 32).
GRAPH_PROMPT, GRAPH_TOKENS, GRAPH_BLOCK = 200, 8, 32


def test_graph_check_sets_up_at_the_graph_budget_and_compares_with_eager(hf_tiny, monkeypatch):
    """graph_check's orchestration with eager steps in place of the compiled ones (the compiled runs on CPU:
    test_graphs_section_on_the_tiny_model_evicts_and_matches_eager): the policy's cache at graph_budget's budget,
    which evicts a 200-token prompt, and the two generations' tokens side by side; no graph compiled, so the row
    fails."""
    import runtime
    from loading import load_model
    from runtime import model_step, prefill_step
    _, ckpt = hf_tiny("llama")
    model = load_model(ckpt, torch.float32, "cpu")
    monkeypatch.setattr(runtime, "compile_steps", lambda device, mode, prefill, freeze, fns: (prefill_step, model_step))
    prompt = torch.randint(0, 512, (GRAPH_PROMPT,), generator=torch.Generator().manual_seed(3)).tolist()
    r = gc.graph_check(model, "keydiff", prompt, GRAPH_TOKENS, GRAPH_BLOCK, "cpu", mode="default")
    assert model.layers[0].attention.kv_cache.spec.budget == 56  # graph_budget: 48 + 8 new, it evicts (200 prompt)
    assert r["compiled"] == r["eager"] and len(r["eager"]) == GRAPH_TOKENS and r["graphs"] == 0
    assert gc.graph_row(r)["detail"] == "0 graphs compiled"


def test_graph_budget_evicts_or_refuses():
    """An evicting policy gets a quarter of the prompt, at least 48 prompt slots beside the new tokens', and a prompt
    too short to evict at that budget is refused (a check that never evicts would pass for nothing)."""
    keydiff = policies.make("keydiff")
    assert gc.graph_budget(keydiff, 256, 24) == 72 and gc.graph_budget(keydiff, 1000, 24) == 250
    assert gc.graph_budget(None, 29, 24) == 53  # full keeps every token
    with pytest.raises(UserError, match="too short for keydiff to evict"):
        gc.graph_budget(keydiff, 60, 24)


def test_warm_up_calls_prefill_once_then_decode_twice_with_fresh_tensors(hf_tiny):
    """CUDA graph trees warm up on a graph's first call and record on its second: Generation.warm_up makes both
    before any timed step, each decode input [B, 1] as engine.decode makes it (decode_inputs: other strides would
    recompile)."""
    from loading import load_model
    _, ckpt = hf_tiny("llama")
    args = load_model(ckpt, torch.float32, "cpu").args
    calls = []

    def prefill(model, idx, pos):
        calls.append(("prefill", tuple(idx.shape), pos[..., :2].tolist()[:2], torch.is_inference_mode_enabled()))

    def decode(model, idx, pos):
        calls.append(("decode", tuple(idx.shape), idx.stride() == pos.stride() == (1, 1), pos.tolist()))

    gen = Generation(args, None, [20], block_size=16)
    gen.steps = (prefill, decode)
    gen.warm_up(None, 7)
    assert calls == [("prefill", (1, 16), [0, -1], True), ("decode", (1, 1), True, [[1]]),
                     ("decode", (1, 1), True, [[1]])]
    calls.clear()  # a batch of 3: positions per sequence
    gen = Generation(args, None, [20] * 3, block_size=16)
    gen.steps = (prefill, decode)
    gen.warm_up(None, 7)
    assert calls[0] == ("prefill", (3, 16), [[0, -1], [0, -1]], True)
    assert calls[1:] == [("decode", (3, 1), True, [[1], [1], [1]])] * 2


def test_compile_modes_put_decode_under_cuda_graphs_and_prefill_never():
    assert step_modes("cuda", None) == (None, "reduce-overhead")
    assert step_modes("cuda:0", "reduce-overhead") == (None, "reduce-overhead")
    assert step_modes("cuda", "max-autotune") == ("max-autotune-no-cudagraphs", "max-autotune")
    assert step_modes("cpu", None) == (None, None)


def test_junit_rows(tmp_path):
    xml = tmp_path / "t.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="tests.test_a" name="test_ok"/>'
                   '<testcase classname="tests.test_a" name="test_bad"><failure message="boom"/></testcase>'
                   '<testcase classname="tests.test_b" name="test_skip"><skipped message="needs a CUDA GPU"/>'
                   '</testcase></testsuite></testsuites>')
    rows = gc.test_rows(xml)
    assert [(r["check"], r["ok"], r["value"]) for r in rows] == [
        ("test_a::test_ok", True, "passed"), ("test_a::test_bad", False, "failed"),
        ("test_b::test_skip", False, "skipped")]  # on the GPU a skipped CUDA test is a failed check


def test_figure_and_bench_targets():
    """full: >= 80% of the bound; RocketKV: >= 90% of the bandwidth model's speedup over full, with its speedup over
    the gpt-fast baseline beside it where that ran."""
    full = dict(label="full", T=16384, decode_step_ms=10.0, bytes_per_step=170e6)
    rk = dict(label="rocketkv-256", T=16384, decode_step_ms=3.0, speedup=3.3, ideal_speedup=3.6, peak_saving=0.3)
    small = dict(rk, T=4096, speedup=1.0, ideal_speedup=1.2, peak_saving=0.0)  # 83% of the model
    gptfast = {16384: dict(label="full", T=16384, decode_step_ms=30.0, bytes_per_step=170e6)}
    rows = gc.figure_rows([rk, full, small], gptfast, read_gb_s=20.0)  # full: 17 GB/s of 20 = 85%
    assert [(r["check"], r["ok"]) for r in rows] == [
        ("rocketkv-256 @ 4096", False), ("full @ 16384", True), ("gpt-fast (masked SDPA) @ 16384", None),
        ("rocketkv-256 @ 16384", True)]
    assert "3.00x faster" in rows[2]["value"] and "10.00x gpt-fast" in rows[3]["value"] and "92%" in rows[3]["value"]
    assert not gc.figure_rows([dict(rk, speedup=3.2)], {}, 20.0)[0]["ok"]  # 89% of the model
    assert "gpt-fast" not in gc.figure_rows([rk], {}, 20.0)[0]["value"]
    assert not gc.figure_rows([full], {}, 25.0)[0]["ok"]  # 68% of the bound
    res = {"no-evict": {"decode_step_ms": 10.0}, "keydiff": {"decode_step_ms": 10.5, "decode_tok_s": 95.0,
                                                             "kvpress": {"decode_tok_s": 40.0}},
           "full": {"decode_step_ms": 12.0, "decode_tok_s": 80.0, "kvpress": None}}
    rows = gc.bench_rows(res)
    assert rows[0]["ok"] and "+5.0%" in rows[0]["value"]
    assert rows[1]["value"].startswith("did not run") and rows[2]["value"].startswith("2.38x")
    assert not gc.bench_rows(res | {"keydiff": dict(res["keydiff"], decode_step_ms=11.5)})[0]["ok"]


@pytest.fixture(scope="module")
def tiny_sections(tmp_path_factory):
    """One gpu_check.py run on CPU of the graphs section on the tiny model (compiled: --no-compile is the benchmark
    scripts') and of every measuring section with tiny shapes and sizes, eager: (the process, its rows, OUT).
    --memory-cap 0.68 MiB: full fits a batch of 1 (0.55 MiB; 0.66 estimated before its prefill, a
    prefill block of slack), not 2 (0.70); KeyDiff's 48-slot rows fit 2 (0.58), not 4 (0.76)."""
    tmp = tmp_path_factory.mktemp("sections")
    shapes = tmp / "tiny"
    shapes.mkdir()
    (shapes / "config.json").write_text(json.dumps(FAMILIES["llama"]))
    out = tmp / "check"
    r = subprocess.run([sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--no-compile", "--only",
                        "graphs,attention,eviction,figure,bench,speculate,batch", "--graph-model", "tiny",
                        "--policies", "keydiff,snapkv++", "--graph-prompt", str(GRAPH_PROMPT), "--graph-tokens",
                        str(GRAPH_TOKENS), "--graph-block", str(GRAPH_BLOCK), "--shapes", str(shapes), "--dtype",
                        "float32", "--contexts", "256", "--budgets", "32", "--attention-contexts", "128",
                        "--decode-steps", "3", "--eviction-budgets", "48", "--eviction-policies", "keydiff,sink",
                        "--bench-context", "128", "--bench-budget", "48", "--spec-contexts", "128", "--spec-budget",
                        "48", "--batch-context", "128", "--memory-cap", "0.68", "--out", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode in (0, 1), r.stdout + r.stderr  # 1: a tiny CPU model misses the GPU targets
    return r, json.loads(out.with_suffix(".json").read_text())["rows"], out


def section_rows(rows: list[dict], *sections: str) -> list[str]:
    return [x["check"] for x in rows if x["section"] in sections]


def test_figure_and_bench_sections_run_end_to_end_on_tiny_shapes(tiny_sections):
    """The orchestration on CPU with tiny shapes, eager: bench_figure.py (--random-weights: full and RocketKV at
    each context) and the policy table with HF + kvpress (random config in .venv-kv) run, their JSON is read back,
    and the table lands in OUT.md and OUT.json."""
    if not (REPO / ".venv-kv" / "bin" / "python").is_file():
        pytest.skip(".venv-kv missing (bash scripts/setup.sh test)")
    r, rows, out = tiny_sections
    assert section_rows(rows, "figure") == ["full @ 256", "gpt-fast (masked SDPA) @ 256", "rocketkv-32 @ 256"]
    assert section_rows(rows, "bench") == ["keydiff overhead vs no-evict", "full decode vs HF + kvpress",
                                           "keydiff decode vs HF + kvpress"]
    assert "could not run" not in r.stdout
    assert out.with_suffix(".md").read_text().count("\n| ") == len(rows) + 1
    assert "x (" in [x for x in rows if x["section"] == "bench"][-1]["value"]


def test_attention_eviction_speculate_and_batch_targets():
    measured = [dict(T=16384, form="", decode_step_ms=10.0, bytes_per_step=17e9, read_gb_s=2000.0),
                dict(T=16384, form="flex", decode_step_ms=8.0, bytes_per_step=17e9, read_gb_s=2000.0)]
    rows = gc.attention_rows(measured)  # 85% and 106% of the bound
    assert [(r["check"], r["ok"]) for r in rows] == [
        ("full @ 16384, default (matmul on CUDA)", True), ("full @ 16384, flex_attention", True),
        ("full @ 16384, flex over default", None)]
    assert rows[2]["value"] == "0.80x the step"
    assert not gc.attention_rows([dict(measured[0], decode_step_ms=11.0)])[0]["ok"]  # 77%
    paired = [dict(label="no-evict", decode_step_ms=10.0, overhead=0.0, overhead_quartiles=[0, 0],
                   bandwidth_fraction=0.7),
              dict(label="keydiff", decode_step_ms=10.9, overhead=0.09, overhead_quartiles=[0.08, 0.1]),
              dict(label="sink", decode_step_ms=11.2, overhead=0.12, overhead_quartiles=[0.1, 0.13])]
    rows = gc.eviction_rows(paired, 2048)
    assert [(r["check"], r["ok"]) for r in rows] == [("no-evict @ 2048", None), ("keydiff @ 2048 vs no-evict", True),
                                                     ("sink @ 2048 vs no-evict", False)]
    assert rows[1]["value"].startswith("1.090x") and "70% of the bound" in rows[0]["value"]
    spec = dict(policy="sink", budget=2048, k=4, context=32768, plain_step_ms=10.0, draft_step_ms=5.0, verify_ms=11.0,
                accepted_per_round=0.5, speedup=0.4)
    rows = gc.speculate_rows([spec, dict(spec, context=16384)], accepted=2.3)  # 3.3 x 10 / (4 x 5 + 11) = 1.06x
    assert [r["ok"] for r in rows] == [None, False, None, None]
    assert rows[1]["value"].startswith("1.06x") and "1.10x a step" in rows[0]["value"]
    assert gc.speculate_rows([dict(spec, draft_step_ms=2.0)], accepted=2.3)[1]["ok"]  # 33 / 19 = 1.74x
    summary = {"full": {"batch": 2, "decode_tok_s": 50.0},
               "keydiff": {"batch": 16, "decode_tok_s": 210.0, "vs_full": 4.2, "ideal_vs_full": 6.0}}
    assert gc.batch_rows(summary)[0]["ok"] and "4.20x" in gc.batch_rows(summary)[0]["value"]
    assert not gc.batch_rows({**summary, "keydiff": dict(summary["keydiff"], vs_full=3.9)})[0]["ok"]
    assert gc.batch_rows({"full": {"batch": None}, "keydiff": {"batch": None}})[0]["value"] == "no batch fitted"


def test_attention_eviction_speculate_and_batch_sections_run_end_to_end_on_tiny_shapes(tiny_sections):
    """The sections on CPU with tiny shapes and sizes, eager: both attention forms in this process (flex's unfused
    reference), bench_paired.py (--random-weights: no-evict first, its overhead over itself 0), bench_speculate.py
    and bench_batch.py run and their JSON is read back."""
    r, rows, out = tiny_sections
    assert section_rows(rows, "attention", "eviction", "speculate", "batch") == [
        "full @ 128, default (matmul on CUDA)", "full @ 128, flex_attention", "full @ 128, flex over default",
        "no-evict @ 48", "keydiff @ 48 vs no-evict", "sink @ 48 vs no-evict",
        "sink 48 K=4 @ 128: steps", "sink 48 K=4 @ 128: predicted at 2.3 kept/round", "keydiff vs full under the cap"]
    assert "could not run" not in r.stdout and "no batch fitted" not in r.stdout
    paired = json.loads(out.with_name(out.name + "_eviction_48.json").read_text())["rows"]
    assert [x["label"] for x in paired] == ["no-evict", "keydiff", "sink"] and paired[0]["overhead"] == 0.0


def test_batch_section_runs_bench_batch_to_the_cap(tiny_sections, tmp_path):
    """scripts/bench_batch.py end to end, as the batch section runs it (its JSON and what it printed, beside OUT):
    one row per (policy, batch), batches 1, 2, 4, ... until the first whose estimate (weights + whole cache) exceeds
    --memory-cap, which is decided, not run; every row a copy of one prefilled sequence, decoding its tokens at every
    batch size; the summary names the largest batch that fits, and KeyDiff's rows, smaller than full's, fit more.
    Then its plot from those rows. The rows' decoding across batch sizes in the bench's own functions:
    test_bench_batch.py."""
    from argparse import Namespace
    from scripts.bench_batch import plot_batch
    _, _, out = tiny_sections
    cap, path = 0.68, out.with_name(out.name + "_batch.json")
    printed, saved = path.with_suffix(".log").read_text(), json.loads(path.read_text())
    assert "each row a copy of one prefilled sequence" in printed and "roofline" in printed
    assert "| keydiff |" in printed and "| full |" in printed
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
    assert summary["keydiff"]["batch"] > summary["full"]["batch"]
    assert summary["keydiff"]["ideal_vs_full"] > 1
    k, f = summary["keydiff"], summary["full"]
    assert k["of_roofline_ratio"] == pytest.approx(k["vs_full"] / (k["roofline_tok_s"] / f["roofline_tok_s"]))
    # at ms_for_85 ms per step, keydiff's ratio to full's measured tok/s is 85% of the bandwidth model's ratio
    assert k["batch"] / (k["ms_for_85"] / 1e3) / f["decode_tok_s"] == pytest.approx(0.85 * k["ideal_vs_full"])
    assert saved["gemm_gflop_s"] > 0
    png = tmp_path / "batch.png"
    plot_batch(rows, summary, png, Namespace(checkpoint="tiny", dtype="float32", prompt_tokens=128, budget=48,
                                             memory_cap=cap), [0.0, 0.0])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_graphs_section_on_the_tiny_model_evicts_and_matches_eager(tiny_sections):
    """--graph-model tiny on CPU (compiled in the default mode, no graphs to capture): the tests' llama built beside
    OUT, its short document repeated up to --graph-prompt tokens, so KeyDiff's row, a one-shot policy's (SnapKV++)
    and speculation's (a sink draft: the draft step and the verification block) pass at a budget that evicts
    (graph_budget refuses one that would not): each decode step compiled once under error_on_recompile, eager's
    greedy tokens, all of them."""
    _, rows, out = tiny_sections
    rows = [x for x in rows if x["section"] == "graphs"]
    assert [(x["check"], x["ok"], x["target"]) for x in rows] == [
        ("keydiff", True, "1 graph, 0 skips, eager's tokens"), ("snapkv++", True, "1 graph, 0 skips, eager's tokens"),
        ("speculate sink K=4", True, "2 graphs, 0 skips, eager's tokens")]
    assert all(x["value"].endswith(f", {GRAPH_TOKENS} tokens") for x in rows)
    assert (out.with_name(out.name + "_tiny") / "tokenizer.json").is_file()


def test_tiny_graph_model_without_transformers_is_one_environment_failure(tmp_path, monkeypatch):
    import importlib.util
    from errors import EnvironmentFailure
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m == "transformers" else find_spec(m, *a))
    with pytest.raises(EnvironmentFailure, match="--graph-model tiny needs transformers"):
        gc.tiny_checkpoint(tmp_path / "check")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_one_line_and_exit_1():
    r = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a CUDA GPU" in lines[0] and "TORCH_INDEX=" in lines[0]


def test_python_override_runs_the_check_with_that_python(tmp_path):
    """PYTHON=... (a GPU image's own Python, no .venv to set up there) is the interpreter gpu_check.sh runs."""
    marker = tmp_path / "ran"
    wrapper = tmp_path / "py"
    wrapper.write_text(f"#!/bin/sh\ntouch {marker}\nexec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    env = {**os.environ, "PYTHON": str(wrapper)}
    r = subprocess.run(["bash", "scripts/gpu_check.sh", "--only", "figure,nope"], cwd=REPO, capture_output=True,
                       text=True, timeout=120, env=env)
    assert marker.exists() and r.returncode == 2
    assert "sections are tests, graphs, attention, eviction, figure, bench, speculate, batch" in r.stderr
    r = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHON": str(tmp_path / "nope")})
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [f"error: PYTHON={tmp_path / 'nope'} is not a command"]
    r = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHON": "true"})
    assert r.returncode == 1 and r.stderr.strip().splitlines() == ["error: PYTHON=true is not a Python 3"]


@pytest.mark.parametrize("argv, message", [
    (["--only", "figure,nope"], "sections are tests, graphs, attention, eviction, figure, bench, speculate, batch"),
    (["--graph-layers", "0"], "--graph-layers must be >= 1"),
    (["--eviction-budgets", "2048,x"], "--eviction-budgets takes comma-separated integers"),
    (["--attention-contexts", "0"], "--attention-contexts needs integers >= 1"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    """gpu_check.main in this process (test_python_override_runs_the_check_with_that_python runs a refusal as a
    process)."""
    code = gc.main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err


def test_paired_random_weights_configurations_share_one_set_of_weights():
    """bench_paired.py's weight_twin (the eviction section at 8B shapes: six sets would not fit one GPU): the
    twin's parameters are the model's tensors, its modules and caches its own, and its logits the model's."""
    from engine import setup
    from loading import random_model
    from scripts.bench_paired import weight_twin
    model = random_model(dict(FAMILIES["qwen2"]), torch.float32, "cpu")  # tied embeddings, q/k/v bias
    twin = weight_twin(model)
    assert [p.data_ptr() for p in twin.parameters()] == [p.data_ptr() for p in model.parameters()]
    assert twin.output.weight is twin.tok_embeddings.weight and twin.layers[0] is not model.layers[0]
    ids, pos = torch.tensor([[5, 7, 11, 13]]), torch.arange(4)
    logits = []
    for m in (model, twin):
        setup(m, None, 8, 4, 1, 4)
        with torch.inference_mode():
            logits.append(m(ids, pos))
    assert model.layers[0].attention.kv_cache is not twin.layers[0].attention.kv_cache
    assert torch.equal(logits[0], logits[1])
