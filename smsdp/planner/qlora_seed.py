"""A Llama with peft's LoRA adapters, for the planner, and the QLoRA seed case.

python -m smsdp.planner.qlora_seed            # Llama-2 70B QLoRA on 2 ranks of 24 GB: does it fit, without
                                              # offload and with sdp_offload="params"?
python -m smsdp.planner.qlora_seed --full     # and the plans in full
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from smsdp.planner.model_spec import ROOT, ModelSpec, ParamTensor, TransformerShape
from smsdp.planner.plan import plan
from smsdp.planner.result import Plan


@dataclass(frozen=True)
class LlamaShape:
    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    ffn: int
    vocab_size: int
    seq_len: int


LLAMA2_70B = LlamaShape(n_layer=80, d_model=8192, n_head=64, n_kv_head=8, ffn=28672, vocab_size=32000, seq_len=4096)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def llama_lora(shape: LlamaShape, rank: int, targets: tuple[str, ...] = LORA_TARGETS, name: str = "") -> ModelSpec:
    """A Llama's tensors as ``transformers`` names them, frozen, with peft's LoRA ``A`` and ``B`` on ``targets``.

    Activations use the GPT formula with an MLP multiplier of 4 (``memory.layer_activation_bytes``):
    an approximation for Llama's SwiGLU MLP.
    """
    h, kv = shape.d_model, shape.d_model // shape.n_head * shape.n_kv_head
    linears = {
        "q_proj": (h, h),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (h, h),
        "gate_proj": (h, shape.ffn),
        "up_proj": (h, shape.ffn),
        "down_proj": (shape.ffn, h),
    }
    tensors = [ParamTensor("model.embed_tokens.weight", shape.vocab_size * h, ROOT, trainable=False)]
    for i in range(shape.n_layer):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors.append(ParamTensor(f"model.layers.{i}.{norm}.weight", h, i, trainable=False))
        for proj, (n_in, n_out) in linears.items():
            prefix = f"model.layers.{i}.{'self_attn' if proj.endswith(('q_proj', 'k_proj', 'v_proj', 'o_proj')) else 'mlp'}.{proj}"
            tensors.append(ParamTensor(f"{prefix}.base_layer.weight", n_in * n_out, i, trainable=False))
            if proj in targets:
                tensors.append(ParamTensor(f"{prefix}.lora_A.default.weight", rank * n_in, i))
                tensors.append(ParamTensor(f"{prefix}.lora_B.default.weight", n_out * rank, i))
    tensors.append(ParamTensor("model.norm.weight", h, ROOT, trainable=False))
    tensors.append(ParamTensor("lm_head.weight", shape.vocab_size * h, ROOT, trainable=False))
    act = TransformerShape(shape.n_layer, h, shape.n_head, shape.seq_len, shape.vocab_size)
    label = name or f"Llama (l={shape.n_layer}, h={h}) + LoRA r={rank}"
    return ModelSpec(label, tuple(tensors), act, notes=("activations: the GPT formula (f=4) for a SwiGLU MLP",))


def main(argv: list[str] | None = None) -> int:
    """Llama-2 70B, LoRA r=16 on every projection, NF4 base, on ranks of 24 GB (ml.g5.2xlarge, default 2),
    without offload and with the parameter shards in host memory (sdp_offload="params", FSDP2's CPUOffloadPolicy)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--full", action="store_true", help="print the whole plans")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--ranks", type=int, default=2, help="ml.g5.2xlarge instances (one 24 GB A10G each) = d")
    args = parser.parse_args(argv)
    shape = LlamaShape(**{**LLAMA2_70B.__dict__, "seq_len": args.seq_len})
    model = llama_lora(shape, 16, name=f"Llama-2 70B + LoRA r=16 (s={args.seq_len})")
    fits = False
    for offload in ("none", "params"):
        result = seed_plan(model, args.ranks, offload)
        print(verdict(result, args.ranks))
        if args.full:
            print(result)
        fits = result.fits
    return 0 if fits else 1


def seed_plan(model: ModelSpec, ranks: int, offload: str) -> Plan:
    """The seed's configuration: sdp_qlora, bf16, activation checkpointing, delayed initialization."""
    return plan(
        model,
        instance_type="ml.g5.2xlarge",
        instance_count=ranks,
        parameters={
            "sharded_data_parallel_degree": ranks,
            "bf16": True,
            "sdp_qlora": True,
            "activation_checkpointing": True,
            "delayed_parameter_initialization": True,
            "sdp_offload": offload,
        },
        recommend=False,
    )


def verdict(result: Plan, ranks: int) -> str:
    """One line: fits or not, the device peak against its budget, and the host side when offloaded."""
    gib = 2**30
    memory, host = result.memory, result.host
    offload = "" if host is None else f", sdp_offload={host.mode!r}"
    line = (
        f"{result.model.name} under sdp_qlora{offload}, {ranks} x ml.g5.2xlarge (24 GB each), d={ranks}: "
        f"{'fits' if result.fits else 'does not fit'}: device peak {memory.peak / gib:.2f} GiB "
        f"({memory.peak_phase}) of {result.budget_bytes / gib:.2f} GiB; "
    )
    if host is None:
        return line + f"parameters {memory.parameters / gib:.2f} GiB per rank on the device"
    return line + (
        f"parameters {memory.parameters / gib:.2f} GiB on the device, host {host.need_bytes / gib:.2f} GiB "
        f"(NF4 base and masters {host.state.params / gib:.2f} GiB, gradients and optimizer state "
        f"{(host.state.grads + host.state.optimizer) / gib:.2f} GiB, process {host.overhead_bytes / gib:.2f} GiB) "
        f"of {host.budget_bytes / gib:.2f} GiB host RAM"
    )


if __name__ == "__main__":
    raise SystemExit(main())
