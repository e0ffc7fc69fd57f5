"""Benchmark: per policy, block-wise prefill throughput and decode step time, as ratios measured in the same run.

    python scripts/bench.py --checkpoint smollm2-135m --prompt-tokens 4096 --budget 512 [--compile] [--kvpress]
                            [--llamacpp]

Baselines, all in the same process and run:
- `no-evict`: the same budget + block buffer and the same writes and attention, with eviction switched off. A
  policy's overhead is its step time over this one (scoring + hole filling, nothing else).
- `full`: no eviction, buffer = prompt + new tokens (what every speedup in the papers is relative to).
- `--kvpress`: the same prompt ids, policy and budget through HF transformers + kvpress (one-shot press after the
  prefill, as kvpress does), run in .venv-kv (kvpress needs transformers < 5.3); decode tok/s and peak memory.
- `--llamacpp`: llama.cpp (llama-cpp-python, scripts/bench_llamacpp.py in .venv-llamacpp: `bash scripts/setup.sh
  llamacpp`) on the GGUF the checkpoint was converted from (smollm2-135m: the embedded Q4_1), as shipped (llama.cpp's
  defaults: KV cache f16) and dequantized to F32 (KV cache f32, made once under build/), each with flash attention
  on and off, with the same prompt ids, threads, decode steps and repeats, greedy: TTFT, prefill and decode tok/s,
  peak memory, whether its greedy tokens are `full`'s, and each budgetkv configuration against llama.cpp's best
  setting for each measure. Strict: without .venv-llamacpp the run stops before it starts (one line, exit 1).
Timings are medians over --repeats; prefill = the whole block-wise prompt, TTFT = prefill + the first token's
argmax (the same time: the prefill's last logits give the first token); decode = median per-step time.
Memory: process peak RSS (VmHWM, reset at the start of each phase) on CPU, max_memory_allocated on CUDA.

    python scripts/bench.py --figure rocketkv [--contexts 4096,8192,16384] [--budgets 256,512,1024] [--compile]

`--figure rocketkv` is RocketKV's efficiency experiment (paper 4.3 / Figure 5): per context, `full` and
`rocketkv` at each token budget, each in a fresh process, one-shot prefill of a synthetic prompt (random ids < 1024,
as the paper), then the decode phase only: N = --decode-steps (50 as the paper) tokens, N - 1 decode steps timed as
one loop, 1 warm-up + --repeats samples (the cache is rewound to its post-prefill state between samples), and the
decode-phase peak memory. Speedup and memory saving are relative to `full` in the same run; next to the speedup,
the bandwidth-model ideal: (weights + KV bytes read per step) of full over rocketkv's (t token-equivalents).
Writes --out-dir/rocketkv_figure.{json,png}.

Throughput at a memory cap is measured by scripts/bench_batch.py, a policy's overhead in alternating steps by
scripts/bench_paired.py, quantized weights by scripts/bench_quant.py, self-speculative decoding by scripts/bench_speculate.py.
"""
import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
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
from cache import KV_DTYPES, is_scorer  # noqa: E402
from checkpoint import shape_config  # noqa: E402
from cli import Parser, check_writable, run_cli  # noqa: E402
from engine import PeakMemory, decode_bytes_per_step, prefill_one_shot, prefill_protocol, setup, sync  # noqa: E402
from errors import EnvironmentFailure, UserError  # noqa: E402
from config import parse_config  # noqa: E402
from scripts.benchlib import (bench_model, bench_settings, bench_source, bench_steps, check_common,  # noqa: E402
                              check_policy_flags, check_sizes, config_policy, int_list, json_result,
                              kv_dtype, make_document, parser as common_parser, policy_flags, previous,
                              random_prompt, read_bandwidth_gb_s, run_one, save, short_weights, start, steps_label,
                              time_policy, weights_label)
from scripts.outputs import save_png, write_atomic  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402

LLAMACPP_PY = REPO / ".venv-llamacpp" / "bin" / "python"  # bench_llamacpp.py's venv (bash scripts/setup.sh llamacpp)
KVPRESS = {"keydiff": "KeyDiffPress", "snapkv": "SnapKVPress", "tova": "TOVAPress", "sink": "StreamingLLMPress",
           "keynorm": "KnormPress"}


def paper_peak_memory(T: int, N: int, t: int, n_params: int = 8_030_261_248, L: int = 32, Hkv: int = 8, D: int = 128,
                      elt: int = 2, max_ctx: int = 131072, mask: bool = True, alpha="0.5") -> tuple[int, int]:
    """RocketKV's decode-phase peak memory model (from the paper's section 4.3) of its gpt-fast harness, in bytes, (dense,
    RocketKV): weights + the S_max^2 bool causal mask (gpt-fast allocates it for both; `mask=False` drops it) + K/V
    slots (S_max dense, C RocketKV) + page min/max (2D x Np per KV head; K^T when p = 1) + freqs_cis (max_ctx x D).
    S_max = T + N rounded up to a multiple of 8 as gpt-fast does. Defaults: Llama-3.1-8B in bf16."""
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
    """One configuration of --figure rocketkv ("full" or "rocketkv-<t>") at prompt length T, in this process."""
    N = args.decode_steps
    vocab = min(1024, model.args.vocab_size)  # the paper's ids < 1024 (fewer in a tiny test vocabulary)
    ids = torch.randint(0, vocab, (T,), generator=torch.Generator().manual_seed(0)).to(args.device)
    policy = None
    if label == "full":
        budget = T + N
    else:  # the paper's token budget t: storage C from its even split, t tokens read per step
        t = int(label.split("-")[1])
        policy = policies.RocketKV(read=t)
        budget = policies.rocket_params(T + N, t, model.args.head_dim, N).C
    budget = setup(model, policy, budget, T, N, args.block_size, prefill="one-shot")
    decode_fn = bench_steps(args)[1]  # one configuration per process: its own graph
    mem = PeakMemory(args.device)
    with torch.inference_mode():
        t = time.perf_counter()
        first = prefill_one_shot(model, ids, args.block_size).argmax(-1).view(1, 1)
        sync(args.device)
        prefill_s = time.perf_counter() - t
        n0 = [int(layer.attention.kv_cache.n_valid().max()) for layer in model.layers]
        times, peaks = [], []
        for r in range(1 + args.repeats):  # sample 0 is the warm-up (and the compile)
            rewind(model, n0)
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
            mem.reset()
            tok = first
            sync(args.device)
            t = time.perf_counter()
            for i in range(N - 1):
                tok = decode_fn(model, tok, torch.tensor([T + i], device=args.device)).argmax(-1).view(1, 1)
            sync(args.device)
            times.append(time.perf_counter() - t)
            peaks.append(mem.peak())
            torch._dynamo.config.error_on_recompile = True  # a recompile inside the timed samples would be a bug
    weights_b, kv_read_b = decode_bytes_per_step(model)
    c = model.layers[0].attention.kv_cache
    cache_b = sum(t.nbytes for l in model.layers for t in l.attention.kv_cache.buffers())
    return {"label": label, "T": T, "N": N, "cache_slots": budget, "prefill_s": prefill_s,
            "warmup_s": times[0], "decode_s": statistics.median(times[1:]),
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
    print(f"{args.checkpoint}: --figure rocketkv, contexts {contexts}, budgets {budgets}, N = {args.decode_steps}, "
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
            rows.append(run_one(__file__, ["--one-figure", f"{label}@{T}"], f"{label} at {T}"))
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


# --------------------------------------------------------------------------------- HF transformers + kvpress

def run_kvpress(ckpt_dir: Path, ids: list[int], policy: str, budget: int, args) -> dict | None:
    py = REPO / ".venv-kv" / "bin" / "python"
    if not py.is_file():
        print("  (.venv-kv missing: run `bash scripts/setup.sh test`; kvpress skipped)", file=sys.stderr)
        return None
    ids_file = REPO / "build" / "bench_ids.json"
    ids_file.parent.mkdir(exist_ok=True)
    ids_file.write_text(json.dumps(ids))
    if args.random_weights:  # the same shapes, transformers' own random init: speed does not depend on the values
        model = ["--random-config", str(ids_file.with_name("bench_config.json"))]
        write_atomic(Path(model[1]), json.dumps(shape_config(args.checkpoint)[0]).encode())
    else:
        model = ["--model", str(args.hf_model)]
    cmd = [str(py), str(REPO / "scripts" / "bench_kvpress.py"), *model, "--press", KVPRESS.get(policy, "none"),
           "--budget", str(budget), "--ids-file", str(ids_file), "--decode-steps", str(args.decode_steps),
           "--repeats", str(args.repeats), "--dtype", args.dtype, "--device", args.device]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"  kvpress run failed: {(r.stderr.strip().splitlines() or ['no output'])[-1]}", file=sys.stderr)
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def parser() -> Parser:
    ap = common_parser(__doc__, decode_steps=None, steps_help="default 32; 50 (the paper's N) with --figure")
    policy_flags(ap, "keydiff,sink,tova,snapkv,h2o,keynorm,random")
    ap.add_argument("--kvpress", action="store_true", help="also run HF transformers + kvpress (in .venv-kv)")
    ap.add_argument("--hf-model", type=Path, default=REPO / "build" / "smollm2-hf",
                    help="HF-format copy of the model for kvpress (made from the GGUF if missing)")
    ap.add_argument("--llamacpp", action="store_true",
                    help="also run llama.cpp (in .venv-llamacpp: bash scripts/setup.sh llamacpp) on the GGUF the "
                         "checkpoint was converted from, as shipped and dequantized to F32, each with flash attention "
                         "on and off: TTFT, prefill and decode tok/s, peak memory, whether its greedy tokens are "
                         "full's, and budgetkv against llama.cpp's best setting for each measure")
    ap.add_argument("--json", type=Path, help="also write all results here (the table)")
    ap.add_argument("--figure", choices=["rocketkv"], help="RocketKV's efficiency experiment (paper Figure 5)")
    ap.add_argument("--contexts", default="4096,8192,16384", help="--figure: prompt lengths")
    ap.add_argument("--budgets", default="256,512,1024", help="--figure: RocketKV token budgets")
    ap.add_argument("--out-dir", type=Path, default=REPO / "build", help="--figure: where the JSON and PNG go")
    ap.add_argument("--one-figure", help=argparse.SUPPRESS)  # internal: one --figure configuration, "label@T"
    ap.add_argument("--kv-dtype", choices=list(KV_DTYPES), help="the policy table: budgetkv's KV cache stored so "
                    "(generate.py's --kv-dtype; the peers keep theirs)")
    ap.add_argument("--resume", action="store_true",
                    help="skip the configurations already measured in the output (--json; --figure: --out-dir's "
                         "rocketkv_figure.json), which is rewritten whole after every configuration; refused if it "
                         "was written with other settings (checkpoint, sizes, threads, compile, ...). Without "
                         "--resume the output is replaced when the first configuration finishes")
    return ap


def main():
    return run_cli(run, parser().parse_args())


# the flags that apply to some kinds of run only (the others refuse them)
ONLY = {"contexts": ["figure"], "budgets": ["figure"], "out_dir": ["figure"], "kvpress": ["table"],
        "hf_model": ["table"], "llamacpp": ["table"], "kv_dtype": ["table"], "policies": ["table"], "budget": ["table"],
        "prompt_tokens": ["table"], "json": ["table"], "resume": ["table", "figure"], "dtype": ["table", "figure"]}
RUNS = {"table": "the policy table", "figure": "--figure"}


def check_args(args) -> None:
    """Bad input fails here, before any model is loaded or any configuration has run."""
    defaults = vars(parser().parse_args([]))
    given = {k for k, v in vars(args).items() if v != defaults[k]}
    kind = "figure" if args.figure else "table"
    for k in sorted(given & set(ONLY)):
        if kind not in ONLY[k]:
            flag, where = f"--{k.replace('_', '-')}", [RUNS[r] for r in ONLY[k]]
            raise UserError(f"{flag} needs {' or '.join(where)}" if "table" not in ONLY[k] else
                            f"{flag} does not apply to {RUNS[kind]} (only to {', '.join(where)})")
    if args.kv_dtype == "bfloat16" and args.dtype != "float32":
        raise UserError(f"--kv-dtype bfloat16 halves a float32 run's cache; --dtype {args.dtype}'s own cache is as "
                        "small: drop one of them")
    if args.kv_dtype and args.kvpress:
        raise UserError("--kv-dtype with --kvpress: the kvpress table labels budgetkv's cache as the compute dtype; "
                        "run them apart")
    if args.random_weights and args.llamacpp:
        raise UserError("--llamacpp runs the checkpoint's own GGUF, which --random-weights has not: drop one of them")
    if args.random_weights and args.hf_model != defaults["hf_model"]:
        raise UserError("--hf-model is a checkpoint; with --random-weights --kvpress builds the same shapes itself")
    if args.hf_model != defaults["hf_model"] and not args.kvpress:
        raise UserError("--hf-model is the model --kvpress runs: give --kvpress too")
    if args.llamacpp and not LLAMACPP_PY.is_file():  # strict: a skipped peer must not look like a result
        raise EnvironmentFailure(f"--llamacpp needs {LLAMACPP_PY.parent.parent.name}, which is missing: make it with "
                                 "`bash scripts/setup.sh llamacpp` (builds llama-cpp-python, several minutes)")
    if args.resume and kind != "figure" and args.json is None:
        raise UserError("--resume needs --json: the file the finished configurations are kept in")
    if args.decode_steps is None:
        args.decode_steps = 50 if args.figure else 32
    check_common(args)
    check_policy_flags(args)
    if args.figure:
        int_list(args.contexts, "--contexts")
        int_list(args.budgets, "--budgets")
        try:
            args.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"--out-dir {args.out_dir}: {e.strerror}") from None
        check_writable(args.out_dir / "rocketkv_figure.json", "--out-dir")
    if args.one_figure and not re.fullmatch(r"(full|rocketkv-[1-9]\d*)@[1-9]\d*", args.one_figure):
        raise UserError(f"--one-figure {args.one_figure!r}: full@T or rocketkv-t@T")


def run(args) -> None:
    check_args(args)
    start(args)
    if args.one_figure:
        label, T = args.one_figure.split("@")
        ckpt, config = bench_source(args)
        T = int(T)  # full holds the prompt and the new tokens; RocketKV less, after one layer's scratch of the prompt
        model = bench_model(args, ckpt, config, T + args.decode_steps + args.block_size)
        t = time.perf_counter()
        r = figure_one(model, label, T, args)
        r["wall_s"] = time.perf_counter() - t
        print(json.dumps(r))
        return
    if args.figure:
        return run_figure(args)

    names = policies.spec_list(args.policies)
    for n in names:  # each policy's name and parameters, before any configuration runs
        config_policy(n)
    ckpt, config = bench_source(args)
    check_sizes(config, args)
    # with --random-weights the shapes only: random weights, random prompt ids
    ids = random_prompt(config, args.prompt_tokens) if args.random_weights else \
        make_document(load_tokenizer(ckpt), args.prompt_tokens)[1]
    if args.one:
        label = args.one
        policy = config_policy(label)
        budget = args.budget if is_scorer(policy) else len(ids) + args.decode_steps  # full, exact-topk hold all
        protocol = prefill_protocol(policy, None)
        model = bench_model(args, ckpt, config, budget + args.block_size)
        setup(model, policy, budget, len(ids), args.decode_steps, args.block_size, prefill=protocol,
              evict=label != "no-evict", kv_dtype=kv_dtype(args))
        t = time.perf_counter()
        steps = bench_steps(args)
        r = time_policy(model, ids, steps, args, args.device, one_shot=protocol == "one-shot")
        r["protocol"] = protocol
        r["wall_s"] = time.perf_counter() - t
        print(json.dumps(r))
        return
    gguf = llamacpp_source(ckpt, args) if args.llamacpp else None
    settings = bench_settings(args, ckpt, "table")
    old = previous(args.json, settings, args, "results", dict, TABLE_FIELDS)
    old_llama = previous(args.json, settings, args, "llamacpp", dict, LLAMACPP_FIELDS, missing_ok=True)
    print(f"{args.checkpoint}: prompt {len(ids)} tokens, budget {args.budget}, block {args.block_size}, "
          f"{args.decode_steps} decode steps x {args.repeats} repeats, "
          f"{weights_label(args, config)} on {args.device}, "
          f"{f'{args.kv_dtype} KV cache, ' if kv_dtype(args) else ''}{steps_label(args)}, "
          f"torch threads {torch.get_num_threads()}", file=sys.stderr)
    bw = read_bandwidth_gb_s(args.device)
    results = {}
    configs = [("no-evict", "keydiff", args.budget), ("full", None, len(ids) + args.decode_steps)]
    configs += [(n, n, args.budget) for n in names if n not in ("no-evict", "full")]
    for label, name, budget in configs:
        if label in old:  # --resume: measured by an earlier run with the same settings
            results[label] = old[label]
            print(f"  {label:9s} (from {args.json})", file=sys.stderr)
            continue
        # Each configuration in a fresh process: peak memory is then not polluted by earlier runs or compiles.
        r = results[label] = run_one(__file__, ["--one", label], label)
        r["bandwidth_fraction"] = r["bytes_per_step"] * r["decode_tok_s"] / 1e9 / bw
        print(f"  {label:9s} prefill {r['prefill_tok_s']:7.1f} tok/s  decode {r['decode_step_ms']:6.2f} ms/step "
              f"({r['decode_tok_s']:5.1f} tok/s)  KV {r['kv_cache_mib']:.1f} MiB  "
              f"[warm-up/compile {r['warmup_s']:.0f} s, total {r['wall_s']:.0f} s]", file=sys.stderr)
        if args.kvpress and (label == "full" or label == name and name in KVPRESS):
            results[label]["kvpress"] = run_kvpress(ckpt, ids, "none" if label == "full" else name, budget, args)
        if args.json:  # after every configuration: a stopped run keeps what it measured (--resume goes on)
            save(args.json, args, settings, read_gb_s=bw, results=results)
    llama = {}
    for variant in LLAMACPP_VARIANTS if gguf is not None else []:
        if variant in old_llama:
            llama[variant] = old_llama[variant]
            print(f"  llama.cpp {variant} (from {args.json})", file=sys.stderr)
            continue
        x = llama[variant] = run_llamacpp(gguf, ids, variant, args)
        print(f"  {llama_label(variant, x)}: prefill {x['prefill_tok_s']:7.1f} tok/s  "
              f"decode {x['decode_step_ms']:6.2f} ms/step ({x['decode_tok_s']:5.1f} tok/s)  "
              f"[warm-up {x['warmup_s']:.1f} s]", file=sys.stderr)
        if args.json:
            save(args.json, args, settings, read_gb_s=bw, results=results, llamacpp=llama)
    if args.json:  # with the kept configurations after the last one measured
        save(args.json, args, settings, read_gb_s=bw, results=results, **({"llamacpp": llama} if llama else {}))

    base, full = results["no-evict"], results["full"]
    resumed = sum(label in old for label in results)
    print(f"\nmeasured read bandwidth {bw:.1f} GB/s; ratios from this run (medians of {args.repeats})" +
          (f"; {resumed} of {len(results)} configurations measured by an earlier run (--resume)" if resumed else "") +
          "\n")
    print("| policy | protocol | TTFT s | prefill tok/s | prefill vs no-evict | decode ms/step | "
          "step overhead vs no-evict | decode vs full | decode / bandwidth bound | peak MiB prefill / decode |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, r in results.items():
        print(f"| {label} | {r['protocol']} | {r['prefill_s']:.2f} | {r['prefill_tok_s']:.0f} | "
              f"{r['prefill_tok_s'] / base['prefill_tok_s']:.2f}x | "
              f"{r['decode_step_ms']:.2f} | {r['decode_step_ms'] / base['decode_step_ms'] - 1:+.1%} | "
              f"{r['decode_tok_s'] / full['decode_tok_s']:.2f}x | {r['bandwidth_fraction']:.0%} | "
              f"{r['prefill_peak_mib']:.0f} / {r['decode_peak_mib']:.0f} |")
    if "keydiff" in results:
        kd = results["keydiff"]
        slow = {n: kd["prefill_tok_s"] / results[n]["prefill_tok_s"] for n in ("snapkv", "tova", "h2o") if n in results}
        if slow:
            print("\nkeydiff block-wise prefill speed-up over " +
                  ", ".join(f"{n} {v:.2f}x" for n, v in slow.items()))
    kv_rows = [(label, r) for label, r in results.items() if r.get("kvpress")]
    if kv_rows:
        print("\n| policy | ours decode tok/s | HF+kvpress decode tok/s | ratio | ours peak MiB (decode) | "
              "HF+kvpress peak MiB (decode) | ratio |")
        print("|---|---|---|---|---|---|---|")
        for label, r in kv_rows:
            k = r["kvpress"]
            print(f"| {label} | {r['decode_tok_s']:.1f} | {k['decode_tok_s']:.1f} | "
                  f"{r['decode_tok_s'] / k['decode_tok_s']:.2f}x | {r['decode_peak_mib']:.0f} | "
                  f"{k['decode_peak_mib']:.0f} | {r['decode_peak_mib'] / k['decode_peak_mib']:.2f} |")
    if llama:
        print_peer_table(results, llama, args, config)


# --------------------------------------------------------------------------------- llama.cpp as the CPU peer

# bench_llamacpp.py's runs: the GGUF as shipped with llama.cpp's defaults (KV cache f16), and its F32 copy with an
# f32 KV cache (every tensor and the cache in budgetkv's dtype: its greedy tokens should be full's), each with flash
# attention on and off: on this CPU it is llama.cpp's fast prefill and its slow F32 decode, so each measure is
# compared with llama.cpp's best setting for it (best_llamacpp)
LLAMACPP_WEIGHTS = {"shipped": [], "F32": ["--kv-type", "f32"]}
LLAMACPP_VARIANTS = {f"{w} fa-{fa}": [*flags, "--flash-attn", fa] for w, flags in LLAMACPP_WEIGHTS.items()
                     for fa in ("on", "off")}
LLAMACPP_FIELDS = {"model": str, "kv_type": str, "ttft_s": float, "prefill_tok_s": float, "decode_step_ms": float,
                   "decode_tok_s": float, "prefill_peak_mib": float, "decode_peak_mib": float}


def llamacpp_source(ckpt: Path, args) -> Path:
    """The GGUF the checkpoint was converted from (what llama.cpp runs): smollm2-135m's embedded one, or a .gguf
    --checkpoint, or the GGUF behind the checkpoint quantize.py made of one (int4 / int8 against llama.cpp's own
    4-bit file). A checkpoint from elsewhere (an HF folder) has no GGUF for llama.cpp to run."""
    from convert import ENGINE_FILE, read_identity
    ident = read_identity(ckpt / ENGINE_FILE)
    if ident is not None and ident.get("kind") == "quantized":  # its source: the conversion it quantized
        ident = read_identity(Path(ident["source"]) / ENGINE_FILE)
    if ident is None or ident.get("kind") != "gguf" or not Path(ident["source"]).is_file():
        raise UserError(f"--llamacpp runs llama.cpp on the GGUF the checkpoint was converted from: --checkpoint "
                        f"{args.checkpoint} is not a GGUF's conversion (use smollm2-135m, the embedded GGUF, or a "
                        ".gguf file)")
    return Path(ident["source"])


def run_llamacpp(gguf: Path, ids: list[int], variant: str, args) -> dict:
    """One llama.cpp variant through scripts/bench_llamacpp.py in .venv-llamacpp: the same ids (a file), threads,
    decode steps and repeats. A failure ends the run with one line (exit 1); the whole output goes to a log."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="budgetkv-ids-") as f:
        f.write(json.dumps(ids))
        f.flush()
        cmd = [str(LLAMACPP_PY), str(REPO / "scripts" / "bench_llamacpp.py"), "--gguf", str(gguf),
               "--ids-file", f.name, "--decode-steps", str(args.decode_steps), "--repeats", str(args.repeats),
               "--threads", str(torch.get_num_threads()), *LLAMACPP_VARIANTS[variant]]
        if variant.startswith("F32"):
            cmd += ["--dequantize", str(REPO / "build" / f"{gguf.stem}.F32.gguf")]
        return json_result(subprocess.run(cmd, capture_output=True, text=True), f"llama.cpp {variant}",
                           "budgetkv-bench-llamacpp")


def llama_label(variant: str, x: dict) -> str:
    """'llama.cpp Q4_1 as shipped, KV f16, flash attention on' (the file type from llama_model_desc)."""
    shipped = " as shipped" if variant.startswith("shipped") else ""
    return (f"llama.cpp {x['model'].split(' ', 2)[-1]}{shipped}, KV {x['kv_type']}, flash attention "
            f"{x.get('flash_attn', variant.rpartition('fa-')[2])}")


# each measure: its field, whether more is better, and how the table names it
PEER_MEASURES = (("ttft_s", False, "TTFT"), ("prefill_tok_s", True, "prefill tok/s"),
                 ("decode_tok_s", True, "decode tok/s"), ("decode_peak_mib", False, "decode peak RSS"))


def best_llamacpp(llama: dict, weights: str) -> dict:
    """For llama.cpp's `weights` ("shipped" / "F32"): per measure, (its best value over the flash-attention settings,
    the setting that gave it)."""
    rows = {v.rpartition("fa-")[2]: x for v, x in llama.items() if v.startswith(weights + " ")}
    best = {}
    for field, higher, _ in PEER_MEASURES:
        setting = (max if higher else min)(rows, key=lambda s: rows[s][field])
        best[field] = (rows[setting][field], setting)
    return best


def same_tokens(tokens, reference) -> str:
    """Whether greedy `tokens` are the `reference` ones (budgetkv full's), or where they first differ."""
    if not tokens or not reference:
        return "n/a"
    n = min(len(tokens), len(reference))
    first = next((i for i in range(n) if tokens[i] != reference[i]), None)
    if first is None and len(tokens) == len(reference):
        return f"yes ({n} tokens)"
    return f"no: from token {first + 1 if first is not None else n + 1} of {max(len(tokens), len(reference))}"


def spread(r) -> str:
    per = r.get("decode_tok_s_repeats") or []
    return f"{r['decode_tok_s']:.1f} ({min(per):.1f}-{max(per):.1f})" if per else f"{r['decode_tok_s']:.1f}"


def print_peer_table(results: dict, llama: dict, args, config: dict) -> None:
    """budgetkv's configurations and llama.cpp's variants on the same prompt ids, threads and steps."""
    full = results["full"].get("tokens")
    print(f"\nllama.cpp as the CPU peer: the same {args.decode_steps} greedy decode steps x {args.repeats} repeats, "
          f"{torch.get_num_threads()} threads (llama.cpp {next(iter(llama.values())).get('llama_cpp', '?')}, "
          f"OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY', 'unset')}); decode tok/s = 1 / median step (min-max "
          "over the repeats' medians); "
          "greedy tokens: the first + one per decode step, against budgetkv full's (meaningful for F32"
          f"{'; budgetkv runs quantized weights here' if 'budgetkv_quantization' in config else ''})\n")
    print("| variant | TTFT s | prefill tok/s | decode tok/s (median, min-max) | peak RSS MiB prefill / decode | "
          "same greedy tokens as budgetkv full |")
    print("|---|---|---|---|---|---|")
    weights = {"float32": "fp32"}.get(short_weights(args, config), short_weights(args, config))
    kv = f", KV {args.kv_dtype}" if args.kv_dtype else ""
    rows = [(f"budgetkv {label} ({weights}{kv})", r)
            for label, r in results.items() if label != "no-evict"]  # no-evict: no generator
    rows += [(llama_label(variant, x), x) for variant, x in llama.items()]
    for name, r in rows:
        same = "(reference)" if r is results["full"] else same_tokens(r.get("tokens"), full)
        print(f"| {name} | {r['ttft_s'] if 'ttft_s' in r else r['prefill_s']:.2f} | {r['prefill_tok_s']:.0f} | "
              f"{spread(r)} | {r['prefill_peak_mib']:.0f} / {r['decode_peak_mib']:.0f} | {same} |")
    for w in LLAMACPP_WEIGHTS:
        if not any(v.startswith(w + " ") for v in llama):
            continue
        best = best_llamacpp(llama, w)
        print(f"\nbudgetkv against llama.cpp {w}'s best setting for each measure (flash attention on or off; "
              "ratios > 1: budgetkv better)\n")
        print("| configuration | " + " | ".join(f"{name} (llama.cpp best: {best[f][0]:.2f}, flash attention "
                                                f"{best[f][1]})" for f, _, name in PEER_MEASURES) + " |")
        print("|---|" + "---:|" * len(PEER_MEASURES))
        for label, r in results.items():
            if label == "no-evict":
                continue
            ours = dict(r, ttft_s=r.get("ttft_s", r["prefill_s"]))
            cells = [f"{ours[f] / best[f][0] if higher else best[f][0] / ours[f]:.2f}x"
                     for f, higher, _ in PEER_MEASURES]
            print(f"| budgetkv {label} | " + " | ".join(cells) + " |")


# ----------------------------------------------------------------------------- outputs that survive interruption

# what a resumed row must hold (the table and the ratios use them): str, int or any number
TABLE_FIELDS = {"protocol": str, "prefill_s": float, "prefill_tok_s": float, "decode_step_ms": float,
                "decode_tok_s": float, "bandwidth_fraction": float, "prefill_peak_mib": float, "decode_peak_mib": float}
FIGURE_FIELDS = {"label": str, "T": int, "cache_slots": float, "decode_step_ms": float, "decode_peak_mib": float,
                 "bytes_per_step": float, "weights_mib": float, "cache_mib": float}


if __name__ == "__main__":
    sys.exit(main())
