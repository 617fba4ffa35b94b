"""sdp_qlora's NF4 shard on one CUDA GPU: the same values as torchao's NF4Tensor there; skipped without a GPU.

One process, no collective: ``smsdp.core.nf4_shard`` quantizes and dequantizes a CUDA shard, which must
equal torchao's ``to_nf4(...).get_original_weight()`` on the same device (blocks of zeros aside: see the
module's note). Printed, not asserted: whether the CPU dequantizes the GPU's bytes to the same bits.

    .venv/bin/python -m pytest tests/gpu/test_nf4_shard_gpu.py -q -s
"""

from __future__ import annotations

import pytest
import torch

from smsdp.config.shard_layout import NF4_ALIGN
from smsdp.core import nf4_shard

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cuda_shard_dequantizes_to_what_torchaos_nf4_tensor_gives_there(dtype):
    pytest.importorskip("torchao")
    from torchao.quantization import to_nf4

    torch.manual_seed(5)
    values = torch.randn(70 * NF4_ALIGN, dtype=dtype, device="cuda")  # more than one dequantization chunk
    packed = nf4_shard.quantize(values)
    assert packed.is_cuda
    out = torch.empty_like(values)
    nf4_shard.dequantize_into(out, packed, dtype)
    assert torch.equal(out, to_nf4(values).get_original_weight())
    on_cpu = torch.empty(values.numel(), dtype=dtype)
    nf4_shard.dequantize_into(on_cpu, packed.cpu(), dtype)
    print(f"\n[nf4 {dtype}] CPU dequantization of the GPU's bytes equal bit for bit: {torch.equal(on_cpu, out.cpu())}")
