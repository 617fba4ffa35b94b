"""Per-rank memory of a MiCS job, piece by piece, as the smsdp runtime allocates it.

Notation: ``d`` sharded degree, ``c`` bytes of the compute dtype (2 for bf16
and fp16, 4 for fp32), ``b`` sequences per micro-step, ``s`` sequence length,
``h`` hidden size, ``a`` heads, ``V`` vocabulary, ``L`` layers, ``f`` MLP
multiplier.

Model state (``smsdp/core/flat_param_group.py``): each unit's parameters are split
into flat groups by (sharded?, trainable?). A parameter with fewer than
``sdp_param_persistence_threshold`` elements, or any parameter when ``d == 1``,
is replicated. A sharded group of ``n`` elements is padded to
``p = ceil(n/d)*d`` and each rank keeps ``s = p/d``:

- parameters: the master ``m*s``, ``m`` = 4 (fp32) or 2 under ``sdp_pure_bf16``
  (bf16 and fp16 gathers cast the fp32 master on the fly: no second copy);
  frozen groups too, except under ``sdp_qlora``: a sharded frozen group, its shards
  whole NF4 scale blocks, keeps ``nf4_shard_bytes(s, m)`` (about ``0.52 s``);
- gradients: an accumulator ``m*s`` per trainable group (none for frozen ones);
- optimizer state: AdamW's ``exp_avg`` and ``exp_avg_sq`` in fp32 over this
  rank's unpadded slice, ``8 * min(s, max(0, n - r*s))`` on shard rank ``r``
  (rank 0 holds the most); in bf16 4, and 6 with ``KahanAdamW``'s compensation
  buffer (``OPTIMIZER_BYTES_PER_ELEMENT``). Frozen groups have none.

Everything else is reported separately (see :class:`MemoryBreakdown`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from smsdp.config.parameters import SMPParameters, reshard_degree
from smsdp.config.shard_layout import NF4_ALIGN, ShardLayout, is_sharded, nf4_shard_bytes
from smsdp.planner.model_spec import ROOT, ModelSpec, TransformerShape

OPTIMIZER_BYTES_PER_ELEMENT = {
    "adamw": 8,
    "adam": 8,
    "sgd_momentum": 4,
    "sgd": 0,
    "adamw_bf16": 4,
    "kahan_adamw_bf16": 6,
}
"""State per trainable element: Adam(W) keeps two fp32 moments; SGD with momentum one; plain SGD none.
Under ``sdp_pure_bf16`` the state takes the parameters' dtype: two bf16 moments, and ``smp.KahanAdamW``
a bf16 compensation buffer besides."""


# ----------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class GroupLayout:
    """One flat group of one unit on one rank (its shard arithmetic: ``ShardLayout``)."""

    unit: int
    trainable: bool
    shards: ShardLayout  # of shard rank 0; a replicated group is one shard
    nf4: bool = False  # sdp_qlora: a sharded frozen group kept as NF4 bytes

    @property
    def sharded(self) -> bool:
        return self.shards.sharded

    @property
    def numel(self) -> int:
        return self.shards.numel

    @property
    def padded(self) -> int:
        return self.shards.padded_numel

    @property
    def shard(self) -> int:
        """Elements one rank keeps (the whole group when replicated)."""
        return self.shards.shard_numel

    def local_unpadded(self, sdp_rank: int) -> int:
        """Elements of real parameters in shard rank ``sdp_rank``'s slice (optimizer state covers these)."""
        if not self.sharded:
            return self.numel
        theirs = ShardLayout.of(self.numel, self.shards.shard_degree, sdp_rank)
        return theirs.real_stop - theirs.start


def layout(spec: ModelSpec, sdp_degree: int, persistence_threshold: int, nf4: bool = False) -> list[GroupLayout]:
    """The flat groups the runtime builds, unit by unit (``smsdp.core.cutting.make_groups``): one per
    (sharded, trainable), sharded by the persistence rule (``smsdp.config.shard_layout.is_sharded``);
    under ``nf4`` (``sdp_qlora``) the sharded frozen ones in NF4, aligned as the runtime aligns them."""
    groups: list[GroupLayout] = []
    for unit in spec.unit_ids():
        buckets: dict[tuple[bool, bool], int] = {}
        for t in spec.tensors_of(unit):
            key = (is_sharded(t.numel, sdp_degree, persistence_threshold), t.trainable)
            buckets[key] = buckets.get(key, 0) + t.numel
        for (sharded, trainable), n in sorted(buckets.items(), reverse=True):
            quantized = nf4 and sharded and not trainable
            shards = ShardLayout.of(n, sdp_degree if sharded else 1, 0, NF4_ALIGN if quantized else 1)
            groups.append(GroupLayout(unit, trainable, shards, quantized))
    return groups


# ------------------------------------------------------------------------- model state


@dataclass(frozen=True)
class ModelState:
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def model_state(
    groups: list[GroupLayout],
    compute_bytes: int,
    optimizer_bytes: float,
    sdp_rank: int = 0,
    master_bytes: int = 4,
) -> ModelState:
    """Bytes of parameters, gradients and optimizer state on shard rank ``sdp_rank``.

    ``master_bytes``: 4 (fp32 masters), 2 under ``sdp_pure_bf16``.

    These are what ``DistributedModel.model_state_bytes()`` (params, grads) and
    ``DistributedOptimizer.optimizer_state_bytes()`` report after ``step()``.
    """
    params = grads = 0
    opt = 0.0
    for g in groups:
        # the master only: bf16/fp16 gathers cast it on the fly; NF4 codes and scales in the masters' dtype
        params += nf4_shard_bytes(g.shard, master_bytes) if g.nf4 else master_bytes * g.shard
        if g.trainable:
            grads += master_bytes * g.shard
            opt += optimizer_bytes * g.local_unpadded(sdp_rank)
    return ModelState(params, grads, int(opt))


# ------------------------------------------------------------------------- activations


@dataclass(frozen=True)
class Activations:
    """Activation bytes of one micro-step on one rank, at their peak (start of backward)."""

    saved_per_layer: int
    layers_on_device: int
    head_saved: int
    transient: int
    recomputed_layer: int

    @property
    def total(self) -> int:
        return self.saved_per_layer * self.layers_on_device + self.head_saved + self.transient


def layer_activation_bytes(shape: TransformerShape, batch: int, compute_bytes: int, tp_degree: int = 1) -> int:
    """Bytes one transformer block keeps for its backward when nothing is recomputed.

    Elements kept, in units of ``s*b*h`` (then times ``c``): LayerNorm inputs 2,
    QKV-projection input 1, Q, K and V 3, output-projection input 1, MLP input 1,
    GeLU input ``f``, second MLP input ``f``: ``8 + 2f`` (16 for ``f = 4``).
    Attention core: ``flash`` keeps the fp32 log-sum-exp ``4*a*s*b`` and its
    output, which is the output-projection input already counted (SDPA returns it
    in the ``(b, s, h)`` layout, so the transpose before the projection copies
    nothing: measured, ``tests/unit/test_planner.py``); ``eager`` keeps the softmax
    output ``c*a*s^2*b``.
    With dropout, one 1-byte mask per dropout (``2*sbh``; eager adds the
    attention-dropout mask ``a*s^2*b`` and its output ``c*a*s^2*b``).

    At ``c = 2`` with eager attention and dropout this is Korthikanti et al.
    (2022), eq. (1): ``s*b*h*(34 + 5*a*s/h)``.

    At tensor-parallel degree ``t`` (no sequence parallelism) the inputs of the
    layer norms, of the column-parallel layers and the residual dropout masks
    stay whole (``4`` sbh and ``2*sbh`` bytes); everything between a
    column-parallel and a row-parallel layer (Q, K, V, the attention core, the
    output-projection input, both MLP hiddens) is split: Korthikanti's
    ``s*b*h*(10 + 24/t + 5*a*s/(h*t))``.
    """
    s, b, h, a, f, t = shape.seq_len, batch, shape.d_model, shape.n_head, shape.ffn_mult, tp_degree
    sbh = s * b * h
    total = compute_bytes * 4 * sbh + compute_bytes * (4 + 2 * f) * sbh // t
    if shape.attention == "flash":
        total += 4 * a * s * b // t
    else:
        total += compute_bytes * a * s * s * b // t
    if shape.dropout:
        total += 2 * sbh
        if shape.attention == "eager":
            total += (a * s * s * b + compute_bytes * a * s * s * b) // t
    return total


def activation_bytes(
    shape: TransformerShape,
    batch: int,
    compute_bytes: int,
    *,
    checkpointing: bool = False,
    offload: bool = False,
    loading_horizon: int = 4,
    tp_degree: int = 1,
) -> Activations:
    """Activation memory at its peak, the start of backward.

    - Blocks: :func:`layer_activation_bytes` each; with full activation
      checkpointing (every block, as ``activation_checkpointing`` does) only each
      block's input ``c*s*b*h`` (Korthikanti's ``2sbh`` per layer at 16 bits),
      plus one block's full activations while it is recomputed in backward.
      With offloading (only together with checkpointing, as in SMP), only the
      inputs of ``loading_horizon + 1`` blocks stay on the device.
    - Head (root, never checkpointed): the final LayerNorm and LM-head inputs
      ``2c*sbh`` and the fp32 log-probabilities of the loss ``4*s*b*V``.
    - Transient: the larger of the loss backward (two fp32 ``s*b*V`` gradients,
      while the log-probabilities are still alive) and a block's backward (two
      ``c*f*sbh`` gradients of the MLP hidden, plus the recomputed block).
    - At tensor-parallel degree ``t`` a rank keeps ``V/t`` of the vocabulary's
      log-probabilities and ``f*h/t`` of the MLP hidden (the vocab-parallel loss
      never gathers the logits).
    """
    s, b, h, v, f, t = shape.seq_len, batch, shape.d_model, shape.vocab_size, shape.ffn_mult, tp_degree
    sbh, sbv = s * b * h, s * b * math.ceil(v / t)
    full = layer_activation_bytes(shape, batch, compute_bytes, tp_degree)
    if checkpointing:
        per_layer = compute_bytes * sbh
        on_device = min(shape.n_layer, loading_horizon + 1) if offload else shape.n_layer
        recomputed = full
    else:
        per_layer, on_device, recomputed = full, shape.n_layer, 0
    head = 2 * compute_bytes * sbh + (sbh if shape.dropout else 0)
    loss_backward = 4 * sbv + 8 * sbv
    block_backward = 2 * compute_bytes * f * sbh // t + recomputed
    return Activations(per_layer, on_device, head, max(loss_backward, block_backward), recomputed)


# --------------------------------------------------------------- buffers around the step


@dataclass(frozen=True)
class UnitSizes:
    """Per unit, elements gathered (sharded, padded) and cast (replicated, when c != 4)."""

    order: list[int]  # block units in forward order
    gathered: dict[int, int]
    replicated: dict[int, int]
    trainable_sharded: dict[int, int]
    trainable_all: dict[int, int]


def unit_sizes(groups: list[GroupLayout]) -> UnitSizes:
    gathered: dict[int, int] = {}
    replicated: dict[int, int] = {}
    trainable_sharded: dict[int, int] = {}
    trainable_all: dict[int, int] = {}
    for g in groups:
        gathered.setdefault(g.unit, 0)
        replicated.setdefault(g.unit, 0)
        trainable_sharded.setdefault(g.unit, 0)
        trainable_all.setdefault(g.unit, 0)
        if g.sharded:
            gathered[g.unit] += g.padded
            if g.trainable:
                trainable_sharded[g.unit] += g.padded
        else:
            replicated[g.unit] += g.numel
        if g.trainable:
            trainable_all[g.unit] += g.padded
    order = sorted(u for u in gathered if u != ROOT)
    return UnitSizes(order, gathered, replicated, trainable_sharded, trainable_all)


def kept_for_backward_elems(sizes: UnitSizes, p: SMPParameters) -> int:
    """Sharded elements the runtime keeps gathered from forward into backward (gathered once
    per micro-step, not twice): every unit under ``sdp_reshard_after_forward=False``; else the
    root, and the forward's last unit as the backward's first prefetch (``smsdp.core.model``):
    with ``sdp_backward_prefetch`` >= 1 and room in the live budget, which under
    ``sdp_reshard_after_forward=k`` also holds the earlier units' ``1/k`` slices."""
    if p.sdp_reshard_after_forward is False:
        return sum(sizes.gathered.values())
    root = sizes.gathered.get(ROOT, 0)
    last = sizes.gathered[sizes.order[-1]] if sizes.order else 0
    k = reshard_degree(p)
    slices = sum(sizes.gathered[u] for u in sizes.order[:-1]) // k if k else 0
    fits = root + last + slices <= p.sdp_max_live_parameters
    return root + last if fits and p.sdp_backward_prefetch > 0 else root


def kept_slice_elems(sizes: UnitSizes, p: SMPParameters) -> int:
    """Elements of the ``1/k`` slices ``sdp_reshard_after_forward=k`` holds at the end of a forward
    (``DistributedModel.compute_copy_bytes()["kept_slices"]``): every unit not kept whole."""
    k = reshard_degree(p)
    if not k:
        return 0
    return (sum(sizes.gathered.values()) - kept_for_backward_elems(sizes, p)) // k


def unsharded_in_flight_bytes(
    sizes: UnitSizes,
    compute_bytes: int,
    max_live: int,
    reshard_after_forward: bool | int = True,
    forward_prefetch: int = 1,
    backward_prefetch: int = 1,
) -> int:
    """Gathered parameters alive at once (``smsdp.core.prefetch``).

    ``reshard_after_forward=False``: every unit stays gathered from its forward to its
    backward, so at the end of the forward the whole model is gathered.

    The root unit stays gathered for the whole forward and backward; the unit
    running is gathered whatever the budget; up to ``forward_prefetch`` units after
    it (``backward_prefetch`` before it, in the backward) are gathered ahead, in
    order, while root + running + those <= ``sdp_max_live_parameters`` elements.
    Replicated groups add a compute-dtype cast of their whole buffer while gathered
    when ``c != 4`` (in fp32 they compute from the master directly).
    """
    cast = compute_bytes != 4

    def live(units: list[int]) -> int:
        elems = sum(sizes.gathered.get(u, 0) for u in units)
        if cast:
            elems += sum(sizes.replicated.get(u, 0) for u in units)
        return compute_bytes * elems

    root = [ROOT] if ROOT in sizes.gathered else []
    if reshard_after_forward is False:
        return live(root + list(sizes.order))
    passes = ((sizes.order, forward_prefetch), (sizes.order[::-1], backward_prefetch))
    return max(
        live(root + held) for order, depth in passes for held in _gathered_during_pass(sizes, order, depth, max_live)
    )


def _gathered_during_pass(sizes: UnitSizes, order: list[int], depth: int, max_live: int) -> list[list[int]]:
    """The block units gathered after each gather of one pass (the root's at its start, then each
    unit's), replaying ``Prefetcher.issue_after``: the running unit whatever the budget, then the
    next ``depth`` in order until one does not fit beside the root and those already held."""
    size = [sizes.gathered[u] for u in order]
    held: list[int] = []  # positions in ``order``
    moments = []
    for running in range(-1, len(order)):
        if running >= 0:  # the unit before it was freed at the end of its own forward/backward
            held = [i for i in held if i > running] + [running]
        live = sizes.gathered.get(ROOT, 0) + sum(size[i] for i in held)
        for ahead in range(running + 1, min(running + 1 + depth, len(order))):
            if ahead in held:
                continue
            if live + size[ahead] > max_live:
                break
            held.append(ahead)
            live += size[ahead]
        moments.append([order[i] for i in held])
    return moments


def gradient_buffer_bytes(sizes: UnitSizes, compute_bytes: int, pending_units: int | None) -> int:
    """Unsharded gradients alive during backward, before they are reduce-scattered.

    - The root's gradient (compute dtype) builds up over the whole backward (its
      LM head is used first and its embedding last).
    - The running unit's flat gradient in the compute dtype.
    - Reduce-scatter inputs, fp32 (the runtime reduces in fp32: ``grad.float()``,
      then contiguous buckets): ``pending_units`` of the largest unit (the runtime
      collects earlier units' reduce-scatters at each unit's post-backward), or
      every sharded unit when ``pending_units`` is None. In fp32 the running
      unit's gradient is its own reduce-scatter input and is not counted twice.
    """
    root = sizes.trainable_all.get(ROOT, 0)
    largest_all = max(sizes.trainable_all.values(), default=0)
    largest_sharded = max(sizes.trainable_sharded.values(), default=0)
    if pending_units is None:
        pending = 4 * sum(sizes.trainable_sharded.values())
    else:
        pending = 4 * largest_sharded * pending_units
    running = compute_bytes * largest_all if (compute_bytes != 4 or not largest_sharded) else 0
    return compute_bytes * root + running + pending


def comm_buffer_bytes(
    sizes: UnitSizes,
    compute_bytes: int,
    sdp_degree: int,
    *,
    hierarchical_hosts: int,
) -> int:
    """Staging buffers of the parameter all-gather (``smsdp/comm/collectives.py``).

    - Hierarchical (the sharding group spans ``H`` hosts): stage 1 gathers ``H``
      shards of the largest unit, stage 2 a whole unit before the re-layout:
      ``c * (H*U/d + U)``.
    - Otherwise (the backend's all-gather straight into the output, the
      SMDDP-style path included): nothing; NCCL's own buffers are part of the
      framework overhead.
    """
    largest = max(sizes.gathered.values(), default=0)
    if sdp_degree <= 1 or not largest:
        return 0
    if hierarchical_hosts > 1:
        return compute_bytes * (hierarchical_hosts * largest // sdp_degree + largest)
    return 0


def optimizer_step_temp_bytes(groups: list[GroupLayout], foreach: bool) -> int:
    """fp32 temporaries of the step: AdamW's foreach path (CUDA) materializes one full
    copy of the local shards (``sqrt(exp_avg_sq)``); the single-tensor path (CPU) one
    parameter at a time; the gradient-norm ``pow(2)`` one group at a time."""
    trainable = [g.shard for g in groups if g.trainable]
    if not trainable:
        return 0
    return 4 * (sum(trainable) if foreach else max(trainable))


def construction_bytes(num_params: int, state: ModelState, sizes: UnitSizes, delayed: bool, is_gpu: bool) -> int:
    """Building the model: eagerly, the whole fp32 model is moved to the device before it is
    sharded (``4N`` + the shards). With delayed initialization (``smsdp/core/delayed_init.py``) the
    construction is replayed on the CPU one unit at a time: the device only ever holds shards,
    and a CPU rank holds the shards plus one unit in fp32."""
    if not delayed:
        return 4 * num_params + state.params
    if is_gpu:
        return state.params
    largest = max((sizes.gathered.get(u, 0) + sizes.replicated.get(u, 0) for u in sizes.gathered), default=0)
    return state.params + 4 * largest


# ------------------------------------------------------------------------------ result


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per rank. ``peak`` is the largest of the three phases below.

    - training (forward/backward): everything but the step temporaries, summed
      (conservative: gradients and the reduce-scatter buffers are counted
      although they peak late in backward, when most activations are freed);
    - optimizer step: model state + step temporaries;
    - construction: without delayed parameter initialization the whole model
      is built in fp32 on every rank before it is sharded (``4N``); with it,
      one unit at a time on the CPU (see :func:`construction_bytes`).
    """

    parameters: int
    gradients: int
    optimizer_state: int
    unsharded_params: int
    unsharded_grads: int
    activations: int | None
    communication_buffers: int
    framework_overhead: int
    optimizer_step_temp: int
    construction: int
    kept_slices: int = 0  # sdp_reshard_after_forward=k: 1/k of each unit, from its forward to its backward
    offload_copies: int = 0  # sdp_offload: shard copies on the device (smsdp.planner.offload)
    host_shared: int = 0  # sdp_offload on a CPU rank: the offloaded state, in this same memory

    @property
    def model_state(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def training_phase(self) -> int:
        return (
            self.model_state
            + self.unsharded_params
            + self.kept_slices
            + self.unsharded_grads
            + (self.activations or 0)
            + self.communication_buffers
            + self.framework_overhead
            + self.offload_copies
            + self.host_shared
        )

    @property
    def step_phase(self) -> int:
        offloaded = self.offload_copies + self.host_shared
        return self.model_state + self.optimizer_step_temp + self.framework_overhead + offloaded

    @property
    def construction_phase(self) -> int:
        return self.construction + self.framework_overhead

    @property
    def peak(self) -> int:
        return max(self.training_phase, self.step_phase, self.construction_phase)

    @property
    def peak_phase(self) -> str:
        phases = {
            "forward/backward": self.training_phase,
            "optimizer step": self.step_phase,
            "model construction": self.construction_phase,
        }
        return max(phases, key=phases.__getitem__)
