"""Stop vLLM's engine-core processes without the 30-second stall of a missed SIGTERM.

vLLM's client stops its engine core with SIGTERM and force-kills it when ``timeout`` (the A/B's 30 s) expires.
The engine core's handler is a Python handler, and Python runs it only when the main thread executes bytecode. When
the signal lands while that thread is between its last check and a blocking wait (the client sends it right after
the engine's last reply, as the thread returns to ``input_queue.get()``), the thread sleeps on the queue with the
signal tripped and unhandled. Seen on vLLM 0.32's CPU engine in about half of the runs on this 2-core machine
(2026-12-05): no ``trigger received signal=SIGTERM`` line, the main thread's stack in ``queue.get``, SIGKILL 30 s
later, which also loses whatever the engine core would have written on its way out. A second SIGTERM releases it
at once, but one that arrives after the handler ran meets the default action vLLM restores for the teardown and
kills it mid-way, so it is not a fix.

:func:`stop_engine_core` instead wakes the queue: while vLLM's process manager waits, it sends the engine an
abort of a request id that does not exist, every ``wake_every_s``. The engine core's input thread puts it on the
queue, the main thread runs bytecode, the pending handler runs and the engine shuts down as vLLM meant; an engine
that already handled the signal ignores the message. The manager's shutdown is called first and directly so that
the waker is stopped before vLLM's client closes its sockets. Where the client lacks any of the pieces (another
vLLM, an in-process engine), it is stopped exactly as before.
"""

from __future__ import annotations

import threading
from typing import Any

WAKE_REQUEST_ID = "kda-patches-shutdown-wake"  # no engine ever holds a request of this id
WAKE_EVERY_S = 1.0  # a clean stop of a TP=1 CPU engine takes about 2 s; a wake meanwhile is ignored


def wake_until_set(send_abort: Any, stop: threading.Event, wake_every_s: float) -> int:
    """Call ``send_abort([WAKE_REQUEST_ID])`` every ``wake_every_s`` until ``stop`` is set; return the calls made.

    Args:
        send_abort: the client's ``abort_requests``.
        stop: set by the caller once the engine processes are gone (or the wait is over).
        wake_every_s: seconds between wakes; the first comes after one period, so an engine that handles its
            SIGTERM in time never sees one.
    Returns:
        How many wakes were sent (a failed send ends the loop: the client is going away).
    """
    sent = 0
    while not stop.wait(wake_every_s):
        try:
            send_abort([WAKE_REQUEST_ID])
        except Exception:  # the client's socket is closing; the manager's own timeout still bounds the wait
            break
        sent += 1
    return sent


def stop_engine_core(engine_core: Any, timeout_s: float, wake_every_s: float = WAKE_EVERY_S) -> int | None:
    """Stop vLLM's engine core through its client ``engine_core`` (``llm.llm_engine.engine_core``).

    Args:
        engine_core: vLLM's engine-core client; None does nothing.
        timeout_s: passed to vLLM's shutdown: how long its process manager waits before it force-kills.
        wake_every_s: seconds between wakes while the manager waits (see the module docstring).
    Returns:
        The wakes sent, or None where the client has no process manager with processes or no
        ``abort_requests`` (then only vLLM's own ``shutdown`` ran, as before).
    """
    shutdown = getattr(engine_core, "shutdown", None)
    manager = getattr(getattr(engine_core, "resources", None), "engine_manager", None)
    send_abort = getattr(engine_core, "abort_requests", None)
    if manager is None or not getattr(manager, "processes", None) or send_abort is None \
            or not callable(getattr(manager, "shutdown", None)):
        if shutdown is not None:
            shutdown(timeout=timeout_s)
        return None
    stop = threading.Event()
    sent: list[int] = []
    waker = threading.Thread(target=lambda: sent.append(wake_until_set(send_abort, stop, wake_every_s)),
                             name="kda-engine-stop-waker", daemon=True)
    waker.start()
    try:
        manager.shutdown(timeout=timeout_s)
    finally:
        stop.set()
        waker.join()
    if shutdown is not None:
        shutdown(timeout=timeout_s)  # the manager's part is done (vLLM detaches its finalizer); sockets close here
    return sent[0] if sent else 0
