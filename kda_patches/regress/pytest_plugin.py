"""pytest plugin (``pytest11`` entry point): the ``kda_ab`` fixture runs a patched/unpatched A/B.

In a test::

    def test_my_workload(kda_ab):
        report = kda_ab("mypkg.workloads:serve_small", params={"steps": 4}, rtol=1e-3)
        assert report.comparison.equal   # kda_ab already fails the test on a difference

``kda_ab(workload, ...)`` takes a registered workload name, a ``module:function`` string or an
importable function object; it runs the workload in two fresh interpreters (``KDA_PATCHES=0``,
then ``KDA_PATCHES=1`` with ``KDA_PATCHES_STRICT=1``) and fails the test with the full report
(first difference, wall times, every process's ledger) unless the outputs are equal and every
expectation is met. Options: ``--kda-baseline-dir DIR`` (or the ``kda_baseline_dir`` ini value)
stores/reuses baselines; ``--kda-update-baseline`` re-records them. Importing this plugin imports
neither torch nor vLLM.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    """Register ``--kda-update-baseline``, ``--kda-baseline-dir`` and the ``kda_baseline_dir`` ini value."""
    group = parser.getgroup("kda-patches", "kda_patches A/B regression")
    group.addoption("--kda-update-baseline", action="store_true", default=False,
                    help="kda_ab: run unpatched and overwrite the stored baselines")
    group.addoption("--kda-baseline-dir", default=None,
                    help="kda_ab: baseline store (default: the kda_baseline_dir ini value, else none)")
    parser.addini("kda_baseline_dir", "kda_ab: baseline store, relative to the rootdir", default="")


def workload_spec(workload: str | Callable[..., Any]) -> str:
    """Return the ``name`` or ``module:qualname`` that names ``workload`` in a fresh interpreter.

    Raises:
        ValueError: a function that cannot be imported by name (lambda, nested, ``__main__``).
    """
    if isinstance(workload, str):
        return workload
    module, qualname = getattr(workload, "__module__", None), getattr(workload, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname:
        raise ValueError(f"kda_ab needs an importable module-level function, got {workload!r}; "
                         "pass 'module:function' instead")
    return f"{module}:{qualname}"


def import_paths(config: pytest.Config, test_path: str) -> tuple[str, ...]:
    """Return the directories the runs need to import test-local workloads: the test's dir, the
    rootdir, and every ``sys.path`` entry inside the rootdir (pytest's own insertions)."""
    root = str(config.rootpath)
    paths = [os.path.dirname(test_path), root]
    paths += [entry for entry in sys.path if entry and os.path.abspath(entry).startswith(root + os.sep)]
    return tuple(dict.fromkeys(os.path.abspath(p) for p in paths))


class KdaAB:
    """The ``kda_ab`` fixture's value: call it to run one A/B (see the module docstring)."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self._request = request
        config = request.config
        configured = config.getoption("--kda-baseline-dir") or config.getini("kda_baseline_dir")
        self.baseline_dir = str(config.rootpath / configured) if configured else None
        self.update_baseline = bool(config.getoption("--kda-update-baseline"))

    def __call__(self, workload: str | Callable[..., Any], params: dict[str, Any] | None = None, *,
                 baseline_dir: str | os.PathLike[str] | None = None, rtol: float = 0.0, atol: float = 0.0,
                 expect: tuple[str, ...] | None = None, cache_dir: str | None = None,
                 timeout_s: float | None = None, pythonpath: tuple[str, ...] = (), check: bool = True) -> Any:
        """Run the A/B and return the :class:`~kda_patches.regress.runner.ABReport`.

        Args:
            workload: registered name, ``module:function`` or an importable function.
            params: keyword parameters of the workload (JSON-able).
            baseline_dir: baseline store for this call (overrides the option / ini value).
            rtol, atol: float tolerances (integers are always exact).
            expect: ``patch:counter`` requirements (default: the registered workload's, else none).
            cache_dir: passed to workloads that accept ``cache_dir``.
            timeout_s: per-run limit.
            pythonpath: extra import directories for the runs.
            check: fail the test (with the report) unless equal and every expectation is met.
        """
        from kda_patches.regress.report import format_report
        from kda_patches.regress.runner import run_ab
        from kda_patches.regress.workloads import resolve_workload

        resolved = resolve_workload(workload_spec(workload))
        store = str(baseline_dir) if baseline_dir is not None else self.baseline_dir
        paths = tuple(pythonpath) + import_paths(self._request.config, str(self._request.path))
        report = run_ab(resolved, params, cache_dir=cache_dir, baseline_dir=store,
                        update_baseline=self.update_baseline and store is not None, rtol=rtol, atol=atol,
                        expect=expect, timeout_s=timeout_s, pythonpath=paths)
        self._request.node.user_properties.append(("kda_ab", f"{resolved.name}: {report.verdict}"))
        if check and report.exit_code != 0:
            pytest.fail(format_report(report), pytrace=False)
        return report


@pytest.fixture
def kda_ab(request: pytest.FixtureRequest) -> KdaAB:
    """Run a workload unpatched and patched in fresh processes and compare (see :class:`KdaAB`)."""
    return KdaAB(request)
