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
"""
import dataclasses
import math
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from errors import EnvironmentFailure, UserError
from files import log_dir, open_log, stderr_to_log

TIMEOUT_S = 120.0  # no rank waits longer in a collective (BUDGETKV_TP_TIMEOUT: another number of seconds)
MIN_TIMEOUT_S = 1.0  # ranks start seconds apart: a shorter timeout fails the rendezvous itself


def env_timeout_s() -> float:
    """BUDGETKV_TP_TIMEOUT, seconds >= MIN_TIMEOUT_S, else TIMEOUT_S; UserError for a value that is not one."""
    text = os.environ.get("BUDGETKV_TP_TIMEOUT")
    try:
        value = TIMEOUT_S if text is None else float(text)
    except ValueError:
        value = math.nan
    if not MIN_TIMEOUT_S <= value < math.inf:
        raise UserError(f"BUDGETKV_TP_TIMEOUT={text!r} must be a number of seconds >= {MIN_TIMEOUT_S:g} (or unset: "
                        f"{TIMEOUT_S:g})")
    return value


@dataclasses.dataclass(frozen=True)
class Mesh:
    """This process's place in the tensor-parallel group: rank, world size, local rank, and the group (None when
    world == 1)."""
    rank: int
    world: int
    local_rank: int
    group: object = None

    def __deepcopy__(self, memo):  # a ProcessGroup cannot be copied: a copied model shares its rank's group
        return self


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")  # torchrun sets each for a worker
LOST = []  # the collective error once a rank was lost or stalled: finish() then waits for no one
TERMINAL = []  # a rank other than 0: its own stderr, while fd 2 goes to its log (quiet_other_ranks)


def torchrun_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) without torchrun. A torchrun worker is
    recognised by torchrun's own TORCHELASTIC_RUN_ID, beside which every TORCHRUN_VARS must be set: WORLD_SIZE >= 1,
    0 <= LOCAL_RANK <= RANK < WORLD_SIZE, MASTER_PORT 1-65535 (digits only), MASTER_ADDR a host name or address.
    RANK, WORLD_SIZE or LOCAL_RANK without it (left in a shell) are refused, UserError: a plain run would wait for
    ranks that never come. Each refusal names its variable."""
    env = os.environ
    given = ", ".join(f"{v}={env[v]}" for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if v in env)
    if "TORCHELASTIC_RUN_ID" not in env:
        if given:
            raise UserError(f"{given} in the environment, but this process was not started by torchrun (no "
                            "TORCHELASTIC_RUN_ID): unset them to run on one device, or start it with torchrun")
        return 0, 1, 0
    if missing := [v for v in TORCHRUN_VARS if v not in env]:
        raise UserError(f"torchrun's environment lacks {', '.join(missing)}")
    world = env_int("WORLD_SIZE", 1, 2 ** 31 - 1)
    rank = env_int("RANK", 0, world - 1, f" (WORLD_SIZE={world})")
    local_rank = env_int("LOCAL_RANK", 0, rank, f" (RANK={rank})")
    env_int("MASTER_PORT", 1, 65535)
    addr = env["MASTER_ADDR"]
    if not addr or addr != addr.strip() or any(c.isspace() or not c.isprintable() for c in addr):
        raise UserError(f"torchrun's MASTER_ADDR={addr!r} is not a host name or address")
    return rank, world, local_rank


def env_int(name: str, least: int, most: int, why: str = "") -> int:
    """The environment variable `name` as an integer in [least, most] (ASCII digits only); UserError naming it."""
    text = os.environ[name]
    if not (text.isascii() and text.isdigit() and least <= int(text) <= most):
        raise UserError(f"torchrun's {name}={text!r} must be an integer from {least} to {most}{why}")
    return int(text)


def env_world() -> int:
    """WORLD_SIZE from torchrun's environment (1 when not started by torchrun); UserError for a partial one."""
    return torchrun_env()[1]


def check_world(world: int, requested: int | None, device: str) -> None:
    """The checks every rank makes before any collective (each rank reaches the same answer from the same flags):
    an explicit --tp that is not torchrun's world size, a CUDA run with fewer GPUs than ranks."""
    if requested is not None and requested < 1:
        raise UserError(f"--tp must be >= 1 (ranks), got {requested}")
    if requested is not None and requested != world:
        raise UserError(f"--tp {requested} does not match torchrun's world size {world} "
                        f"(run torchrun --nproc-per-node {requested} generate.py ...)")
    if device.startswith("cuda") and world > 1:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        local_world = env_int("LOCAL_WORLD_SIZE", 1, world) if "LOCAL_WORLD_SIZE" in os.environ else world
        if n < local_world:
            raise UserError(f"tensor parallel over {world} ranks needs one CUDA device per rank; this machine has {n}")


def init(device: str = "cpu", timeout_s: float | None = None) -> Mesh:
    """Join torchrun's process group (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT from the environment): NCCL on
    CUDA (this rank's device is cuda:LOCAL_RANK), gloo on CPU, with a timeout so that no rank waits forever for a
    rank that failed. A world of 1 (no torchrun) initialises nothing."""
    rank, world, local_rank = torchrun_env()
    if world == 1:
        return Mesh(0, 1, 0, None)
    timeout_s = env_timeout_s() if timeout_s is None else timeout_s
    if not dist.is_initialized():
        cuda = device.startswith("cuda")
        if cuda:
            torch.cuda.set_device(local_rank)
        join(rank, world, timeout_s, "nccl" if cuda else "gloo",
             **({"device_id": torch.device("cuda", local_rank)} if cuda else {}))
    return Mesh(rank, world, local_rank, dist.group.WORLD)


def join(rank: int, world: int, timeout_s: float, backend: str, **kw) -> None:
    """init_process_group, its C++ messages kept in a log (join<R>.log): a rank that cannot reach the others
    (MASTER_ADDR unreachable, no rank 0, a port taken) is one line on its own stderr, EnvironmentFailure, once the
    timeout has passed."""
    verbose = os.environ.get("BUDGETKV_VERBOSE") == "1"
    try:
        with stderr_to_log(f"join{rank}.log", verbose):
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kw)
    except (RuntimeError, ValueError, OSError) as e:  # DistNetworkError, DistStoreError: RuntimeErrors
        if TERMINAL:
            os.dup2(TERMINAL[0], 2)  # no rank prints this one for it: the rank says it itself
        env = os.environ
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise EnvironmentFailure(
            f"tensor parallel: rank {rank} of {world} could not join the group at MASTER_ADDR={env['MASTER_ADDR']} "
            f"MASTER_PORT={env['MASTER_PORT']} within {timeout_s:g} s (BUDGETKV_TP_TIMEOUT): {first} (its messages: "
            f"{log_dir() / f'join{rank}.log'})") from None


def finish() -> None:
    """Leave the process group (nothing when none was joined), once every rank is done: a gloo group destroyed by
    the interpreter's exit instead can abort the process (its worker threads still hold tensors)."""
    if dist.is_initialized():
        import gc
        gc.collect()
        try:
            if not LOST:  # a rank already lost: nothing to wait for (its failure is what the user reads)
                dist.barrier()
        except Exception:
            pass
        dist.destroy_process_group()


def naming_lost_ranks(run):
    """run(a), where a collective that fails (gloo: a rank lost, or stalled past the group's timeout) is one line
    naming that rank where it can be told (of two ranks, the other one), EnvironmentFailure."""
    def call(a):
        try:
            return run(a)
        except RuntimeError as e:  # gloo's errors (DistBackendError among them) are RuntimeErrors
            if not dist.is_initialized() or "gloo" not in str(e).lower():
                raise
            LOST.append(e)
            rank, world = dist.get_rank(), dist.get_world_size()
            who = f"rank {1 - rank}" if world == 2 else "another rank"
            raise EnvironmentFailure(
                f"tensor parallel: {who} of {world} stopped answering rank {rank} (it failed, or stalled past the "
                f"group's timeout, BUDGETKV_TP_TIMEOUT, default 120 s; a rank's own error is in "
                f"{log_dir() / 'rank<R>.log'}): {' '.join(str(e).split())[:200]}") from None
    return call


def exit_code(code: int) -> int:
    """The exit code of a torchrun worker: its own, but bad input (2) on a rank other than 0 exits 0. Every rank
    refuses the same input (the same flags, the prompt sent by rank 0); rank 0 printed the line and exits 2, so
    torchrun exits 1 with a report that names rank 0 alone (each other failed rank would add its own entry). A
    malformed torchrun environment keeps its 2."""
    if code != 2 or "TORCHELASTIC_RUN_ID" not in os.environ:
        return code
    try:
        rank = torchrun_env()[0]
    except UserError:
        return code
    return code if rank == 0 else 0


def from_rank0(read, mesh: Mesh):
    """read() on rank 0 alone, its value sent to every rank (broadcast_object_list): input that one process only can
    read (a pipe, a FIFO, stdin), read once. Its refusal (UserError) is raised on every rank; any other failure
    on rank 0 ends the others with one line (EnvironmentFailure). A world of 1: read()."""
    if mesh.world == 1:
        return read()
    box = [None]
    if mesh.rank == 0:
        try:
            box[0] = ("value", read())
        except BaseException as e:
            box[0] = ("refused", str(e)) if isinstance(e, UserError) else ("failed", type(e).__name__)
            dist.broadcast_object_list(box, src=0, group=mesh.group)
            raise
    dist.broadcast_object_list(box, src=0, group=mesh.group)
    kind, value = box[0]
    if kind == "refused":
        raise UserError(value)
    if kind == "failed":
        raise EnvironmentFailure(f"rank 0 failed while reading the input ({value}): its line is on its stderr")
    return value


def start(requested: int | None, device: str, policy, *, interactive: bool = False, speculate: bool = False,
          aot: bool = False) -> Mesh:
    """The command line's entry: validate (on every rank, before any collective, so that bad input fails
    everywhere at once: an explicit --tp that is not torchrun's world size, too few GPUs, a policy refused under
    TP, a feature that runs on one process: a chat, speculation, a step compiled ahead of time), then join the
    group. Without torchrun and without --tp: one device, nothing initialised."""
    world = env_world()
    check_world(world, requested, device)
    check_policy(policy, world)
    if world > 1 and interactive:
        raise UserError("--interactive reads its turns on one process; it does not run under tensor parallel")
    if world > 1 and speculate:
        raise UserError("--speculate runs on one device; it does not run under tensor parallel yet")
    if world > 1 and aot:
        raise UserError("--compile-mode aot runs on one process: under tensor parallel the steps' collectives "
                        "need torch.compile (leave --compile-mode auto)")
    return init(device)


def rank_device(device: str, mesh: Mesh) -> str:
    """This rank's device: cuda:LOCAL_RANK for a CUDA run over several ranks, else `device` as given."""
    return f"cuda:{mesh.local_rank}" if device.startswith("cuda") and mesh.world > 1 else device


def quiet_other_ranks() -> Path | None:
    """Only rank 0 prints (under torchrun; call it first thing, so that a bad flag is one line too): the other
    ranks' stdout goes to /dev/null and their stderr to a log (files.open_log: rank<R>.log, returned), which a
    failure on that rank alone can be read from. A log opened elsewhere than usual is said in one line, on the
    rank's own stderr; where none can be opened, that stderr stays."""
    try:
        rank, world, _ = torchrun_env()
    except UserError:  # said in one line by the command's own check (start), on this process's own stderr
        return None
    if world == 1 or rank == 0:
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    TERMINAL[:] = [os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    try:
        fd, log, note = open_log(f"rank{rank}.log")
    except OSError as e:
        print(f"note: rank {rank} keeps its stderr here: no log could be opened ({e.strerror or e})", file=sys.stderr)
        return None
    if note:
        print(f"note: rank {rank}: {note}: its stderr goes to {log}", file=sys.stderr)
    os.dup2(fd, 2)
    os.close(fd)
    return log


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


def refusal(policy) -> str | None:
    """Why `policy` cannot run tensor parallel (None: it can): its own `tp_refusal()`. Every registered policy runs:
    those that score each KV head alone need nothing, and the two rules that read every head of a layer gather
    them (policies.all_heads, max_over_ranks: K-VEC's cross-head module and coverage, TOVA's heads=all)."""
    return None if policy is None else policy.tp_refusal()


def check_policy(policy, world: int) -> None:
    """UserError (one line) for a policy that cannot run over `world` ranks."""
    if world > 1 and (why := refusal(policy)):
        raise UserError(why)


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
    from quantize import Int4Linear, Int8Linear
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
    from quantize import Int4Linear
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
    import loading
    from config import parse_config
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
    import loading
    from convert import ENGINE_FILE, read_config
    from config import parse_config
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
    from config import parse_config, weight_count
    return weight_count(parse_config(config), world) * dtype.itemsize


def memory_table(config: dict, worlds=(1, 2, 4, 8), contexts=(8192, 16384, 32768, 65536, 131072),
                 budget: int = 2048, block: int = 128, dtype: torch.dtype = torch.bfloat16) -> str:
    """A markdown table of one rank's weights and KV cache (GiB) for each world size: the full cache for each
    context (every token held: context + block slots per layer and KV head) against a budget (budget + block
    slots, whatever the context)."""
    import loading
    from config import parse_config
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
    from cache import kv_bytes
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
