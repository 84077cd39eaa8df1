"""cpu_pin: the host cores a benchmark's processes run on (issue 26, run 7: the host's speed varies by core)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kda_patches.bench.cpu_pin import check_available, current_cpu, parse_cpus, pin_children


def test_a_core_list_takes_single_cores_and_ranges():
    assert parse_cpus("2-4,8") == {2, 3, 4, 8}
    assert parse_cpus(" 0 , 0-1 ,") == {0, 1}


@pytest.mark.parametrize(("text", "why"), [("", "name at least one core"), ("a-3", "is not N or N-M"),
                                           ("5-2", "N-M with 0 <= N <= M"), ("-1", "is not N or N-M")])
def test_a_malformed_core_list_is_refused_naming_the_part(text, why):
    with pytest.raises(ValueError, match=why):
        parse_cpus(text)


def test_cores_outside_the_processs_affinity_are_refused():
    allowed = os.sched_getaffinity(0)
    check_available(frozenset(allowed))
    with pytest.raises(ValueError, match=r"cores \[4095\] are not available"):
        check_available(frozenset({4095, min(allowed)}))


def test_a_pinned_child_and_its_own_children_run_on_the_cores():
    core = max(os.sched_getaffinity(0))
    grandchild = ("import os, subprocess, sys; print(sorted(os.sched_getaffinity(0))); sys.stdout.flush(); "
                  "subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'])")
    shown = subprocess.run([sys.executable, "-c", grandchild], preexec_fn=pin_children(frozenset({core})),
                           capture_output=True, text=True, check=True).stdout.split()
    assert shown == [f"[{core}]", f"[{core}]"]
    assert pin_children(None) is None


def test_the_current_core_is_the_one_the_thread_is_pinned_to():
    allowed = os.sched_getaffinity(0)
    try:
        for core in sorted(allowed):  # each core in turn: a wrong field would not follow the pin every time
            os.sched_setaffinity(0, {core})
            assert current_cpu() == core
    finally:
        os.sched_setaffinity(0, allowed)
