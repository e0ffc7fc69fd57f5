"""Logits parity with HF transformers on tiny random configs of each family, loaded through our converter."""
import pytest
import torch
from conftest import FAMILIES

from cache import setup_caches
from engine import block_inputs, load_model, model_step
from convert import ENGINE_FILE, convert_hf_dir

PROMPT_LEN, NEW, BLOCK = 300, 12, 64


@torch.inference_mode()
def engine_logits(model, ids, new_tokens, block_size):
    """Block-wise prefill then greedy decode; returns (all generated ids, logits [new_tokens, V])."""
    prompt = torch.tensor(ids)
    for start in range(0, len(ids), block_size):
        logits = model_step(model, *block_inputs(prompt, start, block_size))
    out, all_logits = [], []
    for i in range(new_tokens):
        all_logits.append(logits[0])
        tok = int(logits[0].argmax())
        out.append(tok)
        logits = model_step(model, torch.tensor([[tok]]), torch.tensor([len(ids) + i]))
    return out, torch.stack(all_logits)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_hf(family, hf_tiny):
    hf, ckpt = hf_tiny(family)
    model = load_model(ckpt, torch.float32, "cpu")  # straight from the HF safetensors
    setup_caches(model, 1, PROMPT_LEN + NEW, BLOCK)
    ids = torch.randint(0, FAMILIES[family]["vocab_size"], (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))
    out, logits = engine_logits(model, ids.tolist(), NEW, BLOCK)
    with torch.no_grad():
        ref = hf(torch.cat([ids, torch.tensor(out[:-1])])[None]).logits[0, PROMPT_LEN - 1:].float()
    assert ref.abs().max() > 1.0  # the comparison means something: logits are not all near zero
    diff = (logits - ref).abs().max().item()
    assert diff <= 1e-4, f"{family}: max |logits - HF| = {diff}"


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_prefill_with_one_mask_for_all_heads_equals_a_mask_per_head(family, hf_tiny, monkeypatch):
    """An eager prefill block of a cache without eviction gets one mask for every head (cache.update) and attends
    with SDPA's own grouped heads (model.Attention); forcing a mask per KV head (the folded rows every other step
    takes) gives the same logits."""
    import cache as cache_py
    _, ckpt = hf_tiny(family)
    model = load_model(ckpt, torch.float32, "cpu")
    ids = torch.randint(0, FAMILIES[family]["vocab_size"], (PROMPT_LEN,), generator=torch.Generator().manual_seed(2))
    heads, attention_mask = [], cache_py.attention_mask

    def logits(per_head: bool):
        def mask(slot_pos, query_pos, window):
            heads.append(slot_pos.shape[1])
            if per_head:
                slot_pos = slot_pos.expand(-1, model.args.n_kv_heads, -1)
            return attention_mask(slot_pos, query_pos, window)
        monkeypatch.setattr(cache_py, "attention_mask", mask)
        setup_caches(model, 1, PROMPT_LEN + NEW, BLOCK)
        return engine_logits(model, ids.tolist(), NEW, BLOCK)
    shared = logits(False)
    assert 1 in heads and model.args.n_kv_heads < model.args.n_heads  # the shared mask was taken, with GQA
    per_head = logits(True)
    assert shared[0] == per_head[0]
    torch.testing.assert_close(shared[1], per_head[1], rtol=1e-5, atol=1e-5)


def test_converted_engine_file_matches_on_the_fly(hf_tiny, tmp_path):
    import shutil
    hf, ckpt = hf_tiny("qwen2")
    d = tmp_path / "qwen2"
    shutil.copytree(ckpt, d)
    convert_hf_dir(d)
    assert (d / ENGINE_FILE).is_file()
    a, b = load_model(ckpt, torch.float32, "cpu"), load_model(d, torch.float32, "cpu")
    assert a.output.weight is a.tok_embeddings.weight  # tied
    for (na, ta), (nb, tb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(ta, tb)


def test_sliding_window_matters(hf_tiny):
    """Negative control for the Mistral case: without the window the logits differ from HF."""
    hf, ckpt = hf_tiny("mistral")
    model = load_model(ckpt, torch.float32, "cpu")
    model.args.sliding_window = None
    setup_caches(model, 1, PROMPT_LEN + NEW, BLOCK)
    ids = torch.randint(0, 512, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))
    out, logits = engine_logits(model, ids.tolist(), 1, BLOCK)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0, -1]
    assert (logits[0] - ref).abs().max() > 1e-2


@pytest.mark.parametrize("max_window_layers,want", [(0, 48), (2, None), (5, None), (1, "error")])
def test_qwen2_sliding_window_follows_max_window_layers(max_window_layers, want):
    """HF Qwen2 slides only in layers >= max_window_layers; the engine has one window for all layers, so it takes the
    window when every layer slides, none when no layer does, and refuses a mix (it once slid in every layer)."""
    from config import ConfigError, parse_config
    cfg = dict(FAMILIES["qwen2"], use_sliding_window=True, sliding_window=48, max_window_layers=max_window_layers)
    if want == "error":
        with pytest.raises(ConfigError, match="sliding-window attention in some layers only"):
            parse_config(cfg)
    else:
        assert parse_config(cfg).sliding_window == want
    if want != "error":  # transformers 5 writes layer_types; it wins
        types = ["sliding_attention", "full_attention"]
        with pytest.raises(ConfigError):
            parse_config(dict(cfg, layer_types=types))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16, 17])
def test_attention_few_query_rows_compiled_equals_sdpa(rows, dtype, monkeypatch):
    """model.attention compiled on CPU: 1-16 query rows take the row-wise scores (rowwise_product over the keys),
    17 take SDPA; both equal eager SDPA (fp32: to rounding; bf16: within bf16's rounding of a reference in fp32),
    batch of 2, masks with holes and a fully visible row."""
    import model
    torch.manual_seed(0)
    B, h, S, d = 2, 3, 200, 16
    q, keys, values = (torch.randn(B, h, n, d) for n in (rows, S, S))
    mask = torch.rand(B, h, rows, S) > 0.3
    mask[..., 0] = True  # every row sees at least one slot
    mask[0, 0, 0] = True
    ref = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    calls, rowwise_product = [], model.rowwise_product

    def counted(*args):
        calls.append(1)  # at trace time: which form the compiled graph holds
        return rowwise_product(*args)
    torch._dynamo.reset()
    monkeypatch.setattr(model, "rowwise_product", counted)
    compiled = torch.compile(model.attention, fullgraph=True, dynamic=False)
    out = compiled(*(t.to(dtype) for t in (q, keys, values)), mask)
    assert bool(calls) == (rows <= model.ROWWISE_MAX_QUERY_ROWS)
    assert out.dtype == dtype and out.shape == ref.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    assert not torch.allclose(out.float(), torch.nn.functional.scaled_dot_product_attention(q, keys, values),
                              atol=1e-3)  # the mask mattered


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4, 20])
def test_matmul_attention_equals_sdpa(rows, dtype):
    """model.matmul_attention (CUDA's form for steps of a few query rows: two products and an fp32 softmax) equals
    SDPA computed in fp32: batch of 2, masks with holes, the last row seeing one slot only."""
    import model
    torch.manual_seed(1)
    B, h, S, d = 2, 4, 300, 32
    q, keys, values = (torch.randn(B, h, n, d) for n in (rows, S, S))
    mask = torch.rand(B, h, rows, S) > 0.4
    mask[..., 0] = True
    mask[..., -1, 1:] = False
    ref = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    out = model.matmul_attention(*(t.to(dtype) for t in (q, keys, values)), mask)
    assert out.dtype == dtype and out.shape == ref.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(out[..., -1, :].float(), values[..., 0, :].to(dtype).float())  # one slot: its value


@pytest.mark.parametrize("rows", [1, 3, 8, 16, 17])
def test_linear_few_rows_compiled_equals_f_linear(rows, monkeypatch):
    """model.Linear's CPU forms (the compiled per-row reductions for 1-8 rows, W @ x^T for 2-16) compute F.linear,
    contiguous, in the input's shape (a batch of 2 x rows/2 as well)."""
    import model
    from model import Linear, rowwise_linear
    torch.manual_seed(0)
    lin = Linear(48, 40, bias=True)
    x = torch.randn(1, rows, 48)
    ref = torch.nn.functional.linear(x, lin.weight, lin.bias)
    torch.testing.assert_close(lin(x), ref, rtol=1e-5, atol=1e-5)
    assert lin(x).is_contiguous()  # else its q reaches SDPA with a strided last dim: the slow math kernel
    calls = []

    def counted(*args):
        calls.append(1)  # at trace time: which form the compiled graph holds
        return rowwise_linear(*args)
    torch._dynamo.reset()
    monkeypatch.setattr(model, "rowwise_linear", counted)
    compiled = torch.compile(lin, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(x), ref, rtol=1e-5, atol=1e-5)
    assert bool(calls) == (rows <= model.ROWWISE_MAX_ROWS)
    assert compiled(x).is_contiguous()
    if rows % 2 == 0:
        xb = x.view(2, rows // 2, 48)
        torch.testing.assert_close(compiled(xb), ref.view(2, rows // 2, 40), rtol=1e-5, atol=1e-5)

