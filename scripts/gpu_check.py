"""Every GPU claim in one command, on a machine with one CUDA GPU and this repository set up:

    TORCH_INDEX=https://download.pytorch.org/whl/cu128 bash scripts/setup.sh test   # once: CUDA torch, .venv-kv
    bash scripts/gpu_check.sh [--only tests,graphs,figure,bench] [--out build/gpu_check]

Sections, each a group of rows of one table (written to OUT.md and OUT.json, printed at the end):
- tests: the test suite's CUDA-only tests (`pytest -m cuda`), one row each.
- graphs: for each policy (and `full`), a generation whose decode step is compiled with mode="reduce-overhead" on
  --graph-model (the embedded SmolLM2 truncated to --graph-layers layers: a small graph compiles fast, and its real
  embedding and head keep greedy tokens away from ties): the decode step must replay as a CUDA graph (inductor
  counted no cudagraph skip), compile once (error_on_recompile) and give eager's greedy tokens. One more row,
  `speculate`: self-speculative decoding (a sink draft, K = 4) with the draft step and the K+1 verification block
  both under CUDA graphs: two graphs, no skip, no recompile, plain eager greedy's tokens.
- figure: RocketKV's Figure 5 (`bench_figure.py`) at --shapes with random --dtype weights, at --contexts
  and --budgets: decode speedup over `full` beside the bandwidth-model ideal, decode peak memory saving, and
  `full`'s decode step as a fraction of the bandwidth bound (bytes read per step at the read bandwidth measured
  here).
- bench: the policy table (`bench.py --kvpress --policies keydiff`) at the same shapes, --bench-context tokens and
  --bench-budget: KeyDiff's decode step over no-evict's (its overhead: scoring and hole filling), and decode tok/s
  against HF transformers + kvpress (same shapes, transformers' random init) for `full` and KeyDiff.
Targets (docs/performance.md, "The GPU check"): RocketKV at budget 256 and 16K+ about 3x full's decode and about 31%
less peak memory (the paper, Llama-3.1-8B); full's decode >= 80% of the bandwidth bound at batch 1; KeyDiff's step
overhead <= 10%. Exit 0 when every check passed, 1 when one failed or a section could not run, 2 for bad input.
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
from cli import Parser, run_cli  # noqa: E402
from engine import (compile_steps, generate, load_model, model_step, prefill_protocol, prefill_step,  # noqa: E402
                    setup, sync, warm_up)
from errors import EnvironmentFailure, UserError  # noqa: E402

SECTIONS = ("tests", "graphs", "figure", "bench")
CUDA_SETUP = "TORCH_INDEX=https://download.pytorch.org/whl/cu128 bash scripts/setup.sh test"
PY = sys.executable


def row(section: str, check: str, ok: bool | None, value: str, target: str = "", detail: str = "") -> dict:
    """One line of the table: ok True (passed), False (failed) or None (measured, no target to pass)."""
    return {"section": section, "check": check, "ok": ok, "value": value, "target": target, "detail": detail}


# -------------------------------------------------------------------------------------------------------- tests

def run_tests(out: Path) -> list[dict]:
    """The CUDA-only tests (marked `cuda`), one row each from pytest's JUnit XML."""
    xml = out.with_name(out.name + "_tests.xml")
    r = subprocess.run([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", "tests",
                        f"--junitxml={xml}"], cwd=REPO, capture_output=True, text=True)
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
    protocol = prefill_protocol(policy, None)
    setup(model, policy, graph_budget(policy, len(prompt), new_tokens), len(prompt), new_tokens, block_size,
          prefill=protocol)
    run = dict(block_size=block_size, device=device, one_shot=protocol == "one-shot")
    eager = generate(model, prompt, new_tokens, steps=(prefill_step, model_step), **run)

    def compiled():
        steps = compile_steps(device, mode, prefill=False)
        warm_up(model, steps, prompt[0], block_size, device)
        return generate(model, prompt, new_tokens, steps=steps, **run)
    return compare_compiled(spec, eager, compiled, device)


def speculate_check(model, draft_spec: str, prompt: list[int], new_tokens: int, block_size: int, device: str,
                    mode: str | None = "reduce-overhead", k: int = 4) -> dict:
    """Self-speculative decoding with `draft_spec` at graph_budget's budget: plain eager greedy tokens (the full
    cache), then a speculative generation whose draft step and verification block are compiled in `mode`, under
    error_on_recompile; the same fields as graph_check, graphs expected: 2."""
    import speculative
    draft_policy = policies.make(draft_spec)
    setup(model, None, len(prompt) + new_tokens, len(prompt), new_tokens, block_size)
    plain = generate(model, prompt, new_tokens, steps=(prefill_step, model_step), block_size=block_size,
                     device=device)
    draft = speculative.draft_model(model)
    speculative.setup(model, draft, draft_policy, graph_budget(draft_policy, len(prompt), new_tokens), len(prompt),
                      new_tokens, block_size, k)

    def compiled():
        steps = speculative.compile_steps(device, mode)
        speculative.warm_up(model, draft, steps, prompt[0], block_size, k, device)
        return speculative.generate(model, draft, prompt, new_tokens, k=k, block_size=block_size, steps=steps,
                                    device=device)
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
    from scripts.benchlib import make_document
    src = out.with_name(out.name + "_tiny_src")
    make_hf_checkpoint("llama", src)
    return with_tiny_tokenizer(src, out.with_name(out.name + "_tiny"), inspect.getsource(make_document))


def run_graphs(args) -> list[dict]:
    from checkpoint import resolve_checkpoint
    from scripts.benchlib import make_document
    from tokenizer import load_tokenizer
    ckpt = tiny_checkpoint(args.out) if args.graph_model == "tiny" else resolve_checkpoint(args.graph_model)
    model = load_model(ckpt, torch.float32, args.device)
    model.layers = model.layers[:args.graph_layers]  # a small graph: the check is the capture, not the model
    torch.backends.cuda.matmul.allow_tf32 = False  # eager and compiled in the same precision
    _, prompt = make_document(load_tokenizer(ckpt), args.graph_prompt)
    prompt = (prompt * -(-args.graph_prompt // len(prompt)))[:args.graph_prompt]  # a small tokenizer's few tokens
    mode = "reduce-overhead" if args.device.startswith("cuda") else None  # CPU (tests): no graphs to capture
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


# ------------------------------------------------------------------------------------------------ figure, bench

def bench(argv: list[str], args, script: str = "bench.py") -> subprocess.CompletedProcess:
    """scripts/`script` at the check's shapes and dtype, random weights; EnvironmentFailure with its last line when
    it fails."""
    cmd = [PY, str(REPO / "scripts" / script), "--random-weights", "--checkpoint", args.shapes, "--dtype",
           args.dtype, "--device", args.device, *(["--compile"] if args.compile else []), *argv]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        raise EnvironmentFailure(f"{' '.join(cmd[1:])} failed: {last_line(r.stderr or r.stdout)}")
    return r


def run_figure(args, out: Path, read_gb_s: float) -> list[dict]:
    fig_dir = out.with_name(out.name + "_figure")
    bench(["--contexts", args.contexts, "--budgets", args.budgets, "--out-dir", str(fig_dir)], args, "bench_figure.py")
    return figure_rows(json.loads((fig_dir / "rocketkv_figure.json").read_text())["rows"], read_gb_s)


def figure_rows(rows: list[dict], read_gb_s: float) -> list[dict]:
    """RocketKV vs full per context: speedup beside the ideal, peak saving (targets at budget 256 from 16K on: the
    paper's ~3x and ~31%, checked as >= 2.5x and >= 25%); full's step against the bandwidth bound (>= 80%)."""
    out = []
    for x in sorted(rows, key=lambda x: (x["T"], x["label"] != "full", x.get("cache_slots", 0))):
        step_s = x["decode_step_ms"] / 1e3
        if x["label"] == "full":
            frac = x["bytes_per_step"] / step_s / 1e9 / read_gb_s
            out.append(row("figure", f"full @ {x['T']}", frac >= 0.8, f"{frac:.0%} of the bandwidth bound "
                           f"({x['decode_step_ms']:.2f} ms/step)", ">= 80%"))
            continue
        paper = x["label"] == "rocketkv-256" and x["T"] >= 16384
        out.append(row("figure", f"{x['label']} @ {x['T']}",
                       x["speedup"] >= 2.5 and x["peak_saving"] >= 0.25 if paper else None,
                       f"{x['speedup']:.2f}x (ideal {x['ideal_speedup']:.2f}x), peak {-x['peak_saving']:+.1%}",
                       "~3x, ~-31% (paper)" if paper else ""))
    return out


def run_bench(args, out: Path) -> list[dict]:
    path = out.with_name(out.name + "_bench.json")
    bench(["--kvpress", "--policies", "keydiff", "--prompt-tokens", str(args.bench_context), "--budget",
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
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"sections to run, of {', '.join(SECTIONS)}")
    ap.add_argument("--out", type=Path, default=REPO / "build" / "gpu_check", help="writes OUT.json and OUT.md")
    ap.add_argument("--shapes", default="llama3.1-8b", help="figure and bench: the shipped config (random weights)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--contexts", default="16384", help="figure: prompt lengths (the paper's figure: also 32768)")
    ap.add_argument("--budgets", default="256", help="figure: RocketKV token budgets (the paper's: 256,1024,4096)")
    ap.add_argument("--bench-context", type=int, default=16384, help="bench: prompt tokens")
    ap.add_argument("--bench-budget", type=int, default=2048, help="bench: KeyDiff's budget")
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
    for k in ("bench_context", "bench_budget", "graph_layers", "graph_prompt", "graph_tokens", "graph_block"):
        if getattr(args, k) < 1:
            raise UserError(f"--{k.replace('_', '-')} must be >= 1, got {getattr(args, k)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise EnvironmentFailure(f"gpu_check needs a CUDA GPU, and torch {torch.__version__} ({build}) sees none; "
                                 f"on a GPU machine set it up with: {CUDA_SETUP}")
    return only


def run(args) -> int:
    only = check_args(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    header = (f"budgetkv GPU check on {name}, torch {torch.__version__}; figure and bench: {args.shapes} shapes, "
              f"random {args.dtype} weights, {'compiled' if args.compile else 'eager'}")
    print(header, file=sys.stderr)
    from scripts.benchlib import read_bandwidth_gb_s
    meta = {"device": name, "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()},
            "read_gb_s": read_bandwidth_gb_s(args.device), "wall_s": {}}
    runs = {"tests": lambda: run_tests(args.out), "graphs": lambda: run_graphs(args),
            "figure": lambda: run_figure(args, args.out, meta["read_gb_s"]), "bench": lambda: run_bench(args, args.out)}
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
