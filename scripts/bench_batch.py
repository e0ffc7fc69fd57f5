"""Throughput at a memory cap: for `full` and each policy, decode tok/s (B / median step) and the decode peak memory
at batch 1, 2, 4, ... until the next batch's estimate (weights + B rows of every layer's whole cache, decided before
allocating) exceeds --memory-cap MiB; the largest batch under the cap; beside it the bandwidth model (weights read
once per step, K/V once per sequence) and a roofline (those reads, or the step's FLOPs at the machine's measured
matrix-product rate, whichever takes longer). Each row a copy of one prefilled sequence: one batch-1 prefill per
policy (its own process), its cache state copied into every row of each batch's process.

    python scripts/bench_batch.py --prompt-tokens 8176 --budget 512 --memory-cap 4096 [--policies keydiff,snapkv]
                                  [--batch-sizes 1,2,4,...] [--plot docs/batch_throughput.png] [--compile]
"""
import argparse
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from errors import check_python  # noqa: E402

check_python()  # one line, not a traceback, in a Python without the requirements
import torch  # noqa: E402

import policies  # noqa: E402
from cache import is_scorer  # noqa: E402
from cli import run_cli  # noqa: E402
from files import check_writable  # noqa: E402
from config import parse_config  # noqa: E402
from engine import PeakMemory, decode_bytes_per_step, prefill_protocol, sync  # noqa: E402
from errors import EnvironmentFailure, UserError  # noqa: E402
from config import weight_count  # noqa: E402
from loading import kv_cache_estimate  # noqa: E402
from scripts.benchlib import (bench_model, bench_run, bench_settings, bench_source, check_common,  # noqa: E402
                              check_policy_flags, check_sizes, config_policy, gemm_gflop_s, int_list, make_document,
                              parser as common_parser, policy_flags, random_prompt, read_bandwidth_gb_s, run_one,
                              save, start, weights_label)
from scripts.outputs import save_png  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402


def parser():
    ap = common_parser(__doc__)
    policy_flags(ap, "keydiff,snapkv")  # full is always measured beside them
    ap.add_argument("--memory-cap", type=float, default=4096,
                    help="MiB for the weights and the whole KV cache (with positions and policy state); a batch whose "
                         "estimate exceeds it is not run (default 4096)")
    ap.add_argument("--batch-sizes", help="comma-separated batch sizes instead of 1, 2, 4, 8, ...")
    ap.add_argument("--plot", type=Path, help="write the tok/s-vs-batch plot (PNG) here")
    ap.add_argument("--json", type=Path, help="also write the rows and the summary here")
    ap.add_argument("--one-prefill", help=argparse.SUPPRESS)  # internal: "label@state-file"
    return ap


def check_args(args) -> None:
    """Bad input fails here, before any model is loaded or any configuration has run."""
    check_common(args)
    check_policy_flags(args)
    if not 0 < args.memory_cap < math.inf:
        raise UserError(f"--memory-cap must be a finite number of MiB > 0, got {args.memory_cap:g}")
    if args.batch_sizes is not None and max(int_list(args.batch_sizes, "--batch-sizes")) > MAX_BATCH:
        raise UserError(f"--batch-sizes must be at most {MAX_BATCH}, got {args.batch_sizes}")
    if args.plot is not None:
        check_writable(args.plot, "--plot")


def internal(value: str, flag: str, form: str) -> tuple:
    """The parts of an internal flag's value (what run_batch passes its own children); UserError otherwise."""
    m = re.fullmatch(form, value)
    if m is None:
        raise UserError(f"{flag} {value!r}: a flag this script passes its own runs (label@B@state-file), not one to "
                        "give")
    return m.groups()


def run(args) -> None:
    check_args(args)
    start(args)
    if args.one_prefill:
        label, path = internal(args.one_prefill, "--one-prefill", r"([^@]+)@(.+)")
        print(json.dumps(batch_prefill_one(label, Path(path), args)))
    elif args.one:
        label, B, path = internal(args.one, "--one", r"([^@]+)@([0-9]+)@(.+)")
        print(json.dumps(batch_one(label, int(B), Path(path), args)))
    else:
        run_batch(args)


def batch_budget(label: str, L: int, args) -> tuple:
    """(policy, cache budget, prefill protocol) of a --batch configuration at prompt length L: full holds the prompt
    and every decoded token (the first token + --decode-steps steps)."""
    policy = config_policy(label)
    budget = args.budget if is_scorer(policy) else L + args.decode_steps + 1
    return policy, budget, prefill_protocol(policy, None)


def batch_run(model, label: str, L: int, B: int, first: int, args):
    """The run of B rows for `label` at prompt length L (benchlib.bench_run: set up, and compiled and warmed up on
    `first` with --compile)."""
    policy, budget, protocol = batch_budget(label, L, args)
    return bench_run(args, model, policy, L, budget, first, protocol, batch=B)


def cache_state(model) -> list[dict]:
    """Every buffer of every layer's cache (K, V, positions, int8 scales, per-slot and per-layer policy state: all
    batch-first), by name: what copy_rows puts into each row of a batch."""
    return [dict(layer.attention.kv_cache._buffers) for layer in model.layers]


def copy_rows(model, state: list[dict]) -> None:
    """Each row of the model's batch caches := the batch-1 cache state `state` (cache_state of a prefilled
    sequence): every buffer of every layer, so that each row decodes exactly as that sequence would alone."""
    for layer, src in zip(model.layers, state, strict=True):
        bufs = layer.attention.kv_cache._buffers
        if set(bufs) != set(src):
            raise ValueError(f"cache buffers differ: {sorted(bufs)} vs {sorted(src)}")
        for name, t in bufs.items():
            s = src[name]
            if s.shape[0] != 1 or s.shape[1:] != t.shape[1:] or s.dtype != t.dtype:
                raise ValueError(f"cache buffer {name}: {tuple(s.shape)} {s.dtype} is not one row of "
                                 f"{tuple(t.shape)} {t.dtype}")
            t.copy_(s.expand_as(t))


def decode_rows(model, gen, first: int, L: int, B: int) -> tuple[list, list]:
    """The run's greedy decode steps (Generation.decode) of a batch of B rows whose caches hold an L-token prompt
    and whose first token is `first`, each row at its own positions; (seconds per step, each row's tokens: first +
    one per step)."""
    toks, times = [[first] for _ in range(B)], []
    gen.decode(model, torch.full((B,), first, dtype=torch.long, device=gen.device), toks, [L] * B,
               on_step=lambda logits, s: times.append(s))
    return times, toks


def batch_prefill_one(label: str, path: Path, args) -> dict:
    """One process per (policy, context): prefill ONE sequence (batch 1, eager, the policy's protocol) and
    save its cache state and first token to `path` for every batch size's process to copy into its rows."""
    ckpt, config = bench_source(args)
    ids = batch_ids(ckpt, config, args)
    L = len(ids)
    _, budget, protocol = batch_budget(label, L, args)
    model = bench_model(args, ckpt, config, budget + args.block_size)
    eager = argparse.Namespace(**{**vars(args), "compile": False})  # the prefill is eager, whatever decode is
    gen = batch_run(model, label, L, 1, ids[0], eager)
    slots = gen.slots
    with torch.inference_mode():
        t = time.perf_counter()
        logits = gen.prefill(model, [ids])
        first = int(logits.argmax(-1).view(-1)[0])
        sync(args.device)
        prefill_s = time.perf_counter() - t
    state = cache_state(model)
    torch.save({"first": first, "L": L, "state": state}, path)
    return {"label": label, "L": L, "protocol": protocol, "slots": slots, "prefill_s": prefill_s,
            "row_bytes": sum(t.nbytes for layer in state for t in layer.values()),
            "kv_row_bytes": kv_cache_estimate(model.args, slots + args.block_size, model.tok_embeddings.weight.dtype),
            "weights_bytes": decode_bytes_per_step(model)[0]}


def linears(model) -> list[torch.nn.Module]:
    """The model's weight products (every Linear, the output head included)."""
    return [m for m in model.modules() if hasattr(m, "in_features") and hasattr(m, "out_features")]


def step_flops(model, B: int) -> float:
    """FLOPs of one decode step of B sequences: 2 per weight per sequence (the products) plus attention's q.k and
    p.v, 4 x head_dim per query head per slot attended."""
    products = sum(m.in_features * m.out_features for m in linears(model))
    a = model.args
    attention = sum(4 * a.n_heads * a.head_dim * layer.attention.kv_cache.read_tokens() for layer in model.layers)
    return B * (2 * products + attention)


def products_ms(model, B: int, device: str) -> float:
    """Milliseconds of one step's weight products alone at B rows, eager (each Linear on random rows; median of 3
    passes): the matrix-product part of a step, the attention and the policy left out."""
    act = model.tok_embeddings.weight.dtype  # the activations' dtype (a quantized Linear's weight is int8)
    xs = [(m, torch.randn(B, 1, m.in_features, device=device, dtype=act)) for m in linears(model)]

    def once() -> float:
        sync(device)
        t = time.perf_counter()
        for m, x in xs:
            m(x)
        sync(device)
        return time.perf_counter() - t
    once()
    return 1e3 * statistics.median(once() for _ in range(3))


def batch_one(label: str, B: int, path: Path, args) -> dict:
    """One process per (policy, batch size): B rows each a copy of the prefilled sequence at `path`, then
    --decode-steps greedy decode steps (the first a warm-up, with --compile the compile), timed per step; the
    decode-phase peak memory; each row's greedy tokens (all rows must agree)."""
    ckpt, config = bench_source(args)
    saved = torch.load(path, map_location=args.device, weights_only=True)
    _, budget, _ = batch_budget(label, saved["L"], args)
    model = bench_model(args, ckpt, config, B * (budget + args.block_size))
    first, L = saved["first"], saved["L"]
    gen = batch_run(model, label, L, B, first, args)  # with --compile: compiled and warmed up here
    slots = gen.slots
    mem = PeakMemory(args.device)
    with torch.inference_mode():
        copy_rows(model, saved["state"])
        del saved
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        mem.reset()
        times, toks = decode_rows(model, gen, first, L, B)
        peak = mem.peak()
        products = products_ms(model, B, args.device)
    weights_b, kv_b = decode_bytes_per_step(model)  # kv_b: the whole batch's K and V read per step
    step = statistics.median(times[1:])
    return {"label": label, "batch": B, "slots": slots, "decode_step_ms": 1e3 * step, "decode_tok_s": B / step,
            "warmup_s": gen.compile_s, "decode_peak_mib": peak / 2**20, "memory_measure": mem.measure,
            "weights_bytes": weights_b, "kv_bytes_per_seq": kv_b / B, "flops": step_flops(model, B),
            "products_ms": products,
            "rows_identical": all(row == toks[0] for row in toks), "tokens": toks[0]}


def batch_ids(ckpt, config: dict, args) -> list[int]:
    return random_prompt(config, args.prompt_tokens) if args.random_weights else \
        make_document(load_tokenizer(ckpt), args.prompt_tokens)[1]


MAX_BATCH = 2**20


def batch_sizes(args):
    """--batch-sizes in increasing order, or 1, 2, 4, 8, ... (the cap ends them)."""
    if args.batch_sizes:
        yield from sorted(int_list(args.batch_sizes, "--batch-sizes"))
        return
    B = 1
    while B <= MAX_BATCH:
        yield B
        B *= 2


def run_batch(args) -> None:
    """Decode throughput and peak memory as the batch grows, per policy, until --memory-cap; the largest
    batch each fits; the bandwidth model beside it."""
    names = policies.spec_list(args.policies)
    labels = ["full"] + [n for n in names if n != "full"]
    for n in labels:
        config_policy(n)
    ckpt, config = bench_source(args)
    check_sizes(config, args)
    dtype = getattr(torch, args.dtype)
    weights_b = weight_count(parse_config(config)) * dtype.itemsize
    cap = args.memory_cap * 2**20
    if weights_b > cap:
        raise UserError(f"--memory-cap {args.memory_cap:g} MiB is below the weights alone "
                        f"({weights_b / 2**20:.0f} MiB in {args.dtype}): nothing fits")
    smallest = min(batch_sizes(args))
    kv1 = {n: kv_cache_estimate(parse_config(config), batch_budget(n, args.prompt_tokens, args)[1] + args.block_size,
                                dtype) for n in labels}
    if all(weights_b + smallest * kv > cap for kv in kv1.values()):
        raise UserError(f"--memory-cap {args.memory_cap:g} MiB holds no batch of {smallest} (weights and whole cache "
                        f"need at least {(weights_b + smallest * min(kv1.values())) / 2**20:.0f} MiB): nothing fits")
    settings = bench_settings(args, ckpt, "batch")
    print(f"{args.checkpoint}: throughput at a memory cap, prompt {args.prompt_tokens} tokens, budget {args.budget}, block "
          f"{args.block_size}, memory cap {args.memory_cap:g} MiB (weights + whole cache, decided before allocating), "
          f"{args.decode_steps} decode steps (the first a warm-up), {weights_label(args, config)} on {args.device}, "
          f"{'compiled' if args.compile else 'eager'}, torch threads {torch.get_num_threads()}; each row a copy of "
          f"one prefilled sequence", file=sys.stderr)
    load = [os.getloadavg()[0]]  # the machine's 1-minute load at the start and the end (shared: say how busy)
    bw = read_bandwidth_gb_s(args.device)
    peak_gflop_s = gemm_gflop_s(args.device, dtype)
    rows, prefills = [], {}
    work = Path(tempfile.mkdtemp(prefix="budgetkv-bench-batch-"))
    try:
        for label in labels:
            path = work / "state.pt"
            pre = None
            for B in batch_sizes(args):
                row = {"label": label, "batch": B}
                if pre is not None:
                    est = pre["weights_bytes"] + B * pre["row_bytes"]
                    row["estimate_mib"] = est / 2**20
                    if est > cap:  # decided before allocating: this batch is not run
                        rows.append(row | {"fits": False, "measured": False})
                        print(f"  {label:10s} B={B:5d} estimate {est / 2**20:7.0f} MiB > cap: stop", file=sys.stderr)
                        break
                else:  # one prefilled sequence per (policy, context), in its own process
                    if weights_b + B * kv1[label] > cap:
                        rows.append(row | {"fits": False, "measured": False,
                                           "estimate_mib": (weights_b + B * kv1[label]) / 2**20})
                        print(f"  {label:10s} B={B:5d} over the cap before any prefill: stop", file=sys.stderr)
                        break
                    pre = prefills[label] = run_one(__file__, ["--one-prefill", f"{label}@{path}"], f"{label} prefill")
                    print(f"  {label:10s} prefill of one {pre['L']}-token sequence ({pre['protocol']}) "
                          f"{pre['prefill_s']:.0f} s; cache {pre['row_bytes'] / 2**20:.1f} MiB per row",
                          file=sys.stderr)
                    est = pre["weights_bytes"] + B * pre["row_bytes"]
                    row["estimate_mib"] = est / 2**20
                    if est > cap:
                        rows.append(row | {"fits": False, "measured": False})
                        break
                x = run_one(__file__, ["--one", f"{label}@{B}@{path}"], f"{label} at batch {B}")
                x.pop("label")
                read_s = (x["weights_bytes"] + B * x["kv_bytes_per_seq"]) / (bw * 1e9)
                ideal, roofline = B / read_s, B / max(read_s, x["flops"] / (peak_gflop_s * 1e9))
                row |= x | {"fits": True, "measured": True, "ideal_tok_s": ideal, "roofline_tok_s": roofline,
                            "of_ideal": x["decode_tok_s"] / ideal, "of_roofline": x["decode_tok_s"] / roofline,
                            "peak_over_cap": x["decode_peak_mib"] > args.memory_cap}
                rows.append(row)
                print(f"  {label:10s} B={B:5d} decode {x['decode_tok_s']:8.1f} tok/s ({x['decode_step_ms']:.1f} "
                      f"ms/step)  ideal {ideal:8.1f}  estimate {row['estimate_mib']:6.0f} MiB  peak "
                      f"{x['decode_peak_mib']:6.0f} MiB{'' if x['rows_identical'] else '  ROWS DIFFER'}",
                      file=sys.stderr)
                if not x["rows_identical"]:
                    raise EnvironmentFailure(f"{label} at batch {B}: the copied rows decoded different tokens")
                if args.json:
                    save(args.json, args, settings, read_gb_s=bw, gemm_gflop_s=peak_gflop_s, memory_cap_mib=args.memory_cap, rows=rows,
                         summary=batch_summary(rows, labels))
            path.unlink(missing_ok=True)
    finally:
        for f in work.iterdir():
            f.unlink()
        work.rmdir()
    summary = batch_summary(rows, labels)
    load.append(os.getloadavg()[0])
    if args.json:
        save(args.json, args, settings, read_gb_s=bw, gemm_gflop_s=peak_gflop_s, memory_cap_mib=args.memory_cap, rows=rows, summary=summary,
             load_average=load)
    print(f"\nload average (1 min) {load[0]:.2f} at the start, {load[1]:.2f} at the end; "
          f"measured read bandwidth {bw:.1f} GB/s, matrix products {peak_gflop_s:.0f} GFLOP/s (2048 x 2048); "
          f"memory cap {args.memory_cap:g} MiB; each row a copy of one prefilled sequence ({args.prompt_tokens} "
          f"tokens); ideal tok/s (the bandwidth model) = B / ((weights + B x KV per sequence) / bandwidth); roofline "
          f"tok/s = B / max(those reads, the step's FLOPs / the product rate); products: the step's weight products "
          f"alone, eager; peak: {next((x['memory_measure'] for x in rows if x.get('measured')), '?')} during "
          f"decode\n")
    print("| policy | batch | cache slots / seq | estimate MiB (weights + cache) | fits cap | decode tok/s | "
          "ms / step | products ms | ideal tok/s | of ideal | roofline tok/s | of roofline | decode peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for x in rows:
        if x.get("measured"):
            print(f"| {x['label']} | {x['batch']} | {x['slots']} | {x['estimate_mib']:.0f} | yes | "
                  f"{x['decode_tok_s']:.1f} | {x['decode_step_ms']:.1f} | {x['products_ms']:.1f} | "
                  f"{x['ideal_tok_s']:.1f} | {x['of_ideal']:.0%} | {x['roofline_tok_s']:.1f} | "
                  f"{x['of_roofline']:.0%} | {x['decode_peak_mib']:.0f}"
                  f"{' (over cap)' if x['peak_over_cap'] else ''} |")
        else:
            print(f"| {x['label']} | {x['batch']} | | {x['estimate_mib']:.0f} | no (not run) | | | | | | | | |")
    print("\n| policy | largest batch under the cap | decode tok/s there | vs full | bandwidth-model ratio | "
          "of the model's ratio | roofline ratio | of the roofline's ratio | ms/step for 85% of the model's ratio | "
          "products alone ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, s in summary.items():
        if s["batch"] is None:
            print(f"| {label} | none | | | | | | | | |")
            continue
        print(f"| {label} | {s['batch']} | {s['decode_tok_s']:.1f} | "
              + (f"{s['vs_full']:.2f}x | {s['ideal_vs_full']:.2f}x | {s['of_ideal_ratio']:.0%} | "
                 f"{s['roofline_vs_full']:.2f}x | {s['of_roofline_ratio']:.0%} | {s['ms_for_85']:.1f} | "
                 f"{s['products_ms']:.1f} |" if s.get("vs_full") is not None else "| | | | | | | |"))
    if args.plot:
        plot_batch(rows, summary, args.plot, args, load)
        print(f"\nwrote {args.plot}", file=sys.stderr)


def batch_summary(rows: list[dict], labels: list[str]) -> dict:
    """Per policy: its largest batch under the cap, tok/s there, and against full's at full's largest: measured, the
    bandwidth model's and the roofline's ratio (ideal tok/s at each one's largest batch), and the step time the
    policy would need for 85% of the bandwidth model's ratio beside its weight products' own time."""
    out = {}
    for label in labels:
        fit = [x for x in rows if x["label"] == label and x.get("measured")]
        best = max(fit, key=lambda x: x["batch"]) if fit else None
        keys = ("batch", "decode_tok_s", "ideal_tok_s", "roofline_tok_s", "products_ms")
        out[label] = {k: best[k] if best else None for k in keys}
    f = out.get("full")
    for label, s in out.items():
        if f and f["batch"] is not None and s["batch"] is not None:
            s["vs_full"] = s["decode_tok_s"] / f["decode_tok_s"]
            s["ideal_vs_full"] = s["ideal_tok_s"] / f["ideal_tok_s"]
            s["of_ideal_ratio"] = s["vs_full"] / s["ideal_vs_full"]
            s["roofline_vs_full"] = s["roofline_tok_s"] / f["roofline_tok_s"]
            s["of_roofline_ratio"] = s["vs_full"] / s["roofline_vs_full"]
            # the step time at which this policy's ratio to full (as measured) would be 85% of the model's
            s["ms_for_85"] = 1e3 * s["batch"] / (0.85 * s["ideal_vs_full"] * f["decode_tok_s"])
    return out


def plot_batch(rows: list[dict], summary: dict, path: Path, args, load: list[float]) -> None:
    """Decode tok/s against batch size per policy (dashed: the bandwidth model), the cap's largest batch starred."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    for label, s in summary.items():
        xs = sorted((x for x in rows if x["label"] == label and x.get("measured")), key=lambda x: x["batch"])
        if not xs:
            continue
        bs = [x["batch"] for x in xs]
        line, = ax.plot(bs, [x["decode_tok_s"] for x in xs], "o-", label=label)
        ax.plot(bs, [x["ideal_tok_s"] for x in xs], "--", color=line.get_color(), alpha=0.5)
        ax.plot(bs, [x["roofline_tok_s"] for x in xs], ":", color=line.get_color(), alpha=0.8)
        ax.plot([s["batch"]], [s["decode_tok_s"]], "*", ms=16, color=line.get_color())
        ax.annotate(f"B={s['batch']}", (s["batch"], s["decode_tok_s"]), textcoords="offset points", xytext=(6, -12))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set(xlabel="batch size (sequences)", ylabel="decode tokens/s (all sequences)",
           title=f"{args.checkpoint} {args.dtype}, {args.prompt_tokens}-token context, budget {args.budget}, "
                 f"cap {args.memory_cap:g} MiB, load average {load[0]:.1f} -> {load[1]:.1f}")
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(title="star: largest batch under the cap\ndashed: bandwidth model\ndotted: roofline (+ FLOPs)",
              title_fontsize=7, fontsize=8,
              loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    save_png(fig, path, dpi=120)
    plt.close(fig)


def main():
    return run_cli(run, parser().parse_args())


if __name__ == "__main__":
    sys.exit(main())
