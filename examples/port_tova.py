"""TOVA ported from docs/policies.md and docs/porting.md alone, in plain NumPy.

    python examples/port_tova.py tests/vectors RESULTS && python scripts/check_port.py tests/vectors RESULTS
"""
import fnmatch
import json
import pathlib
import sys

import numpy as np
from safetensors.numpy import load_file, save_file


def int8_round_trip(x):
    """Each token's and KV head's vector rounded to its int8 grid, in float32."""
    scale = np.maximum(np.abs(x).max(-1, keepdims=True) / np.float32(127), np.float32(1.17549435e-38))
    return (np.clip(np.rint(x / scale), -127, 127) * scale).astype(np.float32)


def attention_row(q, keys):
    """Softmax in fp32 of q . k / sqrt(head_dim) over keys [n, head_dim] (elementwise, so equal keys score equal)."""
    logits = (q[None, :] * keys).sum(-1) / np.float32(np.sqrt(q.shape[-1]))
    e = np.exp(logits - logits.max())
    return e / e.sum()


def tova_scores(q, k, head, group, candidates, newest):
    """The last query's attention over the candidates, averaged over the KV head's query heads."""
    keys = k[candidates, head]
    rows = [attention_row(q[newest, j], keys) for j in range(head * group, (head + 1) * group)]
    return np.mean(rows, axis=0, dtype=np.float32)


def run_case(case, shape, inputs):
    q, k = inputs["q"], inputs["k"]
    if case["kv_dtype"] == "int8":
        k = int8_round_trip(k)
    n, n_kv, budget = q.shape[0], shape["n_kv_heads"], case["budget"]
    group = shape["n_heads"] // n_kv
    steps = case["steps"]
    kept = np.zeros((len(steps), n_kv, n), np.uint8)
    scores = np.full((len(steps), n_kv, n), np.nan, np.float32)
    held = [[] for _ in range(n_kv)]
    for s, (start, end) in enumerate(steps):
        for h in range(n_kv):
            candidates = np.array(held[h] + list(range(start, end)))
            score = tova_scores(q, k, h, group, candidates, end - 1)
            scores[s, h, candidates] = score
            drop = np.lexsort((candidates, score))[: max(len(candidates) - budget, 0)]
            held[h] = sorted(set(candidates.tolist()) - set(candidates[drop].tolist()))
            kept[s, h, held[h]] = 1
    return {"kept": kept, "scores": scores}


def main(vectors, results, pattern="tova-*"):
    vectors, results = pathlib.Path(vectors), pathlib.Path(results)
    manifest = json.loads((vectors / "manifest.json").read_text())
    results.mkdir(parents=True, exist_ok=True)
    for case in manifest["cases"]:
        if case["policy"] != "tova" or not fnmatch.fnmatch(case["case"], pattern):
            continue
        shape = manifest["shapes"][case["inputs"]]
        out = run_case(case, shape, load_file(vectors / shape["file"]))
        save_file(out, results / f"{case['case']}.safetensors")


if __name__ == "__main__":
    main(*sys.argv[1:])
