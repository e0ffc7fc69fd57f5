"""Tensor parallel decode: each rank's decode step time and the share of it spent in the all-reduces, on a model's
shapes with seeded random weights (speed does not depend on the values).

    torchrun --nproc-per-node 2 scripts/bench_tp.py --checkpoint llama3.2-1b --policy keydiff --budget 512
    python scripts/bench_tp.py ...            # the same on one process (TP=1), for the ratio

After a block-wise prefill of --prompt-tokens random ids, --steps decode steps alternate between the real step and
the same step with the all-reduces switched off (every Attention / FeedForward's tp_group set to None: the same
per-rank compute, no communication; its output is wrong, and its token is fed to the next step; both kinds write
the same cache, which changes which slots are kept and which tokens come, never a step's shapes): one Generation.decode
run whose on_step switches the kind. Each rank times its own steps (engine.decode's step times: each ends once its
token reached the host); rank 0 prints every rank's median step time, the median without all-reduces, and the
all-reduce share 1 - without / with (it includes waiting for the slowest rank: what a rank really loses to the
collectives). --compile compiles
both kinds (two graphs; CUDA graphs on a GPU). On CPU with gloo this is a correctness run: two processes on one
machine's cores are slower than one (docs/tensor_parallel.md).
"""
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from engine import Generation  # noqa: E402
import runtime  # noqa: E402
import policies  # noqa: E402
import ranks  # noqa: E402
import tp  # noqa: E402
from checkpoint import shape_config  # noqa: E402
from cli import Parser, run_ranks  # noqa: E402
from config import parse_config  # noqa: E402
from errors import UserError, check_int  # noqa: E402

MAX_TOKENS = 2 ** 31 - 1


def parser() -> Parser:
    ap = Parser(description=__doc__)
    ap.add_argument("--checkpoint", default="llama3.2-1b", help="a short name or a folder with a config.json")
    ap.add_argument("--policy", default="keydiff", help="generate.py's --policy")
    ap.add_argument("--budget", type=int, default=512, help="KV slots held per layer and KV head")
    ap.add_argument("--prompt-tokens", type=int, default=1024, help="the random prompt's length in tokens")
    ap.add_argument("--block-size", type=int, default=128, help="prefill block size in tokens")
    ap.add_argument("--steps", type=int, default=40, help="decode steps of each kind (default 40)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cuda (one GPU per rank) or cpu (default: cuda where there is one, else cpu)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="auto = bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--compile", action="store_true", help="compile the decode step (generate.py --compile)")
    ap.add_argument("--threads", type=int, help="CPU threads per rank")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    return ap


def set_reduce(model, group) -> None:
    for layer in model.layers:
        layer.attention.tp_group = layer.feed_forward.tp_group = group


def check(a) -> dict:
    """The flags' bad input, on every rank before any collective; the model's config (its shapes)."""
    for name in ("budget", "prompt_tokens", "block_size", "steps"):
        check_int(name, getattr(a, name), 1, MAX_TOKENS)
    runtime.check_device(a.device)
    config, label = shape_config(a.checkpoint)
    ctx = parse_config(config).max_seq_len
    if max(a.prompt_tokens + 2 * a.steps + 3, a.block_size, a.budget) > ctx:
        raise UserError(f"--prompt-tokens + 2 x --steps + 3 ({a.prompt_tokens} + {2 * a.steps + 3}), --block-size "
                        f"({a.block_size}) and --budget ({a.budget}) must fit the model's context ({ctx})")
    return config, label


@torch.inference_mode()
def run(a) -> int:
    config, label = check(a)
    policy = policies.make(a.policy)
    mesh = ranks.start(None, a.device)
    device = ranks.rank_device(a.device, mesh)
    runtime.set_threads(a.threads)
    dtype = {"auto": torch.bfloat16 if device.startswith("cuda") else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16}[a.dtype]
    model = tp.random_model(config, dtype, device, 0, mesh, label=label)
    group = model.layers[0].attention.tp_group
    L = a.prompt_tokens
    gen = Generation(model.args, policy, [L], budget=a.budget if policy is not None else None,
                     max_new_tokens=2 * a.steps + 3, block_size=a.block_size, device=device)
    gen.setup(model)
    if a.compile:  # as generate.py --compile compiles (the first decode steps, untimed, warm it up)
        gen.compile(model, 0, warm=False)
    ids = torch.randint(0, model.args.vocab_size, (L,), generator=torch.Generator().manual_seed(0)).tolist()
    gen.prefill(model, [ids])
    times, kinds = {True: [], False: []}, []

    def on_step(logits, seconds):  # the step just timed by engine.decode; the next one the other kind
        on = len(kinds) % 2 == 0
        kinds.append(on)
        if len(kinds) > 2:  # the first of each kind compiles / warms up
            times[on].append(seconds)
        set_reduce(model, None if on else group)

    set_reduce(model, group)
    gen.decode(model, torch.zeros(1, dtype=torch.long, device=device), [[0]], [L], on_step=on_step)
    set_reduce(model, group)
    with_ar, without = statistics.median(times[True]), statistics.median(times[False])
    rows = tp.gather_ints([round(with_ar * 1e6), round(without * 1e6)], mesh)
    out = {"world": mesh.world, "device": device.split(":")[0], "checkpoint": label, "policy": a.policy,
           "budget": a.budget, "prompt_tokens": L, "compiled": a.compile, "threads": torch.get_num_threads(),
           "step_ms_per_rank": [r[0] / 1e3 for r in rows], "step_ms_without_allreduce_per_rank":
           [r[1] / 1e3 for r in rows],
           "allreduce_share_per_rank": [round(1 - r[1] / r[0], 3) if r[0] else None for r in rows]}
    if mesh.rank == 0:
        if a.json:
            print(json.dumps(out))
        elif mesh.world == 1:  # nothing to switch off: both kinds of step are the same
            print(f"one process: decode step {statistics.median(times[True] + times[False]) * 1e3:.2f} ms")
        else:
            for r, (w, wo) in enumerate(rows):
                print(f"rank {r}: decode step {w / 1e3:.2f} ms, without all-reduce {wo / 1e3:.2f} ms, "
                      f"all-reduce share {1 - wo / w:.0%}")
    return 0


def main(argv=None) -> int:
    return run_ranks(run, lambda: parser().parse_args(argv))  # under torchrun only rank 0 prints


if __name__ == "__main__":
    sys.exit(main())
