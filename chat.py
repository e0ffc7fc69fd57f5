"""A conversation whose fixed-budget KV cache persists across turns (`Chat`), and generate.py --interactive's REPL.

    chat = Chat(model, tokenizer, "keydiff", budget=512)
    print(chat.send("What is the capital of France?"))
    print(chat.send("And of Italy?", on_text=lambda s: print(s, end="", flush=True)))

The rules, turn by turn:

- Positions never restart within a conversation: turn n is prefilled at the positions after everything turn n - 1
  wrote, on top of what the caches kept. The last sampled token of an answer is not written during its turn (no step
  ran on it): it is fed first in the next turn, unless it is an end-of-sequence token and the chat template closes
  the assistant's turn itself (the template's end-of-turn text follows the answer instead).
- The chat template is applied turn by turn: turn 1 is the template's prompt for one user message; turn n > 1 is
  what the template writes after the previous answer (its end of turn, the new user message, the generation
  prompt), found by rendering [previous user, assistant, new user] with a marker as the assistant's text. Earlier
  turns are never rendered again: the cache holds each turn as it was sent. Without a template (or
  chat_template=False) a turn is its raw text, BOS before the first one only.
- Block-wise policies (the default --prefill block, full and exact-topk included) just continue: the new turn goes
  in blocks, and a scorer evicts back to the budget after every block and every generated token, as in one run.
  One-shot compression that then evicts during decode (SAGE-KV; any `--prefill one-shot` of a block-wise scorer)
  compresses turn 1 once and continues every later turn block-wise with that evicting rule.
  One-shot compression that appends during decode (SnapKV++, RocketKV, K-VEC) re-compresses: each later turn is
  prefilled densely layer by layer on top of the kept history (the history's slots, then the turn's, in one
  scratch per layer), and history plus turn are compressed again to the `budget - max_new_tokens` prompt slots
  the policy keeps, with the new turn's last queries as the observation window (`recompress`).
- A turn that would not fit is refused before anything is written (`TurnRefused`, one line): past the model's
  context (max_position_embeddings) for every policy (positions keep growing even where the cache holds only the
  budget: RoPE beyond the trained range is not trusted), and for `full` / exact-topk when the conversation would
  outgrow their slots (raise the budget or reset). An answer stops early where the context ends.
- `stop()` (Ctrl-C in the REPL, or in a script or notebook calling `send`) ends the current answer: the tokens shown
  so far stay in the history, and a token whose step was running when stop() came is dropped (neither shown nor
  kept). The prefill of a turn always completes. An exception during a turn (from `on_text`, non-finite logits,
  inside a step) keeps the history consistent in the same way: the prompt and the tokens decoded so far stay, and a
  step cut short leaves nothing (its slots are emptied: no position is ever held twice). Outside the REPL, Ctrl-C
  raises KeyboardInterrupt once the turn is recorded.
- `reset()` forgets the conversation: the caches are emptied (set up again, planned for the next first turn) and
  positions restart at 0.

Memory stays flat: the caches are allocated once per conversation (budget + block slots per layer and KV head); a
turn allocates only its token ids, its prefill's activations and, re-compressing, one layer's history + turn
scratch. The transcript's token ids (4 bytes each) are the one thing that grows.
"""
import json
import signal
import sys
import threading
import time
from array import array
from contextlib import contextmanager

import torch

from cache import compress_into, eager_blocks, is_scorer, scratch_cache
import engine
import policies
import runtime
from engine import Generation, PeakMemory, block_inputs, prefill_one_shot, sync
from runtime import prefill_step
from errors import UserError
from model import Transformer
from sampling import GREEDY, Sampling, first_tokens, stop_reason
from tokenizer import Tokenizer

MAX_TURN_BYTES = 64 << 20  # one line of stdin, capped as a prompt file is (generate_args.MAX_PROMPT_BYTES)
MARKER = "<<budgetkv:assistant-answer>>"  # stands for the previous answer when the template renders a new turn
COMMANDS = {"/reset": "forget the conversation (positions restart at 0)", "/stats": "the conversation's summary",
            "/exit": "leave (EOF too)", "/help": "this list"}


RUNNING: set[int] = set()  # id() of each model a turn is running on: its caches are in use until the turn ends
RUNNING_LOCK = threading.Lock()


def check_idle(model) -> None:
    """UserError while a turn runs on `model` (a send(), reset(), compile() or new Chat from on_text or another
    thread would write the caches under that turn's steps)."""
    if id(model) in RUNNING:
        raise UserError("a turn is running on this model: send(), reset(), compile() and a new Chat wait for it to "
                        "end (one turn at a time per model, not from on_text or another thread)")


@contextmanager
def one_turn(model):
    """The block is the model's one running turn (check_idle refuses anything else on it until the block ends)."""
    with RUNNING_LOCK:
        check_idle(model)
        RUNNING.add(id(model))
    try:
        yield
    finally:
        RUNNING.discard(id(model))


class TurnRefused(UserError):
    """A turn that does not fit (the model's context, a cache that keeps every token): nothing was written, the
    conversation goes on (a REPL prints the line and reads the next turn)."""


class Chat:
    """One conversation with a model whose KV cache persists across turns (the rules are in the module docstring).

    policy: a policy object, a spec string ("keydiff", "snapkv:window=16") or None / "full"; budget: KV slots per
    layer and KV head (default 2048, or the model's context if smaller) for every policy, full included (there it
    bounds the whole conversation); prefill: "block" or "one-shot" (None: the policy's default); sampling: a
    sampling.Sampling (greedy by default; no repetition penalty). The caches and the steps are those of one
    engine.Generation (`run`), checked as generate.py's are (sizes against the model's context, the caches against
    the device's free memory) before anything is allocated."""

    def __init__(self, model, tokenizer, policy=None, budget: int | None = None, *, max_new_tokens: int | None = None,
                 block_size: int | None = None, prefill: str | None = None, sampling: Sampling = GREEDY,
                 kv_dtype: torch.dtype | None = None, chat_template: bool = True, evict_before_attend: bool = False):
        if not isinstance(model, Transformer):
            raise UserError(f"model={model!r:.60} is not a budgetkv model (loading.load_model makes one)")
        if not isinstance(tokenizer, Tokenizer):
            raise UserError(f"tokenizer={tokenizer!r:.60} is not a budgetkv tokenizer (tokenizer.load_tokenizer makes "
                            "one)")
        policy = policies.resolve(policy)
        check_idle(model)
        if isinstance(sampling, Sampling) and sampling.repetition_penalty != 1.0:
            raise UserError("`repetition_penalty` applies to a plain generation, not to a conversation")
        self.model, self.tokenizer, self.policy = model, tokenizer, policy
        self.device = str(model.tok_embeddings.weight.device)
        self.run = Generation(model.args, policy, None, budget=budget, max_new_tokens=max_new_tokens,
                              block_size=block_size, prefill=prefill, evict_before_attend=evict_before_attend,
                              kv_dtype=kv_dtype, sampling=sampling, device=self.device)
        self.budget, self.block_size, self.protocol = self.run.budget, self.run.block_size, self.run.protocol
        self.max_new_tokens, self.sampling = self.run.max_new_tokens, sampling
        self.name = policy.name if policy is not None else "full"
        self.template = chat_template and tokenizer.chat_template is not None
        self.eos_ids = set(tokenizer.eos_ids)
        self.slots = None  # the slots per layer and KV head (SAGE-KV: its layout's), set by plan()
        self.last = {}  # the last turn's stats
        self._stop = False
        self.plan(self.budget if is_scorer(policy) else 1)  # what cannot work fails now, not at the first turn
        self.reset()

    @property
    def steps(self):
        """The (prefill block, decode) steps: the run's (compiled by compile())."""
        return self.run.steps

    @steps.setter
    def steps(self, steps) -> None:
        self.run.steps = steps

    def plan(self, prompt_len: int) -> None:
        """Set every layer's cache up for a conversation whose first turn has prompt_len tokens (the policy planned
        against it: SAGE-KV's layout, SnapKV++'s kernel); UserError / PolicyError where the budget cannot work."""
        self.slots = self.run.setup(self.model, [prompt_len])
        self.caches = self.model_caches()

    def model_caches(self) -> list:
        return [getattr(layer.attention, "kv_cache", None) for layer in self.model.layers]

    def owns_caches(self) -> bool:
        """Whether the model still holds this conversation's caches (another Chat, or a Generation set up on the
        same model, replaces them: one conversation per model at a time)."""
        return all(a is b for a, b in zip(self.caches, self.model_caches(), strict=True))

    # ------------------------------------------------------------------------------------------- the conversation

    def reset(self) -> None:
        """Forget the conversation: empty caches (planned again at the next turn), positions restart at 0."""
        check_idle(self.model)
        self.tokens = array("i")  # the token at each position written so far, in position order
        self.pending: list[int] = []  # the last answer's last token: sampled, not yet written
        self.last_user: str | None = None
        self.turns, self.generated, self.decode_s, self.prefill_tokens, self.prefill_s = 0, 0, 0.0, 0, 0.0
        self.peak_bytes, self.memory_measure = 0, PeakMemory(self.device).measure
        self.prompt_end = 0  # positions [0, prompt_end) were the history plus the last turn's prompt
        self.answer_ids: list[int] = []
        self.fresh = True
        for cache in self.caches if self.owns_caches() else []:  # never another conversation's caches
            if cache is not None:
                cache.reset()

    def stop(self) -> None:
        """End the answer being generated after its current token (safe from a signal handler or a callback)."""
        self._stop = True

    @property
    def position(self) -> int:
        """The next position to write; the pending token (if any) takes it."""
        return len(self.tokens)

    def send(self, text: str, on_text=None) -> str:
        """One user turn: its tokens prefilled on top of the kept history, then the answer (greedy or sampled) until
        an end-of-sequence token, max_new_tokens, the model's context or stop(). on_text(piece): each new piece of
        the answer's text as it is generated. Returns the answer's text; raises TurnRefused (nothing written) when
        the turn does not fit. An exception raised during the turn (by on_text, by non-finite logits, inside a step)
        leaves the conversation consistent: the prompt and the answer's tokens decoded so far are kept, as after
        stop(), and nothing of a step cut short. Ctrl-C (SIGINT to the main thread, under Python's default handler)
        ends the answer as stop() does, then raises KeyboardInterrupt."""
        if not isinstance(text, str):
            raise UserError(f"text={text!r} is not a text (str)")
        if on_text is not None and not callable(on_text):
            raise UserError(f"on_text={on_text!r} is not callable")
        with one_turn(self.model):
            return self.turn(text, on_text)

    def turn(self, text: str, on_text) -> str:
        """send()'s turn, the model's one running turn."""
        if not self.fresh and not self.owns_caches():
            raise UserError("this conversation's KV caches were replaced: another Chat or engine run set up caches on "
                            "the same model since its last turn (one conversation per model at a time; reset() starts "
                            "this one again)")
        ids = self.turn_ids(text)
        if not ids:
            raise TurnRefused("the turn is empty once tokenized")
        vocab = self.model.args.vocab_size
        if max(ids) >= vocab:
            raise TurnRefused(f"the tokenizer gives token id {max(ids)}, outside the model's vocab_size {vocab}")
        n_new = self.room(len(ids))
        if self.fresh:
            self.plan(len(ids))
        self._stop = False
        mem = PeakMemory(self.device)
        mem.reset()
        sync(self.device)
        out, fed, t0 = [], [0], time.perf_counter()  # fed: the answer's tokens whose decode step completed
        with interrupt_stops(self) as interrupted:
            try:
                with torch.inference_mode():
                    logits = self.prefill(torch.tensor(ids, dtype=torch.long, device=self.device))
            except BaseException:
                self.forget_from(self.position)  # a prefill cut short: none of the turn stays
                raise
            self.fresh, self.last_user = False, text
            self.tokens.extend(ids)
            self.prompt_end, self.pending = len(self.tokens), []
            t1 = time.perf_counter()
            try:
                with torch.inference_mode():
                    self.answer(logits, n_new, on_text, out, fed)
            finally:
                sync(self.device)
                self.commit(out, fed[0], len(ids), t1 - t0, time.perf_counter() - t1, mem, n_new)
        if interrupted:
            raise KeyboardInterrupt
        return self.decode(out)

    def commit(self, out: list[int], fed: int, n_prompt: int, prefill_s: float, decode_s: float, mem,
               n_new: int) -> None:
        """Record an answer of at most n_new tokens: out[:fed] were written by decode steps that completed, out[fed]
        (if any) is pending. Slots at the positions from the first unwritten one on are emptied: a step cut short by
        an exception may have written its token in some layers only, and a position is never held twice."""
        self.forget_from(self.prompt_end + fed)
        self.answer_ids = out
        self.tokens.extend(out[:fed])
        self.pending = out[fed:fed + 1]
        self.turns += 1
        self.generated += len(out)
        self.prefill_tokens += n_prompt
        self.prefill_s += prefill_s
        self.decode_s += decode_s
        peak = mem.peak()
        self.peak_bytes = max(self.peak_bytes, peak)
        self.memory_measure = mem.measure
        reason = "interrupted" if self._stop else stop_reason(out, n_new, self.eos_ids,
                                                                      context=n_new < self.max_new_tokens or
                                                                      "max_new_tokens" in self.run.clamped)
        self.last = dict(turn=self.turns, prompt_tokens=n_prompt, generated_tokens=len(out), stop_reason=reason,
                         ttft_s=prefill_s, decode_tok_s=(len(out) - 1) / decode_s if len(out) > 1 else 0.0,
                         peak_bytes=peak, **self.held_summary())

    def forget_from(self, position: int) -> None:
        """Forget every token at a position >= `position` in every layer's cache."""
        for layer in self.model.layers:
            layer.attention.kv_cache.forget_from(position)

    def turn_ids(self, text: str) -> list[int]:
        """The token ids turn `text` feeds: the pending token (unless the template closes an answer that ended with
        an end-of-sequence token), then the template's text for the turn (see the module docstring)."""
        tok = self.tokenizer
        if not self.template:
            return self.pending + tok.encode(text, add_bos=self.position == 0 and not self.pending)
        if self.last_user is None:
            return self.pending + tok.chat_prompt_ids(text)
        marker, n = MARKER, 0
        while marker in self.last_user or marker in text:  # a user may type the marker: pick one neither holds
            n += 1
            marker = f"{MARKER[:-2]}-{n}>>"
        rendered = tok.render_messages([{"role": "user", "content": self.last_user},
                                        {"role": "assistant", "content": marker}, {"role": "user", "content": text}])
        if rendered.count(marker) != 1:
            raise UserError(f"the chat template in {tok.chat_template_file} does not write an assistant's message "
                            "as it is, so turns cannot be added one by one (--no-chat skips the template)")
        after = tok.template_ids(rendered.split(marker)[1])
        pending = [t for t in self.pending if t not in self.eos_ids]  # the template writes the end of the turn
        return pending + after

    def room(self, n_prompt: int) -> int:
        """The answer tokens this turn may generate (max_new_tokens, fewer where the model's context ends first);
        TurnRefused when not one fits, or when a cache that keeps every token (full, exact-topk) would need more
        slots than it has (positions are slots there)."""
        start, ctx = self.position, self.model.args.max_seq_len
        if n_prompt >= ctx:  # no conversation would hold it: a /reset does not help
            raise TurnRefused(f"this turn's {n_prompt} tokens leave no room for an answer in the model's context of "
                              f"{ctx} tokens: shorten it")
        if start + n_prompt >= ctx:
            raise TurnRefused(f"the conversation has used {start} of the model's {ctx} positions and this turn's "
                              f"{n_prompt} tokens leave no room for an answer: /reset starts a new conversation")
        n_new = min(self.max_new_tokens, ctx - start - n_prompt)
        if not is_scorer(self.policy) and start + n_prompt + n_new > self.budget:
            raise TurnRefused(f"{self.name} keeps every token: {start} held + this turn's {n_prompt} + up to {n_new} "
                              f"new exceed its {self.budget} slots (raise the budget, --budget, or /reset)")
        return n_new

    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        """The turn's tokens [L] into the caches at positions position, position + 1, ...; the last one's logits."""
        if self.fresh and self.protocol == "one-shot":
            return prefill_one_shot(self.model, prompt, self.block_size)
        if self.model.layers[0].attention.kv_cache.spec.mode == "append":
            return recompress(self.model, prompt, self.position, self.block_size)
        return prefill_at(self.model, prompt, self.position, self.block_size, self.steps[0])

    def answer(self, logits: torch.Tensor, n_new: int, on_text, out: list[int], fed: list[int]) -> None:
        """Sample the answer into `out` from the prompt's last logits, feeding each token at the next position
        (engine.decode), until EOS, n_new tokens or stop(); fed[0] counts the decode steps that completed (the last
        token is not written). A token sampled after stop() was asked for (Ctrl-C during its step) is dropped:
        neither shown nor kept."""
        token, outs = first_tokens(logits, self.sampling)
        if self._stop:
            return
        out.extend(outs[0])
        shown = [""]
        self.stream(out, shown, on_text)

        def step(model, idx, input_pos):
            logits = self.steps[1](model, idx, input_pos)
            fed[0] += 1
            return logits

        def on_token(b, ids):
            if self._stop:
                ids.pop()
            else:
                self.stream(ids, shown, on_text)
        engine.decode(self.model, step, token, [out], [self.position], n_new, eos_ids=self.eos_ids,
                      on_token=on_token, stop=lambda: self._stop, sampling=self.sampling)
        if on_text is not None and self.decode(out) != shown[0]:
            on_text(self.decode(out)[len(shown[0]):])

    def stream(self, out: list[int], shown: list[str], on_text) -> None:
        """Hand on_text the answer's new complete characters (none while the text ends in a partial character)."""
        if on_text is None:
            return
        s = self.decode(out)
        if s.endswith("\ufffd") or len(s) <= len(shown[0]) or not s.startswith(shown[0]):
            return
        on_text(s[len(shown[0]):])
        shown[0] = s

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def compile(self, mode: str | None = None, prefill: bool | None = None, freeze: bool = False,
                around=None) -> None:
        """Compile both steps through the run (Generation.compile: mode, prefill, freeze as generate.py's
        --compile-mode, --compile-prefill, --freeze; around(run) wraps the warm-up) and warm them up on a one-token
        prompt before the first turn (not for a one-shot scorer, whose plan waits for the first turn's length), then
        start an empty conversation (taking the model's caches back from another Chat or run, as a turn after reset()
        does: the warm-up writes the caches it runs on)."""
        check_idle(self.model)
        if not self.owns_caches():
            self.plan(self.budget if is_scorer(self.policy) else 1)
        self.run.compile(self.model, 0, mode, prefill, freeze, around=around,
                         warm=not (self.protocol == "one-shot" and is_scorer(self.policy)))
        self.reset()

    # ------------------------------------------------------------------------------------------------ the numbers

    def held(self) -> torch.Tensor:
        """Tokens every layer's cache holds now: [layers, batch, KV heads] (engine.held)."""
        return engine.held(self.model)

    def held_summary(self) -> dict:
        return dict(tokens_held=int(self.held().max()), slots=self.slots,
                    positions_used=self.position + len(self.pending), context=self.model.args.max_seq_len)

    def stats(self) -> dict:
        """The conversation so far: turns, tokens held (the most any layer and KV head holds), positions used, the
        peak memory of its turns (each turn's, the largest) and the decode and prefill rates."""
        decoded = self.generated - self.turns  # every turn's first token comes from its prefill
        return dict(policy=self.name, prefill=self.protocol, turns=self.turns, generated_tokens=self.generated,
                    prompt_tokens=self.prefill_tokens, **self.held_summary(), peak_bytes=self.peak_bytes,
                    memory_measure=self.memory_measure,
                    decode_tok_s=decoded / self.decode_s if decoded and self.decode_s else 0.0,
                    prefill_tok_s=self.prefill_tokens / self.prefill_s if self.prefill_s else 0.0)


def shifted(input_pos: torch.Tensor, start: int) -> torch.Tensor:
    """Block positions [T] moved to start at `start` (padding stays -1)."""
    return torch.where(input_pos >= 0, input_pos + start, input_pos)


def prefill_at(model, prompt: torch.Tensor, start: int, block_size: int, step=prefill_step) -> torch.Tensor:
    """Block-wise prefill of prompt [L] at positions start, start + 1, ... on top of what the caches hold (a scorer
    evicts back to its budget after every block, as in one run); returns the last position's logits [1, vocab]."""
    with eager_blocks(model, start, start + prompt.numel(), step is prefill_step):
        for s in range(0, prompt.numel(), block_size):
            runtime.THREADS.tick()
            idx, pos = block_inputs(prompt, s, block_size)
            logits = step(model, idx, shifted(pos, start))
    return logits


def recompress(model, prompt: torch.Tensor, start: int, block_size: int, shared: dict | None = None) -> torch.Tensor:
    """A new turn [L] at positions start, ... for caches that append after a one-shot compression (SnapKV++,
    RocketKV, K-VEC): per layer, one scratch holds the kept history (its n valid slots, which fill [0, n) in
    position order) and then the turn, appended after it; model.prefill_layer_major runs the turn densely
    over it, and the scratch is compressed into the emptied layer cache as a one-shot prompt is: the policy's
    `keep` best of history + turn, scored with the turn's last queries. Peak: one layer's history + turn scratch on
    top of the budgets. Returns the last position's logits [1, vocab]."""
    n_blocks = -(-prompt.numel() // block_size)
    idx, input_pos = block_inputs(prompt, 0, n_blocks * block_size)
    shared = {} if shared is None else shared

    def scratch(i):
        c = model.layers[i].attention.kv_cache
        n = int(c.n_valid().max())
        s = scratch_cache(c, n + n_blocks * block_size, n + prompt.numel())
        for dst, src in zip([s.pos, *s.slot_buffers()], [c.pos, *c.slot_buffers()], strict=True):
            dst[:, :, :n] = src[:, :, :n]
        s.fill_eagerly(n, n + prompt.numel(), one_mask=bool((s.pos[:, :, :n] == s.pos[:, :1, :n]).all()))
        return s

    def done(i, s):
        c = model.layers[i].attention.kv_cache
        c.reset()  # rebuilt from the scratch: no stale slot past what the compression keeps
        compress_into(s, c, shared)
    return model.prefill_layer_major(idx, shifted(input_pos, start), block_size, scratch, done)


# ---------------------------------------------------------------------------------------------------- the REPL

@contextmanager
def ctrl_c_stops(chat: Chat):
    """While the block runs, Ctrl-C (SIGINT) calls chat.stop() instead of raising KeyboardInterrupt: the answer
    ends, the program goes on. Signal handlers exist in the main thread only; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, lambda *_: chat.stop())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


@contextmanager
def interrupt_stops(chat: Chat):
    """While a turn runs in the main thread under Python's default SIGINT handler (a script, a notebook), Ctrl-C
    calls chat.stop() instead of raising inside a step; yields a list that is non-empty once it did (the caller
    raises KeyboardInterrupt after the turn is recorded). Under another handler (ctrl_c_stops) nothing changes."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield []
        return
    hit = []

    def handler(*_):
        hit.append(True)
        chat.stop()
    old = signal.signal(signal.SIGINT, handler)
    try:
        yield hit
    finally:
        signal.signal(signal.SIGINT, old)


def stats_line(st: dict) -> str:
    mib = 2 ** 20
    return (f"--- {st['turns']} turn{'' if st['turns'] == 1 else 's'} | {st['policy']} ({st['prefill']} prefill): {st['tokens_held']} tokens held of "
            f"{st['slots']} slots per layer and KV head | positions used {st['positions_used']} of "
            f"{st['context']} | peak memory {st['peak_bytes'] / mib:.1f} MiB ({st['memory_measure']}, the largest "
            f"turn's) | decode {st['decode_tok_s']:.1f} tok/s, prefill {st['prefill_tok_s']:.1f} tok/s")


def read_turn(stdin, prompt: str) -> str | None:
    """One line of input (None at EOF); the prompt is shown on a terminal only. A line that is not UTF-8 raises
    TurnRefused (the REPL goes on to the next line); one over MAX_TURN_BYTES, read no further, UserError."""
    if prompt and stdin is sys.stdin:
        try:
            line = input(prompt)
        except EOFError:
            return None
        except UnicodeDecodeError as e:
            raise TurnRefused(f"the turn is not valid UTF-8 text ({e.reason} at byte {e.start}): skipped") from None
    else:
        raw = getattr(stdin, "buffer", stdin)  # bytes where there are (a pipe, a file), else the text stream's own
        line = raw.readline(MAX_TURN_BYTES + 1)
        if len(line) > MAX_TURN_BYTES:  # the rest of the line may never end (/dev/zero): the chat ends here
            raise UserError(f"a turn on stdin is longer than {MAX_TURN_BYTES >> 20} MiB (as a prompt file may be)")
        if line in ("", b""):
            return None
        line = line.decode("utf-8", "surrogateescape") if isinstance(line, bytes) else line
        line = line.removesuffix("\n")
    try:  # a terminal in a C locale passes bytes that are not UTF-8 as lone surrogates
        line.encode("utf-8")
    except UnicodeEncodeError as e:
        raise TurnRefused(f"the turn is not valid UTF-8 text (at character {e.start + 1}): skipped") from None
    return line


def repl(chat: Chat, *, json_mode: bool = False, stdin=None, out=None, err=None) -> int:
    """Read turns line by line, stream each answer (json_mode: one JSON object per turn, no streaming); commands
    /reset, /stats, /help, /exit (or EOF). A refused turn prints one line and the loop goes on; Ctrl-C during an
    answer ends that answer; Ctrl-C at the prompt discards the line. Returns the exit code (0)."""
    stdin, out, err = stdin or sys.stdin, out or sys.stdout, err or sys.stderr
    prompt = "> " if not json_mode and stdin.isatty() else ""
    if prompt:
        print(f"chat: {chat.name} ({chat.protocol} prefill), budget {chat.budget} slots per layer and KV head; "
              "/help lists the commands, /exit or Ctrl-D leaves", file=err)
    while True:
        try:
            line = read_turn(stdin, prompt)
        except KeyboardInterrupt:
            print(file=out)
            continue
        except TurnRefused as e:
            print(f"error: {e}", file=err, flush=True)
            continue
        if line is None:
            break
        text = line.strip()
        if not text:
            continue
        if text.split()[0] in COMMANDS and text != text.split()[0]:  # "/reset now": a command, not a prompt
            print(f"error: {text.split()[0]} takes no argument", file=err)
            continue
        if text.startswith("/") and " " not in text:
            if text == "/exit":
                break
            if text == "/reset":
                chat.reset()
                print("(conversation reset: positions restart at 0)", file=err)
            elif text == "/stats":
                st = chat.stats()
                print(json.dumps({"stats": st}) if json_mode else stats_line(st), file=out, flush=True)
            elif text == "/help":
                print("\n".join(f"{c:8} {h}" for c, h in COMMANDS.items()), file=err)
            else:
                print(f"error: unknown command {text} ({', '.join(COMMANDS)})", file=err)
            continue
        def show(piece):
            out.write(piece)
            out.flush()
        try:
            with ctrl_c_stops(chat):
                answer = chat.send(text, on_text=None if json_mode else show)
        except TurnRefused as e:
            print(f"error: {e}", file=err, flush=True)
            continue
        if json_mode:
            print(json.dumps({"text": answer, "token_ids": chat.answer_ids, **chat.last}), file=out, flush=True)
        else:
            print(file=out, flush=True)
    return 0
