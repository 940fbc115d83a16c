"""Backend-independent generation: prompt layout, delay pattern, sampler, and the AR state machine (NumPy only).

The ONNX Runtime backend and the PyTorch reference backend both run this code, so they differ only in the
numbers their parts compute.
"""
