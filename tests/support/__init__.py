"""Test support: fixtures' helpers, harnesses, fake CUDA drivers, tiny GGUF writers and independent references."""
