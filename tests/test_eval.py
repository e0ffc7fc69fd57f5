"""scripts/eval.py on a tiny random Llama: fidelity is exact where nothing is evicted, perplexity matches an
independent computation (HF transformers), the cache snapshot leaves generation unchanged, and the CLI writes its
outputs (and refuses bad input with one line, exit 2)."""
import json
import re
import math
import sys

import pytest
import torch

from engine import generate
from runtime import model_step, prefill_step
from loading import load_model
from scripts import eval as ev
from scripts import eval_report

PREFIX, CONT, BLOCK = 40, 12, 16


pytestmark = pytest.mark.usefixtures("one_thread")


STEPS = (prefill_step, model_step)
# SAGE-KV's literal rule selects even when everything fits: skip_if_fits keeps it dense then
NAMES = ["full", *(n if n != "sagekv" else "sagekv:skip_if_fits=true" for n in ev.policies.REGISTRY)]


def protocol_of(policy, protocol):  # SnapKV++, RocketKV, SAGE-KV, K-VEC run one-shot only
    return "one-shot" if ev.policies.lookup(policy).protocol == "one-shot" else protocol


@pytest.fixture(scope="module")
def tiny(hf_tiny):
    hf, ckpt = hf_tiny("llama")
    model = load_model(ckpt, torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    texts = [torch.randint(0, 512, (PREFIX + CONT,), generator=g).tolist() for _ in range(2)]
    return hf, model, texts


def run_fidelity(model, texts, cfgs):
    return ev.fidelity(model, texts, PREFIX, cfgs, block_size=BLOCK, steps=STEPS)


@pytest.mark.parametrize("protocol", ["block", "one-shot"])
def test_fidelity_exact_without_eviction(tiny, protocol):
    """Budget >= prefix + continuation: no policy evicts anything, so every one matches the full cache."""
    _, model, texts = tiny
    cfgs = [("block", "full", None)] + [(protocol_of(p, protocol), p, PREFIX + CONT) for p in NAMES if p != "full"]
    records = run_fidelity(model, texts, cfgs)
    assert len(records) == len(cfgs) * len(texts)
    full_nll = {r["text"]: r["nll"] for r in records if r["policy"] == "full"}
    for r in records:
        assert r["kl"] < 1e-6 and r["agree"] == 1.0 and r["accept"] == 4.0, r  # every round accepts all K=4
        assert r["nll"] == pytest.approx(full_nll[r["text"]], abs=1e-5), r


def test_fidelity_small_budget_diverges(tiny):
    """Negative control: with 8 of 52 tokens kept (SnapKV: 33, its window is 32; a policy that appends the 12
    teacher-forced tokens: 45 or 36 slots; Exact-TopK holds all 64 and attends 8) every policy differs from full."""
    _, model, texts = tiny
    budgets = {"kvec": 36, "snapkv++": 45, "rocketkv": 45, "exact-topk:k=8": 64}
    names = [p if p != "exact-topk" else "exact-topk:k=8" for p in NAMES if p != "full"]
    cfgs = [(protocol_of(p, "block"), p, budgets.get(p, 33 if p.endswith("snapkv") else 8)) for p in names]
    records = run_fidelity(model, texts, cfgs)
    assert len(records) == len(cfgs) * len(texts)  # every configuration ran (none was not applicable)
    for r in records:
        assert r["kl"] > 1e-4, r
        assert 0 <= r["accept"] <= 4 and (r["agree"] < 1 or r["accept"] == 4), r


def test_draft_rounds_by_hand():
    """Rounds of K draft tokens over the teacher-forced agreements: a round accepts the leading agreements, the
    target supplies the next position, and a round the text's end cuts short is not counted."""
    a = [1, 1, 0, 1, 1, 1, 1, 0]
    # K=4: t=0 accepts 2 (a[2] = 0; the target supplies 2), t=3 accepts 4 (a[3:7]; the target's bonus token is 7)
    assert eval_report.draft_rounds(a, 4) == [2, 4] and eval_report.mean_accepted(a, 4) == 3.0
    # K=2: t=0 accepts 2 (bonus 2), t=3 accepts 2 (bonus 5), t=6 accepts 1 (a[7] = 0)
    assert eval_report.draft_rounds(a, 2) == [2, 2, 1] and eval_report.mean_accepted(a, 2) == pytest.approx(5 / 3)
    # K=1: t=0 1, t=2 0, t=3 1, t=5 1, t=7 0
    assert eval_report.draft_rounds(a, 1) == [1, 0, 1, 1, 0]
    assert eval_report.draft_rounds([1, 1, 0, 1, 1], 4) == [2]  # the round at t=3 is cut short after 2 agreements
    assert eval_report.draft_rounds([1] * 10, 4) == [4, 4] and eval_report.draft_rounds([1] * 8, 4) == [4]  # t=5: 3 left, cut short
    assert eval_report.draft_rounds([0, 0, 0], 4) == [0, 0, 0] and eval_report.draft_rounds([], 4) == []
    assert eval_report.mean_accepted([1, 1], 4) == 0.0  # no complete round


def test_perplexity_matches_hf(tiny):
    """The full cache's NLL (and so perplexity) equals exp(mean NLL) from HF transformers' logits of the text."""
    hf, model, texts = tiny
    records = run_fidelity(model, texts, [("block", "full", None)])
    for r, text in zip(records, texts):
        with torch.no_grad():
            logits = hf(torch.tensor([text])).logits[0, PREFIX - 1:-1].double()
        nll = -logits.log_softmax(-1).gather(-1, torch.tensor(text[PREFIX:])[:, None]).mean().item()
        assert math.exp(r["nll"]) == pytest.approx(math.exp(nll), rel=1e-4)
    summary = eval_report.summarize(records)
    assert summary["fidelity"]["full"]["all"]["ppl"] == pytest.approx(math.exp(sum(r["nll"] for r in records) / 2))


@pytest.mark.parametrize("protocol", ["block", "one-shot"])
def test_snapshot_teacher_force_then_generation_as_generate(tiny, protocol):
    """Teacher-forcing the answer between snapshot and restore leaves the greedy answer as generate() makes it."""
    _, model, texts = tiny
    ids = texts[0][:PREFIX]
    ev.use(model, "h2o", 24, BLOCK, protocol=protocol)
    expected, _ = generate(model, ids, 10, block_size=BLOCK, steps=STEPS, one_shot=protocol == "one-shot")
    with torch.inference_mode():
        logits = ev.prefill(model, ids, STEPS, BLOCK, protocol == "one-shot")
        snap = ev.snapshot(model)
        rows = ev.teacher_force(model, logits, len(ids), texts[1][:6], STEPS)
        ev.restore(model, snap)
        assert rows.shape == (6, 512)
        assert ev.greedy(model, logits, len(ids), 10, set(), STEPS) == expected


@pytest.fixture(scope="module")
def tiny_tok_ckpt(hf_tiny, tmp_path_factory):
    """The tiny llama checkpoint plus a small byte-level BPE tokenizer.json."""
    from conftest import with_tiny_tokenizer
    _, src = hf_tiny("llama")
    return with_tiny_tokenizer(src, tmp_path_factory.mktemp("tiny_eval"),
                               "the quick brown fox jumps over the lazy dog 0123456789")


def test_question_after_the_document_in_the_chat_template(tiny_tok_ckpt):
    """A task's prompt is its document, then its question, in the chat template when the checkpoint has one (the
    order the one-shot policies assume, and the ids generate.py --prompt-file --prompt and generate_text(document=)
    build: tokenizer.prompt_ids), then the answer prefix; without a template, plain text after the BOS."""
    from tokenizer import load_tokenizer
    tok = load_tokenizer(tiny_tok_ckpt)
    a = ev.parse_args(["--tasks", "passkey,niah_single", "--lengths", "300"])
    tok.chat_template = "<s>{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "
    chat = ev.make_items(tok, a, 2048)
    tok.chat_template = None
    plain = ev.make_items(tok, a, 2048)
    for task in ("passkey", "niah_single"):
        (it,), (bare,) = chat[task], plain[task]
        s = it["sample"]
        doc, question, prefix = s.context, s.question, s.meta["answer_prefix"]
        assert doc and question and prefix and question not in doc
        assert it["ids"] == tok.encode(f"<s>[user] {doc}\n\n{question}\n[assistant] ", add_bos=False) + tok.encode(
            prefix, add_bos=False)
        assert bare["ids"] == tok.encode(f"{doc}\n\n{question}\n\n{prefix}", add_bos=True)


def test_free_generation_measures_flag_a_loop():
    """Hand-checked cases: a loop repeats nearly every 4-gram, text that never repeats none; divergence counts the
    agreeing head; overlap is a bag-of-tokens F1."""
    loop = [7, 8] * 32  # "TheTheThe..."
    assert eval_report.repeated_ngrams(loop) == pytest.approx(1 - 2 / 61)  # 61 4-grams, 2 distinct
    assert eval_report.repeated_ngrams(list(range(64))) == 0.0
    assert eval_report.repeated_ngrams([1, 2, 3, 4, 1, 2, 3, 4]) == pytest.approx(1 / 5)  # 5 4-grams, (1,2,3,4) twice
    assert eval_report.first_divergence([1, 2, 3, 9], [1, 2, 3, 4]) == 3 and eval_report.first_divergence([1, 2], [1, 2]) == 2
    assert eval_report.token_overlap([1, 2, 3, 4], [4, 3, 2, 1]) == 1.0 and eval_report.token_overlap([1, 1], [1, 2]) == 0.5


def test_freegen_exact_without_eviction_and_flags_divergence(tiny):
    """Budget >= prefix + continuation: every policy continues exactly as full (and as engine.generate does); a
    budget of 8 diverges from it."""
    _, model, texts = tiny
    cfgs = [("block", "full", None), ("block", "keydiff", PREFIX + CONT), ("block", "h2o", PREFIX + CONT),
            ("block", "keydiff", 8), ("block", "sink", 8)]
    records = ev.freegen(model, texts, PREFIX, CONT, cfgs, block_size=BLOCK, steps=STEPS)
    assert len(records) == len(cfgs) * len(texts)
    for r in records:
        if r["budget"] in (None, PREFIX + CONT):
            assert r["match"] == CONT and r["overlap"] == 1.0, r
    assert any(r["match"] < CONT for r in records if r["budget"] == 8)
    ev.use(model, "full", PREFIX + CONT, BLOCK)
    out, _ = generate(model, texts[0][:PREFIX], CONT, block_size=BLOCK, steps=STEPS)
    assert out == next(r["tokens"] for r in records if r["policy"] == "full" and r["text"] == 0)


def test_quick_cli_writes_outputs(tiny_tok_ckpt, tmp_path, capsys, monkeypatch):
    """--quick's outputs; off a terminal (stderr captured) plain progress lines, one per LOG_INTERVAL (0 here)."""
    import progress
    monkeypatch.setattr(progress, "LOG_INTERVAL", 0)
    out = tmp_path / "eval"
    # --quick, plus passkey and the one-shot protocol; less work than --quick alone for this small model
    argv = ["--checkpoint", str(tiny_tok_ckpt), "--quick", "--out-dir", str(out), "--prefill", "block,one-shot",
            "--tasks", "fidelity,freegen,passkey,needle", "--policies", "full,sink,keydiff", "--lengths", "300",
            "--fid-prefix", "256", "--fid-tokens", "16", "--gen-tokens", "8", "--block-size", "32", "--max-new-tokens", "4"]
    assert ev.main(argv) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "\r" not in err and re.search(r"^fidelity \d+/\d+ prompts .* s  keydiff @ 128$", err, re.M), err
    assert re.search(r"^needle (\d+)/\1 prompts ", err, re.M), err
    res = json.loads((out / "results.json").read_text())
    assert set(res["summary"]) == {"fidelity", "freegen", "passkey", "needle"}
    assert res["summary"]["freegen"]["full"]["all"]["match"] == 8 and "## freegen" in (out / "results.md").read_text()
    assert list(res["summary"]["passkey"]) == ["full", "sink", "keydiff", "sink (one-shot)", "keydiff (one-shot)"]
    assert set(res["summary"]["fidelity"]["sink"]) == {"128", "256"}  # --quick's budgets
    assert res["summary"]["fidelity"]["full"]["all"]["kl"] == 0 and res["config"]["depths"] == [0.0, 1.0]
    assert res["summary"]["fidelity"]["full"]["all"]["accept"] == 4.0 and res["config"]["accept_k"] == 4
    assert all(0 <= r["accept"] <= 4 for r in res["records"] if r["task"] == "fidelity")
    md = (out / "results.md").read_text()
    assert "## fidelity" in md and "## passkey" in md and "| full (no eviction) | 0.000 / 100.0 / 4.00 / " in md
    assert "draft tokens accepted per round" in md and "draft rounds of K=4" in md
    for png in ["fidelity.png", "freegen.png", "passkey.png", "needle.png", "niah_heatmap_full.png", "niah_heatmap_keydiff_128.png",
                "niah_heatmap_sink_256_one-shot.png"]:
        assert (out / png).read_bytes()[:4] == b"\x89PNG", png
    for r in res["records"]:
        if r["task"] not in ("fidelity", "freegen"):
            assert 0 <= r["score"] <= 1 and 0 <= r["partial"] <= 1 and r["logp"] <= 0


def test_no_matplotlib_writes_tables_without_plots(tiny_tok_ckpt, tmp_path, monkeypatch, capsys):
    real = eval_report.importlib.util.find_spec
    monkeypatch.setattr(eval_report.importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    out = tmp_path / "eval"
    argv = ["--checkpoint", str(tiny_tok_ckpt), "--quick", "--out-dir", str(out), "--tasks", "fidelity",
            "--policies", "full", "--fid-prefix", "64", "--fid-tokens", "4", "--block-size", "32"]
    assert ev.main(argv) == 0
    err = capsys.readouterr().err
    assert "no plots: matplotlib is not installed" in err and f"{sys.executable} -m pip install" in err, err
    assert (out / "results.md").is_file() and not list(out.glob("*.png"))


def test_longbench_average(tiny_tok_ckpt, tmp_path, monkeypatch, capsys):
    """--longbench runs each task through load_longbench / longbench_score and reports the English-16 average."""
    tasks = ["hotpotqa", "triviaqa"]  # a chat task and one without the template, 32 new tokens each
    sample = ev.eval_tasks.Sample(task=tasks[0], context="the quick brown fox " * 20, question="who jumps?",
                                  answers=["the fox"], metric="", meta={})
    monkeypatch.setattr(ev.eval_tasks, "load_longbench", lambda task, source=None, limit=None: [sample] * limit)
    monkeypatch.setattr(ev.eval_tasks, "longbench_score", lambda task, pred, s: 0.5 if task == tasks[0] else 1.0)
    out = tmp_path / "lb"
    argv = ["--checkpoint", str(tiny_tok_ckpt), "--tasks", "", "--longbench", ",".join(tasks), "--samples", "1",
            "--policies", "keydiff", "--budgets", "48", "--block-size", "16", "--out-dir", str(out)]
    assert ev.main(argv) == 0, capsys.readouterr().err
    summary = json.loads((out / "results.json").read_text())["summary"]
    assert summary["longbench"]["keydiff"]["48"]["score"] == pytest.approx(0.75)
    assert summary["longbench"]["full"]["all"]["score"] == pytest.approx(0.75)
    assert "## longbench:" in (out / "results.md").read_text() and (out / "longbench.png").is_file()


BAD = [(["--policies", "full,nope"], "unknown policy"), (["--tasks", "fidelity,nope"], "unknown task"),
       (["--budgets", "128,0"], "--budgets must all be >= 1"), (["--prefill", "both"], "unknown --prefill"),
       (["--samples", "0"], "--samples must be >= 1"), (["--budgets", "x"], "invalid"),
       (["--accept-k", "0"], "--accept-k must be between 1 and --fid-tokens (128)"),
       (["--accept-k", "9", "--fid-tokens", "8"], "--accept-k must be between 1 and --fid-tokens (8)"),
       (["--accept-k", "-1", "--tasks", "passkey"], "--accept-k must be between 1 and --fid-tokens"),
       (["--policies", "snapkv", "--budgets", "16"], "observation window"),
       (["--longbench", "nope"], "unknown LongBench task"), (["--depths", "2"], "--depths must be in [0, 1]"),
       (["--checkpoint", "no-such-model"], "unknown checkpoint"),
       (["--tasks", "passkey", "--lengths", "5"], "too small"),
       (["--budgets", "x"], "invalid comma-separated int value: 'x'"),
       (["--tasks", "passkey", "--budgets", "4096"], "--budgets 4096 is larger than the model's context (2048)"),
       (["--tasks", "passkey", "--out-dir", "/proc/no-such-dir"], "--out-dir /proc/no-such-dir: No such file or directory")]


@pytest.mark.parametrize("extra,message", BAD, ids=[m for _, m in BAD])
def test_bad_input_one_line_exit_2(extra, message, tiny_tok_ckpt, tmp_path, capsys):
    ckpt = [] if "--checkpoint" in extra else ["--checkpoint", str(tiny_tok_ckpt)]
    try:
        code = ev.main(["--out-dir", str(tmp_path)] + ckpt + extra)
    except SystemExit as e:  # argparse errors exit from inside parse_args
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error:") and message in err[0], err
    assert not list(tmp_path.iterdir())



def test_policy_that_cannot_fit_is_not_applicable(tiny):
    """SnapKV++ keeping budget - new tokens < its window cannot run (the paper's N/A): the config is skipped and the
    table says n/a, while the other budgets still run."""
    _, model, texts = tiny
    ev.NOT_APPLICABLE.clear()
    records = run_fidelity(model, texts, [("one-shot", "snapkv++", 20), ("one-shot", "snapkv++", 50)])
    assert {r["budget"] for r in records} == {50} and len(records) == len(texts)
    assert ("fidelity", "snapkv++ (one-shot)", 20) in ev.NOT_APPLICABLE
    table = eval_report.markdown(eval_report.summarize(records), [20, 50], "header")
    assert "| snapkv++ (one-shot) | n/a |" in table
    ev.NOT_APPLICABLE.clear()


def test_configs_parse_policy_specs_and_run_a_policy_that_holds_everything_once():
    """--policies takes specs (a policy's own key=value pairs stay with it); a policy without a scorer (it holds every
    token) runs once at the full budget, whatever --budgets says."""
    a = ev.parse_args(["--policies", "full,snapkv:window=8,kernel=3,exact-topk:k=8,full:", "--budgets", "16,32"])
    assert a.policies == ["full", "snapkv:window=8,kernel=3", "exact-topk:k=8", "full:"]
    assert ev.configs(a) == [("block", "full", None), ("block", "snapkv:window=8,kernel=3", 16),
                             ("block", "snapkv:window=8,kernel=3", 32), ("block", "exact-topk:k=8", None)]
