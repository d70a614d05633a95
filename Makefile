# The two commands a user needs: `make run` and `make test`. Both build .venv from nothing when it is missing.
PY := .venv/bin/python
VENV_STAMP := .venv/.installed

.PHONY: run test test-all bench clean-venv

$(VENV_STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(VENV_STAMP)

run: $(VENV_STAMP)
	.venv/bin/opd run configs/tiny.yaml

test: $(VENV_STAMP)
	$(PY) -m pytest

test-all: $(VENV_STAMP)
	$(PY) -m pytest -m 'not gpu'

bench: $(VENV_STAMP)
	$(PY) bench/decode.py
	$(PY) bench/replay.py
	$(PY) bench/pipeline.py

clean-venv:
	rm -rf .venv
