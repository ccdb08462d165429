# Two commands do everything: `make train` and `make test`. Each creates .venv on
# first use and installs the project with pinned versions (see pyproject.toml).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ARGS   ?=
PYTEST_ARGS ?=

.PHONY: setup train test sample benchmark ablation clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

train: $(STAMP)
	$(BIN)/python train.py $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

sample: $(STAMP)
	$(BIN)/python sample.py $(ARGS)

benchmark: $(STAMP)
	$(BIN)/python scripts/benchmark.py $(ARGS)

# The worked result of docs/ablations.md: the selection-ratio sweep under equal training-time budgets (~30 min on a
# 2-core CPU), then its table and plots into docs/ablation/ and the block of docs/ablations.md they fill.
ABLATION_DIR ?= outputs/ablation/toy_ratio
ablation: $(STAMP)
	$(BIN)/python train.py -m experiment=toy_ratio_ablation hydra.sweep.dir=$(ABLATION_DIR) $(ARGS)
	$(BIN)/python scripts/ablation_report.py $(ABLATION_DIR) --out docs/ablation --readme docs/ablations.md

clean:
	rm -rf $(VENV) .cache .pytest_cache
