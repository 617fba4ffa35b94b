"""The SageMaker backend: ``ml.*`` instance types become real SageMaker training jobs.

``dry_run(spec)`` checks every option and builds the CreateTrainingJob request
and the source bundle without calling AWS (the SDK is imported only to look up
the PyTorch image when no ``image_uri`` is given). ``launch(request)`` checks
credentials and buckets, then lets the SageMaker Python SDK upload the source
dir and create the job, and returns its handle at once.
"""

from __future__ import annotations

import importlib.util
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from estimator.backends import BackendUnavailable
from estimator.backends.base import AttachedJob, Backend
from estimator.backends.sagemaker import sdk3_trainer
from estimator.backends.sagemaker.attach import attach_job
from estimator.backends.sagemaker.aws_session import (
    code_uri,
    default_output_path,
    default_sagemaker_session,
    resolve_image,
    resolve_region,
)
from estimator.backends.sagemaker.environment import custom_mpi_options, job_environment
from estimator.backends.sagemaker.images import choose_image
from estimator.backends.sagemaker.job import SageMakerJob, job_from_session
from estimator.backends.sagemaker.options import RemoteOptions
from estimator.backends.sagemaker.preflight import check_before_upload, check_credentials
from estimator.backends.sagemaker.request import SageMakerRequest
from estimator.backends.sagemaker.sdk import submit_module
from estimator.backends.sagemaker.sdk3_trainer import torchrun_request
from estimator.backends.sagemaker.source_bundle import ENTRY_SCRIPT, plan_bundle
from estimator.backends.sagemaker.training_request import ResolvedJob, create_training_job_request
from estimator.spec import JobSpec
from estimator.validation import problem
from smsdp.config import TORCHRUN, ConfigError


class SageMakerBackend(Backend[SageMakerRequest]):
    stop_on_interrupt = False  # Ctrl-C stops waiting; the job runs on in SageMaker, as with the SDK

    def check_options(self, options: Mapping[str, Any]) -> None:
        """An image (``framework_version`` or ``image_uri``) whose torch smsdp does not support."""
        choose_image(options.get("image_uri"), options.get("framework_version"), options.get("py_version"))

    def dry_run(self, spec: JobSpec) -> SageMakerRequest:
        options = RemoteOptions.from_spec(spec)
        bundle = plan_bundle(spec, options)
        region = resolve_region(options.sagemaker_session)
        environment = job_environment(spec)
        mpi = {
            "enabled": True,
            "processes_per_host": spec.runtime.processes_per_host,
            "custom_mpi_options": custom_mpi_options(environment, _user_mpi_options(spec)),
        }
        output_path = spec.output_path or default_output_path(region)
        image = resolve_image(options, region, spec.instance_type)
        resolved = ResolvedJob(
            region=region,
            image_uri=image["uri"],
            image=image,
            output_path=output_path,
            code_uri=code_uri(spec.job_name, output_path, options.code_location),
            entry_script=ENTRY_SCRIPT,
            environment=environment,
            mpi=mpi,
        )
        if spec.launcher == TORCHRUN:  # SMP v2, SDK 3's Torchrun: SDK 3's ModelTrainer starts it
            request = torchrun_request(spec, options, resolved)
        else:
            request = create_training_job_request(spec, options, resolved)
        return SageMakerRequest(spec, options, resolved, bundle, request)

    def launch(self, request: SageMakerRequest) -> SageMakerJob:
        session = request.options.sagemaker_session or default_sagemaker_session(request.region)
        check_before_upload(request, session)
        if request.spec.launcher == TORCHRUN:
            _submit_through_sdk3(request, session)
        else:
            submit_module().submit(request, session)
        return job_from_session(request.job_name, session)

    def attach(self, job_name: str, output_path: str | None = None, sagemaker_session: Any = None) -> AttachedJob:
        """The SageMaker job ``job_name`` (``output_path`` is not needed: SageMaker knows it)."""
        try:
            if sagemaker_session is None:
                sagemaker_session = default_sagemaker_session(resolve_region())
            check_credentials(sagemaker_session.boto_session)
        except ConfigError as exc:  # most likely a local job's name, mistyped
            raise problem(
                "job_name",
                "is not a local job under output_path (default ./smsdp-jobs), and "
                f"SageMaker cannot be asked about it: {exc}",
                job_name,
            ) from None
        return attach_job(job_name, sagemaker_session)


def _submit_through_sdk3(request: SageMakerRequest, session: Any) -> None:
    if importlib.util.find_spec(sdk3_trainer.SDK3_TRAIN) is None:
        raise BackendUnavailable(
            "a torchrun job (SMP v2, Torchrun(...), torch_distributed) on SageMaker is started by SDK 3's "
            "ModelTrainer, which is not installed: pip install 'sagemaker>=3' (or sagemaker-train); or launch "
            "with mpirun: MPI(...) / distribution={'mpi': {...}}"
        )
    with tempfile.TemporaryDirectory(prefix=f"smsdp-{request.job_name}-") as staging:
        code_dir = request.bundle.write_to(Path(staging) / "code")
        sdk3_trainer.submit(request, session, str(code_dir))


def _user_mpi_options(spec: JobSpec) -> str:
    return spec.custom_mpi_options_text
