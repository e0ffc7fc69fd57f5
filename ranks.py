"""torchrun's rank lifecycle: which rank this process is, joining and leaving the group, only rank 0 printing, a
lost rank named in one line, input read once on rank 0 and sent to every rank. Nothing here knows the model: the
sharding is tp.py's.

    torchrun --nproc-per-node 2 generate.py --policy keydiff --budget 2048 ...
"""
import dataclasses
import gc
import math
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

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
        raise UserError(f"`tp` must be >= 1 (ranks), got {requested}")
    if requested is not None and requested != world:
        raise UserError(f"tp={requested} does not match torchrun's world size {world} "
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


def start(requested: int | None, device: str, *, interactive: bool = False, speculate: bool = False,
          aot: bool = False) -> Mesh:
    """The command line's entry: validate (on every rank, before any collective, so that bad input fails
    everywhere at once: an explicit --tp that is not torchrun's world size, too few GPUs, a feature that runs on one process: a chat, speculation, a step compiled ahead of time), then join the
    group. Without torchrun and without --tp: one device, nothing initialised."""
    world = env_world()
    check_world(world, requested, device)
    if world > 1 and interactive:
        raise UserError("`interactive` reads its turns on one process; it does not run under tensor parallel")
    if world > 1 and speculate:
        raise UserError("`speculate` runs on one device; it does not run under tensor parallel yet")
    if world > 1 and aot:
        raise UserError("compile_mode=aot runs on one process: under tensor parallel the steps' collectives "
                        "need torch.compile (leave `compile_mode` auto)")
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
