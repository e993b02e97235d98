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

# Two workers: the Ray/Serve tests on one (one Ray instance, fixed ports), the rest on the
# other (tests/conftest.py groups them).
test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadgroup tests
