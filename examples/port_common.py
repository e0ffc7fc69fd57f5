"""What every worked port shares: reading the test vectors, the cache contract, writing results (docs/porting.md).

Written from docs/policies.md and docs/porting.md alone, in plain NumPy, with a dynamic list of positions per KV
head instead of a static buffer: a port may store its cache any way it likes as long as each KV head keeps the
same positions. A port supplies `score(ctx, h, cand, newest) -> fp32 scores of the candidate positions cand` of KV
head h and calls `main(policy, score)`. ctx holds the case's `params` and `budget`, `q`, `k`, `v` (float32 [N, heads,
D], int8-rounded for an int8 case), `group`, `D` and the step's `block` of positions; a rule with state across
steps (H2O's sums) may keep it in ctx, which lives for one case.
"""
import json
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file


def int8_round_trip(x):
    """--kv-dtype int8: what a rule reads is each row (one token, one KV head) rounded to its int8 grid,
    scale = max|x| / 127, in float32."""
    scale = np.maximum(np.abs(x).max(-1, keepdims=True) / np.float32(127), np.finfo(np.float32).tiny)
    return (np.clip(np.round(x / scale), -127, 127) * scale).astype(np.float32)


def attention(ctx, h, queries, cand):
    """The rows a rule reads: the causal fp32 softmax of q . k / sqrt(D) of the query positions `queries` over the
    candidates, for each query head of KV head h's group, averaged over the group: [len(queries), len(cand)]."""
    G = ctx["group"]
    logits = np.einsum("qgd,nd->qgn", ctx["q"][queries][:, h * G:(h + 1) * G], ctx["k"][cand, h]) / np.sqrt(ctx["D"])
    logits = np.where(cand[None, None, :] <= queries[:, None, None], logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True)).mean(1)


def step(ctx, kept, block, newest, score):
    """One step of one KV head: the block is written and attended first, then the kept positions plus the block
    are scored and the lowest dropped down to the budget; ties drop the older position (attend before evict)."""
    cand = np.array(sorted(kept + block))
    s = score(ctx, ctx["head"], cand, newest).astype(np.float32)
    order = np.lexsort((cand, s))  # ascending by (score, position): the first ones are dropped
    return sorted(cand[order[max(0, len(cand) - ctx["budget"]):]].tolist()), cand, s


def run_case(case, shape, inputs, score):
    q, k, v = (inputs[n].astype(np.float32) for n in ("q", "k", "v"))
    if case["kv_dtype"] == "int8":
        k, v = int8_round_trip(k), int8_round_trip(v)
    H, N = shape["n_kv_heads"], k.shape[0]
    ctx = dict(params=case["params"], budget=case["budget"], q=q, k=k, v=v, group=shape["n_heads"] // H,
               D=shape["head_dim"])
    kept = [[] for _ in range(H)]
    out_kept = np.zeros((len(case["steps"]), H, N), np.uint8)
    out_scores = np.full((len(case["steps"]), H, N), np.nan, np.float32)
    for i, (start, end) in enumerate(case["steps"]):
        for h in range(H):
            ctx["head"], ctx["block"] = h, list(range(start, end))
            kept[h], cand, s = step(ctx, kept[h], list(range(start, end)), end - 1, score)
            out_kept[i, h, kept[h]] = 1
            out_scores[i, h, cand] = s
    return {"kept": out_kept, "scores": out_scores}


def main(policy, score, argv=None):
    """python examples/port_POLICY.py VECTORS OUT: run every case of `policy` that this port handles."""
    vectors, out = (Path(a) for a in (argv or sys.argv[1:]))
    manifest = json.loads((vectors / "manifest.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    for case in manifest["cases"]:
        if case["policy"] == policy:
            shape = manifest["shapes"][case["inputs"]]
            result = run_case(case, shape, load_file(str(vectors / shape["file"])), score)
            save_file(result, str(out / f"{case['case']}.safetensors"))
