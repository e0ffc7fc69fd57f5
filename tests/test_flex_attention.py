"""kernels.flex_attention_form, the candidate CUDA attention form that BUDGETKV_ATTENTION=flex takes for every
attention (and BUDGETKV_ATTENTION=sdpa, gpt-fast's form): it equals the default choice's result to float tolerance
on this CPU, by itself (grouped heads, a mask per KV head, one mask for all heads, keys per query head) and inside
the engine: every policy of test_batch's cases
(each under its protocol: block-wise and one-shot), those cases batched, a chat continuation, self-speculation (the
draft and the K+1 verification block), eager; compiled (fullgraph, error_on_recompile) for KeyDiff block-wise: the
form is one function of (q, keys, values, mask) in every policy's decode step, and test_conformance compiles each
policy's own step."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import kernels
import policies
from engine import generate, setup
from runtime import compile_steps, model_step, prefill_step
from loading import load_model
from test_batch import BLOCK, CASES, LONG_PROMPTS, NEW, PROMPTS, batched

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture
def flex(monkeypatch):
    """flex(True) turns the form on for the test (as BUDGETKV_ATTENTION=flex does at import), flex(False) off; both
    return the list of the form's eager calls, so that a test sees the switch mattered (a compiled step appends
    nothing: dynamo would guard on the list's length and recompile)."""
    calls, form = [], kernels.flex_attention_form

    def counted(*a):
        if not torch.compiler.is_compiling():
            calls.append(1)
        return form(*a)
    monkeypatch.setattr(kernels, "flex_attention_form", counted)
    return lambda on: monkeypatch.setattr(kernels, "FORM", "flex" if on else "") or calls


def test_the_forms_are_off_by_default():
    """A process without BUDGETKV_ATTENTION imports kernels with no form; the variable, read at import, names one."""
    import subprocess
    import sys
    code = ("import importlib, os, kernels\n"
            "forms = [kernels.FORM]\n"
            "for form in ('flex', 'sdpa'):\n"
            "    os.environ['BUDGETKV_ATTENTION'] = form\n"
            "    forms.append(importlib.reload(kernels).FORM)\n"
            "print(forms)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": "."})
    assert out.stdout.strip() == "['', 'flex', 'sdpa']", out.stderr[-2000:]


def test_sdpa_form_takes_sdpa_where_the_choice_takes_another(monkeypatch):
    """Compiled on CPU, 3 query rows per KV head: the choice takes the row-wise scores, FORM "sdpa" SDPA (gpt-fast's
    decode); both equal SDPA over keys repeated per query head."""
    torch.manual_seed(1)
    B, hq, h, S, d = 1, 6, 2, 40, 16
    q, keys, values = torch.randn(B, hq, 1, d), torch.randn(B, h, S, d), torch.randn(B, h, S, d)
    mask = torch.rand(B, h, 1, S) > 0.3
    mask[..., 0] = True
    ref = F.scaled_dot_product_attention(q, keys.repeat_interleave(3, 1), values.repeat_interleave(3, 1),
                                         attn_mask=mask.repeat_interleave(3, 1))
    calls, rowwise_product = [], kernels.rowwise_product
    monkeypatch.setattr(kernels, "rowwise_product", lambda *a: calls.append(1) or rowwise_product(*a))
    for form, rowwise in (("", True), ("sdpa", False)):
        monkeypatch.setattr(kernels, "FORM", form)
        calls.clear()
        torch._dynamo.reset()
        out = torch.compile(kernels.attention, fullgraph=True, dynamic=False)(q, keys, values, mask)
        torch.testing.assert_close(out, ref, **TOL)
        assert bool(calls) == rowwise
    torch._dynamo.reset()


@pytest.mark.parametrize("hq, h, mask_heads", [(6, 2, 2), (6, 2, 1), (6, 6, 6), (2, 2, 2)])
def test_form_equals_sdpa_over_repeated_heads(hq, h, mask_heads):
    """Batch 2, 3 query tokens over 40 slots: masks with holes, one row seeing a single slot; mask_heads 1: one mask
    for every head; h == hq: keys per query head (a per-head selection)."""
    torch.manual_seed(0)
    B, T, S, d = 2, 3, 40, 16
    q, keys, values = torch.randn(B, hq, T, d), torch.randn(B, h, S, d), torch.randn(B, h, S, d)
    mask = torch.rand(B, mask_heads, T, S) > 0.4
    mask[..., 0] = True
    mask[0, 0, 0, 1:] = False
    rep = hq // h
    ref = F.scaled_dot_product_attention(q, keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1),
                                         attn_mask=mask.repeat_interleave(hq // mask_heads, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = kernels.flex_attention_form(q, keys.to(torch.bfloat16), values.to(torch.bfloat16), mask)
        torch.testing.assert_close(out, F.scaled_dot_product_attention(
            q, keys.bfloat16().float().repeat_interleave(rep, 1), values.bfloat16().float().repeat_interleave(rep, 1),
            attn_mask=mask.repeat_interleave(hq // mask_heads, 1)), **TOL)  # a bf16 cache under fp32 compute
        torch.testing.assert_close(kernels.flex_attention_form(q, keys, values, mask), ref, **TOL)
    assert not torch.allclose(ref, F.scaled_dot_product_attention(q, keys.repeat_interleave(rep, 1),
                                                                  values.repeat_interleave(rep, 1)), atol=1e-3)


def recording(logits: list):
    """Eager steps that keep every logits tensor they return."""
    def prefill(model, idx, pos):
        logits.append(prefill_step(model, idx, pos).clone())
        return logits[-1]

    def decode(model, idx, pos):
        logits.append(model_step(model, idx, pos).clone())
        return logits[-1]
    return prefill, decode


def assert_same_run(a: tuple, b: tuple) -> None:
    (tokens_a, logits_a), (tokens_b, logits_b) = a, b
    assert tokens_a == tokens_b and len(logits_a) == len(logits_b) > 0
    for x, y in zip(logits_a, logits_b):
        torch.testing.assert_close(x, y, **TOL)


@pytest.mark.parametrize("spec,prefill,budget", CASES, ids=[f"{s}-{p}" for s, p, _ in CASES])
def test_every_policy_and_a_batch_equal_the_default_attention(hf_tiny, flex, spec, prefill, budget):
    """One sequence past the budget (it evicts while prefilling), then the ragged batch of test_batch: the logits of
    every step and the tokens equal the default attention's, eager."""
    _, ckpt = hf_tiny("llama")
    model = load_model(ckpt, torch.float32, "cpu")
    prompts = LONG_PROMPTS if spec == "sagekv" else PROMPTS

    def single():
        logits = []
        setup(model, policies.make(spec), budget, len(prompts[0]), NEW, BLOCK, prefill=prefill)
        tokens, _ = generate(model, prompts[0], NEW, block_size=BLOCK, steps=recording(logits),
                             one_shot=prefill == "one-shot")
        return tokens, logits

    def batch():
        logits = []
        return batched(model, spec, prefill, budget, prompts, steps=recording(logits))[0], logits
    with torch.inference_mode():
        flex(False)
        want = single(), batch()
        calls = flex(True)
        got = single(), batch()
    assert calls
    assert_same_run(got[0], want[0])
    assert_same_run(got[1], want[1])


def test_chat_continuation_equals_the_default_attention(hf_tiny, flex, tmp_path):
    """A KeyDiff chat whose cache persists across three turns (each turn's prompt prefilled after the kept history,
    evicting): the same prompts and answers with the flex form."""
    from chat import Chat
    from conftest import with_tiny_tokenizer
    from test_chat import TEMPLATE, TURNS, WORDS, converse, no_eos
    import json
    from tokenizer import load_tokenizer
    _, src = hf_tiny("llama")
    d = with_tiny_tokenizer(src, tmp_path / "chat", WORDS)
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                         "chat_template": TEMPLATE}))
    model, tok = load_model(d, torch.float32, "cpu"), load_tokenizer(d)

    def conversation():
        chat = Chat(model, tok, "keydiff", budget=24, max_new_tokens=6, block_size=8)
        no_eos(chat)
        return converse(chat, TURNS[:3])
    flex(False)
    want = conversation()
    calls = flex(True)
    assert conversation() == want and calls
    assert sum(len(ids) for ids, _ in want[-1:]) > 24  # the last turn's conversation is past the budget


COMPILED = [("keydiff", "block", 16)]


@pytest.mark.parametrize("spec,prefill,budget", COMPILED, ids=[f"{s}-{p}" for s, p, _ in COMPILED])
def test_compiled_decode_equals_eager_default_attention(hf_tiny, flex, spec, prefill, budget):
    """The decode step compiled with the flex form (fullgraph, error_on_recompile over two generations' decode
    steps; prefill eager, as gpu_check's graphs check runs it: eager flex_attention compiles a wrapper of its own
    per shape): the logits of every step and the tokens equal the eager default attention's."""
    _, ckpt = hf_tiny("llama")
    model = load_model(ckpt, torch.float32, "cpu")
    prompts = PROMPTS[0], PROMPTS[2]

    def run(prompt, steps):
        logits = []
        setup(model, policies.make(spec), budget, len(prompt), NEW, BLOCK, prefill=prefill)
        prefill_fn, decode_fn = steps

        def decode(model, idx, pos):
            with torch._dynamo.config.patch(error_on_recompile=decode_fn is not model_step):
                logits.append(decode_fn(model, idx, pos).clone())
            return logits[-1]
        return generate(model, prompt, NEW, block_size=BLOCK, steps=(prefill_fn, decode),
                        one_shot=prefill == "one-shot")[0], logits
    with torch.inference_mode():
        flex(False)
        want = [run(p, (prefill_step, model_step)) for p in prompts]
    calls = flex(True)
    torch._dynamo.reset()
    try:
        steps = compile_steps("cpu", prefill=False)
        with torch.inference_mode():
            got = [run(p, steps) for p in prompts]
    finally:
        torch._dynamo.reset()
    assert calls  # the eager prefill's
    for g, w in zip(got, want):
        assert_same_run(g, w)


@pytest.mark.parametrize("spec", ["keydiff", "snapkv++:window=4"])
def test_speculation_equals_plain_greedy_default_attention(hf_tiny, flex, spec):
    """Self-speculation with the flex form in the draft and in the K+1 verification block: token for token plain
    greedy's with the default attention (a draft past its budget, so the draft evicts)."""
    from test_speculative import draft_budget_for, ids_of, plain, speculate
    import speculative
    _, ckpt = hf_tiny("llama")
    model = load_model(ckpt, torch.float32, "cpu")
    prompt, n, k, block = ids_of(60), 12, 3, 16
    with torch.inference_mode():
        flex(False)
        want = plain(model, prompt, n, block, 60 + n)
        calls = flex(True)
        draft = speculative.draft_model(model)
        (got, _), _ = speculate(model, draft, prompt, n, block, k, spec, draft_budget_for(spec, n, k, budget=24))
    assert calls and got == want
