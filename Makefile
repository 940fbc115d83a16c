# Two commands do all set-up on a fresh machine:
#   make demo   venv + install, then build -> generate wavs -> parity report on the tiny synthetic checkpoint
#   make test   venv + install, then the whole test suite (make test-fast: without the export tests)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export CI := 1
# Olive reads CI to switch its telemetry off before it starts (it hangs ~10 s at exit otherwise).

.PHONY: demo openvino-demo test test-fast venv lint clean

venv: $(STAMP)

$(STAMP): requirements.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements.txt
	touch $(STAMP)

# Where the demos write: exports and reports under $(OUT), wavs in $(WAVS) (tests/test_make_targets.py runs the
# targets themselves into a temporary folder).
OUT ?= onnx
WAVS ?= .
# make clean removes $(MODELS) too (synthetic checkpoints written by hand: docs/building.md)
MODELS ?= models

demo: $(STAMP)
	$(BIN)/python optimize.py --synthetic tiny --device cpu --precision int4 --output $(OUT)
	$(BIN)/python inference.py --model-path $(OUT)/cpu_int4 --text "Hello from the tiny synthetic Higgs model." \
	    --out $(WAVS)/demo.wav
	$(BIN)/python inference.py --model-path $(OUT)/cpu_int4 --ref-audio tests/data/ref_en_24k.wav \
	    --ref-text "$$(cat tests/data/ref_en_24k.txt)" --text "<|emotion:elation|>New words in a cloned voice." \
	    --out $(WAVS)/demo_clone.wav
	$(BIN)/python inference.py --model-path $(OUT)/cpu_int4 --text "Streamed while it is spoken." --stream \
	    --out $(WAVS)/demo_stream.wav
	$(BIN)/python eval.py --model-path $(OUT)/cpu_int4 --markdown $(OUT)/cpu_int4_report.md

openvino-demo: $(STAMP)  # the tiny model through the OpenVINO runtime: build -> speak -> parity report
	$(BIN)/python optimize.py --synthetic tiny --device openvino --precision int4 --output $(OUT)
	$(BIN)/python inference.py --model-path $(OUT)/openvino_int4 --provider openvino \
	    --text "Hello from the tiny synthetic Higgs model, through OpenVINO." --out $(WAVS)/demo_openvino.wav
	$(BIN)/python eval.py --model-path $(OUT)/openvino_int4 --provider openvino \
	    --markdown $(OUT)/openvino_int4_report.md

test: $(STAMP)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)  # no ONNX exports: unit tests only (about a minute)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m pytest -q -m "not slow"

lint: $(STAMP)
	$(BIN)/python -m ruff check .

clean:
	rm -rf $(MODELS) $(OUT) $(WAVS)/demo.wav $(WAVS)/demo_*.wav
