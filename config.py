"""config.json -> ModelArgs: every hyper-parameter comes from the checkpoint's config.json, never from a name, and
every value is checked by type and range before any weight is read (ConfigError names the field in one line);
weight_count, the parameters its sizes make."""
import math

import torch

from errors import UserError
from model import ModelArgs, rope_inv_freq

SUPPORTED_ARCHITECTURES = {"llama", "mistral", "qwen2"}
MAX_HEAD_DIM = 1 << 16  # models use 64-256; parse_config computes head_dim / 2 RoPE frequencies to check them
MAX_SIZE = 2 ** 31 - 1  # any one size or context (the largest are ~10^7); tensors index with int64
MAX_PARAMETERS = 2 ** 48  # ~3 * 10^14, a thousand times the largest model: no tensor's size overflows int64
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


class ConfigError(UserError):
    """A config.json this engine cannot run; the message is one line for the user."""


def parse_config(cfg: dict) -> ModelArgs:
    """ModelArgs from config.json, every value checked by type and range (ConfigError names the field)."""
    model_type = check_supported(cfg)
    check_sizes(cfg)
    n_heads, n_kv_heads, head_dim = head_shapes(cfg)
    eps = number(cfg, "rms_norm_eps", 1e-6)
    if not 0 < eps < 1:  # (a float32 norm overflows long before 1e300)
        raise ConfigError(f"config.json: rms_norm_eps must be > 0 and < 1, got {eps!r}")
    rope_theta, scaling = rope_of(cfg)
    window = sliding_window(cfg, model_type)
    attention_bias = flag(cfg, "attention_bias")
    args = ModelArgs(
        vocab_size=cfg["vocab_size"],
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        intermediate_size=cfg["intermediate_size"],
        norm_eps=eps,
        rope_theta=rope_theta,
        max_seq_len=cfg.get("max_position_embeddings") or 4096,
        rope_scaling=scaling,
        tie_embeddings=flag(cfg, "tie_word_embeddings"),
        # Qwen2 has q/k/v bias and a bias-free o_proj; Llama's attention_bias covers all four.
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=model_type != "qwen2" and attention_bias,
        sliding_window=window,
    )
    # Finite values can still overflow: the largest angle, position x frequency, must stay finite in fp32.
    inv_freq = rope_inv_freq(args)
    if not (torch.isfinite(inv_freq * args.max_seq_len).all() and (inv_freq >= 0).all()):
        raise ConfigError(f"config.json: rope_theta {rope_theta!r} with rope_scaling {scaling} gives RoPE "
                          "frequencies that are not finite")
    n = weight_count(args)
    if n > MAX_PARAMETERS:
        raise ConfigError(f"config.json: its sizes (vocab_size {args.vocab_size}, hidden_size {args.dim}, "
                          f"intermediate_size {args.intermediate_size}, {args.n_heads} heads of {head_dim}, "
                          f"{args.n_layers} layers) make {n:,} parameters, more than any model ({MAX_PARAMETERS:,})")
    return args


def weight_count(args: ModelArgs, world: int = 1) -> int:
    """The parameters of args' model from its sizes alone (no module built), a tied embedding counted once; world
    > 1: those one tensor-parallel rank holds (wqkv, wo, w13 and w2 sliced `world` ways, the rest whole)."""
    d, f, q, kv = args.dim, args.intermediate_size, args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    sliced = [(q + 2 * kv) * d, (q + 2 * kv) * args.qkv_bias, d * q, 2 * f * d, d * f]  # wqkv, its bias, wo, w13, w2
    whole = 2 * d + d * args.o_bias  # the two norms, wo's bias
    embeddings = args.vocab_size * d * (1 if args.tie_embeddings else 2)
    return args.n_layers * (sum(n // world for n in sliced) + whole) + embeddings + d


def check_supported(cfg: dict) -> str:
    """The model_type, if the engine runs it: a supported architecture, boolean flags, no MLP bias, SiLU."""
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or model_type not in SUPPORTED_ARCHITECTURES:
        archs = cfg.get("architectures")
        arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else model_type
        raise ConfigError(f"unsupported architecture {arch!r} (model_type {model_type!r}); "
                          f"budgetkv runs {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
    for key in ("mlp_bias", "tie_word_embeddings", "attention_bias", "use_sliding_window"):
        flag(cfg, key)
    if flag(cfg, "mlp_bias"):
        raise ConfigError("unsupported config: mlp_bias=true")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"unsupported activation {act!r} (only silu / SwiGLU)")
    return model_type


def check_sizes(cfg: dict) -> None:
    """The sizes are present where they have no default, and positive integers wherever they are given."""
    for key in SIZES:
        if cfg.get(key) is None:
            raise ConfigError(f"config.json lacks {key!r}")
    for key in SIZES + ("num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window"):
        v = cfg.get(key)
        if v is not None and (type(v) is not int or v < 1):  # None: absent, or a default applies
            raise ConfigError(f"config.json: {key} must be a positive integer, got {v!r}")
        if v is not None and v > MAX_SIZE:
            raise ConfigError(f"config.json: {key} is {v}, more than {MAX_SIZE} (no model's is that large)")


def head_shapes(cfg: dict) -> tuple[int, int, int]:
    """(n_heads, n_kv_heads, head_dim): whole GQA groups, and an even head_dim (RoPE rotates halves) of at most
    MAX_HEAD_DIM."""
    n_heads, dim = cfg["num_attention_heads"], cfg["hidden_size"]
    n_kv_heads = cfg.get("num_key_value_heads") or n_heads
    if n_heads % n_kv_heads:
        raise ConfigError(f"config.json: num_attention_heads {n_heads} is not a multiple of "
                          f"num_key_value_heads {n_kv_heads}")
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if dim % n_heads:
            raise ConfigError(f"config.json: hidden_size {dim} is not a multiple of num_attention_heads {n_heads} "
                              "(and no head_dim is given)")
        head_dim = dim // n_heads
    if head_dim % 2:
        raise ConfigError(f"config.json: head_dim {head_dim} must be even (RoPE rotates halves)")
    if head_dim > MAX_HEAD_DIM:
        what = "head_dim" if cfg.get("head_dim") is not None else "hidden_size / num_attention_heads"
        raise ConfigError(f"config.json: {what} is {head_dim}, more than {MAX_HEAD_DIM} (no model's heads are that "
                          "wide)")
    return n_heads, n_kv_heads, head_dim


def rope_of(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope scaling) over the whole head, from the top level (transformers 4.x) or rope_parameters
    (transformers 5), which must agree where both give a theta."""
    for where in (cfg, cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}):
        if where.get("partial_rotary_factor", 1.0) != 1.0:  # RoPE over part of each head: not implemented
            raise ConfigError(f"unsupported config: partial_rotary_factor {where['partial_rotary_factor']!r} "
                              "(budgetkv rotates the whole head)")
    rope = cfg.get("rope_parameters")
    if rope is not None and not isinstance(rope, dict):
        raise ConfigError(f"config.json: rope_parameters must be an object, got {rope!r}")
    rope = dict(rope or {})
    thetas = {name: number(d, "rope_theta", None, name) for name, d in (("rope_theta", cfg),
                                                                       ("rope_parameters.rope_theta", rope))}
    rope.pop("rope_theta", None)
    for name, theta in thetas.items():
        if theta is not None and theta <= 0:
            raise ConfigError(f"config.json: {name} must be > 0, got {theta!r}")
    if None not in thetas.values() and len(set(thetas.values())) > 1:
        raise ConfigError(f"config.json: rope_theta {thetas['rope_theta']!r} and rope_parameters.rope_theta "
                          f"{thetas['rope_parameters.rope_theta']!r} disagree")
    rope_theta = next((t for t in thetas.values() if t is not None), 10000.0)
    return rope_theta, rope_scaling(cfg, rope)


def sliding_window(cfg: dict, model_type: str) -> int | None:
    """The attention window, or None: Mistral's, or use_sliding_window's. HF Qwen2 slides only in layers >=
    max_window_layers (or as layer_types says); the engine has one window for all layers, so a mix is refused."""
    window = None
    if model_type == "mistral" or flag(cfg, "use_sliding_window"):
        window = cfg.get("sliding_window")
    if model_type != "qwen2" or window is None:
        return window
    n_layers = cfg["num_hidden_layers"]
    mwl = cfg.get("max_window_layers", n_layers)
    if type(mwl) is not int or mwl < 0:
        raise ConfigError(f"config.json: max_window_layers must be an integer >= 0, got {mwl!r}")
    kinds = cfg.get("layer_types")
    if not kinds:  # the layers below max_window_layers attend fully, the others slide (no list of every layer)
        kinds = ["full_attention"] * (mwl > 0) + ["sliding_attention"] * (mwl < n_layers)
    elif (not isinstance(kinds, list) or len(kinds) != n_layers
            or any(k not in ("sliding_attention", "full_attention") for k in kinds)):
        raise ConfigError(f"config.json: layer_types must list sliding_attention / full_attention for each "
                          f"of the {n_layers} layers")
    if len(set(kinds)) > 1:
        raise ConfigError("unsupported config: sliding-window attention in some layers only "
                          "(use_sliding_window with max_window_layers < num_hidden_layers)")
    return window if "sliding_attention" in kinds else None


def flag(cfg: dict, key: str) -> bool:
    """A config.json boolean (absent: false); anything but true / false is refused."""
    v = cfg.get(key, False)
    if v is None:
        return False
    if type(v) is not bool:
        raise ConfigError(f"config.json: {key} must be true or false, got {v!r}")
    return v


def number(cfg: dict, key: str, default, name: str | None = None):
    """A finite config.json number (absent or null: default) as a float."""
    v = cfg.get(key)
    if v is None:
        return default
    if type(v) not in (int, float) or not math.isfinite(v):
        raise ConfigError(f"config.json: {name or key} must be a finite number, got {v!r}")
    return float(v)


def rope_scaling(cfg: dict, rope: dict) -> dict | None:
    """The checked rope scaling of config.json (rope_scaling, or transformers 5's rope_parameters): None, or
    {"rope_type": "linear", "factor"} / {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}."""
    scaling = cfg.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise ConfigError(f"config.json: rope_scaling must be an object or null, got {scaling!r}")
    label = "rope_scaling"
    if not scaling and rope.get("rope_type", "default") != "default":
        scaling, label = rope, "rope_parameters"
    if not scaling:
        return None
    scaling = dict(scaling)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("llama3", "linear", "default"):
        raise ConfigError(f"unsupported rope scaling {kind!r} (llama3 and linear are supported)")
    if kind == "default":
        return None
    scaling["rope_type"] = kind
    need = ["factor"] + (["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
                         if kind == "llama3" else [])
    missing = [k for k in need if scaling.get(k) is None]
    if missing:
        raise ConfigError(f"config.json: {label} {kind} lacks {', '.join(missing)}")
    for k in need[:3]:
        v = number(scaling, k, None, f"{label}.{k}")
        if v <= 0:
            raise ConfigError(f"config.json: {label}.{k} must be > 0, got {scaling[k]!r}")
        scaling[k] = v
    if kind == "llama3":
        ctx = scaling["original_max_position_embeddings"]
        if type(ctx) is not int or not 1 <= ctx <= MAX_SIZE:
            raise ConfigError(f"config.json: {label}.original_max_position_embeddings must be an integer from 1 to "
                              f"{MAX_SIZE}, got {ctx!r}")
        if not scaling["low_freq_factor"] < scaling["high_freq_factor"]:
            raise ConfigError(f"config.json: {label}.low_freq_factor ({scaling['low_freq_factor']}) must be "
                              f"below high_freq_factor ({scaling['high_freq_factor']})")
    return scaling
