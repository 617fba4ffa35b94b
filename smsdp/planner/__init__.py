"""The planner: will a MiCS job fit, what would fit, and how fast would it run.

Pure Python (pydantic and the standard library), so the client imports it
without torch::

    from smsdp.planner import ModelSpec, plan
    p = plan(ModelSpec.gpt(n_layer=96, d_model=12288, n_head=96, vocab_size=50257, seq_len=2048),
             instance_type="ml.p4d.24xlarge", instance_count=32, batch_size=1,
             parameters={"sharded_data_parallel_degree": 256, "bf16": True,
                         "activation_checkpointing": True, "delayed_parameter_initialization": True})
    print(p)                        # memory table, communication, step time, recommendation
    p.fits, p.recommendation.sharded_degree, p.to_dict()

The client's ``smsdp plan`` command and ``Estimator.plan()`` are the user-facing
doors. ``docs/planner.md`` states every formula and constant.
"""

from smsdp.planner.hardware import Assumptions, Hardware
from smsdp.planner.model_spec import ROOT, ModelSpec, ParamTensor, TransformerShape
from smsdp.planner.plan import plan, plan_runtime
from smsdp.planner.result import DoesNotFitError, Plan, PlanError, Recommendation

__all__ = [
    "ROOT",
    "Assumptions",
    "DoesNotFitError",
    "Hardware",
    "ModelSpec",
    "ParamTensor",
    "Plan",
    "PlanError",
    "Recommendation",
    "TransformerShape",
    "plan",
    "plan_runtime",
]
