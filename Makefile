# Two commands do everything: `make train` and `make test`. Each creates .venv on
# first use and installs the project with pinned versions (see pyproject.toml).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ARGS   ?=
PYTEST_ARGS ?=
# Tests run on two pytest-xdist workers (CI has 2 cores; one pytest process keeps about one busy): a file, or the
# files sharing a session fixture (tests/conftest.py), stays on one worker. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2

.PHONY: setup train test test-all slurm-setup sample benchmark gpu-check gpu-wheels ablation ablation-seeds study precision example example-buckets example-video clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

train: $(STAMP)
	$(BIN)/python train.py $(ARGS)

# make test (what CI runs, .ci/run) leaves out the tests marked `slurm` (a real local SLURM cluster: root, an apt
# install and about 3 minutes); make test-all installs the cluster where it can and runs every test (docs/tests.md).
TEST_MARKS ?= not slurm
# The project's bytecode is compiled first: with PYTHONDONTWRITEBYTECODE set (as on CI) every program a test starts
# would compile tread/ again (about 0.5 s a launch; the suite starts a few hundred).
test: $(STAMP)
	$(BIN)/python -m compileall -q -j 0 tread tests scripts $(wildcard *.py) >/dev/null
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup $(if $(TEST_MARKS),-m "$(TEST_MARKS)") $(PYTEST_ARGS)

test-all: $(STAMP) slurm-setup
	$(MAKE) test TEST_MARKS=

# slurm-wlm and munge from Debian for tests/test_slurm.py, quietly and never fatal: without them (or without root)
# those tests skip and say why.
slurm-setup:
	@if ! command -v slurmctld >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    timeout 900 bash scripts/slurm_cluster.sh install >/tmp/slurm-install.log 2>&1 \
	      || echo "slurm-setup: could not install slurm-wlm and munge (log: /tmp/slurm-install.log); the SLURM tests will skip" >&2; \
	  else echo "slurm-setup: slurm-wlm/munge missing and not installable (needs root and apt-get); the SLURM tests will skip" >&2; fi; \
	fi

sample: $(STAMP)
	$(BIN)/python sample.py $(ARGS)

benchmark: $(STAMP)
	$(BIN)/python scripts/benchmark.py $(ARGS)

# The GPU figures (docs/benchmarks.md) on a bare GPU machine with its own torch: no venv (the registry may be out of
# reach there), the repo on PYTHONPATH, missing dependencies from WHEELS (made here by `make gpu-wheels`), the paper
# code from PAPER_DIR when set. Within its 480 s budget (ARGS="--budget S"); the report lands in
# outputs/gpu_check/report.md.
GPU_PYTHON ?= python3
WHEELS ?= .whl
gpu-check:
	PYTHONPATH=$(CURDIR):$$PYTHONPATH $(GPU_PYTHON) scripts/gpu_check.py --wheels $(WHEELS) \
		$(if $(PAPER_DIR),--paper-dir $(PAPER_DIR)) $(ARGS)

gpu-wheels: $(STAMP)
	$(BIN)/python scripts/gpu_check.py --download-wheels $(WHEELS)

# One training run per input line "NAME SEED OVERRIDES...", two at a time with one thread each (the conditions the
# grids' step counts were planned under), each into DIR/NAME/SEED with its console output appended to stdout.log there; a run
# whose summary.json says completed is skipped and one that was stopped resumes from its last checkpoint (resume=auto;
# a fresh directory starts fresh), so an interrupted grid continues where it stopped.
RUN_GRID = OMP_NUM_THREADS=1 xargs -P 2 -L 1 sh -c 'd=$(1)/$$0/$$1; s=$$1; shift; mkdir -p $$d; \
  grep -qs "\"status\": \"completed\"" $$d/summary.json || \
  $(BIN)/python train.py "$$@" train.seed=$$s hydra.run.dir=$$d resume=auto $(ARGS) >> $$d/stdout.log 2>&1'

# The worked result of docs/ablations.md: the selection-ratio sweep under equal training-time budgets (~30 min on a
# 2-core CPU), then its table and plots into docs/ablation/ and the block of docs/ablations.md they fill.
ABLATION_DIR ?= outputs/ablation/toy_ratio
ablation: $(STAMP)
	$(BIN)/python train.py -m experiment=toy_ratio_ablation hydra.sweep.dir=$(ABLATION_DIR) $(ARGS)
	$(BIN)/python scripts/ablation_report.py $(ABLATION_DIR) --out docs/ablation --readme docs/ablations.md

# Error bars for that result: each ratio at its equal-time step count (fixed steps: bit-reproducible at one thread)
# over seeds 0-4, two runs at once with one thread each (20 runs: 70 min to 2 h 20 min on a 2-core CPU), then the
# seed-grouped report (each ratio against ratio 0, paired over seeds, Holm) into docs/ablation/seeds/.
SEEDS_DIR ?= outputs/ablation/toy_ratio_seeds
SEEDS_RATIOS := 0:858 0.25:1004 0.5:1242 0.75:1444
ablation-seeds: $(STAMP)
	for s in 0 1 2 3 4; do for rs in $(SEEDS_RATIOS); do echo ratio_$${rs%%:*} $$s experiment=toy_ratio_seeds \
	  routing.routes.0.selection_ratio=$${rs%%:*} train.max_steps=$${rs##*:}; done; done | $(call RUN_GRID,$(SEEDS_DIR))
	$(BIN)/python scripts/ablation_report.py $(SEEDS_DIR) --out docs/ablation/seeds --readme docs/ablations.md --marker seeds

# The research-modes study of docs/research.md: dense, TREAD, TREAD + dense fine-tuning, REPA + TREAD with the toy
# encoder and its two controls (an untrained encoder; the FID network itself) and SPRINT, seeds 0-4, each run with
# one thread, two runs at once (the conditions its step counts were planned under); every metric is read at equal
# measured training time and at equal FLOPs, interpolated between each run's two evaluations; the declared
# family (each mode against its baseline) is paired over seeds and Holm-corrected. A completed run is skipped, so
# an interrupted study continues. ~70 min on the quiet 2-core CPU; then the report into docs/research/.
STUDY_DIR ?= outputs/study
STUDY_ARMS := dense tread tread_ft repa repa_random repa_fid sprint
STUDY_SEEDS := 0 1 2 3 4
STUDY_COMPARE := tread:dense tread_ft:tread repa:tread repa_random:tread repa_fid:tread sprint:dense
study: $(STAMP)
	for s in $(STUDY_SEEDS); do for m in $(STUDY_ARMS); do echo $$m $$s experiment=study_$$m; done; done | \
	  $(call RUN_GRID,$(STUDY_DIR))
	$(BIN)/python scripts/ablation_report.py $(STUDY_DIR) --out docs/research --readme docs/research.md --marker study \
	  --at-time auto --at-flops auto --metric fd_ae --metric class_acc --metric shape_acc \
	  --metric colour_acc $(foreach c,$(STUDY_COMPARE),--compare study_$(subst :,:study_,$(c)))

# bf16 autocast against fp32 on the default run (docs/benchmarks.md, "Precision per device"): experiment=toy at seeds
# 0, 1, 2 in each precision (~60 min on a 2-core CPU with native bf16; the published figures: OMP_NUM_THREADS=1, the
# two precisions as two multiruns side by side), then the seed-grouped report into docs/precision/.
PRECISION_DIR ?= outputs/precision
precision: $(STAMP)
	$(BIN)/python train.py -m experiment=toy train.mixed_precision=no,bf16 train.seed=0,1,2 \
	  hydra.sweep.dir=$(PRECISION_DIR) $(ARGS)
	$(BIN)/python scripts/ablation_report.py $(PRECISION_DIR) --out docs/precision --readme docs/benchmarks.md --marker precision

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

# The bucketed loop of docs/buckets.md ("Worked example"), offline on a CPU: toy shapes as PNGs of three aspect ratios
# at two sizes with caption files -> precompute with buckets (a tiny fitted VAE, tiny FLUX text encoders) -> a LoRA
# with routing on a tiny FLUX, one bucket per batch -> validation images at every bucket -> the exported adapter in
# diffusers' FluxPipeline. The VAE and the encoders are written once under .cache.
BUCKETS_DIR := outputs/example/buckets_$(shell date +%Y%m%d-%H%M%S)
BUCKETS_VAE := .cache/tiny_vae
BUCKETS_SIZES := 32x32,48x32,32x48,64x64,96x64,64x96
example-buckets: $(STAMP)
	test -f $(EXAMPLE_ENCODERS)/model_index.json || $(BIN)/python scripts/tiny_text_encoders.py flux $(EXAMPLE_ENCODERS)
	test -f $(BUCKETS_VAE)/config.json || $(BIN)/python scripts/tiny_vae.py $(BUCKETS_VAE) --steps 300
	$(BIN)/python scripts/toy_images.py $(BUCKETS_DIR)/images --sizes $(BUCKETS_SIZES) --per-class 24
	$(BIN)/python scripts/precompute_latents.py --images $(BUCKETS_DIR)/images --out $(BUCKETS_DIR)/latents \
	  --vae $(BUCKETS_VAE) --buckets $(BUCKETS_SIZES) --bucket-stride 4 --caption-sidecars --text-family flux \
	  --text-encoders $(EXAMPLE_ENCODERS) --max-text-length 16 --device cpu --workers 0
	$(BIN)/python train.py experiment=flux_buckets data.path=$(abspath $(BUCKETS_DIR))/latents \
	  model.text_encoders=$(abspath $(EXAMPLE_ENCODERS)) hydra.run.dir=$(BUCKETS_DIR)/run $(ARGS)
	$(BIN)/python scripts/diffusers_pipeline.py $(BUCKETS_DIR)/run --prompts $(EXAMPLE_PROMPTS)

# The video loop of docs/video.md ("Worked example"), offline on a CPU: moving toy shapes as clips (mp4, GIF and frame
# folders) of two aspect ratios and two lengths with caption files -> precompute with frame buckets (a tiny fitted
# Wan VAE, tiny umT5 encoders) -> a Wan LoRA with routing, one bucket per batch -> validation videos -> the exported
# adapter in diffusers' WanPipeline. The VAE (fitted once, a few minutes) and the encoders are written under .cache.
VIDEO_DIR := outputs/example/video_$(shell date +%Y%m%d-%H%M%S)
VIDEO_VAE := .cache/tiny_video_vae
VIDEO_ENCODERS := .cache/tiny_text_encoders/wan
VIDEO_SIZES := 32x32,48x32,32x48
VIDEO_PROMPTS := "a red disc moving right" "a blue triangle moving down"
example-video: $(STAMP)
	test -f $(VIDEO_ENCODERS)/model_index.json || $(BIN)/python scripts/tiny_text_encoders.py wan $(VIDEO_ENCODERS)
	test -f $(VIDEO_VAE)/config.json || OMP_NUM_THREADS=1 $(BIN)/python scripts/tiny_video_vae.py $(VIDEO_VAE) --steps 1000
	$(BIN)/python scripts/toy_clips.py $(VIDEO_DIR)/clips --sizes $(VIDEO_SIZES) --frames 5,9 --per-class 12
	$(BIN)/python scripts/precompute_latents.py --videos $(VIDEO_DIR)/clips --out $(VIDEO_DIR)/latents \
	  --vae $(VIDEO_VAE) --frame-buckets 5,9 --buckets $(VIDEO_SIZES) --bucket-stride 4 --caption-sidecars \
	  --text-family wan --text-encoders $(VIDEO_ENCODERS) --max-text-length 16 --device cpu --workers 0
	$(BIN)/python train.py experiment=wan_clips data.path=$(abspath $(VIDEO_DIR))/latents \
	  model.text_encoders=$(abspath $(VIDEO_ENCODERS)) hydra.run.dir=$(VIDEO_DIR)/run $(ARGS)
	$(BIN)/python scripts/diffusers_pipeline.py $(VIDEO_DIR)/run --prompts $(VIDEO_PROMPTS)

clean:
	rm -rf $(VENV) .cache .pytest_cache
