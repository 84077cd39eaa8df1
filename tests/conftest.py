"""Shared test options and checks.

- GPU-only tests run with ``--run-gpu`` (the H200 script passes it); without it they are skipped.
- vLLM is part of the test environment: a session that cannot find it stops at once with one message
  (``vllm_stack.import_vllm`` turns a broken import into the same message per test); skips are kept only
  for absent hardware.
- The closing summary names every skip reason with its count, so a skipped group cannot pass unseen.
- On the CPU the state-copy kernels run under the Triton interpreter: ``TRITON_INTERPRET=1`` is set here,
  before any test module imports triton, so ``pytest tests -k kimi`` run directly answers like ``make test``
  (Triton reads it when a kernel is defined; a module collected first must not define them compiled).
- Tests that start real vLLM engines use the ``fast_exit`` fixture (or put ``tests/fast_exit`` on the children's
  ``PYTHONPATH`` themselves): vLLM's spawned processes skip the seconds of interpreter teardown after their work.
- Under pytest-xdist (``make test`` runs ``-n 2 --dist loadfile``) files are the unit and the files of the tests
  that start a real vLLM engine (marked ``engine``) are one unit, so one worker runs them one after another
  and two engines never compete for the machine's cores (``xdist_scheduling.py``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections import Counter

# xdist workers do not see the controller's argv: the controller's choice reaches them through the environment.
if "--run-gpu" in sys.argv:
    os.environ["KDA_TESTS_RUN_GPU"] = "1"
if os.environ.get("KDA_TESTS_RUN_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import durations_by_directory
import pytest
import vllm_stack
import xdist_scheduling

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fast_exit"))
import kda_test_fast_exit


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-gpu", action="store_true", default=False,
                     help="run tests marked 'gpu' (compiled Triton on a CUDA device)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device; runs only with --run-gpu")
    config.addinivalue_line("markers", "engine: starts a real vLLM engine (slow; in an xdist engine unit)")
    config.addinivalue_line("markers", "slow: minutes of fresh processes or compiles; not in `make test-fast`")
    config.addinivalue_line("markers", "alias_mechanism: the test is about the routed alias's own objects; "
                            "it runs under KDA_PATCHES_ROUTING=alias only")
    config.addinivalue_line("markers", "rewrite_mechanism: the test is about the rewritten twin; "
                            "it runs under KDA_PATCHES_ROUTING=rewrite only")
    config.addinivalue_line("markers", "both_mechanisms: runs under both mechanisms (overrides a module's mark)")
    vllm_stack.GPU_RUN = config.getoption("--run-gpu")
    binding = xdist_scheduling.engine_core_binding(os.environ.get("PYTEST_XDIST_WORKER"), os.cpu_count())
    if binding is not None:  # this worker's engines compute on its own core (a test may still set its own)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", binding)
    # find_spec, not an import: importing vLLM costs seconds and must not happen in every pytest process
    # before the tests that register post-import hooks on its modules.
    if not vllm_stack.GPU_RUN and importlib.util.find_spec("vllm") is None:
        raise pytest.UsageError(vllm_stack.MISSING.format(error="no module named 'vllm'"))


# Left out of `make test-fast` (marked ``slow`` here): fresh-process A/B pairs of released code and of the
# reference workload (tens of seconds each under the interpreter), the Ascend compile check (minutes), and the
# vLLM 0.13 suite in its second environment (which `make test-fast` does not build).
SLOW = ("tests/released/", "tests/ascend_check/test_ascend_compile.py",
        "tests/kimi/test_kimi_prefill_exactness.py::test_fresh_process_ab_of_the_reference_workload",
        "tests/kv_layout/test_vllm013_env.py::test_vllm013_suite_passes_in_second_environment")


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which the GPU machine may lack
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``--dist loadfile`` (``make test``): whole files, the engine files as one unit (``xdist_scheduling``)."""
    if config.getoption("dist", "no") != "loadfile":
        return None
    return xdist_scheduling.make_scheduler(config, log)


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by the marks added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    stray = sorted({item.nodeid.split("::", 1)[0] for item in items if "engine" in item.keywords}
                   - xdist_scheduling.ENGINE_FILES)
    if stray:
        raise pytest.UsageError(f"tests marked engine outside xdist_scheduling.ENGINE_FILES: {', '.join(stray)}")
    for item in items:
        if item.nodeid.startswith(SLOW):
            item.add_marker(pytest.mark.slow)
    if hasattr(config, "workerinput"):  # an xdist worker: the engine units first in the queue, so they start at once
        items.sort(key=lambda item: xdist_scheduling.queue_position(item.nodeid))
    if config.getoption("--run-gpu"):
        return
    skip_gpu = pytest.mark.skip(reason="GPU test: run with --run-gpu on a CUDA machine (make gpu-check)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def skip_reason(report: pytest.TestReport) -> str:
    """Return the reason text of a skipped report (``longrepr`` is ``(path, line, 'Skipped: reason')``)."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config):
    """After every other summary: the test time per directory (with ``--durations``), then one line naming each
    skip reason with its count, just above the totals."""
    yield
    reports = [report for report in terminalreporter.stats.get("skipped", []) if report.skipped]
    counts = Counter(skip_reason(report) for report in reports)
    rendered = "; ".join(f"{count} x {reason}" for reason, count in sorted(counts.items())) or "none"
    if config.getoption("durations", None) is not None:  # make test asks for --durations: per directory too
        # every phase's report, wherever the reporter filed it (passed setups and teardowns are under "")
        timed = [report for reports in terminalreporter.stats.values() for report in reports
                 if hasattr(report, "duration") and hasattr(report, "when")]
        terminalreporter.write_line("test time per directory:")
        for line in durations_by_directory.format_totals(durations_by_directory.directory_totals(timed)):
            terminalreporter.write_line(line)
    terminalreporter.write_line(f"skips ({len(reports)}): {rendered}")


@pytest.fixture
def fast_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The processes this test starts put ``tests/fast_exit`` first on ``PYTHONPATH``: their spawned children
    (vLLM's engine core and workers) end without the interpreter teardown, with the same exit code
    (``kda_test_fast_exit``)."""
    monkeypatch.setenv("PYTHONPATH", kda_test_fast_exit.with_fast_exit(dict(os.environ))["PYTHONPATH"])


@pytest.fixture
def strict(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the test as under ``KDA_PATCHES_STRICT=1`` (bypassed calls raise); the routing mechanism is kept."""
    import kda_patches
    from kda_patches.flags import Flags

    current = kda_patches._FLAGS
    monkeypatch.setattr(kda_patches, "_FLAGS", Flags(strict=True, routing=current.routing if current else "rewrite"))


@pytest.fixture
def lenient(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the test without STRICT (bypassed calls are counted, not raised), whatever the environment says."""
    import kda_patches
    from kda_patches.flags import Flags

    current = kda_patches._FLAGS
    monkeypatch.setattr(kda_patches, "_FLAGS", Flags(strict=False, routing=current.routing if current else "rewrite"))


MECHANISMS = ("rewrite", "alias")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test that uses ``routing`` runs under both mechanisms, unless it is marked as about one of them (the
    closest mark wins: a test's own mark over its module's). The routing suite uses it in every test."""
    if "routing" not in metafunc.fixturenames:
        return
    choices = {"alias_mechanism": ("alias",), "rewrite_mechanism": ("rewrite",), "both_mechanisms": MECHANISMS}
    closest = next((mark.name for mark in metafunc.definition.iter_markers() if mark.name in choices), None)
    metafunc.parametrize("routing", choices.get(closest, MECHANISMS), indirect=True)


@pytest.fixture
def routing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Set ``KDA_PATCHES_ROUTING`` for the test (read when a seam is wrapped, i.e. when the dummies load);
    the ``strict`` / ``lenient`` fixtures keep it."""
    import kda_patches
    from kda_patches.flags import Flags

    mechanism = getattr(request, "param", "rewrite")
    current = kda_patches._FLAGS
    monkeypatch.setattr(kda_patches, "_FLAGS", Flags(strict=bool(current and current.strict), routing=mechanism))
    return mechanism
