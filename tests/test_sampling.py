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


def test_sample_below_min_temperature_is_greedy():
    """A temperature too small to divide by (sampling.MIN_TEMPERATURE) samples greedily; above it, the largest logit
    is subtracted first, so that even huge logits never overflow into NaN."""
    from sampling import MIN_TEMPERATURE, Sampling
    logits = torch.tensor([[1.0, 3e38, -3e38, 2.0], [0.5, 0.25, 0.75, 0.0]])
    for t in (0.0, 5e-324, 1e-45, MIN_TEMPERATURE / 2):
        assert Sampling(t).sample(logits).tolist() == [1, 2]
    for t, top_k, top_p in ((MIN_TEMPERATURE, 0, 1.0), (1e-3, 2, 0.9), (1.0, 0, 1.0)):
        tok = Sampling(t, top_k, top_p).sample(logits)
        assert tok[0] == 1 and 0 <= tok[1] < 4  # the 3e38 gap leaves no mass elsewhere


@pytest.mark.parametrize("kw, message", [
    (dict(temperature=float("nan")), "`temperature` must be a finite number >= 0, got nan"),
    (dict(temperature="0.7"), "`temperature` must be a finite number >= 0, got '0.7'"),
    (dict(temperature=-1.0), "`temperature` must be a finite number >= 0, got -1.0"),
    (dict(temperature=1.0, top_k=True), "`top_k` must be an integer, got True"),
    (dict(temperature=1.0, top_k=2.5), "`top_k` must be an integer, got 2.5"),
    (dict(temperature=1.0, top_k=-1), "`top_k` must be >= 0, got -1"),
    (dict(temperature=1.0, top_p=0.0), "`top_p` must be in (0, 1], got 0.0"),
    (dict(temperature=1.0, top_p=float("inf")), "`top_p` must be a finite number, got inf"),
    (dict(top_k=5), "`top_k` applies to sampling, and temperature=0 decodes greedily"),
    (dict(temperature=1e-9, top_k=5, top_p=0.9), "`top_k` / `top_p` apply to sampling"),
    (dict(repeat_last_n=8), "`repeat_last_n` applies to `repetition_penalty`, which is 1 (off)"),
    (dict(repetition_penalty=0.0), "`repetition_penalty` must be between 0.01 and 100, got 0.0"),
    (dict(repetition_penalty=1.1, repeat_last_n=-2), "`repeat_last_n` must be >= -1, got -2"),
    (dict(repetition_penalty=1.1, repeat_last_n=4.0), "`repeat_last_n` must be an integer, got 4.0"),
])
def test_a_sampling_is_checked_when_made(kw, message):
    """Every setting the command line refuses is refused by the value itself, naming the parameter (the command
    line shows it as its flag): the Python API and generate.py check through one place."""
    from errors import UserError
    from sampling import Sampling
    with pytest.raises(UserError) as e:
        Sampling(**kw)
    assert message in str(e.value)


def test_a_sampling_is_checked_against_the_model():
    from errors import UserError
    from sampling import Sampling
    with pytest.raises(UserError, match=r"top_k=600 exceeds the model's vocabulary \(512 tokens\)"):
        Sampling(1.0, 600).check_model(512, 2048)
    with pytest.raises(UserError, match="repeat_last_n=4096 is longer than the model's context"):
        Sampling(repetition_penalty=1.1, repeat_last_n=4096).check_model(512, 2048)
    Sampling(1.0, 512, repetition_penalty=1.1, repeat_last_n=-1).check_model(512, 2048)  # the bounds themselves
