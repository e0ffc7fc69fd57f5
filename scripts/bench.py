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

The experiments are scripts of their own: RocketKV's Figure 5 scripts/bench_figure.py, throughput at a memory cap
scripts/bench_batch.py, a policy's overhead in alternating steps scripts/bench_paired.py, quantized weights
scripts/bench_quant.py, self-speculative decoding scripts/bench_speculate.py.
"""
import json
import os
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
from cli import Parser, run_child, run_cli  # noqa: E402
from errors import EnvironmentFailure, UserError  # noqa: E402
from scripts.benchlib import (bench_model, bench_run, bench_settings, bench_source, check_common,  # noqa: E402
                              check_policy_flags, check_sizes, config_policy, json_result, kv_dtype, make_document,
                              noise_note, parser as common_parser, policy_flags, previous, random_prompt,
                              read_bandwidth_gb_s, run_one, save, short_weights, start, steps_label, time_policy,
                              weights_label)
from scripts.outputs import write_atomic  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402

LLAMACPP_PY = REPO / ".venv-llamacpp" / "bin" / "python"  # bench_llamacpp.py's venv (bash scripts/setup.sh llamacpp)
HF_MODEL = REPO / "build" / "smollm2-hf"  # --kvpress's copy of smollm2-135m (bench_kvpress.py makes it from the GGUF)
KVPRESS = {"keydiff": "KeyDiffPress", "snapkv": "SnapKVPress", "tova": "TOVAPress", "sink": "StreamingLLMPress",
           "keynorm": "KnormPress"}


# --------------------------------------------------------------------------------- HF transformers + kvpress

def run_kvpress(ckpt_dir: Path, ids: list[int], policy: str, budget: int, args) -> dict | None:
    py = REPO / ".venv-kv" / "bin" / "python"
    if not py.is_file():
        print("  (.venv-kv missing: run `bash scripts/setup.sh test`; kvpress skipped)", file=sys.stderr)
        return None
    ids_file = REPO / "build" / "bench_ids.json"
    ids_file.parent.mkdir(exist_ok=True)
    write_atomic(ids_file, json.dumps(ids).encode())  # never through a link planted at the name
    if args.random_weights:  # the same shapes, transformers' own random init: speed does not depend on the values
        model = ["--random-config", str(ids_file.with_name("bench_config.json"))]
        write_atomic(Path(model[1]), json.dumps(shape_config(args.checkpoint)[0]).encode())
    else:
        model = ["--model", str(HF_MODEL)]
    cmd = [str(py), str(REPO / "scripts" / "bench_kvpress.py"), *model, "--press", KVPRESS.get(policy, "none"),
           "--budget", str(budget), "--ids-file", str(ids_file), "--decode-steps", str(args.decode_steps),
           "--repeats", str(args.repeats), "--dtype", args.dtype, "--device", args.device]
    r = run_child(cmd)
    if r.returncode != 0:
        print(f"  kvpress run failed: {(r.stderr.strip().splitlines() or ['no output'])[-1]}", file=sys.stderr)
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def parser() -> Parser:
    ap = common_parser(__doc__)
    policy_flags(ap, "keydiff,sink,tova,snapkv,h2o,keynorm,random")
    ap.add_argument("--kvpress", action="store_true", help="also run HF transformers + kvpress (in .venv-kv)")
    ap.add_argument("--llamacpp", action="store_true",
                    help="also run llama.cpp (in .venv-llamacpp: bash scripts/setup.sh llamacpp) on the GGUF the "
                         "checkpoint was converted from, as shipped and dequantized to F32, each with flash attention "
                         "on and off: TTFT, prefill and decode tok/s, peak memory, whether its greedy tokens are "
                         "full's, and budgetkv against llama.cpp's best setting for each measure")
    ap.add_argument("--json", type=Path, help="also write all results here (the table)")
    ap.add_argument("--kv-dtype", choices=list(KV_DTYPES), help="budgetkv's KV cache stored so "
                    "(generate.py's --kv-dtype; the peers keep theirs)")
    ap.add_argument("--resume", action="store_true",
                    help="skip the configurations already measured in --json, which is rewritten whole after "
                         "every configuration; refused if it was written with other settings (checkpoint, sizes, "
                         "threads, compile, ...). Without --resume the output is replaced when the first "
                         "configuration finishes")
    return ap


def main():
    return run_cli(run, parser().parse_args())


def check_args(args) -> None:
    """Bad input fails here, before any model is loaded or any configuration has run."""
    if args.kv_dtype == "bfloat16" and args.dtype != "float32":
        raise UserError(f"--kv-dtype bfloat16 halves a float32 run's cache; --dtype {args.dtype}'s own cache is as "
                        "small: drop one of them")
    if args.kv_dtype and args.kvpress:
        raise UserError("--kv-dtype with --kvpress: the kvpress table labels budgetkv's cache as the compute dtype; "
                        "run them apart")
    if args.random_weights and args.llamacpp:
        raise UserError("--llamacpp runs the checkpoint's own GGUF, which --random-weights has not: drop one of them")
    if args.kvpress and not args.random_weights and args.checkpoint != "smollm2-135m":
        raise UserError(f"--kvpress runs smollm2-135m's HF copy ({HF_MODEL}), or --random-weights of --checkpoint's "
                        f"shapes: not --checkpoint {args.checkpoint}")
    if args.llamacpp and not LLAMACPP_PY.is_file():  # strict: a skipped peer must not look like a result
        raise EnvironmentFailure(f"--llamacpp needs {LLAMACPP_PY.parent.parent.name}, which is missing: make it with "
                                 "`bash scripts/setup.sh llamacpp` (builds llama-cpp-python, several minutes)")
    if args.resume and args.json is None:
        raise UserError("--resume needs --json: the file the finished configurations are kept in")
    check_common(args)
    check_policy_flags(args)


def run(args) -> None:
    check_args(args)
    start(args)
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
        budget = args.budget if is_scorer(policy) else None  # full, exact-topk hold every token
        model = bench_model(args, ckpt, config, (budget or len(ids) + args.decode_steps + 1) + args.block_size)
        t = time.perf_counter()
        gen = bench_run(args, model, policy, len(ids), budget, ids[0], evict=label != "no-evict")
        r = time_policy(model, ids, gen, args)
        r["protocol"] = gen.protocol
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
    noise_note(args.repeats)
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
                   "decode_tok_s": float, "prefill_peak_mib": float, "decode_peak_mib": float, "tokens?": [int],
                   "decode_tok_s_repeats?": [float]}


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
        return json_result(run_child(cmd), f"llama.cpp {variant}",
                           "bench-llamacpp")


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
                "decode_tok_s": float, "bandwidth_fraction": float, "prefill_peak_mib": float, "decode_peak_mib": float,
                "ttft_s?": float, "tokens?": [int], "decode_tok_s_repeats?": [float],
                "kvpress?": {"decode_tok_s": float, "decode_peak_mib": float}}


if __name__ == "__main__":
    sys.exit(main())
