"""Tensor parallel over torch.distributed, in the spirit of gpt-fast's tp.py: N ranks (one per GPU, or processes on
a CPU with gloo) each hold 1/N of every layer's heads and MLP columns, and their KV cache holds only their own KV
heads: each rank evicts its own heads, with no communication.

    torchrun --nproc-per-node 2 generate.py --policy keydiff --budget 2048 ...

Sharding (Megatron-style; docs/tensor_parallel.md):
- attention: the fused wqkv is column-parallel with its q, k and v parts sliced separately by head (rank r gets
  query heads [r hq/N, (r+1) hq/N) and KV heads [r hkv/N, (r+1) hkv/N), biases too); wo is row-parallel (its input
  columns of those query heads), its bias added on rank 0 only;
- MLP: the fused w13 is column-parallel with its gate and up halves sliced separately; w2 is row-parallel;
- one all-reduce (sum) after wo and one after w2: model.py's `tp_group` hook on Attention / FeedForward, a
  functional collective, so it stays inside a compiled graph;
- embeddings, norms and the output head are replicated (every rank computes the same logits: no gather, and the
  same token is sampled everywhere from the same seed).
Quantized Linears (quantize.py, int8 and int4) shard the same way with their scales, before they are packed for
the device's kernel. N must divide the query heads, the KV heads and the MLP width: N > KV heads (KV-head
replication) is refused. The few policy rules that read every KV head of a layer gather them (policies.all_heads).
Joining the group, which rank prints, a lost rank: ranks.py.
"""
import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn

import loading
from cache import kv_bytes
from config import parse_config, weight_count
from convert import ENGINE_FILE, read_config
from errors import UserError
from quantize import Int4Linear, Int8Linear
from ranks import Mesh

# ---------------------------------------------------------------------------------------------------- checks

def check_shapes(args, world: int) -> None:
    """N must divide the query heads, the KV heads (no KV-head replication) and the MLP width."""
    if world == 1:
        return
    for what, n in (("KV heads", args.n_kv_heads), ("query heads", args.n_heads),
                    ("MLP width (intermediate_size)", args.intermediate_size)):
        if n % world:
            raise UserError(f"tensor parallel over {world} ranks needs {world} to divide the model's {what} ({n}); "
                            f"use a world size that divides {n}" + (" (KV-head replication for more ranks than KV "
                                                                     "heads is not implemented)"
                                                                     if what == "KV heads" else ""))


# -------------------------------------------------------------------------------------------------- sharding

def shard_rows(t: torch.Tensor, parts: list[int], rank: int, world: int) -> torch.Tensor:
    """Dim 0 of t cut into consecutive parts of the given sizes (wqkv's q, k, v; w13's gate, up); rank's 1/world
    of each part, concatenated (a copy: the full tensor can be freed)."""
    out, start = [], 0
    for n in parts:
        k = n // world
        out.append(t[start + rank * k:start + (rank + 1) * k])
        start += n
    return torch.cat(out).contiguous()


def shard_cols(t: torch.Tensor, rank: int, world: int, dim: int = 1) -> torch.Tensor:
    """rank's 1/world of t along `dim` (a copy)."""
    k = t.shape[dim] // world
    return t.narrow(dim, rank * k, k).contiguous()


def param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def shard_column(mod: nn.Module, parts: list[int], rank: int, world: int) -> None:
    """Column-parallel: keep rank's output features of each part (a float Linear, or a quantized one with its scales:
    int8 scales [N]; int4 scales_and_zeros [K/g, N, 2], whose N is dim 1)."""
    if isinstance(mod, Int4Linear) and mod.layout != "nibbles":
        raise UserError("an int4 Linear already packed for its kernel cannot be sharded: shard before "
                        "quantize.prepare (tp.load_model does)")
    mod.weight = param(shard_rows(mod.weight.data, parts, rank, world))
    if mod.bias is not None:
        mod.bias = param(shard_rows(mod.bias.data, parts, rank, world))
    if isinstance(mod, Int8Linear):
        mod.scales = param(shard_rows(mod.scales.data, parts, rank, world))
    if isinstance(mod, Int4Linear):
        sz = mod.scales_and_zeros.data.transpose(0, 1)  # [N, K/g, 2]
        mod.scales_and_zeros = param(shard_rows(sz, parts, rank, world).transpose(0, 1).contiguous())
    if hasattr(mod, "out_features"):
        mod.out_features = sum(parts) // world


def shard_row(mod: nn.Module, rank: int, world: int) -> None:
    """Row-parallel: keep rank's input features (int8 scales are per output feature: kept whole; int4 nibbles hold
    two input features a byte and its scales one group of in-features a row). The bias is added once: rank 0 keeps
    it, the others get zeros (the all-reduce sums the partial outputs)."""
    if isinstance(mod, Int4Linear):
        if mod.layout != "nibbles":
            raise UserError("an int4 Linear already packed for its kernel cannot be sharded: shard before "
                            "quantize.prepare (tp.load_model does)")
        k = mod.in_features // world
        if k % mod.groupsize:
            raise UserError(f"int4 group size {mod.groupsize} does not divide a rank's {k} in-features of a "
                            f"row-parallel Linear: use a smaller --groupsize or fewer ranks")
        mod.scales_and_zeros = param(shard_cols(mod.scales_and_zeros.data, rank, world, dim=0))
    mod.weight = param(shard_cols(mod.weight.data, rank, world))
    if mod.bias is not None and rank != 0:
        mod.bias = param(torch.zeros_like(mod.bias.data))
    if hasattr(mod, "in_features"):
        mod.in_features //= world


def shard_module(name: str, mod: nn.Module, args, mesh: Mesh) -> None:
    """The sharding rule of one module, by its name in model.py: wqkv column-parallel by q, k, v parts, wo
    row-parallel, w13 column-parallel by gate and up halves, w2 row-parallel; anything else stays whole."""
    rank, world = mesh.rank, mesh.world
    hq, hkv, d, inter = args.n_heads, args.n_kv_heads, args.head_dim, args.intermediate_size
    if name.endswith("attention.wqkv"):
        shard_column(mod, [hq * d, hkv * d, hkv * d], rank, world)
    elif name.endswith("attention.wo"):
        shard_row(mod, rank, world)
    elif name.endswith("feed_forward.w13"):
        shard_column(mod, [inter, inter], rank, world)
    elif name.endswith("feed_forward.w2"):
        shard_row(mod, rank, world)


def apply_tp(model, mesh: Mesh):
    """Shard `model` in place for this rank (see the module docstring) and localize it. A world of 1 changes
    nothing. Call before quantize.prepare for an int4 model (tp.load_model does)."""
    if mesh.world == 1:
        return model
    check_shapes(model.args, mesh.world)
    for name, mod in list(model.named_modules()):
        shard_module(name, mod, model.args, mesh)
    return localize(model, mesh)


def localize(model, mesh: Mesh):
    """After its Linears are sharded: the per-rank head counts on each Attention, the all-reduce group on each
    Attention / FeedForward, a per-rank copy of ModelArgs (n_heads, n_kv_heads, intermediate_size divided by the
    world size; dim, head_dim unchanged), so that cache.setup_caches allocates only this rank's KV heads, and
    `kv_head0`, the model's index of its first KV head (RandomScores hashes the model's heads)."""
    world, args = mesh.world, model.args
    hq, hkv = args.n_heads // world, args.n_kv_heads // world
    for layer in model.layers:
        layer.attention.n_heads, layer.attention.n_kv_heads = hq, hkv
        layer.attention.tp_group = layer.feed_forward.tp_group = mesh.group.group_name  # a name: copyable
    model.full_args = args
    model.args = dataclasses.replace(args, n_heads=hq, n_kv_heads=hkv,
                                     intermediate_size=args.intermediate_size // world)
    model.kv_head0 = mesh.rank * hkv
    model.tp_group = mesh.group.group_name  # the caches' (policies that read every head gather over it)
    model.tp = mesh
    return model


def random_model(config: dict, dtype, device: str, seed: int, mesh: Mesh, *, label: str, kv_bytes: int = 0):
    """loading.random_model for this rank: the whole model's values (the same generator stream), each Linear
    sliced as soon as it is made, so that a rank holds its shard plus one whole tensor at a time (Llama-3.1-70B on
    8 GPUs never needs the whole model on one). kv_bytes: the whole model's KV cache (a rank holds 1/N)."""
    if mesh.world == 1:
        return loading.random_model(config, dtype, device, seed, label=label, kv_bytes=kv_bytes)
    args = parse_config(config)
    check_shapes(args, mesh.world)
    n = weight_bytes_per_rank(config, mesh.world, dtype) // dtype.itemsize
    model = loading.random_model(config, dtype, device, seed, label=label, kv_bytes=kv_bytes // mesh.world,
                                shard=lambda name, mod: shard_module(name, mod, args, mesh), n_params=n)
    return localize(model, mesh)


def load_model(ckpt_dir, dtype, device: str, mesh: Mesh, config: dict | None = None):
    """loading.load_model for this rank, then quantized Linears packed for its device's kernel. An engine file (a
    converted or quantized checkpoint) is read slice by slice: a rank reads only its slices of the sharded Linears
    (read_slices). A Hugging Face folder is read whole on the host, sharded there, and only the slices move to
    `device`."""
    if mesh.world == 1:
        return loading.load_model(ckpt_dir, dtype, device, config)
    if (ckpt_dir / ENGINE_FILE).is_file():
        config = config if config is not None else read_config(ckpt_dir)
        args = parse_config(config)
        return loading.load_model(ckpt_dir, dtype, device, config, shard=lambda m: apply_tp(m, mesh),
                                  read=lambda f: read_slices(f, args, mesh))

    def shard(model):
        apply_tp(model, mesh)
        model.to(device)
    return loading.load_model(ckpt_dir, dtype, "cpu", config, shard=shard)


def slice_rule(name: str, args):
    """How a checkpoint tensor is cut for a rank, the tensor-level form of shard_module: ("parts", dim, sizes) for
    wqkv / w13 (their q, k, v or gate, up parts along `dim`; int4 scales_and_zeros [K/g, N, 2] along dim 1),
    ("split", dim) for wo / w2 (their in-features: dim 1, int4 scales_and_zeros dim 0), ("rank0",) for wo's bias,
    None for a tensor every rank keeps whole (int8 scales of wo / w2 are per output row; everything outside them)."""
    module, _, suffix = name.rpartition(".")
    hq, hkv, d, inter = args.n_heads, args.n_kv_heads, args.head_dim, args.intermediate_size
    if not name.startswith("layers."):
        return None
    if module.endswith(("attention.wqkv", "feed_forward.w13")):
        parts = [hq * d, hkv * d, hkv * d] if module.endswith("wqkv") else [inter, inter]
        return ("parts", 1 if suffix == "scales_and_zeros" else 0, parts)
    if module.endswith(("attention.wo", "feed_forward.w2")):
        if suffix == "bias":
            return ("rank0",)
        if suffix == "scales":
            return None
        return ("split", 0 if suffix == "scales_and_zeros" else 1)
    return None


def read_slices(f, args, mesh: Mesh) -> dict:
    """The tensors of an engine file (its open safe_open handle) as this rank keeps them (slice_rule), each sharded
    Linear's slices read on their own (safetensors' get_slice: only those bytes), so that a rank never holds the
    whole checkpoint."""
    rank, world = mesh.rank, mesh.world
    out = {}
    for name in f.keys():
        rule = slice_rule(name, args)
        if rule is None:
            out[name] = f.get_tensor(name)
            continue
        if rule[0] == "rank0":
            t = f.get_tensor(name)
            out[name] = t if rank == 0 else torch.zeros_like(t)
            continue
        sl = f.get_slice(name)
        shape = sl.get_shape()
        dim = rule[1]
        bounds = []
        if rule[0] == "split":
            k = shape[dim] // world
            bounds.append((rank * k, (rank + 1) * k))
        else:
            start = 0
            for n in rule[2]:
                k = n // world
                bounds.append((start + rank * k, start + (rank + 1) * k))
                start += n
        pieces = [sl[tuple(slice(a, b) if i == dim else slice(None) for i in range(len(shape)))]
                  for a, b in bounds]
        out[name] = torch.cat(pieces, dim) if len(pieces) > 1 else pieces[0]
    return out


# ------------------------------------------------------------------------------------------------ memory plan

def weight_bytes_per_rank(config: dict, world: int, dtype: torch.dtype) -> int:
    """Bytes of the weights one rank holds (float weights in dtype): the sharded Linears' 1/world (wqkv and w13
    with their biases, wo and w2), everything else whole (embeddings, output head, norms, wo's bias)."""
    return weight_count(parse_config(config), world) * dtype.itemsize


def memory_table(config: dict, worlds=(1, 2, 4, 8), contexts=(8192, 16384, 32768, 65536, 131072),
                 budget: int = 2048, block: int = 128, dtype: torch.dtype = torch.bfloat16) -> str:
    """A markdown table of one rank's weights and KV cache (GiB) for each world size: the full cache for each
    context (every token held: context + block slots per layer and KV head) against a budget (budget + block
    slots, whatever the context)."""
    args = parse_config(config)
    gib = 2 ** 30
    head = ["ranks", "weights / rank"] + [f"KV full {c // 1024}K / rank" for c in contexts] + \
        [f"KV budget {budget} / rank", f"total / rank, {contexts[-1] // 1024}K: full vs budget"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for n in worlds:
        if args.n_kv_heads % n:
            continue
        local = dataclasses.replace(args, n_kv_heads=args.n_kv_heads // n)
        w = weight_bytes_per_rank(config, n, dtype)
        full = [loading.kv_cache_estimate(local, c + block, dtype) for c in contexts]
        bud = loading.kv_cache_estimate(local, budget + block, dtype)
        rows.append("| " + " | ".join([str(n), f"{w / gib:.1f}"] + [f"{f / gib:.2f}" for f in full] +
                                      [f"{bud / gib:.2f}", f"{(w + full[-1]) / gib:.1f} vs {(w + bud) / gib:.1f}"])
                    + " |")
    return "\n".join(rows)


# ------------------------------------------------------------------------------------------------ the summary

def report(mesh: Mesh, model, stats: dict) -> str:
    """Every rank's KV cache bytes, weight bytes and peak memory (the largest of generate()'s startup, prefill and
    decode peaks), gathered with one all_gather (every rank calls it), added to stats (tp_world,
    kv_cache_bytes_per_rank, kv_cache_bytes_total, weight_bytes_per_rank, peak_bytes_per_rank); returns the
    summary's line."""
    peak = max(stats.get(k, 0) for k in ("startup_peak_bytes", "prefill_peak_bytes", "decode_peak_bytes"))
    weights = sum(p.nbytes for p in model.parameters())
    rows = gather_ints([kv_bytes(model), weights, peak], mesh)
    kv, weights, peak = ([r[i] for r in rows] for i in range(3))
    stats.update(tp_world=mesh.world, kv_cache_bytes_per_rank=kv, kv_cache_bytes_total=sum(kv),
                 weight_bytes_per_rank=weights, peak_bytes_per_rank=peak)
    mib = 2 ** 20
    return (f"tensor parallel over {mesh.world} ranks: KV cache per rank "
            f"{', '.join(f'{b / mib:.2f}' for b in kv)} MiB (total {sum(kv) / mib:.2f} MiB) | weights per rank "
            f"{', '.join(f'{b / mib:.1f}' for b in weights)} MiB | peak memory per rank "
            f"{', '.join(f'{b / mib:.1f}' for b in peak)} MiB ({stats.get('memory_measure', 'peak')})")


def gather_ints(values: list[int], mesh: Mesh) -> list[list[int]]:
    """Every rank's `values` (the same length on each), rank by rank: one all_gather of an int64 tensor (on the
    group's device: CPU for gloo, this rank's GPU for NCCL)."""
    if mesh.world == 1:
        return [list(values)]
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(mesh.group) == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.int64, device=dev)
    out = [torch.empty_like(t) for _ in range(mesh.world)]
    dist.all_gather(out, t, group=mesh.group)
    return [o.tolist() for o in out]
