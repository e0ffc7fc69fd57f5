"""The CPU decode step compiled ahead of time (AOTInductor): exported once, compiled to a shared library packaged on
disk, and later loaded and run with no tracing, no guards and no Python between kernels.

The packaged step takes every parameter and buffer of the model as an input (torch.func.functional_call), so the
package holds no weights (one copy in memory, the module's own) and writes the caches in place, as a compiled step
does. A package is named by a key over everything that shapes the traced step: the source of the repository's
modules that a step runs, torch's version, the thread count, every input's name, shape, stride and dtype, and the
plain attributes of every module and of the objects they hold (the policy and its plan, the model's arguments). A
change to any of them compiles a new package; none is ever loaded for another state."""
import hashlib
import inspect
import os
from pathlib import Path

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parent
PACKAGES = ROOT / "build" / "aot-steps"  # <key>.pt2, kept across runs (BUDGETKV_AOT_DIR overrides)


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
UNTRACED_MODULES = {"generate.py", "cli.py", "chat.py", "progress.py", "checkpoint.py", "convert.py", "tokenizer.py",
                    "files.py", "errors.py", "engine.py", "speculative.py"}


def step_key(model, idx: Tensor, input_pos: Tensor) -> str:
    h = hashlib.sha256()
    for path in sorted(ROOT.glob("*.py")):
        if path.name not in UNTRACED_MODULES:
            h.update(path.name.encode() + path.read_bytes())
    h.update(f"torch {torch.__version__}, threads {torch.get_num_threads()}".encode())
    names, tensors = step_inputs(model)
    for name, t in [*zip(names, tensors), ("idx", idx), ("input_pos", input_pos)]:
        h.update(f"{name}{tuple(t.shape)}{t.stride()}{t.dtype}{t.device}".encode())
    for name, module in model.named_modules():
        skip = getattr(module, "UNTRACED", ())
        attrs = {k: v for k, v in vars(module).items() if not k.startswith("_") and k not in skip}
        h.update(f"{name}:{type(module).__qualname__}{describe(attrs, set())}".encode())
    return h.hexdigest()[:32]


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
    from model import set_layer_regions
    names, tensors = step_inputs(model)
    set_layer_regions(False)  # a region is a dynamo construct: the exported step is flat
    with torch.no_grad():
        ep = torch.export.export(_Step(model, names), (tensors, idx, input_pos), strict=False)
    own = {t.untyped_storage().data_ptr() for t in tensors}
    baked = [name for name, t in ep.constants.items()
             if isinstance(t, Tensor) and t.untyped_storage().data_ptr() in own]
    if baked:  # a model tensor reached around the module's attributes would be frozen into the package
        raise RuntimeError(f"the exported step holds model tensors as constants: {baked}")
    return ep


def compile_package(model, idx: Tensor, input_pos: Tensor, path: Path) -> Path:
    """Export and compile the step into `path`, written whole or not at all (a temporary file, then renamed)."""
    import torch._inductor
    ep = export_step(model, idx, input_pos)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.pt2")
    try:
        torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load_package(path: Path):
    """The package's loader, or None where the file is not a package this torch can load."""
    try:
        return torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    except RuntimeError:
        return None


class AotStep:
    """The decode step on CPU, called as a compiled step is: step(model, idx, input_pos) -> logits.

    On its first call, and whenever the model's caches or the input shapes change (engine.setup makes new caches),
    it binds: computes the key, loads the package of that key or compiles it (about a minute for SmolLM2-135M on two
    cores), and holds the model's tensors for the calls that follow. Between binds nothing is re-read: change a
    policy or a cache through engine.setup, which makes new caches. A package that cannot be loaded (damaged on
    disk) is compiled again in its place. `compiled` and `loaded` count the binds."""

    def __init__(self):
        self.loaders, self.bound, self.tensors, self.loader = {}, None, None, None
        self.compiled = self.loaded = 0

    def fingerprint(self, model, idx: Tensor, input_pos: Tensor) -> tuple:
        # the bound tensors stay referenced, so a new cache's tensors can never take an old one's id
        return (id(model.tok_embeddings.weight), *(id(layer.attention.kv_cache.k) for layer in model.layers),
                idx.shape, input_pos.shape)

    def bind(self, model, idx: Tensor, input_pos: Tensor) -> None:
        self.tensors = None
        key = step_key(model, idx, input_pos)
        if key not in self.loaders:
            path = package_dir() / f"{key}.pt2"
            loader = load_package(path) if path.is_file() else None
            if loader is None:
                compile_package(model, idx, input_pos, path)
                loader = load_package(path)
                self.compiled += 1
            else:
                self.loaded += 1
            self.loaders[key] = loader
        self.loader, self.tensors = self.loaders[key], step_inputs(model)[1]
        self.bound = self.fingerprint(model, idx, input_pos)

    def __call__(self, model, idx: Tensor, input_pos: Tensor) -> Tensor:
        if self.fingerprint(model, idx, input_pos) != self.bound:
            self.bind(model, idx, input_pos)
        return self.loader.run([*self.tensors, idx, input_pos])[0]
