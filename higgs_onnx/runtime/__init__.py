"""ONNX Runtime side (and the OpenVINO runtime behind the same part interface); no torch here. `model.HiggsTTS` is
the facade; its pieces: `parts` (the export folder and its sessions), `backend` (the generation backend and KV
caches, via `decoder`), `codec` (+ `stream`), `voice` (+ `voice_cache`); `session` / `openvino` / `checks` run a
part."""
