"""The CPU decode step compiled ahead of time (aoti.py): eager's tokens for every kind of packaged state, a batch,
and a package key that changes with everything the traced step depends on."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import aoti
import kernels
import policies
from conftest import REPO
from engine import generate, generate_batch, prefill_protocol, setup, setup_batch
from runtime import model_step, prefill_step
from loading import load_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    """A fresh package folder for this module: every first bind here compiles."""
    d = tmp_path_factory.mktemp("aot-steps")
    old = os.environ.get("BUDGETKV_AOT_DIR")
    os.environ["BUDGETKV_AOT_DIR"] = str(d)
    yield d
    if old is None:
        del os.environ["BUDGETKV_AOT_DIR"]
    else:
        os.environ["BUDGETKV_AOT_DIR"] = old


@pytest.fixture(scope="module")
def tiny(hf_tiny):
    return load_model(hf_tiny("llama")[1], torch.float32, "cpu")


PROMPT = torch.randint(0, 512, (90,), generator=torch.Generator().manual_seed(3)).tolist()
CLI_CODE = ("import sys, json, io, contextlib; sys.argv = ['generate.py'] + sys.argv[1:]; import generate; "
            "out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out): rc = generate.main(sys.argv[1:])\n"
            "r = json.loads(out.getvalue()); print(json.dumps({'rc': rc, 'text': r['text'], "
            "'cache': r['compile_cache'], 'mode': r['compile_mode'], "
            "'dynamo': 'torch._dynamo' in sys.modules, 'inductor': 'torch._inductor' in sys.modules}))")


@pytest.fixture(scope="module")
def cli_argv(hf_tiny, tmp_path_factory):
    """generate.py's arguments for h2o at budget 40, block 8, one thread, over the tiny model with a small tokenizer:
    the setting of the package cli_runs builds and the command-line tests below load."""
    from conftest import with_tiny_tokenizer
    corpus = "the quick brown fox jumps over the lazy dog"
    ckpt = with_tiny_tokenizer(hf_tiny("llama")[1], tmp_path_factory.mktemp("ckpt"), corpus)
    return ["--checkpoint", str(ckpt), "--prompt", f"{corpus} " * 6, "--max-new-tokens", "5", "--policy", "h2o",
            "--budget", "40", "--block-size", "8", "--json", "--threads", "1"]


@pytest.fixture(scope="module")
def cli_runs(cli_argv, packages):
    """generate.py --compile on CPU in a fresh process, twice, then without --compile in this one (cli_argv), so
    that its package is the one the h2o-40 case below loads (the key holds no prompt length, new-token count or
    checkpoint path). What each run printed and, for the compiled runs, which modules it imported."""
    argv = cli_argv
    env = {**os.environ, "BUDGETKV_AOT_DIR": str(packages)}
    runs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", CLI_CODE, *argv, "--compile"], capture_output=True, text=True,
                           env=env, cwd=REPO, timeout=600)
        assert r.returncode == 0, r.stderr
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    import contextlib
    import io

    import generate
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert generate.main(argv) == 0
    return runs + [json.loads(out.getvalue())]


def run(model, spec: str, budget: int, step, n: int = 12, kv_dtype=None) -> list[int]:
    policy = policies.make(spec)
    prefill = prefill_protocol(policy, None)
    setup(model, policy, budget, len(PROMPT), n, 8, prefill=prefill, kv_dtype=kv_dtype)
    with torch.inference_mode():
        return generate(model, PROMPT, n, block_size=8, steps=(prefill_step, step), one_shot=prefill == "one-shot")[0]


# Each kind of state a package takes as inputs and writes in place: block-wise eviction with per-slot state (H2O,
# whose package generate.py --compile built in cli_runs: loaded here); a one-shot compression, then a selector that
# appends and updates per-layer state (RocketKV's pages: SnapKV's ring is per-layer state too). A batch that evicts
# in a bfloat16 cache under fp32 weights: batch_package below. test_conformance proves every policy's compiled step
# eager's.
@pytest.mark.parametrize("spec,budget,built_by_cli", [("h2o", 40, True), ("rocketkv", 64, False)],
                         ids=["h2o-40", "rocketkv-64"])
def test_packaged_step_generates_eager_tokens(tiny, packages, cli_runs, spec, budget, built_by_cli, recwarn):
    step = aoti.AotStep()
    assert run(tiny, spec, budget, step) == run(tiny, spec, budget, model_step)
    assert (step.compiled, step.loaded) == ((0, 1) if built_by_cli else (1, 0))
    # the Python API's compile=True showed torch's FutureWarning from inside the compile on stderr
    assert [str(w.message) for w in recwarn if issubclass(w.category, FutureWarning)] == []
    # a second step on the same state loads the package instead of compiling it
    again = aoti.AotStep()
    assert run(tiny, spec, budget, again) == run(tiny, spec, budget, model_step)
    assert (again.compiled, again.loaded) == (0, 1)


def test_a_step_rebinds_when_setup_makes_new_caches(tiny, packages):
    """One step object across runs of different policies and budgets: each run's caches get their own package, and
    the tensors of the first are not written; the first state again binds the new caches to its loaded package."""
    step = aoti.AotStep()
    a = run(tiny, "h2o", 40, step)
    b = run(tiny, "rocketkv", 64, step)
    assert b == run(tiny, "rocketkv", 64, model_step) and a == run(tiny, "h2o", 40, model_step)
    assert step.compiled + step.loaded == 2 and len(step.loaders) == 2
    assert run(tiny, "h2o", 40, step) == a and step.compiled + step.loaded == 2


@pytest.fixture(scope="module")
def batch_package(tiny, packages):
    """A ragged batch of 3 under KeyDiff at budget 40 (the longest prompt past it) in a bfloat16 cache under fp32
    weights, its decode step packaged here: (the packaged step's tokens, the eager step's, the step's (compiled,
    loaded) binds). The command line's batch below has this state, so it loads this package."""
    prompts = [PROMPT, PROMPT[:50], PROMPT[20:75]]

    def batch(step):
        setup_batch(tiny, policies.make("keydiff"), 40, [len(p) for p in prompts], 8, 8, kv_dtype=torch.bfloat16)
        with torch.inference_mode():
            return generate_batch(tiny, prompts, 8, block_size=8, steps=(prefill_step, step))[0]
    step = aoti.AotStep()
    packaged = batch(step)
    assert tiny.layers[0].attention.kv_cache.k.dtype == torch.bfloat16
    return packaged, batch(model_step), (step.compiled, step.loaded)


def test_batch_step_generates_each_sequences_tokens(batch_package):
    """A ragged batch that evicts, in a bfloat16 cache under fp32 weights (the row-wise attention widens it in its
    loop): each sequence's eager tokens, from a package compiled here."""
    packaged, eager, binds = batch_package
    assert packaged == eager and binds == (1, 0)


def main_compiled(argv: list) -> tuple[int, int]:
    """generate.main(argv) under error_on_recompile, from a clean dynamo (graphs an earlier test in this process
    compiled would count as recompiles); its exit code and the dynamo graphs it compiled. Resets dynamo, inductor's
    freezing flag and the layer regions afterwards."""
    import generate
    from model import set_layer_regions
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            return generate.main(argv), counters["stats"]["unique_graphs"]
    finally:
        torch._inductor.config.freezing = False
        set_layer_regions(True)
        torch._dynamo.reset()


def test_compiled_batch_run_never_recompiles(cli_argv, packages, batch_package, capsys):
    """--compile warms a batch's steps up with the shapes generate_batch passes ([B, block] and [B, 1], positions
    per sequence): no recompile afterwards, and the compiled batch generates what the eager one does. Three ragged
    prompts under KeyDiff at budget 40 in a bfloat16 cache, the longest past it: batch_package's state, so the
    command line loads that package (built in another context: the key is the traced state's) and writes none."""
    import generate
    words = "the quick brown fox jumps over the lazy dog ".split()
    argv = [*cli_argv[:2], "--max-new-tokens", "6", "--json", "--policy", "keydiff", "--budget", "40",
            "--block-size", "8", "--dtype", "float32", "--kv-dtype", "bfloat16", "--threads", "1"]
    for n in (60, 7, 30):
        argv += ["--prompt", " ".join(words[i % len(words)] for i in range(n))]
    packaged = {p: p.stat().st_mtime_ns for p in packages.glob("*.pt2")}
    code, unique_graphs = main_compiled(argv + ["--compile", "--compile-prefill"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert unique_graphs == 1  # the prefill step's; the decode step is compiled ahead of time
    compiled = json.loads(out)["sequences"]
    assert max(x["prompt_tokens"] for x in compiled) > 40  # it evicts
    assert {p: p.stat().st_mtime_ns for p in packages.glob("*.pt2")} == packaged  # batch_package's, loaded
    assert generate.main(argv) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["sequences"] == compiled


def test_the_key_follows_the_traced_state(tiny, tmp_path, monkeypatch):
    """Every input that changes the traced step changes the package's name: a policy parameter, the budget, the
    batch, the cache's dtype, the thread count, inductor's kernel profiling, the attention form, the CPU's
    instruction sets, a source file a step runs; the same state gives the same key, whatever the prompt's length or
    a change to the command line's module."""
    def key(spec="keydiff", budget=40, batch=1, prompt_len=len(PROMPT), kv_dtype=None):
        policy = policies.make(spec)
        if batch == 1:
            setup(tiny, policy, budget, prompt_len, 8, 8, kv_dtype=kv_dtype)
        else:
            setup_batch(tiny, policy, budget, [prompt_len] * batch, 8, 8)
        return aoti.step_key(tiny, torch.zeros(batch, 1, dtype=torch.long), torch.zeros(batch, dtype=torch.long))
    base = key()
    assert key() == base
    assert key(prompt_len=60) == base  # the prompt's length is not part of a block-wise policy's decode step
    others = [key("keydiff:window_frac=0.5"), key(budget=48), key(batch=2), key("tova"),
              key(kv_dtype=torch.bfloat16)]
    n = torch.get_num_threads()
    torch.set_num_threads(n + 1)
    try:
        others.append(key())
    finally:
        torch.set_num_threads(n)
    from torch._inductor import config as inductor_config
    with inductor_config.patch({"cpp.enable_kernel_profile": True}):  # bench_paired --profile's named kernels
        others.append(key())
    with monkeypatch.context() as m:
        m.setattr(kernels, "FORM", "sdpa")  # BUDGETKV_ATTENTION=sdpa
        others.append(key())
    assert aoti.cpu_features().startswith(f"cpu {torch.backends.cpu.get_cpu_capability()}, flags ")
    with monkeypatch.context() as m:  # the same build folder on a host with other instruction sets
        m.setattr(aoti, "cpu_features", lambda: "cpu AVX2, flags 0123456789abcdef")
        others.append(key())
    src = tmp_path / "src"
    src.mkdir()
    for p in aoti.ROOT.glob("*.py"):
        (src / p.name).write_bytes(p.read_bytes())
    monkeypatch.setattr(aoti, "ROOT", src)
    (src / "generate.py").write_text((src / "generate.py").read_text() + "\n# a change\n")
    assert key() == base  # a module no step runs
    (src / "policies.py").write_text((src / "policies.py").read_text() + "\n# a change\n")
    others.append(key())
    assert len({base, *others}) == len(others) + 1


def test_a_failed_compile_leaves_no_package(tiny, tmp_path, monkeypatch):
    """A compile that fails part-way (here: the packager raising) leaves nothing a later run would load."""
    import torch._inductor
    monkeypatch.setenv("BUDGETKV_AOT_DIR", str(tmp_path))

    def fail(ep, package_path):
        with open(package_path, "wb") as f:
            f.write(b"half")
        raise RuntimeError("compiler crashed")
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", fail)
    with pytest.raises(RuntimeError, match="compiler crashed"):
        run(tiny, "keydiff", 40, aoti.AotStep())
    assert list(tmp_path.iterdir()) == []


def test_the_fork_is_awaited_not_the_processes_it_started(tmp_path):
    """in_fork returns when its fork exits, though a process the fork started still holds their pipe (a compiler's
    worker); the fork's error comes back as one line."""
    import threading
    release_r, release_w = os.pipe()

    def start_a_lingering_process():
        if os.fork() == 0:  # holds every descriptor of the fork, the report pipe's writing end among them
            os.read(release_r, 1)
            os._exit(0)
    done = []
    waiter = threading.Thread(target=lambda: done.append(aoti.in_fork(start_a_lingering_process)), daemon=True)
    waiter.start()
    waiter.join(60)
    os.write(release_w, b"x")
    assert done == [None], "in_fork waited for a process its fork started"

    def fail():
        raise ValueError("bad\nshape")
    with pytest.raises(RuntimeError, match="compiling the decode step failed in its process: ValueError: bad"):
        aoti.in_fork(fail)


def test_no_run_imports_the_compiler(cli_runs):
    """generate.py --compile on CPU: the first run compiles the package (in a fork of its process, aoti.in_fork),
    the second loads it; neither run's own process ever imports dynamo or inductor, so none keeps the compiler's
    memory, and both generate eager's text."""
    cold, warm, eager = cli_runs
    assert (cold["cache"], warm["cache"], cold["mode"]) == ("miss", "hit", "aot")
    assert cold["text"] == warm["text"] == eager["text"]
    assert not any(run[m] for run in (cold, warm) for m in ("dynamo", "inductor"))


@pytest.mark.parametrize("flag,prefill,compile_prefill", [(["--compile-prefill"], "block", True),
                                                         ([], "block", False),
                                                         ([], "one-shot", False),
                                                         (["--freeze"], "block", False)],
                         ids=["both-steps", "decode-only", "one-shot", "frozen"])
def test_compiled_run_never_recompiles(cli_argv, cli_runs, packages, capsys, flag, prefill, compile_prefill):
    """--compile warms the steps up with the shapes and strides generation uses: no recompile afterwards.
    On CPU the default compiles the decode step alone, ahead of time (no dynamo graph; prefill eager) and generates
    the same text; --compile-prefill adds torch.compile's prefill graph; one-shot prefill never runs the block
    step, so it is not compiled (and --compile-prefill is refused there); --freeze is torch.compile's. At cli_runs's
    setting, whose package every run here loads (no new one in the folder), and a prompt longer than the budget."""
    import generate
    argv = cli_argv + ["--prefill", prefill]
    packaged = sorted(packages.glob("*.pt2"))
    code, unique_graphs = main_compiled(argv + ["--compile"] + flag)
    out, err = capsys.readouterr()
    assert code == 0, err
    frozen = "--freeze" in flag
    # the dynamo graphs: the prefill step if compiled, the decode step if frozen; nothing else
    assert unique_graphs == compile_prefill + frozen
    stats = json.loads(out)
    assert stats["generated_tokens"] == 5 and stats["compiled_prefill"] is compile_prefill
    assert stats["prompt_tokens"] > 40 and sorted(packages.glob("*.pt2")) == packaged  # it evicts; a loaded package
    # --compile-mode auto on CPU, fp32: the packed GEMM templates of max-autotune where the weights are frozen
    assert stats["compile_mode"] == ("max-autotune-no-cudagraphs" if frozen else "aot")
    assert stats["frozen"] is frozen
    assert generate.main(argv) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["text"] == stats["text"]  # the compiled kernels generate what eager does


@pytest.fixture(scope="module")
def built(tiny, packages):
    """Two real packages with their records, copied from the module's folder: the tiny model's h2o-40 step (the cases
    below copy it, and their compiles copy it instead of compiling again) and its rocketkv-64 step (another setting's
    package). Also eager's tokens. Both are the module's (test_packaged_step_generates_eager_tokens compiled them:
    loaded here)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # as under one_thread: the thread count is part of the key
    try:
        paths = []
        for spec, budget in (("h2o", 40), ("rocketkv", 64)):
            step = aoti.AotStep()
            run(tiny, spec, budget, step)
            (key,) = step.loaders
            paths.append(packages / f"{key}.pt2")
        want = run(tiny, "h2o", 40, model_step)
    finally:
        torch.set_num_threads(n)
    own, theirs = paths
    return own, theirs, want


@pytest.fixture
def copies(built, tmp_path, monkeypatch):
    """The package folder of a case, holding the own package under its key; a compile copies the own package; every
    load is recorded by the sha256 of what it loaded."""
    import shutil
    import torch._inductor
    own, _, _ = built
    folder = tmp_path / "aot"
    folder.mkdir()
    for p in (own, aoti.record_path(own)):
        shutil.copyfile(p, folder / p.name)
    monkeypatch.setenv("BUDGETKV_AOT_DIR", str(folder))
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package",
                        lambda ep, package_path: shutil.copyfile(own, package_path))
    loaded, load = [], aoti.load_package
    monkeypatch.setattr(aoti, "load_package", lambda path: loaded.append(aoti.file_sha256(path)) or load(path))
    return folder / own.name, loaded


def damage_in_place(path):
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def swap_in_theirs_with_its_record(path, theirs):
    path.write_bytes(theirs.read_bytes())
    aoti.record_path(path).write_bytes(aoti.record_path(theirs).read_bytes())


def record_a_package_torch_cannot_load(path, theirs):
    path.write_bytes(b"PK\x03\x04 not a package")
    record = json.loads(aoti.record_path(path).read_text())
    aoti.record_path(path).write_text(json.dumps(record | {"sha256": aoti.file_sha256(path),
                                                           "bytes": path.stat().st_size}))


def grown_sparse(path, theirs):  # a hole past its end: gigabytes to hash, a few bytes on disk
    os.truncate(path, path.stat().st_size + 2 ** 34)


def cut_short_without_record(path, theirs):
    path.write_bytes(path.read_bytes()[:100])
    aoti.record_path(path).unlink()


TAMPERED = {  # what was done to the key's package -> the reason printed
    "another package under the key's name, the key's record kept": (
        lambda path, theirs: path.write_bytes(theirs.read_bytes()), "damaged or replaced"),
    "another setting's package with its record, both under the key's name": (
        swap_in_theirs_with_its_record, "built for another model or setting"),
    "bytes damaged in place, same size": (lambda path, theirs: damage_in_place(path), "damaged or replaced"),
    "no record": (lambda path, theirs: aoti.record_path(path).unlink(), "no readable record"),
    "a record that is not JSON": (lambda path, theirs: aoti.record_path(path).write_text("{"), "no readable record"),
    "a recorded package that torch cannot load": (record_a_package_torch_cannot_load, "torch could not load it"),
    "a package cut short, no record": (cut_short_without_record, "no readable record"),
    "a package grown sparse past 16 GiB, its record kept": (grown_sparse, "damaged or replaced"),
}


@pytest.mark.parametrize("case", TAMPERED)
def test_an_untrusted_package_is_compiled_again_never_loaded(tiny, built, copies, case, capsys, monkeypatch):
    """A package whose record does not vouch for it is never handed to torch's loader (a damaged one aborts the
    process there): one line says why, a compile replaces it, and the next run loads the replacement."""
    own, theirs, want = built
    path, loaded = copies
    tamper, why = TAMPERED[case]
    tamper(path, theirs)
    bad = aoti.file_sha256(path) if path.stat().st_size < 2 ** 30 else None  # the sparse one: never hashed
    hashed = []
    file_sha256 = aoti.file_sha256
    monkeypatch.setattr(aoti, "file_sha256", lambda p: hashed.append(p.stat().st_size) or file_sha256(p))
    step = aoti.AotStep()
    assert run(tiny, "h2o", 40, step) == want and (step.compiled, step.loaded) == (1, 0)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and why in lines[0] and "compiling it again" in lines[0]
    assert all(size < 2 ** 30 for size in hashed)  # nothing past the recorded size is read
    good = aoti.file_sha256(own)
    assert aoti.file_sha256(path) == good and aoti.package_problem(path, path.stem, json.loads(
        aoti.record_path(own).read_text())["built_from"]) is None
    again = aoti.AotStep()
    assert run(tiny, "h2o", 40, again) == want and (again.compiled, again.loaded) == (0, 1)
    torch_loaded = [d for d in loaded if d != good]
    assert torch_loaded == ([bad] if why == "torch could not load it" else [])  # only a recorded one reaches torch


def read_only(folder, monkeypatch):
    folder.chmod(0o555)
    if os.geteuid() == 0:  # root writes through the mode bits: the OS's refusal, as a user gets it
        import errno
        import tempfile

        def refuse(*a, dir=None, **k):
            raise PermissionError(errno.EACCES, "Permission denied")
        monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
    return folder


@pytest.mark.parametrize("where", ["read-only folder", "a file in the way"])
def test_an_unwritable_package_folder_is_found_before_compiling(tiny, built, copies, where, tmp_path, monkeypatch,
                                                                capsys):
    """The compiled step runs without being saved, one line naming the folder, said before the compile."""
    _, _, want = built
    folder = tmp_path / "ro"
    folder.mkdir()
    if where == "read-only folder":
        read_only(folder, monkeypatch)
    else:
        (folder / "file").write_text("")
        folder = folder / "file" / "aot"
    monkeypatch.setenv("BUDGETKV_AOT_DIR", str(folder))
    said_before = []
    monkeypatch.setattr(aoti, "in_fork", lambda fn, build=aoti.in_fork: said_before.append(
        capsys.readouterr().err) or build(fn))  # the compile's start
    step = aoti.AotStep()
    try:
        assert run(tiny, "h2o", 40, step) == want and step.compiled == 1
    finally:
        (tmp_path / "ro").chmod(0o755)
    assert len(said_before) == 1 and f"cannot write compiled steps in {folder}" in said_before[0]
    assert said_before[0].count("\n") == 1 and capsys.readouterr().err == ""
    assert list((tmp_path / "ro").rglob("*.pt2")) == []


@pytest.mark.parametrize("failing", ["package", "record"])
def test_a_full_disk_during_the_save_runs_the_step_unsaved(tiny, built, copies, failing, monkeypatch, capsys):
    """The save fails (no space): the compiled step runs anyway, one line names the file and the folder, nothing
    half-written stays, and what stays is never loaded (the next run compiles again)."""
    import errno
    import pathlib
    import shutil
    _, _, want = built
    path, _ = copies
    path.unlink()
    aoti.record_path(path).unlink()

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    with monkeypatch.context() as m:
        if failing == "package":
            m.setattr(aoti.shutil, "copyfile", lambda src, dst, copy=shutil.copyfile: full() if Path(
                dst).parent == path.parent else copy(src, dst))
        else:
            m.setattr(pathlib.Path, "write_text", full)
        step = aoti.AotStep()
        assert run(tiny, "h2o", 40, step) == want and step.compiled == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "No space left on device" in lines[0] and str(path.parent) in lines[0]
    assert sorted(p.name for p in path.parent.iterdir()) == ([] if failing == "package" else [path.name])
    again = aoti.AotStep()
    assert run(tiny, "h2o", 40, again) == want and (again.compiled, again.loaded) == (1, 0)
