"""SageMaker jobs: ``ml.*`` instance types, submitted with the SageMaker Python SDK v2.

Importing this package imports neither the SDK nor boto3 (they come with the
``sagemaker`` extra and are imported when a job needs them).
"""

from estimator.backends.sagemaker.backend import SageMakerBackend
from estimator.backends.sagemaker.job import SageMakerJob
from estimator.backends.sagemaker.request import SageMakerRequest

__all__ = ["SageMakerBackend", "SageMakerJob", "SageMakerRequest"]
