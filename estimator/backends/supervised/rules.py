"""The Estimator rules of jobs whose files are a job directory on this machine or a file system it sees: no S3."""

from __future__ import annotations

from typing import Any

from estimator.backends.base import JobRules
from estimator.backends.supervised.known_paths import check_local_output_path
from estimator.spec import S3_SCHEME
from estimator.validation import check_checkpoint_uri, problem
from smsdp.config.instance_types import LOCAL


class JobDirRules(JobRules):
    jobs_name = "local jobs"

    def config_instance_type(self, instance_type: str) -> str:
        return LOCAL

    def check_output_path(self, output_path: Any, instance_type: str) -> str:
        return check_local_output_path(output_path)

    def check_checkpoint_uri(self, uri: Any, instance_type: str) -> str | None:
        text = check_checkpoint_uri(uri)
        if text is not None and text.startswith(S3_SCHEME):
            raise problem(
                "checkpoint_s3_uri",
                "is in S3 but local jobs keep checkpoints on this machine; use 'file:///some/dir' to keep them "
                "across jobs",
                text,
            )
        return text
