"""A policy's decode-step overhead over `no-evict`, measured in ONE process: one model per configuration (the weights
are the same mmapped file), each prefilled block-wise (eager), then their decode steps alternate, one step of each in
turn, and the overhead is the median over steps of (policy step / no-evict step) - 1. On a shared VM whose speed
drifts by 10% and more between processes, configurations timed in separate processes (scripts/bench.py's table)
cannot resolve a few percent; alternating steps puts both under the same conditions. The bandwidth-bound fraction is
paired the same way: a 256 MiB read probe is timed before each round of steps, and each step's bytes are costed at
the bandwidth of its own round. `--profile [ROWS]` then prints each configuration's top kernels.

    python scripts/bench_paired.py --compile --policies keydiff [--decode-steps 96]
"""
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from errors import check_python  # noqa: E402

check_python()  # one line, not a traceback, in a Python without the requirements
import torch  # noqa: E402

import policies  # noqa: E402
from cache import is_scorer  # noqa: E402
from cli import run_cli  # noqa: E402
from engine import decode_bytes_per_step, sync  # noqa: E402
from errors import UserError  # noqa: E402
from runtime import AOT  # noqa: E402
from sampling import first_tokens  # noqa: E402
from scripts.benchlib import (bench_model, bench_run, bench_settings, bench_source, check_common,  # noqa: E402
                              check_policy_flags, check_sizes, compiler_flags, config_policy, make_document,
                              parser as common_parser, policy_flags, random_prompt, save, start, timed_read,
                              weights_label)
from tokenizer import load_tokenizer  # noqa: E402


def parser():
    ap = common_parser(__doc__)
    policy_flags(ap, "keydiff")
    compiler_flags(ap)
    ap.add_argument("--freezing-twins", action="store_true",
                    help="with --compile: each configuration twice, its graph compiled without (generate.py's "
                         "choice) and with inductor's freezing (weights folded into the graph: '<policy> (frozen)')")
    ap.add_argument("--aot-twins", action="store_true",
                    help="with --compile on CPU: each configuration twice, its decode step compiled by "
                         "torch.compile (default mode, unfrozen) and ahead of time ('<policy> (aot)', generate.py's)")
    ap.add_argument("--profile", type=int, nargs="?", const=15, metavar="ROWS",
                    help="after the timed steps, profile 10 decode steps of each configuration and print the top "
                         "ROWS (15) kernels by self time (with --compile: inductor's named kernels, whose record hooks "
                         "then run in the timed steps too)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    return ap


def check_args(args) -> None:
    """Bad input fails here, before any model is loaded."""
    check_common(args)
    check_policy_flags(args)
    for k in ("freezing_twins", "aot_twins"):
        if getattr(args, k) and not args.compile:
            raise UserError(f"--{k.replace('_', '-')} needs --compile")
    if args.compile_mode == AOT and args.freezing_twins:
        raise UserError("--compile-mode aot compiles the CPU decode step, unfrozen: not with --freezing-twins")
    if args.aot_twins and args.device != "cpu":
        raise UserError("--aot-twins compares the CPU decode step's two compilers: not on a CUDA device")
    if args.freezing_twins and args.aot_twins:
        raise UserError("--freezing-twins and --aot-twins: one pair of twins per run")
    if args.profile is not None and args.profile < 1:
        raise UserError(f"--profile needs >= 1 rows, got {args.profile}")


def run(args) -> None:
    check_args(args)
    start(args)
    run_paired(args)


def run_paired(args) -> None:
    """Decode-step overhead of each policy over no-evict, steps alternating in one process."""
    labels = ["no-evict", *policies.spec_list(args.policies)]
    pols = [config_policy(label) for label in labels]
    for label, policy in zip(labels, pols):
        if not is_scorer(policy) or policy.protocol == "one-shot" or policy.decode != "evict":
            raise policies.PolicyError(f"--paired measures block-wise evicting policies, not {label}")
    ckpt, config = bench_source(args)
    check_sizes(config, args)
    ids = random_prompt(config, args.prompt_tokens) if args.random_weights else \
        make_document(load_tokenizer(ckpt), args.prompt_tokens)[1]
    models, frozen, modes, policies_of = {}, {}, {}, {}
    twins = ["", " (frozen)"] if args.freezing_twins else ["", " (aot)"] if args.aot_twins else [""]
    for label, policy in zip(labels, pols):
        for twin in twins:
            name = label + twin
            first = next(iter(models.values()), None)
            model = models[name] = weight_twin(first) if args.random_weights and first is not None else \
                bench_model(args, ckpt, config, args.budget + args.block_size)
            frozen[name] = twin == " (frozen)"
            modes[name] = AOT if twin == " (aot)" else "default" if args.aot_twins else args.compile_mode
            policies_of[name] = (policy, label != "no-evict")
    if args.profile:  # name each compiled kernel in the profile (inductor's CPU kernels are anonymous otherwise)
        torch._inductor.config.cpp.enable_kernel_profile = True
    # one run per configuration, compiled and warmed up as a user's is (its first step's graph traced then, with its
    # own freezing): dynamo treats a module's weights as inputs, so configurations that trace alike share a graph
    gens = {name: bench_run(args, model, policies_of[name][0], len(ids), args.budget, ids[0],
                            evict=policies_of[name][1], freeze=frozen[name], mode=modes[name])
            for name, model in models.items()}
    # Bandwidth probe, timed once per round of steps: each step's bandwidth-bound fraction is taken against the
    # read bandwidth measured next to it, since both drift together on a shared VM. The probe also flushes the
    # caches before each round, which a model smaller than the last-level cache would otherwise sit in.
    probe = torch.ones(2**26, device=args.device)
    outs, probe_s = {}, []
    first_s = {label: [gen.compile_s] for label, gen in gens.items()}
    with torch.inference_mode():
        for label, model in models.items():
            outs[label] = first_tokens(gens[label].prefill(model, [ids]))[1][0]
        step_s = {label: [] for label in models}
        with torch._dynamo.config.patch(error_on_recompile=True):  # a recompile inside the timed steps would be a bug
            for i in range(args.decode_steps):  # rounds of one engine.decode step per configuration
                probe_s.append(timed_read(probe, args.device))
                order = list(models) if i % 2 == 0 else list(models)[::-1]  # neither side always goes first
                for label in order:
                    one_step(models[label], gens[label], outs[label], len(ids), step_s[label].append)
    bw = [probe.nbytes / t / 1e9 for t in probe_s]
    bw_q = statistics.quantiles(bw, n=4)
    mode = (args.compile_mode or "generate.py's mode") + (" + cpp_wrapper" if args.cpp_wrapper else "") \
        if args.compile else "eager"
    print(f"\n{args.checkpoint}, prompt {len(ids)} tokens, budget {args.budget}, {args.decode_steps} alternating decode "
          f"steps, {weights_label(args, config)} on {args.device}, {mode}, torch threads {torch.get_num_threads()}, read bandwidth "
          f"(probe next to each round) median {statistics.median(bw):.1f} GB/s, quartiles {bw_q[0]:.1f} .. "
          f"{bw_q[2]:.1f}\n")
    print("| policy | decode ms/step (median) | overhead vs no-evict (median of per-step ratios) | "
          "quartiles of the ratio | MB read / step | decode / bandwidth bound (median of per-step ratios) | "
          "quartiles | first step s (incl. compile) |")
    print("|---|---|---|---|---|---|---|---|")
    base, rows = step_s["no-evict"], []
    for label, s in step_s.items():
        ratios = sorted(a / b - 1 for a, b in zip(s, base))
        q = statistics.quantiles(ratios, n=4)
        step_bytes = sum(decode_bytes_per_step(models[label]))
        # the time reading this step's bytes at the bandwidth probed in its round, over the step's time
        fractions = [step_bytes / (g * 1e9) / t for g, t in zip(bw, s)]
        f = statistics.quantiles(fractions, n=4)
        print(f"| {label} | {1e3 * statistics.median(s):.2f} | {statistics.median(ratios):+.1%} | "
              f"{q[0]:+.1%} .. {q[2]:+.1%} | {step_bytes / 1e6:.4g} | {statistics.median(fractions):.1%} | "
              f"{f[0]:.1%} .. {f[2]:.1%} | {first_s[label][0]:.1f} |")
        rows.append({"label": label, "decode_step_ms": 1e3 * statistics.median(s),
                     "overhead": statistics.median(ratios), "overhead_quartiles": [q[0], q[2]],
                     "bytes_per_step": step_bytes, "bandwidth_fraction": statistics.median(fractions),
                     "first_step_s": first_s[label][0]})
    if args.json:
        save(args.json, args, bench_settings(args, ckpt, "paired"), read_gb_s=statistics.median(bw), rows=rows)
    if args.profile:
        with torch._dynamo.config.patch(error_on_recompile=True):  # profile the graphs just timed, not new ones
            profile_steps(models, outs, len(ids), gens, args)


def weight_twin(model):
    """A model over `model`'s own weight tensors, its caches set up after: the random-weights configurations share
    one set of weights (a set per configuration would not fit one GPU at 8B shapes)."""
    from loading import meta_model
    twin = meta_model(model.config)
    weights = {k: t for k, t in model.state_dict().items() if ".kv_cache." not in k}  # not its caches
    twin.load_state_dict(weights, assign=True)
    if twin.args.tie_embeddings:  # one Parameter for both, as the model has
        twin.output.weight = twin.tok_embeddings.weight
    twin.inv_freq, twin.config = model.inv_freq, model.config
    return twin.eval()


def one_step(model, gen, out: list[int], prompt_len: int, timed) -> None:
    """One greedy step of the run's decode loop after the tokens `out` (appended in place) of a prompt_len-token
    prompt; timed(seconds) with the step's time."""
    token = torch.tensor(out[-1:], device=model.tok_embeddings.weight.device)
    gen.decode(model, token, [out], [prompt_len + len(out) - 1], max_new_tokens=len(out) + 1,
               on_step=lambda logits, s: timed(s))


def profile_steps(models, outs, prompt_len, gens, args, n_steps: int = 10) -> None:
    """torch.profiler over n_steps decode steps (engine.decode) of each configuration, the top kernels by self
    time."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    sort_by = "self_device_time_total" if args.device.startswith("cuda") else "self_cpu_time_total"
    for label, model in models.items():
        out = outs[label]
        with torch.inference_mode(), profile(activities=activities) as prof:
            gens[label].decode(model, torch.tensor(out[-1:], device=args.device), [out], [prompt_len + len(out) - 1],
                               max_new_tokens=len(out) + n_steps)
            sync(args.device)
        print(f"\n{label}: {n_steps} decode steps, top kernels by self time\n")
        print(prof.key_averages().table(sort_by=sort_by, row_limit=args.profile, max_name_column_width=60))


def main():
    return run_cli(run, parser().parse_args())


if __name__ == "__main__":
    sys.exit(main())
