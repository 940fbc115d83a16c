# Two commands do all set-up on a fresh machine:
#   make demo   venv + install, then the whole pipeline on the embedded tiny synthetic checkpoint
#   make test   venv + install, then the whole test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export CI := 1
# Olive reads CI to switch its telemetry off before it starts (it hangs ~10 s at exit otherwise).

.PHONY: demo test venv lint clean

venv: $(STAMP)

$(STAMP): requirements.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements.txt
	touch $(STAMP)

models/tiny/config.json: | $(STAMP)
	$(BIN)/python -m higgs_onnx.synthetic --preset tiny --out models/tiny

demo: $(STAMP) models/tiny/config.json
	$(BIN)/python -m higgs_onnx.reference --checkpoint models/tiny --temperature 0 \
	    --text "Hello from the tiny synthetic Higgs model." --out demo_reference.wav

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/python -m ruff check .

clean:
	rm -rf models onnx demo_*.wav
