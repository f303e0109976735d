"""LayerStager: layers arrive in order, each exactly the host layer; the same loop on CPU (views, no copies) and,
where a GPU is present, through the copy stream and its pool of staging buffers."""

from __future__ import annotations

import pytest
import torch

from kvmem.staging import LayerStager


def _consume(stager: LayerStager, keys, values) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What a consumer sees of each layer, copied out on the current stream before the next layer is asked for."""
    seen, order = [], []
    for l0, k, v in stager.chunks(keys, values):
        order.append(l0)
        seen += [(k[i] * 1, v[i] * 1) for i in range(k.shape[0])]  # queued on the current stream, like a block write
    assert order == list(range(0, keys.shape[0], stager.chunk or keys.shape[0]))
    return seen


@pytest.mark.parametrize("chunk", [None, 1, 2])
def test_cpu_chunks_are_views_in_order(chunk):
    keys, values = torch.randn(5, 2, 7, 4), torch.randn(5, 2, 7, 4)
    stager = LayerStager("cpu", chunk=chunk)
    assert stager.pin(keys) is keys  # nothing to pin without a device
    seen = []
    for l0, k, v in stager.chunks(keys[:, :, 2:], values[:, :, 2:]):
        assert k.data_ptr() == keys[l0, :, 2:].data_ptr() and torch.equal(v, values[l0 : l0 + k.shape[0], :, 2:])
        seen.append((l0, k.shape[0]))
    step = chunk or 5
    assert seen == [(l0, min(step, 5 - l0)) for l0 in range(0, 5, step)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("pool,chunk", [(1, 1), (2, 1), (3, 5)])
def test_cuda_layers_arrive_whole_through_the_pool(pool, chunk):
    keys, values = torch.randn(24, 2, 1000, 64), torch.randn(24, 2, 1000, 64)
    stager = LayerStager("cuda", pool=pool, chunk=chunk)
    seen = _consume(stager, stager.pin(keys[:, :, 10:]), stager.pin(values[:, :, 10:]))
    torch.cuda.synchronize()
    for layer, (k, v) in enumerate(seen):
        assert torch.equal(k.cpu(), keys[layer, :, 10:]) and torch.equal(v.cpu(), values[layer, :, 10:])
