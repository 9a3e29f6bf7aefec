"""llama.cpp through llama-cpp-python's low-level API: several sequences per llama_decode."""

from edgeprefill.backends.llamacpp.backend import LlamaCppBackend, LlamaCppConfig

__all__ = ["LlamaCppBackend", "LlamaCppConfig"]
