"""Which positions does a kvpress press keep? Run with the kvpress venv (it needs transformers < 5.3):

    .venv-kv/bin/python tests/reference/kvpress_keep.py --model DIR --press NAME --ratio R --ids-file F --out OUT.json

Loads the HF checkpoint DIR with transformers (fp32, CPU, attn_implementation="sdpa", so the attention-based presses
compute their own window attention as they do by default), prefills the token ids of F (a JSON list) once without a
press and once inside `with press(model):`, each on a fresh DynamicCache, and recovers the kept positions by matching
every row of the compressed cache's keys against the keys of the uncompressed prefill of the same layer and KV head.
The match is exact (a press compresses after a layer's attention, so every layer's keys are computed from the same
hidden states in both runs) with an allclose fallback, and each kept row must match exactly one position: nothing
here depends on how kvpress computes its indices. Writes {layer: [[sorted positions] per KV head]}.

NAME is keydiff, snapkv, tova, sink (StreamingLLMPress) or keynorm (KnormPress), optionally with press arguments:
`snapkv:window_size=32,kernel_size=7`. Several --press/--ratio/--out triples may be given (one model load), and
several models (one import of transformers and kvpress): each run's arguments, then `--next` and the next run's.
"""
import argparse
import json
import sys

try:
    import torch
    import transformers
    from kvpress import KeyDiffPress, KnormPress, SnapKVPress, StreamingLLMPress, TOVAPress
except ImportError as e:  # exit status 77 = skip (tests/test_kvpress.py)
    print(f"kvpress_keep: cannot import kvpress: {e}", file=sys.stderr)
    sys.exit(77)

PRESSES = {"keydiff": KeyDiffPress, "snapkv": SnapKVPress, "tova": TOVAPress, "sink": StreamingLLMPress,
           "keynorm": KnormPress}


def make_press(spec: str, ratio: float):
    name, _, args = spec.partition(":")
    kw = {k: int(v) for k, v in (a.split("=") for a in args.split(",") if a)}
    return PRESSES[name](compression_ratio=ratio, **kw)


@torch.no_grad()
def prefill_keys(model, ids, press=None):
    cache = transformers.DynamicCache(config=model.config)
    if press is None:
        model(ids, past_key_values=cache, use_cache=True)
    else:
        with press(model):
            model(ids, past_key_values=cache, use_cache=True)
    return [layer.keys[0] for layer in cache.layers]  # [n_kv_heads, kept, head_dim] per layer


N_INEXACT = 0


def match_positions(full: torch.Tensor, kept: torch.Tensor) -> list[int]:
    """Positions (rows of full [L, D]) of the rows of kept [n, D]; exact match, else the unique allclose one."""
    global N_INEXACT
    out = []
    for row in kept:
        hit = (full == row).all(-1).nonzero().flatten()
        if hit.numel() != 1:
            N_INEXACT += 1
            hit = torch.isclose(full, row, rtol=1e-5, atol=1e-6).all(-1).nonzero().flatten()
        if hit.numel() != 1:
            raise SystemExit(f"a kept key row matches {hit.numel()} positions of the uncompressed prefill")
        out.append(int(hit))
    if len(set(out)) != len(out):
        raise SystemExit("two kept key rows matched the same position")
    return sorted(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--ids-file", required=True)
    ap.add_argument("--press", action="append", required=True, help="NAME[:arg=int,...] (repeatable)")
    ap.add_argument("--ratio", action="append", type=float, required=True, help="compression ratio (repeatable)")
    ap.add_argument("--out", action="append", required=True, help="output JSON (repeatable)")
    ap.add_argument("--attn", default="sdpa", help="attn_implementation (default sdpa)")
    a = ap.parse_args(argv)
    transformers.utils.logging.disable_progress_bar()
    if not len(a.press) == len(a.ratio) == len(a.out):
        ap.error("give one --ratio and one --out per --press")
    global N_INEXACT
    N_INEXACT = 0
    torch.manual_seed(0)
    # One thread: the exact match needs both prefills bit-identical, and MKL may split a GEMM differently between
    # two runs when the machine is loaded (a CI run failed so, every key off by more than the allclose fallback).
    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32,
                                                             attn_implementation=a.attn).eval()
    ids = torch.tensor(json.load(open(a.ids_file)), dtype=torch.long)[None]
    full = prefill_keys(model, ids)
    for spec, ratio, out in zip(a.press, a.ratio, a.out):
        kept = prefill_keys(model, ids, make_press(spec, ratio))
        result = {str(i): [match_positions(f, k) for f, k in zip(full[i], kept[i])] for i in range(len(full))}
        with open(out, "w") as f:
            json.dump(result, f)
    print(f"kvpress_keep: {N_INEXACT} kept rows matched by allclose, not bit-exactly", file=sys.stderr)


def runs(argv: list[str]) -> list[list[str]]:
    """The arguments of each run: argv split at `--next`."""
    out = [[]]
    for arg in argv:
        if arg == "--next":
            out.append([])
        else:
            out[-1].append(arg)
    return out


if __name__ == "__main__":
    for run_argv in runs(sys.argv[1:]):
        main(run_argv)
