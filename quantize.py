"""Weight-only quantization, in the spirit of gpt-fast's quantize.py: int8 per output channel (symmetric) and int4 per
group of in-features (asymmetric, packed two to a byte). Activations, the KV cache, embeddings and norms stay float.

    python scripts/quantize.py --checkpoint smollm2-135m --mode int8
    python scripts/quantize.py --checkpoint smollm2-135m --mode int4        # group 32, the default
    python generate.py --checkpoint checkpoints/smollm2-135m-int8 --prompt "Hello"

What is quantized: every Linear of the transformer (attention.wqkv, attention.wo, feed_forward.w13, feed_forward.w2)
and the output head. Biases, embeddings and norms stay float. A tied head (SmolLM2, Qwen2.5 <= 3B, Llama 3.2) gets
its own quantized copy of the embedding matrix: decode reads the whole head every step but only one embedding row,
so the head is where the bytes are (21% of SmolLM2's weights). `--head auto` (default) quantizes it with int8 and
keeps it float (and tied) with int4, whose 4-bit head costs far more perplexity than its body (docs/quantization.md,
scripts/bench_quant.py). `--head quantize|float` overrides.

The checkpoint is a new directory (default `<checkpoint>-int8`, `<checkpoint>-int4-g32`): config.json with a
"budgetkv_quantization" entry ({"mode", "groupsize", "head", "source"}), budgetkv.safetensors and the tokenizer
files. The engine file is written last and records the identity of the checkpoint it was quantized from (as a
conversion does, convert.py): a later run quantizes again when that checkpoint changed (docs/checkpoints.md).
Per quantized Linear `<name>` of shape [N out, K in] the file holds:
    int8: <name>.weight int8 [N, K], <name>.scales fp32 [N]                  w = weight * scales[:, None]
    int4: <name>.weight uint8 [N, K/2], <name>.scales_and_zeros fp32 [K/g, N, 2]
          (column 2j in the high nibble, 2j+1 in the low one)               w = (q - 8) * scale + zero
The int4 file layout is plain nibbles, the same on every device (it is what CUDA's _convert_weight_to_int4pack
takes); `prepare` repacks it at load time for the device's kernel, because torch's packed layouts are device
specific (CPU's _convert_weight_to_int4pack_for_cpu output is neither nibble order of the plain layout: measured).

Kernels, chosen once per Linear at load time (so the forward has no data-dependent branch and compiles fullgraph):
    int8, CPU: aten._weight_int8pack_mm; in a compiled step of 1-8 rows (decode, a verification block) instead
          kernels.rowwise_linear over the weight widened in the loop, in the run's dtype.
    int8, CUDA: F.linear(x, weight.to(x.dtype)) * scales, gpt-fast's formulation: inductor fuses the cast into the
          matmul, so this is the intended path there, not a fallback.
    int4, CPU: aten._weight_int4pack_mm_for_cpu's kernel, quantized.int4mm_packed_weight_cpu (out-features a
          multiple of 16).
    int4, CUDA: aten._weight_int4pack_mm (tinygemm, sm80+; out-features a multiple of 8).
    The fused kernels compute in bfloat16 whatever the run's dtype (see FUSED_DTYPE for why).
    Anything else (another device, a shape the kernel rejects, a kernel this torch build or GPU lacks): dequantize
    then matmul in the run's dtype, same result, slower; `prepare` says so in one line per load. Each fused kernel is
    first tried on a small weight against dequantize + matmul, so a missing kernel (or a layout mismatch) falls back
    instead of failing.
torchao is not used: torch's own ops cover both modes on CPU and CUDA, and the engine keeps no extra dependency.
"""
import functools
import json
import shutil
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from config import parse_config
from convert import (ENGINE_FILE, TOKENIZER_FILES, CheckpointError, check_float, check_loaded, checkpoint_files,
                     file_sha256, identity, load_stats, read_config, read_hf_dir, save_engine, save_stats)
from errors import UserError
from files import remove_stale_tmp, write_atomic, write_text
from kernels import rowwise_linear, rowwise_rows
from model import ModelArgs, on_meta
from progress import Progress

MODES = ("int8", "int4")
GROUP_SIZES = (32, 64, 128)
# Divides the in-features of every model in checkpoint.MODELS, and is the block of a Q4_1 / Q4_0 GGUF (the embedded
# SmolLM2's): 64 would re-quantize two of its blocks per group (+41.8% perplexity, docs/quantization.md).
DEFAULT_GROUPSIZE = 32
MARKER = "budgetkv_quantization"  # the config.json entry that makes loading.load_model swap the Linears
LINEARS = ("wqkv", "wo", "w13", "w2", "output")  # the last component of every Linear's name in model.py


# ------------------------------------------------------------------------------------------- quantize / dequantize

def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric, one scale per output channel: scale = max|w_row| / 127, q = round(w / scale), |q| <= 127."""
    w = w.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127  # an all-zero row gets q = 0, not 0/0
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4(w: Tensor, groupsize: int) -> tuple[Tensor, Tensor]:
    """Asymmetric min/max per group of `groupsize` in-features (tinygemm's convention, w = (q - 8) * scale + zero,
    q in 0..15). Returns the plain nibbles [N, K/2] uint8 and scales_and_zeros [K/g, N, 2] fp32."""
    N, K = w.shape
    groups = w.float().reshape(N, K // groupsize, groupsize)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scales = ((hi - lo) / 15).clamp(min=1e-6)  # a constant group: q = 0 and zero = lo + 8 * scale gives lo back
    zeros = lo + 8 * scales
    q = torch.round((groups - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8).reshape(N, K)
    nibbles = (q[:, 0::2] << 4) | q[:, 1::2]
    return nibbles, torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()


def unpack_nibbles(nibbles: Tensor) -> Tensor:
    """[N, K/2] uint8 -> q [N, K] uint8 in 0..15 (the high nibble is the even column)."""
    return torch.stack([nibbles >> 4, nibbles & 15], dim=-1).reshape(nibbles.shape[0], -1)


def dequantize_int4(nibbles: Tensor, scales_and_zeros: Tensor, groupsize: int) -> Tensor:
    q = unpack_nibbles(nibbles)
    N, K = q.shape
    scales, zeros = (scales_and_zeros[..., i].t()[..., None] for i in (0, 1))  # [N, K/g, 1]
    groups = q.reshape(N, K // groupsize, groupsize).to(scales_and_zeros.dtype)
    return ((groups - 8) * scales + zeros).reshape(N, K)


def quantize_weight(w: Tensor, mode: str, groupsize: int | None) -> dict[str, Tensor]:
    """One Linear's weight -> its tensors in the checkpoint, named by suffix."""
    if mode == "int8":
        q, scales = quantize_int8(w)
        return {"weight": q, "scales": scales}
    nibbles, scales_and_zeros = quantize_int4(w, groupsize)
    return {"weight": nibbles, "scales_and_zeros": scales_and_zeros}


def check_mode(mode: str, groupsize: int | None, in_features: dict[str, int]) -> int | None:
    """The group size to use (None for int8); bad combinations raise UserError with one line."""
    if mode not in MODES:
        raise UserError(f"unsupported quantization mode {mode!r} ({' or '.join(MODES)})")
    if mode == "int8":
        if groupsize is not None:
            raise UserError("--groupsize applies to --mode int4 only (int8 has one scale per output channel)")
        return None
    groupsize = DEFAULT_GROUPSIZE if groupsize is None else groupsize
    if groupsize not in GROUP_SIZES:
        raise UserError(f"unsupported --groupsize {groupsize} (int4 takes {', '.join(map(str, GROUP_SIZES))})")
    bad = {name: k for name, k in in_features.items() if k % groupsize}
    if bad:
        ok = [g for g in GROUP_SIZES if all(k % g == 0 for k in in_features.values())]
        name, k = next(iter(bad.items()))
        hint = f"use --groupsize {' or '.join(map(str, ok))}" if ok else "use --mode int8"
        raise UserError(f"--groupsize {groupsize} does not divide the in-features of {name} ({k}); {hint}")
    return groupsize


def in_features(args: ModelArgs) -> dict[str, int]:
    """In-features of each kind of Linear in model.py (what an int4 group size must divide)."""
    return {"wqkv": args.dim, "wo": args.n_heads * args.head_dim, "w13": args.dim, "w2": args.intermediate_size,
            "output": args.dim}


# ------------------------------------------------------------------------------------------------------ modules

class Int8Linear(nn.Module):
    """y = x @ (weight * scales[:, None]).T + bias; weight int8 [N, K], scales [N]."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.int8), requires_grad=False)
        self.scales = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.kernel = "linear"  # prepare picks "int8pack" (CPU) or keeps "linear"

    def forward(self, x: Tensor) -> Tensor:
        if self.kernel == "int8pack" and rowwise_rows(x.numel() // x.shape[-1]):
            # a compiled step's few rows: the int8 weight widened inside kernels.rowwise_linear's loop, in x's dtype
            # (faster than the fused kernel here: docs/performance.md)
            y = rowwise_linear(x, self.weight.to(x.dtype)) * self.scales.to(x.dtype)
            return y if self.bias is None else y + self.bias
        if self.kernel == "int8pack":
            return fused_matmul(torch.ops.aten._weight_int8pack_mm, x, self.bias, self.weight, self.scales)
        y = F.linear(x, self.weight.to(x.dtype)) * self.scales
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    """y = x @ dequantize_int4(weight, scales_and_zeros).T + bias.

    `weight` holds the file's plain nibbles [N, K/2] until `prepare` repacks it into the layout of the device's
    kernel (`layout` says which one it is in); scales_and_zeros is [K/g, N, 2]."""

    def __init__(self, in_features: int, out_features: int, bias: bool, groupsize: int, dtype=None):
        super().__init__()
        self.in_features, self.out_features, self.groupsize = in_features, out_features, groupsize
        self.weight = nn.Parameter(torch.empty(out_features, in_features // 2, dtype=torch.uint8),
                                   requires_grad=False)
        self.scales_and_zeros = nn.Parameter(torch.empty(in_features // groupsize, out_features, 2, dtype=dtype),
                                             requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.kernel = "dequant"  # prepare picks "int4pack_cpu", "int4pack_cuda" or keeps "dequant"
        self.layout = "nibbles"  # the weight's layout: the file's plain nibbles or the kernel it was packed for

    def forward(self, x: Tensor) -> Tensor:
        if self.kernel == "int4pack_cpu":
            # aten._weight_int4pack_mm_for_cpu's kernel, called as inductor's lowering calls it: the group size a
            # tensor of the module's, since the constant that lowering makes of it reaches the kernel wrong inside
            # a compiled layer region (model.block_region)
            return fused_matmul(torch.ops.quantized.int4mm_packed_weight_cpu, x, self.bias, self.weight,
                                self.group_size, self.scales_and_zeros)
        if self.kernel == "int4pack_cuda":
            return fused_matmul(torch.ops.aten._weight_int4pack_mm, x, self.bias, self.weight, self.groupsize,
                                self.scales_and_zeros)
        y = F.linear(x, dequantize_int4(self.weight, self.scales_and_zeros, self.groupsize).to(x.dtype))
        return y if self.bias is None else y + self.bias


def fused_matmul(op, x: Tensor, bias: Tensor | None, *args) -> Tensor:
    """Run a fused kernel the way it wants its input: 2-D, contiguous, bfloat16 (see FUSED_DTYPE); the result
    returns in x's shape and dtype."""
    y = op(x.reshape(-1, x.shape[-1]).to(FUSED_DTYPE).contiguous(), *args)
    y = y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)
    return y if bias is None else y + bias


def empty_module(linear: nn.Linear, mode: str, groupsize: int | None, dtype) -> nn.Module:
    """A quantized module shaped like `linear`, with uninitialised tensors (on the current default device)."""
    k, n, bias = linear.in_features, linear.out_features, linear.bias is not None
    if mode == "int8":
        return Int8Linear(k, n, bias, dtype)
    return Int4Linear(k, n, bias, groupsize, dtype)


def linears(model: nn.Module, head: bool):
    """(parent module, attribute, full name, Linear) for every Linear to quantize."""
    for name, module in list(model.named_modules()):
        for attr, child in list(module.named_children()):
            full = f"{name}.{attr}" if name else attr
            if isinstance(child, nn.Linear) and attr in LINEARS and (head or full != "output"):
                yield module, attr, full, child


# ---------------------------------------------------------------------------------------- kernels (load time)

# The fused kernels run in bfloat16 whatever the model's dtype: torch's CPU kernels are vectorised for bfloat16 only
# (in float32 they are slower than the float32 matmul they replace), and tinygemm takes bfloat16 only; gpt-fast casts
# to bfloat16 for int4 too. Rounding the activations to bfloat16 (2^-9 relative) adds less
# error than rounding the weights to int8 (up to scale / 2 = max|w_row| / 254 per weight).
FUSED_DTYPE = torch.bfloat16
FUSED = {"int8": {"cpu": "int8pack"}, "int4": {"cpu": "int4pack_cpu", "cuda": "int4pack_cuda"}}
OP_NAMES = {"int8pack": "_weight_int8pack_mm", "int4pack_cpu": "int4mm_packed_weight_cpu",
            "int4pack_cuda": "_weight_int4pack_mm"}
N_TILE = {"int4pack_cpu": 16, "int4pack_cuda": 8}  # the out-features multiple each int4 packing needs


def inner_k_tiles(k: int) -> int:
    """tinygemm packs 2, 4 or 8 k-tiles of 16 per int32 group; take the widest that divides the in-features."""
    return next((t for t in (8, 4, 2) if k % (16 * t) == 0), 2)


def pack_for_kernel(mod: nn.Module, kernel: str) -> None:
    """Set the module's kernel; for a fused one cast its scales to bfloat16 and, for int4, repack its plain nibbles
    into that kernel's layout (once: a packed module cannot be repacked, nor dequantized)."""
    if isinstance(mod, Int4Linear) and mod.layout not in ("nibbles", kernel):
        raise CheckpointError(f"an int4 Linear packed for {mod.layout} cannot run {kernel}: "
                              "load or quantize the model on the device it runs on")
    mod.kernel = kernel
    if kernel not in OP_NAMES:
        return
    scales = "scales" if isinstance(mod, Int8Linear) else "scales_and_zeros"
    setattr(mod, scales, nn.Parameter(aligned(getattr(mod, scales).data.to(FUSED_DTYPE)), requires_grad=False))
    if isinstance(mod, Int8Linear):
        mod.weight = nn.Parameter(aligned(mod.weight.data), requires_grad=False)
        return
    if kernel == "int4pack_cpu":
        mod.register_buffer("group_size", torch.tensor(mod.groupsize, device=mod.weight.device), persistent=False)
    if mod.layout == kernel:
        return
    nibbles = mod.weight.data
    if kernel == "int4pack_cpu":
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_nibbles(nibbles).to(torch.int32), 1)
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack(nibbles.contiguous(), inner_k_tiles(mod.in_features))
    mod.weight = nn.Parameter(packed, requires_grad=False)
    mod.layout = kernel


def aligned(t: Tensor) -> Tensor:
    """t, copied if its data does not start on a 64-byte boundary. safetensors' load_file hands out views at file
    offsets, and _weight_int8pack_mm reads out of bounds on a misaligned weight once M > 1 (measured: a segfault
    at offset 40, fine at 0)."""
    return t if t.data_ptr() % 64 == 0 else t.clone(memory_format=torch.contiguous_format)


@functools.lru_cache(maxsize=None)
def fused_kernel_runs(mode: str, device: str, groupsize: int | None) -> bool:
    """Whether torch's fused kernel for `mode` runs on `device` and agrees with dequantize + matmul, tried once on a
    small random weight. A build or GPU without the kernel raises (-> False); a wrong packed layout would disagree."""
    kernel = FUSED[mode].get(device)
    if kernel is None:
        return False
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(256, 32, bias=False)  # 256 in-features: every group size and inner-k-tile count divides it
    with torch.no_grad():
        linear.weight.copy_(torch.randn(32, 256, generator=gen))
    x = torch.randn(3, 256, generator=gen).to(device, FUSED_DTYPE)
    fused, plain = (quantized_from_linear(linear, mode, groupsize).to(device, FUSED_DTYPE) for _ in range(2))
    try:
        pack_for_kernel(fused, kernel)
        with torch.no_grad():
            got, want = fused(x).float(), plain(x).float()
    except (RuntimeError, NotImplementedError, AttributeError):  # AttributeError: a build without the op
        return False
    return bool(got.shape == want.shape and (got - want).abs().max() <= 0.02 * want.abs().max())


def pick_kernel(mod: nn.Module) -> tuple[str, str | None]:
    """(kernel, why it is not a fused one, or None) for one quantized module on its device."""
    mode, device = "int8" if isinstance(mod, Int8Linear) else "int4", mod.weight.device.type
    plain = "linear" if mode == "int8" else "dequant"
    if mode == "int8" and device == "cuda":
        return plain, None  # gpt-fast's formulation: inductor fuses the int8 -> float cast into the matmul
    kernel = FUSED[mode].get(device)
    if kernel is None or not fused_kernel_runs(mode, device, getattr(mod, "groupsize", None)):
        return plain, f"no working {mode} kernel ({OP_NAMES.get(kernel, 'none known')}) on {device}"
    if mod.out_features % N_TILE.get(kernel, 1):
        return plain, f"out-features not a multiple of {N_TILE[kernel]} ({OP_NAMES[kernel]})"
    return kernel, None


def prepare(model: nn.Module) -> dict[str, int]:
    """Pick each quantized Linear's kernel for its device and repack int4 weights for it. Falling back to dequantize
    + matmul is reported in one stderr line. Returns {kernel: number of Linears}."""
    counts, reasons = {}, {}
    for mod in model.modules():
        if isinstance(mod, (Int8Linear, Int4Linear)):
            kernel, why = pick_kernel(mod)
            pack_for_kernel(mod, kernel)
            counts[kernel] = counts.get(kernel, 0) + 1
            if why:
                reasons[why] = reasons.get(why, 0) + 1
    if reasons:
        detail = "; ".join(f"{n}: {why}" for why, n in reasons.items())
        print(f"quantize: {sum(reasons.values())} of {sum(counts.values())} quantized Linears fall back to "
              f"dequantize + matmul (same result, slower) -- {detail}", file=sys.stderr)
    return counts


def quantized_from_linear(linear: nn.Linear, mode: str, groupsize: int | None) -> nn.Module:
    """A quantized copy of one float Linear (fp32 scales on the Linear's device; not yet prepared)."""
    with on_meta():
        mod = empty_module(linear, mode, groupsize, torch.float32)
    for suffix, t in quantize_weight(linear.weight.detach(), mode, groupsize).items():
        setattr(mod, suffix, nn.Parameter(t, requires_grad=False))
    mod.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)
    return mod.to(linear.weight.device)


# -------------------------------------------------------------------------------------------------- entry points

def quantize_model(model: nn.Module, mode: str, groupsize: int | None = None, head: bool | None = None) -> nn.Module:
    """Quantize a loaded float model in place (no checkpoint written) and prepare it for its device; the benchmark
    can compare modes on one loaded model this way. The dtype of the scales follows the model's."""
    head = head_quantized(mode) if head is None else head
    targets = list(linears(model, head))
    groupsize = check_mode(mode, groupsize, {full: lin.in_features for _, _, full, lin in targets})
    with Progress(len(targets), f"quantizing to {mode_name(mode, groupsize)}", "Linears") as bar:
        for done, (parent, attr, _, lin) in enumerate(targets, 1):
            setattr(parent, attr, quantized_from_linear(lin, mode, groupsize).to(lin.weight.dtype))
            bar.update(done)
    prepare(model)
    return model


def swap_linears(model: nn.Module, quant: dict) -> None:
    """Replace the Linears of a freshly built (meta) model by empty quantized modules matching a checkpoint's
    quantization entry, so that load_state_dict(assign=True) takes the packed tensors as they are."""
    if not isinstance(quant, dict):
        raise CheckpointError(f"unsupported {MARKER} entry in config.json: {quant!r} (expected an object)")
    mode, groupsize = quant.get("mode"), quant.get("groupsize")
    if mode not in MODES or (mode == "int4" and groupsize not in GROUP_SIZES):
        raise CheckpointError(f"unsupported {MARKER} entry in config.json: {quant} (known: int8, int4 with group "
                              f"size {', '.join(map(str, GROUP_SIZES))})")
    for parent, attr, _, lin in list(linears(model, bool(quant.get("head", True)))):
        setattr(parent, attr, empty_module(lin, mode, groupsize, lin.weight.dtype))


def summary(model: nn.Module) -> dict:
    """What a benchmark row needs: the mode, group size and kernels in use, and the bytes of all weights."""
    mods = [m for m in model.modules() if isinstance(m, (Int8Linear, Int4Linear))]
    kernels = {}
    for m in mods:
        kernels[m.kernel] = kernels.get(m.kernel, 0) + 1
    seen, weight_bytes = set(), 0
    for t in model.parameters():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            weight_bytes += t.nbytes
    mode = None if not mods else "int8" if isinstance(mods[0], Int8Linear) else "int4"
    groupsize = mods[0].groupsize if mode == "int4" else None
    return {"mode": mode, "groupsize": groupsize, "kernels": kernels, "weight_bytes": weight_bytes}


# --------------------------------------------------------------------------------------------- quantize a checkpoint

def open_tensors(ckpt: Path):
    """(get(name), names) over the float checkpoint, reading the engine file lazily one tensor at a time, only with
    the identity its resolve verified (convert.check_loaded)."""
    engine = ckpt / ENGINE_FILE
    if not engine.is_file():
        check_loaded(engine, None)
        tensors = read_hf_dir(ckpt)
        return tensors.__getitem__, list(tensors)
    from safetensors import SafetensorError, safe_open
    try:
        handle = safe_open(str(engine), "pt", device="cpu")
        check_loaded(engine, handle.metadata())
        names = list(handle.keys())
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read {engine} (truncated or corrupt?): {e}") from None

    def get(name):
        try:
            t = handle.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read tensor {name} in {engine} (truncated or corrupt?): {e}") from None
        check_float(t, name, engine)
        return t
    return get, names


def quantize_checkpoint(ckpt: Path, args: ModelArgs, mode: str, groupsize: int | None,
                        head: bool) -> dict[str, Tensor]:
    """The quantized checkpoint's tensors: Linear weights quantized, everything else as stored."""
    get, names = open_tensors(ckpt)
    out = {}
    tied_head = head and "output.weight" not in names  # a tied head: its own quantized copy of the embedding
    total = len(names) + tied_head
    with Progress(total, f"quantizing {ckpt.name} to {mode_name(mode, groupsize)}", "tensors") as bar:
        for done, name in enumerate(names, 1):
            module, _, kind = name.rpartition(".")
            if kind == "weight" and module.rpartition(".")[2] in LINEARS and (head or module != "output"):
                out.update({f"{module}.{k}": v for k, v in quantize_weight(get(name), mode, groupsize).items()})
            else:
                out[name] = get(name)
            bar.update(done)
        if tied_head:
            out.update({f"output.{k}": v for k, v in quantize_weight(get("tok_embeddings.weight"), mode,
                                                                      groupsize).items()})
            bar.update(total)
    return out


def mode_name(mode: str, groupsize: int | None) -> str:
    return f"{mode} (group {groupsize})" if groupsize else mode


def head_quantized(mode: str, head: str = "auto") -> bool:
    """Whether the output head is quantized: `auto` = with int8 only (see the module docstring)."""
    return head == "quantize" or head == "auto" and mode == "int8"


def default_out(ckpt: Path, mode: str, groupsize: int | None) -> Path:
    suffix = mode if mode == "int8" else f"{mode}-g{groupsize}"
    return ckpt.parent / f"{ckpt.name}-{suffix}"


def quantize_dir(ckpt: Path, mode: str, groupsize: int | None = None, head: str = "auto",
                 out: Path | None = None) -> dict:
    """Write the quantized copy of the float checkpoint directory `ckpt` (to `out`, default `default_out`); returns
    {"out", "mode", "groupsize", "head", "weight_bytes"}. Bad input raises UserError (one line)."""
    config = read_config(ckpt)
    if MARKER in config:
        q = config[MARKER]
        raise UserError(f"{ckpt} is already quantized ({q.get('mode')}); quantize the float checkpoint it was "
                        f"made from ({q.get('source', 'its source')})")
    args = parse_config(config)
    groupsize = check_mode(mode, groupsize, in_features(args))
    out_dir = out or default_out(ckpt, mode, groupsize)
    if out_dir.resolve() == ckpt.resolve():
        raise UserError(f"--out {out_dir} is the source checkpoint itself; pick another directory")
    quantized_head = head_quantized(mode, head)
    stats = load_stats(out_dir)
    sources = {f.name: file_sha256(f, stats) for f in checkpoint_files(ckpt)}  # before reading: a change shows
    tensors = quantize_checkpoint(ckpt, args, mode, groupsize, head=quantized_head)

    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create --out {out_dir}: {e.strerror or e}") from None
    remove_stale_tmp(out_dir)
    # The tokenizer files and config.json first, each atomically; the engine file last, recording them and the
    # source's identity: a run killed before it leaves files that no longer match the engine file there.
    for name in TOKENIZER_FILES:
        if (ckpt / name).is_file():
            write_atomic(out_dir / name, lambda tmp: shutil.copyfile(ckpt / name, tmp))
        elif (out_dir / name).is_file():  # left by an earlier quantization of another checkpoint
            (out_dir / name).unlink()
    config[MARKER] = {"mode": mode, "groupsize": groupsize, "head": quantized_head, "source": str(ckpt)}
    write_text(out_dir / "config.json", json.dumps(config, indent=2))
    written = ["config.json"] + [n for n in TOKENIZER_FILES if (ckpt / n).is_file()]
    companions = {n: file_sha256(out_dir / n, stats) for n in written}
    quantization = {"mode": mode, "groupsize": groupsize, "head": quantized_head}
    save_engine(tensors, out_dir / ENGINE_FILE, identity("quantized", ckpt, sources, companions,
                                                         quantization=quantization))
    save_stats(stats)
    return {"out": out_dir, "mode": mode, "groupsize": groupsize, "head": quantized_head,
            "weight_bytes": sum(t.nbytes for t in tensors.values())}
