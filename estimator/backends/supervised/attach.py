"""Find a job directory by job name, and the Estimator arguments that describe its job.

Every backend that lays out a job directory (local, Slurm) attaches the same
way: the directory is under ``output_path`` (or, without one, under
``./smsdp-jobs`` or an output path a job was started in before), and its
``job.json`` says which backend ran it and how to build its Estimator again.

The job directory keeps no secret value (``job.json`` has them redacted), except,
while the job runs, the container contract itself: ``hyperparameters.json``, the
script's input, holds the real hyperparameters until the job ends
(``hyperparameters_file.py``), and attach takes them from there. A secret
``environment`` value (or one in ``custom_mpi_options``), or a secret
hyperparameter of a job that ended, is nowhere: the arguments come back with it
``missing``, and re-running the job asks for it again rather than running with
``********``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from estimator.backends.supervised.hyperparameters_file import decoded
from estimator.backends.supervised.job_dir import JobDir, read_json
from estimator.backends.supervised.known_paths import check_local_output_path, places_to_look
from estimator.backends.supervised.layout import OWN_SECTION
from estimator.redact import REDACTED
from estimator.validation import check_job_name, problem
from smsdp.config.instance_types import LOCAL


def find_job_dir(job_name: str, output_path: str | None = None) -> Path:
    """The job directory of ``job_name``; ``ConfigError`` naming every place looked in. A name, never a
    path: ``../jobs/j1``, ``/abs/j1`` or ``..`` would find directories no job of this name made."""
    check_job_name(job_name)
    places = [Path(check_local_output_path(output_path))] if output_path is not None else places_to_look()
    found = [place / job_name for place in places if JobDir(place / job_name).description_file.is_file()]
    if not found:
        empty = [str(place / job_name) for place in places if (place / job_name).is_dir()]
        why = f"; {', '.join(empty)} exists but holds no job.json (its creation was interrupted)" if empty else ""
        raise problem("job_name", f"is not a local job: looked in {', '.join(map(str, places))}{why}", job_name)
    return found[0]


def recorded_backend(root: Path) -> str:
    """The name of the backend that ran the job in ``root`` (jobs of older versions: local)."""
    description = read_json(JobDir(root).description_file)
    backend = description.get(OWN_SECTION, {}).get("Backend") or description.get("ResourceConfig", {}).get(
        "InstanceType"
    )
    return str(backend or LOCAL)


def estimator_kwargs(root: Path) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The Estimator arguments of the job in ``root`` (the code that ran, even if the original moved),
    and those the job directory holds only redacted (``environment['HF_TOKEN']``)."""
    own = read_json(JobDir(root).description_file)[OWN_SECTION]
    hyperparameters = decoded(JobDir(root))
    redacted = tuple(own.get("Redacted", ()))
    if hyperparameters is None:
        hyperparameters = own["HyperParameters"]
    else:  # still there unless the job ended and its secrets were blanked
        kept = {f"hyperparameters[{name!r}]" for name, value in hyperparameters.items() if value != REDACTED}
        redacted = tuple(name for name in redacted if name not in kept)
    kwargs = {
        "entry_point": own["EntryPoint"],
        "source_dir": str(JobDir(root).code),
        "instance_type": LOCAL,
        "instance_count": own["InstanceCount"],
        "distribution": own["Distribution"],
        "hyperparameters": hyperparameters,
        "environment": own["Environment"],
        "output_path": str(root.parent),
        "checkpoint_s3_uri": own.get("CheckpointS3Uri"),
        "checkpoint_local_path": own.get("CheckpointLocalPath"),
        "max_run": own["MaxRun"],
        "collective_timeout": own.get("CollectiveTimeout"),
        "max_retry_attempts": own.get("MaxRetryAttempts"),
    }
    kwargs.update(_tensorboard_output(read_json(JobDir(root).description_file)))
    return kwargs, redacted


def _tensorboard_output(description: dict[str, Any]) -> dict[str, Any]:
    """The directory the job's ``tensorboard_output_config`` named (its events are in <dir>/<job>), if any."""
    uri = description.get("TensorBoardOutputConfig", {}).get("S3OutputPath")
    return {"tensorboard_output_config": {"S3OutputPath": uri}} if uri else {}
