# Every target builds the environment first; it is a no-op when .venv is up to date.
PY := .venv/bin/python
VENV_STAMP := .venv/.installed

.PHONY: demo test lint venv clean

$(VENV_STAMP): pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(VENV_STAMP)

venv: $(VENV_STAMP)

demo: $(VENV_STAMP)
	$(PY) -m raggedfsdp demo

lint: $(VENV_STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: lint
	$(PY) -m pytest -q tests

clean:
	rm -rf .venv build *.egg-info
