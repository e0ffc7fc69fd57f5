"""RocketKV's efficiency experiment (paper 4.3 / Figure 5): decode speedup and decode peak memory saving over `full`.

    python scripts/bench_figure.py [--contexts 2048,4096,8000] [--budgets 256,512,1024] [--compile]

Per context, `full` and `rocketkv` at each token budget, each in a fresh process, one-shot prefill of a synthetic
prompt (random ids < 1024, as the paper), then the decode phase only: N = --decode-steps (50 as the paper) tokens,
N - 1 decode steps timed as one run of engine.decode, 1 warm-up + --repeats samples (the cache is rewound to its
post-prefill state between samples), and the decode-phase peak memory. Speedup and memory saving are relative to
`full` in the same run; next to the speedup, the bandwidth-model ideal: (weights + KV bytes read per step) of full
over rocketkv's (t token-equivalents). Writes --out-dir/rocketkv_figure.{json,png}. BUDGETKV_ATTENTION=sdpa runs
every configuration with masked SDPA over the whole static buffer (gpt-fast's decode attention: the paper's
baseline).
"""
import dataclasses
import json
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from errors import check_python  # noqa: E402

check_python()  # one line, not a traceback, in a Python without the requirements
import torch  # noqa: E402

import policies  # noqa: E402
from cli import run_cli  # noqa: E402
from files import check_writable  # noqa: E402
from config import parse_config  # noqa: E402
from engine import PeakMemory, decode_bytes_per_step, sync  # noqa: E402
from errors import UserError  # noqa: E402
from sampling import first_tokens  # noqa: E402
from scripts.benchlib import (bench_model, bench_run, bench_settings, bench_source, check_common,  # noqa: E402
                              int_list, noise_note, parser as common_parser, previous, run_one, save, start,
                              weights_label)
from scripts.outputs import save_png  # noqa: E402


def paper_peak_memory(T: int, N: int, t: int, n_params: int = 8_030_261_248, L: int = 32, Hkv: int = 8, D: int = 128,
                      elt: int = 2, max_ctx: int = 131072, mask: bool = True, alpha="0.5") -> tuple[int, int]:
    """RocketKV's decode-phase peak memory model (from the paper's section 4.3) of its gpt-fast harness, in bytes,
    (dense, RocketKV): weights + the S_max^2 bool causal mask (gpt-fast allocates it for both; `mask=False` drops
    it) + K/V slots (S_max dense, C RocketKV) + page min/max (2D x Np per KV head; K^T when p = 1) + freqs_cis
    (max_ctx x D). S_max = T + N rounded up to a multiple of 8 as gpt-fast does. Defaults: Llama-3.1-8B in bf16."""
    from policies import rocket_params
    S = -(-(T + N) // 8) * 8
    fixed = n_params * elt + (S * S if mask else 0) + max_ctx * D * elt
    per_slot = L * Hkv * D * 2 * elt
    rp = rocket_params(S, t, D, N, alpha)
    aux = (rp.Np * 2 * D if rp.p >= 2 else rp.C * D) * L * Hkv * elt if rp.sparse else 0
    return fixed + S * per_slot, fixed + rp.C * per_slot + aux


def rewind(model, n0: list[int]) -> None:
    """Back to the state right after prefill: slots past each layer's post-prefill count n0 emptied (`full` and the
    policies that append after a one-shot compression fill slots in order), a selector's decode-time state rebuilt
    (RocketKV's pages)."""
    for layer, n in zip(model.layers, n0):
        c = layer.attention.kv_cache
        c.pos[:, :, n:] = -1
        if c.selector is not None:
            c.selector.prepare(c.view(c.spec.budget))


def figure_one(model, label: str, T: int, args) -> dict:
    """One configuration of the figure ("full" or "rocketkv-<t>") at prompt length T, in this process."""
    N = args.decode_steps
    vocab = min(1024, model.args.vocab_size)  # the paper's ids < 1024 (fewer in a tiny test vocabulary)
    ids = torch.randint(0, vocab, (T,), generator=torch.Generator().manual_seed(0)).tolist()
    policy = budget = None  # full holds every token
    if label != "full":  # the paper's token budget t: storage C from its even split, t tokens read per step
        t = int(label.split("-")[1])
        policy = policies.RocketKV(read=t)
        budget = policies.rocket_params(T + N, t, model.args.head_dim, N).C
    # one configuration per process: its own graph
    gen = bench_run(args, model, policy, T, budget, ids[0], "one-shot", new_tokens=N)
    budget = gen.slots
    mem = PeakMemory(args.device)
    with torch.inference_mode():
        t = time.perf_counter()
        first, _ = first_tokens(gen.prefill(model, [ids]))  # waits for the device
        prefill_s = time.perf_counter() - t
        n0 = [int(layer.attention.kv_cache.n_valid().max()) for layer in model.layers]
        times, peaks = [], []
        for r in range(1 + args.repeats):  # sample 0 is the warm-up (and the compile)
            rewind(model, n0)
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
            mem.reset()
            sync(args.device)
            t = time.perf_counter()
            gen.decode(model, first, [[int(first)]], [T])  # N - 1 steps; each waits for its token
            times.append(time.perf_counter() - t)
            peaks.append(mem.peak())
            torch._dynamo.config.error_on_recompile = True  # a recompile inside the timed samples would be a bug
    weights_b, kv_read_b = decode_bytes_per_step(model)
    c = model.layers[0].attention.kv_cache
    cache_b = sum(t.nbytes for l in model.layers for t in l.attention.kv_cache.buffers())
    return {"label": label, "T": T, "N": N, "cache_slots": budget, "prefill_s": prefill_s,
            "warmup_s": gen.compile_s + times[0], "decode_s": statistics.median(times[1:]),
            "decode_step_ms": 1e3 * statistics.median(times[1:]) / (N - 1),
            "decode_peak_mib": max(peaks[1:]) / 2**20, "weights_mib": weights_b / 2**20,
            "cache_mib": cache_b / 2**20, "bytes_per_step": weights_b + kv_read_b,
            "params": dataclasses.asdict(c.policy.rp) if policy is not None else None}


def run_figure(args) -> None:
    contexts, budgets = int_list(args.contexts, "--contexts"), int_list(args.budgets, "--budgets")
    ckpt, config = bench_source(args)
    ctx = parse_config(config).max_seq_len
    if args.block_size > ctx:
        raise UserError(f"--block-size {args.block_size} is larger than the model's context ({ctx})")
    if max(contexts) + args.decode_steps > ctx:
        raise UserError(f"--contexts {max(contexts)} + --decode-steps {args.decode_steps} exceed the model's context "
                        f"({ctx})")
    out = args.out_dir / "rocketkv_figure"
    settings = bench_settings(args, ckpt, "figure")
    old = {(x["label"], x["T"]): x for x in previous(out.with_suffix(".json"), settings, args, "rows", list,
                                                     FIGURE_FIELDS)}
    print(f"{args.checkpoint}: RocketKV figure, contexts {contexts}, budgets {budgets}, N = {args.decode_steps}, "
          f"1 warm-up + {args.repeats} samples, "
          f"{weights_label(args, config)} on {args.device}, {'compiled' if args.compile else 'eager'}, "
          f"torch threads {torch.get_num_threads()}", file=sys.stderr)
    rows = []
    for T in contexts:
        for label in ["full"] + [f"rocketkv-{t}" for t in budgets]:
            if (label, T) in old:  # --resume: measured by an earlier run with the same settings
                rows.append(old[label, T])
                print(f"  T={T:6d} {label:14s} (from {out}.json)", file=sys.stderr)
                continue
            rows.append(run_one(__file__, ["--one", f"{label}@{T}"], f"{label} at {T}"))
            x = rows[-1]
            print(f"  T={T:6d} {label:14s} decode {x['decode_step_ms']:7.2f} ms/step  peak {x['decode_peak_mib']:6.0f}"
                  f" MiB  [prefill {x['prefill_s']:.0f} s, warm-up {x['warmup_s']:.0f} s]", file=sys.stderr)
            add_ratios(rows)  # JSON and plot after every configuration: a stopped run keeps what it measured
            save(out.with_suffix(".json"), args, settings, rows=rows)
            plot_figure(rows, budgets, out.with_suffix(".png"))
    add_ratios(rows)
    save(out.with_suffix(".json"), args, settings, rows=rows)  # with the kept rows after the last one measured
    plot_figure(rows, budgets, out.with_suffix(".png"))
    print("\n| context | policy | cache slots | decode ms/step | speedup vs full | ideal (bandwidth model) | "
          "of ideal | decode peak MiB | peak saving | weights+cache saving |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for x in sorted(rows, key=lambda x: x["T"]):
        print(f"| {x['T']} | {x['label']} | {x['cache_slots']} | {x['decode_step_ms']:.2f} | {x['speedup']:.2f}x | "
              f"{x['ideal_speedup']:.2f}x | {x['speedup'] / x['ideal_speedup']:.0%} | {x['decode_peak_mib']:.0f} | "
              f"{x['peak_saving']:.1%} | {x['tensor_saving']:.1%} |")
    noise_note(args.repeats)
    print(f"\nwrote {out}.json and {out}.png", file=sys.stderr)


def add_ratios(rows) -> None:
    """Speedup, bandwidth-model ideal and memory savings of each row against `full` at the same context."""
    full = {x["T"]: x for x in rows if x["label"] == "full"}
    for x in rows:
        f = full[x["T"]]
        x["speedup"] = f["decode_step_ms"] / x["decode_step_ms"]
        x["ideal_speedup"] = f["bytes_per_step"] / x["bytes_per_step"]
        x["peak_saving"] = 1 - x["decode_peak_mib"] / f["decode_peak_mib"]
        x["tensor_saving"] = 1 - (x["weights_mib"] + x["cache_mib"]) / (f["weights_mib"] + f["cache_mib"])


def plot_figure(rows, budgets, path) -> None:
    """Like the paper's Figure 5: decode speedup (measured; bandwidth-model ideal dashed) and peak-memory saving
    against context length, one line per token budget, both relative to full."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    contexts = sorted({x["T"] for x in rows})
    for t in budgets:
        xs = sorted((x for x in rows if x["label"] == f"rocketkv-{t}"), key=lambda x: x["T"])
        if not xs:
            continue
        ts = [x["T"] for x in xs]
        line, = a.plot(ts, [x["speedup"] for x in xs], "o-", label=f"t={t}")
        a.plot(ts, [x["ideal_speedup"] for x in xs], "--", color=line.get_color(), alpha=0.6)
        b.plot(ts, [100 * x["peak_saving"] for x in xs], "o-", label=f"t={t}")
    a.set(xlabel="context (tokens)", ylabel="decode speedup vs full (x)", title="end-to-end decode speedup")
    b.set(xlabel="context (tokens)", ylabel="decode peak memory saving (%)", title="peak memory saving")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [f"{c // 1024}K" for c in contexts])
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    a.axhline(1, color="grey", lw=0.8)
    fig.suptitle("RocketKV vs full (dashed: bandwidth-model ideal)")
    fig.tight_layout()
    save_png(fig, path, dpi=120)
    plt.close(fig)


# what a resumed row must hold (the table and the ratios use them): str, int or any number
FIGURE_FIELDS = {"label": str, "T": int, "cache_slots": float, "decode_step_ms": float, "decode_peak_mib": float,
                 "bytes_per_step": float, "weights_mib": float, "cache_mib": float}


def parser():
    ap = common_parser(__doc__, decode_steps=50, steps_help="N, the tokens generated per sample (the paper's 50)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="the weights' and the KV cache's dtype")
    ap.add_argument("--contexts", default="2048,4096,8000",
                    help="prompt lengths (default 2048,4096,8000: the default checkpoint's context is 8K; the paper's "
                         "are 16K-64K, which a longer-context checkpoint or --random-weights shapes reach)")
    ap.add_argument("--budgets", default="256,512,1024", help="RocketKV token budgets")
    ap.add_argument("--out-dir", type=Path, default=REPO / "build", help="where the JSON and PNG go")
    ap.add_argument("--resume", action="store_true",
                    help="skip the configurations already measured in --out-dir's rocketkv_figure.json, which is "
                         "rewritten whole after every configuration; refused if it was written with other settings "
                         "(checkpoint, sizes, threads, compile, ...). Without --resume the output is replaced when the "
                         "first configuration finishes")
    return ap


def check_args(args) -> None:
    """Bad input fails here, before any model is loaded or any configuration has run."""
    check_common(args)
    int_list(args.contexts, "--contexts")
    int_list(args.budgets, "--budgets")
    try:
        args.out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out-dir {args.out_dir}: {e.strerror}") from None
    check_writable(args.out_dir / "rocketkv_figure.json", "--out-dir")
    if args.one and not re.fullmatch(r"(full|rocketkv-[1-9]\d*)@[1-9]\d*", args.one):
        raise UserError(f"--one {args.one!r}: full@T or rocketkv-t@T")


def run(args) -> None:
    check_args(args)
    start(args)
    if not args.one:
        return run_figure(args)
    label, T = args.one.split("@")
    ckpt, config = bench_source(args)
    T = int(T)  # full holds the prompt and the new tokens; RocketKV less, after one layer's scratch of the prompt
    model = bench_model(args, ckpt, config, T + args.decode_steps + args.block_size)
    t = time.perf_counter()
    r = figure_one(model, label, T, args)
    r["wall_s"] = time.perf_counter() - t
    print(json.dumps(r))


def main():
    return run_cli(run, parser().parse_args())


if __name__ == "__main__":
    sys.exit(main())
