"""Score KV-cache policies x budgets on any checkpoint, against the full cache of the same model.

    python scripts/eval.py --quick        # SmolLM2-135M on a CPU: a small subset (what CI may run)
    python scripts/eval.py                # the SmolLM2-135M table: 8 policies x 4 budgets (25 min measured)
    python scripts/eval.py --checkpoint llama3.1-8b --budgets 512,1024,2048,4096 --lengths 4096,8192,16384 \\
        --samples 20 --compile --longbench en16 --longbench-source path/to/LongBench   # GPU, same script

Tasks (--tasks):
  fidelity   teacher-forced natural text (Python's own pydoc topics): after a --fid-prefix-token prefix, each of the
             next --fid-tokens tokens is fed one at a time (the policy evicts at every step). Per policy and budget:
             mean KL(full || policy) of the next-token distributions (nats), top-1 agreement with the full cache,
             acceptance as a draft (draft tokens accepted per round of --accept-k: draft_rounds) and the text's
             perplexity. The primary measure for a small model.
  freegen    free generation from the same prefixes: --gen-tokens greedy tokens, each fed back (as a user's run
             does; a policy that evicts the tokens it just wrote can loop, which teacher forcing never shows). Per
             policy and budget: tokens until the first divergence from the full cache's continuation, token overlap
             with it (bag-of-tokens F1, %) and repeated 4-grams of the continuation (%: near 100 is a loop).
  passkey, niah_single, niah_multikey, niah_multivalue, variable_tracking, common_words
             RULER-style retrieval (scripts/eval_tasks.py) at each of --lengths: the greedy answer scored with the
             task's metric and with partial credit, and log p(true answer), teacher-forced after the prompt.
  needle     niah_single at --depths x --lengths: a heatmap PNG per policy and budget (depth x length); its
             table row is niah_single's score averaged over the depths.
  Default: fidelity,freegen,needle (SmolLM2-135M with its full cache fails variable_tracking and common_words).
  --longbench TASKS (or en16) adds LongBench tasks from --longbench-source, scored as LongBench does; the
             table shows the English-16 average.
Protocols (--prefill): block (evict after every prefill block, hard budget throughout; default) and one-shot
(whole prompt dense, one compression). The full cache is run once per prompt and shown beside every policy.
Outputs in --out-dir: results.jsonl (one line per configuration, written as each finishes: what --resume reads),
then at the end results.json (config, every sample, summaries), results.md (one table per task: rows policy
(+protocol), columns budgets), fidelity.png, <task>.png (score vs budget, one line per policy) and
niah_heatmap_<policy>_<budget>[_one-shot].png. An interrupted run goes on with the same command and --resume.
"""
import json
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from errors import check_python  # noqa: E402

check_python()  # one line, not a traceback, in a Python without the requirements
import torch  # noqa: E402

import policies  # noqa: E402
from cache import is_scorer  # noqa: E402
from checkpoint import resolve_checkpoint  # noqa: E402
import progress  # noqa: E402
from cli import Parser, run_cli  # noqa: E402
from files import check_writable  # noqa: E402
from convert import read_config  # noqa: E402
from engine import Generation, decode, decode_inputs  # noqa: E402
from engine import prefill as engine_prefill  # noqa: E402
from errors import UserError  # noqa: E402
from loading import load_model  # noqa: E402
from runtime import check_device, model_step, prefill_step  # noqa: E402
from sampling import first_tokens  # noqa: E402
from config import parse_config  # noqa: E402
from scripts import eval_tasks  # noqa: E402
from scripts.eval_journal import JOURNAL, read_journal, run_settings  # noqa: E402
from scripts.eval_report import (NOT_APPLICABLE, first_divergence, label, mean_accepted,  # noqa: E402
                                 repeated_ngrams, token_overlap, write_outputs)
from scripts.outputs import append_line, checksum, digest, write_atomic  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402

POLICIES = "full,random,sink,h2o,tova,snapkv,keydiff,keynorm"
SYNTHETIC = ["passkey", "niah_single", "niah_multikey", "niah_multivalue", "variable_tracking", "common_words"]
TASKS = ["fidelity", "freegen", *SYNTHETIC, "needle"]
DEFAULT_TASKS = "fidelity,freegen,needle"  # the whole SmolLM2 table: ~24 min on one CPU core (from --quick's costs)
MAX_NEW = {"passkey": 12, "niah_single": 16, "niah_multikey": 16, "niah_multivalue": 40, "variable_tracking": 32,
           "common_words": 64, "needle": 16}  # greedy answer length; generation also stops at EOS
# --quick: the values it sets for every option left at its default
QUICK = dict(policies=["full", "sink", "snapkv", "keydiff"], budgets=[128, 256], lengths=[1024], depths=[0.0, 1.0],
             tasks=["fidelity", "freegen", "needle"], fid_prefix=1024, fid_tokens=64, gen_tokens=64)


# ------------------------------------------------------------------------------------------------ the engine

def use(model, policy: str, budget: int, block_size: int, prompt_len: int = 0, new_tokens: int = 0,
        protocol: str = "block"):
    """Caches for `policy` (a spec, 'full' = no eviction) holding `budget` slots per layer and KV head, set up by a
    run as generate.py's (engine.Generation: checked, and the policy planned for this prompt). Kept when nothing
    changed."""
    pol = policies.make(policy)
    per_prompt = pol is not None and (pol.protocol == "one-shot" or pol.decode == "append")  # planned per prompt
    key = (policy, budget, block_size, protocol) + ((prompt_len, new_tokens) if per_prompt else ())
    if getattr(model, "eval_caches", None) == key:
        return
    Generation(model.args, pol, [max(prompt_len, 1)], budget=budget, max_new_tokens=max(new_tokens, 1),
               block_size=block_size, prefill=protocol).setup(model)
    model.eval_caches = key


def prefill(model, ids: list[int], steps, block_size: int, one_shot: bool) -> torch.Tensor:
    """Empty the caches and process the prompt as generate() does; the last position's logits [1, vocab]."""
    for layer in model.layers:
        layer.attention.kv_cache.reset()
    prompt = torch.tensor(ids, dtype=torch.long, device=model.inv_freq.device)
    return engine_prefill(model, prompt, block_size, steps[0], one_shot)


def teacher_force(model, logits, pos: int, targets: list[int], steps) -> torch.Tensor:
    """Log-probs [len(targets), vocab]: row i predicts targets[i] after the prompt and targets[:i], fed one at a time
    from position `pos` (the policy evicts at every step). `logits`: the prefill's."""
    rows = [logits.float().log_softmax(-1)]
    for i, token in enumerate(targets[:-1]):
        out = steps[1](model, *decode_inputs(torch.tensor([token], device=logits.device),
                                             torch.tensor([pos + i], device=logits.device)))
        rows.append(out.float().log_softmax(-1))  # a new tensor: under CUDA graphs `out` is overwritten next step
    return torch.cat(rows)


def greedy(model, logits, pos: int, max_new: int, eos: set, steps) -> list[int]:
    """The greedy continuation of the prompt whose last logits are `logits`, from position `pos` (engine.decode)."""
    token, outs = first_tokens(logits)
    decode(model, steps[1], token, outs, [pos], max_new, eos_ids=eos)
    return outs[0]


def snapshot(model) -> list[dict]:
    return [{n: t.clone() for n, t in layer.attention.kv_cache.named_buffers()} for layer in model.layers]


def restore(model, snap: list[dict]) -> None:
    for layer, saved in zip(model.layers, snap):
        for n, t in layer.attention.kv_cache.named_buffers():
            t.copy_(saved[n])


def configs(a) -> list[tuple[str, str, int | None]]:
    """(protocol, policy, budget); the full cache first, once (its budget is each task's longest prompt). A policy
    whose only protocol is one-shot (SnapKV++, RocketKV, SAGE-KV, K-VEC) runs one-shot whatever --prefill says. A
    policy that holds every token (Exact-TopK) runs once, at the full budget (budget None): its own parameters
    (exact-topk:k=...) set what it attends."""
    protocols = {pol: ["one-shot"] if policies.lookup(pol).protocol == "one-shot" else a.prefill
                 for pol in a.policies if policies.lookup(pol) is not None}
    out = [(p, pol, b) for pol, ps in protocols.items() for p in ps
           for b in (a.budgets if is_scorer(policies.lookup(pol)) else [None])]
    order = ["block", "one-shot"]
    return [("block", "full", None)] + sorted(out, key=lambda c: order.index(c[0]))  # stable: policy order kept


def fits(task, protocol, policy, budget, bar, use_args) -> bool:
    """Set up the caches (`use`); False, noted in NOT_APPLICABLE and shown as n/a in the table, when the policy
    cannot run this prompt at this budget (e.g. SnapKV++ keeps budget - new tokens < its window: the paper's N/A)."""
    try:
        use(*use_args)
        return True
    except UserError as e:
        NOT_APPLICABLE[task, label(protocol, policy), budget] = str(e)
        if bar is not None:
            bar.step()
        return False


def show(bar, protocol, policy, budget) -> None:
    if bar is not None:
        bar.note = label(protocol, policy) + ("" if budget is None else f" @ {budget}")


# --------------------------------------------------------------------------------------------------- fidelity

def fidelity_texts(tok, n_texts: int, length: int, seed: int) -> list[list[int]]:
    """n_texts windows of `length` token ids from Python's pydoc topics (long English prose), at seeded offsets."""
    import pydoc_data.topics
    topics = pydoc_data.topics.topics
    ids = tok.encode("\n\n".join(topics[k] for k in sorted(topics)), add_bos=False)
    bos = tok.encode("", add_bos=True)
    n = length - len(bos)
    if n > len(ids):
        raise UserError(f"the fidelity text has {len(ids)} tokens, fewer than --fid-prefix + --fid-tokens")
    rng = random.Random(seed)
    return [bos + ids[o:o + n] for o in (rng.randrange(len(ids) - n + 1) for _ in range(n_texts))]


def each_config(task: str, cfgs, n_texts: int, use_args, measure, bar=None, done=None) -> list[dict]:
    """One record per config and text: measure(protocol, policy, i) -> the measures of text i. A policy that cannot
    run this prompt at this budget (use_args(protocol, policy, budget) -> use()'s arguments) is n/a. done(cfg,
    records) is called as each config finishes."""
    records = []
    for protocol, policy, budget in cfgs:
        show(bar, protocol, policy, budget)
        first = len(records)
        for i in range(n_texts):
            if policy != "full" and not fits(task, protocol, policy, budget, bar, use_args(protocol, policy, budget)):
                continue
            records.append(dict(task=task, protocol=protocol, policy=policy, budget=budget, text=i,
                                **measure(protocol, policy, i)))
            if bar is not None:
                bar.step()
        if done is not None:
            done((protocol, policy, budget), records[first:])
    return records


@torch.inference_mode()
def fidelity_reference(model, texts: list[list[int]], prefix: int, *, block_size: int, steps) -> list[torch.Tensor]:
    """The full cache's log-probs of each text's continuation after `prefix` tokens (teacher_force): what fidelity
    compares every policy with."""
    use(model, "full", max(len(t) for t in texts), block_size)
    return [teacher_force(model, prefill(model, t[:prefix], steps, block_size, False), prefix, t[prefix:], steps)
            for t in texts]


@torch.inference_mode()
def fidelity(model, texts: list[list[int]], prefix: int, cfgs, *, block_size: int, steps, accept_k: int = 4,
             bar=None, done=None, ref=None) -> list[dict]:
    """Teacher-force each text's continuation after `prefix` tokens; per config and text: mean KL(full || policy)
    (nats), top-1 agreement with full, the mean draft tokens accepted per round of `accept_k` when the policy's
    cache drafts for the full cache's (mean_accepted of the top-1 agreements) and mean NLL of the text (perplexity =
    exp of the mean NLL). ref: fidelity_reference's, for a caller that scores configs in several calls."""
    total = max(len(t) for t in texts)
    if ref is None:
        ref = fidelity_reference(model, texts, prefix, block_size=block_size, steps=steps)

    def measure(protocol, policy, i):
        t = texts[i]
        logp = ref[i] if policy == "full" else teacher_force(
            model, prefill(model, t[:prefix], steps, block_size, protocol == "one-shot"), prefix, t[prefix:], steps)
        target = torch.tensor(t[prefix:], device=logp.device)[:, None]
        kl = (ref[i].exp() * (ref[i] - logp)).sum(-1).clamp_min(0)
        agree = ref[i].argmax(-1) == logp.argmax(-1)
        return dict(kl=kl.mean().item(), agree=agree.float().mean().item(),
                    accept=mean_accepted(agree.tolist(), accept_k), nll=-logp.gather(-1, target).mean().item())

    return each_config("fidelity", cfgs, len(texts), lambda protocol, policy, budget: (
        model, policy, budget or total, block_size, prefix, total - prefix, protocol), measure, bar, done)


# ---------------------------------------------------------------------------------------------- free generation

@torch.inference_mode()
def freegen(model, texts: list[list[int]], prefix: int, n_new: int, cfgs, *, block_size: int, steps, bar=None,
            done=None) -> list[dict]:
    """Greedy continuation of each text's first `prefix` tokens for `n_new` tokens, each fed back; per config and
    text: agreement with the full cache's continuation (tokens until the first divergence, token overlap) and the
    continuation's repeated 4-grams."""
    use(model, "full", prefix + n_new, block_size)
    ref = [greedy(model, prefill(model, t[:prefix], steps, block_size, False), prefix, n_new, set(), steps)
           for t in texts]

    def measure(protocol, policy, i):
        out = ref[i] if policy == "full" else greedy(
            model, prefill(model, texts[i][:prefix], steps, block_size, protocol == "one-shot"), prefix, n_new,
            set(), steps)
        return dict(match=first_divergence(out, ref[i]), overlap=token_overlap(out, ref[i]), rep=repeated_ngrams(out),
                    tokens=out)

    return each_config("freegen", cfgs, len(texts), lambda protocol, policy, budget: (
        model, policy, budget or prefix + n_new, block_size, prefix, n_new, protocol), measure, bar, done)


# ----------------------------------------------------------------------------------------- tasks with answers

def make_items(tok, a, ctx: int) -> dict[str, list[dict]]:
    """task -> prompts to score: {ids, answer_ids, max_new, sample, length, depth}. A synthetic prompt is its
    document, then its question (tokenizer.prompt_ids, as generate.py and engine.generate_text build one), then
    RULER's answer prefix ("The pass key is"), after the chat template; the true answer follows it."""
    count = lambda s: len(tok.encode(s, add_bos=False))  # noqa: E731
    items = defaultdict(list)

    def add(task, sample, question, document, chat, max_new, length):
        chat = chat and tok.chat_template is not None
        prefix = sample.meta.get("answer_prefix", "")
        if prefix and not chat:  # plain text: the prefix ends the prompt's text
            question += "\n\n" + prefix
        ids = tok.prompt_ids(question, document, chat)
        if prefix and chat:  # the chat template's assistant turn starts with it
            ids += tok.encode(prefix, add_bos=False)
        answer = ", ".join(sample.answers)
        answer_ids = tok.encode(answer if chat and not prefix else " " + answer, add_bos=False)
        if len(ids) + max(max_new, len(answer_ids)) > ctx:
            raise UserError(f"a {task} prompt has {len(ids)} tokens: with its answer ({max(max_new, len(answer_ids))} "
                            f"tokens) it exceeds the model's context ({ctx}); use shorter --lengths"
                            + (" or a smaller --max-new-tokens" if a.max_new_tokens else ""))
        items[task].append(dict(ids=ids, answer_ids=answer_ids, max_new=max_new, sample=sample, length=length,
                                depth=sample.meta.get("depth")))

    for task in a.tasks:
        if task in ("fidelity", "freegen"):
            continue
        gen = eval_tasks.TASKS["niah_single" if task == "needle" else task]
        for length in a.lengths:
            for depth in a.depths if task == "needle" else [None]:
                seed = a.seed + 1000 * length + round(1000 * (depth or 0))
                try:
                    samples = gen(count, length, a.samples, seed, depth=depth)
                except ValueError as e:  # e.g. a length too short for the task's fixed text
                    raise UserError(f"{task} at --lengths {length}: {e}") from None
                for s in samples:
                    add(task, s, s.question, s.context, True, a.max_new_tokens or MAX_NEW[task], length)
    for task in a.longbench:
        max_new = eval_tasks.LONGBENCH_MAXGEN[task]
        limit = max(1, min(a.longbench_max_tokens or ctx, ctx - max_new - 64))  # 64: room for the chat template
        try:
            samples = eval_tasks.load_longbench(task, a.longbench_source, limit=a.longbench_limit or a.samples)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
            raise UserError(f"--longbench {task}: cannot read {e.filename}: {e.strerror}") from None
        except (ValueError, RuntimeError) as e:
            raise UserError(f"--longbench {task}: {e}") from None
        for s in samples:
            ids = tok.encode(s.prompt(), add_bos=False)
            text = s.prompt() if len(ids) <= limit else (  # LongBench truncates the middle of a long prompt
                tok.decode(ids[:limit // 2]) + tok.decode(ids[len(ids) - (limit - limit // 2):]))
            add(f"longbench/{task}", s, text, None, s.meta.get("chat", task not in eval_tasks.LONGBENCH_NO_CHAT),
                max_new, len(ids))
    return items


def score_answer(task: str, prediction: str, sample) -> dict:
    """LongBench: its own score. Synthetic: the task's metric and partial credit averaged over the answers."""
    if task.startswith("longbench/"):
        return dict(score=eval_tasks.longbench_score(task.split("/", 1)[1], prediction, sample))
    partial = sum(eval_tasks.partial_credit(prediction, x) for x in sample.answers) / len(sample.answers)
    return dict(score=eval_tasks.METRICS[sample.metric](prediction, sample.answers), partial=partial)


@torch.inference_mode()
def run_task(model, tok, task: str, items: list[dict], cfgs, *, block_size: int, steps, bar=None,
             done=None) -> list[dict]:
    """Per config and prompt: the greedy answer and its scores, and log p(true answer) teacher-forced from the
    same prefill (the cache is snapshotted after the prefill and restored between the two). done(cfg, records) is
    called as each config finishes."""
    eos = set(tok.eos_ids)
    full_budget = max(len(it["ids"]) + max(it["max_new"], len(it["answer_ids"])) for it in items)
    records = []
    for protocol, policy, budget in cfgs:
        show(bar, protocol, policy, budget)
        first = len(records)
        for it in items:
            ids, answer = it["ids"], it["answer_ids"]
            if not fits(task, protocol, policy, budget, bar, (model, policy, budget or full_budget, block_size,
                                                           len(ids), max(it["max_new"], len(answer)), protocol)):
                continue
            logits = prefill(model, ids, steps, block_size, protocol == "one-shot")
            logp = {}
            if not task.startswith("longbench/"):
                snap = snapshot(model)
                rows = teacher_force(model, logits, len(ids), answer, steps)
                logp = dict(logp=rows.gather(-1, torch.tensor(answer, device=rows.device)[:, None]).sum().item())
                restore(model, snap)
            out = greedy(model, logits, len(ids), it["max_new"], eos, steps)
            prediction = tok.decode([t for t in out if t not in eos])
            records.append(dict(task=task, protocol=protocol, policy=policy, budget=budget, length=it["length"],
                                depth=it["depth"], tokens=len(ids), **score_answer(task, prediction, it["sample"]),
                                **logp, prediction=prediction, answers=it["sample"].answers))
            if bar is not None:
                bar.step()
        if done is not None:
            done((protocol, policy, budget), records[first:])
    return records


# -------------------------------------------------------------------------------------------------------- CLI

def csv(kind):
    def parse(s):
        return [kind(x) for x in s.split(",") if x.strip()]
    parse.__name__ = f"comma-separated {kind.__name__}"  # argparse names the type in its error line
    return parse


def parse_args(argv=None):
    ap = Parser(description=__doc__)
    ap.add_argument("--checkpoint", default="smollm2-135m", help="as in generate.py (default smollm2-135m)")
    ap.add_argument("--policies", type=policies.spec_list, default=policies.spec_list(POLICIES),
                    help=f"comma list (default {POLICIES}); the full cache is always run as the reference")
    ap.add_argument("--budgets", type=csv(int), default=[128, 256, 512, 1024], help="comma list")
    ap.add_argument("--prefill", type=csv(str), default=["block"], help="block, one-shot or block,one-shot")
    ap.add_argument("--tasks", type=csv(str), default=csv(str)(DEFAULT_TASKS),
                    help=f"comma list of {','.join(TASKS)} (default {DEFAULT_TASKS})")
    ap.add_argument("--lengths", type=csv(int), default=[1024, 2048], help="prompt lengths in tokens")
    ap.add_argument("--depths", type=csv(float), default=[0.0, 0.5, 1.0],
                    help="needle depths, 0 = start of the context, 1 = end")
    ap.add_argument("--samples", type=int, default=1, help="samples per task, length and depth")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="greedy answer length (default: per task)")
    ap.add_argument("--fid-prefix", type=int, default=2048, help="fidelity: tokens before the scored part")
    ap.add_argument("--fid-tokens", type=int, default=128, help="fidelity: tokens teacher-forced and scored")
    ap.add_argument("--fid-texts", type=int, default=1, help="fidelity, freegen: number of text windows")
    ap.add_argument("--accept-k", type=int, default=4,
                    help="fidelity: draft tokens per round for the acceptance measure (1 to --fid-tokens)")
    ap.add_argument("--gen-tokens", type=int, default=128,
                    help="freegen: greedy tokens generated after the --fid-prefix prefix")
    ap.add_argument("--longbench", type=csv(str), default=[],
                    help="LongBench tasks, comma list or en16 (the English-16)")
    ap.add_argument("--longbench-source",
                    help="a LongBench <task>.jsonl or the folder of data.zip's files (default: the HF hub, through "
                         "datasets)")
    ap.add_argument("--longbench-limit", type=int, default=0, help="samples per LongBench task (default --samples)")
    ap.add_argument("--longbench-max-tokens", type=int, default=0,
                    help="truncate LongBench prompts in the middle to this many tokens (default: the model's context "
                         "less the task's answer length)")
    ap.add_argument("--block-size", type=int, default=128, help="prefill block size")
    ap.add_argument("--seed", type=int, default=0,
                    help="task data and text offsets; the random policy has its own (random:seed=N)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu, cuda or cuda:N (default: cuda where there is one, else cpu)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="auto = bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--threads", type=int, default=0,
                    help="CPU threads (default: torch's; 1 is much faster when another process holds a core)")
    ap.add_argument("--compile", action="store_true", help="compile the prefill and decode steps (GPU; slow on CPU)")
    ap.add_argument("--out-dir", type=Path, default=REPO / "build" / "eval", help="where the tables, plots and results.jsonl go")
    ap.add_argument("--quiet", action="store_true", help="no progress lines (on a terminal or off one)")
    ap.add_argument("--resume", action="store_true",
                    help="skip the configurations already in --out-dir/results.jsonl (a run interrupted or killed "
                         "keeps every configuration it finished there); refused if that file was written with other "
                         "settings (checkpoint, dtype, lengths, seed, ...). Without --resume, results.jsonl is "
                         "replaced when the first configuration finishes")
    ap.add_argument("--quick", action="store_true", help="a small subset of the defaults: " +
                    " ".join(f"--{k.replace('_', '-')} " + (",".join(map(str, v)) if isinstance(v, list) else str(v))
                             for k, v in QUICK.items()))
    a = ap.parse_args(argv)
    if a.quick:  # the quick values replace only the options left at their defaults
        for k, v in QUICK.items():
            if getattr(a, k) == ap.get_default(k):
                setattr(a, k, v)
    return a


MAX_ITEMS = 10_000  # --samples and --fid-texts: far more than a run can score, few enough to build at once


def check_args(a) -> None:
    for spec in a.policies:
        policies.make(spec)  # PolicyError for an unknown name or parameter
    if unknown := [t for t in a.tasks if t not in TASKS]:
        raise UserError(f"unknown task {unknown[0]!r}; known: {', '.join(TASKS)}")
    if unknown := [p for p in a.prefill if p not in ("block", "one-shot")]:
        raise UserError(f"unknown --prefill {unknown[0]!r}: block, one-shot or both (block,one-shot)")
    if a.longbench == ["en16"]:
        a.longbench = list(eval_tasks.LONGBENCH_EN16)
    if unknown := [t for t in a.longbench if t not in eval_tasks.LONGBENCH_MAXGEN]:
        raise UserError(f"unknown LongBench task {unknown[0]!r}; known: {', '.join(eval_tasks.LONGBENCH_MAXGEN)}")
    for name in ("budgets", "lengths", "depths", "policies", "prefill"):
        if not getattr(a, name):
            raise UserError(f"--{name} is empty")
    for name in ("budgets", "lengths", "depths", "tasks", "prefill", "longbench"):
        values = getattr(a, name)
        if twice := [v for i, v in enumerate(values) if v in values[:i]]:
            raise UserError(f"--{name.replace('_', '-')} lists {twice[0]} twice")
    if not a.tasks and not a.longbench:
        raise UserError("nothing to run: give --tasks or --longbench")
    for name in ("budgets", "lengths"):
        if min(getattr(a, name)) < 1:
            raise UserError(f"--{name} must all be >= 1")
    for name in ("samples", "block_size", "fid_prefix", "fid_tokens", "fid_texts", "gen_tokens"):
        if getattr(a, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("samples", "fid_texts"):  # each is built in memory before the first configuration runs
        if getattr(a, name) > MAX_ITEMS:
            raise UserError(f"--{name.replace('_', '-')} must be at most {MAX_ITEMS}, got {getattr(a, name)}")
    if a.accept_k < 1 or "fidelity" in a.tasks and a.accept_k > a.fid_tokens:
        raise UserError(f"--accept-k must be between 1 and --fid-tokens ({a.fid_tokens})")
    if a.threads > 1024:
        raise UserError(f"--threads must be at most 1024, got {a.threads}")
    if a.threads < 0 or a.max_new_tokens < 0 or a.longbench_limit < 0 or a.longbench_max_tokens < 0:
        raise UserError("--threads, --max-new-tokens, --longbench-limit and --longbench-max-tokens must be >= 0")
    if not all(0 <= d <= 1 for d in a.depths):
        raise UserError("--depths must be in [0, 1]")
    check_device(a.device)
    if not a.longbench and (a.longbench_source or a.longbench_limit or a.longbench_max_tokens):
        raise UserError("--longbench-source, --longbench-limit and --longbench-max-tokens apply to --longbench tasks, "
                        "and none is given")
    if a.longbench_source:
        source = Path(a.longbench_source)
        if not source.exists():
            raise UserError(f"--longbench-source {source}: no such file or folder")
        if not source.is_dir() and len(a.longbench) > 1:
            raise UserError(f"--longbench-source {source} is one file, for {len(a.longbench)} tasks: give the folder "
                            "of <task>.jsonl files")


def dtype_of(a) -> torch.dtype:
    """--dtype: auto is bfloat16 on CUDA, float32 elsewhere."""
    return {"auto": torch.bfloat16 if a.device.startswith("cuda") else torch.float32, "float32": torch.float32,
            "bfloat16": torch.bfloat16, "float16": torch.float16}[a.dtype]


def check_sizes(a, model_args) -> None:
    """The lengths, budgets and each policy against the model, before any loading: one UserError naming the flag."""
    ctx = model_args.max_seq_len
    for spec in a.policies:  # a parameter that cannot work at a budget fails before any loading
        policy = policies.make(spec)
        if is_scorer(policy) and policy.protocol != "one-shot":  # (one-shot ones depend on each prompt: n/a there)
            for budget in a.budgets:
                try:
                    policy.plan(policies.Run(budget, max(a.lengths), 0, a.block_size, model_args))
                except UserError as e:  # the library's budget= is one of this command's --budgets
                    raise UserError(str(e).replace(f"budget={budget}", f"`budgets` {budget}")) from None
    if a.fid_prefix + a.fid_tokens > ctx and "fidelity" in a.tasks:
        raise UserError(f"--fid-prefix + --fid-tokens exceeds the model's context ({ctx})")
    if a.fid_prefix + a.gen_tokens > ctx and "freegen" in a.tasks:
        raise UserError(f"--fid-prefix + --gen-tokens exceeds the model's context ({ctx})")
    if max(a.budgets) > ctx:
        raise UserError(f"--budgets {max(a.budgets)} is larger than the model's context ({ctx})")
    if a.block_size > ctx:
        raise UserError(f"--block-size {a.block_size} is larger than the model's context ({ctx})")
    if a.max_new_tokens >= ctx:
        raise UserError(f"--max-new-tokens {a.max_new_tokens} leaves no room for a prompt in the model's context "
                        f"({ctx})")
    if max(a.lengths) >= ctx and any(t not in ("fidelity", "freegen") for t in a.tasks):
        raise UserError(f"--lengths {max(a.lengths)} leaves no room for an answer in the model's context ({ctx})")


def run(a) -> int:
    t_start = time.perf_counter()
    NOT_APPLICABLE.clear()
    check_args(a)
    progress.quiet = a.quiet
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = dtype_of(a)
    try:  # the outputs' folder before the run, not after it
        a.out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out-dir {a.out_dir}: {e.strerror}") from None
    journal = a.out_dir / JOURNAL
    check_writable(journal, "--out-dir")
    ckpt = resolve_checkpoint(a.checkpoint)
    config = read_config(ckpt)  # read once, here and by the model
    model_args = parse_config(config)
    ctx = model_args.max_seq_len
    check_sizes(a, model_args)
    tok = load_tokenizer(ckpt)
    items = make_items(tok, a, ctx)
    texts = (fidelity_texts(tok, a.fid_texts, a.fid_prefix + a.fid_tokens, a.seed)
             if {"fidelity", "freegen"} & set(a.tasks) else [])
    tasks = [t for t in a.tasks if t in ("fidelity", "freegen", *items)] + [t for t in items
                                                                          if t.startswith("longbench/")]
    data = {t: digest([a.fid_prefix, texts] if t == "fidelity" else [a.fid_prefix, a.gen_tokens, texts]
                      if t == "freegen" else [[it["ids"], it["answer_ids"], it["max_new"],
                       it["sample"].answers, it["length"], it["depth"]] for it in items[t]]) for t in tasks}
    settings = run_settings(a, ckpt, dtype)
    run_id = digest(settings)
    cfgs = configs(a)
    keys = {(t, c): (t, *c, data[t]) for t in tasks for c in cfgs}
    done = read_journal(journal, settings) if a.resume else {}
    results = {tc: done[k]["records"] for tc, k in keys.items() if k in done}
    for (t, (protocol, policy, budget)), k in keys.items():
        if k in done and done[k]["na"] is not None:
            NOT_APPLICABLE[t, label(protocol, policy), budget] = done[k]["na"]
    head = {"budgetkv_eval": 1, "settings": settings}
    if a.resume:  # what is kept, whole lines only (a line cut short by a kill is dropped here)
        print(f"--resume: {len(results)} of {len(keys)} configurations are in {journal}", file=sys.stderr)
        write_atomic(journal, "".join(json.dumps(x) + "\n" for x in [head, *done.values()]))
    fresh = not a.resume  # an earlier journal is replaced when the first configuration finishes

    def record(task, cfg, records):
        nonlocal fresh
        results[task, cfg] = records
        entry = dict(run=run_id, task=task, protocol=cfg[0], policy=cfg[1], budget=cfg[2], data=data[task],
                     records=records, na=NOT_APPLICABLE.get((task, label(cfg[0], cfg[1]), cfg[2])))
        entry["sum"] = checksum(entry)  # --resume re-measures a line whose content no longer matches it
        if fresh:
            write_atomic(journal, json.dumps(head) + "\n" + json.dumps(entry) + "\n")
            fresh = False
        else:
            append_line(journal, entry)

    timings = {}
    if len(results) < len(keys):
        model = load_model(ckpt, dtype, a.device, config)
        steps = (prefill_step, model_step)
        if a.compile:
            torch._dynamo.config.cache_size_limit = torch._dynamo.config.accumulated_cache_size_limit = 4096
            compiled = Generation(model_args, None, device=a.device)  # as generate.py --compile, the prefill too
            compiled.compile(model, 0, prefill=True, warm=False)
            steps = compiled.steps
    for task in tasks:
        todo = [c for c in cfgs if (task, c) not in results]
        if not todo:
            continue
        t0 = time.perf_counter()
        n = a.fid_texts if task in ("fidelity", "freegen") else len(items[task])
        kw = dict(block_size=a.block_size, steps=steps, done=lambda cfg, records, task=task: record(task, cfg, records))
        with progress.Progress(len(todo) * n, task, "prompts") as bar:
            if task == "fidelity":
                fidelity(model, texts, a.fid_prefix, todo, accept_k=a.accept_k, bar=bar, **kw)
            elif task == "freegen":
                freegen(model, texts, a.fid_prefix, a.gen_tokens, todo, bar=bar, **kw)
            else:
                run_task(model, tok, task, items[task], todo, bar=bar, **kw)
        timings[task] = round(time.perf_counter() - t0, 1)
    records = [r for t in tasks for c in cfgs for r in results[t, c]]
    resumed = sum(k in done for k in keys.values())
    return write_outputs(a, ckpt, dtype, records, timings, time.perf_counter() - t_start, resumed, len(keys))


def main(argv=None) -> int:
    return run_cli(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
