"""One rank of tests/test_tp.py, started by torchrun (2 processes, gloo on CPU): for each case, generate greedily
with the whole model on one rank alone (TP=1, the reference; no collective; the eager suite's ranks split these runs
and exchange them) and with this rank's shard (TP=2),
and write what the test compares to <out>/rank<R>.json: both token lists, the largest logit difference, the
reference's smallest top-1 margin, and whether this rank's kept positions equal the reference's of the same KV
heads in every layer.

    torchrun --nproc-per-node 2 tests/tp_worker.py <out dir> <suites, comma-separated: eager, compiled, quant>

Each rank's file maps each suite's name to its results.
"""
import copy
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import runtime  # noqa: E402
import loading  # noqa: E402
import policies  # noqa: E402
import ranks  # noqa: E402
import tp  # noqa: E402
from engine import generate, setup  # noqa: E402

BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=2048,
            rms_norm_eps=1e-5, rope_theta=10000.0, model_type="llama", architectures=["LlamaForCausalLM"])
# Two tiny GQA models: 2 KV heads (q/k/v/o bias: wo's bias must be added once), 4 KV heads (Qwen2: q/k/v bias,
# tied embeddings).
MODELS = {
    "kv2": dict(BASE, num_attention_heads=4, num_key_value_heads=2, attention_bias=True, tie_word_embeddings=False),
    "kv4": dict(BASE, num_attention_heads=8, num_key_value_heads=4, model_type="qwen2",
                architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True, use_sliding_window=False),
}
PROMPT_LEN, NEW, BUDGET, BLOCK, SEED = 100, 10, 48, 16, 1


def tiny_model(name: str):
    """Seeded random weights (std 0.08, as conftest's checkpoints: wide enough for clear logit margins), random
    biases and norms: the same on every rank."""
    model = loading.random_model(MODELS[name], torch.float32, "cpu", seed=SEED, std=0.08)
    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("bias") or "norm" in pname:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def prompt_ids(n: int = PROMPT_LEN) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(7)).tolist()


def recording(fn, logits: list):
    def step(model, idx, input_pos):
        out = fn(model, idx, input_pos)
        logits.append(out.detach().float().clone())
        return out
    return step


def run(model, spec: str, prefill: str, steps=(runtime.prefill_step, runtime.model_step)):
    """Greedy tokens, each step's logits, and the caches' kept positions per layer [H, n] (sorted, per KV head)."""
    policy = policies.make(spec)
    L = PROMPT_LEN
    budget = BUDGET if policies.lookup(spec) is not None and hasattr(policy, "score") else L + NEW
    setup(model, policy, budget, L, NEW, BLOCK, prefill=prefill)
    logits = []
    out, _ = generate(model, prompt_ids(), NEW, block_size=BLOCK, one_shot=prefill == "one-shot",
                      steps=tuple(recording(s, logits) for s in steps))
    kept = [sorted_positions(layer.attention.kv_cache.pos[0]) for layer in model.layers]
    return out, logits, kept


def sorted_positions(pos: torch.Tensor) -> list[list[int]]:
    return [sorted(p for p in row.tolist() if p >= 0) for row in pos]


def compare(ref, got, mesh: ranks.Mesh, hkv_local: int) -> dict:
    (t1, l1, k1), (t2, l2, k2) = ref, got
    n = min(len(l1), len(l2))
    diff = max(float((a - b).abs().max()) for a, b in zip(l1[:n], l2[:n]))
    margins = [float(v[0, 0] - v[0, 1]) for v in (x.topk(2, dim=-1).values for x in l1)]
    h0 = mesh.rank * hkv_local
    kept_equal = all(kr[h0:h0 + hkv_local] == kt for kr, kt in zip(k1, k2, strict=True))
    return dict(ref=t1, tp=t2, logit_diff=diff, min_margin=min(margins), kept_equal=kept_equal,
                kept_sizes=[len(h) for h in k2[0]])


def cases() -> list[tuple[str, str]]:
    """(policy spec, protocol) for every registered policy under each protocol it allows, plus the settings that
    read every KV head of a layer (gathered across ranks): tova:heads=all, K-VEC's cross-head module picking one
    head of the layer (delta=1) and its coverage alone (delta=0)."""
    out = [("full", "block"), ("full", "one-shot")]
    for name, cls in policies.REGISTRY.items():
        for prefill in ("block", "one-shot"):
            if cls.protocol == "one-shot" and prefill == "block":
                continue
            out.append((name, prefill))
    return out + [("tova:heads=all", "block"), ("tova:heads=all", "one-shot"), ("kvec:delta=1", "one-shot"),
                  ("kvec:delta=0", "one-shot")]


def shared_references(full, mesh) -> list:
    """The one-device runs of every case: each rank runs every world-th case (no collective inside), then the
    ranks exchange them."""
    mine = {i: run(full, spec, prefill) for i, (spec, prefill) in enumerate(cases()) if i % mesh.world == mesh.rank}
    every = [None] * mesh.world
    torch.distributed.all_gather_object(every, mine, group=mesh.group)
    refs = {i: ref for part in every for i, ref in part.items()}
    return [refs[i] for i in range(len(cases()))]


def eager_suite(mesh):
    results = {}
    for mname in MODELS:
        full = tiny_model(mname)
        shard = tp.apply_tp(copy.deepcopy(full), mesh)
        hkv = shard.args.n_kv_heads
        for (spec, prefill), ref in zip(cases(), shared_references(full, mesh), strict=True):
            t = time.perf_counter()
            r = compare(ref, run(shard, spec, prefill), mesh, hkv)
            r["seconds"] = time.perf_counter() - t
            results[f"{mname}|{spec}|{prefill}"] = r
    return results


COMPILED = [("tova:heads=all", "block")]  # docs/testing.md: why this one


def calls_in(gm, name: str) -> int:
    """Occurrences of `name` in a traced graph's code, each layer region (engine.block_region: one subgraph called
    once per layer) counted once per call."""
    n = str(gm.code).count(name)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.higher_order.invoke_subgraph:
            n += calls_in(getattr(gm, node.args[0].target), name)
    return n


def compiling_in_turn(mesh, out_dir: Path, timeout_s: float = 600.0) -> None:
    """Rank 0 compiles each graph first; another rank starts the same compile only once rank 0's has ended, and then
    loads rank 0's graph from inductor's on-disk cache (the ranks trace the same code: equal shapes, and no rank
    number in the graph) instead of compiling it again. Lasts until the next torch._dynamo.reset."""
    count = [0]

    def ended(args):
        count[0] += 1
        (out_dir / f"rank0-compiled-{count[0]}").touch()

    def start(args):
        count[0] += 1
        deadline = time.monotonic() + timeout_s
        while not (out_dir / f"rank0-compiled-{count[0]}").exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 did not compile graph {count[0]} within {timeout_s:.0f} s")
            time.sleep(0.2)
    if mesh.rank == 0:
        torch._dynamo.on_compile_end(ended)
    else:
        torch._dynamo.on_compile_start(start)


def compiled_suite(mesh, out_dir: Path):
    """TP=2 with both steps compiled (fullgraph, error_on_recompile; the one-shot prefill is eager by design) against
    the eager TP=1 reference; the ranks compile in turn (compiling_in_turn)."""
    results = {}
    full = tiny_model("kv2")
    shard = tp.apply_tp(copy.deepcopy(full), mesh)
    for spec, prefill in COMPILED:
        ref = run(full, spec, prefill)
        torch._dynamo.reset()
        # the decode step is one graph holding the 2 all-reduces of every layer
        tok, pos = torch.zeros(1, 1, dtype=torch.long), torch.tensor([PROMPT_LEN])
        setup(shard, policies.make(spec), BUDGET, PROMPT_LEN, NEW, BLOCK, prefill=prefill)  # (run() sets up again)
        with torch.inference_mode():
            exp = torch._dynamo.explain(runtime.model_step)(shard, tok, pos)
        results[f"kv2|{spec}|explain"] = dict(graphs=exp.graph_count, breaks=exp.graph_break_count,
                                              all_reduces=sum(calls_in(g, "all_reduce(") for g in exp.graphs),
                                              all_gathers=sum(calls_in(g, "all_gather") for g in exp.graphs))
        torch._dynamo.reset()
        compiling_in_turn(mesh, out_dir)
        steps = runtime.compile_steps("cpu", prefill=prefill == "block")
        t = time.perf_counter()
        with torch._dynamo.config.patch(error_on_recompile=True):
            got = run(shard, spec, prefill, steps)
            again = run(shard, spec, prefill, steps)  # a second generation: still no recompile
        r = compare(ref, got, mesh, shard.args.n_kv_heads)
        r.update(seconds=time.perf_counter() - t, again=again[0])
        results[f"kv2|{spec}|{prefill}|compiled"] = r
    torch._dynamo.reset()
    return results


def quantized(model, mode: str):
    """The model's Linears quantized in memory (quantize_model without `prepare`: int4 stays in plain nibbles,
    which is what shards)."""
    import quantize
    groupsize = 32 if mode == "int4" else None
    for parent, attr, _, lin in list(quantize.linears(model, True)):
        setattr(parent, attr, quantize.quantized_from_linear(lin, mode, groupsize))
    return model


def plain_kernels(model):
    """Every quantized Linear on its dequantize + matmul kernel, in fp32: sharding then changes only the order of
    wo's and w2's sums (the fused kernels round each rank's partial output to bfloat16, checked separately)."""
    import quantize
    for mod in model.modules():
        if isinstance(mod, (quantize.Int8Linear, quantize.Int4Linear)):
            quantize.pack_for_kernel(mod, "linear" if isinstance(mod, quantize.Int8Linear) else "dequant")
    return model


def fused_linears(qfull, qshard, mesh) -> dict:
    """With the device's fused kernels (bfloat16 inside): each column-parallel shard's output equals its slice of
    the whole Linear's output, and the row-parallel shards' outputs summed over the ranks equal the whole output,
    within bfloat16 rounding (relative to the output's largest value)."""
    from torch.distributed._functional_collectives import all_reduce
    x = torch.randn(1, 5, qfull.args.dim, generator=torch.Generator().manual_seed(3))
    full, shard, r, n = qfull.layers[0], qshard.layers[0], mesh.rank, mesh.world
    args = qfull.args
    hq, hkv, I = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, args.intermediate_size
    errs = {}
    with torch.inference_mode():
        y = full.attention.wqkv(x)
        parts = [y[..., :hq], y[..., hq:hq + hkv], y[..., hq + hkv:]]
        want = torch.cat([p.chunk(n, -1)[r] for p in parts], -1)
        errs["wqkv"] = rel(shard.attention.wqkv(x), want)
        g, u = full.feed_forward.w13(x).chunk(2, -1)
        errs["w13"] = rel(shard.feed_forward.w13(x), torch.cat([g.chunk(n, -1)[r], u.chunk(n, -1)[r]], -1))
        xo = torch.randn(1, 5, hq, generator=torch.Generator().manual_seed(4))
        errs["wo"] = rel(all_reduce(shard.attention.wo(xo.chunk(n, -1)[r]), "sum", mesh.group),
                         full.attention.wo(xo))
        xi = torch.randn(1, 5, I, generator=torch.Generator().manual_seed(5))
        errs["w2"] = rel(all_reduce(shard.feed_forward.w2(xi.chunk(n, -1)[r]), "sum", mesh.group),
                         full.feed_forward.w2(xi))
    return errs


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def quant_suite(mesh):
    import quantize
    results = {}
    for mode in ("int8", "int4"):
        qfull = quantized(tiny_model("kv2"), mode)
        qshard = tp.apply_tp(copy.deepcopy(qfull), mesh)
        plain = plain_kernels(copy.deepcopy(qfull)), plain_kernels(copy.deepcopy(qshard))
        kernels = quantize.prepare(qfull), quantize.prepare(qshard)
        wqkv = qshard.layers[0].attention.wqkv
        for spec, prefill in (("keydiff", "block"), ("snapkv++", "one-shot")):
            r = compare(run(plain[0], spec, prefill), run(plain[1], spec, prefill), mesh, qshard.args.n_kv_heads)
            r.update(kernels=[sorted(k) for k in kernels], wqkv_out=wqkv.out_features, wqkv_type=type(wqkv).__name__,
                     fused_rel_err=fused_linears(qfull, qshard, mesh))
            results[f"kv2|{spec}|{prefill}|{mode}"] = r
    return results


def main():
    out_dir, suites = Path(sys.argv[1]), sys.argv[2].split(",")
    torch.set_num_threads(1)
    mesh = ranks.init("cpu")
    assert mesh.world == 2, mesh
    run_suite = {"eager": eager_suite, "compiled": lambda m: compiled_suite(m, out_dir), "quant": quant_suite}
    results = {name: run_suite[name](mesh) for name in suites}
    (out_dir / f"rank{mesh.rank}.json").write_text(json.dumps(results))
    ranks.finish()


if __name__ == "__main__":
    main()
