"""Serving engines: ``hf`` (transformers, the reference engine and encoder)."""
