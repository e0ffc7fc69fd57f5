"""The engine: build a model from a checkpoint directory and run it with a fixed-budget KV cache (block-wise or
one-shot prefill, then decode), plus what the command lines share to time and measure it. generate.py is its
command line."""
import contextlib
import ctypes
import dataclasses
import math
import os
import re
import time
from pathlib import Path

import threads  # noqa: F401  (before torch: how its OpenMP threads wait, for the Python API too)
import torch

import aoti
import kernels
from cache import (KV_DTYPES, Storage, compress_into, eager_blocks, is_scorer, kv_bytes, row_cache, scratch_cache,
                   setup_caches)
from config import parse_config
from convert import ENGINE_FILE, CheckpointError, check_loaded, read_config, read_hf_dir
from errors import UserError
from model import ModelArgs, RMSNorm, Transformer, TransformerBlock, on_meta, rope_inv_freq
from policies import Run
from sampling import RepetitionPenalty, StopStrings

INDUCTOR_CACHE = Path(__file__).resolve().parent / "build" / "inductor-cache"  # compiled steps, kept across runs


def load_model(ckpt_dir: Path, dtype: torch.dtype, device: str, config: dict | None = None, shard=None,
               read=None) -> Transformer:
    """Build the model from config.json and load weights without a second copy (meta init + assign).

    `config`: the checkpoint's config.json when the caller has read it already (read here otherwise); the model
    carries it as `model.config`, so that nobody reads it twice. A checkpoint written by scripts/quantize.py (a
    "budgetkv_quantization" entry in config.json) gets its Linears swapped for quantized ones before loading, and
    repacked for the device's kernel after. shard(model): applied once the weights are in, before that repacking
    (tp.apply_tp: each rank keeps its slice of every Linear); with read(handle), which reads an engine file's
    tensors already sliced through its safe_open handle (tp.read_slices), shard is applied to the empty model before
    the loading instead. An engine file is read only with the identity its resolve verified (convert.check_loaded)."""
    if config is None:
        config = read_config(ckpt_dir)
    args = parse_config(config)
    quant = config.get("budgetkv_quantization")
    engine_file = ckpt_dir / ENGINE_FILE
    if engine_file.is_file():
        from safetensors import SafetensorError, safe_open
        try:
            with safe_open(str(engine_file), "pt", device="cpu") as f:  # the identity and tensors of one file
                check_loaded(engine_file, f.metadata())
                tensors = {k: f.get_tensor(k) for k in f.keys()} if read is None else read(f)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {engine_file} (truncated or corrupt?): {e}") from None
    else:
        check_loaded(engine_file, None)
        tensors = read_hf_dir(ckpt_dir)
    n_layers = 1 + max((int(k.split(".")[1]) for k in tensors if k.startswith("layers.")), default=-1)
    if n_layers != args.n_layers:  # before the model is built: a config with a million layers would take minutes
        raise CheckpointError(f"weights in {ckpt_dir} have {n_layers} layers, its config.json's num_hidden_layers "
                              f"says {args.n_layers}")
    # Float tensors take the run's dtype (quantization scales included); packed integer weights keep theirs.
    tensors = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in tensors.items()}
    with on_meta():
        model = Transformer(args)
        if quant is not None:
            import quantize
            quantize.swap_linears(model, quant)
    sliced = read is not None and engine_file.is_file()
    if shard is not None and sliced:
        shard(model)
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
    if shard is not None and not sliced:
        shard(model)
    if quant is not None:
        quantize.prepare(model)  # pick each Linear's kernel for this device; says once if it falls back
    model.config = config
    return model.eval()


def meta_model(config: dict) -> Transformer:
    """The model of a config.json on the meta device: its shapes and parameter count, no weight allocated. It builds
    every layer's modules: check a config's weight_count against the memory free before."""
    args = parse_config(config)  # off the meta device: it checks RoPE's frequencies by value
    with on_meta():
        return Transformer(args)


def parameter_count(model) -> int:
    """Parameters, a tied embedding counted once (model.parameters() yields a shared tensor once)."""
    return sum(p.numel() for p in model.parameters())


def weight_count(args: ModelArgs, world: int = 1) -> int:
    """The parameters of args' model from its sizes alone (no module built), a tied embedding counted once; world
    > 1: those one tensor-parallel rank holds (wqkv, wo, w13 and w2 sliced `world` ways, the rest whole)."""
    d, f, q, kv = args.dim, args.intermediate_size, args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    sliced = [(q + 2 * kv) * d, (q + 2 * kv) * args.qkv_bias, d * q, 2 * f * d, d * f]  # wqkv, its bias, wo, w13, w2
    whole = 2 * d + d * args.o_bias  # the two norms, wo's bias
    embeddings = args.vocab_size * d * (1 if args.tie_embeddings else 2)
    return args.n_layers * (sum(n // world for n in sliced) + whole) + embeddings + d


def free_memory(device: str) -> int | None:
    """Bytes free for a new allocation on `device`: CUDA's mem_get_info, or on CPU /proc/meminfo's MemAvailable
    (None where neither can be read: nothing is checked)."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def kv_cache_estimate(args: ModelArgs, slots: int, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> int:
    """Bytes of the K and V buffers of `slots` slots in every layer, for one sequence: what cache.Storage allocates
    for them, allocated on the meta device (nothing is)."""
    buffers = Storage(dtype, kv_dtype).allocate((1, args.n_kv_heads, slots, args.head_dim), "meta")
    return args.n_layers * sum(t.nbytes for t in buffers.values())


def check_fits(label: str, n_params: int, dtype: torch.dtype, device: str, kv_bytes: int = 0) -> None:
    """UserError, before anything is allocated, when the weights (n_params in dtype) and the KV cache (kv_bytes)
    need more than `device` has free."""
    free = free_memory(device)
    weights = n_params * dtype.itemsize
    if free is not None and weights + kv_bytes > free:
        gib = 2 ** 30
        raise UserError(f"{label} in {str(dtype).removeprefix('torch.')} needs {(weights + kv_bytes) / gib:.1f} GiB "
                        f"(weights {weights / gib:.1f} GiB + KV cache {kv_bytes / gib:.1f} GiB), more than the "
                        f"{free / gib:.1f} GiB free on {device}: pick a smaller model, dtype or budget")


def random_model(config: dict, dtype: torch.dtype, device: str, seed: int = 0, std: float = 0.02, *,
                 label: str = "the model", kv_bytes: int = 0, shard=None, n_params: int | None = None) -> Transformer:
    """The model of a config.json with seeded random weights instead of a checkpoint's (speed and memory do not
    depend on the values): every Linear and the embedding normal(0, std), norms 1, biases 0. Built on the meta
    device, then each tensor allocated once, in `dtype`, on `device` and filled there (no float32 copy on the host
    for a bfloat16 run; a tied head shares the embedding). Refused (UserError) before any allocation when the weights
    plus kv_bytes (the KV cache the caller will allocate) exceed the device's free memory. shard(name, module):
    called on each module once its own tensors are made, to keep a slice of them (tp.random_model: a rank holds
    its shard plus at most one whole tensor at a time, with the values of the whole model's); n_params: the
    parameters that then remain (what check_fits counts)."""
    args = parse_config(config)
    n_params = n_params or weight_count(args)
    check_fits(f"{label}'s shapes ({args.n_layers} layers, {n_params:,} parameters)", n_params, dtype, device,
               kv_bytes)
    model = meta_model(config)
    gen = torch.Generator(device=device).manual_seed(seed)
    made, keep = {}, []  # keep: the meta tensors stay alive, so that no id is reused during the walk
    with torch.no_grad():
        for module_name, module in model.named_modules():
            meta = {name: p for name, p in module._parameters.items() if p is not None}
            for name, p in list(module._parameters.items()):
                if p is None:
                    continue
                if id(p) not in made:
                    t = torch.empty(p.shape, dtype=dtype, device=device)
                    if name == "bias":
                        t.zero_()
                    elif isinstance(module, RMSNorm):
                        t.fill_(1.0)
                    else:
                        t.normal_(0.0, std, generator=gen)
                    made[id(p)] = torch.nn.Parameter(t)
                    keep.append(p)
                module._parameters[name] = made[id(p)]
            if shard is not None:
                shard(module_name, module)
                for name, p in meta.items():  # only the slice stays referenced: the whole tensor is freed
                    made[id(p)] = module._parameters[name]
    if args.tie_embeddings:
        assert model.output.weight is model.tok_embeddings.weight
    model.inv_freq = rope_inv_freq(args).to(device)
    model.config = config
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


AOT = "aot"  # a compile mode of our own: the CPU decode step compiled ahead of time (aoti.py)


def compile_steps(device: str, mode: str | None = None, prefill: bool = True, freeze: bool = False):
    """(prefill_step, decode_step), each compiled once with fullgraph=True; decode under CUDA graphs on GPU, and
    with mode AOT (CPU) from an AOTInductor package (aoti.AotStep), the prefill step then torch.compile's.

    Unfrozen (the default), a compiled graph reads the module's own weights and inductor caches it on disk: a later
    process of the same model, policy, budget, block size, dtype and device loads it in seconds. freeze=True folds
    the weights into the graph as constants (inductor's freezing): a second copy of the weights, for a CPU decode
    step ~2% faster (docs/performance.md). prefill=False leaves
    the prefill step eager (gpt-fast's default; generate.py's on CPU). The cache is the repository's
    build/inductor-cache unless TORCHINDUCTOR_CACHE_DIR says otherwise (torch's default is under /tmp, which a
    reboot empties)."""
    if os.access(INDUCTOR_CACHE.parent.parent, os.W_OK):
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(INDUCTOR_CACHE))
    if mode == AOT:  # the decode step from a package (aoti.py): no dynamo unless the prefill step is compiled too
        return (compile_steps(device, None, freeze=freeze)[0] if prefill else prefill_step), aoti.AotStep()

    # Dynamo reads the global flag when it traces (frozen, the weights are constants, not graph inputs): it holds
    # until another compile_steps. In the options too, so that a frozen and an unfrozen step never share a graph.
    torch._inductor.config.freezing = freeze
    use_layer_regions(device, freeze)

    prefill_mode, decode_mode = step_modes(device, mode)
    return ((compile_step(prefill_step, prefill_mode, freeze) if prefill else prefill_step),
            compile_step(model_step, decode_mode, freeze))


def use_layer_regions(device: str, freeze: bool) -> None:
    """Whether the next traced step takes one layer for all (block_region; read when dynamo traces): not for frozen
    weights (a region cannot hold constants), not with the flex attention form (kernels.FORM: a region's
    functionalization fails on its block mask), and on CPU only: on CUDA a region's step runs slower under CUDA graphs
    and TOVA's tokens differ from eager's (docs/performance.md)."""
    set_layer_regions(not freeze and device == "cpu" and kernels.FORM != "flex")


# Layer regions: a compiled step traces one layer and stamps its graph out for every later layer whose inputs and
# whatever it reads of its modules match (torch.compiler.nested_compile_region; a layer that differs, say a policy
# reading the layer's index, is traced again): tracing, not compiling, is most of a warm start, and a cold one
# compiles one layer's kernels. Eager, a region is the plain function. Every TransformerBlock runs through
# block_forward, which takes the region while regions_on().
block_plain = TransformerBlock.forward
try:  # one reuse entry per distinct layer trace (each model, block shape and differing layer in the process)
    block_region = torch.compiler.nested_compile_region(block_plain, max_reuse_entries=1024)
except TypeError:  # torch 2.11: regions without a reuse limit to set
    block_region = torch.compiler.nested_compile_region(block_plain)
except AttributeError:  # a torch without regions
    block_region = block_plain
layer_regions = True


def block_forward(block: TransformerBlock, x, cos, sin, input_pos, query_pos, cache=None):
    """TransformerBlock.forward, as one layer region while regions_on()."""
    return (block_region if regions_on() else block_plain)(block, x, cos, sin, input_pos, query_pos, cache)


TransformerBlock.forward = block_forward


def set_layer_regions(on: bool) -> None:
    """use_layer_regions calls this before every compile; it also marks regions_on a constant for dynamo (here, not
    at import: the marker imports dynamo, ~70 MiB and ~1.3 s that an eager run does not need)."""
    global layer_regions
    layer_regions = on
    torch.compiler.assume_constant_result(regions_on)


def regions_on() -> bool:
    """layer_regions, read when dynamo traces a step and not guarded (as inductor's freezing flag is): a frozen
    and an unfrozen step traced one after the other in one process both keep running without a recompile."""
    return layer_regions


aoti.before_export = lambda: set_layer_regions(False)  # an exported step is flat


def compile_step(fn, mode: str | None, freeze: bool = False):
    """fn compiled once with fullgraph=True and static shapes under `mode`, a set of inductor options (frozen or
    not, so that a frozen and an unfrozen step never share a graph). Each step is its own Python function: dynamo
    caches compiled graphs per code object, so one function compiled for two models would recompile."""
    options = {**torch._inductor.list_mode_options(mode or "default"), "freezing": freeze}
    return torch.compile(fn, fullgraph=True, dynamic=False, options=options)


@torch.inference_mode()
def warm_up(model, steps, first_id: int, block_size: int, device: str, batch: int = 1) -> None:
    """Compile (or load) both steps before anything is timed, in the order a run calls them: the prefill step on one
    padded block (a batch: each sequence at its own positions), then the decode step twice with its inputs made as
    decode() makes them (decode_inputs: other shapes or strides would recompile). Twice, since CUDA graph trees
    warm up on a graph's first call and record it on the second; the third call, the first timed one, replays.
    Leaves the caches dirty: reset before use."""
    first = torch.tensor([first_id], device=device)
    idx, pos = block_inputs(first, 0, block_size) if batch == 1 else \
        batch_block_inputs([first] * batch, 0, block_size)
    steps[0](model, idx, pos)
    for _ in range(2):
        steps[1](model, *decode_inputs(torch.full((batch,), first_id, device=device),
                                       torch.ones(batch, dtype=torch.long, device=device)))
    sync(device)
    release_free_memory()


def release_free_memory() -> None:
    """Give the C allocator's free pages back to the system (glibc's malloc_trim): the temporaries of a long
    prefill or of a compile, once freed, otherwise stay in the process's RSS for the whole decode. Nothing
    where the C library has no malloc_trim."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def default_compile_mode(device: str, dtype: torch.dtype, quantized: bool, freeze: bool = False) -> str | None:
    """--compile-mode auto: on CPU, AOT (the decode step compiled ahead of time: no tracing on a warm start, no
    compiler in the process, no guards per step), or frozen in fp32 max-autotune (inductor's packed micro-GEMM
    templates, which need the weights as constants; otherwise torch's default: quantized Linears have kernels of
    their own); on CUDA None means reduce-overhead (CUDA graphs) for decode."""
    if device == "cpu" and not freeze:
        return AOT
    packed = freeze and device == "cpu" and dtype == torch.float32 and not quantized
    return "max-autotune-no-cudagraphs" if packed else None


def set_threads(n: int | None) -> None:
    """n CPU threads for torch's intra-op and inter-op pools (None: torch's default, one per core). The inter-op
    pool can be sized once per process, before any parallel work: a later call leaves it as it is."""
    if n is None:
        return
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError:
        pass


MIN_TEMPERATURE = 1e-5  # below it sampling is greedy: logits / t would overflow, and exp() of the gaps is 0 anyway


def sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """logits [B, V] -> token ids [B]. Greedy at a temperature below MIN_TEMPERATURE (0 included); the exponential
    race avoids a host sync. The largest logit is subtracted before dividing by the temperature, so that no finite
    row overflows into inf - inf = NaN."""
    if temperature < MIN_TEMPERATURE:
        return logits.argmax(-1)
    return race(probabilities(logits, temperature, top_k, top_p))


def probabilities(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """What sample() draws from (temperature >= MIN_TEMPERATURE): softmax(logits / temperature) over [..., V],
    top-k and then top-p applied (the tokens outside them 0). Not renormalised after top-p: divide by the sum
    for a distribution."""
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > top_p  # keep the smallest prefix whose mass reaches p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
    return probs


def race(weights: torch.Tensor) -> torch.Tensor:
    """One index per row of non-negative weights [..., V], drawn with probability proportional to its weight (the
    exponential race: argmax w / Exp(1), no normalisation and no host sync)."""
    return (weights / torch.empty_like(weights).exponential_(1)).argmax(-1)


def block_inputs(prompt: torch.Tensor, start: int, block_size: int):
    """One prefill block, padded to block_size so every block has the same shape (no recompiles)."""
    chunk = prompt[start:start + block_size]
    n = chunk.numel()
    idx = torch.zeros(1, block_size, dtype=torch.long, device=prompt.device)
    idx[0, :n] = chunk
    pos = torch.arange(start, start + block_size, device=prompt.device)
    pos[n:] = -1
    return idx, pos


def batch_block_inputs(prompts: list[torch.Tensor], start: int, block_size: int):
    """Block `start // block_size` of every sequence of a batch, each at its own positions: idx, input_pos
    [B, block_size], left-aligned (a sequence's block i holds its tokens [start, start + block_size), as its
    batch-1 prefill would; -1 pads a short block, and the whole block once the sequence's prompt has ended)."""
    rows = [block_inputs(p, start, block_size) for p in prompts]
    return torch.cat([idx for idx, _ in rows]), torch.stack([pos for _, pos in rows])


def prefill_one_shot(model, prompt: torch.Tensor, block_size: int, shared: dict | None = None, *,
                     on_prefill=None, row: int | None = None, on_layer=None) -> torch.Tensor:
    """Dense prefill of the whole prompt, then one compression per layer (the SnapKV / RocketKV / kvpress protocol):
    model.prefill_layer_major with one scratch cache at a time (one layer's K/V for the whole prompt, slot =
    position), each compressed into its layer's cache (cache.compress_into) before the next layer runs. `shared`:
    the cross-layer state of this forward (K-VEC's coverage counter), a fresh dict unless given. on_prefill(done, L)
    after each layer: the share of the prompt's work done, L * layers done // layers (every token goes through a
    layer at once). row: compress into sequence `row` of a batch cache (cache.row_cache), the others untouched.
    on_layer(i, scratch): layer i's whole-prompt scratch (slot = position) before its compression (speculative.py
    copies it into its target's full cache). Returns the last position's logits [1, vocab]."""
    L = prompt.numel()
    n_layers = len(model.layers)
    n_blocks = -(-L // block_size)
    idx, input_pos = block_inputs(prompt, 0, n_blocks * block_size)
    shared = {} if shared is None else shared

    def layer_cache(i):
        c = model.layers[i].attention.kv_cache
        return c if row is None else row_cache(c, row)

    def scratch(i):
        return scratch_cache(model.layers[i].attention.kv_cache, n_blocks * block_size, L)

    def done(i, scratch):
        c = layer_cache(i)
        if on_layer is not None:
            on_layer(i, scratch)
        if c.scorer is None:  # full, Exact-TopK: the scratch already is the whole prompt
            for dst, src in zip([c.pos, *c.slot_buffers()], [scratch.pos, *scratch.slot_buffers()], strict=True):
                dst[:, :, :L] = src[:, :, :L]
        else:
            compress_into(scratch, c, shared)
        if on_prefill is not None:
            on_prefill(L * (i + 1) // n_layers, L)
    return model.prefill_layer_major(idx, input_pos, block_size, scratch, done)


def prefill(model, prompt: torch.Tensor, block_size: int, step=prefill_step, one_shot: bool = False,
            shared: dict | None = None, *, on_prefill=None) -> torch.Tensor:
    """The prompt [L] into the caches: block-wise (`step` on each padded block) or one-shot (prefill_one_shot,
    eager); returns the last position's logits [1, vocab]. The eager step over caches that hold every token at
    slot == position (full, Exact-TopK), where no block boundary decides anything, takes unpadded chunks of at
    least EAGER_CHUNK tokens instead (larger products, fewer calls). on_prefill(done, L), if given, after each block
    with the prompt tokens done (one-shot: after each layer, see prefill_one_shot). It adds no host sync: on CUDA a
    block it reports may still be running (a caller that shows a rate syncs before drawing it)."""
    if one_shot:
        return prefill_one_shot(model, prompt, block_size, shared, on_prefill=on_prefill)
    L = prompt.numel()
    dense = dense_chunk(model, block_size, step)
    with eager_blocks(model, 0, L, step is prefill_step):  # eager: a dense cache's block attends the slots filled
        for start in range(0, L, dense or block_size):
            end = min(start + (dense or block_size), L)
            inputs = (prompt[None, start:end], torch.arange(start, end, device=prompt.device)) if dense else \
                block_inputs(prompt, start, block_size)
            logits = step(model, *inputs)
            if on_prefill is not None:
                on_prefill(end, L)
    return logits


EAGER_CHUNK = 512  # llama.cpp's default micro-batch


def dense_chunk(model, block_size: int, step=prefill_step) -> int | None:
    """The unpadded chunk, at least EAGER_CHUNK tokens, that prefill() gives the eager step over caches that hold
    every token at slot == position (full, Exact-TopK); None elsewhere (padded blocks of block_size)."""
    dense = step is prefill_step and all(layer.attention.kv_cache.spec.mode == "dense" for layer in model.layers)
    return max(block_size, EAGER_CHUNK) if dense else None


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class PeakMemory:
    """Per-phase peak memory: CUDA's max_memory_allocated, or on CPU the process peak RSS (VmHWM), which Linux
    lets us reset by writing 5 to /proc/self/clear_refs. Falls back to ru_maxrss (not resettable) elsewhere."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.measure = "cuda max_memory_allocated" if self.cuda else "process peak RSS, VmHWM"

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.measure = "process peak RSS since start, ru_maxrss"

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


def sample_finite(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                  penalty: RepetitionPenalty | None = None) -> torch.Tensor:
    """sample(), or -1 where a row's logits are not all finite: the check rides on the token's own host sync.
    penalty: applied to the logits first, and told the tokens drawn."""
    if penalty is not None:
        logits = penalty(logits)
    token = torch.where(torch.isfinite(logits).all(-1), sample(logits, temperature, top_k, top_p), -1)
    if penalty is not None:
        penalty.push(token)
    return token


def check_finite(tok: int, step: int) -> None:
    if tok < 0:
        raise UserError(f"the model's logits are not finite (NaN or inf) at generated token {step + 1}: generation "
                        "stopped; check the checkpoint's weights and config.json, or run --dtype float32")


@torch.inference_mode()
def generate(model, prompt_ids: list[int], max_new_tokens: int, *, on_token=None, **kw) -> tuple[list, dict]:
    """One prompt: generate_batch() of a batch of one; returns (generated ids, stats) with the counts as numbers.
    on_token(ids): after every token, with the ids so far."""
    outs, stats = generate_batch(model, [prompt_ids], max_new_tokens,
                                 on_token=None if on_token is None else lambda b, out: on_token(out), **kw)
    return outs[0], one_sequence(stats)


def prefill_batch(model, prompts: list[torch.Tensor], block_size: int, step=prefill_step, one_shot: bool = False,
                  shared: dict | None = None, *, on_prefill=None) -> torch.Tensor:
    """Every prompt of a batch into its row of the caches; returns each sequence's last-position logits [B, vocab].
    One prompt: prefill() (shared: a one-shot prefill's cross-layer state, K-VEC's coverage counter).
    Block-wise: one step per block index for the whole batch (batch_block_inputs: each sequence at its own
    positions, so its blocks are exactly its batch-1 blocks; a sequence whose prompt has ended gets padding, which
    changes nothing it keeps), its logits taken from the block holding its last token. One-shot: each sequence
    alone through prefill_one_shot into its row, with the policy planned for that prompt's length (replan).
    on_prefill(done, total) in prompt tokens of the whole batch (one prompt: see prefill)."""
    if len(prompts) == 1:
        return prefill(model, prompts[0], block_size, step, one_shot, shared, on_prefill=on_prefill)
    total, done = sum(p.numel() for p in prompts), 0
    if one_shot:
        policy = model.layers[0].attention.kv_cache.policy
        planned = dict(vars(policy)) if policy is not None else {}  # the batch's plan, as the decode step saw it
        rows = []
        for b, p in enumerate(prompts):
            replan(model, p.numel())
            rows.append(prefill_one_shot(model, p, block_size, row=b)[0])
            done += p.numel()
            if on_prefill is not None:
                on_prefill(done, total)
        if policy is not None:
            vars(policy).update(planned)  # the same objects again: a compiled decode step's guards still hold
        return torch.stack(rows)
    longest = max(p.numel() for p in prompts)
    last_block = [(p.numel() - 1) // block_size for p in prompts]
    rows = [None] * len(prompts)
    with eager_blocks(model, 0, longest, step is prefill_step):
        for i, start in enumerate(range(0, longest, block_size)):
            logits = step(model, *batch_block_inputs(prompts, start, block_size))
            for b in (b for b, last in enumerate(last_block) if last == i):
                rows[b] = logits[b].clone()
            done += sum(min(block_size, max(0, p.numel() - start)) for p in prompts)
            if on_prefill is not None:
                on_prefill(done, total)
    return torch.stack(rows)


def replan(model, prompt_len: int) -> None:
    """Plan the caches' policy for one prompt of a batch (what plan() sizes from the prompt length: SAGE-KV's
    layout, SnapKV++'s kernel) before that prompt's one-shot compression; setup_batch checked that every prompt's
    plan decodes alike."""
    c = model.layers[0].attention.kv_cache
    if c.policy is None:
        return
    if c.run is None:
        raise UserError("a one-shot batch needs its caches from engine.setup_batch (which plans every prompt)")
    c.policy.plan(dataclasses.replace(c.run, prompt_len=prompt_len))


def first_tokens(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                 penalty: RepetitionPenalty | None = None) -> tuple[torch.Tensor, list]:
    """Each sequence's first token from its prompt's last logits [B, vocab]: (the tokens [B], [[id], ...])."""
    token = sample_finite(logits, temperature, top_k, top_p, penalty)
    outs = [[tok] for tok in token.tolist()]  # the first tokens are needed on the host anyway (streaming, EOS)
    for out in outs:
        check_finite(out[0], 0)
    return token, outs


def decode_inputs(token: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's inputs for a batch of any size: ids and positions [B, 1], views of the [B] tensors (what
    warm_up passes too: other shapes or strides would recompile)."""
    return token.view(-1, 1), positions.view(-1, 1)


def decode(model, step, token: torch.Tensor, outs: list[list[int]], positions: list[int], max_new_tokens: int, *,
           eos_ids=(), temperature=0.0, top_k=0, top_p=1.0, penalty=None, finished=None, on_token=None, on_done=None,
           stop=None, on_step=None) -> int:
    """The decode loop, for a batch of one or more: feeds each sequence's last sampled token (token [B]) at its next
    position (positions[b], then one more each step) and samples the next, until every sequence has its EOS
    (included) or max_new_tokens ids or finished(b, ids) says it is complete (a stop string), or stop() says so
    (checked before each step); penalty: a sampling.RepetitionPenalty. outs: each sequence's ids so
    far, appended in place; a finished sequence keeps stepping with the others (the batch is a static shape) but
    nothing more is recorded for it. on_token(b, ids) after each token appended to sequence b, on_done(b, ids) once
    it is complete. on_step(logits, seconds) after each step: its logits [B, vocab] and its time, the clock read once
    its tokens reached the host (which waits for the device); the benchmarks time steps by it. Returns the steps
    run."""
    def more(b: int) -> bool:
        ids = outs[b]
        return ids[-1] not in eos_ids and len(ids) < max_new_tokens and not (finished and finished(b, ids))
    live = [more(b) for b in range(len(outs))]
    for b, out in enumerate(outs):
        if not live[b] and on_done:
            on_done(b, out)
    pos, n_steps = torch.tensor(positions, device=token.device), 0
    while any(live) and not (stop is not None and stop()):
        n_steps += 1
        t = time.perf_counter()
        logits = step(model, *decode_inputs(token.clamp_min(0), pos))
        token = sample_finite(logits, temperature, top_k, top_p, penalty)
        tokens = token.tolist()
        if on_step is not None:
            on_step(logits, time.perf_counter() - t)
        for b, tok in enumerate(tokens):
            if live[b]:
                check_finite(tok, len(outs[b]))
                outs[b].append(tok)
                if on_token:
                    on_token(b, outs[b])
                live[b] = more(b)
                if not live[b] and on_done:
                    on_done(b, outs[b])
        pos = pos + 1
    return n_steps


@torch.inference_mode()
def generate_batch(model, prompts_ids: list[list[int]], max_new_tokens: int, *, block_size: int, steps,
                   eos_ids=(), temperature=0.0, top_k=0, top_p=1.0, penalty=None, finished=None, device="cpu",
                   one_shot=False, shared: dict | None = None, on_prefill=None, on_token=None, on_done=None
                   ) -> tuple[list[list[int]], dict]:
    """Prefill then decode a batch of one or more prompts of any lengths (caches from setup or setup_batch, one row
    per prompt); returns (each sequence's generated ids, stats). steps = (prefill, decode). Each sequence keeps its
    own positions and kept set; greedy, each one's tokens are its batch-1 tokens. A sequence stops at its first EOS
    (included), at max_new_tokens or where finished(b, ids) says (see decode, and its penalty: started here on
    the prompts). shared, on_prefill: see prefill_batch; on_token(b, ids) after
    each token of sequence b, on_done(b, ids) once it is complete. Stats count decode tokens over all sequences."""
    prefill_fn, decode_fn = steps
    for layer in model.layers:
        layer.attention.kv_cache.reset()
    lens = [len(ids) for ids in prompts_ids]
    if not lens or min(lens) == 0:
        raise UserError("a batch needs at least one prompt, and no prompt may be empty")
    prompts = [torch.tensor(ids, dtype=torch.long, device=device) for ids in prompts_ids]
    check_capacity(model, max(lens), max_new_tokens, one_shot)
    mem = PeakMemory(device)
    # the peak so far: loading and compiling (before the first reset; on CPU the process's peak RSS since it began)
    stats = {"batch_size": len(prompts), "prompt_tokens": lens, "memory_measure": mem.measure,
             "startup_peak_bytes": mem.peak()}

    release_free_memory()  # what loading (a first run's conversion) freed is not the prefill's
    mem.reset()
    sync(device)
    t0 = time.perf_counter()
    logits = prefill_batch(model, prompts, block_size, prefill_fn, one_shot, shared, on_prefill=on_prefill)
    if penalty is not None:
        penalty.start(prompts_ids)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, penalty=penalty)
    token, outs = first_tokens(logits, **sampling)
    t1 = time.perf_counter()
    stats.update(ttft_s=t1 - t0, prefill_tok_s=sum(lens) / (t1 - t0), prefill_peak_bytes=mem.peak())
    if on_token:
        for b, out in enumerate(outs):
            on_token(b, out)

    release_free_memory()
    mem.reset()
    t2 = time.perf_counter()
    n_steps = decode(model, decode_fn, token, outs, lens, max_new_tokens, eos_ids=eos_ids, on_token=on_token,
                     on_done=on_done, finished=finished, **sampling)
    sync(device)
    t3 = time.perf_counter()
    n_decode = sum(len(out) - 1 for out in outs)
    stats.update(decode_tokens=n_decode, decode_s=t3 - t2, decode_tok_s=n_decode / (t3 - t2) if n_decode else 0.0,
                 decode_peak_bytes=mem.peak(), generated_tokens=[len(out) for out in outs], decode_steps=n_steps)
    return outs, stats


def prefill_protocol(policy, prefill: str | None) -> str:
    """The prefill protocol for `policy` and a --prefill choice (None: the policy's default): "block" or
    "one-shot". A paper that defines its protocol fixes it."""
    if policy is not None and policy.protocol == "one-shot":
        if prefill == "block":
            raise UserError(f"--policy {policy.name} compresses the prompt once after a dense prefill; use "
                            "--prefill one-shot (its default)")
        return "one-shot"
    return prefill or "block"


def setup(model, policy, budget: int, prompt_len: int, max_new_tokens: int, block_size: int, *,
          prefill: str = "block", evict_before_attend: bool = False, kv_dtype: torch.dtype | None = None,
          evict: bool = True, batch: int = 1) -> int:
    """Plan `policy` for this run and give every layer its cache of `budget` slots (fewer when the policy's own
    layout needs fewer: SAGE-KV); returns the slots. policy None (`full`) and selector-only policies (Exact-TopK)
    hold every token: budget >= prompt + new tokens. evict=False: the `no-evict` baseline (the same buffer and
    scoring-free steps: nothing is ever dropped)."""
    name = policy.name if policy is not None else "full"
    if not is_scorer(policy) and budget < prompt_len + max_new_tokens:
        raise UserError(f"--policy {name} keeps every token: --budget must be >= prompt + max-new-tokens "
                        f"({prompt_len} + {max_new_tokens}); pick an evicting policy to stay within {budget}")
    if evict_before_attend and (prefill != "block" or not is_scorer(policy)):
        raise UserError(f"--evict-before-attend applies to block-wise evicting policies, not to {name} "
                        f"with --prefill {prefill}")
    if evict_before_attend and budget < block_size:  # else a block's first queries may keep no key to see
        raise UserError(f"--evict-before-attend needs --budget >= --block-size ({budget} < {block_size})")
    slots, keep = budget, None
    run = Run(budget, prompt_len, max_new_tokens, block_size, model.args)
    if policy is not None:
        slots = policy.plan(run) or budget
        keep = policy.prompt_keep(run) if prefill == "one-shot" else None
    setup_caches(model, batch, slots, block_size, policy, evict_before_attend, kv_dtype, keep=keep, evict=evict)
    for layer in model.layers:
        layer.attention.kv_cache.run = run  # what the policy was planned for (replan: one prompt of a batch)
    return slots


def setup_batch(model, policy, budget: int, prompt_lens: list[int], max_new_tokens: int, block_size: int,
                **kw) -> int:
    """setup() for a batch of prompts of these lengths: one cache row per prompt, `budget` slots each. The policy
    is planned for every prompt first: a plan that depends on the prompt's length (SAGE-KV's layout, RocketKV's
    default read) must give every prompt the same slots and the same decode plan (policy.decode_plan), since
    the whole batch decodes as one static shape; otherwise UserError, before anything is allocated."""
    if policy is not None:
        plans = {}
        for L in sorted(set(prompt_lens)):
            slots = policy.plan(Run(budget, L, max_new_tokens, block_size, model.args)) or budget
            plans[L] = (slots, policy.decode_plan())
        (La, pa), *rest = plans.items()
        for Lb, pb in rest:
            if pb != pa:
                raise UserError(f"--policy {policy.name} plans a {La}-token and a {Lb}-token prompt differently "
                                f"(slots and decode plan {pa} vs {pb}) and a batch decodes with one plan: "
                                f"{policy.batch_hint or 'run these prompts in separate batches'}")
    return setup(model, policy, budget, max(prompt_lens), max_new_tokens, block_size, batch=len(prompt_lens), **kw)


def check_capacity(model, prompt_len: int, max_new_tokens: int, one_shot: bool) -> None:
    """A cache that never evicts (full, Exact-TopK, and after a one-shot compression SnapKV++, RocketKV, K-VEC) must
    hold the kept prompt plus every token written during decode (the last sampled one is never written).
    Generation past that capacity is an error, never a silent eviction."""
    spec = model.layers[0].attention.kv_cache.spec
    if spec.mode in ("evict", "no-evict"):
        return
    kept = min(prompt_len, spec.keep) if one_shot and spec.mode == "append" else prompt_len
    if kept + max_new_tokens - 1 > spec.budget:
        raise UserError(f"{spec.policy.name if spec.policy else 'full'}: {kept} kept prompt tokens + "
                        f"{max_new_tokens} new tokens exceed the cache's {spec.budget} slots (raise --budget)")


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
        per_token = sum(t[:, :, :1].nbytes for t in c.kv_buffers())  # K+V (+scales)
        kv += int(per_token * c.read_tokens())
    return weights, kv


# -------------------------------------------------------------------------------------------------------- the run

DEFAULT_NEW_TOKENS, DEFAULT_BLOCK, DEFAULT_BUDGET = 200, 128, 2048  # each clamped to the model's context


def bounded_budget(args: ModelArgs) -> int:
    """The default budget of a policy that evicts, and of a conversation whatever its policy: DEFAULT_BUDGET slots,
    or the model's context if smaller."""
    return min(DEFAULT_BUDGET, args.max_seq_len)


CACHE_NOTES = {"hit": "from the compile cache", "miss": "now cached for the next run",
               "bypass": "not cacheable: compiles again next run", "off": "cache off"}


def check_sizes_and_sampling(args: ModelArgs, max_new_tokens: int | None, budget: int | None, block_size: int | None,
                             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                             repetition_penalty: float = 1.0, repeat_last_n: int = 64) -> None:
    """The sizes (None: the default) and the sampling a run of this model takes: one UserError naming the flag.
    Generation and chat.Chat both check through it."""
    if top_k > args.vocab_size:
        raise UserError(f"--top-k {top_k} exceeds the model's vocabulary ({args.vocab_size} tokens)")
    if not 0.01 <= repetition_penalty <= 100 or not -1 <= repeat_last_n <= args.max_seq_len:
        raise UserError(f"need --repetition-penalty between 0.01 and 100 and --repeat-last-n from -1 (the whole "
                        f"sequence) to the model's context ({args.max_seq_len})")
    for name, value in (("--max-new-tokens", max_new_tokens), ("--budget", budget), ("--block-size", block_size)):
        if value is not None and value < 1:
            raise UserError(f"{name} must be >= 1, got {value}")
    if not (0 <= temperature < math.inf and top_k >= 0 and 0 < top_p <= 1):
        raise UserError("need a finite --temperature >= 0, --top-k >= 0 and 0 < --top-p <= 1")


class Generation:
    """One run of a model over one prompt or a batch: the settings resolved against the model's context and the
    prompts' lengths, then setup() (the caches), compile() (the steps compiled and warmed up) and generate()
    (prefill, the decode loop, the stats). generate.py and generate_text run through it; chat.py (a cache that
    persists across turns), the benchmarks and eval use its pieces: setup, compile_settings, warm_up and the one
    decode loop, `decode`.

    None is the default: max_new_tokens 200 (fewer where the context ends first), block_size 128, budget
    prompt + max_new_tokens for the policies that hold every token (full, exact-topk) and 2048 for the others, each
    clamped to the model's context (`clamped`: {flag: (default, used)}); a value given must fit (UserError).
    prefill: "block" or "one-shot" (None: the policy's default)."""

    def __init__(self, args: ModelArgs, policy, prompt_lens: list[int], *, budget: int | None = None,
                 max_new_tokens: int | None = None, block_size: int | None = None, prefill: str | None = None,
                 evict_before_attend: bool = False, kv_dtype: torch.dtype | None = None, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, repetition_penalty: float = 1.0, repeat_last_n: int = 64,
                 device: str = "cpu"):
        kernels.check_form()
        self.args, self.policy, self.lens, self.device = args, policy, list(prompt_lens), device
        self.protocol = prefill_protocol(policy, prefill)
        self.evict_before_attend, self.kv_dtype = evict_before_attend, kv_dtype
        check_sizes_and_sampling(args, max_new_tokens, budget, block_size, temperature, top_k, top_p,
                                 repetition_penalty, repeat_last_n)
        self.sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        self.penalty = (repetition_penalty, repeat_last_n)
        self.clamped = {}
        self.max_new_tokens, self.block_size = self.fit(max_new_tokens, block_size, budget)
        if not is_scorer(policy):  # full, exact-topk: every token is held
            self.budget = budget or max(self.lens) + self.max_new_tokens
        else:
            self.budget = budget or bounded_budget(args)
            if budget is None and self.budget < DEFAULT_BUDGET:
                self.clamped["--budget"] = (DEFAULT_BUDGET, self.budget)
        self.steps, self.slots = (prefill_step, model_step), None
        self.compile_mode, self.compiled_prefill, self.frozen, self.compile_s, self.compile_cache = \
            None, False, False, 0.0, None

    def fit(self, max_new_tokens, block_size, budget) -> tuple[int, int]:
        """(max_new_tokens, block_size) against the context: a default clamped, a value given checked."""
        ctx, L, n = self.args.max_seq_len, max(self.lens), len(self.lens)
        longest = self.lens.index(L) + 1
        what = "the prompt" if n == 1 else f"prompt {longest} of the batch"
        total = f"prompt ({L})" if n == 1 else f"the longest prompt (prompt {longest} of the batch, {L} tokens)"
        if L > ctx:
            raise UserError(f"{what} has {L} tokens, longer than the model's context of {ctx}")
        if max_new_tokens is None:
            if L >= ctx:
                raise UserError(f"{what} ({L} tokens) fills the model's context ({ctx}): no room for new tokens")
            max_new_tokens = min(DEFAULT_NEW_TOKENS, ctx - L)
            if max_new_tokens < DEFAULT_NEW_TOKENS:
                self.clamped["--max-new-tokens"] = (DEFAULT_NEW_TOKENS, max_new_tokens)
        elif L + max_new_tokens > ctx:
            raise UserError(f"{total} + --max-new-tokens ({max_new_tokens}) exceeds the model's context ({ctx})")
        if block_size is None:
            block_size = min(DEFAULT_BLOCK, ctx)
            if block_size < DEFAULT_BLOCK:
                self.clamped["--block-size"] = (DEFAULT_BLOCK, block_size)
        elif block_size > ctx:
            raise UserError(f"--block-size {block_size} is larger than the model's context ({ctx})")
        if budget is not None and budget > ctx:
            raise UserError(f"--budget {budget} is larger than the model's context ({ctx})")
        return max_new_tokens, block_size

    def kv_bytes_needed(self, dtype: torch.dtype) -> int:
        """Bytes the caches setup() allocates (every layer's, one row per prompt), plus a one-shot prefill's
        scratch (one layer's K/V of the whole padded prompt): what a model built for this run must leave free."""
        block, kv_dtype = self.block_size, self.kv_dtype
        need = len(self.lens) * kv_cache_estimate(self.args, self.budget + block, dtype, kv_dtype)
        if self.protocol == "one-shot":
            scratch = -(-max(self.lens) // block) * block
            need += kv_cache_estimate(self.args, scratch, dtype, kv_dtype) // self.args.n_layers
        return need

    def setup(self, model) -> int:
        """Every layer's cache for this run (setup_batch); returns the slots per layer and KV head."""
        self.slots = setup_batch(model, self.policy, self.budget, self.lens, self.max_new_tokens, self.block_size,
                                 prefill=self.protocol, evict_before_attend=self.evict_before_attend,
                                 kv_dtype=self.kv_dtype)
        return self.slots

    def compile(self, model, first_id: int, mode: str | None = None, prefill: bool | None = None,
                freeze: bool = False, around=None) -> None:
        """Compile both steps (compile_settings) and warm them up on first_id (the caches are left dirty: generate()
        resets them). around(self): a context manager for the warm-up (generate.py's compiler log and ticker),
        entered once the mode is settled, whose value is the terminal's stream (None: stderr). Sets compile_mode,
        compiled_prefill, frozen, compile_s, compile_cache."""
        mode, self.compiled_prefill = compile_settings(model, self.protocol, mode, prefill, freeze)
        self.frozen = freeze
        self.compile_mode = mode_name(mode, self.device)
        self.steps = compile_steps(self.device, mode, prefill=self.compiled_prefill, freeze=freeze)
        dynamo = mode != AOT or self.compiled_prefill
        if dynamo:  # imported here: an eager or AOT run never imports the compiler (~115 MiB, ~1.3 s)
            from torch._dynamo.utils import counters
            counters["inductor"].clear()
        t = time.perf_counter()
        with around(self) if around is not None else contextlib.nullcontext() as terminal:
            if mode == AOT and terminal is not None:
                self.steps[1].stream = terminal  # a package not loaded or not saved: its line there, not in a log
            warm_up(model, self.steps, first_id, self.block_size, self.device, batch=len(self.lens))
        self.compile_s = time.perf_counter() - t
        self.compile_cache = cache_state(counters["inductor"] if dynamo else None,
                                         self.steps[1] if mode == AOT else None)

    def generate(self, model, prompts: list[list[int]], *, eos_ids=(), finished=None, on_token=None, on_done=None,
                 on_prefill=None) -> tuple[list[list[int]], dict]:
        """generate_batch() with this run's settings and steps; returns (each sequence's ids, stats): the timings
        and per-phase peaks, the bytes a decode step reads (weights once for the batch, and KV) and the bandwidth
        they make at the measured steps per second, the cache's size and the compile's record."""
        penalty = None if self.penalty[0] == 1.0 else RepetitionPenalty(
            *self.penalty, len(prompts), model.args.vocab_size, self.device)
        outs, stats = generate_batch(model, prompts, self.max_new_tokens, block_size=self.block_size,
                                     steps=self.steps, eos_ids=eos_ids, penalty=penalty, finished=finished,
                                     device=self.device,
                                     one_shot=self.protocol == "one-shot", on_prefill=on_prefill, on_token=on_token,
                                     on_done=on_done, **self.sampling)
        weight_b, kv_read_b = decode_bytes_per_step(model)
        steps_per_s = stats["decode_steps"] / stats["decode_s"] if stats["decode_steps"] else 0.0
        one_block_wise = len(prompts) == 1 and self.protocol == "block"  # a batch prefills in blocks
        stats.update(budget=self.budget, slots_held=self.slots,
                     slots_read_per_step=model.layers[0].attention.kv_cache.read_tokens(), block_size=self.block_size,
                     prefill_chunk=one_block_wise and dense_chunk(model, self.block_size, self.steps[0]) or
                     self.block_size, prefill=self.protocol, threads=torch.get_num_threads(),
                     compiled=self.steps[1] is not model_step, compiled_prefill=self.compiled_prefill,
                     frozen=self.frozen, compile_mode=self.compile_mode, compile_s=round(self.compile_s, 2),
                     compile_cache=self.compile_cache, kv_cache_bytes=kv_bytes(model), weight_bytes=weight_b,
                     kv_read_bytes_per_step=kv_read_b,
                     process_peak_bytes=max(stats["startup_peak_bytes"], stats["prefill_peak_bytes"],
                                            stats["decode_peak_bytes"]),
                     bandwidth_gb_s=(weight_b + kv_read_b) * steps_per_s / 1e9,  # bytes of a step x steps per second
                     max_new_tokens=self.max_new_tokens,
                     clamped_to_context={flag[2:]: {"default": d, "used": v} for flag, (d, v) in self.clamped.items()})
        if len(outs) == 1:
            one_sequence(stats)
        return outs, stats


def one_sequence(stats: dict) -> dict:
    """A batch of one's stats as one sequence's: its prompt and generated token counts as numbers, no batch keys."""
    del stats["batch_size"], stats["decode_steps"]
    stats.update(prompt_tokens=stats["prompt_tokens"][0], generated_tokens=stats["generated_tokens"][0])
    return stats


def compile_settings(model, protocol: str, mode: str | None, prefill: bool | None, freeze: bool
                     ) -> tuple[str | None, bool]:
    """(torch.compile mode or AOT, whether the prefill step is compiled) for --compile-mode (None or "auto":
    default_compile_mode; AOT becomes None under tensor parallel, whose steps' collectives need torch.compile) and
    --compile-prefill (None: on CUDA only; never for a one-shot prefill, which does not run the block step)."""
    device = str(model.tok_embeddings.weight.device)
    if mode in (None, "auto"):
        quantized = "budgetkv_quantization" in getattr(model, "config", {})
        mode = default_compile_mode(device, model.tok_embeddings.weight.dtype, quantized, freeze)
        if mode == AOT and getattr(model, "tp_group", None) is not None:
            mode = None
    prefill = device != "cpu" if prefill is None else prefill
    return mode, prefill and protocol == "block"


def mode_name(mode: str | None, device: str) -> str:
    """What a compile mode of None means on this device (step_modes): the name a summary prints."""
    return mode or ("reduce-overhead" if device.startswith("cuda") else "default")


def cache_state(inductor_counters, aot_step=None) -> str:
    """What the caches did for the steps just compiled: every one found ("hit"), some compiled and saved ("miss"),
    some not cacheable ("bypass"), or no lookup at all ("off": inductor's cache disabled). inductor_counters: its
    FX graph cache's (None: no torch.compile'd step); aot_step: an aoti.AotStep just bound."""
    counts = inductor_counters or {}
    if counts.get("fxgraph_cache_bypass"):
        return "bypass"
    if counts.get("fxgraph_cache_miss") or (aot_step is not None and aot_step.compiled):
        return "miss"
    return "hit" if counts.get("fxgraph_cache_hit") or aot_step is not None else "off"


DTYPES = ("auto", "float32", "bfloat16", "float16")  # --dtype's choices; auto: bfloat16 on CUDA, float32 on CPU
PREFILLS = ("block", "one-shot")


def compute_dtype(dtype: str, device: str) -> torch.dtype:
    """--dtype: auto is bfloat16 on CUDA, float32 on CPU."""
    auto = torch.bfloat16 if device.startswith("cuda") else torch.float32
    return auto if dtype == "auto" else getattr(torch, dtype)


def check_run_settings(device: str, dtype: str = "auto", kv_dtype: str = "auto", prefill: str | None = None) -> None:
    """--device, --dtype, --kv-dtype and --prefill, as generate.py and generate_text both take them: one UserError
    naming the flag. --kv-dtype bfloat16 only halves a float32 run's cache."""
    for flag, value, allowed in (("--dtype", dtype, DTYPES), ("--kv-dtype", kv_dtype, ("auto", *KV_DTYPES)),
                                 ("--prefill", prefill, (None, *PREFILLS))):
        if not isinstance(value, str | None) or value not in allowed:
            raise UserError(f"unsupported {flag} {value!r} ({', '.join(a for a in allowed if a)})")
    if not isinstance(device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise UserError(f"unsupported --device {device!r} (cpu, cuda or cuda:N)")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but CUDA is not available (use --device cpu)")
    if ":" in device and int(device.split(":")[1]) >= torch.cuda.device_count():
        raise UserError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if kv_dtype == "bfloat16" and compute_dtype(dtype, device) != torch.float32:
        raise UserError(f"--kv-dtype bfloat16 halves a float32 run's cache; this run computes in "
                        f"{str(compute_dtype(dtype, device)).removeprefix('torch.')}, whose own cache is as small: "
                        "drop --kv-dtype or add --dtype float32")


def generate_text(prompt: str | list[str], *, checkpoint: str = "smollm2-135m", policy="full",
                  budget: int | None = None, max_new_tokens: int | None = None, block_size: int | None = None,
                  prefill: str | None = None, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                  repetition_penalty: float = 1.0, repeat_last_n: int = 64, stop: list[str] = (),
                  document: str | None = None, seed: int = 0, kv_dtype: str = "auto", dtype: str = "auto",
                  device: str | None = None, chat_template: bool = True, compile: bool = False) -> dict:
    """The Python API in one call, with generate.py's defaults: load `checkpoint` (its forms: a short name, an HF
    or budgetkv directory, a .gguf file), set the caches up for `policy` (a spec string, e.g. "snapkv:window=32",
    or a policy object) at `budget`, compile when asked, and generate. One prompt returns {"text", "token_ids",
    **stats}; a list of prompts, one batch, {"texts", "token_ids" (one list per prompt), **stats}. document: put
    before the prompt (the question goes last, as the one-shot policies assume); stop: strings that end a sequence,
    cut from its text."""
    import policies
    from checkpoint import resolve_checkpoint
    from tokenizer import load_tokenizer
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    check_run_settings(device, dtype, kv_dtype, prefill)
    compute = compute_dtype(dtype, device)
    texts = [prompt] if isinstance(prompt, str) else list(prompt)
    stop = [stop] if isinstance(stop, str) else list(stop)
    if not texts or not all(isinstance(t, str) and t.strip() for t in texts) or not all(stop) or not (
            document is None or isinstance(document, str)):
        raise UserError("generate_text takes a non-empty prompt text (or a list of them), a document text and "
                        "non-empty stop strings")
    policy = policies.make(policy) if isinstance(policy, str) else policy
    ckpt = resolve_checkpoint(checkpoint)
    tokenizer = load_tokenizer(ckpt)
    model = load_model(ckpt, compute, device)
    ids = [tokenizer.prompt_ids(t, document, chat_template) for t in texts]
    gen = Generation(model.args, policy, [len(i) for i in ids], budget=budget, max_new_tokens=max_new_tokens,
                     block_size=block_size, prefill=prefill, kv_dtype=KV_DTYPES.get(kv_dtype),
                     temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                     repeat_last_n=repeat_last_n, device=device)
    torch.manual_seed(seed)
    gen.setup(model)
    if compile:
        gen.compile(model, ids[0][0])
    stops = StopStrings(list(stop))
    outs, stats = gen.generate(model, ids, eos_ids=set(tokenizer.eos_ids),
                               finished=(lambda b, out: stops.cut(tokenizer.decode(out)) is not None) if stop else None)
    decoded = [tokenizer.decode(out) for out in outs]
    decoded = [text[:stops.cut(text)] if stops.cut(text) is not None else text for text in decoded]
    if isinstance(prompt, str):
        return {"text": decoded[0], "token_ids": outs[0], **stats}
    return {"texts": decoded, "token_ids": outs, **stats}
