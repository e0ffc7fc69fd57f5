"""--kv-dtype int8: the static buffer stores K and V as int8 with one scale per token and head (cache.py); every
policy scores the dequantized keys/values, so with well-separated scores it keeps the same tokens as fp32 KV."""

import pytest
import torch
from conftest import generate_compiled, make_policy

from cache import dequantize_rows, kv_bytes, quantize_rows, setup_caches
from engine import generate
from runtime import model_step, prefill_step
from loading import load_model

EAGER = (prefill_step, model_step)


pytestmark = pytest.mark.usefixtures("one_thread")


def ids_of(n, seed):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_round_trip_error_bound():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 50, 64, generator=g) * torch.rand(2, 3, 50, 1, generator=g) * 10
    q, scale = quantize_rows(x)
    assert q.dtype == torch.int8 and scale.shape == x.shape[:-1]
    err = (dequantize_rows(q, scale, torch.float32) - x).abs()
    assert (err <= scale[..., None] / 2 + 1e-6).all()  # rounding: at most half a step per element
    assert (err.amax(-1) / x.abs().amax(-1)).max() <= 1 / 254 + 1e-6
    assert q.abs().amax(-1).eq(127).all()  # the largest element of each row uses the full range
    xb = x.bfloat16()  # a bf16 cache stores bf16 scales: the bound holds for the stored scale too
    qb, sb = quantize_rows(xb)
    assert sb.dtype == torch.bfloat16
    errb = (dequantize_rows(qb, sb, torch.float32) - xb.float()).abs()
    assert (errb <= sb.float()[..., None] / 2 * (1 + 1e-5) + 1e-6).all()
    z, zs = quantize_rows(torch.zeros(4, 8))  # an all-zero row stays zero (no division by zero)
    assert (dequantize_rows(z, zs, torch.float32) == 0).all()
    # fp16 scales of tiny rows (max |x| / 127 below fp16's normal range) once rounded to 0: 0 / 0 made NaN codes.
    # Floored at fp16's smallest normal, the error stays within half a step of the stored scale.
    tiny = torch.tensor([[0.0, 0.0, 0.0, 0.0], [3e-6, -1e-6, 2e-6, 0.0], [1e-2, -5e-3, 2e-3, 0.0]],
                        dtype=torch.float16)
    qt, st = quantize_rows(tiny)
    assert (st > 0).all() and (qt[0] == 0).all() and qt[2].abs().max() == 127
    errt = (dequantize_rows(qt, st, torch.float32) - tiny.float()).abs()
    assert (errt <= st.float()[..., None] / 2 * (1 + 1e-3)).all()


def kept(model):
    return [layer.attention.kv_cache.pos[0].sort(-1).values.clone() for layer in model.layers]


PARAMS = dict(window_frac=0.1, n_sink=4, seed=0)


def test_int8_logits_close_and_buffer_smaller(hf_tiny):
    _, ckpt = hf_tiny("llama")
    model = load_model(ckpt, torch.float32, "cpu")
    prompt = torch.tensor(ids_of(60, seed=5))
    from engine import block_inputs
    logits = {}
    for kv_dtype in (None, torch.int8):
        setup_caches(model, 1, 64, 64, kv_dtype=kv_dtype)
        with torch.inference_mode():
            logits[kv_dtype] = model_step(model, *block_inputs(prompt, 0, 64))
        logits[f"bytes{kv_dtype}"] = kv_bytes(model)
    diff = (logits[None] - logits[torch.int8]).abs().max().item()
    assert 0 < diff < 0.05 * logits[None].abs().max().item(), diff  # int8 is used (not exact) and close
    D = model.args.head_dim
    assert logits[f"bytes{torch.int8}"] / logits[f"bytes{None}"] == pytest.approx((D + 4) / (4 * D))


def test_int8_kv_compiles_without_recompiles(hf_tiny):
    _, ckpt = hf_tiny("qwen2")
    model = load_model(ckpt, torch.float32, "cpu")
    prompt = ids_of(100, seed=6)
    setup_caches(model, 1, 48, 16, make_policy("keydiff", PARAMS), kv_dtype=torch.int8)
    out_e, _ = generate(model, prompt, 70, block_size=16, steps=EAGER)
    kept_e = kept(model)
    out_c = generate_compiled(model, prompt, 70, 16)
    assert out_c == out_e
    assert all(torch.equal(a, b) for a, b in zip(kept(model), kept_e))


def test_bf16_kv_logits_close_and_buffer_half(hf_tiny):
    """--kv-dtype bfloat16 under fp32 weights: the buffer is half an fp32 one, and a step's logits move by the
    rounding of K/V to bf16 only (used: not bit-equal; close)."""
    _, ckpt = hf_tiny("llama")
    model = load_model(ckpt, torch.float32, "cpu")
    prompt = torch.tensor(ids_of(60, seed=5))
    from engine import block_inputs
    logits, sizes = {}, {}
    for kv_dtype in (None, torch.bfloat16):
        setup_caches(model, 1, 64, 64, kv_dtype=kv_dtype)
        assert model.layers[0].attention.kv_cache.k.dtype == (kv_dtype or torch.float32)
        with torch.inference_mode():
            logits[kv_dtype] = model_step(model, *block_inputs(prompt, 0, 64))
        sizes[kv_dtype] = kv_bytes(model)
    assert logits[torch.bfloat16].dtype == torch.float32
    diff = (logits[None] - logits[torch.bfloat16]).abs().max().item()
    assert 0 < diff < 0.02 * logits[None].abs().max().item(), diff
    assert sizes[torch.bfloat16] * 2 == sizes[None]


def test_bf16_kv_compiled_keydiff_matches_eager(hf_tiny):
    """An evicting cache's compiled step attends through SDPA on widened copies, as eager does: eager's tokens and
    kept sets, under error_on_recompile."""
    _, ckpt = hf_tiny("qwen2")
    model = load_model(ckpt, torch.float32, "cpu")
    prompt = ids_of(100, seed=6)
    setup_caches(model, 1, 48, 16, make_policy("keydiff", PARAMS), kv_dtype=torch.bfloat16)
    out_e, _ = generate(model, prompt, 70, block_size=16, steps=EAGER)
    kept_e = kept(model)
    out_c = generate_compiled(model, prompt, 70, 16)
    assert model.layers[0].attention.kv_cache.k.dtype == torch.bfloat16
    assert out_c == out_e
    assert all(torch.equal(a, b) for a, b in zip(kept(model), kept_e))


def test_bf16_kv_compiled_rowwise_step_close_to_eager(hf_tiny):
    """`full`'s compiled decode step reads the bf16 cache in place (keys widened in the row-wise loop, the values'
    product in bf16, its weights rounded to bf16): its logits are eager's (fp32 SDPA over widened copies) up to that
    rounding, step after step without a recompile. Not token for token: the rounding is the compiled step's own."""
    _, ckpt = hf_tiny("qwen2")
    model = load_model(ckpt, torch.float32, "cpu")
    prompt = torch.tensor(ids_of(100, seed=6))
    setup_caches(model, 1, 128, 16, kv_dtype=torch.bfloat16)
    from engine import block_inputs
    with torch.inference_mode():
        for start in range(0, 96, 16):
            model_step(model, *block_inputs(prompt, start, 16))
    buffers = [t.clone() for layer in model.layers for t in layer.attention.kv_cache.slot_buffers()]

    def restore():
        for t, saved in zip((t for layer in model.layers for t in layer.attention.kv_cache.slot_buffers()), buffers):
            t.copy_(saved)
    torch._dynamo.reset()
    step = torch.compile(model_step, fullgraph=True, dynamic=False)
    try:
        with torch.inference_mode(), torch._dynamo.config.patch(error_on_recompile=True):
            for i in range(96, 100):
                idx, pos = prompt[None, i:i + 1], torch.tensor([i])
                restore()
                eager = model_step(model, idx, pos)
                restore()
                compiled = step(model, idx, pos)
                assert (compiled - eager).abs().max() < 0.01 * eager.abs().max()
                buffers = [t.clone() for layer in model.layers for t in layer.attention.kv_cache.slot_buffers()]
    finally:
        torch._dynamo.reset()
