"""Weight-only quantization (quantize.py): per weight format, each in a fresh process, decode tok/s with the `full`
cache, bytes read per decode step (weights + KV), and the perplexity of the evaluation harness's fidelity text.

    python scripts/bench_quant.py [--modes float32,bfloat16,int8,int4-g64,int4-g32] --prompt-tokens 512
"""
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from errors import check_python  # noqa: E402

check_python()  # one line, not a traceback, in a Python without the requirements
import torch  # noqa: E402

from checkpoint import resolve_checkpoint  # noqa: E402
from cli import run_cli  # noqa: E402
from config import parse_config  # noqa: E402
import quantize  # noqa: E402
from scripts import eval as ev  # noqa: E402
from loading import load_model  # noqa: E402
from errors import UserError  # noqa: E402
from scripts.benchlib import (bench_model, bench_run, bench_settings, bench_source, check_common,  # noqa: E402
                              make_document, parser as common_parser, previous, random_prompt, run_one, save, start,
                              steps_label, time_policy)
from tokenizer import load_tokenizer  # noqa: E402

MODES = "float32,bfloat16,int8,int4-g32,int4-g64,int4-g32-qhead"


def parser():
    ap = common_parser(__doc__)
    ap.add_argument("--modes", default=MODES, help="weight formats: float32, bfloat16, int8, int4-gN; -qhead = int4 "
                    "with a quantized output head (default all of these)")
    ap.add_argument("--prompt-tokens", type=int, default=4096, help="the timed prompt's length in tokens")
    ap.add_argument("--ppl-texts", type=int, default=4, help="fidelity texts for the perplexity")
    ap.add_argument("--ppl-prefix", type=int, default=256, help="context tokens before each scored span")
    ap.add_argument("--ppl-tokens", type=int, default=128, help="scored tokens per text")
    ap.add_argument("--json", type=Path, help="also write all rows here")
    ap.add_argument("--resume", action="store_true",
                    help="skip the modes already measured in --json, which is rewritten whole after every mode; "
                         "refused if it was written with other settings")
    return ap


PPL_FLAGS = ("ppl_texts", "ppl_prefix", "ppl_tokens")


def check_args(args) -> None:
    """Bad input fails here, before any model is loaded or any configuration has run."""
    check_common(args)
    if args.prompt_tokens < 1:
        raise UserError(f"--prompt-tokens must be >= 1, got {args.prompt_tokens}")
    if args.resume and args.json is None:
        raise UserError("--resume needs --json: the file the finished configurations are kept in")
    modes = mode_list(args)
    if not modes:
        raise UserError("--modes is empty")
    for m in modes + ([args.one] if args.one else []):
        check_quant_mode(m)
    if twice := [m for i, m in enumerate(modes) if m in modes[:i]]:
        raise UserError(f"--modes lists {twice[0]} twice")
    if min(args.ppl_texts, args.ppl_prefix, args.ppl_tokens) < 1:
        raise UserError("--ppl-texts, --ppl-prefix and --ppl-tokens must be >= 1")
    if args.ppl_texts > ev.MAX_ITEMS:
        raise UserError(f"--ppl-texts must be at most {ev.MAX_ITEMS}, got {args.ppl_texts}")
    defaults = parser().parse_args([])
    if args.random_weights and any(getattr(args, k) != getattr(defaults, k) for k in PPL_FLAGS):
        raise UserError("--ppl-texts, --ppl-prefix and --ppl-tokens set the perplexity, which --random-weights does "
                        "not measure: drop them")


def run(args) -> None:
    check_args(args)
    start(args)
    if not args.one:
        return run_quant(args)
    t = time.perf_counter()
    r = quant_one(args.one, args)
    r["wall_s"] = time.perf_counter() - t
    print(json.dumps(r))


def quant_one(mode: str, args) -> dict:
    """One row in this process: --checkpoint in fp32 / bf16, or its quantize.py checkpoint (int8; int4-gN =
    group size N; written beside it on first use, as a user would) loaded by loading.load_model; decode tok/s and
    bytes read per step with the `full` cache on the synthetic document (block-wise prefill, as the main table);
    perplexity of the evaluation harness's fidelity text (teacher-forced continuations, scripts/eval.py)."""
    import math
    from scripts import quantize as quantize_cli
    if args.random_weights:
        return quant_random(mode, args)
    ckpt = resolve_checkpoint(args.checkpoint)
    tok = load_tokenizer(ckpt)
    if mode.startswith("int"):
        spec, qhead = mode.removesuffix("-qhead"), mode.endswith("-qhead")  # -qhead: int4 with a quantized head
        kind, _, g = spec.partition("-g")
        qdir = quantize.default_out(ckpt, kind, int(g) if g else None)
        qdir = qdir.with_name(qdir.name + "-qhead") if qhead else qdir
        if not (qdir / "config.json").is_file():
            argv = ["--checkpoint", str(ckpt), "--mode", kind, "--out", str(qdir)] + (["--groupsize", g] if g else [])
            argv += ["--head", "quantize"] if qhead else []
            if quantize_cli.main(argv) != 0:
                sys.exit(f"scripts/quantize.py {' '.join(argv)} failed")
        ckpt = qdir
    model = load_model(ckpt, torch.bfloat16 if mode == "bfloat16" else torch.float32, args.device)
    _, ids = make_document(tok, args.prompt_tokens)
    gen = bench_run(args, model, None, len(ids), None, ids[0])
    r = time_policy(model, ids, gen, args)
    texts = ev.fidelity_texts(tok, args.ppl_texts, args.ppl_prefix + args.ppl_tokens, seed=0)
    records = ev.fidelity(model, texts, args.ppl_prefix, [("block", "full", None)], block_size=args.block_size,
                          steps=gen.steps)
    r["nll"] = sum(x["nll"] for x in records) / len(records)
    r["ppl"] = math.exp(r["nll"])
    r["mode"] = mode
    r["kernels"] = quantize.summary(model)["kernels"]
    return r


def quant_random(mode: str, args) -> dict:
    """One row with --random-weights: the shapes' random model (float32, or bfloat16 for that mode)
    quantized in memory by quantize.quantize_model, the `full` cache on random prompt ids; no perplexity (random
    weights have none worth reporting)."""
    ckpt, config = bench_source(args)
    ids = random_prompt(config, args.prompt_tokens)
    model = bench_model(args, ckpt, config, len(ids) + args.decode_steps + args.block_size,
                        dtype=torch.bfloat16 if mode == "bfloat16" else torch.float32)
    if mode.startswith("int"):
        kind, _, g = mode.removesuffix("-qhead").partition("-g")
        quantize.quantize_model(model, kind, int(g) if g else None, head=True if mode.endswith("-qhead") else None)
    r = time_policy(model, ids, bench_run(args, model, None, len(ids), None, ids[0]), args)
    return r | {"mode": mode, "ppl": None, "kernels": quantize.summary(model)["kernels"]}


def run_quant(args) -> None:
    modes = mode_list(args)  # checked in check_args
    ckpt, config = bench_source(args)
    model_args = parse_config(config)
    ctx = model_args.max_seq_len
    for m in modes:  # an int4 group size must divide the model's in-features
        kind, _, g = m.removesuffix("-qhead").partition("-g")
        if kind == "int4":
            try:
                quantize.check_mode(kind, int(g), quantize.in_features(model_args))
            except UserError as e:
                raise UserError(f"--modes {m}: {e}") from None
    if args.block_size > ctx:
        raise UserError(f"--block-size {args.block_size} is larger than the model's context ({ctx})")
    if not args.random_weights and args.ppl_prefix + args.ppl_tokens > ctx:
        raise UserError(f"--ppl-prefix + --ppl-tokens ({args.ppl_prefix} + {args.ppl_tokens}) must fit the model's "
                        f"context ({ctx})")
    if args.prompt_tokens + args.decode_steps > ctx:
        raise UserError(f"--prompt-tokens + --decode-steps ({args.prompt_tokens} + {args.decode_steps}) must fit the "
                        f"model's context ({ctx})")
    settings = bench_settings(args, ckpt, "quant")
    fields = QUANT_FIELDS | {"ppl": None if args.random_weights else float}
    old = {x["mode"]: x for x in previous(args.json, settings, args, "rows", list, fields)}
    ppl = "no perplexity (random weights)" if args.random_weights else \
        f"perplexity: {args.ppl_texts} fidelity texts, {args.ppl_tokens} tokens after {args.ppl_prefix}"
    print(f"{args.checkpoint}: weight formats {modes}; decode: full cache, prompt {args.prompt_tokens} tokens, "
          f"{args.decode_steps} decode steps x {args.repeats} repeats; {ppl}; "
          f"{'random weights (seed 0), ' if args.random_weights else ''}"
          f"{args.device}, {steps_label(args)}, torch threads {torch.get_num_threads()}", file=sys.stderr)
    rows = []
    for mode in modes:
        if mode in old:  # --resume: measured by an earlier run with the same settings
            rows.append(old[mode])
            print(f"  {mode:10s} (from {args.json})", file=sys.stderr)
            continue
        rows.append(run_one(__file__, ["--one", mode], mode))
        x = rows[-1]
        print(f"  {mode:10s} decode {x['decode_tok_s']:5.1f} tok/s  prefill {x['prefill_tok_s']:6.1f} tok/s  "
              f"ppl {ppl_text(x['ppl'])}  [{x['kernels']}, total {x['wall_s']:.0f} s]", file=sys.stderr)
        if args.json:  # after every configuration: a stopped run keeps what it measured (--resume goes on)
            save(args.json, args, settings, rows=rows)
    if args.json:  # with the kept rows after the last one measured
        save(args.json, args, settings, rows=rows)
    base = next((x for x in rows if x["mode"] == "float32"), rows[0])
    print(f"\n| mode | bytes read / decode step (MiB) | decode tok/s | vs {base['mode']} | prefill tok/s | "
          f"perplexity | vs {base['mode']} | peak MiB decode |")
    print("|---|---|---|---|---|---|---|---|")
    for x in rows:
        print(f"| {x['mode']} | {x['bytes_per_step'] / 2**20:.0f} | {x['decode_tok_s']:.1f} | "
              f"{x['decode_tok_s'] / base['decode_tok_s']:.2f}x | {x['prefill_tok_s']:.0f} | {ppl_text(x['ppl'])} | "
              f"{'–' if x['ppl'] is None else format(x['ppl'] / base['ppl'] - 1, '+.2%')} | "
              f"{x['decode_peak_mib']:.0f} |")


def ppl_text(ppl: float | None) -> str:
    return "–" if ppl is None else f"{ppl:.4f}"


def mode_list(args) -> list[str]:
    return [m.strip() for m in args.modes.split(",") if m.strip()]


def check_quant_mode(m: str) -> None:
    kind, _, g = m.removesuffix("-qhead").partition("-g")
    if not (m in ("float32", "bfloat16", "int8") or kind == "int4" and g in map(str, quantize.GROUP_SIZES)):
        raise UserError(f"unknown --modes entry {m!r} (float32, bfloat16, int8, int4-gN, int4-gN-qhead; N is "
                        f"{', '.join(map(str, quantize.GROUP_SIZES))})")


QUANT_FIELDS = {"mode": str, "decode_tok_s": float, "bytes_per_step": float, "prefill_tok_s": float,
                "decode_peak_mib": float}  # and "ppl": float, null with --random-weights


def main():
    return run_cli(run, parser().parse_args())


if __name__ == "__main__":
    sys.exit(main())
