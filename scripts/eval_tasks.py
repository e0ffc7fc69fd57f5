"""Evaluation tasks and metrics: RULER-style synthetic retrieval (generated, seeded, no download) and LongBench.

    samples = TASKS["niah_single"](count_tokens, 4096, n_samples=20, seed=0)      # count_tokens: str -> int
    score = METRICS[s.metric](prediction, s.answers)                               # in [0, 1]
    samples = load_longbench("hotpotqa", "data/hotpotqa.jsonl")                     # or None: the HF hub
    score = longbench_score("hotpotqa", prediction, sample)

Synthetic prompts are the context, then the question (tokenizer.with_document); the context starts with RULER's
one-line instruction, then the haystack (meta["haystack_start"] is where it begins). `depth` is the share of the
filler (the haystack without needles, as in RULER) before the needle asked about, whose offset is
meta["needle_offsets"][0].
meta["answer_prefix"] is RULER's answer prefix, for a runner that appends it after the chat template, and
meta["max_new_tokens"] RULER's generation length for the task.
LongBench prompts use LongBench's own per-task template (meta["template"]); its metrics follow LongBench's
metrics.py, whose numbers the papers report, quirks included (noted where they matter).
"""
import sys

if __name__ == "__main__":  # run directly: one line, not an ImportError
    PART = "scripts/eval_tasks.py is a part of scripts/eval.py, not a command of its own"
    print(f"usage: {PART}" if sys.argv[1:] in (["-h"], ["--help"]) else f"error: {PART}",
          file=sys.stdout if sys.argv[1:] in (["-h"], ["--help"]) else sys.stderr)
    sys.exit(0 if sys.argv[1:] in (["-h"], ["--help"]) else 2)

import itertools
import random
import re
import string
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from files import json_type, jsonl_objects, read_capped
from tokenizer import with_document


@dataclass
class Sample:
    task: str
    context: str  # the long part (haystack / document)
    question: str  # the query, placed after the context
    answers: list[str]  # gold answers (all must appear for multi-value tasks)
    metric: str  # name in METRICS
    meta: dict = field(default_factory=dict)

    def prompt(self) -> str:
        # LongBench samples carry their task's template ({context}, {input}); synthetic ones are context then
        # question, as every prompt with a document (tokenizer.with_document)
        template = self.meta.get("template")
        if template:
            return template.format(context=self.context, input=self.question)
        return with_document(self.question, self.context)


# ---------------------------------------------------------------------------------------------------------------
# Metrics: fn(prediction, answers) -> [0, 1]

def string_match_all(prediction: str, answers: list[str]) -> float:
    """RULER (niah, vt, cwe): share of the gold strings found anywhere in the output, case-insensitive."""
    p = prediction.lower()
    return sum(a.lower() in p for a in answers) / len(answers) if answers else 0.0


def string_match_part(prediction: str, answers: list[str]) -> float:
    """RULER (qa): 1 if any gold string is in the output."""
    p = prediction.lower()
    return float(any(a.lower() in p for a in answers))


def _normalize(s: str) -> str:
    # SQuAD/LongBench answer normalisation: lower case, drop punctuation, then articles, squeeze whitespace
    s = "".join(c for c in s.lower() if c not in string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def _f1(pred: list[str], gold: list[str]) -> float:
    same = sum((Counter(pred) & Counter(gold)).values())
    if same == 0:
        return 0.0
    p, r = same / len(pred), same / len(gold)
    return 2 * p * r / (p + r)


def qa_f1(prediction: str, answers: list[str]) -> float:
    """LongBench QA: F1 of the normalised word bags, max over the gold answers."""
    return max((_f1(_normalize(prediction).split(), _normalize(a).split()) for a in answers), default=0.0)


def _lcs_table(a, b) -> list[list[int]]:
    t = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, x in enumerate(a, 1):
        prev, row = t[i - 1], t[i]
        for j, y in enumerate(b, 1):
            row[j] = prev[j - 1] + 1 if x == y else max(prev[j], row[j - 1])
    return t


def _lcs_words(ref: list[str], hyp: list[str]) -> set[str]:
    # one LCS, traced back the way the `rouge` package does it (ties move along hyp), as a set of words
    t, i, j, out = _lcs_table(ref, hyp), len(ref), len(hyp), set()
    while i and j:
        if ref[i - 1] == hyp[j - 1]:
            out.add(ref[i - 1])
            i, j = i - 1, j - 1
        elif t[i - 1][j] > t[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return out


def _rouge_l(hyp: str, ref: str) -> float:
    # LongBench calls the `rouge` package (Rouge().get_scores, "rouge-l" "f"), which is summary-level ROUGE-L with
    # sets: sentences are split on ".", words on " " (case and punctuation kept); the LCS words of every
    # (reference sentence, hypothesis sentence) pair are pooled as a set, over the number of *distinct* words on each
    # side. An empty hypothesis raises there and LongBench scores 0.
    hs = [" ".join(s.split()).split(" ") for s in hyp.split(".") if s]
    rs = [" ".join(s.split()).split(" ") for s in ref.split(".") if s]
    if not hs or not rs:
        return 0.0
    union = set().union(*(_lcs_words(r, h) for r in rs for h in hs))
    p = len(union) / len(set(itertools.chain(*hs)))
    r = len(union) / len(set(itertools.chain(*rs)))
    return 2 * p * r / (p + r + 1e-8)


def rouge_l(prediction: str, answers: list[str]) -> float:
    """LongBench summarisation: ROUGE-L F (the `rouge` package's definition), max over the gold answers."""
    return max((_rouge_l(prediction, a) for a in answers), default=0.0)


def classification(prediction: str, answers: list[str], all_classes: list[str] | None = None) -> float:
    """LongBench TREC: every class name found in the prediction is a guess; 1/len(guesses) if the gold is one of them.

    Class names that are substrings of the gold label don't count as guesses. LongBench removes them from the list it
    is iterating over, which skips the entry after each removal; kept here so scores match. Without all_classes the
    gold answers serve as the class list."""
    classes = all_classes or answers
    best = 0.0
    for gold in answers:
        guesses, i = [c for c in classes if c in prediction], 0
        while i < len(guesses):
            if guesses[i] in gold and guesses[i] != gold:
                del guesses[i]  # and skip the next one, as LongBench's remove-while-iterating does
            i += 1
        best = max(best, 1 / len(guesses) if gold in guesses else 0.0)
    return best


def _vote_share(prediction: str, gold: str | None) -> float:
    # every number the model writes is a vote; the share of votes for the gold number
    nums = re.findall(r"\d+", prediction)
    return sum(n == gold for n in nums) / len(nums) if nums and gold is not None else 0.0


def retrieval(prediction: str, answers: list[str]) -> float:
    """LongBench PassageRetrieval: gold "Paragraph N"; share of the numbers in the prediction equal to N."""
    def gold(a):
        n = re.findall(r"Paragraph (\d+)", a) or re.findall(r"\d+", a)
        return n[0] if n else None
    return max((_vote_share(prediction, gold(a)) for a in answers), default=0.0)


def count(prediction: str, answers: list[str]) -> float:
    """LongBench PassageCount: share of the numbers in the prediction equal to the gold count."""
    return max((_vote_share(prediction, str(a).strip()) for a in answers), default=0.0)


def levenshtein(a: str, b: str, sub: int = 1) -> int:
    """Edit distance; sub=2 makes a substitution cost a deletion plus an insertion (the InDel distance)."""
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (0 if x == y else sub)))
        prev = cur
    return prev[-1]


def _fuzz_ratio(a: str, b: str) -> float:
    # fuzzywuzzy's fuzz.ratio (with python-Levenshtein): Levenshtein.ratio = 1 - InDel / (len a + len b), reported
    # as a whole percent; equal strings 100, one empty 0
    if a == b:
        return 1.0
    if not a or not b:
        return 0.0
    return round(100 * (1 - levenshtein(a, b, sub=2) / (len(a) + len(b)))) / 100


def code_sim(prediction: str, answers: list[str]) -> float:
    """LongBench LCC / RepoBench-P: the first generated line that is not a comment or a markdown fence, against the
    gold next line, by edit similarity."""
    lines = prediction.lstrip("\n").split("\n")
    line = next((x for x in lines if "`" not in x and "#" not in x and "//" not in x), "")
    return max((_fuzz_ratio(line, a) for a in answers), default=0.0)


def _words(s: str) -> list[str]:
    return [w.strip(string.punctuation) for w in s.lower().split()]


def partial_credit(prediction: str, answer: str) -> float:
    """Share of the answer reproduced in order. A one-word answer (a passkey, a number) counts characters: the
    longest common subsequence with the closest word of the prediction ("71439" for "71432": 0.8). A longer answer
    counts words: the LCS of the answer's words with the prediction's, over the answer's word count."""
    ans, pred = _words(answer), _words(prediction)
    if not ans or not ans[0]:
        return 0.0
    if len(ans) == 1:
        return max((_lcs_table(ans[0], w)[-1][-1] for w in pred), default=0) / len(ans[0])
    return _lcs_table(ans, pred)[-1][-1] / len(ans)


def partial(prediction: str, answers: list[str]) -> float:
    """partial_credit averaged over the gold answers (all count for multi-value tasks)."""
    return sum(partial_credit(prediction, a) for a in answers) / len(answers) if answers else 0.0


METRICS = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
    "qa_f1": qa_f1,
    "rouge_l": rouge_l,
    "classification": classification,
    "retrieval": retrieval,
    "count": count,
    "code_sim": code_sim,
    "partial_credit": partial,
}


# ---------------------------------------------------------------------------------------------------------------
# Synthetic tasks (RULER-style). No digits in any filler, so a number needle occurs exactly once.

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
# Essay-like filler for NIAH (RULER uses Paul Graham essays, a download): varied sentences, so the needle is not
# the only distinct thing in the context, as it would be in pure repetition.
ESSAY = [
    "The old library on the hill keeps its windows open through most of the summer.",
    "Most people who start a small business underestimate how long the first customers take to arrive.",
    "A good teacher explains the same idea in three different ways before moving on.",
    "The river froze early that year, and the ferry stopped running before the holidays.",
    "Writing a clear letter is harder than it looks, because every sentence has to earn its place.",
    "The committee argued for hours about the color of the new benches in the park.",
    "Farmers in the valley plant barley in the spring and leave some fields fallow every few years.",
    "When the power went out, the neighbors gathered in the bakery to share bread and stories.",
    "Learning to draw is mostly learning to see what is actually in front of you.",
    "The museum moved its collection of maps to a cooler room to protect the paper.",
    "Some of the best ideas come from noticing what everyone else has stopped paying attention to.",
    "The train to the coast was slow, but the view of the cliffs made up for it.",
    "A careful cook tastes the soup several times before deciding that it is finished.",
    "The company rewrote its software twice before anyone outside the office used it.",
    "Children in the village learn to swim in the lake long before they learn to ride a bicycle.",
    "Old houses creak at night as the wooden beams cool after a warm day.",
    "The city council finally agreed to repair the bridge after the spring floods.",
    "Reading widely makes it easier to recognize a good argument when you meet one.",
    "The lighthouse keeper wrote down the weather every evening in a thick leather notebook.",
    "Most advice about working well says the same thing in slightly different words.",
    "The market opens at dawn, and the best fruit is usually gone before noon.",
    "A quiet walk after dinner often solves problems that a long meeting could not.",
]
# Needle keys are "adjective-noun" (RULER's style). No adjective is a suffix of another, so no key can contain
# another key; the hyphen keeps keys out of the filler.
ADJS = ("amber brave calm dusty eager fancy gentle hollow jolly lucky misty noble proud rapid rustic shiny silent "
        "tidy vivid wild clever frozen golden bitter").split()
NOUNS = ("harbor falcon lantern meadow pebble canyon violin orchard glacier compass willow beacon ribbon thimble "
         "quarry walrus saddle marble garden rocket").split()

PASSKEY_HEAD = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                "I will quiz you about the important information there.")
NIAH_NEEDLE = "One of the special magic numbers for {key} is: {value}."
NIAH_HEAD = {1: "A special magic number is hidden within the following text. Make sure to memorize it. "
                "I will quiz you about the number afterwards.",
             2: "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
                "I will quiz you about the numbers afterwards."}
VT_HEAD = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n"
VT_QUESTION = "Question: Find all variables that are assigned the value {value} in the text above."
VT_PREFIX = ("Answer: According to the chain(s) of variable assignment in the text above, {n} variables are assigned "
             "the value {value}, they are:")
CWE_HEAD = ("Below is a numbered list of words. In these words, some appear more often than others. "
            "Memorize the ones that appear most often.")


def _place(units: list[str], needles: list[tuple[float, str]], sep: str) -> tuple[str, list[int]]:
    """Join filler units with `sep`, each (depth, text) needle inserted at the unit boundary with the closest share
    `depth` of the filler's characters before it (the filler is uniform English, so characters track tokens).
    Needles at the same boundary keep their order. Returns the text and each needle's character offset."""
    cum = list(itertools.accumulate((len(u) + len(sep) for u in units), initial=0))
    at = [min(range(len(units) + 1), key=lambda i: abs(cum[i] - d * cum[-1])) for d, _ in needles]
    parts, where = [], {}
    for i in range(len(units) + 1):
        for j in (j for j in range(len(needles)) if at[j] == i):
            where[j] = len(parts)
            parts.append(needles[j][1])
        if i < len(units):
            parts.append(units[i])
    starts = list(itertools.accumulate((len(p) + len(sep) for p in parts), initial=0))
    return sep.join(parts), [starts[where[j]] for j in range(len(needles))]


def _synthetic(task, head, body, offsets, question, answers, prefix, max_new, **meta) -> Sample:
    context = head + "\n" + body
    start = len(head) + 1
    return Sample(task, context, question, answers, "string_match_all",
                  dict(meta, haystack_start=start, needle_offsets=[start + o for o in offsets],
                       answer_prefix=prefix, max_new_tokens=max_new))


def _numbers(rng: random.Random, n: int, digits: int) -> list[str]:
    return [str(v) for v in rng.sample(range(10 ** (digits - 1), 10 ** digits), n)]  # distinct, same length


def _essay(rng: random.Random, k: int) -> list[str]:
    out = []
    while len(out) < k:  # reshuffled passes over the pool, so no fixed period
        out += rng.sample(ESSAY, len(ESSAY))
    return out[:k]


def _passkey(rng, k, depth, n_tokens):
    key = _numbers(rng, 1, 5)[0]
    # the classic needle says the key twice ("... Remember it. 71432 is the pass key."); here once, like every other
    # needle, so each answer occurs exactly once in the context
    body, offs = _place([NOISE] * k, [(depth, f"The pass key is {key}. Remember it.")], "\n")
    return _synthetic("passkey", PASSKEY_HEAD, body, offs, "What is the pass key?", [key], "The pass key is", 32)


def _niah(task, n_keys, n_values):
    def make(rng, k, depth, n_tokens):
        keys = [f"{a}-{rng.choice(NOUNS)}" for a in rng.sample(ADJS, n_keys)]
        values = _numbers(rng, n_keys * n_values, 7)
        # keys[0] is the one asked for; its values are values[:n_values]; the first of them sits at `depth`, the
        # other needles (more values, or distractor keys) at random depths
        needles = [(depth if i == 0 else rng.random(), NIAH_NEEDLE.format(key=keys[i // n_values], value=v))
                   for i, v in enumerate(values)]
        body, offs = _place(_essay(rng, k), needles, " ")
        one = n_values == 1
        what = "is the special magic number" if one else "are all the special magic numbers"
        prefix = (f"The special magic number for {keys[0]} mentioned in the provided text is" if one else
                  f"The special magic numbers for {keys[0]} mentioned in the provided text are")
        return _synthetic(task, NIAH_HEAD[1 if one else 2], body, offs,
                          f"What {what} for {keys[0]} mentioned in the provided text?", values[:n_values], prefix, 128,
                          keys=keys)
    return make


def _variable_tracking(rng, k, depth, n_tokens, hops=4):
    # RULER's vt: one chain of 5 variables (5 capital letters) through 4 hops from a 5-digit value, noise filler.
    # Names that are words of the surrounding text ("AGAIN") would be matched in any answer that echoes the text.
    text = (VT_HEAD + NOISE + VT_QUESTION + VT_PREFIX).lower()
    names = []
    while len(names) < hops + 1:
        v = "".join(rng.choices(string.ascii_uppercase, k=5))
        if v not in names and v.lower() not in text:
            names.append(v)
    value = _numbers(rng, 1, 5)[0]
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {b} = VAR {a}" for a, b in zip(names, names[1:])]
    depths = [depth] + sorted(rng.uniform(depth, 1) for _ in chain[1:])  # in order, the value first at `depth`
    body, offs = _place([NOISE] * k, list(zip(depths, chain)), "\n")
    return _synthetic("variable_tracking", VT_HEAD, body, offs, VT_QUESTION.format(value=value), names,
                      VT_PREFIX.format(n=hops + 1, value=value), 30)


def _pseudo_words(rng: random.Random, n: int) -> list[str]:
    # three consonant-vowel syllables: unlimited distinct words (8K tokens needs hundreds), all six letters long,
    # so none is a substring of another
    words = {}
    while len(words) < n:
        words["".join(rng.choice("bdfgklmnprstvz") + rng.choice("aeiou") for _ in range(3))] = None
    return list(words)


def _common_words(rng, k, depth, n_tokens, n_common=10):
    # RULER's cwe: 10 words repeated 30 times among k words repeated 3 times (6 and 1 below 4K tokens, where 30
    # repeats would not leave room for the rest), shuffled, as a numbered list. No needle: depth does not apply.
    rep_common, rep_rare = (30, 3) if n_tokens >= 4096 else (6, 1)
    words = _pseudo_words(rng, n_common + k)
    items = words[:n_common] * rep_common + words[n_common:] * rep_rare
    rng.shuffle(items)
    body = " ".join(f"{i}. {w}" for i, w in enumerate(items, 1))
    return _synthetic("common_words", CWE_HEAD, body, [],
                      f"Question: What are the {n_common} most common words in the above list?", words[:n_common],
                      f"Answer: The top {n_common} words that appear most often in the list are:", 120,
                      depth=None, repeats=(rep_common, rep_rare))


def _fit(build, count_tokens, n_tokens: int, guess: int) -> int:
    """Largest filler size k whose prompt has at most n_tokens tokens: gallop from `guess` (the previous sample's k),
    then bisect. Token counts grow with k up to tokenizer noise, which costs at most a unit."""
    def fits(k):
        return count_tokens(build(k).prompt()) <= n_tokens
    step = max(1, guess // 16)
    if fits(guess):
        lo, hi = guess, guess + step
        while fits(hi):
            lo, step = hi, step * 2
            hi = lo + step
    else:
        hi, lo = guess, max(0, guess - step)
        while not fits(lo):
            if lo == 0:
                raise ValueError(f"n_tokens={n_tokens} is too small for the task's fixed text")
            hi, step = lo, step * 2
            lo = max(0, hi - step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _generator(task, make):
    def generate(count_tokens, n_tokens: int, n_samples: int, seed: int, depth: float | None = None) -> list[Sample]:
        if depth is not None and not 0 <= depth <= 1:
            raise ValueError(f"depth must be in [0, 1], got {depth}")
        samples, k = [], 64
        for i in range(n_samples):
            d = depth if depth is not None else i / (n_samples - 1) if n_samples > 1 else 0.5
            # a fresh RNG per build: every filler size k of sample i draws the same keys, values and depths
            def build(k, i=i, d=d):
                return make(random.Random(f"{task}:{seed}:{i}"), k, d, n_tokens)
            k = _fit(build, count_tokens, n_tokens, k)
            s = build(k)
            s.meta = {"depth": d, "length": n_tokens, "seed": seed, "index": i,
                      "tokens": count_tokens(s.prompt()), "n_filler": k, **s.meta}
            samples.append(s)
        return samples
    return generate


TASKS = {
    "passkey": _generator("passkey", _passkey),
    "niah_single": _generator("niah_single", _niah("niah_single", 1, 1)),
    "niah_multikey": _generator("niah_multikey", _niah("niah_multikey", 4, 1)),
    "niah_multivalue": _generator("niah_multivalue", _niah("niah_multivalue", 1, 4)),
    "variable_tracking": _generator("variable_tracking", _variable_tracking),
    "common_words": _generator("common_words", _common_words),
}


# ---------------------------------------------------------------------------------------------------------------
# LongBench (v1, English 16)

LONGBENCH_EN16 = {
    "narrativeqa": "qa_f1", "qasper": "qa_f1", "multifieldqa_en": "qa_f1",
    "hotpotqa": "qa_f1", "2wikimqa": "qa_f1", "musique": "qa_f1",
    "gov_report": "rouge_l", "qmsum": "rouge_l", "multi_news": "rouge_l",
    "trec": "classification", "triviaqa": "qa_f1", "samsum": "rouge_l",
    "passage_count": "count", "passage_retrieval_en": "retrieval",
    "lcc": "code_sim", "repobench-p": "code_sim",
}
LONGBENCH_MAXGEN = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "hotpotqa": 32, "2wikimqa": 32, "musique": 32,
    "gov_report": 512, "qmsum": 512, "multi_news": 512, "trec": 64, "triviaqa": 32, "samsum": 128,
    "passage_count": 32, "passage_retrieval_en": 32, "lcc": 64, "repobench-p": 64,
}
# few-shot and code tasks are continuations: LongBench gives them to chat models without the chat template
LONGBENCH_NO_CHAT = {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}
# few-shot tasks: the model goes on with more examples after its answer, so only the first line is scored
_FIRST_LINE = {"trec", "triviaqa", "samsum", "lsht"}

# LongBench's config/dataset2prompt.json, verbatim (the task data's format strings)
_MULTIDOC = ("Answer the question based on the given passages. Only give me the answer and do not output any other "
             "words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given "
             "passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:")
_QASPER_RULE = ("as concisely as you can, using a single phrase or sentence if possible. If the question cannot be "
                "answered based on the information in the article, write \"unanswerable\". If the question is a "
                "yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.")
LONGBENCH_PROMPTS = {
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. Answer the "
                   "question as concisely as you can, using a single phrase if possible. Do not provide any "
                   "explanation.\n\nStory: {context}\n\nNow, answer the question based on the story as concisely as "
                   "you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: "
                   "{input}\n\nAnswer:",
    "qasper": "You are given a scientific article and a question. Answer the question " + _QASPER_RULE +
              "\n\nArticle: {context}\n\n Answer the question based on the above article " + _QASPER_RULE +
              "\n\nQuestion: {input}\n\nAnswer:",
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following "
                       "question based on the above text, only give me the answer and do not output any other "
                       "words.\n\nQuestion: {input}\nAnswer:",
    "hotpotqa": _MULTIDOC, "2wikimqa": _MULTIDOC, "musique": _MULTIDOC,
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\n"
                  "Report:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. Answer the query "
             "in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above "
             "meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",
    "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}"
                  "\n\nNow, write a one-page summary of all the news.\n\nSummary:",
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n"
            "{input}",
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any other "
                "words. The following are some examples.\n\n{context}\n\n{input}",
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n"
              "{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please "
                     "carefully read these paragraphs and determine how many unique paragraphs there are after "
                     "removing duplicates. In other words, how many non-repeating paragraphs are there in total?"
                     "\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. "
                     "The output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final "
                     "answer is: ",
    "passage_retrieval_en": "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which "
                            "paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n"
                            "{input}\n\nPlease enter the number of the paragraph that the abstract is from. The "
                            "answer format must be like \"Paragraph 1\", \"Paragraph 2\", etc.\n\nThe answer is: ",
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}


def _base(task: str) -> str:
    base = task.removesuffix("_e")  # LongBench-E subsets ("hotpotqa_e") share the task's template and metric
    if base not in LONGBENCH_EN16:
        raise ValueError(f"unknown LongBench task {task!r} (English 16: {', '.join(LONGBENCH_EN16)})")
    return base


def load_longbench(task: str, source: str | Path | None = None, limit: int | None = None) -> list[Sample]:
    """LongBench rows as Samples. source: a LongBench .jsonl (or the folder of data.zip's <task>.jsonl files);
    None: the HF hub through `datasets` (RuntimeError when that is not possible, e.g. offline)."""
    base = _base(task)
    if source is None:
        try:
            import datasets
            # THUDM/LongBench is a script dataset: datasets 2.x/3.x need trust_remote_code, 4.x cannot load scripts
            kw = {"trust_remote_code": True} if int(datasets.__version__.split(".")[0]) < 4 else {}
            rows = datasets.load_dataset("THUDM/LongBench", task, split="test", **kw)
        except Exception as e:
            raise RuntimeError(f"cannot load LongBench {task!r} from the hub ({type(e).__name__}: {e}); download "
                               "data.zip from the THUDM/LongBench dataset repo and pass source=<task>.jsonl") from e
    else:
        path = Path(source)
        path = path / f"{task}.jsonl" if path.is_dir() else path
        rows = read_jsonl(path, limit)
    rows = list(rows)[:limit] if limit is not None else list(rows)
    if not rows:
        raise ValueError(f"{path if source is not None else 'the hub'} has no rows")
    for i, r in enumerate(rows):
        check_row(r, f"{path} line {r.pop('_line')}" if source is not None else f"the hub's row {i + 1}")
    return [Sample(task, r["context"], r["input"], list(r["answers"]), LONGBENCH_EN16[base],
                   {"template": LONGBENCH_PROMPTS[base], "all_classes": r.get("all_classes"),
                    "length": r.get("length"), "_id": r.get("_id"), "chat": base not in LONGBENCH_NO_CHAT,
                    "max_new_tokens": LONGBENCH_MAXGEN[base]})
            for r in rows]


MAX_JSONL_BYTES = 256 << 20  # LongBench's largest English file is under 40 MiB; /dev/zero never ends


def read_jsonl(path: Path, limit: int | None = None) -> list[dict]:
    """The first `limit` rows of a .jsonl (blank lines skipped), each with its line number as "_line"; ValueError
    naming the line for one that is not a JSON object."""
    data = read_capped(path, MAX_JSONL_BYTES)  # a named pipe nobody writes to reads as empty: "has no rows"
    if len(data) > MAX_JSONL_BYTES:
        raise ValueError(f"{path} is larger than {MAX_JSONL_BYTES >> 20} MiB: not one LongBench task's file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    return jsonl_objects(path, text, limit=limit)


def check_row(r: dict, where: str) -> None:
    """A LongBench row as load_longbench uses it: context and input strings, answers a non-empty list of strings,
    all_classes null or a list of strings (ValueError naming `where` and the field otherwise)."""
    for key in ("context", "input"):
        if not isinstance(r.get(key), str):
            raise ValueError(f"{where}: {key!r} must be a string, got {json_type(r[key]) if key in r else 'nothing'}")
    for key in ("answers", "all_classes"):
        v = r.get(key)
        if key == "all_classes" and v is None:
            continue
        if not isinstance(v, list):
            got = json_type(v) if key in r else "nothing"
        elif not v:
            got = "an empty list"
        elif odd := [x for x in v if not isinstance(x, str)]:
            got = f"a list holding {json_type(odd[0])}"
        else:
            continue
        raise ValueError(f"{where}: {key!r} must be a non-empty list of strings, got {got}")


def longbench_score(task: str, prediction: str, sample: Sample) -> float:
    """One prediction scored as LongBench's eval.py does (first line only for few-shot tasks, the task's metric,
    max over the gold answers), in [0, 1]; LongBench reports 100 x the mean over a task's samples."""
    base = _base(task)
    if base in _FIRST_LINE:
        prediction = prediction.lstrip("\n").split("\n")[0]
    if LONGBENCH_EN16[base] == "classification":
        return classification(prediction, sample.answers, sample.meta.get("all_classes"))
    return METRICS[LONGBENCH_EN16[base]](prediction, sample.answers)


def longbench_average(task_scores: dict[str, float]) -> float:
    """The English-16 average: the unweighted mean of the 16 task scores (all of them must be there)."""
    missing = [t for t in LONGBENCH_EN16 if t not in task_scores]
    if missing:
        raise ValueError(f"LongBench English-16 average needs every task; missing {missing}")
    return sum(task_scores[t] for t in LONGBENCH_EN16) / len(LONGBENCH_EN16)
