"""GPU clock record of each timed pass (engine passes swing by 50%: did the machine drift?)."""

from __future__ import annotations

import calendar
import os
import signal
import stat
import time
from datetime import datetime

import pytest

from kda_patches.bench import gpu_clocks
from kda_patches.bench.gpu_clocks import (
    FIELDS,
    format_window,
    parse_samples,
    read_samples,
    start_sampler,
    stop_sampler,
    summarize_window,
)

EVENT_QUERY = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active"
THROTTLE_QUERY = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"


@pytest.fixture
def local_tz():
    """A local time zone five hours behind UTC (a POSIX rule: no tz database needed), so that reading nvidia-smi's
    local-time stamps as UTC would be off by 5 h."""
    saved = os.environ.get("TZ")
    os.environ["TZ"] = "KDA+5"
    time.tzset()
    yield
    if saved is None:
        del os.environ["TZ"]
    else:
        os.environ["TZ"] = saved
    time.tzset()


def stamp(moment: datetime, millis: int) -> str:
    """nvidia-smi's timestamp of a local time."""
    return moment.strftime("%Y/%m/%d %H:%M:%S") + f".{millis:03d}"


def test_the_fields_are_the_ones_the_summary_reads_in_order():
    assert ",".join(FIELDS) == EVENT_QUERY


def test_a_line_parses_to_unix_seconds_of_its_local_timestamp_and_floats(local_tz):
    moment = datetime(2024, 5, 6, 13, 14, 15)
    [sample] = parse_samples(f"{stamp(moment, 250)}, 1980, 2619, 412.37, 61, 0x0000000000000004\n")
    assert sample["t"] == pytest.approx(time.mktime(moment.timetuple()) + 0.250, abs=1e-6)
    assert sample["t"] == pytest.approx(calendar.timegm(moment.timetuple()) + 5 * 3600 + 0.250, abs=1e-6)
    assert (sample["sm_mhz"], sample["mem_mhz"], sample["power_w"], sample["temp_c"]) == (1980.0, 2619.0, 412.37,
                                                                                          61.0)
    assert sample["reasons"] == 0x4 and isinstance(sample["reasons"], int)


def test_unavailable_values_become_none():
    line = "2024/05/06 13:14:15.000, 1410, [Not Supported], [N/A], 40, [N/A]"
    [sample] = parse_samples(line)
    assert sample["sm_mhz"] == 1410.0 and sample["temp_c"] == 40.0
    assert sample["mem_mhz"] is None and sample["power_w"] is None and sample["reasons"] is None
    [sample] = parse_samples("2024/05/06 13:14:15.000, 1410, 2619, 300, [Unknown Error], [GPU requires reset]")
    assert sample["temp_c"] is None and sample["reasons"] is None  # any bracketed value: not a number


def test_malformed_lines_are_skipped_and_counted(tmp_path):
    good = ["2024/05/06 13:14:15.000, 1980, 2619, 400, 60, 0x0000000000000000",
            "2024/05/06 13:14:15.200, 1755, 2619, 700, 70, 0x0000000000000004"]
    text = "\n".join([good[0],
                      "2024/05/06 13:14:15.100, 1980, 2619, 400, 60",  # a field short
                      "2024/05/06 13:14:15.100, 1980, 2619, 400, 60, 0x0, 7",  # a field over
                      "2024-05-06T13:14:15, 1980, 2619, 400, 60, 0x0",  # another timestamp format
                      "2024/05/06 13:14:15.100, fast, 2619, 400, 60, 0x0",  # neither a number nor bracketed
                      "",  # blank: not a sample, not malformed
                      good[1],
                      "2024/05/06 13:14:15.300, 19"])  # the line being written when the file was read
    path = tmp_path / "clocks.csv"
    path.write_text(text)
    samples, skipped = read_samples(str(path))
    assert skipped == 5
    assert [sample["power_w"] for sample in samples] == [400.0, 700.0]
    assert parse_samples(text) == samples


def test_a_missing_file_reads_as_no_samples(tmp_path):
    assert read_samples(str(tmp_path / "never-written.csv")) == ([], 0)


def sample(t: float, sm: float | None = 1980.0, power: float | None = 400.0, temp: float | None = 60.0,
           reasons: int | None = 0x0) -> dict:
    return {"t": t, "sm_mhz": sm, "mem_mhz": 2619.0, "power_w": power, "temp_c": temp, "reasons": reasons}


def test_a_window_holds_exactly_the_samples_between_its_ends_inclusive():
    samples = [sample(99.999, sm=900.0, power=100.0, temp=90.0, reasons=0x40),  # just before
               sample(100.0, sm=1755.0, power=400.0, temp=60.0, reasons=0x1),
               sample(105.0, sm=1980.0, power=None, temp=65.0, reasons=0x4),
               sample(107.0, sm=1900.0, power=420.0, temp=None, reasons=None),
               sample(110.0, sm=1950.0, power=430.0, temp=62.0, reasons=0x0),
               sample(110.001, sm=2100.0, power=700.0, temp=95.0, reasons=0x40)]  # just after
    summary = summarize_window(samples, 100.0, 110.0)
    assert summary == {"count": 4, "sm_mhz_median": 1925.0, "sm_mhz_min": 1755.0, "sm_mhz_max": 1980.0,
                       "power_w_median": 420.0, "temp_c_max": 65.0, "throttled_fraction": pytest.approx(1 / 3)}


def test_idle_alone_is_not_throttling_but_every_other_reason_is():
    reasons = [0x1, 0x0, 0x4, 0x5, 0x2, 0x1]  # idle, none, SW power cap, idle + power cap, applications clocks, idle
    samples = [sample(float(t), reasons=bits) for t, bits in enumerate(reasons)]
    assert summarize_window(samples, 0.0, 10.0)["throttled_fraction"] == pytest.approx(3 / 6)
    assert summarize_window(samples[:2], 0.0, 10.0)["throttled_fraction"] == 0.0


def test_a_statistic_without_values_is_none():
    samples = [sample(1.0, sm=None, power=None, temp=None, reasons=None), sample(2.0, sm=None, power=None)]
    summary = summarize_window(samples, 0.0, 3.0)
    assert summary["count"] == 2
    assert summary["sm_mhz_median"] is None and summary["sm_mhz_min"] is None and summary["sm_mhz_max"] is None
    assert summary["power_w_median"] is None
    assert summary["temp_c_max"] == 60.0 and summary["throttled_fraction"] == 0.0


def test_an_empty_window_has_only_its_count():
    assert summarize_window([sample(1.0), sample(5.0)], 2.0, 4.0) == {"count": 0}
    assert format_window({"count": 0}) == "no GPU clock samples"


def test_a_window_formats_as_one_short_line():
    summary = {"count": 9, "sm_mhz_median": 1979.6, "sm_mhz_min": 1755.0, "sm_mhz_max": 1980.0,
               "power_w_median": 411.8, "temp_c_max": 61.0, "throttled_fraction": 0.12}
    assert format_window(summary) == "sm 1980 MHz (1755-1980), 412 W, 61 C, throttled 12%"
    summary.update(power_w_median=None, throttled_fraction=None)
    assert format_window(summary) == "sm 1980 MHz (1755-1980), ? W, 61 C, throttled ?"


def test_a_missing_tool_gives_no_sampler_and_a_note_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: nothing is found
    process, note = start_sampler(str(tmp_path / "clocks.csv"))
    assert process is None and "nvidia-smi" in note and "not found" in note
    process, note = start_sampler(str(tmp_path / "clocks.csv"), executable="kda-no-such-smi")
    assert process is None and "kda-no-such-smi" in note
    assert not (tmp_path / "clocks.csv").exists()


def test_an_interval_below_50_ms_is_refused(tmp_path):
    with pytest.raises(ValueError, match="interval_ms"):
        start_sampler(str(tmp_path / "clocks.csv"), interval_ms=49)


FAKE_SMI = """\
#!/bin/sh
printf '%s\\n' "$*" >> {log}
case "$*" in *{reject}*) echo "Field \\"{reject}\\" is not a valid field to query." >&2; exit 2;; esac
case "$*" in *-lms*) ;; *) echo "2024/05/06 13:14:15.000, 1980, 2619, 400, 60, 0x0000000000000000"; exit 0;; esac
{prelude}
while :; do
  echo "2024/05/06 13:14:15.250, 1755, 2619, 398.5, 60, 0x0000000000000004"
  echo "2024/05/06 13:14:15.450, 1980, 2619, [N/A], 61, 0x0000000000000001"
  sleep 0.05
done
"""


def write_fake_smi(directory, reject: str, prelude: str = "") -> str:
    """An nvidia-smi stand-in: logs its arguments, exits 2 when they contain ``reject``, answers a probe with one
    line, and in ``-lms`` mode prints two samples every 50 ms until it is stopped."""
    script = directory / "nvidia-smi"
    script.write_text(FAKE_SMI.format(log=directory / "calls.log", reject=reject, prelude=prelude))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def calls(directory) -> list[str]:
    return (directory / "calls.log").read_text().splitlines()


def wait_for(condition, deadline_s: float = 10.0) -> None:
    """Poll until ``condition()`` (normally a few tens of milliseconds; the deadline only bounds a hang)."""
    give_up = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < give_up, "the fake sampler wrote nothing"
        time.sleep(0.02)


def test_the_sampler_falls_back_to_the_older_reasons_field(tmp_path):
    executable = write_fake_smi(tmp_path, reject="clocks_event_reasons")
    path = str(tmp_path / "clocks.csv")
    process, note = start_sampler(path, interval_ms=50, gpu_index=3, executable=executable)
    try:
        assert process is not None
        assert "clocks_throttle_reasons.active" in note and "clocks_event_reasons" not in note
        wait_for(lambda: len(read_samples(path)[0]) >= 2)
    finally:
        stop_sampler(process)
    assert process.returncode is not None
    samples, skipped = read_samples(path)
    assert skipped == 0 and [row["sm_mhz"] for row in samples[:2]] == [1755.0, 1980.0]
    assert samples[1]["power_w"] is None and samples[0]["reasons"] == 0x4
    assert calls(tmp_path)[:3] == [f"--query-gpu={EVENT_QUERY} --format=csv,noheader,nounits -i 3",
                                   f"--query-gpu={THROTTLE_QUERY} --format=csv,noheader,nounits -i 3",
                                   f"--query-gpu={THROTTLE_QUERY} --format=csv,noheader,nounits -i 3 -lms 50"]


def test_a_driver_that_knows_the_new_field_is_probed_once(tmp_path, monkeypatch):
    write_fake_smi(tmp_path, reject="kda-accepts-everything")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")  # found by name, as on a GPU host
    path = str(tmp_path / "clocks.csv")
    process, note = start_sampler(path)
    try:
        assert process is not None and "clocks_event_reasons.active" in note
        wait_for(lambda: len(read_samples(path)[0]) >= 1)
    finally:
        stop_sampler(process)
    assert process.returncode == -signal.SIGTERM
    assert calls(tmp_path)[:2] == [f"--query-gpu={EVENT_QUERY} --format=csv,noheader,nounits -i 0",
                                   f"--query-gpu={EVENT_QUERY} --format=csv,noheader,nounits -i 0 -lms 200"]


def test_a_driver_that_rejects_both_fields_gives_no_sampler_and_says_why(tmp_path):
    executable = write_fake_smi(tmp_path, reject="clocks_")
    process, note = start_sampler(str(tmp_path / "clocks.csv"), executable=executable)
    assert process is None
    assert "exit 2" in note and "not a valid field" in note
    assert len(calls(tmp_path)) == 2 and not any("-lms" in call for call in calls(tmp_path))


def test_stopping_kills_a_sampler_that_ignores_terminate(tmp_path, monkeypatch):
    ready = tmp_path / "ignoring-term"
    executable = write_fake_smi(tmp_path, reject="kda-accepts-everything", prelude=f"trap '' TERM; touch {ready}")
    monkeypatch.setattr(gpu_clocks, "STOP_TIMEOUT_S", 0.2)
    process, _ = start_sampler(str(tmp_path / "clocks.csv"), interval_ms=50, executable=executable)
    try:
        wait_for(ready.exists)
    finally:
        stop_sampler(process)
    assert process.returncode == -signal.SIGKILL


def test_stopping_no_sampler_does_nothing():
    stop_sampler(None)
