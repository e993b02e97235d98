# Two entry points: `make serve` runs the server on the embedded model, `make test` runs the suite.
# Both create .venv in the repo root on first use and reuse it afterwards.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

.PHONY: serve test install

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q torch==$(TORCH_VERSION)
	$(VENV)/bin/python -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/python -m deployments.serve_main serve_config.yaml

# The tests that need no Ray on two workers, then the Ray/Serve tests alone, one at a time
# (tests/conftest.py marks them); fails if either run fails.
test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n 2 -m "not ray" tests; first=$$?; \
	$(VENV)/bin/python -m pytest -q -m ray tests; second=$$?; \
	test $$first = 0 && test $$second = 0
