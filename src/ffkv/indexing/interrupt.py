"""Ctrl-C that waits for a safe point: the loop asks, and stops where its state is whole."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Callable, Iterator


@contextmanager
def deferred_interrupt() -> Iterator[Callable[[], bool]]:
    """Turn SIGINT into a flag the caller polls; a second Ctrl-C interrupts at once.

    Yields a function returning True once Ctrl-C was pressed. Outside the main
    thread (where handlers cannot be set) the flag stays False and Ctrl-C acts as usual.
    """
    pressed = {"count": 0}
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return

    def handler(signum, frame):
        pressed["count"] += 1
        if pressed["count"] > 1:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: pressed["count"] > 0
    finally:
        signal.signal(signal.SIGINT, previous)
