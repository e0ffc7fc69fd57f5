"""Every compile and runtime decision, made here and asked by everything else: eager, torch.compile, CUDA graphs or
the CPU decode step compiled ahead of time (AOT, aoti.py); freezing; layer regions; the inductor cache folder; the
device and the compute dtype; CPU threads (and how they wait: threads.py, before torch loads).

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
"""
import ctypes
import os
import re
from pathlib import Path

import threads  # noqa: F401  (before torch: how its OpenMP threads wait)
import torch

import aoti
import kernels
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


MAX_THREADS = 1024


def set_threads(n: int | None) -> None:
    """n CPU threads (1 to MAX_THREADS; UserError naming `threads` otherwise) for torch's intra-op and inter-op
    pools (None: torch's default, one per core). The inter-op pool can be sized once per process, before any
    parallel work: a later call leaves it as it is."""
    if n is None:
        return
    torch.set_num_threads(check_int("threads", n, 1, MAX_THREADS))
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError:
        pass


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


def compile_steps(device: str, mode: str | None = None, prefill: bool = True, freeze: bool = False):
    """The engine's (prefill-block step, decode step), compiled by compile_fns (prefill=False: the prefill step
    stays eager)."""
    prefills, (decode,) = compile_fns(device, mode, [prefill_step] if prefill else [], [model_step], freeze)
    return (prefills or [prefill_step])[0], decode


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
        return prefill_steps, [aoti.AotStep() for _ in decode]
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
