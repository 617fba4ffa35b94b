"""The two `distribution=` examples of the SageMaker sharded-data-parallelism docs, as pasted.

Shared by the config tests (they must validate) and the SageMaker request tests (they must
make valid CreateTrainingJob requests).
"""

from __future__ import annotations


def docs_p3_distribution() -> dict:
    # Verbatim from "How to Apply Sharded Data Parallelism to Your Training Job",
    # https://docs.aws.amazon.com/sagemaker/latest/dg/model-parallel-extended-features-pytorch-sharded-data-parallelism.html
    smp_options = {
        "enabled": True,
        "parameters": {
            # "pipeline_parallel_degree": 1,    # Optional, default is 1
            # "tensor_parallel_degree": 1,      # Optional, default is 1
            "ddp": True,
            # parameters for sharded data parallelism
            "sharded_data_parallel_degree": 2,  # Add this to activate sharded data parallelism
            "sdp_reduce_bucket_size": int(5e8),  # Optional
            "sdp_param_persistence_threshold": int(1e6),  # Optional
            "sdp_max_live_parameters": int(1e9),  # Optional
            "sdp_hierarchical_allgather": True,  # Optional
            "sdp_gradient_clipping": 1.0,  # Optional
        },
    }

    mpi_options = {
        "enabled": True,  # Required
        "processes_per_host": 8,  # Required
    }
    return {"smdistributed": {"modelparallel": smp_options}, "mpi": mpi_options}


def docs_p4d_distribution() -> dict:
    # Verbatim from "Sharded data parallelism with SMDDP Collectives", same page,
    # except for ONE added comma after 64: the docs' dict is missing it (a SyntaxError as printed).
    smp_options = {
        "enabled": True,
        "parameters": {
            "partitions": 1,
            "ddp": True,
            "sharded_data_parallel_degree": 64,  # comma missing in the docs
            "bf16": True,
            "ddp_dist_backend": "auto",  # Specify "nccl" to force to use NCCL.
        },
    }

    mpi_options = {
        "enabled": True,  # Required
        "processes_per_host": 8,  # Required
    }
    return {"smdistributed": {"modelparallel": smp_options}, "mpi": mpi_options}
