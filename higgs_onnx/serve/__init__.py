"""The speech server: an OpenAI-compatible `/v1/audio/speech` on FastAPI + uvicorn, fed by a batching scheduler.

    python -m higgs_onnx.serve --model-path onnx/cpu_int4 [--host 127.0.0.1] [--port 8000] [--max-batch 4]
"""
