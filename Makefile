# The two commands a user needs: `make run` and `make test`. Both build .venv from nothing when it is missing.
PY := .venv/bin/python
# torch comes from pip (`torch==2.13.0` is a local CPU wheel that only pip finds), the rest from uv, which keeps
# that torch and installs in seconds where pip takes a minute or two. Bytecode is compiled at install, on every
# core (pip compiles torch's 20,000 files on one), for everything pip put there: torch and its own dependencies
# (sympy, mpmath, jinja2, ...), which uv then leaves alone. torch ships one Python 3.12-only test file that cannot
# compile here, hence `|| true`.
# Every Ray actor, test worker and forked rank is a new interpreter that imports torch, transformers and this
# project. A machine that sets PYTHONDONTWRITEBYTECODE would have each of them compile every module without a .pyc
# again (sympy alone is hundreds), so the targets here write them (into .venv and the tree's __pycache__, both
# ignored by git).
unexport PYTHONDONTWRITEBYTECODE
UV := $(PY) -m uv pip install -q --python $(PY) --compile-bytecode
VENV_STAMP := .venv/.installed
DS_STAMP := .venv/.deepspeed
# The versions the tests passed on, which every install here is constrained to (`uv pip install -c`, `pip -c`):
# `make lock` writes it from a venv that passed, `make upgrade-check` tries the newest releases.
LOCK := requirements.lock

.PHONY: run test lint docs test-all bench lock gpu-stack-check vllm-env gpu-wheels upgrade-check clean-venv

$(VENV_STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --no-compile -c $(LOCK) torch==2.13.0 uv
	$(PY) -m compileall -q -j 0 .venv/lib/python3*/site-packages > /dev/null || true
	$(UV) -c $(LOCK) -e '.[dev,docs]'
	$(UV) -c $(LOCK) --no-deps dflash==0.1.0 speculators==0.9.0  # the interop extra without its pins (pyproject.toml)
	touch $(VENV_STAMP)

run: $(VENV_STAMP)
	.venv/bin/opd run configs/tiny.yaml

# The suite on both cores (pytest-xdist). loadfile: a module runs on one worker, so a module-scoped fixture (a Ray
# cluster, a model) is built once; without xdist's reordering by test count, the longest modules, which
# tests/conftest.py moves to the front, start first. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
PYTEST_XDIST = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# --durations: the slowest tests are printed on every run (CI's log included), so what grows is seen where it grows.
# lint runs beside the tests, not before them: its mypy and mkdocs take the CPU that the tests leave idle while Ray
# actors start and workers wait; its output is held in build/lint.log and shown after the tests, and either
# failing fails `make test`.
test: $(VENV_STAMP)
	@mkdir -p build; $(MAKE) --no-print-directory lint > build/lint.log 2>&1 & lint=$$!; \
	$(PY) -m pytest $(PYTEST_XDIST) --durations=25; tests=$$?; \
	wait $$lint; linted=$$?; cat build/lint.log; \
	[ $$linted -eq 0 ] || echo "make test: lint failed (its output is above)"; exit $$(( tests || linted ))

# What `make test` checks besides the tests, fastest first. ruff: lint on the whole tree, format only on the files
# in FORMATTED (adopted file by file: pyproject.toml's [tool.ruff.format]); mypy on MYPY_PATHS, every package of the
# project (each module must be clean); the docs with --strict, so a broken link, anchor or
# reference page fails (never -q: it hides the warnings that --strict counts).
FORMATTED := docs/hooks/reference.py
MYPY_PATHS := opd actors
DOCS_ENV := NO_MKDOCS_2_WARNING=1

lint: $(VENV_STAMP)
	.venv/bin/ruff check .
	.venv/bin/ruff format --check $(FORMATTED)
	.venv/bin/mypy $(MYPY_PATHS)
	$(DOCS_ENV) .venv/bin/mkdocs build --strict

docs: $(VENV_STAMP)
	$(DOCS_ENV) .venv/bin/mkdocs serve

# DeepSpeed's CPU build (no compiled ops) for tests/test_deepspeed.py; only test-all installs it, so `make test`
# stays as light as before.
$(DS_STAMP): $(VENV_STAMP)
	DS_BUILD_OPS=0 $(PY) -m pip install -q -c $(LOCK) -e '.[dev,deepspeed]'
	touch $(DS_STAMP)

test-all: $(DS_STAMP)
	$(PY) -m pytest $(PYTEST_XDIST) -m 'not gpu'

bench: $(VENV_STAMP)
	$(PY) bench/decode.py
	$(PY) bench/replay.py
	$(PY) bench/pipeline.py

# The two locks. requirements.lock, the trainer's: the venv `make test` passed in, every installed version but torch
# (the local CPU wheel, pinned above and by the `gpu` extra), pip and the project itself. cluster/vllm.lock, the vLLM
# environment's (resources.vllm_python): cluster/vllm.in resolved for the cluster image (Linux x86_64, Python
# 3.11), holding the packages both environments import at requirements.lock's versions.
lock: $(VENV_STAMP)
	{ echo "# The versions the tests passed on, written by \`make lock\` (uv pip freeze); every install is constrained to it."; \
	  $(PY) -m uv pip freeze --python $(PY) --exclude-editable --exclude torch --exclude pip; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)
	$(PY) cluster/check_gpu_stack.py --write

# Both locks still resolve for the cluster image and share their common packages' versions (seconds; .ci/run runs
# it). Only a conflict fails it: an index that cannot be reached is one note.
gpu-stack-check: $(VENV_STAMP)
	$(PY) cluster/check_gpu_stack.py

# The vLLM environment on a GPU machine outside the image (cluster/Dockerfile builds it at /opt/vllm): the vLLM lock,
# then this project without dependencies for its vLLM worker module; set resources.vllm_python to
# $(VLLM_ENV)/bin/python. It must be made from the same Python minor as .venv (Ray runs workers of one version).
VLLM_ENV ?= /opt/vllm
vllm-env:
	python3 -m venv $(VLLM_ENV)
	$(VLLM_ENV)/bin/pip install -q -r cluster/vllm.lock
	$(VLLM_ENV)/bin/pip install -q --no-deps -e .
	@echo "the vLLM environment is ready: set resources.vllm_python: $(VLLM_ENV)/bin/python"

# The wheels GPU first light needs beside the device image's own (Python 3.12, torch 2.11, transformers 5.17, no Ray):
# this project's tested transformers and what the trainer imports that the image lacks, for Python 3.12 on Linux
# x86_64, without their dependencies, into build/gpu-wheels (ignored by git). bench/gpu_first_light.sh installs
# them with --no-deps; bench/gpu_first_light.md says how to carry them.
GPU_WHEELS := build/gpu-wheels
gpu-wheels: $(VENV_STAMP)
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
	  --platform manylinux_2_17_x86_64 --platform any -d $(GPU_WHEELS) -c $(LOCK) \
	  transformers safetensors pydantic pydantic-core typing-inspection annotated-types typing-extensions \
	  pyyaml rich markdown-it-py mdurl pygments
	@du -sh $(GPU_WHEELS)

# The newest releases of every dependency, above the ranges in pyproject.toml (torch aside: it moves with the GPU
# stack's pins), in a scratch venv under build/upgrade, then every check `make test` runs. Prints what moved
# against the lock and which checks broke; build/upgrade/requirements.lock is the lock to adopt (with the ranges
# widened) once they all pass. Needs the package index.
UPGRADE := build/upgrade
UPY := $(UPGRADE)/venv/bin/python
UBIN := $(UPGRADE)/venv/bin
upgrade-check:
	rm -rf $(UPGRADE) && mkdir -p $(UPGRADE)
	python3 -m venv $(UPGRADE)/venv
	$(UPY) -m pip install -q --no-compile torch==2.13.0 uv
	$(UPY) -c 'import re, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
	  reqs = p["dependencies"] + [r for x in ("dev", "docs") for r in p["optional-dependencies"][x]]; \
	  names = {re.match(r"[A-Za-z0-9_.-]+(\[[^]]*\])?", r).group(0) for r in reqs}; \
	  print("\n".join(sorted(n for n in names if n != "torch")))' > $(UPGRADE)/unpinned.txt
	$(UPY) -m uv pip install -q --python $(UPY) --override $(UPGRADE)/unpinned.txt -e '.[dev,docs]'
	$(UPY) -m uv pip install -q --python $(UPY) --no-deps dflash
	$(UPY) -m uv pip freeze --python $(UPY) --exclude-editable --exclude torch --exclude pip > $(UPGRADE)/requirements.lock
	grep -v '^#' $(LOCK) > $(UPGRADE)/locked.txt
	@echo "moved against $(LOCK) (< locked, > newest):"
	@diff $(UPGRADE)/locked.txt $(UPGRADE)/requirements.lock | grep '^[<>]' || echo "  nothing"
	@broken=""; \
	$(UBIN)/ruff check . || broken="$$broken ruff"; \
	$(UBIN)/mypy $(MYPY_PATHS) || broken="$$broken mypy"; \
	$(DOCS_ENV) $(UBIN)/mkdocs build --strict --site-dir $(CURDIR)/$(UPGRADE)/site || broken="$$broken docs"; \
	$(UPY) -m pytest $(PYTEST_XDIST) || broken="$$broken tests"; \
	if [ -n "$$broken" ]; then echo "upgrade-check: broken on the newest releases:$$broken"; exit 1; fi; \
	echo "upgrade-check: every check passes on the newest releases"

clean-venv:
	rm -rf .venv
