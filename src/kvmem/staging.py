"""Layer-by-layer staging of composed memory onto the engine's device.

The reference design (InferScale) keeps the hot KV tier in device or pinned host memory and copies a request's
memory to the device on a side stream, layer by layer, through a small pool of staging buffers with one event
per layer: the injection of layer l starts as soon as layer l has arrived, while later layers are still in flight.

``LayerStager`` is that pipeline. On a CUDA device it uses a copy stream, ``pool`` staging buffers per tensor and
CUDA events; on a CPU device the same loop runs with no stream and no copy (a "staged" layer is a view of the
host tensor), so the code path the CPU tests exercise is the one a GPU runs, less the transfers.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

POOL = 2  # staging buffers per tensor: one being filled while the consumer injects the other


class LayerStager:
    """Copies [L, H, T, D] keys and values to ``device`` a chunk of layers at a time, overlapping the copy of the
    next chunk with the consumer's work on this one.

    ``chunk``: layers per step; default 1 on CUDA (injection of layer l starts when layer l has arrived) and every
    layer on a CPU, where there is no transfer to overlap and every tensor op costs its own dispatch (and, on a
    loader thread beside the engine's, a wait for the GIL): one chunk keeps the op count independent of the
    layers."""

    def __init__(self, device: torch.device | str, pool: int = POOL, chunk: int | None = None):
        self.device = torch.device(device)
        self.pool = max(1, int(pool))
        self.cuda = self.device.type == "cuda"
        self.chunk = chunk if chunk is not None else (1 if self.cuda else None)
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as one contiguous block of pinned host memory when staging to a CUDA device (an asynchronous copy
        needs both: a strided source is copied through pageable memory, synchronously), else ``t``."""
        if not self.cuda or (t.is_pinned() and t.is_contiguous()):
            return t
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)

    def chunks(self, keys: torch.Tensor, values: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Yield ``(first layer, keys[l0:l1], values[l0:l1])`` on the device, [c, H, T, D] each, in layer order, each
        once it has arrived.

        Args:
            keys, values: [L, H, T, D] on the host (any strides; pinned for truly asynchronous copies).
        On CUDA the current stream waits on the chunk's copy event before it is yielded, and a staging buffer is
        refilled only after the current stream has passed what the consumer queued on it, so the consumer must
        queue its work on a chunk (on the current stream) before asking for the next. On CPU the yielded tensors
        are views of ``keys`` and ``values``.
        """
        num_layers = keys.shape[0]
        step = self.chunk or num_layers
        starts = list(range(0, num_layers, step))
        if not self.cuda:
            for l0 in starts:
                yield l0, keys[l0 : l0 + step], values[l0 : l0 + step]
            return
        compute = torch.cuda.current_stream(self.device)
        slots = [
            (
                torch.empty((step, *keys.shape[1:]), dtype=keys.dtype, device=self.device),
                torch.empty((step, *values.shape[1:]), dtype=values.dtype, device=self.device),
            )
            for _ in range(min(self.pool, len(starts)))
        ]
        released: list[torch.cuda.Event | None] = [None] * len(slots)
        arrived: dict[int, torch.cuda.Event] = {}

        def issue(j: int) -> None:
            i, l0 = j % len(slots), starts[j]
            c = min(step, num_layers - l0)
            with torch.cuda.stream(self._stream):
                if released[i] is not None:
                    self._stream.wait_event(released[i])  # the consumer is done with this buffer
                slots[i][0][:c].copy_(keys[l0 : l0 + c], non_blocking=True)
                slots[i][1][:c].copy_(values[l0 : l0 + c], non_blocking=True)
                arrived[j] = torch.cuda.Event()
                arrived[j].record(self._stream)

        try:
            for j in range(len(slots)):
                issue(j)
            for j, l0 in enumerate(starts):
                i, c = j % len(slots), min(step, num_layers - l0)
                compute.wait_event(arrived.pop(j))
                yield l0, slots[i][0][:c], slots[i][1][:c]
                released[i] = torch.cuda.Event()
                released[i].record(compute)
                if j + len(slots) < len(starts):
                    issue(j + len(slots))
        finally:  # a consumer that stops early: no copy may still write into buffers freed to the compute stream
            compute.wait_stream(self._stream)
