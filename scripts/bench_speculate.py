"""Self-speculative decoding (speculative.py) against plain decoding of the same
target with its full cache, measured in the same process.

    python scripts/bench_speculate.py [--policies sink,snapkv,tova,keydiff,rocketkv] [--budgets 256,512]
                                      [--ks 2,4,6] [--contexts 2048,4096,8000] [--weights float32,bfloat16,int8]
                                      [--new-tokens 64] [--repeats 1] [--compile] [--json out.json] [--plot speedup.png]

For each weight format (one model per format, in memory: int8 by quantize.quantize_model, as bench_quant.py
does with random weights) and each context (a prompt of that many tokens: --text prose, a window of the
evaluation's fidelity text to continue, or needle, bench.py's document and question; random ids with
--random-weights), the target's full cache is prefilled ONCE; each draft (policy, budget) cache is prefilled once
(its policy's protocol) and snapshotted. Every measurement starts from that state: the target rolled back to the
prompt (slot == position: the slots past it emptied), the draft restored from its snapshot. Then:
- plain: --new-tokens greedy tokens by the target's own decode step (full cache); its tokens are the reference,
  and it is timed again right before each speculative measurement (plain and speculative alternate --repeats times:
  each row's speedup pairs two timings taken under the same conditions);
- for each draft (policy, budget) and K: speculative.decode of the same tokens, timed; acceptance (mean drafts kept
  per round), whether its tokens are plain's and else the first that differs, with plain's top-2 logit gap at that
  token (greedy identity: a K+1 block's logits equal single steps' up to rounding, ~1e-5 in fp32; with bf16
  activations, which CPU's int8 kernel uses eager, ~0.1, and bf16 logits, 0.25 apart at 32-64, so a near-tie or a
  tie may flip there: a gap of 0 is a tie, which argmax breaks by the lower id), decode tok/s and the speedup over plain, and the bandwidth model's
  prediction from bytes per round at the measured acceptance (speculative.predicted_speedup: K draft steps, one
  more when all K are kept, plus one verification that reads what a target step reads; engine.decode_bytes_per_step
  of both caches), and beside it the step-time model: the same round costed with this machine's measured draft
  step and verification block (on a CPU a K+1 block costs more than a step: its attention grows with the queries).
Timings are medians over --repeats. With --compile the decode step, the draft step and the K+1 verification block
are compiled (fullgraph; CUDA graphs on a GPU), dynamo reset between draft configurations (the plain step compiled
again after each reset), and each step runs once untimed first (compiling, or loading from build/inductor-cache). Prefill stays eager.
`--plot`: speedup against context, one line per draft policy (its best budget and K at each context; dashed: the
bandwidth model's prediction for that configuration), one panel per weight format.
"""
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import engine  # noqa: E402
from engine import Generation  # noqa: E402
import runtime  # noqa: E402
import loading  # noqa: E402
import policies  # noqa: E402
from cache import is_scorer  # noqa: E402
import speculative  # noqa: E402
from cli import Parser, run_cli  # noqa: E402
from files import check_writable  # noqa: E402
from errors import UserError, check_int  # noqa: E402
from config import parse_config  # noqa: E402
from model import set_layer_regions  # noqa: E402
from scripts.benchlib import MAX_REPEATS, int_list, make_document  # noqa: E402
from scripts.outputs import save_png, write_atomic  # noqa: E402

WEIGHTS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.float32}


def parser() -> Parser:
    ap = Parser(description=__doc__)
    ap.add_argument("--checkpoint", default="smollm2-135m", help="generate.py's --checkpoint")
    ap.add_argument("--random-weights", action="store_true",
                    help="--checkpoint's shapes with seeded random weights and random prompt ids (acceptance then "
                         "means little; speed does not depend on the weights)")
    ap.add_argument("--policies", default="sink,snapkv,tova,keydiff,rocketkv", help="draft policies (specs)")
    ap.add_argument("--budgets", default="256,512", help="draft budgets (slots per layer and KV head)")
    ap.add_argument("--ks", default="2,4,6", help="drafts per round")
    ap.add_argument("--contexts", default="2048,4096,8000", help="prompt lengths (SmolLM2's context is 8192)")
    ap.add_argument("--weights", default="float32,bfloat16,int8", help="weight formats: float32, bfloat16, int8")
    ap.add_argument("--text", choices=["prose", "needle"], default="prose",
                    help="the prompt: prose (a window of Python's pydoc topics, continued: the evaluation's fidelity "
                         "text) or needle (bench.py's document whose question asks for its first sentence: a sink "
                         "draft cannot know the answer)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per measurement")
    ap.add_argument("--repeats", type=int, default=1, help="timed repeats of each measurement (median)")
    ap.add_argument("--block-size", type=int, default=128, help="prefill block size in tokens")
    ap.add_argument("--compile", action="store_true", help="compile the decode, draft and verification steps")
    ap.add_argument("--freeze", action="store_true",
                    help="with --compile: fold the weights into each graph (generate.py --freeze; on CPU in fp32 "
                         "max-autotune's packed GEMM templates; minutes of compiling per graph, a copy per graph)")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu, cuda or cuda:N (default: cuda where there is one, else cpu)")
    ap.add_argument("--json", type=Path, help="write the settings and every row here")
    ap.add_argument("--plot", type=Path, help="write the speedup-vs-context plot (PNG) here")
    return ap


def check_args(a) -> dict:
    """Every list parsed and checked before a model is loaded; returns the lists."""
    lists = dict(policies=policies.spec_list(a.policies), budgets=int_list(a.budgets, "--budgets"),
                 ks=int_list(a.ks, "--ks"), contexts=int_list(a.contexts, "--contexts"),
                 weights=[w for w in a.weights.split(",") if w])
    for spec in lists["policies"]:
        if not is_scorer(policies.make(spec)):
            raise UserError(f"--policies: {spec} keeps every token and cannot draft over the target's weights")
    for k in lists["ks"]:
        speculative.check_k(k, "--ks: K")
    for w in lists["weights"]:
        if w not in WEIGHTS:
            raise UserError(f"--weights: unknown format {w!r} ({', '.join(WEIGHTS)})")
    if not lists["weights"]:
        raise UserError("--weights is empty")
    if a.new_tokens < 2 or a.block_size < 1:
        raise UserError("need --new-tokens >= 2 and --block-size >= 1")
    check_int("repeats", a.repeats, 1, MAX_REPEATS)
    if a.freeze and not a.compile:
        raise UserError("--freeze needs --compile")
    if a.threads is not None:
        check_int("threads", a.threads, 1, runtime.MAX_THREADS)
    for path, flag in ((a.json, "--json"), (a.plot, "--plot")):
        if path is not None:
            check_writable(path, flag)
    return lists


def source(a):
    """(checkpoint, config, tokenizer or None)."""
    from checkpoint import resolve_checkpoint, shape_config
    from convert import read_config
    from tokenizer import load_tokenizer
    if a.random_weights:
        return a.checkpoint, shape_config(a.checkpoint)[0], None
    ckpt = resolve_checkpoint(a.checkpoint)
    return ckpt, read_config(ckpt), load_tokenizer(ckpt)


def make_model(a, ckpt, config, weights: str):
    import quantize
    dtype = WEIGHTS[weights]
    model = (loading.random_model(config, dtype, a.device, 0) if a.random_weights else
             loading.load_model(ckpt, dtype, a.device, config))
    if weights == "int8":
        quantize.quantize_model(model, "int8")
    return model


def prompt_ids(tokenizer, config: dict, n: int, text: str) -> list[int]:
    """n prompt ids: random ones (random weights), a window of the fidelity prose, or the needle document."""
    if tokenizer is None:
        vocab = parse_config(config).vocab_size
        return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    if text == "prose":
        from scripts.eval import fidelity_texts
        return fidelity_texts(tokenizer, 1, n, seed=0)[0]
    return make_document(tokenizer, n)[1]


def snapshot(model) -> list[list[torch.Tensor]]:
    return [[t.clone() for t in layer.attention.kv_cache._buffers.values()] for layer in model.layers]


def restore(model, state) -> None:
    for layer, saved in zip(model.layers, state, strict=True):
        for dst, src in zip(layer.attention.kv_cache._buffers.values(), saved, strict=True):
            dst.copy_(src)


def timed(fn, device: str) -> tuple:
    engine.sync(device)
    t = time.perf_counter()
    out = fn()
    engine.sync(device)
    return out, time.perf_counter() - t


@torch.inference_mode()
def plain_decode(model, step, first: int, L: int, n: int, device: str, margins: list | None = None) -> list[int]:
    """n greedy tokens from `first` at position L with the target's own decode step (engine.decode).
    margins: appended with each step's top-2 logit gap (the logits that chose out[1], out[2], ...)."""
    speculative.rollback(model, L - 1)
    out = [first]
    engine.decode(model, step, torch.tensor([first], device=device), [out], [L], n,
                  on_step=None if margins is None else lambda logits, s: margins.append(top2_gap(logits)))
    return out


def top2_gap(logits: torch.Tensor) -> float:
    """The gap between the two largest logits, in the logits' own dtype (0 is a tie: argmax takes the lower id)."""
    top = logits.flatten().topk(2).values
    return float(top[0] - top[1])


@torch.inference_mode()
def spec_decode(target, draft, state, steps, first: int, L: int, n: int, k: int) -> tuple[list[int], list[int]]:
    speculative.rollback(target, L - 1)
    restore(draft, state)
    out = [first]
    kept, _ = speculative.decode(target, draft, out, L, n, k=k, steps=steps)
    return out, kept


@torch.inference_mode()
def step_times(target, draft, state, steps, first: int, L: int, k: int, device: str, n: int = 3) -> tuple:
    """Median seconds of one draft step and one K+1 verification block at this context (both caches restored
    after): what a round costs on this machine, beside the bandwidth model's bytes."""
    tok = torch.tensor([[first]], device=device)
    block = torch.full((1, k + 1), first, device=device)
    draft_s = [timed(lambda: steps.draft(draft, tok, torch.tensor([L], device=device)), device)[1] for _ in range(n)]
    verify_s = [timed(lambda: steps.verify(target, block, torch.arange(L, L + k + 1, device=device)), device)[1]
                for _ in range(n)]
    speculative.rollback(target, L - 1)
    restore(draft, state)
    return statistics.median(draft_s), statistics.median(verify_s)


def paired(plain, spec, repeats: int, device: str) -> tuple:
    """spec's result and the median seconds of spec and of plain, timed alternately (plain, spec, plain, ...):
    both under the same conditions on a machine whose speed drifts."""
    plain_s, spec_s = [], []
    for _ in range(repeats):
        plain_s.append(timed(plain, device)[1])
        out, s = timed(spec, device)
        spec_s.append(s)
    return out, statistics.median(spec_s), statistics.median(plain_s)


def run_context(a, lists, model, weights: str, tokenizer, config, rows: list) -> None:
    """Every draft configuration at each context for one weight format; appends to rows."""
    n, block, max_k = a.new_tokens, a.block_size, max(lists["ks"])
    draft = speculative.draft_model(model)  # after quantize_model: the draft shares the swapped modules
    for L in lists["contexts"]:
        ids = prompt_ids(tokenizer, config, L, a.text)
        L = len(ids)
        engine.setup(model, None, L + n + max_k, L, n + max_k, block)
        with torch.inference_mode():
            logits, prefill_s = timed(lambda: engine.prefill(model, torch.tensor(ids, device=a.device), block),
                                      a.device)
        first, margins = int(logits.argmax(-1)), [top2_gap(logits)]
        mode = runtime.default_compile_mode(a.device, WEIGHTS[weights], weights == "int8", a.freeze)
        mode = runtime.mode_name(None if mode == runtime.AOT else mode, a.device)  # as speculation's: torch.compile
        plain = Generation(model.args, None, [L], max_new_tokens=n + max_k, block_size=block, device=a.device)

        def plain_step():  # (re)compiled after each dynamo reset, and run once untimed
            torch._dynamo.reset()
            if not a.compile:
                return runtime.model_step
            plain.compile(model, first, mode, prefill=False, freeze=a.freeze, warm=False)
            plain_decode(model, plain.steps[1], first, L, 3, a.device)
            return plain.steps[1]
        step = plain_step()
        want, plain_s = timed(lambda: plain_decode(model, step, first, L, n, a.device, margins), a.device)
        print(f"  {weights} context {L}: prefill {prefill_s:.1f} s, plain decode {(n - 1) / plain_s:.2f} tok/s",
              file=sys.stderr)
        for spec in lists["policies"]:
            for budget in lists["budgets"]:
                row = dict(weights=weights, context=L, policy=spec, budget=budget)
                policy = policies.make(spec)
                try:
                    speculative.check_draft(policy, budget, L + n + max_k, True)
                    protocol = engine.prefill_protocol(policy, None)
                    engine.setup(draft, policy, budget, L, n + max_k, block, prefill=protocol)
                except UserError as e:
                    print(f"    {spec} budget {budget}: skipped ({e})", file=sys.stderr)
                    continue
                with torch.inference_mode():
                    engine.prefill(draft, torch.tensor(ids, device=a.device), block,
                                   one_shot=protocol == "one-shot")
                state = snapshot(draft)
                step = plain_step()  # a fresh dynamo: this draft's graphs, not the last one's
                lifecycle = speculative.Speculation(model.args, None, [L], draft_policy=policy, k=max_k,
                                                    draft_budget=budget, max_new_tokens=n, block_size=block,
                                                    device=a.device)
                if a.compile:  # compiled as generate.py --speculate compiles; warmed up below, untimed
                    lifecycle.compile(model, first, mode, prefill=False, freeze=a.freeze, warm=False)
                steps = speculative.Steps(*lifecycle.steps)
                for k in lists["ks"]:
                    if a.compile:
                        spec_decode(model, draft, state, steps, first, L, 2 * (k + 1) + 1, k)  # compile, untimed
                    (out, kept), s, plain_s = paired(lambda: plain_decode(model, step, first, L, n, a.device),
                                                     lambda: spec_decode(model, draft, state, steps, first, L, n,
                                                                         k), a.repeats, a.device)
                    draft_s, verify_s = step_times(model, draft, state, steps, first, L, k, a.device)
                    full_rounds = sum(x == k for x in kept) / len(kept)
                    round_s = (k + full_rounds) * draft_s + verify_s
                    rows.append(dict(row, k=k, accepted_per_round=sum(kept) / len(kept),
                                     plain_tok_s=(n - 1) / plain_s,
                                     plain_step_ms=plain_s / (n - 1) * 1e3, draft_step_ms=draft_s * 1e3,
                                     verify_ms=verify_s * 1e3,
                                     step_time_speedup=(sum(kept) / len(kept) + 1) * plain_s / (n - 1) / round_s,
                                     acceptance_rate=sum(kept) / (k * len(kept)), rounds=len(kept),
                                     spec_tok_s=(n - 1) / s, speedup=plain_s / s, same_tokens=out == want,
                                     first_difference=next((i for i, (x, y) in enumerate(zip(out, want)) if x != y),
                                                           None),
                                     predicted_speedup=speculative.predicted_speedup(model, draft, k, kept),
                                     best_case_speedup=speculative.predicted_speedup(model, draft, k)))
                    x = rows[-1]
                    if x["first_difference"] is not None:  # plain's own top-2 gap there: a tie or a real change
                        x["plain_margin_at_difference"] = margins[x["first_difference"]]
                    print(f"    {spec:10s} budget {budget:5d} K={k}: {x['accepted_per_round']:.2f} kept/round, "
                          f"{x['spec_tok_s']:.2f} tok/s, speedup {x['speedup']:.2f}x (predicted "
                          f"{x['predicted_speedup']:.2f}x; from step times {x['step_time_speedup']:.2f}x: draft "
                          f"{x['draft_step_ms']:.1f} ms, verify {x['verify_ms']:.1f} ms, plain "
                          f"{x['plain_step_ms']:.1f} ms)"
                          f"{'' if x['same_tokens'] else ', tokens differ from ' + difference(x)}",
                          file=sys.stderr)
                    if a.json:
                        save(a, rows)
        engine.setup(model, None, 1, 1, 0, 1)  # free the full cache before the next context's
    torch._dynamo.reset()
    torch._inductor.config.freezing = False
    set_layer_regions(True)


def save(a, rows: list) -> None:
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items() if k not in ("json", "plot")}
    settings["threads"] = torch.get_num_threads()
    write_atomic(a.json, json.dumps({"settings": settings, "rows": rows}, indent=1))


def difference(row: dict) -> str:
    """Where a row's tokens first differ from plain decoding's, with plain's top-2 logit gap at that token."""
    return (f"token {row['first_difference']} (plain's top-2 gap there "
            f"{row.get('plain_margin_at_difference', float('nan')):.3g})")


def table(rows: list) -> str:
    lines = ["| weights | context | draft | budget | K | kept / round | acceptance | plain tok/s | spec tok/s | "
             "speedup | predicted | best case | step-time model | verify / plain step | same tokens |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for x in rows:
        lines.append(f"| {x['weights']} | {x['context']} | {x['policy']} | {x['budget']} | {x['k']} | "
                     f"{x['accepted_per_round']:.2f} | {x['acceptance_rate']:.0%} | {x['plain_tok_s']:.2f} | "
                     f"{x['spec_tok_s']:.2f} | {x['speedup']:.2f}x | {x['predicted_speedup']:.2f}x | "
                     f"{x['best_case_speedup']:.2f}x | {x['step_time_speedup']:.2f}x | "
                     f"{x['verify_ms'] / x['plain_step_ms']:.2f} | "
                     f"{'yes' if x['same_tokens'] else 'from ' + difference(x)} |")
    return "\n".join(lines)


def plot(rows: list, path: Path) -> None:
    """Speedup vs context, one line per draft policy (its best budget and K at each context), one panel per weight
    format; dashed: the bandwidth model's prediction for the plotted configuration."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    formats = list(dict.fromkeys(x["weights"] for x in rows))
    fig, axes = plt.subplots(1, len(formats), figsize=(5 * len(formats), 4), squeeze=False)
    for ax, w in zip(axes[0], formats):
        for i, spec in enumerate(dict.fromkeys(x["policy"] for x in rows)):
            best = {}
            for x in rows:
                if x["weights"] == w and x["policy"] == spec and x["speedup"] > best.get(x["context"], {}).get(
                        "speedup", -1):
                    best[x["context"]] = x
            ctx = sorted(best)
            color = f"C{i}"
            ax.plot(ctx, [best[c]["speedup"] for c in ctx], "o-", color=color, label=spec)
            ax.plot(ctx, [best[c]["predicted_speedup"] for c in ctx], "--", color=color, alpha=0.6)
        ax.axhline(1, color="grey", lw=0.8)
        ax.set(title=f"{w} weights", xlabel="context (tokens)", ylabel="decode speedup over plain full cache")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("self-speculative decoding: best budget and K per point (dashed: bandwidth model)")
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    plt.close(fig)


def run(a) -> int:
    lists = check_args(a)
    if a.threads:
        torch.set_num_threads(a.threads)
    ckpt, config, tokenizer = source(a)
    ctx = parse_config(config).max_seq_len
    if max(lists["contexts"]) + a.new_tokens + max(lists["ks"]) > ctx:
        raise UserError(f"--contexts up to {max(lists['contexts'])} + --new-tokens {a.new_tokens} + K "
                        f"{max(lists['ks'])} exceed the model's context ({ctx})")
    print(f"{a.checkpoint}: --speculate, drafts {lists['policies']} x budgets {lists['budgets']} x K {lists['ks']}, "
          f"contexts {lists['contexts']}, weights {lists['weights']}, {a.new_tokens} tokens x {a.repeats} repeats, "
          f"{('compiled, frozen' if a.freeze else 'compiled') if a.compile else 'eager'}, {a.device}, "
          f"torch threads {torch.get_num_threads()}",
          file=sys.stderr)
    rows = []
    for weights in lists["weights"]:
        model = make_model(a, ckpt, config, weights)
        run_context(a, lists, model, weights, tokenizer, config, rows)
        del model
    print(table(rows))
    if a.json:
        save(a, rows)
    if a.plot and rows:
        plot(rows, a.plot)
    return 0


def main(argv=None) -> int:
    return run_cli(run, parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
