"""higgs-onnx: Higgs Audio v3 TTS exported to ONNX and run with ONNX Runtime."""

import os

# ONNX Runtime 1.32's telemetry writes a device id and a database under ~/.cache/Microsoft/DeveloperTools on import
# unless it sees a CI variable; this is its own switch, set before any module here imports onnxruntime.
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

__version__ = "0.1.0"  # = pyproject.toml
