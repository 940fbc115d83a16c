# Two commands do all set-up on a fresh machine:
#   make demo   venv + install, then build -> generate wavs -> parity report on the tiny synthetic checkpoint
#   make test   venv + install, then the whole test suite (make test-fast: without the export tests)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export CI := 1
# Olive reads CI to switch its telemetry off before it starts (it hangs ~10 s at exit otherwise).

.PHONY: demo openvino-demo test test-fast coverage venv agents-venv lint clean

venv: $(STAMP)

# uv installs the pinned requirements (2 min with pip on 2 cores, under 1 min with uv, bytecode compiled as pip
# does). It reads no pip config, so pip's find-links (a local wheel folder, e.g. the CPU build of torch) is passed
# on; USE_PIP=1 installs with pip alone.
UV := uv==0.13.8
FIND_LINKS = $(or $(PIP_FIND_LINKS),$(shell $(PY) -m pip config get global.find-links 2>/dev/null))

$(STAMP): requirements.txt
	$(PY) -m venv $(VENV)
ifeq ($(USE_PIP),1)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements.txt
else
	$(BIN)/pip install -q --disable-pip-version-check $(UV)
	$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python \
	    $(foreach d,$(FIND_LINKS),--find-links $(d)) -r requirements.txt
endif
	touch $(STAMP)

# Pipecat (the voice-agent framework tests/test_agents.py drives the agent doors with) in a venv of its own: it pins
# protobuf<7, soundfile 0.13 and soxr 1.0, which requirements.txt's toolchain does not take (requirements-agents.txt).
AGENTS := .venv-agents
AGENTS_STAMP := $(AGENTS)/.installed

agents-venv: $(AGENTS_STAMP)

$(AGENTS_STAMP): requirements-agents.txt $(STAMP)
	$(PY) -m venv $(AGENTS)
ifeq ($(USE_PIP),1)
	$(AGENTS)/bin/pip install -q --disable-pip-version-check -r requirements-agents.txt
else
	$(BIN)/uv pip install -q --python $(AGENTS)/bin/python $(foreach d,$(FIND_LINKS),--find-links $(d)) \
	    -r requirements-agents.txt
endif
	touch $@

# Where the demos write: exports and reports under $(OUT), wavs in $(WAVS) (tests/test_make_targets.py runs the
# targets themselves into a temporary folder).
OUT ?= onnx
WAVS ?= .
# make clean removes $(MODELS) too (synthetic checkpoints written by hand: docs/building.md)
MODELS ?= models

# OPTIMIZE_ARGS: more optimize.py flags (the suite gives the route crossover its own tiny export was built with, so
# the target finds that export up to date instead of rebuilding it under the other tests)
OPTIMIZE_ARGS ?=

demo: $(STAMP)
	$(BIN)/python optimize.py --synthetic tiny --device cpu --precision int4 --output $(OUT) $(OPTIMIZE_ARGS)
	$(BIN)/python inference.py --model-path $(OUT)/cpu_int4 --text "Hello from the tiny synthetic Higgs model." \
	    --out $(WAVS)/demo.wav
	$(BIN)/python inference.py --model-path $(OUT)/cpu_int4 --ref-audio tests/data/ref_en_24k.wav \
	    --ref-text "$$(cat tests/data/ref_en_24k.txt)" --text "<|emotion:elation|>New words in a cloned voice." \
	    --out $(WAVS)/demo_clone.wav
	$(BIN)/python inference.py --model-path $(OUT)/cpu_int4 --text "Streamed while it is spoken." --stream \
	    --out $(WAVS)/demo_stream.wav
	$(BIN)/python eval.py --model-path $(OUT)/cpu_int4 --markdown $(OUT)/cpu_int4_report.md \
	    --json $(OUT)/cpu_int4_report.json

openvino-demo: $(STAMP)  # the tiny model through the OpenVINO runtime: build -> speak -> parity report
	$(BIN)/python optimize.py --synthetic tiny --device openvino --precision int4 --output $(OUT)
	$(BIN)/python inference.py --model-path $(OUT)/openvino_int4 --provider openvino \
	    --text "Hello from the tiny synthetic Higgs model, through OpenVINO." --out $(WAVS)/demo_openvino.wav
	$(BIN)/python eval.py --model-path $(OUT)/openvino_int4 --provider openvino \
	    --markdown $(OUT)/openvino_int4_report.md --json $(OUT)/openvino_int4_report.json

# Two pytest workers (pytest-xdist), a test module each at a time (its module fixtures: servers, exports, Ray):
# the suite keeps two cores busy. PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= 2
PYTEST_ARGS ?= -n $(PYTEST_WORKERS) --dist loadfile

test: $(STAMP) $(AGENTS_STAMP)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-fast: $(STAMP)  # no ONNX exports: unit tests only (under a minute)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

# The whole suite under coverage (branch coverage; the CLIs, servers and Ray workers the tests start are measured
# too: pyproject.toml [tool.coverage]); the package's and the top-level scripts' figures (docs/testing.md).
COVERAGE_DATA := $(CURDIR)/.coverage-data
COVERAGE = COVERAGE_FILE=$(COVERAGE_DATA)/cov $(BIN)/python -m coverage
coverage: $(STAMP) $(AGENTS_STAMP)
	rm -rf $(COVERAGE_DATA) && mkdir -p $(COVERAGE_DATA)
	HIGGS_COVERAGE_ROOT=$(CURDIR) COVERAGE_FILE=$(COVERAGE_DATA)/cov COVERAGE_RCFILE=$(CURDIR)/pyproject.toml \
	    $(BIN)/python -m coverage run -m pytest -q $(PYTEST_ARGS)
	$(COVERAGE) combine -q --rcfile=pyproject.toml $(COVERAGE_DATA)
	$(COVERAGE) report --rcfile=pyproject.toml --include='higgs_onnx/*' | grep '^TOTAL' | sed 's/^TOTAL/package (higgs_onnx)/'
	$(COVERAGE) report --rcfile=pyproject.toml --include='optimize.py,inference.py,eval.py,user_script.py' | grep '^TOTAL' | \
	    sed 's/^TOTAL/top-level scripts/'
	$(COVERAGE) report --rcfile=pyproject.toml | grep '^TOTAL' | sed 's/^TOTAL/all/'

lint: $(STAMP)
	$(BIN)/python -m ruff check .

clean:
	rm -rf $(MODELS) $(OUT) $(WAVS)/demo.wav $(WAVS)/demo_*.wav
