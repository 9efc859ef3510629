"""The ranks' output on the console of `memfit launch`: a refusal said once, not once per rank.

Every rank runs the same checks, so a clear refusal (`RunRefused`: a checkpoint of another run, a
run config the ranks cannot train) is raised by all of them, and each printed its traceback.
`RankOutput` reads each rank's output (stdout and stderr together, one pipe per rank) and passes
it on line by line, except a traceback: that is held until the rank's output ends (or the rank
prints on RELEASE_S after it, so a traceback a rank survives is not held for long). A held
traceback that ends in a refusal becomes one line, `memfit: error: <message>`, printed by the
first rank that ends with it; the others' copies are dropped. Any other traceback (a crash) is
passed on whole, for every rank. A run started with a log file (the workflow) writes the log as
before: every traceback stays there.
"""

from __future__ import annotations

import re
import threading
import time
from typing import IO

# the exception line Python prints for memfit.train.run_config.RunRefused (module-qualified)
REFUSAL = re.compile(r"^memfit\.train\.run_config\.RunRefused: ", re.MULTILINE)
# once a rank has joined the process group, torch.distributed's excepthook prints every line of an
# uncaught traceback as "[rank0]: ..." (torch/distributed/distributed_c10d.py, init_process_group's
# _distributed_excepthook): read through the prefix, or such a refusal would print as a traceback
# and exit 1
RANK_PREFIX = re.compile(r"^\[rank\d+\]: ")
TRACEBACK = "Traceback (most recent call last):"
RELEASE_S = 5.0  # a rank still printing this long after a traceback survived it: pass it on


def refusal_message(lines: list[str]) -> str | None:
    """The refusal's message when the traceback `lines` end in a RunRefused, else None."""
    text = "".join(RANK_PREFIX.sub("", line) for line in lines)
    found = list(REFUSAL.finditer(text))
    if not found:
        return None
    return text[found[-1].end() :].strip()


class RankOutput:
    """Copies the ranks' pipes to `out` (plain lines) and `err` (tracebacks, the refusal)."""

    def __init__(self, out: IO[str], err: IO[str]) -> None:
        self.out, self.err = out, err
        self.lock = threading.Lock()
        self.said: set[str] = set()
        self.refused = False  # a rank ended with a refusal
        self.threads: list[threading.Thread] = []

    def attach(self, pipe: IO[bytes]) -> None:
        t = threading.Thread(target=self._pump, args=(pipe,), daemon=True)
        t.start()
        self.threads.append(t)

    def join(self, timeout: float = 30.0) -> None:
        for t in self.threads:
            t.join(timeout)

    def _write(self, stream: IO[str], text: str) -> None:
        with self.lock:
            stream.write(text)
            stream.flush()

    def _pump(self, pipe: IO[bytes]) -> None:
        held: list[str] | None = None
        since = 0.0
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", errors="replace")
            if held is not None and time.monotonic() - since > RELEASE_S:
                self._write(self.err, "".join(held))  # the rank lived on: not its end
                held = None
            if held is None and RANK_PREFIX.sub("", line).startswith(TRACEBACK):
                held, since = [line], time.monotonic()
            elif held is not None:
                held.append(line)
            else:
                self._write(self.out, line)
        pipe.close()
        if held:
            self._end(held)

    def _end(self, held: list[str]) -> None:
        msg = refusal_message(held)
        if msg is None:
            self._write(self.err, "".join(held))
            return
        with self.lock:
            self.refused = True
            if msg in self.said:
                return
            self.said.add(msg)
            self.err.write(f"memfit: error: {msg}\n")
            self.err.flush()
