"""SIGTERM as a clean exit, so what background sinks hold is delivered before the process ends.

A scheduler pre-empting a job sends SIGTERM. With the default action the process dies at once and
buffered tracker data (the tail of a W&B offline run file, queued MLflow values, alerts) is lost.
:func:`install_sigterm_exit`, called by the first background sink that starts on the main thread,
turns SIGTERM into ``SystemExit(143)``: ``finally`` blocks and the ``atexit`` flushes run, and
:func:`signal_exit_code` tells the sinks to mark their run as killed rather than finished.

Installed once per process. A handler installed before it (a launcher's, a framework's) is
chained, not replaced: it runs first and keeps its say. If it ends the process (raises, exits),
that stands and the run is marked killed; if it returns (it handles SIGTERM its own way, e.g. a
flag to stop after the step), so does ours and training goes on. A SIGTERM that is ignored
(``SIG_IGN``) or handled outside Python stays as it is.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from typing import Any, Callable

log = logging.getLogger("earlywarn.sinks")

_lock = threading.Lock()
_installed = False
_previous: Callable[[int, Any], Any] | None = None
"""The Python handler ours replaced (``None``: it replaced the default action)."""
_signal_exit_code: int | None = None


def install_sigterm_exit() -> bool:
    """Turn SIGTERM into ``SystemExit(143)`` so ``finally`` blocks and ``atexit`` flushes run.

    Only from the main thread (Python installs signal handlers there); once per process; chained
    after a handler installed before (see the module docstring). Returns True when the handler
    is in place."""
    global _installed, _previous
    with _lock:
        if _installed:
            return True
        if threading.current_thread() is not threading.main_thread():
            return False
        try:
            previous = signal.getsignal(signal.SIGTERM)
            if previous is signal.SIG_IGN or previous is None:
                return False  # ignored on purpose, or a handler outside Python that cannot be chained
            signal.signal(signal.SIGTERM, _on_sigterm)
        except (ValueError, OSError, AttributeError):  # no signals here (embedded interpreter, Windows)
            return False
        _previous = None if previous is signal.SIG_DFL else previous
        _installed = True
        return True


def signal_exit_code() -> int | None:
    """143 once SIGTERM ended (or is ending) the process through :func:`install_sigterm_exit`'s
    handler, else None. Sinks finishing at that point mark their run as killed instead of finished."""
    return _signal_exit_code


def _on_sigterm(signum: int, frame: Any) -> None:
    global _signal_exit_code
    previous = _previous
    if previous is not None:
        try:
            previous(signum, frame)
        except BaseException:
            _signal_exit_code = 128 + signum  # it ends the process: the run was killed
            raise
        return  # it handled SIGTERM its own way and let the process go on
    _signal_exit_code = 128 + signum
    log.warning("earlywarn: SIGTERM received; flushing trackers and exiting")
    sys.exit(128 + signum)
