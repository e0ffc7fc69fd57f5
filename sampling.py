"""What turns a step's logits into the next token, beyond temperature / top-k / top-p: the repetition penalty, as
static-shaped tensor ops (no host sync, no shape that depends on the tokens), and stop strings, checked on the host
where the text is decoded anyway (streaming)."""
import torch


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
