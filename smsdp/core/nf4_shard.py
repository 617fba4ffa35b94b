"""One rank's shard of a frozen flat group in NF4 (``sdp_qlora``): torchao's format, as one byte buffer.

torchao's ``to_nf4`` quantizes the shard (QLoRA's 4-bit NormalFloat: blocks of
``NF4_BLOCK`` elements scaled by their absmax, the scales themselves quantized to
int8 in blocks of ``NF4_SCALER_BLOCK`` around their mean) and its ``NF4Tensor``
dequantizes it; smsdp only lays the inner tensors out in one ``uint8`` buffer, so
that one all-gather of bytes carries a whole group:

    [codes: n/2][int8 scales: n/64][factors: n/16384 x s][mean: s]

``s`` is the bytes of the dtype the shard was quantized from (``nf4_shard_bytes``).
Each rank quantizes its own shard (shards are whole scale blocks, ``NF4_ALIGN``), so
each shard carries its own mean: torchao's ``to_nf4`` of the shard alone.

[Note: zero blocks]
``to_nf4`` divides a block by its absmax: a block of zeros (padding, a zero bias)
becomes 0/0, and a scale block whose scales are all equal gets an infinite factor.
Both are set to what they mean: the code of 0.0 for every element of a zero block,
and a quantized scale of 0 (the mean, exactly) where the factor is infinite.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from smsdp.config.shard_layout import NF4_ALIGN, NF4_BLOCK, NF4_SCALER_BLOCK, nf4_shard_bytes

ZERO_CODES = 0x77  # two codes of index 7, NF4's 0.0
DEQUANTIZE_CHUNK = 64 * NF4_ALIGN  # elements dequantized at once: torchao widens codes to int64 on the way


@functools.cache
def _nf4() -> ModuleType:
    """torchao's NF4 module, imported by the jobs that use ``sdp_qlora`` only (it is optional, and slow to load)."""
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError as e:
        raise ImportError(
            "sdp_qlora=True keeps the frozen base in torchao's NF4 format, and torchao is not installed: "
            "pip install torchao (0.18; the smsdp[finetune] extra has it), or set sdp_qlora to False"
        ) from e
    return nf4_tensor


def require_torchao() -> None:
    _nf4()


@functools.cache
def _codebook(dtype: torch.dtype) -> torch.Tensor:
    """torchao's NF4 code values in ``dtype``, as ``to_nf4`` makes them (read from it, not copied)."""
    return _nf4().to_nf4(torch.arange(NF4_ALIGN, dtype=dtype), NF4_BLOCK, NF4_SCALER_BLOCK).nf4


def packed_nbytes(shard_numel: int, dtype: torch.dtype) -> int:
    return nf4_shard_bytes(shard_numel, dtype.itemsize)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    flat = torch.empty(tensor.numel(), dtype=tensor.dtype, device=tensor.device)  # strides 1, even for one element
    return flat.copy_(tensor.reshape(-1)).view(torch.uint8)


def quantize(values: torch.Tensor) -> torch.Tensor:
    """The packed NF4 bytes of a 1-D shard (a multiple of ``NF4_ALIGN`` elements), in its dtype's scales."""
    n = values.numel()
    if n % NF4_ALIGN:
        raise ValueError(f"an NF4 shard is a multiple of {NF4_ALIGN} elements, got {n}")
    q = _nf4().to_nf4(values.detach().reshape(-1), NF4_BLOCK, NF4_SCALER_BLOCK)
    codes, scales, factors = q.quantized_data.clone(), q.quantized_scalers.clone(), q.quantization_factor
    zero_blocks = values.detach().reshape(-1, NF4_BLOCK).abs().amax(dim=1) == 0
    codes.view(-1, NF4_BLOCK // 2)[zero_blocks] = ZERO_CODES  # see [Note: zero blocks]
    scales.view(-1, NF4_SCALER_BLOCK)[~torch.isfinite(factors)] = 0
    packed = torch.cat([codes, _bytes(scales), _bytes(factors), _bytes(q.scaler_mean.reshape(1))])
    assert packed.numel() == packed_nbytes(n, values.dtype)
    return packed


def _fields(packed: torch.Tensor, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(codes, int8 scales, factors, mean) of one shard's bytes."""
    s = dtype.itemsize
    bounds = [n // 2, n // NF4_BLOCK, n // NF4_ALIGN * s, s]
    codes, scales, factors, mean = torch.split(packed, bounds)
    return codes, scales.view(torch.int8), factors.view(dtype), mean.view(dtype).reshape(())


def dequantize_into(out: torch.Tensor, packed: torch.Tensor, dtype: torch.dtype) -> None:
    """Write the values of one shard's bytes into ``out`` (1-D; any float dtype), chunk by chunk."""
    nf4 = _nf4()
    n = out.numel()
    codes, scales, factors, mean = _fields(packed, n, dtype)
    table = _codebook(dtype).to(out.device)
    for lo in range(0, n, DEQUANTIZE_CHUNK):
        hi = min(n, lo + DEQUANTIZE_CHUNK)
        meta = {
            "tensor_meta": nf4.SubclassTensorArgs(torch.Size([hi - lo]), (1,), 0, dtype, out.device, False),
            "block_size": NF4_BLOCK,
            "n_blocks": (hi - lo) // NF4_BLOCK,
            "scaler_block_size": NF4_SCALER_BLOCK,
        }
        inner = {
            "quantized_data": codes[lo // 2 : hi // 2],
            "quantized_scalers": scales[lo // NF4_BLOCK : hi // NF4_BLOCK],
            "quantization_factor": factors[lo // NF4_ALIGN : hi // NF4_ALIGN],
            "scaler_mean": mean,
            "nf4": table,
        }
        chunk = nf4.NF4Tensor.__tensor_unflatten__(inner, meta, None, None)
        out[lo:hi].copy_(chunk.get_original_weight())


def dequantize_gathered(out: torch.Tensor, received: torch.Tensor, shards: int, dtype: torch.dtype) -> None:
    """The bytes of ``shards`` shards, gathered into ``received`` in rank order, dequantized into ``out``."""
    nbytes, numel = received.numel() // shards, out.numel() // shards
    for k in range(shards):
        dequantize_into(out[k * numel : (k + 1) * numel], received[k * nbytes : (k + 1) * nbytes], dtype)
