"""The kernels model.py calls (kernels.py): each CPU and CUDA form computes what SDPA or F.linear computes, and the
choice takes each form where its shapes, dtype and device say."""
import pytest
import torch

import kernels


@pytest.mark.parametrize("rows, dtype", [(1, torch.float32), (3, torch.float32), (16, torch.float32),
                                         (17, torch.float32), (1, torch.bfloat16), (17, torch.bfloat16)])
def test_attention_few_query_rows_compiled_equals_sdpa(rows, dtype, monkeypatch):
    """kernels.attention compiled on CPU: 1-16 query rows take the row-wise scores (rowwise_product over the keys),
    17 take SDPA; both equal eager SDPA (fp32: to rounding; bf16: within bf16's rounding of a reference in fp32),
    batch of 2, masks with holes and a fully visible row. bf16 at each form (1 row: row-wise, 17: SDPA); the choice's
    row boundary reads no dtype, checked in fp32."""
    torch.manual_seed(0)
    B, h, S, d = 2, 3, 200, 16
    q, keys, values = (torch.randn(B, h, n, d) for n in (rows, S, S))
    mask = torch.rand(B, h, rows, S) > 0.3
    mask[..., 0] = True  # every row sees at least one slot
    mask[0, 0, 0] = True
    ref = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    calls, rowwise_product = [], kernels.rowwise_product

    def counted(*args):
        calls.append(1)  # at trace time: which form the compiled graph holds
        return rowwise_product(*args)
    torch._dynamo.reset()
    monkeypatch.setattr(kernels, "rowwise_product", counted)
    compiled = torch.compile(kernels.attention, fullgraph=True, dynamic=False)
    out = compiled(*(t.to(dtype) for t in (q, keys, values)), mask)
    assert bool(calls) == (rows <= kernels.ROWWISE_MAX_QUERY_ROWS)
    assert out.dtype == dtype and out.shape == ref.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    assert not torch.allclose(out.float(), torch.nn.functional.scaled_dot_product_attention(q, keys, values),
                              atol=1e-3)  # the mask mattered


@pytest.mark.parametrize("compiled", [False, True])
def test_attention_folds_grouped_heads(compiled, monkeypatch):
    """Grouped-query heads (6 query heads over 2 KV heads) against SDPA over keys repeated per query head: a mask per
    KV head (the folded rows: compiled on CPU, the row-wise form for 3 rows per KV head) and one mask for all heads
    (SDPA groups the heads itself), each query token its own causal row. evicting=True keeps SDPA compiled."""
    torch.manual_seed(2)
    B, hq, h, T, S, d = 2, 6, 2, 1, 40, 8
    q, keys, values = torch.randn(B, hq, T, d), torch.randn(B, h, S, d), torch.randn(B, h, S, d)
    mask = torch.rand(B, h, T, S) > 0.3
    mask[..., 0] = True
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, keys.repeat_interleave(hq // h, 1), values.repeat_interleave(hq // h, 1),
        attn_mask=mask.repeat_interleave(hq // h, 1))
    calls, rowwise_product = [], kernels.rowwise_product
    monkeypatch.setattr(kernels, "rowwise_product", lambda *a: calls.append(1) or rowwise_product(*a))
    torch._dynamo.reset()
    attend = torch.compile(kernels.attention, fullgraph=True, dynamic=False) if compiled else kernels.attention
    torch.testing.assert_close(attend(q, keys, values, mask), ref, rtol=1e-5, atol=1e-5)
    assert bool(calls) == compiled
    shared = mask[:, :1]
    ref_shared = torch.nn.functional.scaled_dot_product_attention(
        q, keys.repeat_interleave(hq // h, 1), values.repeat_interleave(hq // h, 1), attn_mask=shared)
    torch.testing.assert_close(kernels.attention(q, keys, values, shared), ref_shared, rtol=1e-5, atol=1e-5)
    if compiled:
        calls.clear()
        torch._dynamo.reset()
        out = torch.compile(kernels.attention, fullgraph=True, dynamic=False)(q, keys, values, mask, evicting=True)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        assert calls == []  # an evicting cache's step keeps SDPA
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4, 20])
def test_matmul_attention_equals_sdpa(rows, dtype):
    """kernels.matmul_attention (CUDA's form for steps of a few query rows: two products and an fp32 softmax) equals
    SDPA computed in fp32: batch of 2, masks with holes, the last row seeing one slot only."""
    torch.manual_seed(1)
    B, h, S, d = 2, 4, 300, 32
    q, keys, values = (torch.randn(B, h, n, d) for n in (rows, S, S))
    mask = torch.rand(B, h, rows, S) > 0.4
    mask[..., 0] = True
    mask[..., -1, 1:] = False
    ref = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    out = kernels.matmul_attention(*(t.to(dtype) for t in (q, keys, values)), mask)
    assert out.dtype == dtype and out.shape == ref.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(out[..., -1, :].float(), values[..., 0, :].to(dtype).float())  # one slot: its value


@pytest.mark.parametrize("rows", [1, 3, 8, 16, 17])
def test_linear_few_rows_compiled_equals_f_linear(rows, monkeypatch):
    """kernels.Linear's CPU forms (the compiled per-row reductions for 1-8 rows, W @ x^T for 2-16) compute F.linear,
    contiguous, in the input's shape (a batch of 2 x rows/2 as well)."""
    torch.manual_seed(0)
    lin = kernels.Linear(48, 40, bias=True)
    x = torch.randn(1, rows, 48)
    ref = torch.nn.functional.linear(x, lin.weight, lin.bias)
    torch.testing.assert_close(lin(x), ref, rtol=1e-5, atol=1e-5)
    assert lin(x).is_contiguous()  # else its q reaches SDPA with a strided last dim: the slow math kernel
    calls, rowwise_linear = [], kernels.rowwise_linear

    def counted(*args):
        calls.append(1)  # at trace time: which form the compiled graph holds
        return rowwise_linear(*args)
    torch._dynamo.reset()
    monkeypatch.setattr(kernels, "rowwise_linear", counted)
    compiled = torch.compile(lin, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(x), ref, rtol=1e-5, atol=1e-5)
    assert bool(calls) == (rows <= kernels.ROWWISE_MAX_ROWS)
    assert compiled(x).is_contiguous()
    if rows % 2 == 0:
        xb = x.view(2, rows // 2, 48)
        torch.testing.assert_close(compiled(xb), ref.view(2, rows // 2, 40), rtol=1e-5, atol=1e-5)

