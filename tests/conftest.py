import os
import sys
from pathlib import Path

# The suite keeps both cores busy (`pytest -n 2`, and the processes its tests start): every process runs one thread,
# fixed (runtime.THREADS takes OMP_NUM_THREADS as a fixed count), so that runs compare bit for bit and none spins
# beside another. The tests of the adaptive count set their own environment.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO / "build" / "inductor-cache"))
# `pytest -n 2` (the README's command): a core per worker. Inductor's pool of C++ compile processes (each imports
# torch) would only contend: kernels compile in the process that compiles (and in its children, which inherit it).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# `pytest -n 2 --dist loadfile` hands each worker the next file when it is almost done with its own. The files that
# compile cold graphs or start many processes go first, longest first (a cold run here), the rest after them in their
# order: the two workers then end within seconds of each other. (xdist's own order, most tests first, left a
# 36-second file for the end.)
LONGEST_FIRST = ["test_conformance.py", "test_tp.py", "test_cli.py", "test_aoti.py", "test_gpu_check.py",
                 "test_speculative.py", "test_flex_attention.py", "test_chat.py", "test_resume.py",
                 "test_frontier.py", "test_batch.py", "test_kv_int8.py", "test_quantize.py", "test_smollm2.py",
                 "test_engine.py", "test_kernels.py", "test_staleness.py", "test_random_weights.py",
                 "test_bench_attention.py", "test_eval_tasks.py", "test_smollm2_policies.py"]


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (scripts/gpu_check.sh runs these: pytest -m cuda)")
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: a file's tests keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


# Tiny configs of each family, as HF config.json dicts (transformers builds the reference model from them).
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0)
FAMILIES = {
    "llama": dict(TINY, model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=False),
    "llama31": dict(TINY, model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=False,
                    rope_theta=500000.0,
                    # original context 64, so a 300-token prompt runs far past it (all three frequency bands used)
                    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_position_embeddings=64)),
    "qwen2": dict(TINY, model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True,
                  rope_theta=1000000.0, use_sliding_window=False),
    "mistral": dict(TINY, model_type="mistral", architectures=["MistralForCausalLM"], tie_word_embeddings=False,
                    sliding_window=48),
    # 1,000+ distinct token ids fit: no two layer-0 keys share a pre-RoPE key, so KeyL2Norm has no exact ties for
    # RoPE rounding to break differently in the engine and the reference (tests/test_policy_reference.py)
    "llama_vocab2k": dict(TINY, model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=False,
                          vocab_size=2048),
}


def env_with_tmpdir(tmp_path: Path) -> dict:
    """This environment with TMPDIR at tmp_path (a child's logs land there, not in the machine's /tmp), sharing
    inductor's precompiled C++ headers: they live under the temporary folder (torchinductor_<user>), machine-wide as
    on a user's machine; a child under an empty TMPDIR would build them again (15-20 s each here)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    shared = Path(default_cache_dir())
    shared.mkdir(parents=True, exist_ok=True)
    (tmp_path / shared.name).symlink_to(shared, target_is_directory=True)
    return {**os.environ, "TMPDIR": str(tmp_path)}


def make_hf_checkpoint(family: str, out_dir: Path, seed: int = 0):
    """Random-initialised HF model of `family`, saved as safetensors; returns (the HF model, out_dir)."""
    transformers = pytest.importorskip("transformers")
    cfg = dict(FAMILIES[family])
    config_cls = transformers.AutoConfig.for_model(cfg.pop("model_type"), **{k: v for k, v in cfg.items()})
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config_cls, attn_implementation="eager").float().eval()
    with torch.no_grad():  # HF's default init is tiny (std 0.02); widen it so differences would show in logits
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.normal_(0, 0.08)
    hf.save_pretrained(out_dir, safe_serialization=True)
    return hf, out_dir


def with_tiny_tokenizer(src: Path, dst: Path, corpus: str) -> Path:
    """Copy a tiny checkpoint and add a small byte-level BPE tokenizer.json trained here (vocab 400 < 512)."""
    import json
    import shutil
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    shutil.copytree(src, dst, dirs_exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<s>", "</s>"])
    tok.train_from_iterator([corpus] * 50, trainer)
    tok.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return dst


@pytest.fixture(scope="session")
def hf_tiny(tmp_path_factory):
    """family -> (hf_model, checkpoint dir), built once per session."""
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = make_hf_checkpoint(family, tmp_path_factory.mktemp(family))
        return cache[family]
    return get


@pytest.fixture
def tiny_config_dir(tmp_path):
    """A folder holding only a tiny llama config.json (--random-weights shapes; tied embeddings: the head must stay
    tied)."""
    import json
    d = tmp_path / "tiny"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(dict(FAMILIES["llama"], tie_word_embeddings=True)))
    return d


BOUNDED_RUNS = """
import json, resource, signal, sys, time
sys.path.insert(0, sys.argv[1])
import generate
signal.alarm(30)  # a run still going then is killed: its test fails instead of filling the machine's memory
for argv in json.loads(sys.argv[2]):
    peak, start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.monotonic()
    code = generate.main(argv)
    grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024
    print(json.dumps([code, time.monotonic() - start, grew]), flush=True)
    print("--- end of run", file=sys.stderr, flush=True)
"""


def bounded_runs(argvs: list[list[str]], **env) -> list[tuple]:
    """generate.py's main on each argv in turn, in one child that imports it once (env: added to its environment):
    per run (exit code, seconds, MiB its peak memory grew by, stderr). A run past 30 s kills the child."""
    import json
    import subprocess
    r = subprocess.run([sys.executable, "-c", BOUNDED_RUNS, str(REPO), json.dumps(argvs)], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    runs = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("[")]
    errs = r.stderr.split("--- end of run\n")
    assert r.returncode == 0 and len(runs) == len(argvs), r.stderr[-2000:]
    return [(*run, err) for run, err in zip(runs, errs)]


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls gain nothing from threads, and on a busy 2-core machine OpenMP spinning makes them ~50x slower.
    Test modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def generate_compiled(model, prompt, max_new_tokens: int, block_size: int, one_shot: bool = False,
                      device: str = "cpu") -> list:
    """generate() with both steps compiled (fullgraph=True, inductor) under error_on_recompile; resets dynamo and
    inductor's freezing flag afterwards so later tests start clean."""
    from engine import generate
    from runtime import compile_steps
    torch._dynamo.reset()
    steps = compile_steps(device)
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            out, _ = generate(model, prompt, max_new_tokens, block_size=block_size, steps=steps, one_shot=one_shot,
                              device=device)
    finally:
        torch._inductor.config.freezing = False
        torch._dynamo.reset()
    return out


def spy_on(cache):
    """Record, at every decode step of this engine cache, the positions each query head attends: the slots the
    policy selected (or all for dense attention), read from the cache's positions, where the mask lets them."""
    log = {"seen": [], "idx": None}
    update, gather = cache.update, cache.gather

    def gather_spy(idx, query_pos):
        log["idx"] = idx
        return gather(idx, query_pos)

    def update_spy(q, k, v, input_pos, query_pos):
        log["idx"] = None
        keys, values, mask = update(q, k, v, input_pos, query_pos)
        Hq, H = q.shape[1], cache.k.shape[1]
        g = Hq // H
        pos = cache.pos[0]
        if log["idx"] is None:
            rows = [pos[h // g, :keys.shape[2]][mask[0, h // g, 0]] for h in range(Hq)]
        else:  # one selection per query head (SAGE-KV) or per KV head, shared by its group (RocketKV)
            idx = log["idx"][0]
            rows = [pos[h // g][idx[r]][mask[0, r, 0]] for h in range(Hq) for r in [h if len(idx) == Hq else h // g]]
        seen = [r.tolist() for r in rows]
        assert all(len(set(s)) == len(s) for s in seen)
        log["seen"].append([sorted(s) for s in seen])
        return keys, values, mask

    cache.update, cache.gather = update_spy, gather_spy
    return log



def one_shot_equals_reference(model, ref, ids: list, new_tokens: int, block: int, what: str = "") -> None:
    """The engine (set up for a one-shot prefill) and a reference RefModel whose layers record `seen` side by side:
    one-shot prefill, then eager greedy decode steps on the engine's logits. The first token's logits, then at every
    step each (layer, query head)'s attended positions and the logits agree (atol 1e-4)."""
    from engine import prefill_one_shot
    from runtime import model_step
    logs = [spy_on(layer.attention.kv_cache) for layer in model.layers]
    T = len(ids)
    with torch.inference_mode():
        logits = prefill_one_shot(model, torch.tensor(ids), block)
        assert torch.allclose(logits[0], ref.block(ids, range(T)), atol=1e-4), f"{what} prefill logits"
        for p in range(T, T + new_tokens):
            tok = int(logits[0].argmax())
            logits = model_step(model, torch.tensor([[tok]]), torch.tensor([p]))
            ref_logits = ref.block([tok], [p])
            for layer, (log, rl) in enumerate(zip(logs, ref.layers)):
                assert log["seen"][-1] == rl.seen[-1], f"{what} layer {layer} position {p}: attended positions differ"
            err = (logits[0] - ref_logits).abs().max().item()
            assert err <= 1e-4, f"{what} position {p}: logits differ by {err:.3g}"

def make_policy(name, params: dict | None = None):
    """The engine's policy `name` (or class; None for full) with those of `params` (named as the policies' fields)
    that its class has: one dict can serve several policies, as the references share theirs."""
    import dataclasses
    import policies
    if name == "full":
        return None
    cls = policies.REGISTRY[name] if isinstance(name, str) else name
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(**{key: value for key, value in (params or {}).items() if key in fields})
