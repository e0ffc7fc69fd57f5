"""Building a model: from a checkpoint directory's config.json and weights (load_model), or with seeded random
weights of a config's shapes (random_model), each refused before anything is allocated when it would not fit the
device's free memory (check_fits)."""
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from cache import Storage
from config import parse_config, weight_count
from convert import ENGINE_FILE, CheckpointError, check_loaded, read_config, read_hf_dir
from errors import UserError
import quantize
from model import ModelArgs, RMSNorm, Transformer, on_meta, rope_inv_freq
from runtime import check_device, compute_dtype


def load_model(ckpt_dir: Path | str, dtype: torch.dtype | str, device: str, config: dict | None = None, shard=None,
               read=None) -> Transformer:
    """Build the model from config.json and load weights without a second copy (meta init + assign). dtype: a torch
    dtype or its name ("float32", "bfloat16", "float16", "auto": bfloat16 on CUDA, float32 on CPU).

    `config`: the checkpoint's config.json when the caller has read it already (read here otherwise); the model
    carries it as `model.config`, so that nobody reads it twice. A checkpoint written by scripts/quantize.py (a
    "budgetkv_quantization" entry in config.json) gets its Linears swapped for quantized ones before loading, and
    repacked for the device's kernel after. shard(model): applied once the weights are in, before that repacking
    (tp.apply_tp: each rank keeps its slice of every Linear); with read(handle), which reads an engine file's
    tensors already sliced through its safe_open handle (tp.read_slices), shard is applied to the empty model before
    the loading instead. An engine file is read only with the identity its resolve verified (convert.check_loaded)."""
    dtype = compute_dtype(dtype, check_device(device)) if isinstance(dtype, str) else dtype
    ckpt_dir = Path(ckpt_dir)
    if config is None:
        config = read_config(ckpt_dir)
    args = parse_config(config)
    quant = config.get("budgetkv_quantization")
    tensors = read_tensors(ckpt_dir, read)
    n_layers = 1 + max((int(k.split(".")[1]) for k in tensors if k.startswith("layers.")), default=-1)
    if n_layers != args.n_layers:  # before the model is built: a config with a million layers would take minutes
        raise CheckpointError(f"weights in {ckpt_dir} have {n_layers} layers, its config.json's num_hidden_layers "
                              f"says {args.n_layers}")
    # Float tensors take the run's dtype (quantization scales included); packed integer weights keep theirs.
    tensors = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in tensors.items()}
    with on_meta():
        model = Transformer(args)
        if quant is not None:
            quantize.swap_linears(model, quant)
    sliced = read is not None and (ckpt_dir / ENGINE_FILE).is_file()
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


def read_tensors(ckpt_dir: Path, read=None) -> dict:
    """A checkpoint's tensors on the host: its engine file's (through read(handle) when given: a rank's slices),
    read only with the identity its resolve verified (convert.check_loaded), else the Hugging Face folder's."""
    engine_file = ckpt_dir / ENGINE_FILE
    if not engine_file.is_file():
        check_loaded(engine_file, None)
        return read_hf_dir(ckpt_dir)
    try:
        with safe_open(str(engine_file), "pt", device="cpu") as f:  # the identity and tensors of one file
            check_loaded(engine_file, f.metadata())
            return {k: f.get_tensor(k) for k in f.keys()} if read is None else read(f)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read {engine_file} (truncated or corrupt?): {e}") from None


def meta_model(config: dict) -> Transformer:
    """The model of a config.json on the meta device: its shapes and parameter count, no weight allocated. It builds
    every layer's modules: check a config's weight_count against the memory free before."""
    args = parse_config(config)  # off the meta device: it checks RoPE's frequencies by value
    with on_meta():
        return Transformer(args)


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


