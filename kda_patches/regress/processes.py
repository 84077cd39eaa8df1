"""Process-group helpers of the A/B runner: every run is its own session, so the workload's
interpreter and everything it starts (vLLM's engine core and workers) share one process group,
which the runner waits for (ledgers are flushed at exit) or terminates as a whole.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time


def group_has_live_members(pgid: int) -> bool:
    """Return whether process group ``pgid`` has a member that is not a zombie.

    On Linux ``/proc`` is read (zombies left by an init that never reaps do not count);
    elsewhere ``killpg(pgid, 0)`` answers.
    """
    if os.path.isdir("/proc/self"):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                return True
        return False
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def wait_for_group_exit(pgid: int, timeout_s: float, leader: subprocess.Popen | None = None) -> bool:
    """Wait until no process of group ``pgid`` is left (vLLM children flushing ledgers).

    Args:
        pgid: the process group (the run's leader pid).
        timeout_s: how long to wait.
        leader: the leader's Popen, reaped while waiting (a zombie still counts as a member).
    Returns:
        True when the group is gone.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not group_has_live_members(pgid):
            if leader is not None:
                # The leader may have died after the last poll: it is a zombie now, so reap it (no wait).
                leader.wait(timeout=max(0.1, deadline - time.monotonic()))
            return True
        if leader is not None:
            leader.poll()
        time.sleep(0.1)
    return False


def terminate_group(pgid: int, leader: subprocess.Popen | None = None, grace_s: float = 10.0) -> None:
    """SIGTERM the run's process group, then SIGKILL what is left after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        if wait_for_group_exit(pgid, grace_s, leader):
            return
