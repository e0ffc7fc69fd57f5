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
from errors import UserError, check_python  # noqa: E402

check_python()  # first: Ctrl-C from here on is one line
import json  # noqa: E402
from contextlib import nullcontext  # noqa: E402

import runtime  # noqa: E402
import torch  # noqa: E402

import generate_args  # noqa: E402
import progress  # noqa: E402
import speculative  # noqa: E402
import ranks  # noqa: E402
import tp  # noqa: E402
from cache import KV_DTYPES  # noqa: E402
from checkpoint import resolve_checkpoint, shape_config, weights_format  # noqa: E402
from cli import compile_log, is_verbose, run_ranks  # noqa: E402
from config import parse_config  # noqa: E402
from convert import read_config  # noqa: E402
from engine import Generation, prefill_protocol, stop_reason, sync  # noqa: E402
from files import export_trace  # noqa: E402
from generate_args import batch_of, check_args, compute_dtype, prompt_ids, read_prompts, sampling_of  # noqa: E402
from progress import prefill_progress  # noqa: E402
from sampling import StopStrings  # noqa: E402
from tokenizer import check_prompt_ids  # noqa: E402

CACHE_NOTES = {"hit": "from the compile cache", "miss": "now cached for the next run",
               "bypass": "not cacheable: compiles again next run", "off": "cache off"}


def parse_args(argv=None):
    return generate_args.parse_args(argv, __doc__)


def tokenize(a, tokenizer, text: str, i: int, n: int, ckpt, vocab_size: int) -> list[int]:
    """Prompt i of n as token ids (the chat template unless --no-chat or the checkpoint has none); a prompt that
    tokenizes to nothing, or to ids outside the model's vocabulary, is refused."""
    chat = not a.no_chat and tokenizer.chat_template is not None
    which = f"prompt {i + 1} of the batch" if n > 1 else "the prompt"
    return check_prompt_ids(tokenizer.prompt_ids(text, chat=not a.no_chat), vocab_size, which, str(ckpt),
                            " with the chat template" if chat else "")


def run(a) -> int:
    import policies
    check_args(a)
    progress.quiet = a.quiet  # for every line of this run: a conversion's too
    policy = policies.make(a.policy)  # unknown names and parameters fail before any loading
    sampling = sampling_of(a)
    mesh = ranks.start(a.tp, a.device, interactive=a.interactive, speculate=bool(a.speculate),
                    aot=a.compile_mode == runtime.AOT)
    a.device = ranks.rank_device(a.device, mesh)
    draft_policy = None
    if a.speculate:  # --prefill is the draft's; the target is full
        a.draft_policy, draft_policy, a.draft_prefill = speculative.draft_policy(policy, a.draft_policy,
                                                                                 a.draft_checkpoint, a.prefill)
    a.prefill = prefill_protocol(policy, a.prefill)
    if a.prefill == "one-shot" and a.compile_prefill is not None:
        raise UserError("--compile-prefill / --no-compile-prefill apply to --prefill block: a one-shot prefill never "
                        "runs the block step")
    texts = None if a.random_weights or a.interactive else ranks.from_rank0(lambda: read_prompts(a), mesh)
    dtype = compute_dtype(a)
    torch.manual_seed(a.seed or 0)
    runtime.set_threads(a.threads)
    if a.interactive:
        return run_interactive(a, policy, sampling, dtype, mesh)
    ckpt, config, tokenizer, model, prompts = load(a, texts, dtype, mesh)
    run_kind, settings = Generation, dict(prefill=a.prefill, evict_before_attend=a.evict_before_attend)
    if a.speculate:  # the target's settings, and the draft's
        run_kind, settings = speculative.Speculation, dict(draft_policy=draft_policy, k=a.speculate,
                                                           draft_budget=a.draft_budget, draft_prefill=a.draft_prefill)
    gen = run_kind(parse_config(config) if model is None else model.args, policy, [len(p) for p in prompts],
                   budget=a.budget, max_new_tokens=a.max_new_tokens, block_size=a.block_size,
                   kv_dtype=KV_DTYPES.get(a.kv_dtype), sampling=sampling, device=a.device, **settings)
    if model is None:  # random weights: built once the KV cache it must leave room for is known
        model = tp.random_model(config, dtype, a.device, a.seed or 0, mesh, label=a.shapes,
                                kv_bytes=gen.kv_bytes_needed(dtype))
    dtype_name = str(dtype).removeprefix("torch.")
    weights = weights_format(model.config, dtype_name, a.shapes if a.random_weights else None, a.seed or 0)
    if a.speculate:
        return run_speculative(a, model, tokenizer, prompts[0], dtype, gen, weights)
    gen.setup(model)  # the caches, once checked against the memory the weights left
    compile_run(a, gen, model, prompts[0][0])
    outs, stats, stream = generate_streamed(a, gen, model, tokenizer, prompts)
    stats.update(checkpoint=str(ckpt), policy=a.policy, kv_dtype=a.kv_dtype, dtype=dtype_name, weights=weights,
                 random_weights=a.random_weights, device=a.device)
    tp_line = tp.report(mesh, model, stats) if mesh.world > 1 else None  # every rank's KV bytes and peaks
    print_result(a, gen, stats, outs, stream, tp_line)
    return 0


def run_interactive(a, policy, sampling, dtype, mesh) -> int:
    """--interactive: a chat.Chat with the flags' settings (each default clamped to the model's context, a value
    given must fit), --compile's steps compiled before the first turn, then the REPL."""
    import chat
    _, _, tokenizer, model, _ = load(a, [], dtype, mesh)
    conversation = chat.Chat(model, tokenizer, policy, a.budget, max_new_tokens=a.max_new_tokens,
                             block_size=a.block_size, prefill=a.prefill, sampling=sampling,
                             kv_dtype=KV_DTYPES.get(a.kv_dtype), chat_template=not a.no_chat,
                             evict_before_attend=a.evict_before_attend)
    if a.compile:
        conversation.compile(a.compile_mode, a.compile_prefill, a.freeze,
                             around=lambda g: compile_log(g.compile_mode, g.compiled_prefill, a.freeze, is_verbose(a)))
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
        bar, on_prefill = prefill_progress(sum(gen.lens), model.args.n_layers, a.prefill == "one-shot" and n == 1,
                                           lambda: sync(a.device))
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
                 "generated_tokens": len(o), "stop_reason": why} for o, n, why in zip(outs, lens, stats["stop_reason"])]
        counts = (f"batch of {len(outs)}: {sum(lens)} prompt tokens, {sum(map(len, outs))} generated "
                  f"(decode tok/s over all sequences)")
    else:
        text_out = decoded(outs[0])
        counts = (f"{stats['prompt_tokens']} prompt tokens, {stats['generated_tokens']} generated (stopped: "
                  f"{stats['stop_reason']})")
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
          f"policy {a.policy} ({a.prefill} prefill), budget {gen.budget} slots{slots}, {stats['tokens_held']} tokens "
          f"held, "
          f"{count(stats['slots_read_per_step'])} slots read per decode step | prefill {stats['prefill_chunk']} "
          f"tokens a step, "
          f"{stats['weights']} on {a.device} ({threads_said(stats)})"
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
              ", ".join(f"--{name.replace('_', '-')} {d} -> {v}" for name, (d, v) in gen.clamped.items()),
              file=sys.stderr)


def compile_run(a, gen, model, first_id: int) -> None:
    """--compile: the run's steps compiled as the flags say, the compiler's log and ticker around it."""
    if a.compile:
        gen.compile(model, first_id, a.compile_mode, a.compile_prefill, a.freeze,
                    around=lambda g: compile_log(g.compile_mode, g.compiled_prefill, a.freeze, is_verbose(a)))


def run_speculative(a, model, tokenizer, ids, dtype, gen, weights: str) -> int:
    """--speculate K: the draft and both caches (speculative.py), a note when the bandwidth model predicts a loss or
    the device is a CPU, the generation streamed, and a summary with the acceptance and the predicted speedup."""
    draft = speculative.load_draft(model, a.draft_checkpoint, dtype, a.device,
                                   (a.seed or 0) if a.random_weights else None)
    L, N, K = len(ids), gen.max_new_tokens, a.speculate
    slots, draft_slots = gen.setup(model, draft)
    best = speculative.predicted_speedup(model, draft, K)
    if best < 1:
        print(f"note: speculation is predicted to lose here: even keeping every draft, the bandwidth model gives "
              f"{best:.2f}x; it pays when the full cache's KV dominates a step (a long context) and the draft "
              "budget is small", file=sys.stderr)
    elif a.device == "cpu":  # the bandwidth model counts bytes; on a CPU the K+1 block's compute decides
        print(f"note: the bandwidth model predicts up to {best:.2f}x, but on a CPU a K+1 verification block costs "
              "more than a decode step (its attention grows with the queries): docs/speculative.md has the CPU "
              "measurements; time yours with scripts/bench_speculate.py", file=sys.stderr)
    compile_run(a, gen, model, ids[0])
    stream = TextStream(tokenizer)
    bar, on_prefill = prefill_progress(L, model.args.n_layers, sync=lambda: sync(a.device))
    stream.bar = bar
    with bar:
        (out,), stats = gen.generate(model, [ids], eos_ids=set(tokenizer.eos_ids) if tokenizer else set(),
                                     on_token=None if a.json else stream, on_prefill=on_prefill)
    stats.update(policy="full", budget=slots, draft_policy=a.draft_policy, draft_budget=draft_slots,
                 draft_checkpoint=a.draft_checkpoint, draft_prefill=a.draft_prefill, weights=weights,
                 device=a.device, max_new_tokens=N,
                 stop_reason=stop_reason(out, N, set(tokenizer.eos_ids) if tokenizer else set(),
                                         context="max_new_tokens" in gen.clamped),
                 clamped_to_context={name: {"default": d, "used": v} for name, (d, v) in gen.clamped.items()})
    if a.json:
        print(json.dumps({"text": None if a.random_weights else stream.decoded(out), "token_ids": out, **stats}))
        return 0
    print(flush=True)
    mib, compiled = 2 ** 20, f", compiled in {stats['compile_s']:.1f} s" if a.compile else ""
    chunk = f" (the target {stats['prefill_chunk']})" if stats["prefill_chunk"] != gen.block_size else ""
    print(f"--- {stats['prompt_tokens']} prompt tokens, {stats['generated_tokens']} generated | speculate "
          f"K={K}: draft {a.draft_policy} ({a.draft_prefill} prefill) {draft_slots} slots, "
          f"{count(stats['draft_slots_read_per_step'])} slots read per draft step"
          f"{', ' + a.draft_checkpoint if a.draft_checkpoint else ''}; target full, {slots} slots | "
          f"prefill {gen.block_size} tokens a step{chunk}, {weights} on {a.device}{compiled}\n"
          f"{stats['rounds']} rounds: {stats['accepted_per_round']:.2f} of {K} drafts kept per round (acceptance "
          f"{stats['acceptance_rate']:.0%}) | bandwidth model: {stats['predicted_speedup']:.2f}x decode speedup "
          f"predicted at this acceptance ({best:.2f}x with every draft kept)\n"
          f"TTFT {stats['ttft_s']:.3f} s (both caches) | prefill {stats['prefill_tok_s']:.1f} tok/s | decode "
          f"{stats['decode_tok_s']:.2f} tok/s | KV caches {stats['kv_cache_bytes'] / mib:.2f} MiB | peak memory "
          f"({stats['memory_measure']}): prefill {stats['prefill_peak_bytes'] / mib:.1f} MiB, decode "
          f"{stats['decode_peak_bytes'] / mib:.1f} MiB", file=sys.stderr)
    return 0


def threads_said(stats: dict) -> str:
    """'2 threads', or how an adaptive count moved: '1 thread (adaptive, up to 2; 2 -> 1 at 3.1 s: 1.0 cores of
    other work)'."""
    n, moves = stats["threads"], stats["thread_changes"]
    said = f"{n} thread{'s' if n > 1 else ''}"
    if not moves:
        return said
    last = "; ".join(f"{t} at {s} s: {c} cores of other work" for s, t, c in moves[-3:])
    k = stats["thread_moves"]
    return f"{said} ({stats['thread_policy']}; {k} change{'s' if k > 1 else ''}, last: {last})"


def count(x: float) -> str:
    """A count as an integer (257, not 257.0); a token-equivalent that is not one (RocketKV's reads) with a decimal."""
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}"


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


def main(argv=None) -> int:
    return run_ranks(run, lambda: parse_args(argv))  # under torchrun only rank 0 prints, from the first line on


if __name__ == "__main__":
    sys.exit(main())
