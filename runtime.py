"""Every compile and runtime decision, made here and asked by everything else: eager, torch.compile, CUDA graphs or
the CPU decode step compiled ahead of time (AOT, aoti.py); freezing; layer regions; the inductor cache folder; the
device and the compute dtype; CPU threads.

The rules:
- `--compile-mode auto` (None): on CPU the decode step is AOT (no tracing on a warm start, no compiler in the
  process, no guards per step), or frozen in fp32 max-autotune (inductor's packed micro-GEMMs need the weights as
  constants; quantized Linears have kernels of their own); on CUDA decode runs under CUDA graphs (reduce-overhead).
  Under tensor parallel AOT becomes torch.compile's default (the collectives need dynamo).
- The prefill-block step is compiled on CUDA only (unless asked); never for a one-shot prefill, which does not run
  it; never under CUDA graphs (max-autotune would turn them on: its no-cudagraphs twin is used).
- Layer regions on CPU, unfrozen, outside the flex attention form (model.set_layer_regions): a region cannot hold
  constants, a region's functionalization fails on flex's block mask, and on CUDA a region's step runs slower under
  CUDA graphs (docs/performance.md).
- Compiled graphs are cached on disk in the repository's build/inductor-cache (TORCHINDUCTOR_CACHE_DIR overrides;
  torch's default under /tmp is emptied by a reboot).
- CPU threads (`THREADS`): by default as many as the cores this process may use (its CPU affinity, a cgroup CPU
  quota) less the cores other processes keep busy, judged again about once a second while a run works (between
  steps and prefill blocks): two on an idle 2-core machine, one beside a busy process, two again once it is gone.
  Compiled CPU kernels read the count when they run (inductor's dynamic threads), so a compiled step follows it too.
  `set_threads(n)` (--threads N), or OMP_NUM_THREADS in the environment, fixes it: a fixed count reproduces a run's
  logits bit for bit, a count that moves can change their last bits. Between parallel regions OpenMP's threads spin
  briefly, then sleep (libgomp's default): nothing is set when a module is imported, so the import order does not
  matter, and an OMP_WAIT_POLICY or GOMP_SPINCOUNT the user set is left as it is.
"""
import collections
import ctypes
import math
import os
import re
import time
from pathlib import Path

import torch

import aoti
import kernels
from cache import KV_DTYPES
from errors import UserError, check_int
from model import set_layer_regions

INDUCTOR_CACHE = Path(__file__).resolve().parent / "build" / "inductor-cache"  # compiled steps, kept across runs
AOT = "aot"  # a compile mode of our own: the CPU decode step compiled ahead of time (aoti.py)
MODES = (AOT, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: bfloat16 on CUDA, float32 on CPU


def check_device(device) -> str:
    """`device`: cpu, cuda or cuda:N, one this machine has; UserError naming it otherwise."""
    if not isinstance(device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise UserError(f"device={device!r} is not a device: cpu, cuda or cuda:N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device={device} was asked for but CUDA is not available (use cpu)")
    if ":" in device and int(device.split(":")[1]) >= torch.cuda.device_count():
        raise UserError(f"device={device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def compute_dtype(dtype: str, device: str) -> torch.dtype:
    """`dtype` (DTYPES): auto is bfloat16 on CUDA, float32 on CPU."""
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise UserError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    auto = torch.bfloat16 if device.startswith("cuda") else torch.float32
    return auto if dtype == "auto" else getattr(torch, dtype)


def check_kv_dtype(kv_dtype: str, compute: torch.dtype) -> torch.dtype | None:
    """kv_dtype ("auto", "int8", "bfloat16") as the caches' storage (None: the compute dtype); bfloat16 only halves
    a float32 run's cache."""
    if not isinstance(kv_dtype, str) or kv_dtype not in ("auto", *KV_DTYPES):
        raise UserError(f"kv_dtype={kv_dtype!r} is not one of auto, {', '.join(KV_DTYPES)}")
    if kv_dtype == "bfloat16" and compute != torch.float32:
        raise UserError(f"kv_dtype=bfloat16 halves a float32 run's cache; this run computes in "
                        f"{str(compute).removeprefix('torch.')}, whose own cache is as small: drop `kv_dtype` or "
                        "give dtype=float32")
    return KV_DTYPES.get(kv_dtype)


class Threads:
    """The CPU thread count of torch's pools (the module docstring's rule). start(n): fixed at n, or adaptive (None)
    from `usable` cores down to 1; tick() between steps judges the other processes' load about once an INTERVAL
    and moves the count; `changes` keeps the last 20 moves (seconds since start, threads, other processes' cores),
    `moves` counts them all."""
    INTERVAL = 1.0  # seconds between two readings of the machine's load
    BUSY = 0.6  # cores of other work from which one thread fewer is used

    def __init__(self):
        self.fixed, self.usable, self.count, self.last, self.t0 = None, 1, None, None, 0.0
        self.changes, self.moves = collections.deque(maxlen=20), 0

    def ensure(self) -> None:
        """Adaptive from now on, unless start() chose already (the Python API's first run starts it here)."""
        if self.count is None:
            self.start()

    def start(self, n: int | None = None) -> None:
        """Fixed at n, or at OMP_NUM_THREADS when the environment sets it, or adaptive."""
        n = n or omp_num_threads()
        self.fixed, self.usable = n, n or usable_cores()
        self.changes.clear()
        self.moves, self.last, self.t0 = 0, None, time.monotonic()
        self.count = None  # set even where torch's count was changed behind this object's back
        self.use(self.usable)

    def use(self, n: int) -> None:
        if n != self.count:
            torch.set_num_threads(n)
            self.count = n

    def tick(self) -> None:
        self.ensure()
        if self.fixed is not None or self.usable == 1:
            return
        now = time.monotonic()
        if self.last is not None and now - self.last[0] < self.INTERVAL:
            return
        sample = load_sample()
        if sample is not None and self.last is not None and self.last[1] is not None:
            others = other_cores(self.last[1], sample, now - self.last[0])
            want = max(1, self.usable - int(others + 1 - self.BUSY))
            if want != self.count:
                self.use(want)
                self.changes.append((round(now - self.t0, 1), want, round(others, 2)))
                self.moves += 1
        self.last = (now, sample)

    def report(self) -> dict:
        """What a run's stats say of its threads: the count at the end, how it was chosen, its moves, and how idle
        threads wait."""
        self.ensure()
        return {"threads": torch.get_num_threads(),
                "thread_policy": "fixed" if self.fixed is not None else f"adaptive (up to {self.usable})",
                "thread_changes": list(self.changes), "thread_moves": self.moves,
                "wait_policy": os.environ.get("OMP_WAIT_POLICY") or (
                    f"GOMP_SPINCOUNT={os.environ['GOMP_SPINCOUNT']}" if "GOMP_SPINCOUNT" in os.environ else
                    "default (spin briefly, then sleep)")}


THREADS = Threads()
MAX_THREADS = 1024


def set_threads(n: int | None) -> None:
    """The run's CPU threads: fixed at n, or adaptive (None: the module docstring's rule). The inter-op pool is
    sized once per process, before any parallel work: a later call leaves it as it is."""
    THREADS.start(None if n is None else check_int("threads", n, 1, MAX_THREADS))
    try:
        torch.set_num_interop_threads(THREADS.usable)
    except RuntimeError:
        pass


def omp_num_threads() -> int | None:
    """OMP_NUM_THREADS's count, when the environment sets one (errors.check_python refuses a malformed one)."""
    first = os.environ.get("OMP_NUM_THREADS", "").split(",")[0]
    return int(first) if first.isdigit() and int(first) > 0 else None


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup CPU quota (a container's cpu.max)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_quota()
    return max(1, min(n, math.ceil(quota))) if quota else n


CGROUP_QUOTAS = (("/sys/fs/cgroup/cpu.max", None),  # v2: "<quota> <period>" or "max <period>"
                 ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us"))  # v1


def cgroup_quota(files=CGROUP_QUOTAS) -> float | None:
    """The cgroup's CPU quota in cores (cgroup v2's cpu.max, v1's cfs quota / period); None without one."""
    for path, period_path in files:
        try:
            fields = open(path).read().split()
            quota = fields[0]
            period = fields[1] if period_path is None else open(period_path).read().split()[0]
        except (OSError, IndexError):
            continue
        if quota in ("max", "-1"):
            return None
        try:
            return int(quota) / int(period)
        except (ValueError, ZeroDivisionError):
            return None
    return None


def load_sample() -> tuple[int, int] | None:
    """(busy clock ticks of the whole machine, this process's own) from /proc/stat and /proc/self/stat; None where
    they cannot be read."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            own = f.read()
        rest = own[own.rindex(")") + 2:].split()
        return sum(fields) - fields[3] - fields[4], int(rest[11]) + int(rest[12])  # less idle, iowait; utime + stime
    except (OSError, ValueError, IndexError):
        return None


def other_cores(before: tuple[int, int], after: tuple[int, int], seconds: float) -> float:
    """Cores the other processes kept busy between two load_samples `seconds` apart."""
    ticks = os.sysconf("SC_CLK_TCK") * seconds
    return max(0.0, ((after[0] - before[0]) - (after[1] - before[1])) / ticks) if ticks > 0 else 0.0


def release_free_memory() -> None:
    """Give the C allocator's free pages back to the system (glibc's malloc_trim): the temporaries of a long
    prefill or of a compile, once freed, otherwise stay in the process's RSS for the whole decode. Nothing
    where the C library has no malloc_trim."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def default_compile_mode(device: str, dtype: torch.dtype, quantized: bool, freeze: bool = False) -> str | None:
    """The mode `auto` means (the module's rules); None is torch.compile's default (CUDA: reduce-overhead for
    decode)."""
    if device == "cpu" and not freeze:
        return AOT
    packed = freeze and device == "cpu" and dtype == torch.float32 and not quantized
    return "max-autotune-no-cudagraphs" if packed else None


def compile_settings(model, protocol: str, mode: str | None, prefill: bool | None, freeze: bool, aot: bool = True
                     ) -> tuple[str | None, bool]:
    """(the compile mode, whether the prefill-block step is compiled) for a requested mode (None or "auto":
    default_compile_mode) and prefill choice (None: on CUDA only), by the module's rules. aot=False: steps that
    are not the one-token decode step (speculation's), for which auto never means AOT."""
    device = str(model.tok_embeddings.weight.device)
    if mode is not None and mode != "auto" and mode not in MODES:
        raise UserError(f"compile_mode={mode!r} is not one of auto, {', '.join(MODES)}")
    if mode in (None, "auto"):
        quantized = "budgetkv_quantization" in getattr(model, "config", {})
        mode = default_compile_mode(device, model.tok_embeddings.weight.dtype, quantized, freeze)
        if mode == AOT and (getattr(model, "tp_group", None) is not None or not aot):
            mode = None
    if mode == AOT and not aot:
        raise UserError("compile_mode=aot compiles the one-token decode step; speculation's steps are "
                        "torch.compile's (leave the compile mode auto)")
    if mode == AOT and (device != "cpu" or freeze):
        raise UserError("compile_mode=aot compiles the CPU decode step, unfrozen (its package takes the weights as "
                        "inputs): not with " + ("`freeze`" if freeze else f"device={device}"))
    if mode == "reduce-overhead" and device == "cpu":
        raise UserError("compile_mode=reduce-overhead is CUDA graphs, which a CPU has not (use default or "
                        "max-autotune-no-cudagraphs)")
    prefill = device != "cpu" if prefill is None else prefill
    return mode, prefill and protocol == "block"


def step_modes(device: str, mode: str | None) -> tuple[str | None, str | None]:
    """torch.compile modes of (prefill steps, decode steps) for a mode: on CUDA, None puts decode under CUDA graphs
    ("default" does not), and prefill stays out of them in every mode."""
    if not device.startswith("cuda"):
        return mode, mode
    no_graphs = {"reduce-overhead": None, "max-autotune": "max-autotune-no-cudagraphs"}
    return no_graphs.get(mode, mode), mode or "reduce-overhead"


def mode_name(mode: str | None, device: str) -> str:
    """What a compile mode of None means on this device (step_modes): the name a summary prints."""
    return mode or ("reduce-overhead" if device.startswith("cuda") else "default")


def model_step(model, idx, input_pos):
    """The decode step (and an eager prefill block): model(idx, input_pos)."""
    return model(idx, input_pos)


def prefill_step(model, idx, input_pos):  # a separate function so that its compiled graph is separate
    return model(idx, input_pos)


STEPS = (prefill_step,), (model_step,)  # a run's (prefill steps, decode steps): the engine's


def compile_steps(device: str, mode: str | None = None, prefill: bool = True, freeze: bool = False, fns=STEPS
                  ) -> tuple:
    """A run's steps, the prefill steps then the decode steps of `fns` (default the engine's: (prefill-block step,
    decode step)), compiled by compile_fns (prefill=False: the prefill steps stay eager)."""
    prefills, decodes = compile_fns(device, mode, fns[0] if prefill else [], fns[1], freeze)
    return (*(prefills or fns[0]), *decodes)


def compile_fns(device: str, mode: str | None, prefill=(), decode=(), freeze: bool = False) -> tuple[list, list]:
    """(the prefill steps, the decode steps) compiled once each with fullgraph=True and static shapes, prefill's in
    the prefill mode and decode's in the decode mode (step_modes); with mode AOT each decode step is an
    aoti.AotStep (the CPU one-token decode step from a package) and the prefill steps take torch.compile's default.
    Each step must be its own Python function: dynamo caches compiled graphs per code object.

    Unfrozen, a compiled graph reads the module's own weights and inductor caches it on disk (INDUCTOR_CACHE): a
    later process of the same model, policy, budget, block size, dtype and device loads it in seconds. freeze=True
    folds the weights into the graph as constants (inductor's freezing): a second copy of the weights."""
    if os.access(INDUCTOR_CACHE.parent.parent, os.W_OK):
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(INDUCTOR_CACHE))
    if mode == AOT:
        prefill_steps = compile_fns(device, None, prefill, (), freeze)[0] if prefill else []
        THREADS.ensure()
        return prefill_steps, [aoti.AotStep(THREADS.usable) for _ in decode]
    torch._inductor.config.cpp.dynamic_threads = True  # compiled kernels read the count THREADS moves, as they run
    # Dynamo reads the global flag when it traces (frozen, the weights are constants, not graph inputs): it holds
    # until another compile. In the options too, so that a frozen and an unfrozen step never share a graph.
    torch._inductor.config.freezing = freeze
    set_layer_regions(not freeze and device == "cpu" and kernels.FORM != "flex")
    prefill_mode, decode_mode = step_modes(device, mode)
    return ([compile_step(fn, prefill_mode, freeze) for fn in prefill],
            [compile_step(fn, decode_mode, freeze) for fn in decode])


def compile_step(fn, mode: str | None, freeze: bool = False):
    """fn compiled with fullgraph=True and static shapes under `mode`'s inductor options (frozen or not)."""
    options = {**torch._inductor.list_mode_options(mode or "default"), "freezing": freeze}
    return torch.compile(fn, fullgraph=True, dynamic=False, options=options)


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
