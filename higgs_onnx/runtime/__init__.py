"""ONNX Runtime side: sessions with verified providers, the decoder's KV cache, the ONNX backend. No torch here."""
