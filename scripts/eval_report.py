"""The measures scripts/eval.py takes of a continuation against the full cache's, and what it writes at the end: the
summary (a mean per task, row and budget), results.md (one table per task: rows policy (+protocol), columns
budgets), results.json and the plots (score vs budget per task, a needle heatmap per policy and budget; only when
matplotlib is installed)."""
import sys

if __name__ == "__main__":  # run directly: one line, not an ImportError
    PART = "scripts/eval_report.py is a part of scripts/eval.py, not a command of its own"
    print(f"usage: {PART}" if sys.argv[1:] in (["-h"], ["--help"]) else f"error: {PART}",
          file=sys.stdout if sys.argv[1:] in (["-h"], ["--help"]) else sys.stderr)
    sys.exit(0 if sys.argv[1:] in (["-h"], ["--help"]) else 2)

import importlib.util
import json
import math
from collections import Counter, defaultdict
from pathlib import Path

import torch

from scripts import eval_tasks
from scripts.outputs import save_png, write_atomic


def label(protocol: str, policy: str) -> str:
    return policy if protocol == "block" or policy == "full" else f"{policy} ({protocol})"


NOT_APPLICABLE = {}  # (task, row label, budget) -> why: a policy that cannot run this prompt at this budget


# ------------------------------------------------------------------------------- measures of a continuation

def draft_rounds(agree: list[bool], k: int) -> list[int]:
    """Tokens accepted in each round of greedy speculative decoding with k draft tokens per round, where agree[t] says
    whether the draft's next token equals the target's at position t. A round starting at t accepts the leading
    agreements among agree[t:t + k] (n <= k); the target then supplies position t + n itself (its correction, or its
    bonus token after k accepted), so the next round starts at t + n + 1. A last round that the end of `agree` cuts
    short before a disagreement or k agreements is not counted (its outcome is unknown)."""
    rounds, t = [], 0
    while t < len(agree):
        n = 0
        while n < k and t + n < len(agree) and agree[t + n]:
            n += 1
        if n < k and t + n == len(agree):  # cut short by the end
            break
        rounds.append(n)
        t += n + 1
    return rounds


def mean_accepted(agree: list[bool], k: int) -> float:
    """Mean draft tokens accepted per round (draft_rounds); 0 when no round is complete."""
    rounds = draft_rounds(agree, k)
    return sum(rounds) / len(rounds) if rounds else 0.0


def repeated_ngrams(tokens: list[int], n: int = 4) -> float:
    """The fraction of `tokens`' n-grams that repeat an earlier one: 0 for text that never repeats itself, near 1 for
    a loop ("TheTheThe...")."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


def first_divergence(tokens: list[int], ref: list[int]) -> int:
    """How many tokens agree with `ref` before the first that differs."""
    return next((i for i, (x, y) in enumerate(zip(tokens, ref)) if x != y), min(len(tokens), len(ref)))


def token_overlap(tokens: list[int], ref: list[int]) -> float:
    """Bag-of-tokens F1 of two continuations (ROUGE-1 over token ids): 1 for the same tokens in any order."""
    common = sum((Counter(tokens) & Counter(ref)).values())
    return 2 * common / (len(tokens) + len(ref)) if tokens or ref else 1.0


# ------------------------------------------------------------------------------------------------ outputs

def summarize(records: list[dict]) -> dict:
    """task -> row label -> budget ('all' for the full cache) -> mean of each measure (ppl = exp of mean NLL)."""
    groups = defaultdict(list)
    for r in records:
        groups[r["task"], label(r["protocol"], r["policy"]), "all" if r["budget"] is None else r["budget"]].append(r)
    out = defaultdict(lambda: defaultdict(dict))
    for (task, row, budget), rs in groups.items():
        m = {k: sum(r[k] for r in rs) / len(rs) for k in measures(task)}
        if task == "fidelity":
            m["ppl"] = math.exp(m.pop("nll"))
        out[task][row][budget] = m | {"n": len(rs)}
    en16 = [t for t in out if t.startswith("longbench/") and t.split("/", 1)[1] in eval_tasks.LONGBENCH_EN16]
    if en16:  # the average over the English-16 tasks that were run, per row and budget
        avg = out["longbench"]
        for row in out[en16[0]]:
            for budget in out[en16[0]][row]:
                scores = [out[t][row][budget]["score"] for t in en16 if budget in out[t].get(row, {})]
                avg[row][budget] = {"score": sum(scores) / len(scores), "tasks": len(scores)}
    return json.loads(json.dumps(out))  # plain dicts, budget keys as strings


def measures(task: str) -> list[str]:
    """What summarize averages over a task's records."""
    return (["kl", "agree", "accept", "nll"] if task == "fidelity" else ["match", "overlap", "rep"]
            if task == "freegen" else ["score"] if task.startswith("longbench/") else ["score", "partial", "logp"])


def cell(task: str, m: dict) -> str:
    if task == "fidelity":
        return f"{m['kl']:.3f} / {100 * m['agree']:.1f} / {m['accept']:.2f} / {m['ppl']:.2f}"
    if task == "freegen":
        return f"{m['match']:.1f} / {100 * m['overlap']:.1f} / {100 * m['rep']:.1f}"
    if task.startswith("longbench"):
        return f"{100 * m['score']:.1f}"
    return f"{100 * m['score']:.1f} / {100 * m['partial']:.1f} / {m['logp']:.2f}"


def legend(task: str, rows: dict) -> str:
    if task == "fidelity":
        return ("KL(full ‖ policy) nats / top-1 agreement with full % / draft tokens accepted per round (of K, as a "
                "draft for full) / perplexity")
    if task == "freegen":
        return ("greedy continuation: tokens until the first divergence from full / token overlap with full % / "
                "repeated 4-grams % (near 100: a loop)")
    if task == "longbench":
        return f"English-16 average score % ({rows['full']['all']['tasks']} of 16 tasks run)"
    if task.startswith("longbench/"):
        return "LongBench score %"
    return "task metric % / partial credit % / log p(true answer), nats"


def markdown(summary: dict, budgets: list[int], header: str) -> str:
    lines = [header]
    for task, rows in summary.items():
        lines += ["", f"## {task}: {legend(task, rows)}", "", "| policy | " + " | ".join(map(str, budgets)) + " |",
                  "|---|" + "---:|" * len(budgets)]
        for row, by_budget in rows.items():
            ms = [by_budget.get("all") or by_budget.get(str(b)) for b in budgets]
            cells = [cell(task, m) if m else "n/a" if (task, row, b) in NOT_APPLICABLE else ""
                     for m, b in zip(ms, budgets)]
            lines.append(f"| {row if row != 'full' else 'full (no eviction)'} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, records: list[dict], budgets: list[int], out_dir: Path) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    written = []

    colors = {}  # one color per policy, solid for the block protocol, dashed for one-shot

    def lines(ax, rows, key, ylabel, scale=1.0):
        for row, by_budget in rows.items():
            if "all" in by_budget:
                full = row.startswith("full")
                ax.axhline(scale * by_budget["all"][key], color="black" if full else colors.setdefault(
                    row.split(" ")[0], f"C{len(colors) % 10}"), ls=":", lw=1.5, label=row)
            else:
                xs = [b for b in budgets if str(b) in by_budget]
                color = colors.setdefault(row.split(" ")[0], f"C{len(colors) % 10}")
                ax.plot(xs, [scale * by_budget[str(b)][key] for b in xs], marker="o", color=color,
                        ls="--" if "(one-shot)" in row else "-", label=row)
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_xlabel("budget (tokens per layer and KV head)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)

    for task, rows in summary.items():
        if task == "fidelity":
            fig, axes = plt.subplots(1, 4, figsize=(21, 4.5))
            lines(axes[0], {r: v for r, v in rows.items() if r != "full"}, "kl", "KL(full || policy), nats")
            axes[0].set_yscale("log")
            lines(axes[1], rows, "agree", "top-1 agreement with full, %", 100)
            lines(axes[2], rows, "accept", "draft tokens accepted per round (of K)")
            lines(axes[3], rows, "ppl", "perplexity")
        elif task == "freegen":
            fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
            lines(axes[0], rows, "match", "tokens until the first divergence from full")
            lines(axes[1], rows, "overlap", "token overlap with full, %", 100)
            lines(axes[2], rows, "rep", "repeated 4-grams, % (loops near 100)", 100)
        else:
            fig, axes = plt.subplots(1, 1, figsize=(7, 4.5))
            lines(axes, rows, "score", "score, %", 100)
            axes = [axes]
        axes[-1].legend(fontsize=8, loc="best")
        fig.suptitle(f"{task} vs budget")
        fig.tight_layout()
        name = task.replace("/", "_") + ".png"
        save_png(fig, out_dir / name)
        plt.close(fig)
        written.append(name)

    grids = defaultdict(lambda: defaultdict(list))  # needle: (row, budget) -> (depth, length) -> scores
    for r in records:
        if r["task"] == "needle":
            grids[label(r["protocol"], r["policy"]), r["budget"]][r["depth"], r["length"]].append(r["score"])
    for (row, budget), grid in grids.items():
        depths, lengths = sorted({d for d, _ in grid}), sorted({n for _, n in grid})
        z = [[100 * sum(grid[d, n]) / len(grid[d, n]) for n in lengths] for d in depths]
        fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 2.5, 0.5 * len(depths) + 2))
        im = ax.imshow(z, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
        for i, zr in enumerate(z):
            for j, v in enumerate(zr):
                ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("needle depth")
        ax.set_title(f"needle: {row}" + ("" if budget is None else f", budget {budget}"), fontsize=10)
        fig.colorbar(im, ax=ax, label="score %")
        fig.tight_layout()
        policy = row.split(" ")[0]
        name = f"niah_heatmap_{policy}" + ("" if budget is None else f"_{budget}") + \
            ("_one-shot" if "(one-shot)" in row else "") + ".png"
        save_png(fig, out_dir / name)
        plt.close(fig)
        written.append(name)
    return written


def write_outputs(a, ckpt, dtype, records, timings, wall_s, resumed=0, n_configs=0) -> int:
    """results.md, results.json and the PNGs, each replaced whole (write_atomic)."""
    summary = summarize(records)
    header = (f"# budgetkv eval: {a.checkpoint}\n\n{a.device}, {str(dtype).replace('torch.', '')}, block "
              f"{a.block_size}, prefill {','.join(a.prefill)}, lengths {','.join(map(str, a.lengths))}, "
              f"{a.samples} sample(s) per task/length/depth, fidelity {a.fid_texts} x ({a.fid_prefix} + "
              f"{a.fid_tokens}) tokens, draft rounds of K={a.accept_k}, free generation {a.gen_tokens} tokens, seed "
              f"{a.seed}; {wall_s:.0f} s")
    if resumed:
        header += f" ({resumed} of {n_configs} configurations from an earlier run, --resume)"
    reasons = sorted({why for why in NOT_APPLICABLE.values()})
    if reasons:
        header += "\n\nn/a: " + "; ".join(reasons)
    md = markdown(summary, a.budgets, header)
    write_atomic(a.out_dir / "results.md", md)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()}
    write_atomic(a.out_dir / "results.json", json.dumps(
        dict(config=config | {"checkpoint_dir": str(ckpt), "dtype": str(dtype), "torch": torch.__version__},
             wall_s=round(wall_s, 1), task_s=timings, resumed=resumed, summary=summary, records=records), indent=1))
    plots = importlib.util.find_spec("matplotlib") is not None
    pngs = plot(summary, records, a.budgets, a.out_dir) if plots else []
    print(md)
    print(f"wrote {a.out_dir}/results.json, results.md and {len(pngs)} PNGs in {wall_s:.0f} s", file=sys.stderr)
    if not plots:
        print(f"no plots: matplotlib is not installed ({sys.executable} -m pip install -r requirements-eval.txt)",
              file=sys.stderr)
    return 0

