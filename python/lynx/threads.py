"""What a thread that reads a peer's input does with an exception from one message: it
survives it. Such a thread (prefill's bootstrap hook, the sender's reaper, the lanes'
driver, decode's notice loop) serves every request of the server; one hostile or
malformed message must fail at most its own request, never end the thread, which would
leave the server healthy to the router yet deaf."""

from __future__ import annotations

import logging
import threading

_KINDS_LOGGED = 64  # distinct (step, exception type) pairs logged with their traceback


class Survivor:
    """Counts the exceptions one thread survived and logs each kind once. Call
    :meth:`survived` from an ``except`` block; the thread then goes on with its next
    message. A flood of one bad message logs one traceback, not one per message."""

    def __init__(self, log: logging.Logger, thread: str) -> None:
        self._log = log
        self.thread = thread
        self.count = 0
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def survived(self, step: str, exc: BaseException) -> None:
        """``exc`` was raised in ``step`` (what the thread was doing, e.g. "taking an offer
        for room 5") and caught."""
        kind = (step.split(" for ", 1)[0], type(exc).__name__)
        with self._lock:
            self.count += 1
            first = kind not in self._seen and len(self._seen) < _KINDS_LOGGED
            if first:
                self._seen.add(kind)
        if first:
            self._log.error(
                "Lynx %s: %s raised %s: %s; the thread goes on (logged once per kind; %d so far)",
                self.thread,
                step,
                type(exc).__name__,
                exc,
                self.count,
                exc_info=exc,
            )
        else:
            self._log.debug("Lynx %s: %s raised %r", self.thread, step, exc)
