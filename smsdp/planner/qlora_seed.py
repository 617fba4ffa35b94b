"""A Llama with peft's LoRA adapters, for the planner, and the QLoRA seed case.

python -m smsdp.planner.qlora_seed            # Llama-2 70B QLoRA on 2 ranks of 24 GB: does it fit?
python -m smsdp.planner.qlora_seed --full     # and the plan in full
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from smsdp.planner.model_spec import ROOT, ModelSpec, ParamTensor, TransformerShape
from smsdp.planner.plan import plan


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
    """Llama-2 70B, LoRA r=16 on every projection, NF4 base, on ranks of 24 GB (ml.g5.2xlarge, default 2)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--full", action="store_true", help="print the whole plan")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--ranks", type=int, default=2, help="ml.g5.2xlarge instances (one 24 GB A10G each) = d")
    args = parser.parse_args(argv)
    shape = LlamaShape(**{**LLAMA2_70B.__dict__, "seq_len": args.seq_len})
    result = plan(
        llama_lora(shape, 16, name=f"Llama-2 70B + LoRA r=16 (s={args.seq_len})"),
        instance_type="ml.g5.2xlarge",
        instance_count=args.ranks,
        parameters={
            "sharded_data_parallel_degree": args.ranks,
            "bf16": True,
            "sdp_qlora": True,
            "activation_checkpointing": True,
            "delayed_parameter_initialization": True,
        },
        recommend=False,
    )
    gib = 2**30
    print(
        f"{result.model.name} under sdp_qlora, {args.ranks} x ml.g5.2xlarge (24 GB each), d={args.ranks}: "
        f"{'fits' if result.fits else 'does not fit'}: peak {result.memory.peak / gib:.2f} GiB of "
        f"{result.budget_bytes / gib:.2f} GiB; parameters {result.memory.parameters / gib:.2f} GiB per rank"
    )
    if args.full:
        print(result)
    return 0 if result.fits else 1


if __name__ == "__main__":
    raise SystemExit(main())
