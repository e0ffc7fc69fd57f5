"""Bad input, generated, at every entry point of the engine: generate.py, scripts/quantize.py, scripts/download.py and
scripts/convert_hf_checkpoint.py (scripts/eval.py and scripts/bench.py: tests/test_fuzz_scripts.py, the same shape).

Each row of CASES is (id, entry point, argv, setup, exit code, a substring of the message). Every row must end
with exactly one line on stderr that starts with "error:" and holds the substring, the exit code (2 bad input,
1 environment), no "Traceback" anywhere, and nothing written where the command writes: no file under the test's
folder or the shared checkpoint is created or changed by a failing run. argv may name "{ckpt}" (the shared tiny
checkpoint: llama, 2 layers, context 256, a BPE tokenizer), "{bad}" (the copy that `setup` broke) and "{tmp}" (the
test's own folder). A new flag or entry point gets its bad values here. All in-process: no model is compiled.
"""
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

import generate
import generate_args
from scripts import convert_hf_checkpoint, download
from scripts import quantize as quantize_script

pytestmark = pytest.mark.usefixtures("one_thread")

ENTRY = {"generate": generate.main, "quantize": quantize_script.main, "download": download.main,
         "convert": convert_hf_checkpoint.main}
PROMPT = ["--prompt", "the quick brown fox", "--max-new-tokens", "2"]
NAN, INF = float("nan"), float("inf")
DROP = object()  # a config.json field to remove
DEEP, DEEP_OBJECT = "[" * 100_000 + "]" * 100_000, '{"a": ' * 100_000 + "1" + "}" * 100_000  # JSON nested 100,000 deep
NESTED = {"a": 1}
for _ in range(70):
    NESTED = {"a": NESTED}  # 71 levels: more than files.JSON_MAX_DEPTH, fewer than Python's recursion limit


@pytest.fixture(scope="module")
def tiny_ckpt(hf_tiny, tmp_path_factory):
    from conftest import with_tiny_tokenizer
    _, src = hf_tiny("llama")
    d = with_tiny_tokenizer(src, tmp_path_factory.mktemp("fuzz_ckpt"), "the quick brown fox jumps over the lazy dog")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, max_position_embeddings=256)))
    return d


# ------------------------------------------------------------------------------------------------ setups

def broken_copy(tmp: Path, ckpt: Path) -> Path:
    """tmp/bad: the tiny checkpoint with every file linked, so that a setup replaces only what it breaks."""
    bad = tmp / "bad"
    bad.mkdir()
    for f in ckpt.iterdir():
        (bad / f.name).symlink_to(f)
    return bad


def replace(bad: Path, name: str, content) -> None:
    f = bad / name
    if f.is_symlink() or f.is_file():
        f.unlink()
    if content is None:
        return
    if isinstance(content, dict | list):
        content = json.dumps(content)
    f.write_bytes(content if isinstance(content, bytes) else content.encode())


def config(**edits):
    """Setup: the checkpoint with config.json's fields set (DROP removes one)."""
    def setup(tmp, ckpt):
        bad = broken_copy(tmp, ckpt)
        cfg = json.loads((ckpt / "config.json").read_text())
        cfg.update(edits)
        replace(bad, "config.json", {k: v for k, v in cfg.items() if v is not DROP})
    return setup


def files(**contents):
    """Setup: the checkpoint with files replaced (bytes, str or JSON; None removes the file). Names use '__' for
    '.': tokenizer_config__json."""
    def setup(tmp, ckpt):
        bad = broken_copy(tmp, ckpt)
        for name, content in contents.items():
            replace(bad, name.replace("__", "."), content)
    return setup


def tok_config(**fields):
    return files(tokenizer_config__json={"bos_token": "<s>", "eos_token": "</s>", **fields})


def truncated_weights(tmp, ckpt):
    bad = broken_copy(tmp, ckpt)
    data = (ckpt / "model.safetensors").read_bytes()
    replace(bad, "model.safetensors", data[:len(data) // 2])


def deep_identity(tmp, ckpt):
    """An engine file (no source beside it) whose identity is JSON nested 100,000 levels deep."""
    from safetensors.torch import load_file, save_file
    bad = broken_copy(tmp, ckpt)
    replace(bad, "model.safetensors", None)
    save_file(load_file(str(ckpt / "model.safetensors")), str(bad / "budgetkv.safetensors"),
              metadata={"format": "budgetkv", "budgetkv_identity": DEEP})


def fifo_in(name: str):
    """Setup: the checkpoint's <name> is a named pipe (read, it would wait for a writer; skipped, a silent change)."""
    def setup(tmp, ckpt):
        bad = broken_copy(tmp, ckpt)
        replace(bad, name, None)
        os.mkfifo(bad / name)
    return setup


def missing_tensor(tmp, ckpt):
    from safetensors.torch import load_file, save_file
    bad = broken_copy(tmp, ckpt)
    tensors = load_file(str(ckpt / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    (bad / "model.safetensors").unlink()
    save_file(tensors, str(bad / "model.safetensors"))


def edited_tensor(name: str, edit):
    def setup(tmp, ckpt):
        from safetensors.torch import load_file, save_file
        bad = broken_copy(tmp, ckpt)
        tensors = load_file(str(ckpt / "model.safetensors"))
        tensors[name] = edit(tensors[name])
        (bad / "model.safetensors").unlink()
        save_file(tensors, str(bad / "model.safetensors"))
    return setup


def second_shard(tmp, ckpt):
    from safetensors.torch import save_file
    bad = broken_copy(tmp, ckpt)
    save_file({"model.norm.weight": torch.zeros(64)}, str(bad / "model-extra.safetensors"))


def converted(setup):
    """Setup: `setup`'s broken copy, converted in place (as generate.py would) before the command runs."""
    def run(tmp, ckpt):
        from convert import convert_hf_dir
        setup(tmp, ckpt)
        convert_hf_dir(tmp / "bad")
    return run


def int_engine_tensor(tmp, ckpt):
    """A converted copy whose engine file holds an int32 weight under the identity its conversion wrote."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    converted(broken_copy)(tmp, ckpt)
    engine = tmp / "bad" / "budgetkv.safetensors"
    with safe_open(str(engine), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    tensors["layers.0.feed_forward.w2.weight"] = tensors["layers.0.feed_forward.w2.weight"].to(torch.int32)
    save_file(tensors, str(engine), metadata=meta)


def gguf(name: str, **meta):
    """Setup: tmp/<name>, test_gguf_convert's 1-layer llama GGUF with those metadata values."""
    def setup(tmp, ckpt):
        from test_gguf_convert import write_tiny_llama
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        write_tiny_llama(tmp / name, meta=meta)
    return setup


def quantized_marker(marker):
    return config(budgetkv_quantization=marker)


def write(name: str, content):
    """Setup: tmp/<name> with content (bytes or str); a name ending in / is a directory."""
    def setup(tmp, ckpt):
        if name.endswith("/"):
            (tmp / name).mkdir(parents=True)
            return
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return setup


def symlink(name: str, target: str):
    """Setup: tmp/<name> -> tmp/<target> (which need not exist)."""
    def setup(tmp, ckpt):
        (tmp / name).symlink_to(tmp / target)
    return setup


def fifo(name: str):
    """Setup: tmp/<name> is a named pipe that nobody writes to."""
    def setup(tmp, ckpt):
        os.mkfifo(tmp / name)
    return setup


def prompt_of(n_tokens: int):
    """Setup: tmp/p.txt of exactly n_tokens under the checkpoint's tokenizer."""
    def setup(tmp, ckpt):
        from tokenizer import load_tokenizer
        tok = load_tokenizer(ckpt)
        text = "the"
        while len(tok.encode(text, add_bos=True)) < n_tokens:
            text += " fox"
        assert len(tok.encode(text, add_bos=True)) == n_tokens
        (tmp / "p.txt").write_text(text)
    return setup


def other_checkpoint(name: str, marker: dict | None = None):
    """Setup: tmp/<name> holds a model that is not this command's output."""
    def setup(tmp, ckpt):
        shutil.copytree(ckpt, tmp / name, symlinks=True)
        cfg = json.loads((ckpt / "config.json").read_text())
        (tmp / name / "config.json").unlink()
        (tmp / name / "config.json").write_text(json.dumps(dict(cfg, **(marker or {}))))
    return setup


def shapes_only(tmp, ckpt):
    """Setup: tmp/shapes holds the checkpoint's config.json alone (what --random-weights builds)."""
    (tmp / "shapes").mkdir()
    shutil.copy(ckpt / "config.json", tmp / "shapes")


def hf_dir_copy(tmp, ckpt):
    shutil.copytree(ckpt, tmp / "hf", symlinks=True)


# --------------------------------------------------------------------------------------------------- rows

def gen(id, extra, code, message, setup=None, checkpoint="{ckpt}", prompt=True, new_tokens=True):
    argv = ["--checkpoint", checkpoint] + (PROMPT[:2] if prompt else []) + (PROMPT[2:] if new_tokens else []) + extra
    return (f"generate-{id}", "generate", argv, setup, code, message)


# config.json fields and values that are wrong by type or range: (field, value, what the message names)
BAD_CONFIG = [
    ("model_type", "gpt2", "unsupported architecture"), ("model_type", 5, "unsupported architecture"),
    ("model_type", ["llama"], "unsupported architecture"), ("model_type", DROP, "unsupported architecture"),
    ("vocab_size", "abc", "vocab_size"), ("vocab_size", 0, "vocab_size"), ("vocab_size", -1, "vocab_size"),
    ("vocab_size", 512.0, "vocab_size"), ("vocab_size", True, "vocab_size"), ("vocab_size", None, "vocab_size"),
    ("vocab_size", DROP, "lacks 'vocab_size'"), ("vocab_size", 1000, "do not match"),
    ("hidden_size", 0, "hidden_size"), ("hidden_size", "64", "hidden_size"), ("hidden_size", [64], "hidden_size"),
    ("hidden_size", 66, "do not match"), ("hidden_size", DROP, "lacks 'hidden_size'"),
    ("intermediate_size", 0, "intermediate_size"), ("intermediate_size", "x", "intermediate_size"),
    ("intermediate_size", 100, "do not match"),
    ("num_hidden_layers", 0, "num_hidden_layers"),
    ("num_hidden_layers", 3, "have 2 layers, its config.json's num_hidden_layers says 3"),
    ("num_hidden_layers", 10 ** 9, f"have 2 layers, its config.json's num_hidden_layers says {10 ** 9}"),
    ("num_hidden_layers", 2.0, "num_hidden_layers"),
    ("num_attention_heads", 0, "num_attention_heads"), ("num_attention_heads", 3, "num_attention_heads"),
    ("num_attention_heads", 4.0, "num_attention_heads"), ("num_attention_heads", DROP, "num_attention_heads"),
    ("num_key_value_heads", 3, "num_key_value_heads 3"), ("num_key_value_heads", 8, "num_key_value_heads 8"),
    ("num_key_value_heads", 0, "num_key_value_heads"), ("num_key_value_heads", "2", "num_key_value_heads"),
    ("head_dim", 15, "head_dim 15 must be even"), ("head_dim", 0, "head_dim"), ("head_dim", "16", "head_dim"),
    ("head_dim", 32, "do not match"), ("head_dim", 2 ** 20, f"head_dim is {2 ** 20}, more than 65536"),
    ("head_dim", 2 ** 40, f"head_dim is {2 ** 40}, more than 2147483647"),
    ("vocab_size", 2 ** 62, f"vocab_size is {2 ** 62}, more than 2147483647"),
    ("intermediate_size", 2 ** 70, f"intermediate_size is {2 ** 70}, more than 2147483647"),
    ("max_position_embeddings", 2 ** 70, f"max_position_embeddings is {2 ** 70}, more than 2147483647"),
    ("max_position_embeddings", 0, "max_position_embeddings"), ("max_position_embeddings", -1, "max_position"),
    ("max_position_embeddings", "4096", "max_position_embeddings"), ("max_position_embeddings", 1.5, "max_pos"),
    ("rms_norm_eps", -1e-5, "rms_norm_eps"), ("rms_norm_eps", 0, "rms_norm_eps"), ("rms_norm_eps", "1e-5", "rms_norm"),
    ("rms_norm_eps", 1e300, "rms_norm_eps must be > 0 and < 1"), ("partial_rotary_factor", 0.5, "partial_rotary"),
    ("rope_parameters", {"rope_theta": 10000.0, "partial_rotary_factor": 0.25}, "partial_rotary_factor"),
    ("rms_norm_eps", True, "rms_norm_eps"), ("rms_norm_eps", NAN, "rms_norm_eps"), ("rms_norm_eps", INF, "rms_norm"),
    ("rope_theta", 500000.0, "rope_theta 500000.0 and rope_parameters.rope_theta 10000.0 disagree"),
    ("rope_scaling", "linear", "rope_scaling must be an object"), ("rope_scaling", 5, "rope_scaling"),
    ("rope_scaling", [1], "rope_scaling"), ("rope_scaling", {"rope_type": "yarn", "factor": 2.0}, "'yarn'"),
    ("rope_scaling", {"rope_type": 5}, "rope scaling 5"), ("rope_scaling", {"type": ["linear"]}, "rope scaling"),
    ("rope_scaling", {"rope_type": "linear"}, "rope_scaling linear lacks factor"),
    ("rope_scaling", {"rope_type": "linear", "factor": 0}, "rope_scaling.factor"),
    ("rope_scaling", {"rope_type": "linear", "factor": -2.0}, "rope_scaling.factor"),
    ("rope_scaling", {"rope_type": "linear", "factor": "2"}, "rope_scaling.factor"),
    ("rope_scaling", {"rope_type": "linear", "factor": NAN}, "rope_scaling.factor"),
    ("rope_scaling", {"rope_type": "linear", "factor": 1e-40}, "not finite"),
    ("rope_scaling", dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=1.0,
                          original_max_position_embeddings=64), "low_freq_factor (1.0) must be below"),
    ("rope_scaling", dict(rope_type="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0,
                          original_max_position_embeddings=64), "low_freq_factor"),
    ("rope_scaling", dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=0), "original_max_position_embeddings"),
    ("rope_scaling", dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64.5), "original_max_position_embeddings"),
    ("rope_scaling", dict(rope_type="llama3", factor=8.0, low_freq_factor=-1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64), "low_freq_factor must be > 0"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, "llama3 lacks low_freq_factor"),
    ("rope_parameters", "x", "rope_parameters"), ("rope_parameters", [1], "rope_parameters"),
    ("rope_parameters", {"rope_type": "linear", "factor": 0}, "rope_parameters.factor"),
    ("rope_parameters", {"rope_theta": "abc"}, "rope_parameters.rope_theta"),
    ("rope_parameters", {"rope_theta": -1.0}, "rope_theta"),
    ("tie_word_embeddings", "yes", "tie_word_embeddings"), ("tie_word_embeddings", 1, "tie_word_embeddings"),
    ("tie_word_embeddings", "false", "tie_word_embeddings"),
    ("attention_bias", "no", "attention_bias"), ("attention_bias", 0, "attention_bias"),
    ("mlp_bias", True, "mlp_bias"), ("mlp_bias", "x", "mlp_bias"),
    ("hidden_act", "gelu", "activation"), ("hidden_act", 5, "activation"),
    ("use_sliding_window", "yes", "use_sliding_window"),
    ("budgetkv_quantization", "int8", "budgetkv_quantization"),
    ("budgetkv_quantization", {"mode": "int3"}, "budgetkv_quantization"),
    ("budgetkv_quantization", {"mode": "int4", "groupsize": 48}, "budgetkv_quantization"),
]
# rope_theta where transformers 4 writes it (top level) and where 5 does (rope_parameters)
BAD_THETAS = ["abc", 0, -10000.0, NAN, INF, 1e-300, [1], False]
ROPE_THETA = [(dict(rope_parameters=DROP, rope_theta=v), "rope_theta") for v in BAD_THETAS]
ROPE_THETA += [(dict(rope_parameters={"rope_type": "default", "rope_theta": v}), "rope_theta")
               for v in BAD_THETAS]
SLIDING = [  # qwen2 / mistral sliding windows
    (dict(model_type="mistral", sliding_window=0), "sliding_window"),
    (dict(model_type="mistral", sliding_window="x"), "sliding_window"),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=-1), "max_window_layers"),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=16, max_window_layers="x"), "max_window_layers"),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=16, layer_types="x"), "layer_types"),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=16, layer_types=[1, 2]), "layer_types"),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1), "some layers only"),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1,
          num_hidden_layers=2 ** 31 - 1), "some layers only"),  # said at once, no list of every layer made
]


def cfg_id(field, value):
    text = "drop" if value is DROP else json.dumps(value)[:24]
    return f"{field}={text}"


CASES = [gen(f"config-{i:02d}-{cfg_id(f, v)}", [], 2, msg, config(**{f: v}), "{bad}")
         for i, (f, v, msg) in enumerate(BAD_CONFIG)]
CASES += [gen(f"config-{i}-{'-'.join(map(str, e.values()))[:30]}", [], 2, msg, config(**e), "{bad}")
          for i, (e, msg) in enumerate(SLIDING)]
CASES += [gen(f"config-theta-{i:02d}-{cfg_id(*next(iter(e.items())))}", [], 2, msg, config(**e), "{bad}")
          for i, (e, msg) in enumerate(ROPE_THETA)]
CASES += [
    gen("config-architectures-int", [], 2, "unsupported architecture", config(model_type="gpt2", architectures=5),
        "{bad}"),
    gen("config-hidden-size-heads", [], 2, "hidden_size 66 is not a multiple of num_attention_heads 4",
        config(hidden_size=66, head_dim=DROP), "{bad}"),
    gen("config-hidden-size-huge", [], 2, f"hidden_size / num_attention_heads is {2 ** 28}, more than 65536",
        config(hidden_size=2 ** 30, head_dim=DROP), "{bad}"),
    gen("config-sizes-multiply-past-any-model", [], 2, "make 9,223,374,512,903,420,797 parameters, more than any "
        "model", config(vocab_size=2 ** 31 - 1, hidden_size=2 ** 31 - 1), "{bad}"),
    gen("config-window-huge", [], 2, f"sliding_window is {2 ** 70}, more than 2147483647",
        config(model_type="mistral", sliding_window=2 ** 70), "{bad}"),
    gen("config-original-context-huge", [], 2, "original_max_position_embeddings must be an integer from 1 to "
        "2147483647", config(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                               high_freq_factor=4.0, original_max_position_embeddings=10 ** 30)),
        "{bad}"),
    gen("config-list", [], 2, "is not a JSON object", files(config__json=[1, 2]), "{bad}"),
    gen("config-string", [], 2, "is not a JSON object", files(config__json='"llama"'), "{bad}"),
    gen("config-broken-json", [], 2, "is not valid JSON", files(config__json='{"model_type": '), "{bad}"),
    gen("config-empty", [], 2, "is not valid JSON", files(config__json=""), "{bad}"),
    gen("config-binary", [], 2, "is not valid JSON", files(config__json=b"\xff\xfe\x00\x01"), "{bad}"),
    gen("config-missing", [], 2, "has no config.json", files(config__json=None), "{bad}"),
    gen("config-fifo", [], 2, "config.json is not a regular file", fifo_in("config.json"), "{bad}"),
    *[gen(f"fifo-{name}", [], 2, f"{name} is not a regular file", fifo_in(name), "{bad}")
      for name in ("tokenizer_config.json", "generation_config.json", "chat_template.jinja", "tokenizer.json",
                   "model.safetensors")],
    # a checkpoint's files are data someone else wrote: parsed with bounds (files.read_json), the file named
    gen("config-deep", [], 2, "config.json is not valid JSON: nested deeper than 64 levels", files(config__json=DEEP),
        "{bad}"),
    gen("config-deep-object", [], 2, "config.json is not valid JSON: nested deeper than 64 levels",
        files(config__json=DEEP_OBJECT), "{bad}"),
    gen("config-deep-field", [], 2, "config.json is not valid JSON: nested deeper than 64 levels",
        config(rope_scaling=NESTED), "{bad}"),
    gen("config-huge-number", [], 2, "config.json is not valid JSON: Exceeds the limit",
        files(config__json='{"vocab_size": ' + "9" * 5000 + "}"), "{bad}"),
    gen("tokenizer-config-deep", [], 2, "tokenizer_config.json: nested deeper than 64 levels",
        files(tokenizer_config__json=DEEP), "{bad}"),
    gen("generation-config-deep", [], 2, "generation_config.json: nested deeper than 64 levels",
        files(generation_config__json=DEEP_OBJECT), "{bad}"),
    gen("tokenizer-json-deep", [], 2, "tokenizer.json", files(tokenizer__json=DEEP), "{bad}"),
    gen("engine-file-identity-deep", [], 2, "have 0 layers", deep_identity, "{bad}"),
    gen("draft-config-deep", ["--speculate", "2", "--draft-checkpoint", "{bad}"], 2,
        "config.json is not valid JSON: nested deeper than 64 levels", files(config__json=DEEP)),
    gen("config-too-large", [], 2, "config.json is not valid JSON: larger than 64 MiB",
        files(config__json=b" " * (64 << 20) + b"{}"), "{bad}"),
    # weights
    gen("weights-missing", [], 2, "no *.safetensors", files(model__safetensors=None), "{bad}"),
    gen("weights-truncated", [], 2, "truncated or corrupt", truncated_weights, "{bad}"),
    gen("weights-garbage", [], 2, "truncated or corrupt", files(model__safetensors=b"\x00" * 64), "{bad}"),
    gen("weights-empty", [], 2, "truncated or corrupt", files(model__safetensors=b""), "{bad}"),
    gen("weights-lack-a-tensor", [], 2, "lacks tensor", missing_tensor, "{bad}"),
    # an engine file with no source beside it (a garbage one beside HF weights is converted again from them)
    gen("engine-file-garbage", [], 2, "truncated or corrupt",
        files(budgetkv__safetensors=b"garbage", model__safetensors=None), "{bad}"),
    # tokenizer files
    gen("tokenizer-json-garbage", [], 2, "cannot read", files(tokenizer__json="not json"), "{bad}"),
    gen("tokenizer-json-empty", [], 2, "cannot read", files(tokenizer__json=""), "{bad}"),
    gen("tokenizer-json-list", [], 2, "cannot read", files(tokenizer__json=[]), "{bad}"),
    gen("tokenizer-json-binary", [], 2, "cannot read", files(tokenizer__json=b"\x80\x81\x00"), "{bad}"),
    gen("tokenizer-missing", [], 2, "no tokenizer.json or tokenizer.model", files(tokenizer__json=None), "{bad}"),
    gen("tokenizer-model-garbage", [], 2, "cannot read",
        files(tokenizer__json=None, tokenizer__model=b"\x00garbage"), "{bad}"),
    gen("tokenizer-model-empty", [], 2, "cannot read", files(tokenizer__json=None, tokenizer__model=b""), "{bad}"),
    gen("tokenizer-model-bad-ranks", [], 2, "corrupt tiktoken",
        files(tokenizer__json=None, tokenizer__model="IQ== 0\nnot-base64 x\n"), "{bad}"),
    gen("tokenizer-config-broken", [], 2, "cannot parse", files(tokenizer_config__json="{"), "{bad}"),
    gen("tokenizer-config-list", [], 2, "is not a JSON object", files(tokenizer_config__json=[1]), "{bad}"),
    gen("tokenizer-config-binary", [], 2, "cannot parse", files(tokenizer_config__json=b"\xff\xfe"), "{bad}"),
    gen("tokenizer-config-bos-int", [], 2, "bos_token must be a string", tok_config(bos_token=5), "{bad}"),
    gen("tokenizer-config-eos-obj", [], 2, "eos_token must be a string", tok_config(eos_token={"content": 5}),
        "{bad}"),
    gen("generation-config-broken", [], 2, "cannot parse", files(generation_config__json="{x"), "{bad}"),
    gen("generation-config-list", [], 2, "is not a JSON object", files(generation_config__json=[]), "{bad}"),
    # chat templates
    gen("template-if-without-test", [], 2, "tokenizer_config.json line 1 fails: TemplateSyntaxError",
        tok_config(chat_template="{% if %}"), "{bad}"),
    gen("template-unclosed-for", [], 2, "TemplateSyntaxError", tok_config(chat_template="{% for m in messages %}"),
        "{bad}"),
    gen("template-raises", [], 2, "no system role", tok_config(chat_template="{{ raise_exception('no system role') }}"),
        "{bad}"),
    gen("template-undefined", [], 2, "UndefinedError", tok_config(chat_template="{{ messages[5]['content'] }}"),
        "{bad}"),
    gen("template-divides-by-zero", [], 2, "ZeroDivisionError", tok_config(chat_template="{{ 1 / 0 }}"), "{bad}"),
    gen("template-sandbox", [], 2, "SecurityError",
        tok_config(chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}"), "{bad}"),
    gen("template-renders-nothing", [], 2, "empty once tokenized with the chat template",
        tok_config(chat_template="{{ '' }}"), "{bad}"),
    gen("template-lone-surrogate", [], 2, "not valid Unicode", tok_config(chat_template='{{ "\\udcff" }}'), "{bad}"),
    gen("template-int", [], 2, "chat_template must be a string", tok_config(chat_template=5), "{bad}"),
    gen("template-list-int", [], 2, "chat_template must be a string",
        tok_config(chat_template=[{"name": "default", "template": 5}]), "{bad}"),
    gen("template-jinja-file", [], 2, "chat_template.jinja line 1 fails",
        files(chat_template__jinja="{% if %}"), "{bad}"),
    gen("template-jinja-binary", [], 2, "not UTF-8", files(chat_template__jinja=b"\xff\xfe{{"), "{bad}"),
    # a chat template is code someone else wrote: bounded in size, output, the values it makes and time
    gen("template-writes-forever", [], 2, "tokenizer_config.json fails: TemplateLimit: writes more than",
        tok_config(chat_template="{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"),
        "{bad}"),
    gen("template-repeats", [], 2, "TemplateLimit: repeats a value 1,000,000,000,000 times",
        tok_config(chat_template="{{ 'x' * 10 ** 12 }}"), "{bad}"),
    gen("template-power", [], 2, "TemplateLimit: computes 2 ** 1000000000",
        tok_config(chat_template="{{ 2 ** (10 ** 9) }}"), "{bad}"),
    gen("template-doubles", [], 2, "TemplateLimit: makes a value of 2,097,152 characters",
        tok_config(chat_template="{% set ns = namespace(s='x') %}{% for i in range(64) %}"
                                 "{% set ns.s = ns.s ~ ns.s %}{% endfor %}"), "{bad}"),
    gen("template-macro-doubles", [], 2, "TemplateLimit: makes a value of 2,097,152 characters",
        tok_config(chat_template="{% macro f(s) %}{{ f(s ~ s) }}{% endmacro %}{{ f('x') }}"), "{bad}"),
    gen("template-filter-huge", [], 2, "TemplateLimit: calls do_center with 1000000000000",
        tok_config(chat_template="{{ 'x'|center(10 ** 12) }}"), "{bad}"),
    gen("template-method-huge", [], 2, "TemplateLimit: calls ljust with 1000000000000",
        tok_config(chat_template="{{ 'x'.ljust(10 ** 12) }}"), "{bad}"),
    gen("template-recursion", [], 2, "RecursionError", tok_config(chat_template="{% macro f() %}{{ f() }}{% endmacro %}"
                                                                              "{{ f() }}"), "{bad}"),
    gen("template-jinja-file-huge", [], 2, "chat_template.jinja is longer than 1 MiB",
        files(chat_template__jinja="{# #}" * (1 << 18) + "x"), "{bad}"),
    # prompt files
    gen("prompt-file-dev-zero", ["--prompt-file", "/dev/zero"], 2, "larger than 64 MiB", prompt=False),
    gen("prompt-file-only-a-bom", ["--prompt-file", "{tmp}/p.txt"], 2, "prompt file {tmp}/p.txt is empty", write("p.txt", "\ufeff"),
        prompt=False),
    gen("profile-device", ["--profile", "/dev/null"], 2, "not a regular file"),
    gen("profile-symlink", ["--profile", "{tmp}/link"], 2, "not a regular file", symlink("link", "target")),
    gen("prompt-file-missing", ["--prompt-file", "{tmp}/none.txt"], 2, "cannot read prompt file", prompt=False),
    gen("prompt-file-directory", ["--prompt-file", "{tmp}"], 2, "Is a directory", prompt=False),
    gen("prompt-file-binary", ["--prompt-file", "{tmp}/p.bin"], 2, "not UTF-8 text",
        write("p.bin", b"\x89PNG\r\n\x1a\n\xff\xfe"), prompt=False),
    gen("prompt-file-empty", ["--prompt-file", "{tmp}/p.txt"], 2, "prompt file {tmp}/p.txt is empty", write("p.txt", ""),
        prompt=False),
    gen("prompt-file-blank", ["--prompt-file", "{tmp}/p.txt"], 2, "prompt file {tmp}/p.txt is empty", write("p.txt", " \n\t\n"),
        prompt=False),
    gen("prompt-file-unreadable", ["--prompt-file", "/proc/self/mem"], 2, "cannot read prompt file", prompt=False),
    gen("prompt-file-nul-in-path", ["--prompt-file", "{tmp}/a\0b"], 2, "cannot read prompt file", prompt=False),
    gen("prompt-file-too-long", ["--prompt-file", "{tmp}/p.txt"], 2, "longer than the model's context",
        write("p.txt", "the quick brown fox " * 200), prompt=False),
    gen("prompt-and-jsonl", ["--prompt-file", "{tmp}/p.jsonl"], 2, "one question after one document",
        write("p.jsonl", '{"prompt": "hi"}\n')),
    gen("question-empty", ["--prompt-file", "{tmp}/p.txt", "--prompt", " "], 2, "the question (--prompt) is empty",
        write("p.txt", "a document"), prompt=False),
    gen("repetition-penalty-zero", ["--repetition-penalty", "0"], 2, "--repetition-penalty must be between 0.01 and 100"),
    gen("repetition-penalty-nan", ["--repetition-penalty", "nan"], 2, "--repetition-penalty must be a finite number"),
    gen("repetition-penalty-tiny", ["--repetition-penalty", "1e-300"], 2, "--repetition-penalty must be between 0.01"),
    gen("repeat-last-n", ["--repetition-penalty", "1.2", "--repeat-last-n", "-2"], 2, "--repeat-last-n must be >= -1"),
    gen("repeat-last-n-huge", ["--repetition-penalty", "1.2", "--repeat-last-n", "99999999999999999999"], 2,
        "is longer than the model's context (256)"),
    gen("repeat-last-n-alone", ["--repeat-last-n", "5"], 2, "--repeat-last-n applies to --repetition-penalty"),
    gen("stop-empty", ["--stop", ""], 2, "--stop takes a non-empty text"),
    gen("stop-interactive", ["--interactive", "--stop", "x"], 2, "--stop applies to a plain generation",
        prompt=False),
    gen("random-prompt-tokens-past-context", ["--random-weights", "--prompt-tokens", str(2 ** 62)], 2,
        f"--prompt-tokens {2 ** 62} is longer than the model's context of 256", shapes_only, "{tmp}/shapes",
        prompt=False),
    gen("random-prompt-tokens-context", ["--random-weights", "--prompt-tokens", "257"], 2,
        "--prompt-tokens 257 is longer than the model's context of 256", shapes_only, "{tmp}/shapes", prompt=False),
    gen("prompt-surrogate", ["--prompt", "\udcff\udcfe"], 2, "not valid UTF-8", prompt=False),
    gen("prompt-fills-context", ["--prompt-file", "{tmp}/p.txt"], 2, "fills the model's context", prompt_of(256),
        prompt=False, new_tokens=False),
    # output paths
    gen("profile-directory", ["--profile", "{tmp}"], 2, "not a regular file"),
    gen("profile-no-parent", ["--profile", "{tmp}/no/such/t.json"], 2, "cannot write there"),
    gen("profile-proc", ["--profile", "/proc/t.json"], 2, "cannot write there"),
    gen("profile-nul", ["--profile", "{tmp}/a\0b.json"], 2, "cannot write there"),
    # flags: values out of range, flags that do not apply, explicit values past the model's context
    gen("checkpoint-no-such-path", [], 2, "--checkpoint /no/such/model: no such file or directory",
        checkpoint="/no/such/model"),
    gen("checkpoint-relative-missing", [], 2, "no such file or directory", checkpoint="./no-such-model"),
    gen("checkpoint-a-plain-file", [], 2, "not a model directory or a .gguf file", write("plain.txt", "x"),
        checkpoint="{tmp}/plain.txt"),
    gen("threads-0", ["--threads", "0"], 2, "--threads must be between 1 and 1024"),
    gen("threads-neg", ["--threads", "-2"], 2, "--threads must be between 1 and 1024"),
    gen("threads-huge", ["--threads", "100000"], 2, "--threads must be between 1 and 1024"),
    gen("threads-float", ["--threads", "1.5"], 2, "invalid int value"),
    gen("max-new-0", ["--max-new-tokens", "0"], 2, "--max-new-tokens must be >= 1"),
    gen("max-new-neg", ["--max-new-tokens", "-3"], 2, "--max-new-tokens must be >= 1"),
    gen("max-new-float", ["--max-new-tokens", "1e3"], 2, "invalid int value"),
    gen("max-new-empty", ["--max-new-tokens", ""], 2, "invalid int value"),
    gen("max-new-past-context", ["--max-new-tokens", "300"], 2, "--max-new-tokens 300 is larger than the model's context (256)"),
    gen("budget-neg", ["--budget", "-5"], 2, "--budget must be >= 1"),
    gen("budget-past-context", ["--policy", "keydiff", "--budget", "257"], 2, "larger than the model's context"),
    gen("block-past-context", ["--block-size", "257"], 2, "larger than the model's context"),
    gen("block-neg", ["--block-size", "-1"], 2, "--block-size must be >= 1"),
    gen("temperature-neg", ["--temperature", "-1"], 2, "--temperature must be a finite number >= 0"),
    gen("temperature-text", ["--temperature", "warm"], 2, "invalid float value"),
    gen("top-k-neg", ["--temperature", "1", "--top-k", "-1"], 2, "--top-k must be >= 0"),
    gen("top-k-greedy", ["--top-k", "5"], 2, "--top-k applies to sampling"),
    gen("top-k-tiny-temperature", ["--temperature", "1e-45", "--top-k", "5"], 2, "decodes greedily"),
    gen("top-k-past-vocab", ["--temperature", "1", "--top-k", "513"], 2, "exceeds the model's vocabulary (512"),
    gen("top-p-big", ["--temperature", "1", "--top-p", "1.5"], 2, "--top-p must be in (0, 1]"),
    gen("top-p-nan", ["--temperature", "1", "--top-p", "nan"], 2, "--top-p must be a finite number"),
    gen("top-p-greedy", ["--top-p", "0.9"], 2, "--top-p applies to sampling"),
    gen("seed-neg", ["--temperature", "1", "--seed", "-1"], 2, "--seed must be in"),
    gen("seed-greedy", ["--seed", "7"], 2, "--seed applies to sampling"),
    gen("sampling-flags-greedy", ["--seed", "7", "--top-k", "3"], 2, "--top-k applies to sampling"),
    gen("dtype", ["--dtype", "float8"], 2, "invalid choice"),
    gen("kv-dtype", ["--kv-dtype", "fp8"], 2, "invalid choice"),
    gen("device-tpu", ["--device", "tpu"], 2, "--device 'tpu' is not a device"),
    gen("device-cuda-x", ["--device", "cuda:x"], 2, "--device 'cuda:x' is not a device"),
    gen("device-cpu-0", ["--device", "cpu:0"], 2, "--device 'cpu:0' is not a device"),
    gen("compile-mode-alone", ["--compile-mode", "auto"], 2, "need --compile"),
    gen("compile-prefill-one-shot", ["--policy", "snapkv++", "--compile", "--no-compile-prefill"], 2,
        "apply to --prefill block"),
    gen("compile-mode-cpu-graphs", ["--compile", "--compile-mode", "reduce-overhead", "--device", "cpu"], 2,
        "CUDA graphs"),
    gen("prefill-block-one-shot-policy", ["--policy", "kvec", "--prefill", "block"], 2, "--prefill one-shot"),
    gen("evict-before-attend-full", ["--evict-before-attend"], 2, "--evict-before-attend applies"),
    gen("policy-param-inf", ["--policy", "keydiff:window_frac=inf"], 2, "window_frac"),
    gen("policy-param-nan", ["--policy", "h2o:window_frac=nan"], 2, "window_frac"),
    gen("policy-param-empty", ["--policy", "snapkv:window="], 2, "window takes int"),
    gen("policy-empty", ["--policy", ""], 2, "unknown policy"),
    gen("policy-kvec-lam", ["--policy", "kvec:lam=inf"], 2, "lam must be finite"),
    gen("policy-kernel-2-63", ["--policy", "snapkv:kernel=9223372036854775807"], 2, "kernel must be between"),
    gen("policy-kernel-neg-2-63", ["--policy", "kvec:kernel=-9223372036854775807"], 2, "kernel must be between"),
    gen("policy-window-2-64", ["--policy", "snapkv:window=18446744073709551616"], 2, "window must be between"),
    gen("unknown-flag", ["--bogus"], 2, "unrecognized arguments"),
    gen("checkpoint-missing-dir", [], 2, "nope: no such file or directory", checkpoint="{tmp}/nope"),
    gen("checkpoint-a-file", [], 2, "f.bin: not a model directory or a .gguf file", write("f.bin", "x"),
        checkpoint="{tmp}/f.bin"),
    gen("checkpoint-empty-string", [], 2, "--checkpoint is empty", checkpoint=""),
    gen("checkpoint-blank", [], 2, "--checkpoint is empty", checkpoint=" "),
    gen("speculate-default-draft-budget-named", ["--speculate", "2"], 2,
        "sink: --draft-budget 4 must exceed the 4 sink tokens (--draft-budget 4 is the default, half the target's 8 slots"),
    gen("checkpoint-GGUF-upper-missing", [], 2, "GGUF file not found", checkpoint="{tmp}/m.GGUF"),
    gen("checkpoint-empty-dir", [], 2, "has no config.json", write("empty/", None), checkpoint="{tmp}/empty"),
    gen("checkpoint-gguf-missing", [], 2, "GGUF file not found", checkpoint="{tmp}/m.gguf"),
    gen("checkpoint-gguf-block-count-huge", [], 2, "llama.block_count is 2147483647, but its tensors are those of 1 "
        "layer", gguf("x/model.gguf", block_count=2 ** 31 - 1), checkpoint="{tmp}/x/model.gguf"),
    gen("checkpoint-gguf-width-huge", [], 2, "tensor token_embd.weight has shape [260, 32], expected [260, "
        "2147483647]", gguf("x/model.gguf", embedding_length=2 ** 31 - 1), checkpoint="{tmp}/x/model.gguf"),
    gen("checkpoint-symlink-loop", [], 2, "loop: a symlink loop", symlink("loop", "loop"), checkpoint="{tmp}/loop"),
    gen("checkpoint-gguf-symlink-loop", [], 2, "m.gguf: a symlink loop", symlink("m.gguf", "m.gguf"),
        checkpoint="{tmp}/m.gguf"),
    gen("prompt-file-symlink-loop", ["--prompt-file", "{tmp}/loop"], 2, "Too many levels of symbolic links",
        symlink("loop", "loop"), prompt=False),
    gen("speculate-draft-budget-named", ["--prompt-file", "{tmp}/p.txt", "--max-new-tokens", "40", "--speculate",
                                         "2", "--draft-policy", "snapkv:window=32", "--draft-budget", "16"], 2,
        "snapkv: --draft-budget 16 must exceed the observation window", prompt_of(20), prompt=False,
        new_tokens=False),
    gen("speculate-two-line-jsonl", ["--prompt-file", "{tmp}/p.JSONL", "--speculate", "2"], 2, "a batch",
        write("p.JSONL", '{"prompt": "a"}\n{"prompt": "b"}\n'), prompt=False),
    # a named pipe nobody writes to is read as empty, not waited on; an empty document is named
    gen("prompt-file-fifo-and-question", ["--prompt-file", "{tmp}/p.fifo"], 2, "prompt file {tmp}/p.fifo is empty",
        fifo("p.fifo")),
    gen("prompt-file-fifo", ["--prompt-file", "{tmp}/p.fifo"], 2, "prompt file {tmp}/p.fifo is empty",
        fifo("p.fifo"), prompt=False),
    gen("prompt-file-fifo-jsonl", ["--prompt-file", "{tmp}/p.jsonl"], 2, "p.jsonl holds no prompt",
        fifo("p.jsonl"), prompt=False),
    gen("document-empty-with-question", ["--prompt-file", "{tmp}/p.txt"], 2, "prompt file {tmp}/p.txt is empty",
        write("p.txt", "\n \n")),
    gen("dtype-kv-bfloat16-half", ["--dtype", "float16", "--kv-dtype", "bfloat16"], 2,
        "--kv-dtype bfloat16 halves a float32 run's cache"),
]

CASES += [
    ("quantize-int-engine-tensor", "quantize", ["--checkpoint", "{bad}", "--out", "{tmp}/q", "--mode", "int8"],
     int_engine_tensor, 2, "layers.0.feed_forward.w2.weight in"),
    ("quantize-no-mode", "quantize", ["--checkpoint", "{ckpt}", "--out", "{tmp}/q"], None, 2, "--mode"),
    ("quantize-mode", "quantize", ["--checkpoint", "{ckpt}", "--mode", "int3"], None, 2, "invalid choice"),
    ("quantize-groupsize-int8", "quantize", ["--checkpoint", "{ckpt}", "--out", "{tmp}/q", "--mode", "int8",
                                             "--groupsize", "64"], None, 2, "--groupsize applies to --mode int4"),
    ("quantize-groupsize-48", "quantize", ["--checkpoint", "{ckpt}", "--out", "{tmp}/q", "--mode", "int4",
                                           "--groupsize", "48"], None, 2, "unsupported --groupsize 48"),
    ("quantize-groupsize-neg", "quantize", ["--checkpoint", "{ckpt}", "--out", "{tmp}/q", "--mode", "int4",
                                            "--groupsize", "-32"], None, 2, "unsupported --groupsize -32"),
    ("quantize-groupsize-128", "quantize", ["--checkpoint", "{ckpt}", "--out", "{tmp}/q", "--mode", "int4",
                                            "--groupsize", "128"], None, 2, "does not divide"),
    ("quantize-groupsize-text", "quantize", ["--checkpoint", "{ckpt}", "--mode", "int4", "--groupsize", "x"],
     None, 2, "invalid int value"),
    ("quantize-head", "quantize", ["--checkpoint", "{ckpt}", "--mode", "int8", "--head", "half"], None, 2,
     "invalid choice"),
    ("quantize-out-file", "quantize", ["--checkpoint", "{ckpt}", "--out", "{tmp}/f", "--mode", "int8"],
     write("f", "x"), 2, "cannot create --out"),
    ("quantize-out-under-file", "quantize", ["--checkpoint", "{ckpt}", "--out", "{tmp}/f/q", "--mode", "int8"],
     write("f", "x"), 2, "is a file"),
    ("quantize-out-proc", "quantize", ["--checkpoint", "{ckpt}", "--out", "/proc/q", "--mode", "int8"], None, 2,
     "not writable"),
    ("quantize-out-other-model", "quantize", ["--checkpoint", "{ckpt}", "--out", "{tmp}/m", "--mode", "int8"],
     other_checkpoint("m"), 2, "did not write"),
    ("quantize-out-is-source", "quantize", ["--checkpoint", "{ckpt}", "--out", "{ckpt}", "--mode", "int8"], None, 2,
     "is the source checkpoint itself"),
    ("quantize-already-quantized", "quantize", ["--checkpoint", "{tmp}/m", "--out", "{tmp}/q", "--mode", "int8"],
     other_checkpoint("m", {"budgetkv_quantization": {"mode": "int8"}}), 2, "is already quantized"),
    ("quantize-checkpoint-missing", "quantize", ["--checkpoint", "{tmp}/none", "--mode", "int8"], None, 2,
     "none: no such file or directory"),
    ("quantize-bad-config", "quantize", ["--checkpoint", "{bad}", "--out", "{tmp}/q", "--mode", "int8"],
     config(rope_theta="abc"), 2, "rope_theta"),
    ("quantize-bad-heads", "quantize", ["--checkpoint", "{bad}", "--out", "{tmp}/q", "--mode", "int8"],
     config(num_key_value_heads=3), 2, "num_key_value_heads"),
    ("quantize-no-weights", "quantize", ["--checkpoint", "{bad}", "--out", "{tmp}/q", "--mode", "int8"],
     files(model__safetensors=None), 2, "no *.safetensors"),
    ("quantize-truncated", "quantize", ["--checkpoint", "{bad}", "--out", "{tmp}/q", "--mode", "int8"],
     truncated_weights, 2, "truncated or corrupt"),
    ("quantize-unknown-flag", "quantize", ["--checkpoint", "{ckpt}", "--mode", "int8", "--fast"], None, 2,
     "unrecognized arguments"),

    ("download-no-repo", "download", [], None, 2, "--repo-id"),
    ("download-empty-repo", "download", ["--repo-id", "", "--out-dir", "{tmp}/d"], None, 2, "invalid --repo-id"),
    ("download-dotdot", "download", ["--repo-id", "../x"], None, 2, "invalid --repo-id"),
    ("download-absolute", "download", ["--repo-id", "/etc/passwd"], None, 2, "invalid --repo-id"),
    ("download-three-parts", "download", ["--repo-id", "a/b/c"], None, 2, "invalid --repo-id"),
    ("download-space", "download", ["--repo-id", "a b/c"], None, 2, "invalid --repo-id"),
    ("download-dashes", "download", ["--repo-id", "org/--x--"], None, 2, "invalid --repo-id"),
    ("download-out-file", "download", ["--repo-id", "org/model", "--out-dir", "{tmp}/f"], write("f", "x"), 2,
     "a file of that name exists"),
    ("download-out-proc", "download", ["--repo-id", "org/model", "--out-dir", "/proc/d"], None, 2, "not writable"),
    ("download-token-empty", "download", ["--repo-id", "org/model", "--hf-token", ""], None, 2, "--hf-token"),
    ("download-token-space", "download", ["--repo-id", "org/model", "--hf-token", "hf x"], None, 2, "--hf-token"),
    ("download-offline", "download", ["--repo-id", "org/model", "--out-dir", "{tmp}/d"], None, 1, "HF_HUB_OFFLINE"),
    ("download-unknown-flag", "download", ["--repo-id", "org/model", "--resume"], None, 2, "unrecognized"),

    ("convert-no-checkpoint", "convert", [], None, 2, "--checkpoint"),
    ("convert-missing", "convert", ["--checkpoint", "{tmp}/none"], None, 2, "no such file or directory"),
    ("convert-symlink-loop", "convert", ["--checkpoint", "{tmp}/loop"], symlink("loop", "loop"), 2,
     "loop: a symlink loop"),
    ("convert-a-file", "convert", ["--checkpoint", "{tmp}/f.bin"], write("f.bin", "x"), 2, "neither an HF directory"),
    ("convert-gguf-garbage", "convert", ["--checkpoint", "{tmp}/m.gguf", "--out-dir", "{tmp}/o"],
     write("m.gguf", b"GGUF\x03\x00\x00\x00garbage"), 2, "cannot read GGUF file"),
    ("convert-gguf-empty", "convert", ["--checkpoint", "{tmp}/m.gguf", "--out-dir", "{tmp}/o"],
     write("m.gguf", b""), 2, "cannot read GGUF file"),
    ("convert-gguf-truncated-header", "convert", ["--checkpoint", "{tmp}/m.gguf", "--out-dir", "{tmp}/o"],
     write("m.gguf", b"GGUF\x03\x00\x00\x00\x05" + bytes(7) + b"\x02" + bytes(7)), 2,
     "m.gguf: truncated or damaged"),
    ("convert-gguf-truncated-kv", "convert", ["--checkpoint", "{tmp}/m.gguf", "--out-dir", "{tmp}/o"],
     write("m.gguf", b"GGUF\x03\x00\x00\x00" + bytes(8) + b"\x01" + bytes(7) + b"\x14" + bytes(7) + b"general."),
     2, "m.gguf: truncated or damaged"),
    ("convert-gguf-key-length-huge", "convert", ["--checkpoint", "{tmp}/m.gguf", "--out-dir", "{tmp}/o"],
     write("m.gguf", b"GGUF\x03\x00\x00\x00" + bytes(8) + b"\x01" + bytes(7) + (2 ** 40).to_bytes(8, "little") +
           b"general."), 2, "m.gguf: truncated or damaged"),
    ("convert-gguf-not-gguf", "convert", ["--checkpoint", "{tmp}/m.gguf", "--out-dir", "{tmp}/o"],
     write("m.gguf", b"PK\x03\x04" + bytes(60)), 2, "m.gguf: not a GGUF file"),
    ("convert-device-out-dir", "convert", ["--checkpoint", "/dev/zero", "--out-dir", "{tmp}/o"], None, 2,
     "--checkpoint /dev/zero is neither an HF directory nor a .gguf file"),
    ("convert-gguf-upper-fifo", "convert", ["--checkpoint", "{tmp}/m.GGUF", "--out-dir", "{tmp}/o"], fifo("m.GGUF"), 2,
     "m.GGUF is not a file"),
    ("convert-gguf-dir", "convert", ["--checkpoint", "{tmp}/m.gguf"], write("m.gguf/", None), 2, "is not a file"),
    ("convert-gguf-out-file", "convert", ["--checkpoint", "{tmp}/m.gguf", "--out-dir", "{tmp}/f"],
     lambda tmp, ckpt: (write("m.gguf", b"x")(tmp, ckpt), write("f", "x")(tmp, ckpt)), 2, "a file of that name"),
    ("convert-gguf-out-proc", "convert", ["--checkpoint", "{tmp}/m.gguf", "--out-dir", "/proc/o"],
     write("m.gguf", b"x"), 2, "not writable"),
    ("convert-gguf-out-other-model", "convert", ["--checkpoint", "{tmp}/m.gguf", "--out-dir", "{tmp}/m"],
     lambda tmp, ckpt: (write("m.gguf", b"x")(tmp, ckpt), other_checkpoint("m")(tmp, ckpt)), 2,
     "not a GGUF conversion"),
    ("convert-hf-out-dir", "convert", ["--checkpoint", "{tmp}/hf", "--out-dir", "{tmp}/o"], hf_dir_copy, 2,
     "converted in place"),
    ("convert-hf-no-config", "convert", ["--checkpoint", "{bad}"], files(config__json=None), 2, "has no config.json"),
    ("convert-hf-no-weights", "convert", ["--checkpoint", "{bad}"], files(model__safetensors=None), 2,
     "no *.safetensors"),
    ("convert-hf-truncated", "convert", ["--checkpoint", "{bad}"], truncated_weights, 2, "truncated or corrupt"),
    ("convert-hf-missing-tensor", "convert", ["--checkpoint", "{bad}"], missing_tensor, 2, "lacks tensor"),
    ("convert-to-hf-kv-heads", "convert", ["--checkpoint", "{bad}", "--to-hf", "{tmp}/o"],
     converted(config(num_key_value_heads=DROP)), 2, "wqkv.weight has 128 rows, its config.json's heads make 192"),
    ("convert-to-hf-head-dim", "convert", ["--checkpoint", "{bad}", "--to-hf", "{tmp}/o"], converted(config(head_dim=32)), 2,
     "wqkv.weight has 128 rows, its config.json's heads make 256"),
    ("convert-hf-tensor-twice", "convert", ["--checkpoint", "{bad}"], second_shard, 2,
     "tensor model.norm.weight is in two weight files"),
    ("convert-to-hf-int-engine-tensor", "convert", ["--checkpoint", "{bad}", "--to-hf", "{tmp}/o"], int_engine_tensor,
     2, "tensor layers.0.feed_forward.w2.weight in"),
    ("convert-hf-fused-shapes", "convert", ["--checkpoint", "{bad}"],
     edited_tensor("model.layers.0.self_attn.k_proj.weight", lambda t: t.reshape(t.shape[0] * 2, -1)), 2,
     "tensors to fuse disagree in shape"),
    ("convert-hf-int-weights", "convert", ["--checkpoint", "{bad}"],
     edited_tensor("model.layers.0.mlp.down_proj.weight", lambda t: t.to(torch.int8)), 2,
     "is torch.int8, not float32"),
    ("convert-hf-layers", "convert", ["--checkpoint", "{bad}"], config(num_hidden_layers="2"), 2,
     "num_hidden_layers"),
    ("convert-hf-layers-huge", "convert", ["--checkpoint", "{bad}"], config(num_hidden_layers=2 ** 31 - 1), 2,
     "have 2 layers, its config.json's num_hidden_layers says 2147483647"),
    ("convert-gguf-block-count-huge", "convert", ["--checkpoint", "{tmp}/m.gguf", "--out-dir", "{tmp}/o"],
     gguf("m.gguf", block_count=2 ** 31 - 1), 2, "llama.block_count is 2147483647"),
    ("quantize-gguf-block-count-huge", "quantize", ["--checkpoint", "{tmp}/m.gguf", "--mode", "int8"],
     gguf("m.gguf", block_count=2 ** 31 - 1), 2, "llama.block_count is 2147483647"),
    ("quantize-hf-layers-huge", "quantize", ["--checkpoint", "{bad}", "--out", "{tmp}/q", "--mode", "int8"],
     config(num_hidden_layers=2 ** 31 - 1), 2, "num_hidden_layers says 2147483647"),
    ("convert-hf-broken-config", "convert", ["--checkpoint", "{bad}"], files(config__json="{"), 2,
     "is not valid JSON"),
    ("convert-unknown-flag", "convert", ["--checkpoint", "{tmp}", "--force"], None, 2, "unrecognized"),
]


def snapshot(*roots: Path) -> dict:
    """Every file under the roots (links not followed) with its size and modification time."""
    out = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in filenames + dirnames:
                p = Path(dirpath) / name
                st = p.lstat()
                out[str(p)] = (st.st_size, st.st_mtime_ns) if not p.is_dir() or p.is_symlink() else "dir"
    return out


def run_entry(entry, argv):
    try:
        return ENTRY[entry](argv)
    except SystemExit as e:  # argparse errors exit from parse_args, before run_cli
        return e.code


def test_the_table_is_big_enough():
    assert len(CASES) >= 120 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("entry,argv,setup,code,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line(tiny_ckpt, tmp_path, capfd, entry, argv, setup, code, message):
    if setup is not None:
        setup(tmp_path, tiny_ckpt)
    argv = [a.replace("{ckpt}", str(tiny_ckpt)).replace("{bad}", str(tmp_path / "bad")).replace("{tmp}", str(tmp_path))
            for a in argv]
    before = snapshot(tmp_path, tiny_ckpt)
    got = run_entry(entry, argv)
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err, err
    lines = err.strip().splitlines()
    message = message.replace("{tmp}", str(tmp_path))
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    assert got == code, err
    assert snapshot(tmp_path, tiny_ckpt) == before  # nothing written, nothing left half-written


# generate_text's settings that generate.py refuses (by argparse's choices or check_args): a UserError naming the
# parameter, before the checkpoint is looked at; None: the command line's own flags give the same line in its words
API = [
    (dict(kv_dtype="fp8"), "kv_dtype='fp8' is not one of auto, int8, bfloat16", None),
    (dict(kv_dtype=None), "kv_dtype=None is not one of auto", None),
    (dict(dtype="int8"), "dtype='int8' is not one of auto, float32, bfloat16, float16", None),
    (dict(dtype="float8_e4m3fn"), "dtype='float8_e4m3fn' is not one of", None),
    (dict(prefill="both"), "prefill='both' is not one of block, one-shot", None),
    (dict(prefill=""), "prefill='' is not one of", None),
    (dict(policy=5), "policy=5 is not a spec string", None),
    (dict(policy=__import__("policies").KeyDiff), "policy=<class 'policies.KeyDiff'> is not a spec string", None),
    (dict(device="tpu"), "device='tpu' is not a device: cpu, cuda or cuda:N", ["--device", "tpu"]),
    (dict(device="cpu:0"), "device='cpu:0' is not a device", ["--device", "cpu:0"]),
    (dict(device="cuda:x"), "device='cuda:x' is not a device", ["--device", "cuda:x"]),
    (dict(device="cuda:99"), "device=cuda:99", ["--device", "cuda:99"]),
    (dict(dtype="float16", kv_dtype="bfloat16"), "kv_dtype=bfloat16 halves a float32 run's cache; this run "
     "computes in float16", ["--dtype", "float16", "--kv-dtype", "bfloat16"]),
]


@pytest.mark.parametrize("kw, message, flags", API, ids=[m[:40] for _, m, _ in API])
def test_the_api_refuses_what_the_cli_refuses_in_one_line(tiny_ckpt, capfd, kw, message, flags):
    """One check for both: the API's line names the parameter; the command line's is the same line with its flags
    (cli.as_flags)."""
    import engine
    from cli import as_flags
    from errors import UserError
    with pytest.raises(UserError) as e:
        engine.generate_text("the fox", checkpoint="/no/such/model", **kw)
    assert message in str(e.value) and "\n" not in str(e.value)
    if flags is not None:
        argv = ["--checkpoint", str(tiny_ckpt), *PROMPT, *flags]
        assert run_entry("generate", argv) == 2
        assert capfd.readouterr().err == f"error: {as_flags(str(e.value), generate.parse_args(argv))}\n"


CHAT_SETTINGS = [(dict(sampling=dict(temperature=1.0, top_k=10 ** 6)), "top_k=1000000 exceeds the model's vocabulary"),
                 (dict(budget=0), "`budget` must be >= 1, got 0"),
                 (dict(block_size=-2), "`block_size` must be >= 1, got -2"),
                 (dict(budget=10 ** 6), "budget=1000000 is larger than the model's context"),
                 (dict(max_new_tokens=1.5), "`max_new_tokens` must be an integer, got 1.5"),
                 (dict(policy=__import__("policies").KeyDiff), "policy=<class 'policies.KeyDiff'> is not a spec")]


@pytest.mark.parametrize("kw, message", CHAT_SETTINGS, ids=[m[:30] for _, m in CHAT_SETTINGS])
def test_a_chat_refuses_what_a_generation_refuses_with_its_line(tiny_ckpt, kw, message):
    """chat.Chat checks its settings through engine.Generation: the same UserError line, before any cache."""
    import torch

    import chat
    import engine
    import loading
    import policies
    from errors import UserError
    from sampling import Sampling
    from tokenizer import load_tokenizer
    model = loading.load_model(tiny_ckpt, torch.float32, "cpu")
    if "sampling" in kw:
        kw = kw | {"sampling": Sampling(**kw["sampling"])}
    policy = kw.pop("policy", "keydiff")
    with pytest.raises(UserError) as from_chat:
        chat.Chat(model, load_tokenizer(tiny_ckpt), policy, **kw)
    with pytest.raises(UserError) as from_generation:
        engine.Generation(model.args, policies.make(policy) if isinstance(policy, str) else policy, [8], **kw)
    assert message in str(from_chat.value) and str(from_chat.value) == str(from_generation.value)


def test_a_chat_or_run_given_the_wrong_objects_says_which_in_one_line(tiny_ckpt):
    """Chat's model and tokenizer, a run's device: one UserError naming the parameter, not an AttributeError."""
    import torch

    import chat
    import engine
    import loading
    from errors import UserError
    from tokenizer import load_tokenizer
    model, tok = loading.load_model(tiny_ckpt, torch.float32, "cpu"), load_tokenizer(tiny_ckpt)
    for args, line in [((model, None), "tokenizer=None is not a budgetkv tokenizer"),
                       (("model", tok), "model='model' is not a budgetkv model")]:
        with pytest.raises(UserError, match=line):
            chat.Chat(*args)
    device = "cuda:7" if torch.cuda.device_count() < 8 else "gpu"
    with pytest.raises(UserError, match=f"device={device}"):
        engine.Generation(model.args, None, [8], device=device)


# ------------------------------------------------------------------------------- no NaN reaches the user

def nan_weights(tiny_ckpt, tmp_path) -> Path:
    """The tiny checkpoint with a NaN final norm: every logit is NaN."""
    from safetensors.torch import load_file, save_file
    bad = broken_copy(tmp_path, tiny_ckpt)
    tensors = load_file(str(tiny_ckpt / "model.safetensors"))
    tensors["model.norm.weight"][:] = NAN
    (bad / "model.safetensors").unlink()
    save_file(tensors, str(bad / "model.safetensors"))
    return bad


@pytest.mark.parametrize("sampling", [[], ["--temperature", "0.8"]], ids=["greedy", "sampled"])
def test_nan_logits_stop_with_one_line(tiny_ckpt, tmp_path, capfd, sampling):
    """Logits that are not finite stop generation at once: one line, exit 2, no text (it used to emit token 0)."""
    bad = nan_weights(tiny_ckpt, tmp_path)
    code = generate.main(["--checkpoint", str(bad), *PROMPT, *sampling])
    out, err = capfd.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "logits are not finite (NaN or inf) at generated token 1" in err


def test_nan_logits_mid_generation(tiny_ckpt, capfd, monkeypatch):
    """A decode step that turns NaN after two good ones: the two tokens were streamed, then one line, exit 2."""
    import torch
    calls = []

    def step(model, idx, pos):
        calls.append(1)
        logits = model(idx, pos)
        return logits if len(calls) < 3 else torch.full_like(logits, NAN)
    import engine
    import runtime
    monkeypatch.setattr(engine.Generation, "fns", ((runtime.prefill_step,), (step,)))  # its eager decode step
    code = generate.main(["--checkpoint", str(tiny_ckpt), "--prompt", "the quick brown fox", "--max-new-tokens", "8",
                          "--json"])
    out, err = capfd.readouterr()
    assert code == 2 and out == "" and len(calls) == 3
    assert err.count("\n") == 1 and "at generated token 4" in err, err


def test_tiny_temperature_is_greedy(tiny_ckpt, capfd):
    """--temperature below sampling.MIN_TEMPERATURE decodes greedily (as --help says), and never NaN."""
    runs = []
    for t in ("0", "1e-45", "5e-324", "9e-6"):
        assert generate.main(["--checkpoint", str(tiny_ckpt), *PROMPT[:2], "--max-new-tokens", "6", "--json",
                              "--temperature", t]) == 0
        runs.append(json.loads(capfd.readouterr().out))
    assert len({r["text"] for r in runs}) == 1 and all(r["generated_tokens"] == 6 for r in runs)
    with pytest.raises(SystemExit):
        generate.parse_args(["--help"])
    assert "any temperature below 1e-05 is greedy too" in " ".join(capfd.readouterr().out.split())


# ------------------------------------------------------------------------- environment and internal errors

def run_generate_raising(tiny_ckpt, monkeypatch, capfd, exc, *extra):
    def boom(a):
        raise exc
    monkeypatch.setattr(generate_args, "read_prompt", boom)
    code = generate.main(["--checkpoint", str(tiny_ckpt), "--prompt", "x", *extra])
    out, err = capfd.readouterr()
    return code, err


def test_internal_error_is_one_line_and_a_log(tiny_ckpt, tmp_path, monkeypatch, capfd):
    monkeypatch.delenv("BUDGETKV_VERBOSE", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    code, err = run_generate_raising(tiny_ckpt, monkeypatch, capfd, ZeroDivisionError("division by zero"))
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err
    log = tmp_path / f"budgetkv-{os.getuid()}" / "error.log"
    assert err.startswith(f"internal error: ZeroDivisionError: division by zero (traceback in {log}; or rerun with "
                          "-v)")
    log = log.read_text()
    assert "Traceback (most recent call last)" in log and "in boom" in log and "ZeroDivisionError" in log


@pytest.mark.parametrize("how", ["-v", "--verbose", "env"])
def test_verbose_prints_the_traceback(tiny_ckpt, tmp_path, monkeypatch, capfd, how):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    if how == "env":
        monkeypatch.setenv("BUDGETKV_VERBOSE", "1")
    code, err = run_generate_raising(tiny_ckpt, monkeypatch, capfd, KeyError("x"), *([how] if how != "env" else []))
    assert code == 1 and err.startswith("Traceback (most recent call last)") and "in boom" in err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("exc,code,line", [
    (OSError(28, "No space left on device", "/data/out.safetensors"), 1,
     "error: /data/out.safetensors: No space left on device"),
    (PermissionError(13, "Permission denied", "/data/x"), 1, "error: /data/x: Permission denied"),
    (OSError(5, "Input/output error"), 1, "error: Input/output error"),
    (MemoryError(), 1, "error: out of memory (MemoryError)"),
    (KeyboardInterrupt(), 130, "interrupted"),
], ids=["disk-full", "permission", "io", "memory", "interrupt"])
def test_environment_errors_are_one_line(tiny_ckpt, monkeypatch, capfd, exc, code, line):
    got, err = run_generate_raising(tiny_ckpt, monkeypatch, capfd, exc)
    assert got == code and err.strip() == line, err


@pytest.mark.parametrize("where", ["TMPDIR", "inductor cache"])
def test_compiling_on_a_full_disk_is_one_line(tiny_ckpt, tmp_path, monkeypatch, capfd, where):
    """--compile where the compiler's files go to a full disk: inductor raises InductorError around the C++
    compiler's output (TMPDIR full: "error closing /tmp/ccX.s: No space left on device"), or around the OSError of
    writing its cache (no file named): one line naming the file, or the compiler's folder that is full, exit 1.
    The compiler is not run: warm-up raises what inductor raised on a 64 KiB tmpfs."""
    import cli
    import engine
    from torch._inductor.exc import CppCompileError, InductorError
    cache = tmp_path / "cache"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    monkeypatch.setattr(cli, "free_bytes", lambda folder: 0 if folder == str(cache) else 2 ** 40)
    inner = (CppCompileError(["g++", "-x", "c++-header"], f"cpp_prefix.h:1490:2: fatal error: error closing "
                                                          f"{tmp_path}/ccA.s: No space left on device\n")
             if where == "TMPDIR" else OSError(28, "No space left on device"))

    def warm_up(self, model, first_id):
        raise InductorError(inner, None) from inner
    monkeypatch.setattr(engine.Generation, "warm_up", warm_up)
    code = generate.main(["--checkpoint", str(tiny_ckpt), *PROMPT, "--compile"])
    err = capfd.readouterr().err.strip().splitlines()
    full = f"{tmp_path}/ccA.s" if where == "TMPDIR" else str(cache)
    assert code == 1 and err == [f"error: {full}: No space left on device (free some space, or point TMPDIR and "
                                 "TORCHINDUCTOR_CACHE_DIR at another disk, then run again)"], err


def test_safetensors_io_error_names_the_file(tmp_path, monkeypatch, capfd):
    """safetensors reports a failed write as SafetensorError without the file: run_cli finds the file its caller
    passed, and it is an environment failure (exit 1)."""
    import torch
    from safetensors.torch import save_file

    import cli

    def run(a):
        save_file({"w": torch.zeros(4)}, str(tmp_path / "no" / "such" / "w.safetensors"))
    assert cli.run_cli(run, None) == 1
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and f"error: {tmp_path}/no/such/w.safetensors: No such file or directory" in err, err


def test_full_disk_during_quantize(tiny_ckpt, tmp_path, capfd):
    """A real full disk (RLIMIT_FSIZE: writes past 64 KiB fail with EFBIG, which Python ignores as a signal): one line
    naming the file, exit 1, and no loadable checkpoint left behind (the engine file, written last, is absent, and a
    folder without it is refused as an unfinished quantization)."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        code = quantize_script.main(["--checkpoint", str(tiny_ckpt), "--out", str(tmp_path / "q"), "--mode", "int8"])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    err = capfd.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "File too large" in err and str(tmp_path / "q") in err, err
    assert not (tmp_path / "q" / "budgetkv.safetensors").exists()
    assert generate.main(["--checkpoint", str(tmp_path / "q"), *PROMPT]) == 2
    assert "unfinished quantization" in capfd.readouterr().err


# ------------------------------------------------------------------------------------ chat turns from stdin

class RecordingChat:
    """What chat.repl needs of a Chat, recording the turns it sends (no model)."""
    name, protocol, budget = "keydiff", "block", 8

    def __init__(self):
        self.sent, self.resets = [], 0

    def send(self, text, on_text=None):
        self.sent.append(text)
        return "ok"

    def reset(self):
        self.resets += 1

    def stop(self):
        pass


@pytest.mark.parametrize("template", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% set l = range(100000)|list %}{% for a in l %}{% for b in l %}{% endfor %}{% endfor %}"],
    ids=["range", "list"])
def test_a_chat_template_that_loops_is_stopped(tiny_ckpt, tmp_path, monkeypatch, capfd, template):
    """A template looping 10^10 times, writing nothing and calling nothing in its inner loop, stops at
    tokenizer.TEMPLATE_SECONDS (checked at every line of the template's code) with one line naming its file."""
    import time

    import tokenizer
    monkeypatch.setattr(tokenizer, "TEMPLATE_SECONDS", 0.5)
    tok_config(chat_template=template)(tmp_path, tiny_ckpt)
    t = time.monotonic()
    code = generate.main(["--checkpoint", str(tmp_path / "bad"), *PROMPT])
    err = capfd.readouterr().err.strip().splitlines()
    assert code == 2 and time.monotonic() - t < 30, err
    assert err == [f"error: the chat template in {tmp_path / 'bad' / 'tokenizer_config.json'} fails: TemplateLimit: "
                   "runs longer than 0.5 s (--no-chat skips it)"]


def test_a_bad_chat_turn_is_one_line_and_the_chat_goes_on():
    """A turn that is not UTF-8 and commands with an argument: each is one line naming what is wrong, none reaches
    the model, and the next turn is read."""
    import io

    import chat
    lines = [b"hello", b"caf\xe9 au lait", b"/reset now", b"/stats please", b"after"]
    surrogates = io.StringIO("hello\ncaf\udce9 au lait\n/reset now\n/stats please\nafter\n")  # a C locale's stdin
    for stdin in (io.TextIOWrapper(io.BytesIO(b"\n".join(lines) + b"\n"), encoding="utf-8"), surrogates):
        rec, out, err = RecordingChat(), io.StringIO(), io.StringIO()
        assert chat.repl(rec, stdin=stdin, out=out, err=err) == 0
        assert rec.sent == ["hello", "after"] and rec.resets == 0
        assert err.getvalue().splitlines() == [
            "error: the turn is not valid UTF-8 text (at character 4): skipped",
            "error: /reset takes no argument", "error: /stats takes no argument"]


@pytest.mark.parametrize("source", ["/dev/zero", "a long line"])
def test_a_chat_turn_is_read_no_further_than_the_cap(monkeypatch, tmp_path, source):
    """stdin that never ends a line (/dev/zero) or a line over the cap is read up to the cap, not into memory, and
    ends the chat with one line (exit 2)."""
    import chat
    from errors import UserError
    monkeypatch.setattr(chat, "MAX_TURN_BYTES", 1 << 20)
    if source != "/dev/zero":
        (tmp_path / "turns").write_bytes(b"x" * (3 << 20) + b"\nhello\n")
    with open(source if source == "/dev/zero" else tmp_path / "turns", "rb") as f:
        with pytest.raises(UserError, match="a turn on stdin is longer than 1 MiB"):
            chat.repl(RecordingChat(), stdin=f)
        assert f.tell() <= (1 << 20) + 1


@pytest.mark.parametrize("stream", ["stdin", "stdout"])
def test_a_closed_standard_stream_is_one_line(tiny_ckpt, capfd, monkeypatch, stream):
    """Started with stdin or stdout closed (<&-, >&-: Python's sys.stdin / sys.stdout are None)."""
    import sys
    monkeypatch.setattr(sys, stream, None)
    argv = ["--checkpoint", str(tiny_ckpt)] + (["--interactive"] if stream == "stdin" else PROMPT)
    code = run_entry("generate", argv)
    err = capfd.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert (code, err.strip()) == ((2, "error: --interactive reads its turns from stdin, which is closed")
                                   if stream == "stdin" else
                                   (1, "error: standard output is closed: give it a file or /dev/null"))


def test_a_turn_longer_than_the_context_says_so_without_suggesting_reset():
    """No conversation holds a turn of the context's length: the line says to shorten it, not to /reset; a turn
    that fits a fresh conversation but not this one still suggests /reset."""
    from types import SimpleNamespace

    import chat
    state = SimpleNamespace(position=0, model=SimpleNamespace(args=SimpleNamespace(max_seq_len=16)),
                            max_new_tokens=4, policy="keydiff", budget=8)
    with pytest.raises(chat.TurnRefused) as e:
        chat.Chat.room(state, 16)
    assert str(e.value) == ("this turn's 16 tokens leave no room for an answer in the model's context of 16 tokens: "
                            "shorten it")
    state.position = 10
    with pytest.raises(chat.TurnRefused, match="/reset starts a new conversation"):
        chat.Chat.room(state, 8)



@pytest.mark.parametrize("name", ["p.jsonl", "p.JSONL", "p.Jsonl"])
def test_a_jsonl_prompt_file_is_a_batch_in_any_case_and_one_line_speculates(tiny_ckpt, tmp_path, name):
    """A .jsonl prompt file is a batch whatever the case of its suffix; one line of it is one sequence, which
    --speculate accepts."""
    path = tmp_path / name
    path.write_text('{"prompt": "the quick"}\n{"prompt": "brown fox"}\n')
    a = generate.parse_args(["--checkpoint", str(tiny_ckpt), "--prompt-file", str(path)])
    assert generate.read_prompts(a) == ["the quick", "brown fox"]
    path.write_text('{"prompt": "the quick"}\n')
    a = generate.parse_args(["--checkpoint", str(tiny_ckpt), "--prompt-file", str(path), "--speculate", "2"])
    generate.check_args(a)
    assert generate.read_prompts(a) == ["the quick"]


@pytest.mark.parametrize("delay", [0.0, 1.0, 2.0])
def test_ctrl_c_while_starting_is_one_line(tiny_ckpt, delay):
    """SIGINT while torch imports (`delay` after its library is mapped), while the checkpoint loads or while it
    generates: `interrupted`, never a KeyboardInterrupt traceback (generate.py's first statements install the hook:
    errors.check_python). A signal that lands once the run has printed its summary (a fast machine) may end the
    process by SIGINT at exit, with the output whole."""
    import signal
    import subprocess
    import sys
    import time
    from conftest import REPO
    p = subprocess.Popen([sys.executable, str(REPO / "generate.py"), "--checkpoint", str(tiny_ckpt), *PROMPT],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while "libtorch" not in Path(f"/proc/{p.pid}/maps").read_text() and p.poll() is None:
        assert time.monotonic() < deadline, "torch never loaded"
        time.sleep(0.01)
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert p.returncode in (130, -signal.SIGINT, 0), (p.returncode, err)
    finished = err.strip().endswith("MiB") and "peak memory" in err  # the run's whole summary: done before the signal
    assert err.strip() in ("", "interrupted") or finished, err


@pytest.mark.parametrize("batch", [1, 4])
def test_caches_larger_than_the_free_memory_are_one_line_before_they_are_allocated(tiny_ckpt, capfd, monkeypatch,
                                                                                   batch):
    """Real weights, as random ones are: the KV caches a run needs are checked against the memory left once the
    weights are loaded, before setup allocates them (here the free memory is made smaller than one cache)."""
    import engine
    import loading
    monkeypatch.setattr(loading, "free_memory", lambda device: 1000)
    allocated = []
    monkeypatch.setattr(engine, "setup_batch", lambda *a, **k: allocated.append(a))  # Generation.setup's allocation
    code = run_entry("generate", ["--checkpoint", str(tiny_ckpt), *PROMPT, "--batch-size", str(batch)])
    err = capfd.readouterr().err
    assert code == 2 and allocated == [] and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: the KV cache of {batch} sequence{'s' if batch > 1 else ''} in float32 needs ")
    assert "more than the 0.0 GiB free on cpu" in err


# the environment a command line reads: one line, exit 2, before any work
@pytest.mark.parametrize("value", ["abc", "0", "", "-1", "4,x", "\u0664"])
def test_a_thread_count_that_is_none_is_one_line(monkeypatch, capsys, value):
    """OMP_NUM_THREADS that libgomp would warn about (and ignore) is refused before torch loads OpenMP."""
    import errors
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    with pytest.raises(SystemExit) as e:
        errors.check_python()
    assert e.value.code == 2
    assert capsys.readouterr().err == (f"error: OMP_NUM_THREADS={value!r} is not a number of threads >= 1: unset it "
                                       "or give one such as 4\n")
    monkeypatch.setenv("OMP_NUM_THREADS", "4,2")
    errors.check_python()


@pytest.mark.parametrize("value", ["abc", "0", "-5", "nan", "inf", "", "0.001", "0.999"])
def test_a_tensor_parallel_timeout_that_is_none_is_one_line(monkeypatch, value):
    import ranks
    from errors import UserError
    monkeypatch.setenv("BUDGETKV_TP_TIMEOUT", value)
    with pytest.raises(UserError, match=f"BUDGETKV_TP_TIMEOUT={value!r} must be a number of seconds >= 1"):
        ranks.env_timeout_s()
    monkeypatch.setenv("BUDGETKV_TP_TIMEOUT", "2.5")
    assert ranks.env_timeout_s() == 2.5


@pytest.mark.parametrize("where", ["a file", "unwritable"])
def test_a_conversion_folder_that_cannot_be_made_is_one_line_before_converting(tiny_ckpt, tmp_path, monkeypatch,
                                                                                 where):
    """BUDGETKV_CHECKPOINTS under a file or an unwritable folder: refused before the GGUF is converted."""
    import checkpoint
    from errors import UserError
    base = tmp_path / "f" if where == "a file" else Path("/proc/none")
    if where == "a file":
        base.write_text("x")
    monkeypatch.setenv("BUDGETKV_CHECKPOINTS", str(base))
    monkeypatch.setattr(checkpoint, "read_gguf", lambda path: None)
    monkeypatch.setattr(checkpoint, "convert_gguf", lambda *a: pytest.fail("converted"))
    with pytest.raises(UserError, match=r"cannot create the conversion's folder \(BUDGETKV_CHECKPOINTS\) "):
        checkpoint.fresh_gguf(tmp_path / "m.gguf", base / "m")
