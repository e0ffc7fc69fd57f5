"""Every GPU claim in one command, on a machine with one CUDA GPU and this repository set up:

    TORCH_INDEX=https://download.pytorch.org/whl/cu128 bash scripts/setup.sh test   # once: CUDA torch, .venv-kv
    bash scripts/gpu_check.sh                  # tests, attention, eviction: about 9 minutes on one H100
    bash scripts/gpu_check.sh --only figure    # the second call: about 4 minutes at its defaults
    bash scripts/gpu_check.sh --only speculate,batch   # a third (not yet timed on a GPU)

Sections (--only SECTION,...; the default runs tests,attention,eviction), each a group of rows of one table (written
to OUT.md and OUT.json after every section, printed at the end; a call with other sections writes its own OUT); each
row passes or fails against its target, or is a measurement without one:
- tests: the test suite's CUDA-only tests (`pytest -m cuda`), one row each.
- graphs: for each policy (and `full`), a generation whose decode step is compiled with mode="reduce-overhead" on
  --graph-model (the embedded SmolLM2 truncated to --graph-layers layers: a small graph compiles fast, and its real
  embedding and head keep greedy tokens away from ties): the decode step must replay as a CUDA graph (inductor
  counted no cudagraph skip), compile once (error_on_recompile) and give eager's greedy tokens. One more row,
  `speculate`: self-speculative decoding (a sink draft, K = 4) with the draft step and the K+1 verification block
  both under CUDA graphs: two graphs, no skip, no recompile, plain eager greedy's tokens.
- attention: `full`'s compiled decode step at --shapes (random --dtype weights, batch 1) at each of
  --attention-contexts, once per attention form (the default choice: the matmul form on CUDA; flex_attention,
  kernels.FORM "flex"), in this process, beside the read bandwidth measured in this process right after: each
  form's step as a fraction of the bandwidth bound (target >= 80%), and flex's step over the default's.
- eviction: `bench_paired.py --compile` at --shapes for each of --eviction-budgets (prompt: --bench-context tokens,
  or the budget and an eighth of them if longer): each of --eviction-policies' decode step over no-evict's, steps
  alternating in one process (target <= 1.10x), and no-evict's fraction of the bandwidth bound.
- figure: RocketKV's Figure 5 (`bench_figure.py`) at --shapes at --contexts and --budgets, and per context
  a gpt-fast-style baseline (`full` with masked SDPA over the static buffer, kernels.FORM "sdpa": the paper's
  baseline): per RocketKV budget its decode speedup over `full` against the bandwidth model's ratio (target >= 90%
  of it), its speedup over gpt-fast (the paper: ~3x at 256) and its decode peak saving; `full`'s step against the
  bandwidth bound (bytes per step at this process's read bandwidth, >= 80%).
- bench: the policy table (`bench.py --kvpress --policies keydiff`) at the same shapes, --bench-context tokens and
  --bench-budget: KeyDiff's decode step over no-evict's (its overhead: scoring and hole filling), and decode tok/s
  against HF transformers + kvpress (same shapes, transformers' random init) for `full` and KeyDiff.
- speculate: `bench_speculate.py --compile` at --shapes, a --spec-draft draft of --spec-budget slots, K = --spec-k,
  at --spec-contexts: the draft step and the K+1 verification block timed beside plain decode's step, and the
  step-time model's speedup at --spec-accepted drafts kept per round (the embedded model's acceptance, a
  prediction: target >= 1.5x at 32K).
- batch: `bench_batch.py --compile` at --shapes, --batch-context prompts, KeyDiff at --bench-budget against
  `full`, the largest batch each fits under --memory-cap MiB: KeyDiff's tokens/s over full's (target >= 4x) beside the
  bandwidth model's ratio.
Exit 0 when every check passed, 1 when one failed or a section could not run, 2 for bad input.
"""
import argparse
import inspect
import json
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from errors import check_python  # noqa: E402

check_python()  # one line, not a traceback, in a Python without the requirements
import torch  # noqa: E402

import policies  # noqa: E402
from cache import is_scorer  # noqa: E402
from cli import Parser, run_child, run_cli  # noqa: E402
from engine import Generation, sync  # noqa: E402
from errors import EnvironmentFailure, UserError  # noqa: E402
from loading import load_model  # noqa: E402
from scripts.benchlib import (bench_model, bench_source, int_list, json_result, make_document,  # noqa: E402
                              read_bandwidth_gb_s)

SECTIONS = ("tests", "graphs", "attention", "eviction", "figure", "bench", "speculate", "batch")
DEFAULT = "tests,attention,eviction"  # about 9 minutes on one H100 (docs/testing.md)
CUDA_SETUP = "TORCH_INDEX=https://download.pytorch.org/whl/cu128 bash scripts/setup.sh test"
PY = sys.executable


def row(section: str, check: str, ok: bool | None, value: str, target: str = "", detail: str = "") -> dict:
    """One line of the table: ok True (passed), False (failed) or None (measured, no target to pass)."""
    return {"section": section, "check": check, "ok": ok, "value": value, "target": target, "detail": detail}


# -------------------------------------------------------------------------------------------------------- tests

def run_tests(out: Path) -> list[dict]:
    """The CUDA-only tests (marked `cuda`), one row each from pytest's JUnit XML."""
    xml = out.with_name(out.name + "_tests.xml")
    r = run_child([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", "tests", f"--junitxml={xml}"],
                  cwd=REPO)
    if not xml.is_file():
        return [row("tests", "pytest -m cuda", False, "did not run", detail=last_line(r.stderr or r.stdout))]
    return test_rows(xml)


def test_rows(xml: Path) -> list[dict]:
    rows = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if bad is not None:
            rows.append(row("tests", name, False, "failed", detail=(bad.get("message") or "")[:200]))
        elif skipped is not None:
            rows.append(row("tests", name, False, "skipped", detail=(skipped.get("message") or "")[:200]))
        else:
            rows.append(row("tests", name, True, "passed"))
    return rows or [row("tests", "pytest -m cuda", False, "no test collected")]


# ------------------------------------------------------------------------------------------------------- graphs

def graph_budget(policy, prompt_len: int, new_tokens: int) -> int:
    """A budget that makes an evicting policy evict (a quarter of the prompt, and at least 48 slots of prompt for the
    protected sinks and observation windows of the defaults after the new tokens' slots); a policy that keeps every
    token gets them all."""
    if not is_scorer(policy):
        return prompt_len + new_tokens
    budget = max(48 + new_tokens, prompt_len // 4)
    if budget >= prompt_len:
        raise UserError(f"a {prompt_len}-token prompt is too short for {policy.name} to evict at budget {budget}: "
                        "raise --graph-prompt")
    return budget


def graph_check(model, spec: str, prompt: list[int], new_tokens: int, block_size: int, device: str,
                mode: str | None = "reduce-overhead") -> dict:
    """One policy: greedy tokens of an eager generation, then of one whose decode step is compiled in `mode`
    (prefill eager), under error_on_recompile; inductor's cudagraph-skip counter, the graphs dynamo compiled, and
    the median decode step of each."""
    policy = None if spec == "full" else policies.make(spec)
    gen = Generation(model.args, policy, [len(prompt)], budget=graph_budget(policy, len(prompt), new_tokens),
                     max_new_tokens=new_tokens, block_size=block_size, device=device)
    gen.setup(model)

    def run():
        outs, stats = gen.generate(model, [prompt])
        return outs[0], stats
    eager = run()

    def compiled():
        gen.compile(model, prompt[0], mode, prefill=False)
        return run()
    return compare_compiled(spec, eager, compiled, device)


def speculate_check(model, draft_spec: str, prompt: list[int], new_tokens: int, block_size: int, device: str,
                    mode: str | None = "reduce-overhead", k: int = 4) -> dict:
    """Self-speculative decoding with `draft_spec` at graph_budget's budget: plain eager greedy tokens (the full
    cache), then a speculative generation whose draft step and verification block are compiled in `mode`, under
    error_on_recompile; the same fields as graph_check, graphs expected: 2."""
    import speculative
    draft_policy = policies.make(draft_spec)
    gen = Generation(model.args, None, [len(prompt)], max_new_tokens=new_tokens, block_size=block_size, device=device)
    gen.setup(model)
    outs, stats = gen.generate(model, [prompt])
    plain = outs[0], stats
    spec = speculative.Speculation(model.args, None, [len(prompt)], draft_policy=draft_policy, k=k,
                                   draft_budget=graph_budget(draft_policy, len(prompt), new_tokens),
                                   max_new_tokens=new_tokens, block_size=block_size, device=device)
    spec.setup(model, speculative.draft_model(model))

    def compiled():  # the draft step and the verification block, as generate.py --speculate compiles them
        spec.compile(model, prompt[0], mode, prefill=False)
        (out,), stats = spec.generate(model, [prompt])
        return out, stats
    return compare_compiled(f"speculate {draft_spec} K={k}", plain, compiled, device)


def compare_compiled(label: str, eager: tuple, compiled, device: str) -> dict:
    """eager: (tokens, stats) of the eager run; compiled(): compile, warm up and generate, run here under
    error_on_recompile with dynamo's and inductor's counters cleared. The fields graph_row judges."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    result = {"policy": label, "eager": eager[0], "recompiled": None}
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            tokens, stats = compiled()
        sync(device)
        result.update(compiled=tokens, step_ms=1e3 / stats["decode_tok_s"])
    except torch._dynamo.exc.RecompileError as e:
        result.update(compiled=None, recompiled=last_line(str(e)), step_ms=None)
    finally:
        torch._dynamo.reset()
    result.update(eager_step_ms=1e3 / eager[1]["decode_tok_s"], graphs=counters["stats"]["unique_graphs"],
                  cudagraph_skips=counters["inductor"]["cudagraph_skips"])
    return result


def graph_row(r: dict, graphs: int = 1) -> dict:
    """Pass when the decode step compiled once (`graphs` graphs: 2 for speculation's draft and verification),
    inductor skipped no CUDA graph and the tokens are eager's."""
    problems = []
    if r["recompiled"]:
        problems.append(f"recompiled: {r['recompiled']}")
    if r["graphs"] != graphs and not r["recompiled"]:
        problems.append(f"{r['graphs']} graphs compiled")
    if r["cudagraph_skips"]:
        problems.append(f"{r['cudagraph_skips']} cudagraph skip(s)")
    if r["compiled"] is not None and r["compiled"] != r["eager"]:
        i = next(i for i, (a, b) in enumerate(zip(r["compiled"] + [None], r["eager"] + [None])) if a != b)
        problems.append(f"tokens differ from eager at {i}")
    value = "recompiled" if r["step_ms"] is None else \
        f"{r['step_ms']:.2f} ms/step (eager {r['eager_step_ms']:.2f}), {len(r['eager'])} tokens"
    return row("graphs", r["policy"], not problems, value, f"{graphs} graph{'s' * (graphs > 1)}, 0 skips, eager's "
               "tokens", "; ".join(problems))


def tiny_checkpoint(out: Path) -> Path:
    """The tests' random tiny llama (tests/conftest.py) with a small BPE tokenizer, in a folder beside OUT."""
    import importlib.util
    missing = [m for m in ("pytest", "transformers", "tokenizers") if importlib.util.find_spec(m) is None]
    if missing:
        raise EnvironmentFailure(f"--graph-model tiny needs {', '.join(missing)}: bash scripts/setup.sh test")
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import make_hf_checkpoint, with_tiny_tokenizer
    src = out.with_name(out.name + "_tiny_src")
    make_hf_checkpoint("llama", src)
    return with_tiny_tokenizer(src, out.with_name(out.name + "_tiny"), inspect.getsource(make_document))


def run_graphs(args) -> list[dict]:
    from checkpoint import resolve_checkpoint
    from tokenizer import load_tokenizer
    ckpt = tiny_checkpoint(args.out) if args.graph_model == "tiny" else resolve_checkpoint(args.graph_model)
    model = load_model(ckpt, torch.float32, args.device)
    model.layers = model.layers[:args.graph_layers]  # a small graph: the check is the capture, not the model
    torch.backends.cuda.matmul.allow_tf32 = False  # eager and compiled in the same precision
    _, prompt = make_document(load_tokenizer(ckpt), args.graph_prompt)
    prompt = (prompt * -(-args.graph_prompt // len(prompt)))[:args.graph_prompt]  # a small tokenizer's few tokens
    mode = "reduce-overhead" if args.device.startswith("cuda") else "default"  # CPU (tests): no graphs to capture
    rows = []
    for spec in policies.spec_list(args.policies):
        try:
            rows.append(graph_row(graph_check(model, spec, prompt, args.graph_tokens, args.graph_block, args.device,
                                              mode)))
        except Exception as e:  # one policy's failure is its row; the others still run
            rows.append(row("graphs", spec, False, "error", detail=f"{type(e).__name__}: {last_line(str(e))}"))
    try:
        rows.append(graph_row(speculate_check(model, "sink", prompt, args.graph_tokens, args.graph_block,
                                              args.device, mode), graphs=2))
    except Exception as e:
        rows.append(row("graphs", "speculate", False, "error", detail=f"{type(e).__name__}: {last_line(str(e))}"))
    return rows


# ------------------------------------------------------------------------------------- the measuring sections

def bench_argv(args, dtype: bool = True) -> list[str]:
    """A benchmark script's arguments for the check's shapes, dtype (not for bench_speculate.py: its --weights),
    device and compile."""
    return ["--random-weights", "--checkpoint", args.shapes, *(["--dtype", args.dtype] if dtype else []),
            "--device", args.device, *(["--compile"] if args.compile else [])]


def bench(script: str, argv: list[str], args, form: str = "") -> subprocess.CompletedProcess:
    """scripts/`script` at the check's shapes and dtype, random weights, its attention in `form` (kernels.FORM);
    what it printed beside its --json file (the same name, .log); EnvironmentFailure with its last line when it
    fails."""
    import os
    cmd = [PY, str(REPO / "scripts" / script), *bench_argv(args, script != "bench_speculate.py"), *argv]
    r = run_child(cmd, cwd=REPO, env={**os.environ, "BUDGETKV_ATTENTION": form})
    if "--json" in argv:
        Path(argv[argv.index("--json") + 1]).with_suffix(".log").write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        raise EnvironmentFailure(f"{' '.join(cmd[1:])} failed: {last_line(r.stderr or r.stdout)}")
    return r


def run_attention(args) -> list[dict]:
    """`full`'s decode step per attention form and context, one model in this process (bench_figure.figure_one's
    timing: one-shot prefill, then N - 1 decode steps of engine.decode per sample), and the read bandwidth measured
    after each."""
    import kernels
    from scripts import bench_figure
    bargs = bench_figure.parser().parse_args([*bench_argv(args), "--decode-steps", str(args.decode_steps)])
    ckpt, config = bench_source(bargs)
    contexts = int_list(args.attention_contexts, "--attention-contexts")
    model = bench_model(bargs, ckpt, config, max(contexts) + bargs.decode_steps)
    measured = []
    try:
        for T in contexts:
            for form in ATTENTION_FORMS:
                kernels.FORM = form
                torch._dynamo.reset()  # this form's own graph
                torch._dynamo.config.error_on_recompile = False  # figure_one turns it on after its warm-up
                x = bench_figure.figure_one(model, "full", T, bargs)
                measured.append(dict(x, form=form, read_gb_s=read_bandwidth_gb_s(args.device)))
    finally:
        kernels.FORM = ""
        torch._dynamo.config.error_on_recompile = False
        torch._dynamo.reset()
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()  # the later sections' processes need the memory
    return attention_rows(measured)


ATTENTION_FORMS = {"": "default (matmul on CUDA)", "flex": "flex_attention"}


def bound_fraction(x: dict, read_gb_s: float) -> float:
    """The time reading a step's bytes takes at read_gb_s, over the step's time."""
    return x["bytes_per_step"] / (x["decode_step_ms"] / 1e3) / 1e9 / read_gb_s


def attention_rows(measured: list[dict]) -> list[dict]:
    """Per context and form: the step against the bandwidth bound (>= 80%); then flex's step over the default's."""
    rows, default = [], {}
    for x in measured:
        frac = bound_fraction(x, x["read_gb_s"])
        rows.append(row("attention", f"full @ {x['T']}, {ATTENTION_FORMS[x['form']]}", frac >= 0.8,
                        f"{frac:.0%} of the bound ({x['decode_step_ms']:.2f} ms/step, {x['bytes_per_step'] / 1e9:.2f} "
                        f"GB at {x['read_gb_s']:.0f} GB/s)", ">= 80%"))
        if x["form"] == "":
            default[x["T"]] = x
        elif x["T"] in default:
            ratio = x["decode_step_ms"] / default[x["T"]]["decode_step_ms"]
            rows.append(row("attention", f"full @ {x['T']}, flex over default", None, f"{ratio:.2f}x the step",
                            detail="below 1: flex is the faster form"))
    return rows


def run_eviction(args, out: Path) -> list[dict]:
    rows = []
    for budget in int_list(args.eviction_budgets, "--eviction-budgets"):
        path = out.with_name(f"{out.name}_eviction_{budget}.json")
        bench("bench_paired.py", ["--policies", args.eviction_policies, "--prompt-tokens",
                                  str(max(args.bench_context, budget + args.bench_context // 8)), "--budget",
                                  str(budget), "--decode-steps", str(args.decode_steps), "--json", str(path)], args)
        res = json.loads(path.read_text())
        rows += eviction_rows(res["rows"], budget)
    return rows


def eviction_rows(results: list[dict], budget: int) -> list[dict]:
    """Each policy's step over no-evict's (median of per-step ratios, <= 1.10x); no-evict's fraction of the bound."""
    out = []
    for x in results:
        if x["label"] == "no-evict":
            out.append(row("eviction", f"no-evict @ {budget}", None, f"{x['bandwidth_fraction']:.0%} of the bound "
                           f"({x['decode_step_ms']:.2f} ms/step)"))
        else:
            q = x["overhead_quartiles"]
            out.append(row("eviction", f"{x['label']} @ {budget} vs no-evict", 1 + x["overhead"] <= 1.10,
                           f"{1 + x['overhead']:.3f}x ({x['decode_step_ms']:.2f} ms/step; quartiles {1 + q[0]:.3f}x "
                           f".. {1 + q[1]:.3f}x)", "<= 1.10x"))
    return out


def run_figure(args, out: Path, read_gb_s: float) -> list[dict]:
    fig_dir = out.with_name(out.name + "_figure")
    figure = ["--contexts", args.contexts, "--budgets", args.budgets, "--decode-steps", str(args.decode_steps),
              "--out-dir", str(fig_dir)]
    bench("bench_figure.py", figure, args)
    gptfast = {}
    for T in int_list(args.contexts, "--contexts"):  # the paper's baseline: full with masked SDPA, its own process
        r = bench("bench_figure.py", [*figure, "--one", f"full@{T}"], args, form="sdpa")
        gptfast[T] = json_result(r, f"gpt-fast baseline at {T}", "gpu-check")
    return figure_rows(json.loads((fig_dir / "rocketkv_figure.json").read_text())["rows"], gptfast, read_gb_s)


def figure_rows(rows: list[dict], gptfast: dict, read_gb_s: float) -> list[dict]:
    """Per context: full's and gpt-fast's steps against the bandwidth bound (full: >= 80%), then per RocketKV budget
    its speedup over full against the bandwidth model's ratio (>= 90% of it), beside its speedup over gpt-fast (the
    paper's ~3x at 256) and its decode peak saving over full."""
    out = []
    for x in sorted(rows, key=lambda x: (x["T"], x["label"] != "full", x.get("cache_slots", 0))):
        base = gptfast.get(x["T"])
        if x["label"] == "full":
            frac = bound_fraction(x, read_gb_s)
            out.append(row("figure", f"full @ {x['T']}", frac >= 0.8, f"{frac:.0%} of the bandwidth bound "
                           f"({x['decode_step_ms']:.2f} ms/step)", ">= 80%"))
            if base is not None:
                out.append(row("figure", f"gpt-fast (masked SDPA) @ {x['T']}", None,
                               f"{bound_fraction(base, read_gb_s):.0%} of the bound ({base['decode_step_ms']:.2f} "
                               f"ms/step; full {base['decode_step_ms'] / x['decode_step_ms']:.2f}x faster)"))
            continue
        of_ideal = x["speedup"] / x["ideal_speedup"]
        vs_gptfast = "" if base is None else \
            f"; {base['decode_step_ms'] / x['decode_step_ms']:.2f}x gpt-fast (paper ~3x at 256)"
        out.append(row("figure", f"{x['label']} @ {x['T']}", of_ideal >= 0.9,
                       f"{x['speedup']:.2f}x full, {of_ideal:.0%} of the model's {x['ideal_speedup']:.2f}x"
                       f"{vs_gptfast}; peak {-x['peak_saving']:+.1%}", ">= 90% of the model"))
    return out


def run_bench(args, out: Path) -> list[dict]:
    path = out.with_name(out.name + "_bench.json")
    bench("bench.py", ["--kvpress", "--policies", "keydiff", "--prompt-tokens", str(args.bench_context), "--budget",
                       str(args.bench_budget), "--json", str(path)], args)
    return bench_rows(json.loads(path.read_text())["results"])


def bench_rows(results: dict) -> list[dict]:
    """KeyDiff's step over no-evict's (target <= 10%), and decode tok/s over HF + kvpress's where it ran."""
    base, kd = results["no-evict"]["decode_step_ms"], results["keydiff"]["decode_step_ms"]
    rows = [row("bench", "keydiff overhead vs no-evict", kd / base - 1 <= 0.10, f"{kd / base - 1:+.1%} "
                f"({kd:.2f} vs {base:.2f} ms/step)", "<= +10%")]
    for label in ("full", "keydiff"):
        peer = results[label].get("kvpress")
        value = "did not run (see bench.py's output)" if not peer else \
            f"{results[label]['decode_tok_s'] / peer['decode_tok_s']:.2f}x ({results[label]['decode_tok_s']:.1f} " \
            f"vs {peer['decode_tok_s']:.1f} tok/s)"
        rows.append(row("bench", f"{label} decode vs HF + kvpress", None, value))
    return rows


def run_speculate(args, out: Path) -> list[dict]:
    path = out.with_name(out.name + "_speculate.json")
    bench("bench_speculate.py", ["--policies", args.spec_draft, "--budgets", str(args.spec_budget), "--ks",
                                 str(args.spec_k), "--contexts", args.spec_contexts, "--weights", args.dtype,
                                 "--new-tokens", "24", "--repeats", "1", "--json", str(path)], args)
    return speculate_rows(json.loads(path.read_text())["rows"], args.spec_accepted)


def speculate_rows(results: list[dict], accepted: float) -> list[dict]:
    """Per context: the draft step and the K+1 verification block over plain decode's step (measured), and the
    step-time model's speedup at `accepted` drafts kept per round: (accepted + 1) plain steps over K draft steps and
    one verification (target >= 1.5x at 32K and more)."""
    out = []
    for x in results:
        k, plain = x["k"], x["plain_step_ms"]
        predicted = (accepted + 1) * plain / (k * x["draft_step_ms"] + x["verify_ms"])
        label = f"{x['policy']} {x['budget']} K={k} @ {x['context']}"
        out.append(row("speculate", f"{label}: steps", None, f"draft {x['draft_step_ms']:.2f} ms, verify "
                       f"{x['verify_ms']:.2f} ms, plain {plain:.2f} ms ({x['verify_ms'] / plain:.2f}x a step)"))
        out.append(row("speculate", f"{label}: predicted at {accepted} kept/round", predicted >= 1.5
                       if x["context"] >= 32768 else None, f"{predicted:.2f}x (measured here at random weights' "
                       f"acceptance {x['accepted_per_round']:.2f}: {x['speedup']:.2f}x)", ">= 1.5x at 32K"))
    return out


def run_batch(args, out: Path) -> list[dict]:
    path = out.with_name(out.name + "_batch.json")
    bench("bench_batch.py", ["--policies", "keydiff", "--prompt-tokens", str(args.batch_context), "--budget",
                             str(args.bench_budget), "--memory-cap", str(args.memory_cap), "--json", str(path)], args)
    return batch_rows(json.loads(path.read_text())["summary"])


def batch_rows(summary: dict) -> list[dict]:
    """KeyDiff's tokens/s at its largest batch under the cap over full's at full's (>= 4x), beside the bandwidth
    model's ratio."""
    kd, full = summary.get("keydiff", {}), summary.get("full", {})
    if kd.get("vs_full") is None:
        return [row("batch", "keydiff vs full under the cap", False, "no batch fitted",
                    detail=f"largest batches: keydiff {kd.get('batch')}, full {full.get('batch')}")]
    return [row("batch", "keydiff vs full under the cap", kd["vs_full"] >= 4,
                f"{kd['vs_full']:.2f}x (batch {kd['batch']} vs {full['batch']}; {kd['decode_tok_s']:.1f} vs "
                f"{full['decode_tok_s']:.1f} tok/s; bandwidth model {kd['ideal_vs_full']:.2f}x)", ">= 4x")]


# ----------------------------------------------------------------------------------------------------- the table

def last_line(text: str) -> str:
    return (text.strip().splitlines() or ["no output"])[-1]


def markdown(rows: list[dict], header: str) -> str:
    mark = {True: "pass", False: "FAIL", None: "measured"}
    lines = [header, "", "| section | check | result | value | target | detail |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['section']} | {r['check']} | {mark[r['ok']]} | {r['value']} | {r['target']} | {r['detail']} |"
              for r in rows]
    return "\n".join(lines) + "\n"


def write(out: Path, rows: list[dict], header: str, meta: dict) -> None:
    from scripts.outputs import write_atomic
    write_atomic(out.with_suffix(".json"), json.dumps({**meta, "rows": rows}, indent=2))
    write_atomic(out.with_suffix(".md"), markdown(rows, header))


def parser() -> Parser:
    ap = Parser(description=__doc__)
    ap.add_argument("--only", default=DEFAULT, help=f"sections to run, of {', '.join(SECTIONS)} (default: {DEFAULT})")
    ap.add_argument("--out", type=Path, help="writes OUT.json and OUT.md (default: build/gpu_check, or "
                    "build/gpu_check_<sections> for other --only sections, so that a second call keeps the first's)")
    ap.add_argument("--shapes", default="llama3.1-8b", help="figure and bench: the shipped config (random weights)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                    help="the weights' and the KV cache's dtype")
    ap.add_argument("--contexts", default="16384", help="figure: prompt lengths (the paper's figure: also 32768)")
    ap.add_argument("--budgets", default="256", help="figure: RocketKV token budgets (the paper's: 256,1024,4096)")
    ap.add_argument("--bench-context", type=int, default=16384, help="bench, eviction: prompt tokens")
    ap.add_argument("--bench-budget", type=int, default=2048, help="bench, batch: KeyDiff's budget")
    ap.add_argument("--decode-steps", type=int, default=50, help="attention, eviction, figure: decode steps per sample")
    ap.add_argument("--attention-contexts", default="16384", help="attention: prompt lengths (the target: also 32768)")
    ap.add_argument("--eviction-budgets", default="2048", help="eviction: budgets (the target: also 16384)")
    ap.add_argument("--eviction-policies", default="keydiff,snapkv,tova,h2o,sink", help="eviction: block-wise policies")
    ap.add_argument("--spec-draft", default="sink", help="speculate: the draft policy")
    ap.add_argument("--spec-budget", type=int, default=2048, help="speculate: the draft's budget")
    ap.add_argument("--spec-k", type=int, default=4, help="speculate: drafts per round")
    ap.add_argument("--spec-contexts", default="16384,32768", help="speculate: prompt lengths")
    ap.add_argument("--spec-accepted", type=float, default=2.3,
                    help="speculate: drafts kept per round for the step-time model (default: a sink 256 draft, K = 4, "
                         "on SmolLM2-135M at 8K, docs/speculative.md)")
    ap.add_argument("--batch-context", type=int, default=32768, help="batch: prompt tokens")
    ap.add_argument("--memory-cap", type=float, default=71680, help="batch: MiB (default 70 GiB)")
    ap.add_argument("--policies", default=",".join(["full", *policies.REGISTRY]),
                    help="graphs: the policies, with their defaults (default: full and every registered one)")
    ap.add_argument("--graph-model", default="smollm2-135m",
                    help="graphs: the checkpoint (real weights), or `tiny`: the tests' random 2-layer llama with a "
                         "small tokenizer, built here (needs transformers) where the embedded model is not installed")
    ap.add_argument("--graph-layers", type=int, default=2, help="graphs: its first N layers")
    ap.add_argument("--graph-prompt", type=int, default=256, help="graphs: prompt tokens")
    ap.add_argument("--graph-tokens", type=int, default=24, help="graphs: greedy tokens per generation")
    ap.add_argument("--graph-block", type=int, default=32, help="graphs: prefill block size")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # tests: cpu, to check the logic
    ap.add_argument("--no-compile", dest="compile", action="store_false", help=argparse.SUPPRESS)  # tests
    return ap


def check_args(args) -> list[str]:
    only = [s for s in args.only.split(",") if s]
    if not only or any(s not in SECTIONS for s in only):
        raise UserError(f"--only {args.only!r}: sections are {', '.join(SECTIONS)}")
    for k in ("bench_context", "bench_budget", "graph_layers", "graph_prompt", "graph_tokens", "graph_block",
              "spec_budget", "spec_k", "batch_context", "decode_steps"):
        if getattr(args, k) < 1:
            raise UserError(f"--{k.replace('_', '-')} must be >= 1, got {getattr(args, k)}")
    for k in ("contexts", "budgets", "attention_contexts", "eviction_budgets", "spec_contexts"):
        int_list(getattr(args, k), f"--{k.replace('_', '-')}")
    policies.spec_list(args.eviction_policies)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise EnvironmentFailure(f"gpu_check needs a CUDA GPU, and torch {torch.__version__} ({build}) sees none; "
                                 f"on a GPU machine set it up with: {CUDA_SETUP}")
    return only


def run(args) -> int:
    only = check_args(args)
    if args.out is None:
        args.out = REPO / "build" / ("gpu_check" if only == DEFAULT.split(",") else f"gpu_check_{'_'.join(only)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    header = (f"budgetkv GPU check on {name}, torch {torch.__version__}; figure and bench: {args.shapes} shapes, "
              f"random {args.dtype} weights, {'compiled' if args.compile else 'eager'}")
    print(header, file=sys.stderr)
    meta = {"device": name, "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()},
            "read_gb_s": read_bandwidth_gb_s(args.device), "wall_s": {}}
    runs = {"tests": lambda: run_tests(args.out), "graphs": lambda: run_graphs(args),
            "attention": lambda: run_attention(args), "eviction": lambda: run_eviction(args, args.out),
            "figure": lambda: run_figure(args, args.out, meta["read_gb_s"]), "bench": lambda: run_bench(args, args.out),
            "speculate": lambda: run_speculate(args, args.out), "batch": lambda: run_batch(args, args.out)}
    rows = []
    for section in only:
        t = time.perf_counter()
        print(f"  {section} ...", file=sys.stderr)
        try:
            rows += runs[section]()
        except (UserError, EnvironmentFailure, OSError, KeyError, ValueError) as e:  # the others still run
            rows.append(row(section, "section", False, "could not run", detail=last_line(str(e))))
        meta["wall_s"][section] = round(time.perf_counter() - t, 1)
        write(args.out, rows, header, meta)  # after every section: a stopped check keeps what it measured
    print(markdown(rows, header))
    print(f"sections took {meta['wall_s']} s; wrote {args.out.with_suffix('.md')} and .json", file=sys.stderr)
    return 0 if all(r["ok"] is not False for r in rows) else 1


def main(argv=None) -> int:
    return run_cli(run, parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
