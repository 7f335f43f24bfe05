"""duo: asynchronous two-process speculative decoding of GGUF models over gRPC."""

__version__ = "0.1.0"
