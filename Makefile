# Two commands do everything: `make train` and `make test`. Each creates .venv on
# first use and installs the project with pinned versions (see pyproject.toml).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ARGS   ?=
PYTEST_ARGS ?=

.PHONY: setup train test sample benchmark ablation example clean

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

# The practitioner's loop of docs/families.md ("Worked example"), offline on a CPU: text data -> LoKr over an
# int8-quantized tiny FLUX with routing -> captioned validation grids -> sample.py from prompts -> the exported
# adapter in diffusers' FluxPipeline. Tiny random text encoders stand in for FLUX's (written once).
EXAMPLE_DIR := outputs/example/flux_adapter_$(shell date +%Y%m%d-%H%M%S)
EXAMPLE_ENCODERS := .cache/tiny_text_encoders/flux
EXAMPLE_PROMPTS := "a red disc" "a blue triangle" "a yellow ring" "a lime X"
example: $(STAMP)
	test -f $(EXAMPLE_ENCODERS)/model_index.json || $(BIN)/python scripts/tiny_text_encoders.py flux $(EXAMPLE_ENCODERS)
	$(BIN)/python train.py experiment=flux_adapter model.text_encoders=$(abspath $(EXAMPLE_ENCODERS)) hydra.run.dir=$(EXAMPLE_DIR) $(ARGS)
	$(BIN)/python sample.py checkpoint=$(EXAMPLE_DIR) 'prompts=[a red disc, a blue triangle, a yellow ring, a lime X]' num_samples=4
	$(BIN)/python scripts/diffusers_pipeline.py $(EXAMPLE_DIR) --prompts $(EXAMPLE_PROMPTS)

clean:
	rm -rf $(VENV) .cache .pytest_cache
