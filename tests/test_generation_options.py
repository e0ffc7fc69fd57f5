"""What a user sets beside the policy: the repetition penalty (against HF generate's, every policy batched as alone,
compiled without a recompile), stop strings, a document and a question, a batch printed in input order."""
import json
import re
import shutil

import pytest
import torch

import engine
import runtime
import generate
import policies
from engine import Generation
from loading import load_model
from sampling import Sampling
from tokenizer import load_tokenizer

PROMPTS = [[(7 * i + 3) % 500 + 1 for i in range(72)], [(11 * i + 5) % 500 + 1 for i in range(72)]]


@pytest.fixture(scope="module")
def tiny(hf_tiny):
    hf, src = hf_tiny("llama")
    return hf, load_model(src, torch.float32, "cpu")


def run(model, policy, prompts, penalty=1.3, last_n=8, steps=None, budget=48):
    holds_all = policy is None or not policy.scores  # full, exact-topk: the budget is every token
    sampling = Sampling(repetition_penalty=penalty, repeat_last_n=last_n if penalty != 1.0 else None)
    gen = Generation(model.args, policy, [len(p) for p in prompts], budget=None if holds_all else budget,
                     max_new_tokens=16, block_size=8, sampling=sampling)
    gen.setup(model)
    if steps is not None:
        gen.steps = steps
    return gen.generate(model, prompts)[0]


def test_whole_sequence_penalty_is_hf_generates(tiny):
    hf, model = tiny
    ids = torch.tensor([PROMPTS[0]])
    expected = hf.generate(ids, max_new_tokens=16, do_sample=False, repetition_penalty=1.5, eos_token_id=None,
                           pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert run(model, None, PROMPTS[:1], penalty=1.5, last_n=-1)[0] == expected
    assert run(model, None, PROMPTS[:1], penalty=1.0)[0] != expected  # the penalty changed these tokens


@pytest.mark.parametrize("name", sorted(policies.REGISTRY))
def test_penalty_per_sequence_with_every_policy(tiny, name):
    """Each sequence's window is its own: a batch of two gives each prompt's tokens alone."""
    _, model = tiny
    policy = policies.make(name)
    together = run(model, policy, PROMPTS)
    assert together == [run(model, policy, [p])[0] for p in PROMPTS]


def test_penalty_compiled_without_recompile(tiny):
    """The penalty is static-shaped tensor work around the compiled decode step (it reads and rewrites the logits
    outside any step, so the prefill step stays eager): the same tokens as eager, no recompile."""
    _, model = tiny
    policy = policies.make("keydiff")
    eager = run(model, policy, PROMPTS)
    steps = runtime.compile_steps("cpu", None, prefill=False)
    try:
        run(model, policy, PROMPTS, steps=steps)  # compiles
        with torch._dynamo.config.patch(error_on_recompile=True):
            assert run(model, policy, PROMPTS, steps=steps) == eager
    finally:
        torch._dynamo.reset()  # a later test in this process compiles the same functions at other shapes


@pytest.fixture(scope="module")
def tiny_ckpt(hf_tiny, tmp_path_factory):
    from conftest import with_tiny_tokenizer
    _, src = hf_tiny("llama")
    return with_tiny_tokenizer(src, tmp_path_factory.mktemp("tiny_options"),
                               "the quick brown fox jumps over the lazy dog 0123456789")


def cli(ckpt, capsys, *args):
    code = generate.main(["--checkpoint", str(ckpt), "--max-new-tokens", "24", "--json", "--no-chat", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_stop_string_ends_the_sequence_and_is_cut(tiny_ckpt, capsys):
    plain = cli(tiny_ckpt, capsys, "--prompt", "the quick brown fox")
    text = plain["text"]
    stop = text[6:9]
    assert stop.strip() and len(plain["token_ids"]) == 24
    stopped = cli(tiny_ckpt, capsys, "--prompt", "the quick brown fox", "--stop", stop, "--stop", "never-there")
    assert stopped["text"] == text[:text.index(stop)]
    assert stopped["token_ids"] == plain["token_ids"][:len(stopped["token_ids"])] and len(stopped["token_ids"]) < 24


def test_document_then_question(tiny_ckpt, tmp_path, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text("the lazy dog sleeps. the quick fox runs.\n")
    asked = cli(tiny_ckpt, capsys, "--prompt-file", str(doc), "--prompt", "who runs?")
    assert asked == cli(tiny_ckpt, capsys, "--prompt", "the lazy dog sleeps. the quick fox runs.\n\nwho runs?") | {
        k: asked[k] for k in asked if k.endswith(("_s", "tok_s", "bytes", "gb_s"))}
    api = engine.generate_text("who runs?", document=doc.read_text(), checkpoint=str(tiny_ckpt), max_new_tokens=24,
                               chat_template=False)
    assert api["token_ids"] == asked["token_ids"]


def test_batch_prints_in_input_order():
    shown = []
    in_order = generate.InOrder(lambda b, text: shown.append((b, text)))
    for b in (2, 0, 3, 1):
        in_order(b, f"t{b}")
    assert shown == [(0, "t0"), (1, "t1"), (2, "t2"), (3, "t3")]


def test_an_attention_form_that_is_none_is_one_line(tiny, monkeypatch):
    import kernels
    from errors import UserError
    monkeypatch.setattr(kernels, "FORM", "flexx")
    with pytest.raises(UserError, match="BUDGETKV_ATTENTION='flexx' names no attention form"):
        Generation(tiny[1].args, None, [4])


API_REFUSALS = [
    (dict(max_new_tokens=0), "`max_new_tokens` must be >= 1, got 0"),
    (dict(max_new_tokens="24"), "`max_new_tokens` must be an integer, got '24'"),
    (dict(budget=-5, policy="keydiff"), "`budget` must be >= 1, got -5"),
    (dict(budget=True, policy="keydiff"), "`budget` must be an integer, got True"),
    (dict(budget=10 ** 6, policy="keydiff"), "budget=1000000 is larger than the model's context (2048)"),
    (dict(block_size=2.0), "`block_size` must be an integer, got 2.0"),
    (dict(sampling=dict(temperature=float("nan"))), "`temperature` must be a finite number >= 0, got nan"),
    (dict(sampling=dict(top_p=0.0, temperature=1.0)), "`top_p` must be in (0, 1], got 0.0"),
    (dict(sampling=dict(repetition_penalty=1e-300)), "`repetition_penalty` must be between 0.01 and 100"),
    (dict(sampling=dict(top_k=5)), "`top_k` applies to sampling, and temperature=0 decodes greedily"),
    (dict(sampling=dict(repeat_last_n=8)), "`repeat_last_n` applies to `repetition_penalty`"),
    (dict(sampling=dict(temperature=1.0, top_k=10 ** 6)), "top_k=1000000 exceeds the model's vocabulary"),
    (dict(stop=[""]), "`stop` is empty"),
    (dict(stop=5), "stop=5 is not a list of texts"),
    (dict(document=5), "document=5 is not a text"),
    (dict(prompt="the \ud800 fox"), "`prompt` is not valid Unicode text"),  # not blamed on the chat template
    (dict(prompt=["the fox", 7]), "prompt=7 is not a text"),
    (dict(prompt=[]), "neither a text nor a non-empty list"),
    (dict(seed=-1), "`seed` must be between 0 and"),
    (dict(kv_dtype="int4"), "kv_dtype='int4' is not one of auto, int8, bfloat16"),
    (dict(dtype="half"), "dtype='half' is not one of auto"),
    (dict(device="tpu"), "device='tpu' is not a device"),
    (dict(prefill="dense"), "prefill='dense' is not one of block, one-shot"),
    (dict(policy="snapkv++", prefill="block"), "policy=snapkv++ compresses the prompt once"),
]


@pytest.mark.parametrize("kw, message", API_REFUSALS, ids=[str(i) for i in range(len(API_REFUSALS))])
def test_the_api_refuses_what_the_cli_refuses(tiny_ckpt, kw, message):
    """generate_text checks what generate.py checks, in one place each (a Sampling, a Generation's sizes, the
    texts, the run settings), before anything is allocated: one UserError naming the parameter."""
    from errors import UserError
    kw = {"prompt": "the fox"} | kw
    with pytest.raises(UserError) as e:
        engine.generate_text(kw.pop("prompt"), checkpoint=str(tiny_ckpt), chat_template=False, **kw)
    assert message in str(e.value)


def test_the_api_checks_memory_before_allocating(tiny_ckpt, monkeypatch):
    """A KV cache that does not fit the device's free memory is refused before it is allocated, from
    generate_text and from a Chat (as generate.py refuses it)."""
    import chat
    import loading
    from errors import UserError
    from tokenizer import load_tokenizer
    model = load_model(tiny_ckpt, torch.float32, "cpu")
    monkeypatch.setattr(loading, "free_memory", lambda device: 2 ** 20)  # 1 MiB free
    with pytest.raises(UserError, match=r"the KV cache of 1 sequence .* more than the 0.0 GiB free on cpu"):
        engine.generate_text("the fox", checkpoint=str(tiny_ckpt), chat_template=False, budget=2048,
                             policy="keydiff")
    with pytest.raises(UserError, match=r"the KV cache of 1 sequence .* more than the 0.0 GiB free on cpu"):
        chat.Chat(model, load_tokenizer(tiny_ckpt), "keydiff", budget=2048)


def test_the_api_keeps_one_string_stop(tiny_ckpt):
    one = engine.generate_text("the quick brown fox", checkpoint=str(tiny_ckpt), chat_template=False,
                               max_new_tokens=24)
    stop = one["text"][6:9]
    cut = engine.generate_text("the quick brown fox", checkpoint=str(tiny_ckpt), chat_template=False,
                               max_new_tokens=24, stop=stop)  # one string, not its characters
    assert cut["text"] == one["text"][:one["text"].index(stop)]


def test_each_sequence_says_why_it_stopped_beside_the_slots_and_the_tokens_held(tiny_ckpt, tmp_path, capsys):
    """--json and the API: `stop_reason` per sequence (max_new_tokens, a stop string, an EOS, the model's context
    where the default max_new_tokens was clamped to it), `slots` (the cache's, per layer and KV head) beside
    `tokens_held` (what the cache holds at the end: the last sampled token is never written)."""
    plain = cli(tiny_ckpt, capsys, "--prompt", "the quick brown fox")
    n = plain["prompt_tokens"]
    assert plain["stop_reason"] == "max_new_tokens" and (plain["slots"], plain["tokens_held"]) == (n + 24, n + 23)
    evicting = cli(tiny_ckpt, capsys, "--prompt", "the quick brown fox", "--policy", "keydiff", "--budget", "16",
                   "--block-size", "4")
    assert (evicting["slots"], evicting["tokens_held"]) == (16, 16) and "slots_held" not in evicting
    stop = plain["text"][6:9]
    assert cli(tiny_ckpt, capsys, "--prompt", "the quick brown fox", "--stop", stop)["stop_reason"] == "stop_string"
    batch = cli(tiny_ckpt, capsys, "--prompt", "the quick brown fox", "--prompt", "the lazy dog", "--stop", stop)
    assert [s["stop_reason"] for s in batch["sequences"]] == batch["stop_reason"]
    assert batch["stop_reason"][0] == "stop_string"
    model, tok = load_model(tiny_ckpt, torch.float32, "cpu"), load_tokenizer(tiny_ckpt)
    ids = tok.prompt_ids("the quick brown fox", chat=False)
    gen = engine.Generation(model.args, None, [len(ids)], max_new_tokens=24)
    gen.setup(model)
    out, stats = gen.generate(model, [ids], eos_ids={plain["token_ids"][3]})
    assert out[0] == plain["token_ids"][:4] and stats["stop_reason"] == "eos"
    short = tmp_path / "short"  # a context of 16: the default max_new_tokens (200) is clamped to what is left
    shutil.copytree(tiny_ckpt, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 16}))
    r = engine.generate_text("the quick brown fox", checkpoint=str(short), chat_template=False)
    assert r["stop_reason"] == "context" and r["generated_tokens"] == 16 - r["prompt_tokens"]


def test_the_apis_compile_shows_its_progress_line(tiny_ckpt, monkeypatch, capsys):
    """generate_text(compile=True) says it is compiling, as the command line does (a cold compile took minutes with
    nothing on the screen); here off a terminal, a line per LOG_INTERVAL, around a stand-in for the compile."""
    import time

    import progress
    monkeypatch.setattr(progress, "LOG_INTERVAL", 0.01)

    def compile_standing_in(self, model, first_id, mode=None, prefill=None, freeze=False, around=None, warm=True):
        self.compile_mode, self.compiled_prefill = "aot", False
        with around(self) as terminal:
            assert terminal is None  # stderr: AotStep's own lines go there too
            time.sleep(0.2)
    monkeypatch.setattr(engine.Generation, "compile", compile_standing_in)
    engine.generate_text("the fox", checkpoint=str(tiny_ckpt), chat_template=False, max_new_tokens=2, compile=True)
    assert "compiling the decode step (aot) ... 0 s" in capsys.readouterr().err.splitlines()


def test_a_run_generates_only_on_the_caches_it_set_up_for_its_prompts(tiny):
    """A Generation used out of order (generate or compile before setup, after another run set up caches on the same
    model, with prompts other than those it planned for) is one UserError, never an AttributeError, a torch error
    from inside a step, or tokens generated over another run's caches or another prompt length's plan (SAGE-KV's
    layout planned for 38 tokens gave a 620-token prompt one token repeated). Set up again, it is a fresh run's."""
    from errors import UserError
    model = tiny[1]
    short, long = PROMPTS[0][:40], PROMPTS[0] + PROMPTS[1] * 2

    def make(policy, prompts, budget=48):
        return Generation(model.args, policies.make(policy), [len(p) for p in prompts], budget=budget,
                          max_new_tokens=8, block_size=8)
    run = make("sagekv", [short])
    for call in (lambda: run.generate(model, [short]), lambda: run.prefill(model, [short]),
                 lambda: run.compile(model, short[0])):
        with pytest.raises(UserError, match=r"^model= does not hold this run's caches: call setup\(model\) first"):
            call()
    run.setup(model)
    make("sink", [short], budget=64).setup(model)  # another run on the same model replaces the caches
    with pytest.raises(UserError, match="does not hold this run's caches"):
        run.generate(model, [short])
    run.setup(model)
    for prompts in ([long], [short, short], [short[:-1]]):
        with pytest.raises(UserError, match=rf"^prompts= of \[{', '.join(str(len(p)) for p in prompts)}\] tokens, "
                                            r"but setup\(\) planned the caches for prompts of \[40\] tokens"):
            run.generate(model, prompts)
    got = run.generate(model, [short])[0]
    fresh = make("sagekv", [short])
    fresh.setup(model)
    assert got == fresh.generate(model, [short])[0]
    planned_long = make("sagekv", [long])
    planned_long.setup(model)
    assert len(set(planned_long.generate(model, [long])[0][0])) > 1  # what the long prompt gets when planned for
    for kw, message in ((dict(prompt_lens=[40, 0]), "`prompt_lens` must be >= 1, got 0"),
                        (dict(prompt_lens="40"), "`prompt_lens` must be an integer, got '4'"),
                        (dict(prompt_lens=[40], kv_dtype="int8"), "kv_dtype='int8' is not None, torch.int8")):
        with pytest.raises(UserError, match=f"^{re.escape(message)}"):
            Generation(model.args, None, **kw)
