# Two entry points (see README): `make demo` runs the main job, `make test` runs the tests.
# Both create the virtual environment and install the project on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test,hf,eval,bench]'
	touch $(STAMP)

# `make demo MIXERS=gla,hgrn,mamba` sweeps other mixers than the demo's MetaLA, GLA and attention;
# `make demo EXPERIMENT=lm_demo` runs language modelling on the real prose corpus instead of MQAR.
# PARALLEL: runs at a time, each on cores / PARALLEL torch threads (on 2 cores: two one-thread runs).
MIXERS ?=
EXPERIMENT ?= mqar_demo
PARALLEL ?= 2

.PHONY: install test demo bench reports
install: $(STAMP)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -n 2 --dist worksteal -q

demo: $(STAMP)
	$(VENV)/bin/lcsm sweep experiments/$(EXPERIMENT).yaml --report --parallel $(PARALLEL) $(if $(MIXERS),--grid model.mixer=$(MIXERS))

bench: $(STAMP)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[bench]'
	$(VENV)/bin/lcsm bench ops

# The reports of results/ regenerated from the cached runs there (no training): every experiment
# file of the paper experiments and the top-level ones but the demos (whose runs go to runs/), each
# read from and written to results/<experiment name>/.
# experiments/gpu/ holds plans for a GPU loan (experiments/gpu/loan.sh) and experiments/planned/
# CPU experiments fixed before their runs: not yet run.
PAPER_EXPERIMENTS := $(filter-out experiments/configs/% experiments/gpu/% experiments/planned/% %base.yaml,$(wildcard experiments/*/*.yaml)) \
	$(filter-out %_demo.yaml,$(wildcard experiments/*.yaml))

reports: $(STAMP)
	$(VENV)/bin/lcsm report $(PAPER_EXPERIMENTS) --out results
