# The two commands a fresh machine needs:  `make up`  (install, then serve the demo)
#                                          `make test` (install with test extras, then lint and test)
# Options for `lorafleet up` go in ARGS, e.g. `make up ARGS="--port 8001"`; for pytest in PYTEST_ARGS.
# CI also runs `make deploy-test`: the compose stack built and run under podman (deploy/README.md).
VENV ?= .venv
# torch 2.13.0 resolves to the CPU wheel on the CI machines; on a GPU host, override with the
# CUDA build you want, e.g. `make up TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu130"`.
TORCH ?= torch==2.13.0
# not --quiet: a first install takes minutes (mostly torch), and pip's lines show it going on
PIP := $(VENV)/bin/python -m pip install

$(VENV)/bin/python:
	python3 -m venv $(VENV)

$(VENV)/.installed-run: pyproject.toml | $(VENV)/bin/python
	@echo "installing lorafleet and torch into $(VENV) (a few minutes the first time)"
	$(PIP) $(TORCH)
	$(PIP) -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.installed-run
	@echo "installing the test extras into $(VENV)"
	$(PIP) -e ".[test]"
	touch $@

# podman-compose for deploy-test (podman itself comes from Debian: deploy/ci/setup-podman.sh)
$(VENV)/.installed-deploy: $(VENV)/.installed-test
	$(PIP) podman-compose==1.6.0
	touch $@

.PHONY: up test deploy-test
up: $(VENV)/.installed-run
	$(VENV)/bin/lorafleet up $(ARGS)

# two pytest-xdist workers, each given half the suite (worksteal): tests/conftest.py puts the tests that start
# processes first and lets one module of them run at a time, so one worker runs those while the other runs
# the in-process tests on the core they leave idle. PYTEST_ARGS="-n 0" runs it in one process (on a GPU host,
# so that no two GPU tests share the GPU's memory).
test: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -q -n 2 --dist worksteal --durations=15 $(PYTEST_ARGS)

deploy-test: $(VENV)/.installed-deploy
	VENV=$(VENV) TORCH="$(TORCH)" deploy/ci/stack-test.sh
