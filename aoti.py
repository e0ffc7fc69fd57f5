"""The CPU decode step compiled ahead of time (AOTInductor): exported once, compiled to a shared library packaged on
disk, and later loaded and run with no tracing, no guards and no Python between kernels.

The packaged step takes every parameter and buffer of the model as an input (torch.func.functional_call), so the
package holds no weights (one copy in memory, the module's own) and writes the caches in place, as a compiled step
does. It is exported and compiled in a fork of the process (on Linux), so the compiler never loads into the run's
own process: a run that compiles holds the memory of one that loads. A package is named by a key over everything that shapes the traced step: the source of the repository's
modules that a step runs, torch's version, the thread count, the attention form (BUDGETKV_ATTENTION), the CPU's
instruction sets (a package is compiled with -march=native, for the CPU it was built on), every input's name, shape,
stride and dtype, and the plain attributes of every module and of the objects they hold (the policy and its plan,
the model's arguments). A change to any of them compiles a new package. Beside each package a record (<key>.json,
written last) holds what it was built from and the package's sha256; a package is loaded only when both match, so
none is ever loaded for another state or with damaged bytes: it is compiled again in its place."""
import hashlib
import inspect
import json
import os
import shutil
import signal
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from torch import Tensor

import kernels
from errors import EnvironmentFailure
from files import STOP_SIGNALS, dies_with_parent, read_json, remove_stale_tmp, write_atomic, write_text
from model import set_layer_regions

ROOT = Path(__file__).resolve().parent
PACKAGES = ROOT / "build" / "aot-steps"  # <key>.pt2 and <key>.json, kept across runs (BUDGETKV_AOT_DIR overrides)
# torch 2.13's own FutureWarning from inside the compile (inductor copies the exported graph's pytree specs): nothing a
# caller can act on, and the Python API has no compile log to send it to
TORCH_NOTICE = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


def package_dir() -> Path:
    return Path(os.environ.get("BUDGETKV_AOT_DIR") or PACKAGES)


def step_inputs(model) -> tuple[list[str], list[Tensor]]:
    """The names and tensors the packaged step takes before (idx, input_pos): every parameter and buffer, once."""
    named = [*model.named_parameters(), *model.named_buffers()]
    return [n for n, _ in named], [t for _, t in named]


def describe(value, seen: set, depth: int = 0) -> str:
    """A stable text for a Python value the traced step may depend on: plain values by repr, a tensor held outside
    the module's parameters and buffers by its bytes (the export folds it in as a constant), containers and objects
    by their contents (modules are described where they sit in the model)."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return repr(value)
    if isinstance(value, Tensor):
        t = value.detach().cpu().contiguous()
        digest = hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()
        return f"tensor{tuple(t.shape)}{t.dtype}:{digest[:16]}"
    if isinstance(value, torch.nn.Module):
        return type(value).__qualname__
    if depth > 4 or id(value) in seen:
        return f"<{type(value).__qualname__}>"
    seen = seen | {id(value)}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [describe(v, seen, depth + 1) for v in value]
        return f"{type(value).__name__}[{', '.join(sorted(items) if isinstance(value, (set, frozenset)) else items)}]"
    if isinstance(value, dict):
        items = sorted(value.items(), key=str)
        return "{" + ", ".join(f"{k!r}: {describe(v, seen, depth + 1)}" for k, v in items) + "}"
    if isinstance(value, type) or inspect.isroutine(value):  # a class or function by name, not by its (empty) dict
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', repr(value))}"
    attrs = getattr(value, "__dict__", None)
    if attrs is None:
        return f"{type(value).__qualname__}:{value!r}"
    return f"{type(value).__qualname__}({describe(attrs, seen, depth + 1)})"


# The repository's modules whose code never runs inside a step (command lines, files, text, the decode loop): left out
# of the key, so that editing them does not recompile. Every other module, a new one included, is hashed.
UNTRACED_MODULES = {"generate.py", "generate_args.py", "cli.py", "chat.py", "progress.py", "checkpoint.py", "convert.py",
                    "tokenizer.py", "files.py", "errors.py", "engine.py", "speculative.py", "loading.py", "runtime.py",
                    "sampling.py"}


def cpu_features() -> str:
    """The instruction sets of this CPU, as one line: torch's vector capability and a hash of /proc/cpuinfo's flags
    (inductor compiles with -march=native, so a package may use any instruction this CPU has)."""
    flags = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
        if line:
            flags = hashlib.sha256(" ".join(sorted(line.split(":", 1)[1].split())).encode()).hexdigest()[:16]
    except OSError:
        pass
    return f"cpu {torch.backends.cpu.get_cpu_capability()}, flags {flags}"


def step_recipe(model, idx: Tensor, input_pos: Tensor, threads: int | None = None) -> list[str]:
    """What a package is built from, one line each: the traced modules' source (by hash), torch's version, the
    thread count it is compiled for (threads, else torch's now; its kernels read the count they run with) and
    whether inductor names its kernels for a profiler, the attention form and the CPU's
    instruction sets, every input's name, shape, stride, dtype and device, and every module's plain attributes."""
    sources = hashlib.sha256()
    for path in sorted(ROOT.glob("*.py")):
        if path.name not in UNTRACED_MODULES:
            sources.update(path.name.encode() + path.read_bytes())
    inductor = sys.modules.get("torch._inductor.config")  # not imported: its defaults (a warm run never imports it)
    profiled = bool(inductor and inductor.cpp.enable_kernel_profile)  # named kernels, for bench_paired --profile
    lines = [f"sources {sources.hexdigest()}", f"torch {torch.__version__}, threads {threads or torch.get_num_threads()}"
             + (", kernels profiled" if profiled else ""),
             f"attention {kernels.FORM or 'chosen'}", cpu_features()]
    names, tensors = step_inputs(model)
    for name, t in [*zip(names, tensors), ("idx", idx), ("input_pos", input_pos)]:
        lines.append(f"{name}{tuple(t.shape)}{t.stride()}{t.dtype}{t.device}")
    for name, module in model.named_modules():
        skip = getattr(module, "UNTRACED", ())
        attrs = {k: v for k, v in vars(module).items() if not k.startswith("_") and k not in skip}
        lines.append(f"{name}:{type(module).__qualname__}{describe(attrs, set())}")
    return lines


def recipe_key(recipe: list[str]) -> str:
    return hashlib.sha256("\n".join(recipe).encode()).hexdigest()[:32]


def step_key(model, idx: Tensor, input_pos: Tensor, threads: int | None = None) -> str:
    return recipe_key(step_recipe(model, idx, input_pos, threads))


class _Step(torch.nn.Module):
    """model(idx, input_pos) with the given tensors in place of the model's own: what is exported."""

    def __init__(self, model, names: list[str]):
        super().__init__()
        self.names = names
        object.__setattr__(self, "model", model)  # not a submodule: its tensors are inputs, not this module's state

    def forward(self, tensors: list[Tensor], idx: Tensor, input_pos: Tensor) -> Tensor:
        return torch.func.functional_call(self.model, dict(zip(self.names, tensors)), (idx, input_pos), strict=True)


def export_step(model, idx: Tensor, input_pos: Tensor):
    """The decode step model(idx, input_pos) as an ExportedProgram over (tensors, idx, input_pos)."""
    names, tensors = step_inputs(model)
    set_layer_regions(False)  # a region is a dynamo construct: an exported step is flat
    with torch.no_grad():
        ep = torch.export.export(_Step(model, names), (tensors, idx, input_pos), strict=False)
    own = {t.untyped_storage().data_ptr() for t in tensors}
    baked = [name for name, t in ep.constants.items()
             if isinstance(t, Tensor) and t.untyped_storage().data_ptr() in own]
    if baked:  # a model tensor reached around the module's attributes would be frozen into the package
        raise RuntimeError(f"the exported step holds model tensors as constants: {baked}")
    return ep


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def record_path(path: Path) -> Path:
    return path.with_suffix(".json")  # beside <key>.pt2: {"key", "built_from", "bytes", "sha256"}, written after it


def package_problem(path: Path, key: str, recipe: list[str]) -> str | None:
    """Why the package at `path` must not be loaded ("" where there is none yet), or None where it may: its record
    names this key and this recipe, and the package has the recorded size (checked first: nothing larger is read)
    and bytes that hash to the recorded sha256."""
    if not path.is_file():
        return ""
    try:
        record = read_json(record_path(path))
    except (OSError, ValueError):
        return "no readable record of what it was built from"
    if not isinstance(record, dict) or record.get("key") != key or record.get("built_from") != recipe:
        return "it was built for another model or setting"
    try:
        if record.get("bytes") != path.stat().st_size or record.get("sha256") != file_sha256(path):
            return "its bytes are not the ones recorded: damaged or replaced"
    except OSError:
        return "it cannot be read"
    return None


def folder_problem(folder: Path) -> str | None:
    """Why no package can be written in `folder` (created here if missing), found before a compile; None if it can."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return None


def save_package(built: Path, path: Path, recipe: list[str]) -> None:
    """Copy the package into place, then its record (last, so a record always describes the package beside it);
    each written whole or not at all (files.write_atomic). Errors -> EnvironmentFailure naming the file."""
    remove_stale_tmp(path.parent)
    write_atomic(path, lambda tmp: shutil.copyfile(built, tmp))
    record = {"key": recipe_key(recipe), "bytes": path.stat().st_size, "sha256": file_sha256(path),
              "built_from": recipe}
    write_text(record_path(path), json.dumps(record, indent=0))


def build_package(model, idx: Tensor, input_pos: Tensor, built: Path, threads: int | None) -> None:
    """Export the step and compile it into the package file `built`, for `threads` threads (None: torch's count
    now), its kernels reading the count they run with (inductor's dynamic threads). torch's own notice from inside
    the compile (TORCH_NOTICE) is not shown."""
    import torch._inductor
    ep = export_step(model, idx, input_pos)
    torch.set_num_threads(threads or torch.get_num_threads())
    with torch._inductor.config.patch({"cpp.dynamic_threads": True}), warnings.catch_warnings():
        warnings.filterwarnings("ignore", TORCH_NOTICE, FutureWarning)
        torch._inductor.aoti_compile_and_package(ep, package_path=str(built))


def in_fork(fn) -> None:
    """fn() in a forked copy of this process (on Linux; elsewhere in this one), which shares this one's memory until
    it writes: what fn imports and allocates (the compiler, the traced graph) ends with the fork, and this
    process's peak memory never holds it. The fork dies with this process; its error is raised here as a
    RuntimeError with its line. The stop signals wait while it forks (files.STOP_SIGNALS)."""
    if sys.platform != "linux":
        return fn()
    read, write = os.pipe()
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        pid = os.fork()
    except OSError:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        os.close(read), os.close(write)
        raise
    if pid == 0:  # the fork: runs fn, reports, and never returns
        os.close(read)
        code, line = 0, b""
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is this process's: it ends the fork
            dies_with_parent()
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
            fn()
        except BaseException as e:
            code, line = 1, f"{type(e).__name__}: {e}".encode(errors="replace")
        os.write(write, line[:4096])
        os._exit(code)
    try:  # the fork's exit, not the pipe's end, is awaited: a process it started may still hold the pipe open
        os.close(write)
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        status, pid = os.waitpid(pid, 0)[1], None
        os.set_blocking(read, False)  # its line (<= 4096 bytes, within the pipe's buffer) was written before it exited
        try:
            line = os.read(read, 4096).decode(errors="replace")
        except BlockingIOError:
            line = ""
    finally:
        os.close(read)
        if pid is not None:  # this process stopped waiting (Ctrl-C, SIGTERM): the fork ends too
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    if status:
        raise RuntimeError("compiling the decode step failed in its process: "
                           f"{line or os.waitstatus_to_exitcode(status)}")


def compile_package(model, idx: Tensor, input_pos: Tensor, path: Path, recipe: list[str], say,
                    threads: int | None = None):
    """Build the package (build_package, in a fork: in_fork), load it, and save it as `path` with its record; the
    loader. A folder that cannot be written is found before the compile, and a save that fails (a full disk) leaves
    the loaded step running: either is one line through say(line), naming the folder."""
    unwritable = folder_problem(path.parent)
    if unwritable:
        say(f"note: cannot write compiled steps in {path.parent} ({unwritable}): the compiled step runs without "
            "being saved")
    with tempfile.TemporaryDirectory(prefix="budgetkv-aot-") as tmp:
        built = Path(tmp) / path.name
        in_fork(lambda: build_package(model, idx, input_pos, built, threads))
        loader = load_package(built)
        if loader is None:
            raise EnvironmentFailure(f"the decode step just compiled cannot be loaded by this torch "
                                     f"({torch.__version__}): run without --compile")
        if not unwritable:
            try:
                save_package(built, path, recipe)
            except EnvironmentFailure as e:
                say(f"note: {e}: the compiled step runs without being saved in {path.parent}")
    return loader


def load_package(path: Path):
    """The package's loader, or None where the file is not a package this torch can load."""
    try:
        return torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    except (RuntimeError, OSError, ValueError):
        return None


class AotStep:
    """The decode step on CPU, called as a compiled step is: step(model, idx, input_pos) -> logits.

    On its first call, and whenever the model's caches or the input shapes change (engine.setup makes new caches),
    it binds: computes the key, loads the package of that key or compiles it (about a minute for SmolLM2-135M on two
    cores), and holds the model's tensors for the calls that follow. Between binds nothing is re-read: change a
    policy or a cache through engine.setup, which makes new caches. A package is loaded only when its record names
    this key's recipe and its bytes hash to the recorded sha256; any other (swapped, damaged, unrecorded, or one
    torch fails to load) is compiled again in its place, with one line saying why (to `stream`, else stderr).
    `compiled` and `loaded` count the binds. threads: the count it is compiled for (runtime.THREADS.usable), whatever
    the count runs with later (None: torch's at the bind)."""

    def __init__(self, threads: int | None = None):
        self.threads = threads
        self.loaders, self.bound, self.tensors, self.loader = {}, None, None, None
        self.compiled = self.loaded = 0
        self.stream = None

    def say(self, line: str) -> None:
        stream = self.stream if self.stream is not None and not self.stream.closed else sys.stderr
        print(line, file=stream, flush=True)

    def fingerprint(self, model, idx: Tensor, input_pos: Tensor) -> tuple:
        # the bound tensors stay referenced, so a new cache's tensors can never take an old one's id
        return (id(model.tok_embeddings.weight), *(id(layer.attention.kv_cache.k) for layer in model.layers),
                idx.shape, input_pos.shape)

    def load_or_compile(self, model, idx: Tensor, input_pos: Tensor, key: str, recipe: list[str]):
        path = package_dir() / f"{key}.pt2"
        why = package_problem(path, key, recipe)
        if why is None:
            loader = load_package(path)
            if loader is not None:
                self.loaded += 1
                return loader
            why = "torch could not load it"
        if why:
            self.say(f"note: compiled step {path} not loaded ({why}): compiling it again")
        loader = compile_package(model, idx, input_pos, path, recipe, self.say, self.threads)
        self.compiled += 1
        return loader

    def bind(self, model, idx: Tensor, input_pos: Tensor) -> None:
        self.tensors = None
        recipe = step_recipe(model, idx, input_pos, self.threads)
        key = recipe_key(recipe)
        if key not in self.loaders:
            self.loaders[key] = self.load_or_compile(model, idx, input_pos, key, recipe)
        self.loader, self.tensors = self.loaders[key], step_inputs(model)[1]
        self.bound = self.fingerprint(model, idx, input_pos)

    def __call__(self, model, idx: Tensor, input_pos: Tensor) -> Tensor:
        if self.fingerprint(model, idx, input_pos) != self.bound:
            self.bind(model, idx, input_pos)
        return self.loader.run([*self.tensors, idx, input_pos])[0]
