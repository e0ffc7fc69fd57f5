"""Convert a Hugging Face checkpoint (safetensors) or a llama.cpp GGUF file into a budgetkv checkpoint (the library;
the command line is scripts/convert_hf_checkpoint.py).

A budgetkv checkpoint is a directory with `config.json` (HF format), `budgetkv.safetensors` (engine names, fused
q/k/v and gate/up, HF rotate-half layout) and the tokenizer files. HF directories are converted in place (the
engine file lands beside the HF files, as gpt-fast does); a GGUF becomes a new directory.

Nothing is ever unpickled: only safetensors (and GGUF) are read.
"""
import json
from pathlib import Path

import torch

ENGINE_FILE = "budgetkv.safetensors"
# Written into a converted GGUF's config.json; an older conversion is redone (2: tokenizer.ggml.pre honoured).
GGUF_CONVERTER = 2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read; the message is one line for the user."""


def hf_to_engine(get, names: set[str], n_layers: int, tied: bool) -> dict[str, torch.Tensor]:
    """Rename and fuse HF Llama/Mistral/Qwen2 tensors. `get(name)` loads one tensor, `names` lists those present."""
    def need(name):
        if name not in names:
            raise CheckpointError(f"the checkpoint lacks tensor {name!r}")
        return get(name)

    out = {"tok_embeddings.weight": need("model.embed_tokens.weight"), "norm.weight": need("model.norm.weight")}
    if not tied:
        out["output.weight"] = need("lm_head.weight")
    for i in range(n_layers):
        p, e = f"model.layers.{i}.", f"layers.{i}."
        out[e + "attention_norm.weight"] = need(p + "input_layernorm.weight")
        out[e + "ffn_norm.weight"] = need(p + "post_attention_layernorm.weight")
        out[e + "attention.wqkv.weight"] = torch.cat([need(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
        if p + "self_attn.q_proj.bias" in names:
            out[e + "attention.wqkv.bias"] = torch.cat([need(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
        out[e + "attention.wo.weight"] = need(p + "self_attn.o_proj.weight")
        if p + "self_attn.o_proj.bias" in names:
            out[e + "attention.wo.bias"] = need(p + "self_attn.o_proj.bias")
        out[e + "feed_forward.w13.weight"] = torch.cat([need(p + "mlp.gate_proj.weight"), need(p + "mlp.up_proj.weight")])
        out[e + "feed_forward.w2.weight"] = need(p + "mlp.down_proj.weight")
    return out


def read_hf_dir(ckpt_dir: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Engine-named tensors from an HF directory's *.safetensors (sharded or not), read lazily one at a time."""
    from safetensors import SafetensorError, safe_open

    config = read_config(ckpt_dir)
    files = sorted(f for f in ckpt_dir.glob("*.safetensors") if f.name != ENGINE_FILE)
    if not files:
        raise CheckpointError(f"{ckpt_dir} has no *.safetensors weights")
    where = {}
    try:
        handles = [safe_open(str(f), "pt", device="cpu") for f in files]
        for h in handles:
            for name in h.keys():
                where[name] = h
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read the safetensors in {ckpt_dir} (truncated or corrupt?): {e}") from None

    def get(name):
        try:
            t = where[name].get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read tensor {name} in {ckpt_dir} (truncated or corrupt?): {e}") from None
        return t.to(dtype) if dtype is not None else t

    tied = bool(config.get("tie_word_embeddings", False)) or "lm_head.weight" not in where
    n_layers = config.get("num_hidden_layers")
    if type(n_layers) is not int or n_layers < 1:
        raise CheckpointError(f"{ckpt_dir}/config.json lacks a valid num_hidden_layers")
    return hf_to_engine(get, set(where), n_layers, tied)


def read_config(ckpt_dir: Path) -> dict:
    path = ckpt_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{ckpt_dir} has no config.json")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return config


def save_engine(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file
    tmp = path.with_suffix(".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "budgetkv"})
    tmp.replace(path)  # a crash mid-write never leaves a truncated engine file behind


def convert_hf_dir(ckpt_dir: Path) -> Path:
    """Write budgetkv.safetensors beside the HF files; returns the directory."""
    save_engine(read_hf_dir(ckpt_dir), ckpt_dir / ENGINE_FILE)
    return ckpt_dir


# ----------------------------------------------------------------------------------------------------------- GGUF

def _gguf_value(reader, key, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.parts[field.data[0]]
    if field.types and field.types[0].name == "STRING":
        return bytes(value).decode("utf-8")
    return value.tolist()[0]


def unpermute_gguf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved-pair RoPE layout -> HF rotate-half layout)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a llama / qwen2 GGUF to float32, write config.json, budgetkv.safetensors and tokenizer files."""
    import gguf
    import numpy as np

    from tokenizer import write_gguf_tokenizer

    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except Exception as e:  # gguf raises bare ValueError / struct errors on bad files
        raise CheckpointError(f"cannot read GGUF file {gguf_path}: {e}") from None
    arch = _gguf_value(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise CheckpointError(f"unsupported GGUF architecture {arch!r} (llama and qwen2 are supported)")

    def meta(key, default=None):
        return _gguf_value(reader, f"{arch}.{key}", default)

    n_heads, n_kv = meta("attention.head_count"), meta("attention.head_count_kv", meta("attention.head_count"))
    dim = meta("embedding_length")
    eps = meta("attention.layer_norm_rms_epsilon")
    if eps is None:
        raise CheckpointError(f"GGUF file {gguf_path.name} lacks {arch}.attention.layer_norm_rms_epsilon")
    # llama.cpp keeps Llama 3.1-style RoPE scaling as per-frequency factors (a rope_freqs tensor) instead of the
    # parameters the engine's config takes; converting without them would silently misplace every position.
    scaling = meta("rope.scaling.type", "none")
    factor = meta("rope.scaling.factor")
    freq_factors = any(t.name == "rope_freqs.weight" for t in reader.tensors)
    if freq_factors or scaling not in ("none", "linear") or (scaling == "linear" and not factor):
        kind = "per-frequency factors (rope_freqs)" if freq_factors else repr(scaling)
        raise CheckpointError(f"GGUF file {gguf_path.name} uses RoPE scaling by {kind}, which the GGUF converter "
                              "does not carry over; use the model's HF checkpoint instead")
    tensors = {}
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        tensors[t.name] = torch.from_numpy(np.array(data, dtype=np.float32))  # a writable copy
    config = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "model_type": arch,
        "vocab_size": tensors["token_embd.weight"].shape[0],
        "hidden_size": dim,
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": meta("rope.dimension_count", dim // n_heads),
        "rms_norm_eps": float(f"{eps:.7g}"),  # stored as float32: 1e-5
        "rope_theta": meta("rope.freq_base", 10000.0),
        "rope_scaling": {"rope_type": "linear", "factor": factor} if scaling == "linear" else None,
        "max_position_embeddings": meta("context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "source": f"converted from {gguf_path.name}",
        "gguf_converter": GGUF_CONVERTER,
        "gguf_source": gguf_identity(gguf_path),
    }
    names = {
        "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    gguf_layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                  "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                  "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                  "mlp.down_proj": "ffn_down"}
    for i in range(config["num_hidden_layers"]):
        for hf, g in gguf_layer.items():
            for kind in ("weight", "bias"):
                names[f"model.layers.{i}.{hf}.{kind}"] = f"blk.{i}.{g}.{kind}"

    def get(name):
        t = tensors[names[name]]
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):  # llama.cpp permutes only llama q/k
            t = unpermute_gguf(t, n_heads if ".q_proj." in name else n_kv)
        return t

    present = {hf for hf, g in names.items() if g in tensors}
    engine = hf_to_engine(get, present, config["num_hidden_layers"], config["tie_word_embeddings"])
    out_dir.mkdir(parents=True, exist_ok=True)
    write_gguf_tokenizer(reader, out_dir)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    save_engine(engine, out_dir / ENGINE_FILE)
    return out_dir


def gguf_identity(gguf_path: Path) -> dict:
    return {"path": str(gguf_path.resolve()), "bytes": gguf_path.stat().st_size}


def gguf_converted(out_dir: Path, gguf_path: Path) -> bool:
    """Whether out_dir holds a conversion of this very file (two GGUFs may share a name) by this convert_gguf."""
    try:
        cfg = json.loads((out_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return ((out_dir / ENGINE_FILE).is_file() and cfg.get("gguf_converter") == GGUF_CONVERTER
            and cfg.get("gguf_source") == gguf_identity(gguf_path))

