"""sampling.py against independent references: HF transformers' RepetitionPenaltyLogitsProcessor (the whole
sequence), a plain Python window of the last n tokens (llama.cpp's rule), hand-computed stop-string cuts."""
import pytest
import torch

from sampling import RepetitionPenalty, StopStrings


def windowed_reference(logits, history, penalty, last_n):
    """Each row: the tokens among its last `last_n` ids, each penalised once."""
    out = logits.clone()
    for b, ids in enumerate(history):
        for t in set(ids[-last_n:] if last_n > 0 else ids):
            out[b, t] = out[b, t] / penalty if out[b, t] > 0 else out[b, t] * penalty
    return out


@pytest.mark.parametrize("last_n", [-1, 1, 4, 64])
def test_penalty_follows_each_sequence_over_steps(last_n):
    gen = torch.Generator().manual_seed(0)
    V, penalty = 50, 1.3
    prompts = [[3, 7, 7, 9, 11, 3], [0, 49, 2]]
    history = [list(p) for p in prompts]
    rp = RepetitionPenalty(penalty, last_n, batch=2, vocab=V, device="cpu")
    rp.start(prompts)
    for _ in range(12):
        logits = torch.randn(2, V, generator=gen) * 3
        assert torch.equal(rp(logits), windowed_reference(logits, history, penalty, last_n))
        tokens = torch.randint(0, V, (2,), generator=gen)
        rp.push(tokens)
        for b in range(2):
            history[b].append(int(tokens[b]))


def test_whole_sequence_penalty_is_hf_generates():
    transformers = pytest.importorskip("transformers")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 40, (3, 20), generator=gen)
    logits = torch.randn(3, 40, generator=gen) * 4
    rp = RepetitionPenalty(1.5, -1, batch=3, vocab=40, device="cpu")
    rp.start([row.tolist() for row in ids])
    expected = transformers.RepetitionPenaltyLogitsProcessor(1.5)(ids, logits.clone())
    assert torch.equal(rp(logits), expected)


def test_no_penalty_and_empty_window_change_nothing():
    logits = torch.randn(1, 10)
    for penalty, last_n in ((1.0, 64), (1.5, 0)):
        rp = RepetitionPenalty(penalty, last_n, batch=1, vocab=10, device="cpu")
        rp.start([[1, 2, 3]])
        assert torch.equal(rp(logits), logits)


def test_stop_strings_cut_and_hold_back():
    stops = StopStrings(["\n\nQuestion:", "###", ""])
    assert stops.cut("The answer is 4.\n\nQuestion: next") == len("The answer is 4.")
    assert stops.cut("no stop here") is None
    assert stops.cut("a ### b \n\nQuestion:") == 2  # the first occurrence of any
    assert stops.shown("The answer is 4.\n\nQues") == "The answer is 4."  # could still become a stop string
    assert stops.shown("The answer is 4.\n") == "The answer is 4."
    assert stops.shown("one #") == "one " and stops.shown("one # two") == "one # two"
    assert stops.shown("done ### more") == "done "
