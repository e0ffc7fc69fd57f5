"""The CPU decode step compiled ahead of time (aoti.py): eager's tokens for every kind of policy, a batch, and a
package key that changes with everything the traced step depends on."""
import os
import subprocess
import sys

import pytest
import torch

import aoti
import policies
from conftest import REPO
from engine import generate, generate_batch, load_model, model_step, prefill_protocol, prefill_step, setup, setup_batch

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


def run(model, spec: str, budget: int, step, n: int = 12, kv_dtype=None) -> list[int]:
    policy = policies.make(spec)
    prefill = prefill_protocol(policy, None)
    setup(model, policy, budget, len(PROMPT), n, 8, prefill=prefill, kv_dtype=kv_dtype)
    with torch.inference_mode():
        return generate(model, PROMPT, n, block_size=8, steps=(prefill_step, step), one_shot=prefill == "one-shot")[0]


# block-wise eviction; per-slot state (H2O); per-layer state (SnapKV's ring of queries); a selector that appends
# after a one-shot compression and keeps pages (RocketKV); a one-shot layout of its own (SAGE-KV); no eviction
@pytest.mark.parametrize("spec,budget", [("keydiff", 40), ("h2o", 40), ("snapkv", 48), ("rocketkv", 64),
                                         ("sagekv", 64), ("full", 110)])
def test_packaged_step_generates_eager_tokens(tiny, packages, spec, budget):
    step = aoti.AotStep()
    assert run(tiny, spec, budget, step) == run(tiny, spec, budget, model_step)
    assert (step.compiled, step.loaded) == (1, 0)
    # a second step on the same state loads the package instead of compiling it
    again = aoti.AotStep()
    assert run(tiny, spec, budget, again) == run(tiny, spec, budget, model_step)
    assert (again.compiled, again.loaded) == (0, 1)


def test_bf16_kv_step_generates_eager_tokens(tiny, packages):
    """A bfloat16 cache under fp32 weights (the row-wise attention widens it in its loop) has a package of its own."""
    step = aoti.AotStep()
    assert run(tiny, "full", 110, step, kv_dtype=torch.bfloat16) == run(tiny, "full", 110, model_step,
                                                                         kv_dtype=torch.bfloat16)
    assert tiny.layers[0].attention.kv_cache.k.dtype == torch.bfloat16 and step.compiled == 1


def test_a_step_rebinds_when_setup_makes_new_caches(tiny, packages):
    """One step object across two runs of different budgets: the second run's caches get their own package, and the
    tensors of the first are not written."""
    step = aoti.AotStep()
    a = run(tiny, "keydiff", 40, step)
    b = run(tiny, "keydiff", 48, step)
    assert b == run(tiny, "keydiff", 48, model_step) and a == run(tiny, "keydiff", 40, model_step)
    assert step.compiled + step.loaded == 2 and len(step.loaders) == 2


def test_batch_step_generates_each_sequences_tokens(tiny, packages):
    prompts = [PROMPT, PROMPT[:50], PROMPT[20:75]]
    policy = policies.make("keydiff")

    def batch(step):
        setup_batch(tiny, policy, 32, [len(p) for p in prompts], 8, 8)
        with torch.inference_mode():
            return generate_batch(tiny, prompts, 8, block_size=8, steps=(prefill_step, step))[0]
    assert batch(aoti.AotStep()) == batch(model_step)


def test_the_key_follows_the_traced_state(tiny, tmp_path, monkeypatch):
    """Every input that changes the traced step changes the package's name: a policy parameter, the budget, the
    batch, the thread count, a source file a step runs; the same state gives the same key, whatever the prompt's
    length or a change to the command line's module."""
    def key(spec="keydiff", budget=40, batch=1, prompt_len=len(PROMPT)):
        policy = policies.make(spec)
        if batch == 1:
            setup(tiny, policy, budget, prompt_len, 8, 8)
        else:
            setup_batch(tiny, policy, budget, [prompt_len] * batch, 8, 8)
        return aoti.step_key(tiny, torch.zeros(batch, 1, dtype=torch.long), torch.zeros(batch, dtype=torch.long))
    base = key()
    assert key() == base
    assert key(prompt_len=60) == base  # the prompt's length is not part of a block-wise policy's decode step
    others = [key("keydiff:window_frac=0.5"), key(budget=48), key(batch=2), key("tova")]
    n = torch.get_num_threads()
    torch.set_num_threads(n + 1)
    try:
        others.append(key())
    finally:
        torch.set_num_threads(n)
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


def test_a_warm_run_imports_no_compiler(hf_tiny, tmp_path):
    """generate.py --compile on CPU: the first run compiles the package, the second loads it and never imports
    dynamo or inductor, and both generate eager's text."""
    code = ("import sys, json, io, contextlib; sys.argv = ['generate.py'] + sys.argv[1:]; import generate; "
            "out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out): rc = generate.main(sys.argv[1:])\n"
            "r = json.loads(out.getvalue()); print(json.dumps({'rc': rc, 'text': r['text'], "
            "'cache': r['compile_cache'], 'mode': r['compile_mode'], "
            "'dynamo': 'torch._dynamo' in sys.modules, 'inductor': 'torch._inductor' in sys.modules}))")
    from conftest import with_tiny_tokenizer
    ckpt = with_tiny_tokenizer(hf_tiny("llama")[1], tmp_path / "ckpt", "the quick brown fox jumps over the lazy dog")
    argv = ["--checkpoint", str(ckpt), "--prompt", "the quick brown fox jumps over the lazy dog " * 3,
            "--max-new-tokens", "5", "--policy", "keydiff", "--budget", "16", "--block-size", "4", "--json",
            "--threads", "1"]
    env = {**os.environ, "BUDGETKV_AOT_DIR": str(tmp_path / "aot-steps")}
    runs = []
    for extra in (["--compile"], ["--compile"], []):
        r = subprocess.run([sys.executable, "-c", code, *argv, *extra], capture_output=True, text=True, env=env,
                           cwd=REPO, timeout=400)
        assert r.returncode == 0, r.stderr
        import json
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    cold, warm, eager = runs
    assert (cold["cache"], warm["cache"], cold["mode"]) == ("miss", "hit", "aot")
    assert cold["text"] == warm["text"] == eager["text"]
    assert not warm["dynamo"] and not warm["inductor"] and cold["inductor"]


def test_a_damaged_package_is_compiled_again(tiny, tmp_path, monkeypatch):
    """A package file that cannot be loaded (truncated on disk, say) is replaced by a fresh compile, not trusted."""
    monkeypatch.setenv("BUDGETKV_AOT_DIR", str(tmp_path))
    want = run(tiny, "tova", 40, model_step)
    policy = policies.make("tova")
    setup(tiny, policy, 40, len(PROMPT), 12, 8)
    key = aoti.step_key(tiny, torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    (tmp_path / f"{key}.pt2").write_bytes(b"not a package")
    step = aoti.AotStep()
    assert run(tiny, "tova", 40, step) == want and (step.compiled, step.loaded) == (1, 0)
    again = aoti.AotStep()
    assert run(tiny, "tova", 40, again) == want and (again.compiled, again.loaded) == (0, 1)
