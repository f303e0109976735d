"""kvmem: KV-injection memory for LLM serving.

``from kvmem import Memory, AsyncMemory`` is Mem0's open-source API over a kvmem store (``kvmem.memory``);
importing the package alone loads neither torch nor a model.
"""

__all__ = ["AsyncMemory", "Memory", "MemoryInputError"]


def __getattr__(name: str):
    if name in __all__:
        from . import memory

        return getattr(memory, name)
    raise AttributeError(f"module 'kvmem' has no attribute {name!r}")
