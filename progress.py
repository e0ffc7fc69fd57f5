"""Progress lines for long work, on stderr, once the work has run a while. On a terminal one line rewritten in place
(carriage return + clear to the end of the line) from DELAY seconds on, at most 4 times a second, and cleared when
the work ends (what follows, a summary or the output, is the record). Off a terminal (a pipe, a log file) a plain
line every LOG_INTERVAL seconds, the first after LOG_INTERVAL, and nothing to clear: a log shows the work going on,
one line at a time. With `quiet` set (a command line's --quiet) nothing is written anywhere.

    with Progress(total, "prefill", "tokens", rate_unit="tok") as bar:   # prefill 1,024/4,000 tokens  312 tok/s  3.3 s
        for done in ...:
            bar.update(done)
    with Ticker("compiling the decode step (max-autotune)"):             # compiling ... (max-autotune) ... 12 s
        compile()
"""
import os
from contextlib import contextmanager
import shutil
import sys
import threading
import time

DELAY = 1.0  # seconds of work before the first line on a terminal: fast work prints nothing
INTERVAL = 0.25  # on a terminal at most 4 updates a second (the final one is always drawn)
TICK = 1.0  # a Ticker's line on a terminal: rewritten every second, the first after one
LOG_INTERVAL = 5.0  # off a terminal: a plain line every 5 seconds, the first after 5
CLEAR = "\r\x1b[K"  # back to the start of the line, clear to its end
quiet = False  # set by a command line's --quiet: no progress line anywhere in the process


def on_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def columns(stream) -> int:
    """The width of the terminal `stream` writes to (80 when it cannot tell): a longer line would wrap, and the
    carriage return would then rewrite only its last row. A terminal whose size is unset says 0."""
    try:
        n = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        n = 0
    return n if n > 0 else shutil.get_terminal_size().columns


class _Line:
    """One progress line on `stream` (default: sys.stderr when the line is made): rewritten in place on a terminal,
    a plain line each time off one."""

    def __init__(self, stream, enabled: bool):
        self.stream = sys.stderr if stream is None else stream
        self.active = enabled and not quiet
        self.terminal = on_terminal(self.stream)
        self.drawn = False

    def draw(self, text: str) -> None:
        if self.terminal:
            width = max(columns(self.stream) - 1, 10)
            self.stream.write(CLEAR + text[:width])
            self.drawn = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Clear a terminal's line if anything was drawn; later calls do nothing."""
        if self.drawn:
            self.stream.write(CLEAR)
            self.stream.flush()
            self.drawn = False
        self.active = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Progress(_Line):
    """`label done/total unit  rate  elapsed  note` for work counted in steps: update(done) (or step() for one more)
    after each one, close() (or the end of a `with`) at the end. `rate_unit` names the rate ("tok" -> "312 tok/s";
    default: unit), `scale` is what one step is worth in it (a one-shot prefill counts layers and rates tokens:
    scale = tokens / layers); `note`, when set, ends the line (what the work is at). delay and interval: the
    module's, a terminal's or a log's."""

    def __init__(self, total: int, label: str, unit: str, *, rate_unit: str | None = None, scale: float = 1.0,
                 stream=None, enabled: bool = True, delay: float | None = None, interval: float | None = None,
                 clock=time.monotonic):
        super().__init__(stream, enabled)
        self.total, self.label, self.unit = total, label, unit
        self.rate_unit, self.scale = rate_unit or unit, scale
        self.delay = (DELAY if self.terminal else LOG_INTERVAL) if delay is None else delay
        self.interval = (INTERVAL if self.terminal else LOG_INTERVAL) if interval is None else interval
        self.clock = clock
        self.start = clock()
        self.last = None  # when the line was last drawn
        self.done, self.note = 0, ""

    def due(self, done: int, now: float | None = None) -> bool:
        """Whether update(done) would draw now: past the delay, and the interval since the last line (on a terminal,
        or the end). A caller whose steps run asynchronously (CUDA) syncs only then, at most 1 / interval times a
        second."""
        if not self.active:
            return False
        now = self.clock() if now is None else now
        if now - self.start < self.delay:
            return False
        return (done >= self.total and self.terminal) or self.last is None or now - self.last >= self.interval

    def update(self, done: int) -> None:
        self.done = done
        if not self.active:
            return
        now = self.clock()
        if not self.due(done, now):
            return
        elapsed = now - self.start
        rate = done * self.scale / elapsed if elapsed > 0 else 0.0
        self.draw(f"{self.label} {done:,}/{self.total:,} {self.unit}  {rate:,.0f} {self.rate_unit}/s  "
                  f"{elapsed:.1f} s" + (f"  {self.note}" if self.note else ""))
        self.last = now

    def step(self, n: int = 1) -> None:
        self.update(self.done + n)


class Ticker(_Line):
    """`label ... 12 s` every `interval` seconds (default: TICK on a terminal, rewritten in place and cleared at the
    end of the block; LOG_INTERVAL off one) from a daemon thread while the `with` block runs, for work without steps
    (a torch.compile)."""

    def __init__(self, label: str, *, stream=None, enabled: bool = True, interval: float | None = None,
                 clock=time.monotonic):
        super().__init__(stream, enabled)
        self.label, self.clock = label, clock
        self.interval = (TICK if self.terminal else LOG_INTERVAL) if interval is None else interval
        self.stop = threading.Event()
        self.thread = None

    def __enter__(self):
        if self.active:
            self.start = self.clock()
            self.thread = threading.Thread(target=self.tick, name="progress-ticker", daemon=True)
            self.thread.start()
        return self

    def tick(self) -> None:
        while not self.stop.wait(self.interval):
            try:
                self.draw(f"{self.label} ... {self.clock() - self.start:.0f} s")
            except (OSError, ValueError):  # stderr closed under us: the work goes on without its line
                return

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()  # no line is drawn after the clear
            self.thread = None
        super().close()


def prefill_progress(prompt_len: int, n_layers: int, one_shot: bool = False, sync=None):
    """The prefill's progress line and generate()'s on_prefill for it: "prefill 1,024/4,000 tokens  312 tok/s  3.3 s",
    one-shot "prefill (one-shot) 4,000 tokens: 12/30 layers  850 tok/s  5.1 s" (every token goes through a layer at
    once; the rate counts a layer as 1/30 of the prompt; one prompt only: a one-shot batch reports prompt tokens,
    one prompt at a time, as block-wise does). on_prefill is None where no line is written (--quiet): generate()
    then calls nothing. sync(), when given, runs before a line is drawn (at most 4 times a second): on
    CUDA the blocks run asynchronously, and the line must count what has run, not what was queued."""
    if one_shot:
        bar = Progress(n_layers, f"prefill (one-shot) {prompt_len:,} tokens:", "layers", rate_unit="tok",
                       scale=prompt_len / n_layers)
    else:
        bar = Progress(prompt_len, "prefill", "tokens", rate_unit="tok")
    if not bar.active:
        return bar, None
    calls = [0]

    def on_prefill(done: int, total: int) -> None:
        calls[0] += 1
        step = calls[0] if one_shot else done  # one-shot: called once per layer
        if bar.due(step):
            if sync is not None:
                sync()
            bar.update(step)
    return bar, on_prefill


@contextmanager
def compiling(gen):
    """A run's compile (engine.Generation.compile's around): its progress line on stderr ("compiling the decode step (aot) ... 12 s"), as the
    command line's, for a compile that takes minutes when nothing is cached."""
    with Ticker(f"compiling the {'prefill and ' if gen.compiled_prefill else ''}decode step"
                         f"{'s' if gen.compiled_prefill else ''} ({gen.compile_mode})"):
        yield None
