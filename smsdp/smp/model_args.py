"""The keyword arguments of SMP v1's ``DistributedModel`` that have no meaning in smsdp.

SMP scripts pass them (``trace_device="gpu"``, ``overlapping_allreduce=True``, ...);
smsdp accepts every one, and logs once at INFO why it changes nothing here.
``backward_passes_per_step`` and ``average_grads_across_microbatches`` do have a
meaning and are real parameters of ``DistributedModel``.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("smsdp")

WHY_NO_EFFECT = {
    "trace_device": "smsdp does not trace the model to partition it (no pipeline parallelism)",
    "trace_execution_times": "smsdp does not trace the model to partition it (no pipeline parallelism)",
    "trace_execution_timeout": "smsdp does not trace the model to partition it (no pipeline parallelism)",
    "trace_memory_usage": "smsdp does not trace the model to partition it (no pipeline parallelism)",
    "overlapping_allreduce": "gradient reduce-scatters always overlap the backward; the replica all-reduce "
    "overlaps it when backward_passes_per_step is given",
    "bucket_cap_mb": "gradient buckets are sized by the sdp_reduce_bucket_size parameter",
    "broadcast_buffers": "buffers are broadcast from rank 0 once, when the model is wrapped",
    "gradient_as_bucket_view": "gradients already live in one flat buffer per unit, never copied into buckets",
}
_logged: set[str] = set()


def check_no_effect_kwargs(kwargs: dict[str, Any]) -> None:
    """Refuse unknown keywords (TypeError, as Python would); log the known no-effect ones once."""
    unknown = sorted(set(kwargs) - set(WHY_NO_EFFECT))
    if unknown:
        raise TypeError(
            f"DistributedModel got unexpected keyword argument(s) {unknown}; SMP v1's keywords are "
            f"{sorted(WHY_NO_EFFECT) + ['average_grads_across_microbatches', 'backward_passes_per_step']} "
            "plus smsdp's own (transformer_layer_cls, prefetch_units, broadcast_init, keep_gathered_for_backward)"
        )
    for name in sorted(kwargs):
        if name not in _logged:
            _logged.add(name)
            logger.info("DistributedModel(%s=%r) has no effect in smsdp: %s", name, kwargs[name], WHY_NO_EFFECT[name])
