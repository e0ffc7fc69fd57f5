"""How fast a decode step's weight products run on this machine, by how they are written: every Linear of a model's
shapes (random weights: speed does not depend on the values) applied once to a few rows, the reads a decode step
makes (batch-1 decode: 1 row; a small batch or a speculative verification block: 2-16).

    python scripts/bench_linear.py --checkpoint smollm2-135m --rows 1,2,5,8 --threads 2

Forms, each timed over --repeats passes after one untimed pass (compiling, for the compiled ones):
- `F.linear`, eager: what nn.Linear does (MKL's GEMV for one row, GEMM for more);
- `kernels.Linear`, eager: F.linear for one row, (W @ x^T)^T for 2-16;
- `F.linear`, compiled: inductor's lowering of the same product;
- `kernels.Linear`, compiled: kernels.rowwise_linear for 1-8 rows, (W @ x^T)^T for 9-16;
- `rowwise_linear`, compiled: one reduction sum(W * row, -1) per row, at every row count (kernels.Linear's 1-8 rows);
- int8 weights (quantize.quantize_model in memory): the fused kernel (aten._weight_int8pack_mm, bfloat16
  activations) eager and compiled, and Int8Linear compiled (rowwise_linear on the weight widened in the loop for 1-8
  rows, the fused kernel for more).
Prints ms per pass and the weights' bytes over that time (GB/s), beside the machine's measured read bandwidth.
"""
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import runtime  # noqa: E402
import loading  # noqa: E402
import quantize  # noqa: E402
from kernels import rowwise_linear  # noqa: E402
from checkpoint import shape_config  # noqa: E402
from cli import Parser, run_cli  # noqa: E402
from errors import UserError, check_int  # noqa: E402
from scripts.benchlib import MAX_REPEATS, read_bandwidth_gb_s  # noqa: E402


def parser() -> Parser:
    ap = Parser(description=__doc__)
    ap.add_argument("--checkpoint", default="smollm2-135m", help="a short name or a folder with a config.json")
    ap.add_argument("--rows", default="1,2,5,8", help="rows per product (1-16: the few-row forms)")
    ap.add_argument("--repeats", type=int, default=10, help="timed calls per configuration (median)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    return ap


def linears(model) -> list:
    mods = [m for layer in model.layers for m in (layer.attention.wqkv, layer.attention.wo,
                                                 layer.feed_forward.w13, layer.feed_forward.w2)]
    return mods + [model.output]


def fused_int8(m, x):
    """CPU's fused int8 kernel itself (a compiled Int8Linear of 1-8 rows takes kernels.rowwise_linear instead)."""
    return quantize.fused_matmul(torch.ops.aten._weight_int8pack_mm, x, m.bias, m.weight, m.scales)


def time_pass(fn, repeats: int) -> float:
    fn()  # compile, or warm the caches
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def run(a) -> int:
    try:
        rows_list = [int(r) for r in a.rows.split(",")]
    except ValueError:
        raise UserError(f"--rows takes comma-separated row counts (e.g. 1,2,5), not {a.rows!r}") from None
    if not all(1 <= r <= 64 for r in rows_list):
        raise UserError(f"--rows takes 1-64 rows per product, not {a.rows!r}")
    check_int("repeats", a.repeats, 1, MAX_REPEATS)
    runtime.set_threads(a.threads)
    torch._dynamo.config.recompile_limit = 64
    config, label = shape_config(a.checkpoint)
    model = loading.random_model(config, torch.float32, "cpu", label=label)
    print(f"{label}: {sum(m.weight.numel() for m in linears(model)) * 4 / 2**20:.0f} MiB of fp32 weights in "
          f"{len(linears(model))} Linears, torch threads {torch.get_num_threads()}, "
          f"read bandwidth {read_bandwidth_gb_s('cpu'):.1f} GB/s")
    print("| weights | rows | form | ms per pass | GB/s |\n|---|---:|---|---:|---:|")

    def report(kind, mods, forms):
        nbytes = sum(m.weight.numel() * m.weight.element_size() for m in mods)
        for rows in rows_list:
            xs = {n: torch.randn(1, rows, n) for n in {m.in_features for m in mods}}
            for name, op, compiled in forms:
                def apply(xs, op=op):
                    return [op(m, xs[m.in_features]) for m in mods]
                fn = torch.compile(apply, fullgraph=True, dynamic=False) if compiled else apply
                with torch.inference_mode():
                    ms = time_pass(lambda fn=fn: fn(xs), a.repeats)
                print(f"| {kind} | {rows} | {name} | {ms:.2f} | {nbytes / ms / 1e6:.1f} |", flush=True)
            torch._dynamo.reset()

    report("fp32", linears(model), [("F.linear, eager", lambda m, x: F.linear(x, m.weight), False),
                                    ("kernels.Linear, eager", lambda m, x: m(x), False),
                                    ("F.linear, compiled", lambda m, x: F.linear(x, m.weight), True),
                                    ("kernels.Linear, compiled", lambda m, x: m(x), True),
                                    ("rowwise_linear, compiled", lambda m, x: rowwise_linear(x, m.weight), True)])
    quantize.quantize_model(model, "int8", head=True)
    report("int8", linears(model), [("fused kernel, eager", lambda m, x: m(x), False),
                                    ("fused kernel, compiled", fused_int8, True),
                                    ("Int8Linear, compiled", lambda m, x: m(x), True)])
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(run, parser().parse_args()))
