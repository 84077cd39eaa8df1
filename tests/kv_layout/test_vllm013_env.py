"""Runs the real vLLM 0.13.0 tests (``tests/kv_layout/v013``) inside the second environment ``.venv013``.

``make test`` builds that environment first (``make setup-vllm013``); without it this test fails, never skips.
"""

from __future__ import annotations

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYTHON013 = os.path.join(ROOT, os.environ.get("VENV013", ".venv013"), "bin", "python")


def test_vllm013_suite_passes_in_second_environment() -> None:
    assert os.path.exists(PYTHON013), (f"{PYTHON013} is missing: run `make setup-vllm013` (vLLM 0.13.0 second "
                                       "environment, docs/vllm013-env.md)")
    env = {key: value for key, value in os.environ.items() if not key.startswith("KDA_PATCHES")}
    env["KDA_TEST_VLLM013"] = "1"
    version = subprocess.run([PYTHON013, "-c", "import vllm; print(vllm.__version__)"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=300)
    assert version.stdout.strip().splitlines()[-1:] == ["0.13.0"], version.stdout + version.stderr
    result = subprocess.run([PYTHON013, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kv_layout/v013"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
    assert " passed" in result.stdout and " failed" not in result.stdout
