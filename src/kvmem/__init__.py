"""kvmem: KV-injection memory for LLM serving.

``from kvmem import Memory, AsyncMemory`` is Mem0's open-source API over a kvmem store (``kvmem.memory``);
importing the package alone loads neither torch nor a model.
"""

import logging

__all__ = ["AsyncMemory", "Memory", "MemoryConflict", "MemoryInputError"]

# torchao (int8 KV, ``kvformat``; transformers imports it too) warns about each CUDA-only extension a CPU build
# cannot load, and about enums torch's pytree now handles itself; neither concerns kvmem
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)


def __getattr__(name: str):
    if name in __all__:
        from . import memory

        return getattr(memory, name)
    raise AttributeError(f"module 'kvmem' has no attribute {name!r}")
