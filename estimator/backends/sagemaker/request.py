"""``SageMakerRequest``: everything a SageMaker launch will do, as printable data."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from estimator.backends.sagemaker.options import RemoteOptions
from estimator.backends.sagemaker.source_bundle import SourceBundle
from estimator.backends.sagemaker.training_request import ResolvedJob
from estimator.redact import Scrubber, redact_env
from estimator.spec import JobSpec


@dataclass(frozen=True)
class SageMakerRequest:
    """The CreateTrainingJob request, the source dir to upload, and what built them.

    ``str()`` is YAML (secrets in ``Environment`` redacted); ``to_dict()`` /
    ``to_json()`` / ``to_yaml()`` give the same for tools. Where the request
    has ``<account-id>`` the value is only known at launch (the SDK's default
    bucket, used when no ``output_path`` is given).
    """

    spec: JobSpec
    options: RemoteOptions
    resolved: ResolvedJob
    bundle: SourceBundle
    create_training_job: Mapping[str, Any]

    @property
    def job_name(self) -> str:
        return self.spec.job_name

    @property
    def region(self) -> str:
        return self.resolved.region

    @property
    def output_path_is_default(self) -> bool:
        return not self.spec.output_path

    @property
    def inputs(self) -> dict[str, str]:
        """``fit()``'s channels: name -> s3:// URI."""
        return {channel.name: channel.uri for channel in self.spec.channels}

    def to_dict(self) -> dict[str, Any]:
        request = copy.deepcopy(dict(self.create_training_job))
        # Secret values also hide in custom_mpi_options (-x NAME=VALUE) and anywhere else they were pasted.
        scrub = Scrubber.from_environment(request["Environment"], self.spec.custom_mpi_options)
        request = scrub.tree({**request, "Environment": redact_env(request["Environment"])})
        return {
            "CreateTrainingJob": request,
            "Image": dict(self.resolved.image),
            "SourceDir": {"upload_to": self.resolved.code_uri, **self.bundle.summary()},
        }

    def to_json(self, indent: int = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, width=110, default_flow_style=False)

    def __str__(self) -> str:
        runtime = self.spec.runtime
        header = (
            f"SageMaker training job {self.job_name} in {self.region}: {runtime.instance_count} x "
            f"{runtime.instance_type}, {runtime.processes_per_host} processes per host "
            f"({runtime.world_size} ranks), running {self.bundle.entry_point} under smsdp's launcher"
        )
        return header + "\n" + self.to_yaml()

    def _repr_pretty_(self, printer, cycle) -> None:  # IPython shows str(), not the dataclass repr
        printer.text(str(self))
