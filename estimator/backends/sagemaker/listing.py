"""The SageMaker training jobs whose output is under an S3 URI: ``smsdp jobs --output-path s3://...``.

SageMaker has no listing by output path: the newest training jobs of the region are listed
(``ListTrainingJobs``, newest first, at most ``MAX_LISTED``) and each one's
``OutputDataConfig.S3OutputPath`` is read (``DescribeTrainingJob``), as the console would.
"""

from __future__ import annotations

from typing import Any

from estimator.backends.sagemaker.aws_session import default_sagemaker_session, resolve_region
from estimator.backends.sagemaker.preflight import check_credentials

MAX_LISTED = 100  # newest jobs looked at: one DescribeTrainingJob call each
LOSS_METRIC = "train:loss"  # smsdp's metric definition for the progress line's loss


def training_jobs_under(output_path: str, sagemaker_session: Any = None, limit: int = MAX_LISTED) -> list[dict]:
    """``DescribeTrainingJob`` of each of the newest ``limit`` jobs whose output path is ``output_path`` or below."""
    if sagemaker_session is None:
        sagemaker_session = default_sagemaker_session(resolve_region())
    check_credentials(sagemaker_session.boto_session)
    client = sagemaker_session.sagemaker_client
    under = output_path.rstrip("/") + "/"
    found = []
    pages = client.get_paginator("list_training_jobs").paginate(
        SortBy="CreationTime", SortOrder="Descending", PaginationConfig={"MaxItems": limit}
    )
    for page in pages:
        for summary in page["TrainingJobSummaries"]:
            described = client.describe_training_job(TrainingJobName=summary["TrainingJobName"])
            if (described["OutputDataConfig"]["S3OutputPath"].rstrip("/") + "/").startswith(under):
                described.pop("ResponseMetadata", None)
                found.append(described)
    return found


def final_loss(described: dict) -> float | None:
    """The last loss SageMaker's metric definitions captured (``FinalMetricDataList``), if any."""
    values = [m["Value"] for m in described.get("FinalMetricDataList", []) if m.get("MetricName") == LOSS_METRIC]
    return float(values[-1]) if values else None
