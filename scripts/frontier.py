"""Which policy at my memory budget: every policy x budget at one context length, its quality against the same
model's full cache beside its speed and memory as a user's run has them, in one table and on one chart.

    python scripts/frontier.py --length 2048 --budgets 128,256,512,1024          # SmolLM2-135M: every policy
    python scripts/frontier.py --checkpoint llama3.1-8b --random-weights --length 8192 \\
        --budgets 512,1024,2048,4096                                             # speed and memory at 8B shapes (GPU)

Each configuration is a policy at a budget (`full`, the reference, first; a policy that holds every token,
Exact-TopK, once, at full's budget), block-wise prefill (the one-shot-only policies one-shot), and is measured by
the other scripts' own code:
  quality  scripts/eval.py's functions on the prompts of `scripts/eval.py --tasks fidelity,TASK --lengths L
           --fid-prefix L ...` (the whole command is in frontier.md and frontier.json: its numbers are these):
           KL(full || policy) and top-1 agreement with full over --fid-tokens teacher-forced tokens after an L-token
           prefix, and the retrieval task's score at L tokens (needle: niah_single at each of --depths;
           niah_single: --samples prompts).
  speed    scripts/bench.py --one in a fresh process (what bench.py runs for each configuration of its table): an
           L-token prompt through engine.Generation, compiled as generate.py --compile compiles (CUDA graphs on a
           GPU) unless --eager: decode tok/s (median step), TTFT, and the peak memory of each phase (process peak
           RSS on CPU, max_memory_allocated on CUDA).
  memory   the K/V buffers of the configuration's run for one sequence (the chart's x axis): engine.Generation's
           caches for bench.py's prompt and --decode-steps + 1 new tokens, set up on a model on the meta device.
The Pareto front: the configurations that no other matches in both KV bytes (or fewer) and --rank (or better).
Outputs in --out-dir: frontier.json (rewritten after every configuration: what --resume reads), then frontier.md
(the table, least memory first, the front marked) and frontier.png (--rank against KV bytes per sequence, one
marker per configuration, colour = decode tok/s, the front drawn and named). One plain line per configuration on
stderr (a terminal or a log alike), with the time left. An interrupted run goes on with the same command and
--resume.
"""
import argparse
import importlib.util
import math
import shlex
import statistics
import sys
import re
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from errors import check_python  # noqa: E402

check_python()  # one line, not a traceback, in a Python without the requirements
import torch  # noqa: E402

import policies  # noqa: E402
from cache import kv_bytes  # noqa: E402
from cli import Parser, run_child, run_cli  # noqa: E402
from config import parse_config  # noqa: E402
from engine import Generation  # noqa: E402
from errors import UserError  # noqa: E402
from files import check_writable  # noqa: E402
from loading import load_model, meta_model  # noqa: E402
from runtime import model_step, prefill_step  # noqa: E402
from scripts import bench  # noqa: E402
from scripts import eval as ev  # noqa: E402
from scripts.benchlib import (bad_field, bench_settings, bench_source, check_sizes, int_list, json_result,  # noqa: E402
                              make_document, previous, save, start)
from scripts.eval_report import NOT_APPLICABLE, label, summarize  # noqa: E402
from scripts.outputs import save_png, write_atomic  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402

ALL = ",".join(["full", *policies.REGISTRY])
TASKS = ("needle", "niah_single")
# what a row holds from each measurement, each a number (benchlib.bad_field's kinds)
QUALITY = {"kl": float, "top1": float, "ppl": float, "retrieval": float}
SPEED = {"decode_tok_s": float, "decode_step_ms": float, "ttft_s": float, "prefill_tok_s": float,
         "prefill_peak_mib": float, "decode_peak_mib": float, "kv_cache_mib": float, "warmup_s": float}
# --rank (and "speed" when no quality is measured): the row's field, its sign (higher is better), the axis' scale
# and name
AXES = {"top1": ("top1", 1, 100, "top-1 agreement with full, %"), "kl": ("kl", -1, 1, "KL(full || policy), nats"),
        "retrieval": ("retrieval", 1, 100, "retrieval score, %"), "speed": ("decode_tok_s", 1, 1, "decode tok/s")}
NOT_SETTINGS = ("rank", "verbose")  # how the results are shown, not what they are


def what(name: str) -> str:
    """An axis' name in a sentence: "top-1 agreement with full"."""
    return AXES[name][3].rsplit(",", 1)[0]


# ------------------------------------------------------------------------------------ the other scripts' runs

def eval_argv(args, specs: list[str], budgets: list[int]) -> list[str]:
    """scripts/eval.py's command line whose fidelity and retrieval numbers are this run's quality columns."""
    return ["--checkpoint", args.checkpoint, "--policies", ",".join(specs), "--budgets", ",".join(map(str, budgets)),
            "--tasks", f"fidelity,{args.task}", "--lengths", str(args.length), "--fid-prefix", str(args.length),
            "--fid-tokens", str(args.fid_tokens), "--fid-texts", str(args.fid_texts),
            "--depths", ",".join(f"{d:g}" for d in args.depths), "--samples", str(args.samples),
            "--block-size", str(args.block_size), "--seed", str(args.seed), "--dtype", args.dtype,
            "--device", args.device]


def bench_argv(args, spec: str, budget) -> list[str]:
    """scripts/bench.py's command line that measures one configuration in a process of its own (--one, as bench.py
    runs each configuration of its table). A policy that holds every token ignores --budget."""
    argv = ["--checkpoint", args.checkpoint, "--prompt-tokens", str(args.length), "--budget", str(budget),
            "--policies", spec, "--decode-steps", str(args.decode_steps), "--repeats", str(args.repeats),
            "--block-size", str(args.block_size), "--dtype", dtype_name(args), "--device", args.device]
    argv += ["--threads", str(args.threads)] if args.threads is not None else []
    argv += [] if args.eager else ["--compile"]
    argv += ["--random-weights"] if args.random_weights else []
    return argv + ["--one", spec]


def bench_args(args, spec: str, budget):
    return bench.parser().parse_args(bench_argv(args, spec, budget))


def dtype_name(args) -> str:
    return str(ev.dtype_of(args)).removeprefix("torch.")


def speed(args, spec: str, budget) -> dict:
    """bench.py --one of this configuration in a fresh process: the row it gives bench.py's table. A failure ends
    the run with one line (its whole output in a log)."""
    cmd = [sys.executable, str(REPO / "scripts" / "bench.py"), *bench_argv(args, spec, budget)]
    r = json_result(run_child(cmd), f"{spec} at budget {budget} (scripts/bench.py --one)", "frontier")
    return {k: r[k] for k in SPEED}


def speed_na(args, config: dict, spec: str, budget) -> str | None:
    """Why bench.py cannot run this configuration (its policy cannot plan this prompt at this budget), or None."""
    try:
        check_sizes(config, bench_args(args, spec, budget))
    except UserError as e:
        return str(e)
    return None


def quality(q, a, cfg) -> dict | str:
    """eval.py's fidelity and retrieval records of one configuration, averaged as eval.py's table averages them
    (eval_report.summarize); or why the policy cannot run these prompts at this budget."""
    NOT_APPLICABLE.clear()
    kw = dict(block_size=a.block_size, steps=q.steps)
    records = ev.fidelity(q.model, q.texts, a.fid_prefix, [cfg], accept_k=a.accept_k, ref=q.ref, **kw)
    if not NOT_APPLICABLE:
        records += ev.run_task(q.model, q.tok, a.tasks[1], q.items, [cfg], **kw)
    if NOT_APPLICABLE:
        return next(iter(NOT_APPLICABLE.values()))
    summary = summarize(records)
    row, budget = label(cfg[0], cfg[1]), "all" if cfg[2] is None else str(cfg[2])
    fid, task = summary["fidelity"][row][budget], summary[a.tasks[1]][row][budget]
    return dict(kl=fid["kl"], top1=fid["agree"], ppl=fid["ppl"], retrieval=task["score"])


def quality_prompts(a, config, tok) -> SimpleNamespace:
    """eval.py's prompts for the quality columns: the fidelity texts and the retrieval task's items."""
    with our_flags():
        return SimpleNamespace(tok=tok, texts=ev.fidelity_texts(tok, a.fid_texts, a.fid_prefix + a.fid_tokens, a.seed),
                               items=ev.make_items(tok, a, parse_config(config).max_seq_len)[a.tasks[1]])


def load_quality(q, args, a, ckpt, config) -> None:
    """The model (eager steps, as eval.py's default) and the full cache's fidelity reference, into q."""
    q.model = load_model(ckpt, ev.dtype_of(args), args.device, config)
    q.steps = (prefill_step, model_step)
    q.ref = ev.fidelity_reference(q.model, q.texts, a.fid_prefix, block_size=a.block_size, steps=q.steps)


FLAGS = {"--lengths": "--length", "--fid-prefix": "--length", "--prompt-tokens": "--length", "--budget": "--budgets"}


@contextmanager
def our_flags():
    """eval.py's and bench.py's errors about their flags, named as this script's flags."""
    try:
        yield
    except UserError as e:
        raise UserError(re.sub(r"--(lengths|fid-prefix|prompt-tokens|budget)\b", lambda m: FLAGS[m[0]], str(e))) \
            from None


def kv_mib(meta, args, spec: str, budget, prompt_len: int) -> float:
    """The K/V buffers of this configuration's run for one sequence (bench.py's: a prompt_len-token prompt and
    --decode-steps + 1 new tokens), MiB: engine.Generation's caches on `meta`, a model on the meta device."""
    Generation(meta.args, policies.make(spec), [prompt_len], budget=budget, max_new_tokens=1 + args.decode_steps,
               block_size=args.block_size, device=args.device).setup(meta)
    return kv_bytes(meta) / 2**20


# ------------------------------------------------------------------------------------------------- the front

def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points (cost, value) that no other point dominates: none has a cost as low and a value as
    high, and one of them strictly. Equal points are all on the front."""
    return [i for i, (c, v) in enumerate(points)
            if not any(c2 <= c and v2 >= v and (c2 < c or v2 > v) for c2, v2 in points)]


def axis(measures: dict, args) -> str:
    return args.rank if measures["quality"] else "speed"


def score(row: dict, name: str) -> float:
    """The row's value on axis `name`, higher = better."""
    field, sign, _, _ = AXES[name]
    return sign * row[field]


def front(rows: list[dict], name: str) -> list[str]:
    """The labels of the rows on the Pareto front of KV bytes against axis `name` (n/a rows are on no front)."""
    ok = [r for r in rows if r["na"] is None]
    return [ok[i]["label"] for i in pareto_front([(r["kv_mib"], score(r, name)) for r in ok])]


# ------------------------------------------------------------------------------------------------- the outputs

def cell(row: dict, field: str, on: bool, fmt: str, scale: float = 1) -> str:
    """A table cell: the row's field, n/a, or not measured (`on` False)."""
    if row["na"] is not None:
        return "n/a"
    return fmt.format(scale * row[field]) if on else "not measured"


def markdown(rows, on_front, measures, args, header: str) -> str:
    """The table: least KV memory first, the best --rank first among equals; the front's rows marked."""
    name = axis(measures, args)
    full = next(r for r in rows if r["policy"] == "full")
    order = sorted(rows, key=lambda r: (r["na"] is not None, r["kv_mib"] or 0, -score(r, name) if r["na"] is None
                                        else 0))
    lines = [header, "", f"| policy | budget | KV MiB per sequence | KV % of full | KL | top-1 % | {args.task} % | "
             "decode tok/s | TTFT s | peak MiB prefill / decode | front |", "|---|" + "---:|" * 9 + "---|"]
    q, s = measures["quality"], measures["speed"]
    for r in order:
        peak = cell(r, "prefill_peak_mib", s, "{:.0f}") + (f" / {r['decode_peak_mib']:.0f}"
                                                           if s and r["na"] is None else "")
        share = cell(r, "kv_mib", True, "{:.1f}", 100 / full["kv_mib"])
        lines.append(f"| {label(r['protocol'], r['policy'])} | {r['budget'] or 'all'} | "
                     f"{cell(r, 'kv_mib', True, '{:.2f}')} | {share} | "
                     f"{cell(r, 'kl', q, '{:.3f}')} | {cell(r, 'top1', q, '{:.1f}', 100)} | "
                     f"{cell(r, 'retrieval', q, '{:.1f}', 100)} | {cell(r, 'decode_tok_s', s, '{:.1f}')} | "
                     f"{cell(r, 'ttft_s', s, '{:.2f}')} | {peak} | {'yes' if r['label'] in on_front else ''} |")
    reasons = sorted({f"{r['label']}: {r['na']}" for r in rows if r["na"] is not None})
    return "\n".join(lines + ([""] + ["n/a: " + "; ".join(reasons)] if reasons else [])) + "\n"


def plot(rows, on_front, measures, args, title: str, path: Path) -> None:
    """--rank (or decode tok/s) against KV MiB per sequence: a marker per configuration (its shape the policy's),
    coloured by decode tok/s; the front a red staircase (the best reached at that memory or less), its members
    named; the top axis and the dotted lines: % of full's KV."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator
    name = axis(measures, args)
    field, _, scale, ylabel = AXES[name]
    ok = [r for r in rows if r["na"] is None]
    full_kv = next(r["kv_mib"] for r in rows if r["policy"] == "full")
    colour = measures["speed"] and name != "speed"
    speeds = [r["decode_tok_s"] for r in ok] if colour else [0.0]
    norm, cmap = plt.Normalize(min(speeds), max(max(speeds), min(speeds) * 1.01 + 1e-9)), plt.get_cmap("viridis")
    fig, ax = plt.subplots(figsize=(11, 6.5))
    shapes, names = "osD^vP*Xhp<>d8H", list(dict.fromkeys(r["policy"] for r in ok))
    for n, policy in enumerate(names):
        mine = [r for r in ok if r["policy"] == policy]
        ax.scatter([r["kv_mib"] for r in mine], [scale * r[field] for r in mine], s=70, marker=shapes[n % len(shapes)],
                   c=[cmap(norm(r["decode_tok_s"])) for r in mine] if colour else "lightgrey", edgecolors="black",
                   linewidths=0.6, zorder=3)
    members = sorted((r for r in ok if r["label"] in on_front), key=lambda r: r["kv_mib"])
    ax.step([r["kv_mib"] for r in members], [scale * r[field] for r in members], where="post", color="red", lw=1.2,
            zorder=2)
    for kv in dict.fromkeys(r["kv_mib"] for r in members):  # equal members (same memory, same value): one label
        tied = [r for r in members if r["kv_mib"] == kv]
        ax.annotate(", ".join(r["label"] for r in tied), (kv, scale * tied[0][field]), textcoords="offset points",
                    xytext=(5, -11), fontsize=8, color="darkred")
    ax.set_xscale("log", base=2)
    ticks = sorted({round(r["kv_mib"], 3) for r in ok})
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:.3g}"))
    ax.set_xlabel("KV cache per sequence, MiB (log scale; a tick at each configuration's)")
    ax.set_ylabel(ylabel)
    if name == "kl":
        ax.invert_yaxis()  # up is better on every axis
    shares = [100 / 2**k for k in range(12) if 100 / 2**k >= 100 * min(ticks) / full_kv / 1.01]
    for p in shares[1:]:
        ax.axvline(p * full_kv / 100, color="grey", ls=":", lw=0.8, zorder=1)
    top = ax.secondary_xaxis("top", functions=(lambda x: 100 * x / full_kv, lambda p: p * full_kv / 100))
    top.xaxis.set_major_locator(FixedLocator(shares))
    top.xaxis.set_minor_locator(NullLocator())
    top.xaxis.set_major_formatter(FuncFormatter(lambda p, _: f"{p:g}%"))
    top.set_xlabel("% of full's KV cache")
    ax.grid(alpha=0.3, axis="y")
    handles = [Line2D([], [], ls="", marker=shapes[n % len(shapes)], color="lightgrey", markeredgecolor="black",
                      label=policy) for n, policy in enumerate(names)]
    ax.legend(handles=handles + [Line2D([], [], color="red", label="Pareto front")], fontsize=8, loc="best", ncol=2)
    if colour:
        fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax,
                     label=f"decode tok/s ({'eager' if args.eager else 'compiled'})")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    plt.close(fig)


def header(args, measures: dict, specs, budgets, wall_s: float, resumed: int, n: int) -> str:
    device = f"{args.device}, {dtype_name(args)}, block {args.block_size}, torch threads {torch.get_num_threads()}"
    q = (f"quality: `python scripts/eval.py {shlex.join(eval_argv(args, specs, budgets))}` (its fidelity KL and top-1 "
         f"agreement, {args.task} score)" if measures["quality"] else "quality: not measured (--random-weights: "
         "random weights)")
    s = (f"speed: `python scripts/bench.py {shlex.join(bench_argv(args, 'POLICY', 'BUDGET'))}` per configuration, a "
         f"fresh process each ({'eager' if args.eager else 'compiled'}, medians of {args.repeats})"
         if measures["speed"] else "speed: not measured (--no-speed)")
    note = f" ({resumed} of {n} configurations from an earlier run, --resume)" if resumed else ""
    return (f"# Which policy at my memory budget: {args.checkpoint}, {args.length} tokens\n\n{device}; {wall_s:.0f} s"
            f"{note}\n\n{q}\n\n{s}\n\nKV MiB per sequence: the K/V buffers of the configuration's run. Front: no "
            f"other configuration has as little KV memory and as good a {what(axis(measures, args))}.")


def save_json(path: Path, args, settings, rows, measures, specs, budgets) -> None:
    save(path, args, settings, rows=rows, front=front(rows, axis(measures, args)), measured=measures,
         eval_argv=eval_argv(args, specs, budgets) if measures["quality"] else None)


# ----------------------------------------------------------------------------------------------------- the run

def kept(path: Path, settings: dict, args, fields: dict) -> dict:
    """--resume: label -> row of the frontier.json a run with these settings left (refused in one line if it was
    written with others). A row that is not a measurement (a field missing or of another type, a number that is
    not finite and non-negative) is left out, to be measured again, with one line naming it."""
    out = {}
    for r in previous(path, settings, args, "rows", list, {"label": str}):
        want = {"label": str, "na": str} if r.get("na") is not None else fields
        if bad_field(r, want) is not None:
            print(f"--resume: {path}: {r['label']} is not a row this script writes: measuring it again",
                  file=sys.stderr)
            continue
        bad = next((f for f, t in want.items() if t is float and not 0 <= r[f] < math.inf), None)  # kl 0: full's
        if bad is not None:
            print(f"--resume: {path}: label {r['label']} has {bad} = {r[bad]} (not a finite, non-negative number): "
                  "measuring it again", file=sys.stderr)
            continue
        out[r["label"]] = r
    return out


def key(cfg) -> str:
    return cfg[1] if cfg[2] is None else f"{cfg[1]}@{cfg[2]}"


def duration(s: float) -> str:
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.0f} min" if s < 5400 else f"{s / 3600:.1f} h"


def progress(i: int, n: int, row: dict, full_kv: float, took: float, left_s: float | None, task: str) -> str:
    """One plain line per configuration: what it measured, how long it took and the time left."""
    head = f"[{i}/{n}] {label(row['protocol'], row['policy'])}" + (f" @ {row['budget']}" if row["budget"] else "")
    if row["na"] is not None:
        return f"{head}: n/a ({row['na']})"
    parts = [f"KV {row['kv_mib']:.2f} MiB ({100 * row['kv_mib'] / full_kv:.0f}% of full)"]
    if row["kl"] is not None:
        parts += [f"KL {row['kl']:.3f}", f"top-1 {100 * row['top1']:.1f}%", f"{task} {100 * row['retrieval']:.0f}%"]
    if row["decode_tok_s"] is not None:
        parts += [f"decode {row['decode_tok_s']:.1f} tok/s", f"TTFT {row['ttft_s']:.2f} s",
                  f"peak {max(row['prefill_peak_mib'], row['decode_peak_mib']):.0f} MiB"]
    left = "" if left_s is None else f", about {duration(left_s)} left"
    return f"{head}: {', '.join(parts)} ({duration(took)}{left})"


def check_args(args) -> tuple[list[str], list[int]]:
    """Bad input fails here, before any model is loaded: the flags eval.py and bench.py share with this script are
    checked by their own checks. Returns (policy specs, full first; budgets)."""
    if args.random_weights and args.no_speed:
        raise UserError("--random-weights measures speed and memory only, and --no-speed skips them: nothing to run")
    if args.length < 1:
        raise UserError(f"--length must be >= 1, got {args.length}")
    budgets = int_list(args.budgets, "--budgets")
    specs = policies.spec_list(args.policies)
    specs = ["full"] + [s for s in specs if s != "full"]
    with our_flags():
        bench.check_args(bench_args(args, ",".join(specs), max(budgets)))  # names, twice, sizes, device, ...
        if not args.random_weights:
            ev.check_args(ev.parse_args(eval_argv(args, specs, budgets)))
    try:
        args.out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out-dir {args.out_dir}: {e.strerror}") from None
    check_writable(args.out_dir / "frontier.json", "--out-dir")
    return specs, budgets


def run(args) -> int:
    t_start = time.perf_counter()
    specs, budgets = check_args(args)
    start(args)
    measures = dict(quality=not args.random_weights, speed=not args.no_speed)
    a = ev.parse_args(eval_argv(args, specs, budgets))
    ckpt, config = bench_source(bench_args(args, "full", max(budgets)))
    tok = q = None
    with our_flags():
        check_sizes(config, bench_args(args, "full", max(budgets)))  # the prompt, steps, block and budgets
        if measures["quality"]:
            ev.check_sizes(a, parse_config(config))
            tok = load_tokenizer(ckpt)
            q = quality_prompts(a, config, tok)
    prompt_len = args.length if args.random_weights else len(make_document(tok or load_tokenizer(ckpt),
                                                                            args.length)[1])  # bench.py's prompt
    path = args.out_dir / "frontier.json"
    settings = {k: v for k, v in bench_settings(args, ckpt, "frontier").items() if k not in NOT_SETTINGS}
    fields = {"label": str, "kv_mib": float} | (QUALITY if measures["quality"] else {}) | \
        (SPEED if measures["speed"] else {})
    old = kept(path, settings, args, fields)
    cfgs = ev.configs(a)
    todo = [c for c in cfgs if key(c) not in old]
    print(f"frontier: {args.checkpoint}, {args.length} tokens, {len(cfgs)} configurations"
          f"{f' ({len(cfgs) - len(todo)} from {path})' if len(todo) < len(cfgs) else ''}; quality "
          f"{'eval.py fidelity + ' + args.task if measures['quality'] else 'not measured (--random-weights)'}; speed "
          f"{('bench.py --one, ' + ('eager' if args.eager else 'compiled')) if measures['speed'] else 'not measured'}"
          f"; {args.device}, {dtype_name(args)}", file=sys.stderr, flush=True)
    meta = meta_model(config).to(ev.dtype_of(args))
    rows, took = [], []
    try:
        for i, cfg in enumerate(cfgs, 1):
            protocol, spec, budget = cfg
            row = dict(label=key(cfg), policy=spec, protocol=protocol, budget=budget, na=None, kv_mib=None,
                       **dict.fromkeys([*QUALITY, *SPEED]))
            if row["label"] in old:
                rows.append(row | {k: old[row["label"]].get(k) for k in ["na", *fields]})
                print(f"[{i}/{len(cfgs)}] {row['label']}: from {path}", file=sys.stderr, flush=True)
                continue
            t = time.perf_counter()
            row["na"] = speed_na(args, config, spec, budget or max(budgets))
            if row["na"] is None:
                row["kv_mib"] = kv_mib(meta, args, spec, budget, prompt_len)
            if row["na"] is None and measures["quality"]:
                if not hasattr(q, "model"):  # loaded once something is to be measured (not when every row is kept)
                    load_quality(q, args, a, ckpt, config)
                got = quality(q, a, cfg)
                row.update(got) if isinstance(got, dict) else row.update(na=got)
            if row["na"] is None and measures["speed"]:
                row.update(speed(args, spec, budget or max(budgets)))
            rows.append(row)
            save_json(path, args, settings, rows, measures, specs, budgets)  # a stopped run keeps every row so far
            took += [time.perf_counter() - t] if row["na"] is None else []
            left = sum(key(c) not in old for c in cfgs[i:])
            print(progress(i, len(cfgs), row, rows[0]["kv_mib"], time.perf_counter() - t,
                           statistics.mean(took) * left if took else None, args.task), file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print(f"\n{path} keeps {len(rows)} of {len(cfgs)} configurations: the same command with --resume goes on",
              file=sys.stderr)
        raise
    save_json(path, args, settings, rows, measures, specs, budgets)
    return write_outputs(args, rows, measures, specs, budgets, time.perf_counter() - t_start, len(cfgs) - len(todo))


def write_outputs(args, rows, measures, specs, budgets, wall_s: float, resumed: int) -> int:
    """frontier.md and frontier.png, each replaced whole; the table on stdout."""
    name = axis(measures, args)
    on_front = front(rows, name)
    head = header(args, measures, specs, budgets, wall_s, resumed, len(rows))
    md = markdown(rows, on_front, measures, args, head)
    write_atomic(args.out_dir / "frontier.md", md)
    print(md)
    written = "frontier.json and frontier.md"
    if importlib.util.find_spec("matplotlib") is not None:
        shown = f"{what(name)} against KV memory" + (", colour: decode tok/s" if name != "speed" and
                                                     measures["speed"] else "")
        plot(rows, on_front, measures, args, f"{args.checkpoint}, {args.length} tokens: {shown}" +
             ("" if measures["quality"] else " (quality not measured: random weights)"), args.out_dir / "frontier.png")
        written += " and frontier.png"
    else:
        print(f"no frontier.png: matplotlib is not installed ({sys.executable} -m pip install -r "
              "requirements-eval.txt)", file=sys.stderr)
    print(f"front ({what(name)} against KV memory): {', '.join(on_front)}\nwrote {written} in {args.out_dir} "
          f"({wall_s:.0f} s)", file=sys.stderr)
    return 0


def parser() -> Parser:
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="smollm2-135m",
                    help="as in generate.py; with --random-weights a short name's shapes or a folder with a "
                         "config.json (default smollm2-135m)")
    ap.add_argument("--length", type=int, default=2048,
                    help="context length in tokens: the fidelity prefix, the retrieval prompts and the timed prompt "
                         "(default 2048)")
    ap.add_argument("--budgets", default="128,256,512,1024",
                    help="KV slots held per layer and KV head, comma list (default 128,256,512,1024)")
    ap.add_argument("--policies", default=ALL,
                    help="comma list of policy specs (default: full and every registered policy); full, the "
                         "reference, always runs")
    ap.add_argument("--task", choices=TASKS, default="needle",
                    help="the retrieval task, as eval.py runs it: needle (niah_single at each of --depths) or "
                         "niah_single (--samples prompts) (default needle)")
    ap.add_argument("--depths", type=ev.csv(float), default=[0.0, 0.5, 1.0],
                    help="needle depths, 0 = start of the context, 1 = end (default 0,0.5,1)")
    ap.add_argument("--samples", type=int, default=1, help="retrieval prompts per depth (needle) or in all (default 1)")
    ap.add_argument("--fid-tokens", type=int, default=128,
                    help="fidelity: tokens teacher-forced and scored after the --length prefix (default 128)")
    ap.add_argument("--fid-texts", type=int, default=1, help="fidelity: number of text windows (default 1)")
    ap.add_argument("--seed", type=int, default=0, help="retrieval data and fidelity text offsets (default 0)")
    ap.add_argument("--rank", choices=["top1", "kl", "retrieval"], default="top1",
                    help="the quality of the chart's y axis and of the Pareto front (default top1; with --random-weights: "
                         "decode tok/s)")
    ap.add_argument("--decode-steps", type=int, default=32, help="speed: decode steps timed per repeat (default 32)")
    ap.add_argument("--repeats", type=int, default=3, help="speed: repeats, medians reported (default 3)")
    ap.add_argument("--block-size", type=int, default=128, help="prefill block size (default 128)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="weights and KV cache (default auto: bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="(default cuda when there is one, else cpu)")
    ap.add_argument("--threads", type=int,
                    help="torch threads, here and in each timed process (default: torch's, as a user's run has)")
    ap.add_argument("--eager", action="store_true",
                    help="time eager steps (default: compiled as generate.py --compile: CUDA graphs on a GPU, the "
                         "decode step compiled ahead of time on CPU)")
    ap.add_argument("--no-speed", action="store_true",
                    help="quality and KV memory only: the speed and peak-memory columns say not measured")
    ap.add_argument("--random-weights", action="store_true",
                    help="speed and memory only, at --checkpoint's shapes with seeded random weights and random "
                         "prompt ids (bench.py --random-weights): the quality columns say not measured")
    ap.add_argument("--out-dir", type=Path, default=REPO / "build" / "frontier", help="(default build/frontier)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the configurations already in --out-dir/frontier.json (rewritten after every "
                         "configuration) and measure the rest; refused if it was written with other settings "
                         "(checkpoint, length, dtype, ...). Without --resume it is replaced when the first "
                         "configuration finishes")
    return ap


def main(argv=None) -> int:
    return run_cli(run, parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
