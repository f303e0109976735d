"""The vLLM engine's former module path, kept for code that imports it: re-exports ``kvmem.engines.vllm.engine``'s
public names (new code imports ``kvmem.engines.vllm.engine``)."""

from .vllm.engine import AsyncVLLMEngine, VLLMEngine, VLLMGeneration, engine_kwargs
from .vllm.params import MemoryRef, cold_salt

__all__ = ["AsyncVLLMEngine", "MemoryRef", "VLLMEngine", "VLLMGeneration", "cold_salt", "engine_kwargs"]
