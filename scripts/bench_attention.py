"""How fast a decode step's attention runs on this machine, by how it is written: every layer of a model's shapes
(random keys and values: speed does not depend on the values) attending a cache of --slots slots with a few query
tokens (a decode step: 1; a speculative verification block of K drafts: K + 1), grouped-query heads folded as
kernels.attention folds them (the g query heads of a KV head become g x tokens query rows).

    python scripts/bench_attention.py --checkpoint smollm2-135m --slots 8320 --tokens 1,2,3,5 --threads 2

Forms, timed alternately (--repeats rounds, each form once per round, after one untimed call that compiles):
- SDPA, eager and compiled (inductor calls the same CPU kernel);
- `kernels.attention`, compiled: the row-wise scores (one reduction per query row over the keys), the softmax in
  fp32, and one batched GEMM with the values: what a compiled CPU step takes for 1-16 query rows (SDPA past that);
- `matmul_attention`, eager and compiled: two batched products and an fp32 softmax, what `kernels.attention` takes on
  CUDA for up to 64 query rows (`--device cuda --dtype bfloat16`).
Prints ms per pass over all layers and the keys' and values' bytes over that time (GB/s), beside the machine's
measured read bandwidth.
"""
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import engine  # noqa: E402
import runtime  # noqa: E402
import kernels  # noqa: E402
from checkpoint import shape_config  # noqa: E402
from cli import Parser, run_cli  # noqa: E402
from config import parse_config  # noqa: E402
from errors import UserError, check_int  # noqa: E402
from scripts.benchlib import MAX_REPEATS  # noqa: E402


def parser() -> Parser:
    ap = Parser(description=__doc__)
    ap.add_argument("--checkpoint", default="smollm2-135m", help="a short name or a folder with a config.json")
    ap.add_argument("--slots", type=int, default=8320, help="cache slots every query attends")
    ap.add_argument("--tokens", default="1,2,3,5", help="query tokens per pass (1: a decode step; K+1: a block)")
    ap.add_argument("--repeats", type=int, default=10, help="timed calls per configuration (median)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="the keys', values' and queries' dtype")
    return ap


def sdpa(q, keys, values, mask):
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


def run(a) -> int:
    try:
        tokens_list = [int(t) for t in a.tokens.split(",")]
    except ValueError:
        raise UserError(f"--tokens takes comma-separated token counts (e.g. 1,3,5), not {a.tokens!r}") from None
    if not all(1 <= t <= 64 for t in tokens_list):
        raise UserError(f"--tokens takes 1-64 query tokens per pass, not {a.tokens!r}")
    check_int("repeats", a.repeats, 1, MAX_REPEATS)
    check_int("slots", a.slots, 1, 1 << 20)
    try:
        device = torch.device(a.device)
    except RuntimeError:
        raise UserError(f"--device {a.device!r}: not a device (cpu, cuda, cuda:N)") from None
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UserError(f"--device {a.device}: this torch sees {torch.cuda.device_count()} CUDA GPU(s)")
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"--device {a.device}: cpu or cuda")
    runtime.set_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    torch._dynamo.config.recompile_limit = 64
    config, label = shape_config(a.checkpoint)
    args = parse_config(config)
    hkv, d, g = args.n_kv_heads, args.head_dim, args.n_heads // args.n_kv_heads
    gen = torch.Generator().manual_seed(0)
    caches = [tuple(torch.randn(1, hkv, a.slots, d, generator=gen).to(a.device, dtype) for _ in "kv")
              for _ in range(args.n_layers)]
    nbytes = sum(k.nbytes + v.nbytes for k, v in caches)
    from scripts.benchlib import read_bandwidth_gb_s
    print(f"{label}: {args.n_layers} layers x {hkv} KV heads ({g} query heads each) x {a.slots} slots x head dim {d}: "
          f"{nbytes / 2**20:.0f} MiB of {a.dtype} keys and values on {a.device}, torch threads "
          f"{torch.get_num_threads()}, read bandwidth {read_bandwidth_gb_s(a.device):.1f} GB/s")
    print("| query tokens | query rows per KV head | form | ms per pass | GB/s |\n|---:|---:|---|---:|---:|")
    for tokens in tokens_list:
        rows = g * tokens
        q = torch.randn(1, hkv, rows, d, generator=gen).to(a.device, dtype)
        mask = torch.ones(1, hkv, rows, a.slots, dtype=torch.bool)
        mask[..., a.slots - tokens + 1:] = torch.ones(tokens, tokens, dtype=torch.bool).tril()[:, 1:].repeat(g, 1)
        mask = mask.to(a.device)
        forms = {}
        for name, op, compiled in (("SDPA, eager", sdpa, False), ("SDPA, compiled", sdpa, True),
                                   ("kernels.attention, compiled", kernels.attention, True),
                                   ("matmul_attention, eager", kernels.matmul_attention, False),
                                   ("matmul_attention, compiled", kernels.matmul_attention, True)):
            def apply(q, mask, op=op):
                return [op(q, k, v, mask) for k, v in caches]
            forms[name] = torch.compile(apply, fullgraph=True, dynamic=False) if compiled else apply
            torch._dynamo.reset()
        times = {name: [] for name in forms}
        with torch.inference_mode():
            ref = forms["SDPA, eager"](q, mask)
            for name, fn in forms.items():  # compile, and check the form computes SDPA's result
                err = max((x - y).abs().max().item() for x, y in zip(fn(q, mask), ref))
                if err > (1e-4 if dtype == torch.float32 else 2e-2):
                    raise RuntimeError(f"{name} differs from SDPA by {err:.2e}")
            for _ in range(a.repeats):
                for name, fn in forms.items():
                    engine.sync(a.device)
                    t = time.perf_counter()
                    fn(q, mask)
                    engine.sync(a.device)
                    times[name].append(time.perf_counter() - t)
        for name, ts in times.items():
            ms = statistics.median(ts) * 1e3
            print(f"| {tokens} | {rows} | {name} | {ms:.2f} | {nbytes / ms / 1e6:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(run, parser().parse_args()))
