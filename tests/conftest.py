import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO / "build" / "inductor-cache"))

def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (scripts/gpu_check.sh runs these: pytest -m cuda)")


def pytest_collection_modifyitems(config, items):
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
    from engine import compile_steps, generate
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


# The reference implementations (tests/reference/) name parameters as the old command line did; the engine's
# policies name them as their dataclass fields. One table translates, per family; a parameter the policy lacks
# is dropped (the references share one parameter dict between policies).
LEGACY_NAMES = {
    "kvec": dict(kvec_lambda="lam", kvec_delta="delta", kvec_beta="beta", kvec_window="window",
                 kvec_obs_window="obs_window", kvec_long_window="long_window", kvec_kernel="kernel",
                 kvec_pin_value="pin_value"),
    "snapkv++": dict(snap_window="window", rocket_kernel="kernel", rocket_local_window="local_window"),
    "snapkv": dict(snap_window="window", snap_kernel="kernel"),
    "sagekv": dict(sage_sink="sink", sage_topk="topk", sage_skip_if_fits="skip_if_fits"),
    "": dict(tova_heads="heads", tova_keep_last="keep_last"),
}


def make_policy(name, params: dict | None = None):
    """The engine's policy `name` (or class; None for full) from a reference-style parameter dict."""
    import dataclasses
    import policies
    if name == "full":
        return None
    cls = policies.REGISTRY[name] if isinstance(name, str) else name
    if issubclass(cls, policies.KVec):
        table = LEGACY_NAMES["kvec"]
    elif issubclass(cls, policies.SnapKVPlusPlus):
        table = LEGACY_NAMES["snapkv++"]
    elif issubclass(cls, policies.SnapKV):
        table = LEGACY_NAMES["snapkv"]
    elif issubclass(cls, policies.SageKV):
        table = LEGACY_NAMES["sagekv"]
    else:
        table = LEGACY_NAMES[""]
    fields = {f.name for f in dataclasses.fields(cls)}
    kw = {}
    for key, value in (params or {}).items():
        key = table.get(key, key)
        if key in fields:
            kw[key] = value
    return cls(**kw)
