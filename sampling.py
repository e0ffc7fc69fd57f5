"""What turns a step's logits into the next token: a `Sampling` value (greedy, or temperature / top-k / top-p, and
the repetition penalty), sampled as static-shaped tensor ops with no host sync (the exponential race), and stop
strings, checked on the host where the text is decoded anyway (streaming)."""
from dataclasses import dataclass

import torch

from errors import UserError, check_int, check_number

MIN_TEMPERATURE = 1e-5  # below it sampling is greedy: logits / t would overflow, and exp() of the gaps is 0 anyway
DEFAULT_LAST_N = 64  # the repetition penalty's window when repeat_last_n is not given (llama.cpp's)


@dataclass(frozen=True)
class Sampling:
    """How a step's logits become the next token. Greedy at temperature 0 (any below MIN_TEMPERATURE); otherwise
    drawn from softmax(logits / temperature) restricted to the top_k largest (0: all) and then to the smallest set
    whose mass reaches top_p (1: all). repetition_penalty (1: off) divides a positive logit (multiplies a negative
    one) of every token among its sequence's last repeat_last_n tokens (-1: the whole sequence; None: 64), as
    llama.cpp and HF generate do. Checked when made: a UserError names the parameter."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    repeat_last_n: int | None = None

    def __post_init__(self):
        check_number("temperature", self.temperature, least=0.0)
        check_int("top_k", self.top_k, least=0)
        check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise UserError(f"`top_p` must be in (0, 1], got {self.top_p!r}")
        check_number("repetition_penalty", self.repetition_penalty)
        if not 0.01 <= self.repetition_penalty <= 100:
            raise UserError(f"`repetition_penalty` must be between 0.01 and 100, got {self.repetition_penalty!r}")
        if self.repeat_last_n is not None:
            check_int("repeat_last_n", self.repeat_last_n, least=-1)
            if self.repetition_penalty == 1.0:
                raise UserError("`repeat_last_n` applies to `repetition_penalty`, which is 1 (off)")
        given = [f"`{name}`" for name, on in (("top_k", self.top_k != 0), ("top_p", self.top_p != 1.0)) if on]
        if given and self.greedy:
            raise UserError(f"{' / '.join(given)} {'apply' if len(given) > 1 else 'applies'} to sampling, and "
                            f"temperature={self.temperature:g} decodes greedily (sampling needs `temperature` >= "
                            f"{MIN_TEMPERATURE:g})")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def last_n(self) -> int:
        return DEFAULT_LAST_N if self.repeat_last_n is None else self.repeat_last_n

    def check_model(self, vocab_size: int, context: int) -> None:
        """What depends on the model: top_k within the vocabulary, a repeat_last_n given within the context (its
        default, 64, covers a shorter context whole)."""
        if self.top_k > vocab_size:
            raise UserError(f"top_k={self.top_k} exceeds the model's vocabulary ({vocab_size} tokens)")
        if self.repeat_last_n is not None and self.repeat_last_n > context:
            raise UserError(f"repeat_last_n={self.last_n} is longer than the model's context ({context}): give -1 "
                            "for the whole sequence")

    def penalty(self, batch: int, vocab: int, device) -> "RepetitionPenalty | None":
        """The repetition penalty's state for a batch (None when it is off)."""
        if self.repetition_penalty == 1.0:
            return None
        return RepetitionPenalty(self.repetition_penalty, self.last_n, batch, vocab, device)

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """What sampling draws from (not greedy): softmax(logits / temperature) over [..., V], top-k and then top-p
        applied (the tokens outside them 0). Not renormalised after top-p: divide by the sum for a distribution.
        The largest logit is subtracted first, so that no finite row overflows into inf - inf = NaN."""
        logits = (logits - logits.amax(-1, keepdim=True)) / self.temperature
        if self.top_k > 0:
            kth = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(-1)
        if self.top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            outside = sorted_probs.cumsum(-1) - sorted_probs > self.top_p  # the smallest prefix whose mass reaches p
            probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
        return probs

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> token ids [B] (the penalty not applied: see tokens)."""
        return logits.argmax(-1) if self.greedy else race(self.probabilities(logits))

    def tokens(self, logits: torch.Tensor, penalty: "RepetitionPenalty | None" = None) -> torch.Tensor:
        """The next tokens [B], or -1 where a row's logits are not all finite (the check rides on the token's own
        host sync). penalty: applied to the logits first, and told the tokens drawn."""
        if penalty is not None:
            logits = penalty(logits)
        token = torch.where(torch.isfinite(logits).all(-1), self.sample(logits), -1)
        if penalty is not None:
            penalty.push(token)
        return token


GREEDY = Sampling()


def race(weights: torch.Tensor) -> torch.Tensor:
    """One index per row of non-negative weights [..., V], drawn with probability proportional to its weight (the
    exponential race: argmax w / Exp(1), no normalisation and no host sync)."""
    return (weights / torch.empty_like(weights).exponential_(1)).argmax(-1)


class NonFiniteLogits(UserError):
    """The model's logits were NaN or inf: generation stopped."""


def check_finite(tok: int, step: int) -> None:
    """NonFiniteLogits where Sampling.tokens gave -1 (at generated token step + 1)."""
    if tok < 0:
        raise NonFiniteLogits(f"the model's logits are not finite (NaN or inf) at generated token {step + 1}: "
                              "generation stopped; check the checkpoint's weights and config.json, or run in float32")


def first_tokens(logits: torch.Tensor, sampling: Sampling = GREEDY, penalty: "RepetitionPenalty | None" = None
                 ) -> tuple[torch.Tensor, list]:
    """Each sequence's first token from its prompt's last logits [B, vocab]: (the tokens [B], [[id], ...])."""
    token = sampling.tokens(logits, penalty)
    outs = [[tok] for tok in token.tolist()]  # the first tokens are needed on the host anyway (streaming, EOS)
    for out in outs:
        check_finite(out[0], 0)
    return token, outs


class RepetitionPenalty:
    """llama.cpp's and HF generate's repetition penalty: a token among the last `last_n` tokens of its sequence
    (the prompt's included; last_n = -1: the whole sequence, as HF) gets its logit divided by `penalty` when positive,
    multiplied when negative, once however often it occurred. penalty 1: nothing. The window is a ring of token ids
    per sequence [B, last_n] (-1: empty), or a mask over the vocabulary [B, V] for the whole sequence."""

    def __init__(self, penalty: float, last_n: int, batch: int, vocab: int, device):
        self.penalty, self.last_n, self.vocab = penalty, last_n, vocab
        if last_n < 0:
            self.seen = torch.zeros(batch, vocab, dtype=torch.bool, device=device)
        else:
            self.ring = torch.full((batch, max(last_n, 1)), -1, dtype=torch.long, device=device)
            self.next = torch.zeros(batch, 1, dtype=torch.long, device=device)  # each row's next ring slot

    def start(self, prompts: list[list[int]]) -> None:
        """Each sequence's prompt: its last `last_n` tokens (all of them for -1) count from the first token on."""
        for b, ids in enumerate(prompts):
            if self.last_n < 0:
                self.seen[b].zero_()
                self.seen[b, torch.tensor(ids, dtype=torch.long, device=self.seen.device)] = True
            elif self.last_n > 0:
                tail = ids[len(ids) - min(len(ids), self.last_n):]
                self.ring[b].fill_(-1)
                self.ring[b, :len(tail)] = torch.tensor(tail, dtype=torch.long, device=self.ring.device)
                self.next[b] = len(tail) % self.last_n

    def push(self, tokens: torch.Tensor) -> None:
        """The tokens [B] just sampled join their sequences' windows."""
        if self.last_n < 0:
            self.seen.scatter_(1, tokens.clamp_min(0).view(-1, 1), True)
        elif self.last_n > 0:
            self.ring.scatter_(1, self.next, tokens.view(-1, 1))
            self.next = (self.next + 1) % self.last_n

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] with the penalty applied to every token in its row's window."""
        if self.penalty == 1.0 or self.last_n == 0:
            return logits
        if self.last_n < 0:
            seen = self.seen
        else:  # column V catches the empty slots (-1), then is dropped
            seen = torch.zeros(logits.shape[0], self.vocab + 1, dtype=torch.bool, device=logits.device)
            seen = seen.scatter_(1, self.ring.where(self.ring >= 0, self.vocab), True)[:, :self.vocab]
        penalized = torch.where(logits > 0, logits / self.penalty, logits * self.penalty)
        return torch.where(seen, penalized, logits)


def stop_reason(ids: list[int], limit: int, eos_ids=(), at_stop: bool = False, context: bool = False) -> str:
    """Why a sequence's generation ended, by decode's rules in their order: "eos" (its last token ends a sequence),
    "stop_string" (at_stop: its text reached a stop string), "max_new_tokens" at its length limit, or "context"
    where that limit is the model's context (the default max_new_tokens clamped to it, or a turn's room); otherwise
    "interrupted" (stop(), Ctrl-C, an exception)."""
    if ids and ids[-1] in eos_ids:
        return "eos"
    if at_stop:
        return "stop_string"
    if len(ids) >= limit:
        return "context" if context else "max_new_tokens"
    return "interrupted"


class StopStrings:
    """Stop strings (`--stop`): a sequence ends at the first occurrence of any of them in its generated text, which
    is cut there (the stop string not shown, as llama.cpp does). `hold(text)`: how much of a streamed text may be
    shown now: not a tail that could still become a stop string."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]

    def cut(self, text: str) -> int | None:
        """Where `text` ends at its first stop string (None: no stop string in it)."""
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def shown(self, text: str) -> str:
        """The part of a partial text that is safe to print: up to a stop string, or else all but a tail that is
        the beginning of one."""
        at = self.cut(text)
        if at is not None:
            return text[:at]
        keep = len(text)
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    keep = min(keep, len(text) - n)
                    break
        return text[:keep]
