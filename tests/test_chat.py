"""chat.py: a conversation whose budget cache persists across turns, checked against one-shot runs of the same
concatenated token ids (engine.generate, an independent path), and generate.py --interactive as a user drives it."""
import io
import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch
from conftest import REPO, env_with_tmpdir

import generate
import policies
import runtime
from chat import Chat, TurnRefused, repl, stats_line
from conftest import make_policy
from errors import UserError
from engine import generate as one_shot_generate
from engine import Generation, setup
from runtime import model_step, prefill_step
from loading import load_model
from tokenizer import load_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
EAGER = (prefill_step, model_step)
TEMPLATE = ("{% for m in messages %}<s>{{ m.role }}\n{{ m.content }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
WORDS = "the quick brown fox jumps over the lazy dog"
TURNS = [f"{w} {WORDS.split()[(i * 3) % 9]} fox" for i, w in enumerate(WORDS.split() * 6)]


@pytest.fixture(scope="module")
def chat_ckpt(hf_tiny, tmp_path_factory):
    """The tiny llama checkpoint (context 2048) with a small tokenizer and a ChatML-like template ending turns
    with its EOS token </s>."""
    from conftest import with_tiny_tokenizer
    _, src = hf_tiny("llama")
    d = with_tiny_tokenizer(src, tmp_path_factory.mktemp("tiny_chat"), WORDS)
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                         "chat_template": TEMPLATE}))
    return d


@pytest.fixture(scope="module")
def loaded(chat_ckpt):
    return load_model(chat_ckpt, torch.float32, "cpu"), load_tokenizer(chat_ckpt)


def reference(model, ids, n_new, policy=None, budget=None, block_size=8, one_shot=False):
    """The answer of one engine.generate run over `ids` prefilled in one go (fresh caches)."""
    budget = budget or len(ids) + n_new
    setup(model, policy, budget, len(ids), n_new, block_size, prefill="one-shot" if one_shot else "block")
    out, _ = one_shot_generate(model, ids, n_new, block_size=block_size, steps=EAGER, one_shot=one_shot,
                               eos_ids=set())
    return out


def converse(chat, turns):
    """Send the turns; per turn (prompt ids as prefilled, the answer's ids)."""
    log = []
    for t in turns:
        chat.send(t)
        log.append((list(chat.tokens[:chat.prompt_end]), list(chat.answer_ids)))
    return log


def no_eos(chat):
    chat.eos_ids = set()  # random weights: an early </s> would make the answers trivially short


def test_full_chat_equals_one_shot_runs_of_the_concatenated_conversation(loaded):
    """With full and a large budget, every turn's answer equals a fresh one-shot run over the conversation's token
    ids up to that turn's prompt (the kept history is exactly what a single prefill would have written)."""
    model, tok = loaded
    chat = Chat(model, tok, "full", budget=600, max_new_tokens=6, block_size=8)
    no_eos(chat)
    log = converse(chat, TURNS[:5])
    for ids, answer in log:
        assert answer == reference(model, ids, 6, budget=600)
    # the transcript, built independently: the template's first prompt, then per turn the previous answer (its last
    # token included: not an EOS here) and the template's text closing it and opening the new turn
    expected = tok.chat_prompt_ids(TURNS[0])
    assert log[0][0] == expected
    for (_, answer), (ids, _), turn in zip(log, log[1:], TURNS[1:]):
        expected = expected + answer + tok.template_ids(f"</s>\n<s>user\n{turn}</s>\n<s>assistant\n")
        assert ids == expected


@pytest.mark.parametrize("spec", ["keydiff", "h2o", "snapkv:window=4,kernel=3", "tova", "sink", "caote:keydiff"])
def test_block_wise_chat_with_block_1_equals_a_one_shot_run(loaded, spec):
    """Evicting block-wise policies: with block size 1 a prefill block is a decode step, so the turn boundaries
    do not matter and the chat must equal one engine run over the concatenated ids with the same budget."""
    model, tok = loaded
    chat = Chat(model, tok, spec, budget=24, max_new_tokens=4, block_size=1)
    no_eos(chat)
    log = converse(chat, TURNS[:4])
    assert int(chat.held().max()) <= 24
    for ids, answer in log[2:]:  # past the budget: evictions happened
        assert len(ids) > 24
        assert answer == reference(model, ids, 4, policies.make(spec), budget=24, block_size=1)


@pytest.mark.parametrize("spec", ["snapkv++:kernel=3", "kvec"])
def test_recompression_keeping_everything_equals_full(loaded, spec):
    """One-shot policies that append re-compress history + turn every turn: with a budget that keeps every token
    the kept history must be the whole conversation in position order, i.e. the answers equal full's."""
    model, tok = loaded
    chat = Chat(model, tok, spec, budget=400, max_new_tokens=5, block_size=8)
    no_eos(chat)
    log = converse(chat, TURNS[:4])
    for ids, answer in log:
        assert answer == reference(model, ids, 5, budget=400)


@pytest.mark.parametrize("spec, prefill", [
    ("keydiff", None), ("keydiff", "one-shot"), ("snapkv++:kernel=3", None), ("rocketkv:read=8", None),
    ("kvec:window=4,obs_window=4,long_window=4", None), ("sagekv", None), ("h2o", None), ("sink", None)])
def test_the_cache_never_exceeds_its_budget(loaded, spec, prefill):
    """Block-wise continuation, one-shot then evicting (SAGE-KV, keydiff one-shot) and re-compression (SnapKV++,
    RocketKV, K-VEC) all stay within the budget while the conversation grows past it."""
    model, tok = loaded
    chat = Chat(model, tok, spec, budget=40, max_new_tokens=6, block_size=8, prefill=prefill)
    no_eos(chat)
    for t in TURNS[:8]:
        chat.send(t)
        assert int(chat.held().max()) <= chat.slots <= 40
    assert chat.position > 100  # the conversation outgrew the budget
    assert chat.stats()["turns"] == 8


def test_stop_ends_the_answer_and_keeps_its_tokens(loaded):
    """stop() from the streaming callback ends the answer; the tokens produced stay in the history (the next turn
    equals a one-shot run over it)."""
    model, tok = loaded
    chat = Chat(model, tok, "full", budget=300, max_new_tokens=20, block_size=8)
    no_eos(chat)
    pieces = []

    def on_text(piece):
        pieces.append(piece)
        if len(pieces) == 3:
            chat.stop()
    chat.send(TURNS[0], on_text=on_text)
    chat_first, first_end = list(chat.answer_ids), chat.prompt_end
    assert chat.last["stop_reason"] == "interrupted" and 3 <= len(chat_first) < 20
    assert "".join(pieces) == tok.decode(chat.answer_ids)
    ids, answer = converse(chat, TURNS[1:2])[0]
    assert len(answer) == 20 and chat.last["stop_reason"] == "max_new_tokens"
    # the stopped answer's tokens (its last one fed at the start of this turn) follow the first prompt in the history
    assert ids[first_end:first_end + len(chat_first)] == chat_first
    assert answer == reference(model, ids, 20, budget=300)


# Every registered policy, small enough for the tiny model's turns (make_policy keeps what each class has).
SMALL = dict(window_frac=0.1, n_sink=4, window=4, kernel=3, obs_window=4, long_window=4, read=8, k=8)
ALL_POLICIES = ["full", *policies.REGISTRY]


def kept(chat) -> list:
    """Per layer and KV head, the (position, key row) pairs the cache holds, in position order."""
    out = []
    for layer in chat.model.layers:
        c = layer.attention.kv_cache
        for h in range(c.pos.shape[1]):
            p = c.pos[0, h]
            order = [i for i in p.argsort().tolist() if p[i] >= 0]
            out.append((p[order].tolist(), c.keys()[0, h, order]))
    return out


def assert_consistent(chat):
    """No layer holds a position twice or one the conversation has not reached."""
    for positions, _ in kept(chat):
        assert len(set(positions)) == len(positions) and all(p < chat.position for p in positions)


def assert_same_cache(a, b):
    for (pa, ka), (pb, kb) in zip(a, b, strict=True):
        assert pa == pb
        assert torch.equal(ka, kb)


def new_chat(loaded, name):
    model, tok = loaded
    scorer = name != "full" and policies.REGISTRY[name].scores
    chat = Chat(model, tok, make_policy(name, SMALL), budget=40 if scorer else 400, max_new_tokens=20, block_size=8)
    no_eos(chat)
    chat.send(TURNS[0])
    return chat


def after(chat, raised=None) -> dict:
    """What the second turn left (the transcript, the pending token, the answer, every layer's kept positions and
    keys), then the third turn's answer and whether the caches were consistent after each. The chats share one
    model, whose caches they use: each runs to its end before the next one starts."""
    state = dict(raised=raised, tokens=list(chat.tokens), pending=list(chat.pending), answer=list(chat.answer_ids),
                 position=chat.position, kept=kept(chat))
    assert_consistent(chat)
    state["next"] = chat.send(TURNS[2])
    assert_consistent(chat)
    assert int(chat.held().max()) <= chat.slots
    return state


def interrupted_turn(loaded, name, way) -> dict:
    """after() a second turn interrupted at its third decode step (or, way "prefill", in its prefill) by `way`."""
    chat = new_chat(loaded, name)
    model = chat.model
    step, calls, boom = chat.steps[1], [0], [False]

    def wrapped(m, idx, input_pos):
        calls[0] += 1
        if calls[0] == 3 and way == "sigint":
            os.kill(os.getpid(), signal.SIGINT)  # during the step: its token is dropped
        boom[0] = calls[0] == 3 and way == "step"
        logits = step(m, idx, input_pos)
        return logits.fill_(float("nan")) if calls[0] == 3 and way == "nan" else logits

    def raise_midway(*_):
        if boom[0]:
            raise RuntimeError("inside a step")
    hook = model.layers[len(model.layers) // 2].register_forward_hook(raise_midway)
    chat.steps = (chat.steps[0], wrapped)

    def on_text(piece):
        if way == "on_text" and calls[0] >= 2:  # the third token's piece (or the first after it with text)
            raise ValueError("from on_text")
    old_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    boom[0] = way == "prefill"
    raised = None
    try:
        chat.send(TURNS[1], on_text=on_text)
    except BaseException as e:  # noqa: BLE001 (KeyboardInterrupt is one of the ways)
        raised = e
    finally:
        hook.remove()
        signal.signal(signal.SIGINT, old_handler)
        chat.steps = (chat.steps[0], step)
    return after(chat, raised)


def clean_turn(loaded, name, n_new) -> dict:
    """The reference: after() the same turns, the second answer ending cleanly after n_new tokens."""
    chat = new_chat(loaded, name)
    chat.max_new_tokens = n_new
    chat.send(TURNS[1])
    chat.max_new_tokens = 20
    return after(chat)


@pytest.mark.parametrize("name", ALL_POLICIES)
def test_an_interrupted_turn_keeps_exactly_what_was_decoded(loaded, name):
    """Whatever raises during an answer, the conversation stays consistent: an exception from on_text keeps the
    answer so far (its last token pending) as stop() would; non-finite logits keep every token fed; Ctrl-C during
    a step ends the answer there, drops that step's token and then raises KeyboardInterrupt; each equals a clean
    turn of that length, and so does the next turn. An error inside a step (part of the layers written) or inside
    a prefill leaves no position held twice or past the conversation (after() asserts it), and the next turn runs."""
    def same(a, b, *keys):
        for k in keys:
            assert a[k] == b[k], k
        assert_same_cache(a["kept"], b["kept"])

    got = interrupted_turn(loaded, name, "on_text")
    assert isinstance(got["raised"], ValueError) and len(got["answer"]) >= 3
    same(got, clean_turn(loaded, name, len(got["answer"])), "answer", "tokens", "pending", "position", "next")
    ref4 = clean_turn(loaded, name, 4)
    for way in ("nan", "sigint"):  # the third step's input was written, its output not kept: a 4-token answer's cache
        got = interrupted_turn(loaded, name, way)
        assert isinstance(got["raised"], KeyboardInterrupt if way == "sigint" else UserError), (way, got["raised"])
        assert got["answer"] == ref4["answer"][:3] and got["pending"] == []
        same(got, ref4, "tokens", "position")
    ref3 = clean_turn(loaded, name, 3)
    for way in ("step", "prefill"):
        got = interrupted_turn(loaded, name, way)
        assert isinstance(got["raised"], RuntimeError), (way, got["raised"])
        if way == "step":
            assert (got["answer"], got["pending"], got["tokens"]) == (ref3["answer"], ref3["pending"], ref3["tokens"])
            if name == "full":  # nothing is ever evicted: exactly the clean turn's cache
                same(got, ref3, "next")
        else:
            assert got["position"] < ref3["position"] - 3  # the turn's prompt is not in the transcript


def test_reset_restarts_positions_and_repeats_the_first_answer(loaded):
    model, tok = loaded
    chat = Chat(model, tok, "keydiff", budget=32, max_new_tokens=5, block_size=4)
    no_eos(chat)
    first = chat.send(TURNS[0])
    chat.send(TURNS[1])
    chat.reset()
    assert chat.position == 0 and int(chat.held().max()) == 0
    assert chat.send(TURNS[0]) == first


def test_refusals_leave_the_conversation_unchanged(loaded):
    model, tok = loaded
    chat = Chat(model, tok, "full", budget=60, max_new_tokens=10, block_size=8)
    no_eos(chat)
    chat.send(TURNS[0])
    before = (list(chat.tokens), list(chat.pending))
    with pytest.raises(TurnRefused, match="keeps every token.*raise the budget"):
        for t in TURNS[1:]:
            before = (list(chat.tokens), list(chat.pending))
            chat.send(t)
    assert (list(chat.tokens), list(chat.pending)) == before
    # the model's context: positions are refused past max_position_embeddings whatever the policy keeps
    model.args.max_seq_len, ctx = 80, model.args.max_seq_len
    try:
        chat = Chat(model, tok, "keydiff", budget=16, max_new_tokens=10, block_size=8)
        no_eos(chat)
        with pytest.raises(TurnRefused, match="of the model's 80 positions"):
            for t in TURNS:
                chat.send(t)
        assert chat.position <= 80
    finally:
        model.args.max_seq_len = ctx


def test_a_compiled_chat_does_not_recompile_between_turns(loaded):
    model, tok = loaded
    torch._dynamo.reset()
    try:
        chat = Chat(model, tok, "keydiff", budget=24, max_new_tokens=4, block_size=8)
        chat.compile("default", prefill=True)  # torch.compile's graphs, the prefill block's too
        no_eos(chat)
        chat.send(TURNS[0])
        with torch._dynamo.config.patch(error_on_recompile=True):
            compiled = converse(chat, TURNS[1:4])
            chat.reset()
            chat.send(TURNS[0])
    finally:
        torch._inductor.config.freezing = False
        torch._dynamo.reset()
    eager = Chat(model, tok, "keydiff", budget=24, max_new_tokens=4, block_size=8)
    no_eos(eager)
    eager.send(TURNS[0])
    assert converse(eager, TURNS[1:4]) == compiled


def test_repl_commands_and_ctrl_c(loaded, monkeypatch):
    """The REPL: a turn per line, /stats, /reset, unknown commands, and SIGINT during an answer stops the answer,
    not the loop."""
    model, tok = loaded
    chat = Chat(model, tok, "keydiff", budget=32, max_new_tokens=30, block_size=8)
    no_eos(chat)
    send = chat.send

    def send_with_ctrl_c(text, on_text=None):
        n = [0]

        def hit(piece):
            n[0] += 1
            if n[0] == 2 and text == "interrupt me":
                os.kill(os.getpid(), signal.SIGINT)  # the handler runs at the next bytecode: chat.stop()
            on_text(piece)
        answer = send(text, on_text=hit)
        stopped.append(chat.last["stop_reason"] == "interrupted")
        answers.append(answer)
        return answer
    stopped, answers = [], []
    monkeypatch.setattr(chat, "send", send_with_ctrl_c)
    stats_of = chat.stats

    def keep_stats():
        stats.update(stats_of())
        return stats_of()
    stats = {}
    monkeypatch.setattr(chat, "stats", keep_stats)
    stdin = io.StringIO(f"{TURNS[0]}\ninterrupt me\n/stats\n/bogus\n/reset\n\n{TURNS[0]}\n/exit\nnever read\n")
    out, err = io.StringIO(), io.StringIO()
    assert repl(chat, stdin=stdin, out=out, err=err) == 0
    assert out.getvalue() == "\n".join([answers[0], answers[1], stats_line(stats), answers[2], ""])
    assert stats["turns"] == 2 and stats_line(stats).startswith("--- 2 turns | keydiff (block prefill)")
    assert answers[2] == answers[0]  # after /reset the first turn's answer again
    assert "unknown command /bogus" in err.getvalue() and "conversation reset" in err.getvalue()
    assert chat.turns == 1 and stopped == [False, True, False]


def test_repl_ctrl_c_during_a_decode_step_prints_only_the_kept_tokens(loaded):
    """Ctrl-C in the REPL while a decode step runs (SIGINT sent from inside the third step): the answer ends with
    the tokens whose steps completed, the token that step produced is neither printed nor kept (one extra token was
    printed after Ctrl-C), and the REPL goes on to the next turn."""
    model, tok = loaded
    chat = Chat(model, tok, "keydiff", budget=32, max_new_tokens=20, block_size=8)
    no_eos(chat)
    step, calls = chat.steps[1], [0]

    def wrapped(m, idx, input_pos):
        calls[0] += 1
        if calls[0] == 3:
            os.kill(os.getpid(), signal.SIGINT)  # REPL's handler: chat.stop() while the step runs
        return step(m, idx, input_pos)
    chat.steps = (chat.steps[0], wrapped)
    send, turns = chat.send, []

    def recorded(text, on_text=None):
        answer = send(text, on_text=on_text)
        turns.append((answer, list(chat.answer_ids), chat.last["stop_reason"]))
        return answer
    chat.send = recorded
    out = io.StringIO()
    assert repl(chat, stdin=io.StringIO(f"{TURNS[0]}\n{TURNS[1]}\n"), out=out, err=io.StringIO()) == 0
    (first, first_ids, why), (second, second_ids, _) = turns
    assert why == "interrupted" and len(first_ids) == 3 and first == tok.decode(first_ids)
    assert len(second_ids) == 20
    assert out.getvalue() == f"{first}\n{second}\n"  # what was printed is what was kept


def cli(ckpt, *extra, stdin="", timeout=300):
    return subprocess.run([sys.executable, str(REPO / "generate.py"), "--checkpoint", str(ckpt), "--interactive",
                           *extra], input=stdin, capture_output=True, text=True, timeout=timeout)


def test_fifty_turns_through_stdin_keep_memory_flat(chat_ckpt):
    """50 scripted turns through generate.py --interactive --json: the cache never holds more than its budget and
    the process's peak memory of a turn stays within a few percent of the first turns'."""
    turns = (TURNS * 2)[:50]
    r = cli(chat_ckpt, "--policy", "keydiff", "--budget", "32", "--block-size", "8", "--max-new-tokens", "8",
            "--json", stdin="\n".join(turns) + "\n/stats\n", timeout=600)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    stats = rows.pop()["stats"]
    assert len(rows) == 50 and stats["turns"] == 50
    assert all(row["tokens_held"] <= row["slots"] == 32 for row in rows)  # generate.py --json's names and meanings
    assert {row["stop_reason"] for row in rows} <= {"eos", "max_new_tokens"} and stats["tokens_held"] <= 32
    assert rows[-1]["positions_used"] > 10 * 32  # the conversation is far longer than the cache
    early = max(row["peak_bytes"] for row in rows[:5])
    assert max(row["peak_bytes"] for row in rows[5:]) <= 1.03 * early


@pytest.mark.parametrize("extra, message", [
    (["--prompt", "hi"], "--interactive takes its turns from stdin"),
    (["--prompt-file", "x.txt"], "--interactive takes its turns from stdin"),
    (["--random-weights", "--prompt-tokens", "4"], "--interactive needs a tokenizer"),
    (["--profile", "t.json"], "--profile"),
    (["--policy", "snapkv", "--budget", "8"], "must exceed the observation window"),  # before the first turn
    (["--budget", "100", "--max-new-tokens", "100"], "--budget must be >= prompt + --max-new-tokens"),
    (["--budget", "5000"], "larger than the model's context (2048)"),
])
def test_bad_interactive_flags_get_one_line(chat_ckpt, capsys, extra, message):
    code = generate.main(["--checkpoint", str(chat_ckpt), "--interactive", *extra])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1


def test_interactive_full_budget_exhausted_is_one_line_not_the_end(chat_ckpt):
    r = cli(chat_ckpt, "--budget", "40", "--max-new-tokens", "8", stdin="\n".join(TURNS[:4]) + "\n/stats\n")
    assert r.returncode == 0, r.stderr
    assert "error: full keeps every token" in r.stderr and "Traceback" not in r.stderr
    assert "--- " in r.stdout


def test_an_answer_ending_in_eos_is_closed_by_the_template(loaded):
    """The EOS that ended an answer is not fed again: the template's own end of turn follows the answer's text."""
    model, tok = loaded
    probe = Chat(model, tok, "full", budget=300, max_new_tokens=8, block_size=8)
    no_eos(probe)
    probe.send(TURNS[0])
    first = probe.answer_ids
    eos = next(t for i, t in enumerate(first) if i > 0 and t not in first[:i])  # a token that first appears later
    chat = Chat(model, tok, "full", budget=300, max_new_tokens=8, block_size=8)
    chat.eos_ids = {eos}
    chat.send(TURNS[0])
    assert chat.answer_ids == first[:first.index(eos) + 1]
    prompt_end = chat.prompt_end
    chat.send(TURNS[1])
    assert list(chat.tokens[prompt_end:chat.prompt_end]) == first[:first.index(eos)] + \
        tok.template_ids(f"</s>\n<s>user\n{TURNS[1]}</s>\n<s>assistant\n")


def test_a_turn_holding_the_answer_marker_is_added_as_any_other(loaded):
    """A user who types chat.MARKER (the stand-in for the previous answer) gets the template's turn, not a refusal
    blaming the template, and a previous turn holding it does not block every later one."""
    from chat import MARKER
    model, tok = loaded
    chat = Chat(model, tok, "keydiff", budget=32, max_new_tokens=4, block_size=4)
    no_eos(chat)
    for text in (f"the {MARKER} fox", f"{MARKER}-1>> dog {MARKER}", "the dog"):
        pending = [t for t in chat.pending if t != tok.eos_ids[0]]
        start = chat.position
        chat.send(text)
        if start:
            assert list(chat.tokens[start:chat.prompt_end]) == pending + \
                tok.template_ids(f"</s>\n<s>user\n{text}</s>\n<s>assistant\n")


def test_a_second_chat_on_the_same_model_does_not_answer_from_the_first_ones_cache(loaded):
    """Chat B set up on A's model replaces the model's caches: A's next turn is refused (it would have been answered
    over B's conversation), A's reset() leaves B's conversation alone, and after it A starts over as a new chat."""
    model, tok = loaded
    a = Chat(model, tok, "keydiff", budget=32, max_new_tokens=4, block_size=4)
    no_eos(a)
    first = a.send(TURNS[0])
    b = Chat(model, tok, "keydiff", budget=32, max_new_tokens=4, block_size=4)
    no_eos(b)
    b.send(TURNS[5])
    held = int(b.held().max())
    with pytest.raises(UserError, match="caches were replaced"):
        a.send(TURNS[1])
    a.reset()
    assert int(b.held().max()) == held > 0
    b.send(TURNS[6])
    assert a.send(TURNS[0]) == first


def test_compiling_a_chat_whose_caches_were_replaced_leaves_the_other_conversation_alone(loaded, monkeypatch):
    """Chat A compiled after chat B replaced the model's caches: A's warm-up ran on B's caches (9 of layer 0's
    positions rewritten under B's conversation). Now A takes the model back, as its next turn would after reset():
    B's caches are untouched and B's next turn is refused; A then answers as a new chat."""
    model, tok = loaded
    monkeypatch.setattr(runtime, "compile_steps", lambda device, mode, prefill, freeze, fns: (*fns[0], *fns[1]))
    a = Chat(model, tok, "keydiff", budget=32, max_new_tokens=4, block_size=4)
    first = a.send(TURNS[0])
    b = Chat(model, tok, "keydiff", budget=32, max_new_tokens=4, block_size=4)
    b.send(TURNS[5])
    kept = [(c.pos.clone(), *(t.clone() for t in c.kv_buffers())) for c in b.caches]
    a.compile(mode="default")  # the steps stay eager (stubbed): the warm-up is what runs
    for c, was in zip(b.caches, kept):
        assert all(torch.equal(t, w) for t, w in zip((c.pos, *c.kv_buffers()), was))
    with pytest.raises(UserError, match="caches were replaced"):
        b.send(TURNS[6])
    assert a.send(TURNS[0]) == first


@pytest.mark.parametrize("name", ["sagekv", "rocketkv"])
def test_a_policy_object_shared_with_another_run_keeps_the_chats_plan(loaded, chat_ckpt, name):
    """A policy object given to a Chat and then to a run of another prompt length and budget (another model): the
    run plans its own copy, so the chat's next turn answers as a chat that never shared it (before: SAGE-KV
    answered with the other run's layout, RocketKV failed with a KeyError)."""
    model, tok = loaded
    shared, other = policies.make(name), load_model(chat_ckpt, torch.float32, "cpu")

    def conversation(policy, between=None):
        chat = Chat(model, tok, policy, budget=64, max_new_tokens=6, block_size=8)
        no_eos(chat)
        first = chat.send(TURNS[0])
        if between:
            between()
        return first, chat.send(TURNS[1])
    gen = lambda: Generation(other.args, shared, [300], budget=40, max_new_tokens=4, block_size=8).setup(other)
    assert conversation(shared, gen) == conversation(name)


def test_interactive_compile_compiles_before_the_first_turn(chat_ckpt, loaded, tmp_path):
    """--interactive --compile: the steps compile once, before the first turn (the compiler's output goes to the
    log, not the terminal), and every turn's answer equals an eager chat's (this process's, at the same settings,
    its EOS in effect). Both steps under torch.compile at the policy, budget, block size and new tokens of
    test_a_compiled_chat_does_not_recompile_between_turns, whose graphs this run finds in inductor's cache (a cold
    compile's silence: test_cli's second-process test)."""
    argv = ["--policy", "keydiff", "--budget", "24", "--block-size", "8", "--max-new-tokens", "4", "--threads", "1",
            "--json"]
    turns = TURNS[:3]
    compiled = subprocess.run([sys.executable, str(REPO / "generate.py"), "--checkpoint", str(chat_ckpt),
                               "--interactive", "--compile", "--compile-mode", "default", "--compile-prefill", *argv],
                              input="\n".join(turns) + "\n", capture_output=True, text=True, timeout=600,
                              env=env_with_tmpdir(tmp_path))
    assert compiled.returncode == 0, compiled.stderr
    assert [line for line in compiled.stderr.splitlines()  # the compile's own progress line only (past 5 s)
            if not re.fullmatch(r"compiling the prefill and decode steps \(default\) \.\.\. \d+ s", line)] == []
    eager = Chat(*loaded, "keydiff", budget=24, max_new_tokens=4, block_size=8)
    want = [answer for _, answer in converse(eager, turns)]
    assert [json.loads(line)["token_ids"] for line in compiled.stdout.splitlines()] == want and len(want) == 3


@pytest.mark.cuda
def test_a_chat_on_cuda_graphs_answers_as_eager(chat_ckpt):
    """On a GPU: a conversation whose steps replay as CUDA graphs (the cache persisting across turns outside the
    graphs' memory pool) answers every turn as an eager conversation does, without a recompile or a cudagraph skip."""
    from torch._dynamo.utils import counters

    torch.backends.cuda.matmul.allow_tf32 = False
    model, tok = load_model(chat_ckpt, torch.float32, "cuda"), load_tokenizer(chat_ckpt)
    eager = Chat(model, tok, "keydiff", budget=24, max_new_tokens=4, block_size=8)
    no_eos(eager)
    want = converse(eager, TURNS[:4])
    torch._dynamo.reset()
    counters.clear()
    try:
        chat = Chat(model, tok, "keydiff", budget=24, max_new_tokens=4, block_size=8)
        chat.compile()  # CUDA graphs for decode
        no_eos(chat)
        got = converse(chat, TURNS[:1])  # compiles
        with torch._dynamo.config.patch(error_on_recompile=True):
            got += converse(chat, TURNS[1:4])
    finally:
        torch._dynamo.reset()
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert got == want


@pytest.mark.parametrize("during", ["send", "reset", "other_chat", "new_chat"])
def test_a_turn_or_reset_asked_for_during_a_turn_is_refused_and_the_turn_goes_on(loaded, during):
    """send() or reset() of the chat, another chat's send() or a new Chat on the same model, called while a turn
    runs on it (from on_text, or another thread), would write the caches under the running turn's steps: each is
    refused (UserError), and the running turn, the transcript and the next turn are those of a conversation where
    nobody asked."""
    model, tok = loaded

    def conversation(nested):
        chat = Chat(model, tok, "keydiff", budget=40, max_new_tokens=6, block_size=8)
        no_eos(chat)
        other = Chat(model, tok, "keydiff", budget=40, max_new_tokens=6, block_size=8)
        chat.send(TURNS[0])
        refused = []

        def on_text(piece):
            if nested and not refused:
                try:
                    {"send": lambda: chat.send(TURNS[5]), "reset": chat.reset,
                     "other_chat": lambda: other.send(TURNS[5]),
                     "new_chat": lambda: Chat(model, tok, "sink", budget=16)}[during]()
                except UserError as e:
                    refused.append(str(e))
                else:
                    refused.append(None)
        second = chat.send(TURNS[1], on_text=on_text)
        state = list(chat.tokens), list(chat.pending), chat.position, kept(chat)
        assert_consistent(chat)
        return refused, second, state, chat.send(TURNS[2])

    refused, second, state, third = conversation(True)
    _, ref_second, ref_state, ref_third = conversation(False)
    assert (second, third) == (ref_second, ref_third)
    assert state[:3] == ref_state[:3]
    assert_same_cache(state[3], ref_state[3])
    assert refused and refused[0] is not None and "turn" in refused[0]


def test_a_turn_of_the_wrong_type_is_one_line_and_writes_nothing(loaded):
    """send() with a text that is not a str (None, bytes, a number) or an on_text that cannot be called: one
    UserError naming the parameter, before anything is written (before: None and bytes were blamed on the chat
    template, a number and a non-callable on_text were TypeErrors, the latter after the turn's prompt was kept)."""
    model, tok = loaded
    chat = Chat(model, tok, "keydiff", budget=32, max_new_tokens=4, block_size=4)
    first = chat.send(TURNS[0])
    position = chat.position
    for kw, message in ((dict(text=None), "text=None is not a text (str)"),
                        (dict(text=b"hi"), "text=b'hi' is not a text (str)"), (dict(text=5), "text=5 is not a text"),
                        (dict(text=TURNS[1], on_text=5), "on_text=5 is not callable")):
        with pytest.raises(UserError, match=f"^{re.escape(message)}"):
            chat.send(**kw)
        assert chat.position == position
    with pytest.raises(UserError, match=r"^kv_dtype='int8' is not None, torch.int8 or a float torch.dtype"):
        Chat(model, tok, "keydiff", budget=32, kv_dtype="int8")
    chat.reset()
    assert chat.send(TURNS[0]) == first
