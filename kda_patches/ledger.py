"""Per-process ledger: what was applied, skipped or failed, and which paths ran.

Every decision the overlay makes lands here: patch states per target, path counters (calls
seen / routed / bypassed, builds flagged, ...), and free-form facts per section (bootstrap
steps, plan choices, layout verdicts). With ``KDA_PATCHES_STATUS_DIR`` set the ledger is written
atomically to ``<dir>/ledger-<pid>.json`` on every state change, at most once per second while
counters move, and at interpreter exit (SIGTERM / SIGINT held during that last write:
:class:`DeferredSignals`). Stdlib only.
"""

from __future__ import annotations

import _thread
import atexit
import os
import sys
import time

TYPE_CHECKING = False  # typing costs ~8 ms at import; annotations are strings here
if TYPE_CHECKING:
    from typing import Any

# Patch states, most to least significant when a patch has several targets.
STATE_ORDER = ("failed", "skipped", "applied", "pending", "not-applicable", "disabled")
_FLUSH_INTERVAL_S = 1.0


class Ledger:
    """Status of the overlay in one process.

    Attributes:
        pid: the process id the ledger belongs to (a forked child starts a fresh ledger).
        switches: the effective switches (``Flags.as_dict()``), set at activation.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.started_at = time.time()
        self.switches: dict[str, Any] = {}
        self.status_dir: str | None = None
        self.role: str | None = None
        self._targets: dict[str, dict[str, dict[str, str]]] = {}
        self._patch_notes: dict[str, str] = {}
        self._counters: dict[str, dict[str, int]] = {}
        self._facts: dict[str, dict[str, Any]] = {}
        self._lock = _thread.RLock()
        self._last_flush = 0.0
        self._dirty = False
        self.final = False

    # -- recording -------------------------------------------------------------------------
    def record_patch(self, patch: str, state: str, reason: str = "") -> None:
        """Record a patch-level state that has no single target (e.g. ``disabled`` by a switch)."""
        if state not in STATE_ORDER:
            raise ValueError(f"unknown patch state {state!r}; valid: {STATE_ORDER}")
        with self._lock:
            self._patch_notes[patch] = f"{state}:{reason}"
        self.flush(force=True)

    def record_target(self, patch: str, target: str, state: str, reason: str = "") -> None:
        """Record the state of one patch target.

        Args:
            patch: patch name.
            target: ``module:qualname`` of the target.
            state: one of :data:`STATE_ORDER`.
            reason: why (version found, signature drift, exception text, ...).
        """
        if state not in STATE_ORDER:
            raise ValueError(f"unknown patch state {state!r}; valid: {STATE_ORDER}")
        with self._lock:
            self._targets.setdefault(patch, {})[target] = {"state": state, "reason": reason}
        self.flush(force=True)

    def count(self, path: str, key: str, amount: int = 1) -> None:
        """Add ``amount`` to counter ``key`` of ``path`` (e.g. ``gdn_host_flags``/``builds_seen``)."""
        counters = self._counters.get(path)
        if counters is None:
            counters = self._counters.setdefault(path, {})
        counters[key] = counters.get(key, 0) + amount
        self._dirty = True
        if self.status_dir and time.monotonic() - self._last_flush > _FLUSH_INTERVAL_S:
            self.flush()

    def count_each(self, path: str, keys: tuple[str, ...]) -> None:
        """Add 1 to each counter in ``keys`` of ``path`` (one routed call's counters at once)."""
        counters = self._counters.get(path)
        if counters is None:
            counters = self._counters.setdefault(path, {})
        for key in keys:
            counters[key] = counters.get(key, 0) + 1
        self._dirty = True
        if self.status_dir and time.monotonic() - self._last_flush > _FLUSH_INTERVAL_S:
            self.flush()

    def count_routed(self, path: str, casts_folded: bool) -> None:
        """Count one routed call of ``path``: ``calls_seen`` and ``calls_routed``, and ``casts_folded`` if it
        folded its cast (:meth:`count_each` with those keys, unrolled: this runs once per routed layer call)."""
        counters = self._counters.get(path)
        if counters is None:
            counters = self._counters.setdefault(path, {})
        get = counters.get
        counters["calls_seen"] = get("calls_seen", 0) + 1
        counters["calls_routed"] = get("calls_routed", 0) + 1
        if casts_folded:
            counters["casts_folded"] = get("casts_folded", 0) + 1
        self._dirty = True
        if self.status_dir and time.monotonic() - self._last_flush > _FLUSH_INTERVAL_S:
            self.flush()

    def set_fact(self, section: str, key: str, value: Any) -> None:
        """Record a JSON-serialisable fact under ``section`` (bootstrap steps, plan kinds, ...)."""
        with self._lock:
            self._facts.setdefault(section, {})[key] = value
        self.flush(force=True)

    # -- reading ---------------------------------------------------------------------------
    def patch_state(self, patch: str) -> tuple[str, str]:
        """Return ``(state, reason)`` of a patch, aggregated over its targets."""
        targets = self._targets.get(patch, {})
        if targets:
            best = min(targets.values(), key=lambda t: STATE_ORDER.index(t["state"]))
            return best["state"], best["reason"]
        note = self._patch_notes.get(patch)
        if note is None:
            return "pending", "not registered in this process"
        state, _, reason = note.partition(":")
        return state, reason

    def counters(self, path: str) -> dict[str, int]:
        """Return a copy of the counters of ``path``."""
        return dict(self._counters.get(path, {}))

    def snapshot(self) -> dict[str, Any]:
        """Return the whole ledger as a JSON-serialisable dict."""
        with self._lock:
            names = sorted(set(self._targets) | set(self._patch_notes))
            patches = {}
            for name in names:
                state, reason = self.patch_state(name)
                patches[name] = {"state": state, "reason": reason,
                                 "targets": {k: dict(v) for k, v in self._targets.get(name, {}).items()}}
            return {
                "pid": self.pid,
                "role": self.role or guess_process_role(),
                "argv": list(sys.argv[:3]),
                "started_at": self.started_at,
                "written_at": time.time(),
                "switches": dict(self.switches),
                "patches": patches,
                "counters": {p: dict(c) for p, c in self._counters.items()},
                "facts": {s: dict(f) for s, f in self._facts.items()},
                "final": self.final,
            }

    # -- persistence -----------------------------------------------------------------------
    def flush(self, force: bool = False) -> str | None:
        """Write the ledger to the status dir (atomic rename). Returns the path, or None."""
        if not self.status_dir or os.getpid() != self.pid:
            return None
        if not force and not self._dirty:
            return None
        self._last_flush = time.monotonic()
        self._dirty = False
        return write_ledger_file(self.snapshot(), self.status_dir)


def write_ledger_file(snapshot: dict[str, Any], status_dir: str) -> str:
    """Atomically write ``snapshot`` to ``status_dir/ledger-<pid>.json`` and return the path."""
    import json
    import tempfile

    os.makedirs(status_dir, exist_ok=True)
    final = os.path.join(status_dir, f"ledger-{snapshot['pid']}.json")
    fd, tmp = tempfile.mkstemp(prefix=".ledger-", suffix=".tmp", dir=status_dir)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(snapshot, handle, indent=1, sort_keys=True, default=str)
        os.replace(tmp, final)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return final


def sum_counters(snapshots: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Return every counter summed over ledger snapshots (or their summaries), by section then key, sorted."""
    totals: dict[str, dict[str, int]] = {}
    for snapshot in snapshots:
        for section, values in snapshot.get("counters", {}).items():
            bucket = totals.setdefault(section, {})
            for key, amount in values.items():
                bucket[key] = bucket.get(key, 0) + int(amount)
    return {section: dict(sorted(values.items())) for section, values in sorted(totals.items())}


def read_ledger_dir(status_dir: str) -> list[dict[str, Any]]:
    """Read every ``ledger-*.json`` in ``status_dir``, ordered by pid."""
    import json

    ledgers = []
    for name in sorted(os.listdir(status_dir)):
        if name.startswith("ledger-") and name.endswith(".json"):
            with open(os.path.join(status_dir, name)) as handle:
                ledgers.append(json.load(handle))
    return sorted(ledgers, key=lambda entry: entry["pid"])


def guess_process_role() -> str:
    """Best-effort role of this process (vLLM names its engine-core and worker processes)."""
    explicit = os.environ.get("KDA_PATCHES_ROLE")
    if explicit:
        return explicit
    multiprocessing = sys.modules.get("multiprocessing")  # only consult it if already in use
    name = multiprocessing.current_process().name if multiprocessing is not None else None
    if name and name != "MainProcess":
        return name
    return "main"


_LEDGER: Ledger | None = None
_LEDGER_LOCK = _thread.allocate_lock()
_PID = os.getpid()


def _remember_child_pid() -> None:
    global _PID
    _PID = os.getpid()


os.register_at_fork(after_in_child=_remember_child_pid)


def get_ledger() -> Ledger:
    """Return this process's ledger (a forked child gets a fresh one that inherits the switches).

    The common case (same process) takes no lock and makes no system call: wrappers call this per call.
    """
    global _LEDGER
    ledger = _LEDGER
    if ledger is not None and ledger.pid == _PID:
        return ledger
    with _LEDGER_LOCK:
        if _LEDGER is None or _LEDGER.pid != _PID:
            previous = _LEDGER
            _LEDGER = Ledger()
            if previous is not None:
                # A forked child keeps the parent's wrappers, so it inherits patch states and
                # facts; its counters start at zero because they describe this process only.
                _LEDGER.switches = dict(previous.switches)
                _LEDGER.status_dir = previous.status_dir
                _LEDGER.role = previous.role
                for patch, targets in previous._targets.items():
                    _LEDGER._targets[patch] = {k: dict(v) for k, v in targets.items()}
                _LEDGER._patch_notes = dict(previous._patch_notes)
                for section, facts in previous._facts.items():
                    _LEDGER._facts[section] = dict(facts)
        return _LEDGER


DEFERRED_SIGNALS = ("SIGTERM", "SIGINT")


class DeferredSignals:
    """Hold SIGTERM / SIGINT while the final ledger is written, then deliver them to the handlers they had.

    vLLM stops its workers with SIGTERM a few seconds after asking them to exit, and its handler raises
    ``SystemExit`` wherever the main thread is: arriving during the exit-time write, it would leave the ledger
    without its ``final`` mark (seen on a loaded 2-core machine with two TP workers). Only the main thread can
    change handlers; elsewhere, and for a handler that is not a Python callable or ``SIG_DFL``, nothing is held.
    """

    def __init__(self) -> None:
        self.held: list[int] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> DeferredSignals:
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            return self
        for name in DEFERRED_SIGNALS:
            number = getattr(signal, name, None)
            previous = signal.getsignal(number) if number is not None else None
            if previous is None or previous == signal.SIG_IGN:
                continue
            self._previous[number] = previous
            signal.signal(number, lambda received, frame: self.held.append(received))
        return self

    def __exit__(self, *exc_info: object) -> None:
        import signal

        for number, previous in self._previous.items():
            signal.signal(number, previous)
        for number in dict.fromkeys(self.held):  # each signal once, to the handler it had
            signal.raise_signal(number)


def _flush_at_exit() -> None:
    ledger = _LEDGER
    if ledger is not None and ledger.pid == os.getpid():
        ledger.final = True  # readers can tell a complete ledger from one cut off by a kill
        with DeferredSignals():
            try:
                ledger.flush(force=True)
            except OSError:
                pass


atexit.register(_flush_at_exit)
