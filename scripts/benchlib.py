"""What the benchmark scripts share: the flags every one takes, the prompt document, random prompt ids,
comma-separated integer lists, a configuration's model, steps and timed run, the bandwidth and matrix-product probes,
the settings an output is resumable under, outputs that survive interruption (--resume), and one configuration run
in a fresh process."""
import sys

if __name__ == "__main__":  # run directly: one line, not an ImportError
    PART = "scripts/benchlib.py is a part of the benchmarks (scripts/bench*.py), not a command of its own"
    print(f"usage: {PART}" if sys.argv[1:] in (["-h"], ["--help"]) else f"error: {PART}",
          file=sys.stdout if sys.argv[1:] in (["-h"], ["--help"]) else sys.stderr)
    sys.exit(0 if sys.argv[1:] in (["-h"], ["--help"]) else 2)

import argparse
import json
import math
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch

import policies
from cache import KV_DTYPES, is_scorer, kv_bytes
from checkpoint import resolve_checkpoint, shape_config
from cli import Parser, run_child
from files import check_writable, open_log
from config import parse_config
from convert import read_config
from engine import Generation, PeakMemory, decode_bytes_per_step, sync
from errors import EnvironmentFailure, UserError
from loading import kv_cache_estimate, load_model, random_model
from runtime import AOT, check_device, release_free_memory, set_threads
from sampling import first_tokens
from scripts.outputs import check_settings, checkpoint_identity, checksum, read_json, write_atomic

REPO = Path(__file__).resolve().parent.parent


def parser(doc: str, decode_steps: int | None = 32, steps_help: str | None = None) -> Parser:
    """The flags every benchmark script takes; each script adds its own."""
    ap = Parser(description=doc)
    ap.add_argument("--checkpoint", default="smollm2-135m",
                    help="a short name, an HF or budgetkv directory or a .gguf file (generate.py's --checkpoint)")
    ap.add_argument("--block-size", type=int, default=128, help="prefill block size in tokens")
    ap.add_argument("--decode-steps", type=int, default=decode_steps,
                    help=steps_help or "decode steps timed per repeat (greedy)")
    ap.add_argument("--repeats", type=int, default=3, help="times each configuration runs; timings are medians")
    ap.add_argument("--compile", action="store_true", help="compile the prefill-block and decode steps")
    ap.add_argument("--compile-mode", default=None, choices=[AOT, "default", "reduce-overhead", "max-autotune",
                                                             "max-autotune-no-cudagraphs"],
                    help="default: generate.py's (on CPU aot, the decode step compiled ahead of time, or "
                         "max-autotune-no-cudagraphs for frozen graphs; on CUDA decode under CUDA graphs); the others "
                         "are torch.compile modes")
    prefill = ap.add_mutually_exclusive_group()
    prefill.add_argument("--compile-prefill", dest="compile_prefill", action="store_true", default=None,
                         help="with --compile: compile the prefill-block step too (default: as generate.py --compile "
                              "does: on CUDA, not on CPU)")
    prefill.add_argument("--no-compile-prefill", dest="compile_prefill", action="store_false",
                         help="with --compile: the prefill-block step stays eager")
    ap.add_argument("--random-weights", action="store_true",
                    help="--checkpoint's shapes (a short name's configs/<name>.json, or a folder with only a "
                         "config.json) with seeded random weights (seed 0) and random prompt ids")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu, cuda or cuda:N (default: cuda where there is one, else cpu)")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's; 1 is steadier on a shared machine)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one configuration, print JSON
    return ap


def compiler_flags(ap: Parser) -> None:
    """Compiler experiments (bench_paired.py): frozen weights, inductor's C++ wrapper."""
    ap.add_argument("--freeze", action="store_true",
                    help="with --compile: fold the weights into the compiled graphs (generate.py --freeze)")
    ap.add_argument("--cpp-wrapper", action="store_true",
                    help="inductor's C++ wrapper (torch._inductor.config.cpp_wrapper): no Python between kernels")


def policy_flags(ap: Parser, policies_default: str) -> None:
    """The flags of the scripts that run policies at a budget on a prompt: the prompt's length, the budget, the
    policies, the dtype."""
    ap.add_argument("--prompt-tokens", type=int, default=4096, help="the prompt's length in tokens")
    ap.add_argument("--budget", type=int, default=512, help="KV slots held per layer and KV head (generate.py's "
                    "--budget) for every evicting policy")
    ap.add_argument("--policies", default=policies_default,
                    help="comma-separated policy specs (generate.py's --policy, e.g. snapkv:window=16)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="the weights' and the KV cache's dtype")


def check_policy_flags(args) -> None:
    """policy_flags' bad input, before any model is loaded."""
    for k in ("prompt_tokens", "budget"):
        if getattr(args, k) < 1:
            raise UserError(f"--{k.replace('_', '-')} must be >= 1, got {getattr(args, k)}")
    names = policies.spec_list(args.policies)
    if not names:
        raise UserError(f"--policies is empty ({args.policies!r}): name at least one policy")
    if twice := [n for i, n in enumerate(names) if n in names[:i]]:
        raise UserError(f"--policies lists {twice[0]} twice")


MAX_REPEATS = 1000


def check_common(args) -> None:
    """The shared flags' bad input, before any model is loaded."""
    if args.compile_prefill is not None and not args.compile:
        raise UserError(f"--{'' if args.compile_prefill else 'no-'}compile-prefill needs --compile")
    for k in ("compile_mode", "cpp_wrapper", "freeze"):
        if getattr(args, k, None) not in (None, False) and not args.compile:
            raise UserError(f"--{k.replace('_', '-')} needs --compile")
    if args.compile_mode == AOT and (getattr(args, "freeze", False) or args.device != "cpu"):
        raise UserError("--compile-mode aot compiles the CPU decode step, unfrozen: not with --freeze or a CUDA "
                        "device")
    if args.decode_steps < 2:
        raise UserError(f"--decode-steps must be >= 2, got {args.decode_steps}")
    for k in ("repeats", "block_size"):
        if getattr(args, k) < 1:
            raise UserError(f"--{k.replace('_', '-')} must be >= 1, got {getattr(args, k)}")
    if args.repeats > MAX_REPEATS:  # each repeat times every configuration again
        raise UserError(f"--repeats must be at most {MAX_REPEATS}, got {args.repeats}")
    if args.threads is not None and not 1 <= args.threads <= 1024:
        raise UserError(f"--threads must be between 1 and 1024, got {args.threads}")
    check_device(args.device)
    if getattr(args, "json", None) is not None:
        check_writable(args.json, "--json")


def start(args) -> None:
    """The process-wide settings a run asks for: its CPU threads (runtime.set_threads: --threads, else adaptive, as
    a user's run), inductor's C++ wrapper."""
    set_threads(args.threads)
    if getattr(args, "cpp_wrapper", False):
        torch._inductor.config.cpp_wrapper = True


def make_document(tokenizer, n_tokens: int, seed: int = 0) -> tuple[str, list[int]]:
    """A prompt of at most n_tokens (chat-formatted): a fact at the start, filler sentences, a question about the
    fact at the end. Returns (text, ids)."""
    import random
    rng = random.Random(seed)
    subjects = ["The river", "A merchant", "The old library", "Our committee", "The northern valley", "A young engineer",
                "The harbour", "The observatory", "A travelling musician", "The city council"]
    verbs = ["described", "measured", "rebuilt", "visited", "recorded", "painted", "studied", "discussed"]
    objects = ["the bridge near the mill", "a map of the eastern hills", "the winter festival", "an old clock tower",
               "the results of the harvest", "a letter from the coast", "the new railway line", "a garden of herbs"]
    fact = "The secret password for the archive is BLUE-HERON-42."
    filler = []
    while len(tokenizer.encode(" ".join(filler), add_bos=False)) < n_tokens - 60:
        filler += [f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} in {1800 + rng.randrange(200)}."
                   for _ in range(50)]
    question = "\n\nQuestion: what is the secret password for the archive, stated at the very start?"

    def encode(t):
        return tokenizer.chat_prompt_ids(t) if tokenizer.chat_template else tokenizer.encode(t, add_bos=True)

    words = (fact + " " + " ".join(filler)).split(" ")
    while True:  # trim filler words until the formatted prompt fits
        text = " ".join(words) + question
        ids = encode(text)
        if len(ids) <= n_tokens:
            return text, ids
        if not words:
            raise UserError(f"--prompt-tokens {n_tokens} is too small: the question alone takes {len(ids)} tokens")
        words = words[: len(words) - max(1, (len(ids) - n_tokens) // 2)]


def random_prompt(config: dict, n: int) -> list[int]:
    """--random-weights: n prompt ids drawn below the vocabulary size (seed 0: every process draws the same)."""
    vocab = parse_config(config).vocab_size
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(0)).tolist()


def int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise UserError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise UserError(f"{flag} needs integers >= 1, got {text!r}")
    if twice := [v for i, v in enumerate(values) if v in values[:i]]:
        raise UserError(f"{flag} lists {twice[0]} twice")
    return values


def timed_read(x: torch.Tensor, device: str) -> float:
    """Seconds to read x once (a sum: streaming reads, one scalar written)."""
    sync(device)
    t = time.perf_counter()
    x.sum()
    sync(device)
    return time.perf_counter() - t


def read_bandwidth_gb_s(device: str) -> float:
    """Measured streaming-read bandwidth: median time of summing a 512 MiB fp32 tensor."""
    x = torch.ones(2**27, device=device)
    return x.nbytes / statistics.median(timed_read(x, device) for _ in range(5)) / 1e9


def gemm_gflop_s(device: str, dtype: torch.dtype) -> float:
    """Measured dense matrix-product rate: median of 5 products of two 2048 x 2048 matrices in `dtype`."""
    a = torch.randn(2048, 2048, device=device).to(dtype)
    a @ a

    def once() -> float:
        sync(device)
        t = time.perf_counter()
        a @ a
        sync(device)
        return time.perf_counter() - t
    return 2 * 2048**3 / statistics.median(once() for _ in range(5)) / 1e9


# vars(args) that are not settings: the configurations (--policies, bench_quant's modes, bench_figure's contexts
# and budgets), where the outputs go, the checkpoint's name (checkpoint_identity instead) and the internal flags
NOT_SETTINGS = {"policies", "quant", "modes", "contexts", "budgets", "checkpoint", "json", "out_dir", "resume", "one",
                "one_quant", "plot", "one_batch", "one_batch_prefill", "one_prefill"}


def bench_settings(args, ckpt, mode: str) -> dict:
    """What every configuration's measurement depends on besides the configuration itself (recorded beside the
    results; --resume refuses an output with other settings)."""
    # outputs written before these flags stay resumable
    off = {k for k in ("llamacpp", "kv_dtype") if not getattr(args, k, None)}
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
            if k not in NOT_SETTINGS | off} | dict(
        mode=mode, checkpoint=shapes_identity(ckpt) if getattr(args, "random_weights", False) else
        checkpoint_identity(ckpt), threads=torch.get_num_threads(), torch=torch.__version__)


def shapes_identity(name: str) -> dict:
    """--random-weights: what tells one model's shapes from another's (the config, not its path)."""
    import hashlib
    config, shapes = shape_config(name)
    return {"shapes": shapes, "config": hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]}


def bad_field(x: dict, fields: dict, values: bool = False) -> str | None:
    """The first of `fields` that the row x lacks or holds in another kind (values: holds a number that is no
    measurement: a rate, time or size is finite and > 0, and the tables divide by it; a count is >= 0). A kind is
    str, int, float (any number), None (null), a dict (a row of its own) or [kind] (a list of them); a field named
    with a trailing "?" may be absent."""
    for name, kind in fields.items():
        key = name.removesuffix("?")
        if key not in x:
            if name.endswith("?"):
                continue
            return key
        if not fits(x[key], kind, values):
            return key
    return None


def fits(v, kind, values: bool) -> bool:
    if isinstance(kind, dict):
        return isinstance(v, dict) and bad_field(v, kind, values) is None
    if isinstance(kind, list):
        return isinstance(v, list) and all(fits(e, kind[0], values) for e in v)
    if kind not in (int, float):
        return values or (v is None if kind is None else isinstance(v, kind))
    if not values:
        return type(v) is int or (kind is float and type(v) is float)
    return 0 <= v < math.inf if kind is int else 0 < v < math.inf


def previous(path, settings: dict, args, key: str, kind: type, fields: dict, missing_ok: bool = False):
    """--resume: out[key] of the JSON this script left at `path` with these settings (empty when there is none or
    without --resume; missing_ok: also when the output has no `key` yet); each entry a dict with `fields`
    (bad_field's kinds)."""
    old = read_json(path) if args.resume else None
    if old is None:
        return kind()
    check_settings(path, old.get("settings") if isinstance(old, dict) else None, settings)
    if missing_ok and key not in old:
        return kind()
    entries = old.get(key)
    ok = isinstance(entries, kind) and all(isinstance(x, dict) and bad_field(x, fields) is None
                                           for x in (entries.values() if kind is dict else entries))
    if not ok:
        raise UserError(f"--resume: {path} has no {key} as this script writes them (run without --resume to replace "
                        "it)")
    return kind(measured(path, entries, fields))


def measured(path, entries, fields: dict):
    """The entries (a dict's items, or a list's rows) whose numbers are measurements (bad_field's values) and whose
    content is what save() wrote (its checksum); each other is left out to be measured again, with one line naming
    it and why."""
    for name, x in entries.items() if isinstance(entries, dict) else ((None, x) for x in entries):
        bad = bad_field(x, fields, values=True)
        row = name if name is not None else ", ".join(f"{f} {x[f]}" for f in fields if fields[f] in (str, int))
        if bad is not None:
            print(f"--resume: {path}: {row} has {bad} = {x[bad]} (not a measurement: a finite number > 0): measuring "
                  "it again", file=sys.stderr)
        elif x.get("sum") != checksum(x):
            print(f"--resume: {path}: {row}: its content does not match its checksum (edited since it was written): "
                  "measuring it again", file=sys.stderr)
        else:
            yield (name, x) if isinstance(entries, dict) else x


def signed(value):
    """A list's or a dict's entries that are dicts, each with its checksum as "sum"; any other value as it is."""
    if isinstance(value, list) and value and all(isinstance(x, dict) for x in value):
        return [x | {"sum": checksum(x)} for x in value]
    if isinstance(value, dict) and value and all(isinstance(x, dict) for x in value.values()):
        return {k: x | {"sum": checksum(x)} for k, x in value.items()}
    return value


def save(path, args, settings: dict, **out) -> None:
    """The output JSON: the arguments, the settings and `out`, each entry of its tables signed (checksum)."""
    out = {k: signed(v) for k, v in out.items()}
    write_atomic(path, json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "settings": settings, **out},
                                  indent=2))


def run_one(script: str, argv: list[str], what: str) -> dict:
    """One configuration in a fresh process (`script` with this process's arguments and `argv` added); its JSON line. A failure ends the run
    with one line; the process's whole output goes to a log."""
    r = run_child([sys.executable, script, *sys.argv[1:], *argv])
    try:
        return json_result(r, what, "bench")
    except EnvironmentFailure as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


def json_result(r: subprocess.CompletedProcess, what: str, log_name: str) -> dict:
    """The JSON line a measuring subprocess printed last; or EnvironmentFailure naming its last stderr line and a
    log holding its whole output (files.open_log: <log_name>-<pid>.log)."""
    lines = r.stdout.strip().splitlines()
    if r.returncode == 0 and lines:
        try:
            return json.loads(lines[-1])
        except json.JSONDecodeError:
            pass
    last = (r.stderr.strip().splitlines() or ["no result"])[-1].removeprefix("error: ")
    try:
        fd, log, _ = open_log(f"{log_name}-{os.getpid()}.log")
        with open(fd, "w") as f:
            f.write(r.stdout + r.stderr)
    except OSError as e:
        raise EnvironmentFailure(f"{what} failed (exit {r.returncode}): {last} (its whole output could not be "
                                 f"logged: {e.strerror or e})") from None
    raise EnvironmentFailure(f"{what} failed (exit {r.returncode}): {last} (whole output: {log})")


def bench_source(args) -> tuple:
    """(checkpoint, config.json): the resolved checkpoint folder, or with --random-weights the name whose shapes
    run (a short name's shipped config, or a folder holding only a config.json)."""
    if args.random_weights:
        return args.checkpoint, shape_config(args.checkpoint)[0]
    ckpt = resolve_checkpoint(args.checkpoint)
    return ckpt, read_config(ckpt)


def bench_model(args, ckpt, config: dict, kv_slots: int = 0, dtype: torch.dtype | None = None):
    """The model in --dtype (or `dtype`): the checkpoint's weights, or with --random-weights seeded random ones (seed
    0, the same in every process and configuration), refused before allocating when they and kv_slots slots of KV
    cache per layer would not fit the device's free memory."""
    dtype = dtype or getattr(torch, args.dtype)
    if not args.random_weights:
        return load_model(ckpt, dtype, args.device, config)
    kv_need = kv_cache_estimate(parse_config(config), kv_slots, dtype, kv_dtype(args))
    return random_model(config, dtype, args.device, 0, label=shape_config(args.checkpoint)[1], kv_bytes=kv_need)


def kv_dtype(args) -> torch.dtype | None:
    """--kv-dtype (int8, bfloat16): the cache's storage dtype; None: the compute dtype (the runs without the flag)."""
    return KV_DTYPES.get(getattr(args, "kv_dtype", None))


def weights_label(args, config: dict | None = None) -> str:
    """The weights' format: the run's dtype, or a quantize.py checkpoint's mode, run in that dtype."""
    if args.random_weights:
        return f"random {args.dtype} weights (seed 0)"
    quant = short_weights(args, config)
    return f"{quant} weights, run in {args.dtype}" if quant != args.dtype else args.dtype


def short_weights(args, config: dict | None) -> str:
    """int8, int4-g32 (a quantize.py checkpoint), else the run's dtype."""
    quant = (config or {}).get("budgetkv_quantization")
    if not isinstance(quant, dict):
        return args.dtype
    return quant.get("mode", "?") + (f"-g{quant['groupsize']}" if quant.get("groupsize") else "")


def config_policy(label: str):
    """The policy of a configuration (a spec): `no-evict` is KeyDiff's buffer with eviction off, `full` None."""
    return policies.make("keydiff" if label == "no-evict" else label)


def check_sizes(config: dict, args) -> dict:
    """config (returned), after checking the prompt, decode steps, block and budget and each policy against it."""
    model_args = parse_config(config)
    ctx = model_args.max_seq_len
    if args.block_size > ctx:
        raise UserError(f"--block-size {args.block_size} is larger than the model's context ({ctx})")
    if args.prompt_tokens + args.decode_steps > ctx or args.budget > ctx:
        raise UserError(f"--prompt-tokens + --decode-steps ({args.prompt_tokens} + {args.decode_steps}) and --budget "
                        f"({args.budget}) must fit the model's context ({ctx})")
    run = policies.Run(args.budget, args.prompt_tokens, args.decode_steps, args.block_size, model_args)
    for name in policies.spec_list(args.policies):  # each policy against the budget, before any run
        policy = config_policy(name)
        if is_scorer(policy):
            policy.plan(run)
    return config


def bench_run(args, model, policy, prompt_len: int, budget: int | None, first_id: int, protocol: str | None = None,
              *, evict: bool = True, freeze: bool | None = None, mode: str | None = None, batch: int = 1,
              new_tokens: int | None = None) -> Generation:
    """The run a configuration times, as a user's takes it: an engine.Generation of `policy` at `budget` (None:
    the run's default) over `batch` prompts of prompt_len tokens and new_tokens new ones (default --decode-steps +
    1: the first, then one per step), in --block-size blocks, set up and, with
    --compile, compiled as generate.py compiles (the prefill-block step as --compile-prefill says, by default as
    generate.py decides; frozen
    with --freeze, or as `freeze` says; in --compile-mode, or `mode`) and warmed up on first_id. evict=False: the
    no-evict baseline."""
    gen = Generation(model.args, policy, [prompt_len] * batch, budget=budget,
                     max_new_tokens=new_tokens or 1 + args.decode_steps,
                     block_size=args.block_size, prefill=protocol, kv_dtype=kv_dtype(args), device=args.device,
                     evict=evict)
    gen.setup(model)
    if args.compile:
        freeze = getattr(args, "freeze", False) if freeze is None else freeze
        gen.compile(model, first_id, mode or args.compile_mode, args.compile_prefill, freeze)
    else:
        gen.compile_s = timed(lambda: gen.warm_up(model, first_id))  # first calls' costs, untimed as compiled ones
    return gen


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def noise_note(repeats: int) -> None:
    """One line under a table whose timings rest on a single sample each."""
    if repeats == 1:
        print("\nnote: --repeats 1 times each configuration once: its overheads and ratios are dominated by noise "
              "(give --repeats 3 or more for numbers to compare)")


def steps_label(args) -> str:
    prefill = {True: ", prefill too", False: ", decode only", None: ""}[args.compile_prefill]
    return f"compiled{prefill}" if args.compile else "eager"


def time_policy(model, ids, gen: Generation, args) -> dict:
    """Median prefill time of a run set up by bench_run (block-wise, or one-shot: dense layer-major prefill then
    one compression, eager even with --compile, as in generate.py; it ends with the first token's argmax, so it is
    also the TTFT) and median decode step time over repeats (and per repeat), per-phase peak memory, and the greedy
    tokens (the first + one per decode step) of the last repeat."""
    mem = PeakMemory(args.device)
    prefill_s, step_s, prefill_peak, decode_peak, per_repeat = [], [], [], [], []
    with torch.inference_mode():
        dynamo = args.compile and "torch._dynamo" in sys.modules  # not imported: eager, or the AOT decode step alone
        if dynamo:  # a recompile inside the timed loop would be a bug
            torch._dynamo.config.error_on_recompile = True
        for _ in range(args.repeats):
            mem.reset()
            sync(args.device)
            t0 = time.perf_counter()
            token, (toks,) = first_tokens(gen.prefill(model, [ids]))  # its host copy waits for the device
            prefill_s.append(time.perf_counter() - t0)
            prefill_peak.append(mem.peak())
            release_free_memory()
            mem.reset()
            mine = []
            gen.decode(model, token, [toks], [len(ids)], on_step=lambda logits, s: mine.append(s))
            decode_peak.append(mem.peak())
            step_s += mine
            per_repeat.append(1 / statistics.median(mine))
        if dynamo:
            torch._dynamo.config.error_on_recompile = False
    weights_b, kv_read_b = decode_bytes_per_step(model)
    return {"warmup_s": gen.compile_s, "prefill_s": statistics.median(prefill_s),
            "ttft_s": statistics.median(prefill_s), "prefill_tok_s": len(ids) / statistics.median(prefill_s),
            "decode_step_ms": 1e3 * statistics.median(step_s), "decode_tok_s": 1 / statistics.median(step_s),
            "decode_tok_s_repeats": per_repeat, "tokens": toks,  # the last repeat's greedy tokens
            "prefill_peak_mib": max(prefill_peak) / 2**20, "decode_peak_mib": max(decode_peak) / 2**20,
            "kv_cache_mib": kv_bytes(model) / 2**20, "bytes_per_step": weights_b + kv_read_b}
