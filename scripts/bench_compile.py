"""What `generate.py --compile` costs and when it pays: eager, a cold compile and warm starts, each a real
`generate.py --json` run in its own process, as a user runs them.

    python scripts/bench_compile.py --policy keydiff --budget 512 --prompt-tokens 4096 --new-tokens 128
    python scripts/bench_compile.py --checkpoint llama3.1-8b --random-weights --device cuda --prompt-tokens 16384 \
        --budget 2048

The same raw prompt (a document of --prompt-tokens tokens, as scripts/bench.py makes it; with --random-weights,
that many random token ids) in every run. "cold": empty compile caches (inductor's and the AOT packages', a fresh
folder under build/, removed afterwards); "warm": a second process on the caches the cold run filled, what every
later run of the same model, policy, budget, block size, dtype and device gets. Eager and warm runs alternate,
--repeats of each, so that a machine whose speed drifts slows both alike. Reported per run: compile s, TTFT, prefill
and decode tok/s, the process peak (loading and compiling included) and each phase's own peak. Then the break-even:
the generated tokens from which the compiled run's wall time (compile + TTFT + decode) is below eager's, cold and
warm.
"""
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from errors import check_python  # noqa: E402

check_python()  # one line, not a traceback, in a Python without the requirements

from config import parse_config  # noqa: E402
from cli import Parser, run_child, run_cli  # noqa: E402
from files import check_writable  # noqa: E402
from errors import UserError, check_int  # noqa: E402
from scripts.benchlib import MAX_REPEATS, bench_source, make_document  # noqa: E402
from scripts.outputs import write_atomic  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402

MIB = 2 ** 20


def parser() -> Parser:
    ap = Parser(description=__doc__)
    ap.add_argument("--checkpoint", default="smollm2-135m", help="generate.py's --checkpoint")
    ap.add_argument("--policy", default="keydiff", help="generate.py's --policy (default keydiff)")
    ap.add_argument("--budget", type=int, default=512, help="generate.py's --budget")
    ap.add_argument("--prompt-tokens", type=int, default=4096, help="the prompt's length in tokens")
    ap.add_argument("--new-tokens", type=int, default=128,
                    help="at most this many generated tokens per run (default 128; generation stops at EOS)")
    ap.add_argument("--repeats", type=int, default=2, help="eager and warm runs, alternating (default 2 each)")
    ap.add_argument("--threads", type=int, help="generate.py's --threads (default: its own)")
    ap.add_argument("--compile-mode", default="auto", choices=["auto", "aot", "default", "reduce-overhead",
                                                               "max-autotune", "max-autotune-no-cudagraphs"],
                    help="generate.py's --compile-mode (default auto)")
    ap.add_argument("--freeze", action="store_true",
                    help="compile with generate.py --freeze (never cached: every compiled run is cold)")
    ap.add_argument("--device", default=None, help="generate.py's --device (default: its own)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="generate.py's --dtype (default: its own)")
    ap.add_argument("--random-weights", action="store_true",
                    help="generate.py --random-weights: --checkpoint's shapes with random weights (a llama3.1-8b on "
                         "a GPU without its files), a prompt of --prompt-tokens random ids")
    ap.add_argument("--json", type=Path, help="also write the runs and the break-even here")
    return ap


def generate_run(args, prompt_file: Path | None, cache: Path, compiled: bool) -> dict:
    prompt = (["--random-weights", "--prompt-tokens", str(args.prompt_tokens)] if prompt_file is None
              else ["--prompt-file", str(prompt_file), "--no-chat"])
    cmd = [sys.executable, str(REPO / "generate.py"), "--checkpoint", args.checkpoint, "--policy", args.policy,
           *prompt, "--max-new-tokens", str(args.new_tokens), "--json", "--quiet"]
    if args.policy != "full":
        cmd += ["--budget", str(args.budget)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.device:
        cmd += ["--device", args.device]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    if compiled:
        cmd += ["--compile", "--compile-mode", args.compile_mode] + (["--freeze"] if args.freeze else [])
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "BUDGETKV_AOT_DIR": str(cache / "aot-steps")}
    r = run_child(cmd, env=env)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"generate.py failed ({' '.join(cmd[2:])}): {last}")
    sys.stderr.write(r.stderr)  # a run's warnings reach the user (inductor's own output goes to its compile log)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out.pop("text", None)
    return out


def wall_s(r: dict) -> float:
    """Compile + first token + decode: the time a user waits (loading left out: the same for both)."""
    return r["compile_s"] + r["ttft_s"] + r["decode_s"]


def break_even(eager: dict, compiled: dict) -> float | None:
    """Generated tokens from which compiled beats eager: compile + TTFT + n / decode rate, equal for both."""
    gain = 1 / eager["decode_tok_s"] - 1 / compiled["decode_tok_s"]
    if gain <= 0:
        return None
    return max(0.0, (compiled["compile_s"] + compiled["ttft_s"] - eager["ttft_s"]) / gain)


def run(args) -> int:
    if args.prompt_tokens < 64 or args.new_tokens < 2 or args.budget < 1:
        raise UserError("need --prompt-tokens >= 64, --new-tokens >= 2 and --budget >= 1")
    check_int("repeats", args.repeats, 1, MAX_REPEATS)
    if args.json is not None:
        check_writable(args.json, "--json")
    ckpt, config = bench_source(args)
    ctx = parse_config(config).max_seq_len
    if args.prompt_tokens + args.new_tokens > ctx:
        raise UserError(f"--prompt-tokens + --new-tokens ({args.prompt_tokens} + {args.new_tokens}) must fit the "
                        f"model's context ({ctx})")
    text = None if args.random_weights else make_document(load_tokenizer(ckpt), args.prompt_tokens)[0]
    build = REPO / "build"
    build.mkdir(exist_ok=True)
    cache = Path(tempfile.mkdtemp(prefix="bench-compile-cache-", dir=build))
    runs = []
    try:
        prompt_file = None if text is None else cache / "prompt.txt"
        if prompt_file is not None:
            prompt_file.write_text(text)
        for kind in ["cold"] + ["eager", "warm"] * args.repeats:
            r = generate_run(args, prompt_file, cache, compiled=kind != "eager")
            runs.append({"run": kind, **r})
            print(f"  {kind}: compile {r['compile_s']:.1f} s, TTFT {r['ttft_s']:.2f} s, decode "
                  f"{r['decode_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    first = runs[0]
    print(f"\n{args.checkpoint}, --policy {args.policy} --budget {args.budget}, {first['prompt_tokens']} prompt "
          f"tokens, {args.new_tokens} new at most, {first['weights'].split(' [')[0]} on {first['device']} "
          f"({first['threads']} threads), "
          f"--compile-mode {args.compile_mode} ({first['compile_mode']}){', frozen' if args.freeze else ''}\n")
    print("| run | compile s | cache | TTFT s | prefill tok/s | generated tokens | decode tok/s | wall s (compile + "
          "TTFT + decode) | process peak MiB | prefill peak MiB | decode peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        print(f"| {r['run']} | {r['compile_s']:.1f} | {r['compile_cache'] or ''} | {r['ttft_s']:.2f} | "
              f"{r['prefill_tok_s']:.0f} | {r['generated_tokens']} | "
              f"{r['decode_tok_s']:.1f} | {wall_s(r):.1f} | {r['process_peak_bytes'] / MIB:.0f} | "
              f"{r['prefill_peak_bytes'] / MIB:.0f} | {r['decode_peak_bytes'] / MIB:.0f} |")

    def median_run(kind):
        rs = [r for r in runs if r["run"] == kind]
        return {k: statistics.median(r[k] for r in rs) for k in ("compile_s", "ttft_s", "decode_tok_s",
                                                                 "decode_peak_bytes")}
    eager, warm = median_run("eager"), median_run("warm")
    even = {kind: break_even(eager, c) for kind, c in (("cold", first), ("warm", warm))}
    print(f"\ncompiled decode / eager: {warm['decode_tok_s'] / eager['decode_tok_s']:.2f}x (medians); steady decode "
          f"peak compiled / eager: {warm['decode_peak_bytes'] / eager['decode_peak_bytes']:.2f}x")
    for kind, n in even.items():
        print(f"--compile pays off from {'never (no faster decode)' if n is None else f'{n:.0f} generated tokens'} "
              f"with a {kind} cache")
    if args.json is not None:
        write_atomic(args.json, json.dumps({"settings": vars(args) | {"json": str(args.json)}, "runs": runs,
                                            "break_even_tokens": even}, indent=1, default=str))
    return 0


def main(argv=None) -> int:
    return run_cli(run, parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
