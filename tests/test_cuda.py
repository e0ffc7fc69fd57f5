"""CUDA-only tests (marked `cuda`: skipped without a GPU; scripts/gpu_check.sh runs them as `pytest -m cuda`)."""
import pytest
import torch

from conftest import REPO
from engine import PeakMemory, setup
from loading import load_model, random_model

pytestmark = pytest.mark.cuda


def test_cuda_logits_match_cpu(hf_tiny):
    _, ckpt = hf_tiny("llama31")
    idx = torch.randint(0, 512, (1, 64), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(64)
    logits = {}
    torch.backends.cuda.matmul.allow_tf32 = False
    for device in ("cpu", "cuda"):
        model = load_model(ckpt, torch.float32, device)
        setup(model, None, 65, 64, 1, 64)
        with torch.inference_mode():
            logits[device] = model(idx.to(device), pos.to(device)).cpu()
    torch.testing.assert_close(logits["cuda"], logits["cpu"], rtol=1e-4, atol=1e-4)


def test_random_weights_are_made_on_the_device_without_a_host_copy():
    """bfloat16 random weights of smollm2-360m's shapes (~0.7 GB) filled on the GPU: the process RSS grows by far
    less than the weights."""
    import json

    def rss():
        return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmRSS:"))
    config = json.loads((REPO / "configs" / "smollm2-360m.json").read_text())
    before_rss, before_gpu = rss(), torch.cuda.memory_allocated()
    model = random_model(config, torch.bfloat16, "cuda")
    weights = sum(p.nbytes for p in model.parameters())
    assert all(p.is_cuda and p.dtype == torch.bfloat16 for p in model.parameters())
    assert torch.cuda.memory_allocated() - before_gpu >= weights
    assert rss() - before_rss < weights / 4


def test_peak_memory_on_cuda_is_max_memory_allocated():
    mem = PeakMemory("cuda")
    assert mem.measure == "cuda max_memory_allocated"
    mem.reset()
    base = torch.cuda.memory_allocated()
    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    del x
    assert mem.peak() - base >= 64 << 20


def test_keydiff_decode_replays_as_a_cuda_graph(hf_tiny):
    """gpu_check's per-policy check on the tiny model: reduce-overhead, no cudagraph skip, one graph, eager's tokens."""
    from scripts import gpu_check as gc
    _, ckpt = hf_tiny("llama")
    model = load_model(ckpt, torch.float32, "cuda")
    prompt = torch.randint(0, 512, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    r = gc.graph_check(model, "keydiff", prompt, 16, 32, "cuda")
    assert gc.graph_row(r)["ok"], gc.graph_row(r)


@pytest.mark.parametrize("rows, slots, matmul", [(4, 9000, True), (64, 9000, True), (65, 9000, False),
                                                 (4, 2000, False)])
def test_attention_on_cuda_takes_the_products_for_few_rows(rows, slots, matmul, monkeypatch):
    """kernels.attention on CUDA, eager: up to MATMUL_MAX_QUERY_ROWS query rows over MATMUL_EAGER_MIN_SLOTS slots or
    more go to matmul_attention, the rest to SDPA; both equal SDPA on the CPU in fp32. Compiled, the products take
    every slot count (tests/test_kernels.py checks the products' result)."""
    import kernels
    torch.manual_seed(0)
    q, keys, values = (torch.randn(1, 8, n, 64) for n in (rows, slots, slots))
    mask = torch.rand(1, 8, rows, slots) > 0.2
    calls, matmul_attention = [], kernels.matmul_attention
    monkeypatch.setattr(kernels, "matmul_attention", lambda *a: calls.append(1) or matmul_attention(*a))
    torch.backends.cuda.matmul.allow_tf32 = False
    out = kernels.attention(*(t.cuda() for t in (q, keys, values, mask)))
    assert bool(calls) == matmul
    ref = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)


def test_flex_form_compiled_on_cuda_gives_the_default_tokens(hf_tiny, monkeypatch):
    """kernels.FORM "flex" (what gpu_check's attention section times): KeyDiff's decode step compiled under CUDA
    graphs with flex_attention over the cache's sliced buffers gives the eager default attention's greedy tokens."""
    import kernels
    from scripts import gpu_check as gc
    _, ckpt = hf_tiny("llama")
    model = load_model(ckpt, torch.float32, "cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    prompt = torch.randint(0, 512, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    default = gc.graph_check(model, "keydiff", prompt, 16, 32, "cuda")
    monkeypatch.setattr(kernels, "FORM", "flex")
    flex = gc.graph_check(model, "keydiff", prompt, 16, 32, "cuda")
    assert gc.graph_row(flex)["ok"], gc.graph_row(flex)
    assert flex["compiled"] == default["eager"]
