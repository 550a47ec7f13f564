"""Progress of the long command-line runs (training, the load tester, the sweep, the advisor):
tqdm's bar on a terminal; in a log — output piped or redirected, not a terminal — one line per
finished phase instead, since a bar redraws itself with carriage returns and a piped log gets
one endless line of them — and, for a long phase, a line every ``interval_s`` seconds, so a
log shows a run is alive and how far it got."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm


class Progress:
    """``total`` steps of ``unit``, described as ``desc``, on ``file`` (default stderr).

    On a terminal: a tqdm bar, ``phase(text)`` shown beside it. Otherwise no bar; each
    ``phase_done(text)`` prints ``"{desc}: {text} [{done}/{total} {unit}, {s} s]"``.
    ``write(text)`` prints a line in both cases (above the bar on a terminal); ``leave``: keep
    the finished bar on the terminal. In a log, ``update`` also prints
    ``"{desc}: {done}/{total} {unit}, {s} s, ETA {s} s[, {phase}]"`` when ``interval_s``
    seconds (None: never) have passed since the last line; ``clock``: seconds."""

    def __init__(self, total: int, desc: str, unit: str, file: TextIO | None = None,
                 leave: bool = True, interval_s: float | None = None,
                 clock=time.perf_counter):
        self.file = sys.stderr if file is None else file
        self.terminal = bool(getattr(self.file, "isatty", lambda: False)())
        self.desc, self.unit, self.total, self.done = desc, unit, total, 0
        self.clock, self.interval_s, self.postfix = clock, interval_s, ""
        self.start = self.last_line = clock()
        self.bar = tqdm(total=total, desc=desc, unit=unit, file=self.file,
                        disable=not self.terminal, leave=leave)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.done += n
        self.bar.update(n)
        if self.terminal or self.interval_s is None:
            return
        now = self.clock()
        if now - self.last_line >= self.interval_s:
            self.last_line = now
            spent = now - self.start
            eta = spent / self.done * (self.total - self.done) if self.done else 0.0
            self.write(f"{self.desc}: {self.done}/{self.total} {self.unit}, {spent:.0f} s, "
                       f"ETA {eta:.0f} s" + (f", {self.postfix}" if self.postfix else ""))

    def phase(self, text: str) -> None:
        """A phase begins: named beside the bar (in a log: on the next interval's line)."""
        self.postfix = text
        self.bar.set_postfix_str(text)

    def phase_done(self, text: str) -> None:
        """A phase ended: one line in a log (nothing on a terminal, where the bar shows it)."""
        if not self.terminal:
            self.write(f"{self.desc}: {text} [{self.done}/{self.total} {self.unit}, "
                       f"{self.clock() - self.start:.0f} s]")

    def write(self, text: str) -> None:
        tqdm.write(text, file=self.file)
        self.file.flush()

    def close(self) -> None:
        self.bar.close()
