"""Ctrl-C during a run: finish what is safe to finish, checkpoint, stop.

    with GracefulInterrupt() as interrupt:   # installs a SIGINT handler (main thread only)
        with interrupt.armed():              # the step loop: a first Ctrl-C is deferred ...
            if interrupt.pending(): ...      # ... to the loop's next safe point (or: .check())
            with interrupt.safe():           # ... or raised at once while the loop only waits
                ray.wait(...)

A first SIGINT outside `armed()` (start-up, pretraining) raises KeyboardInterrupt at once, as
Python does by default; inside it, the loop checkpoints its current step and raises
`RunInterrupted`.  A second SIGINT always raises at once (abort without a checkpoint).
No Ray here: both run loops take the object as `interrupt=` (the reference loop calls `check()`
before every step).
"""
from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager


class GracefulInterrupt:
    def __init__(self, notice: bool = True):
        self.count = 0
        self.notice = notice
        self._armed = self._safe = False
        self._previous = None

    def __enter__(self) -> GracefulInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        self._armed = False
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def pending(self) -> bool:
        """True once Ctrl-C was pressed."""
        return self.count > 0

    def check(self) -> bool:
        """`pending()`, arming the deferral from the first call on: a loop that calls this at
        the top of every step (the reference loop) defers Ctrl-C to its next step."""
        self._armed = True
        return self.pending()

    @contextmanager
    def armed(self):
        """Defer a first Ctrl-C to the loop's safe points (`pending`, `safe`)."""
        self._armed = True
        try:
            yield self
        finally:
            self._armed = False

    @contextmanager
    def safe(self):
        """A region where the loop only waits: Ctrl-C raises KeyboardInterrupt at once."""
        if self.pending() and self._armed:
            raise KeyboardInterrupt
        self._safe = True
        try:
            yield
        finally:
            self._safe = False

    def _handle(self, signum, frame) -> None:
        self.count += 1
        if not self._armed or self._safe or self.count > 1:
            raise KeyboardInterrupt
        if self.notice:
            print("\nopd: interrupt: finishing the current step, then saving a checkpoint "
                  "(Ctrl-C again to abort without one)", file=sys.stderr, flush=True)


class NoInterrupt:
    """What a run uses when no handler is installed: never pending, nothing deferred."""

    def pending(self) -> bool:
        return False

    def check(self) -> bool:
        return False

    @contextmanager
    def armed(self):
        yield self

    @contextmanager
    def safe(self):
        yield
