"""The backend seam: ``launch(dry_run(spec))``, torchx-style, and the rules a backend adds to the Estimator's.

A backend turns a validated ``JobSpec`` into a typed, printable request
without side effects (``dry_run``), and a request into a running ``Job``
(``launch``). ``attach`` finds a job started earlier. Backends are imported
lazily (see ``estimator.backends.backend_for``) so the client pays only for
the one it uses. What differs between backends while the Estimator is being
built (where job files may go, an argument only one backend takes) is a
``JobRules``, light to import, so that bad input is refused before anything runs.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from estimator.job import Job
from estimator.spec import S3_SCHEME, JobSpec
from estimator.validation import check_checkpoint_uri, local_directory, output_path_text, problem

RequestT = TypeVar("RequestT")


@dataclass(frozen=True)
class AttachedJob:
    """A job found by name, plus the Estimator arguments that describe it.

    ``missing``: arguments the job kept only redacted (``environment['HF_TOKEN']``): a re-run needs
    them given again (``Estimator.attach(name, environment={...})``)."""

    job: Job
    estimator_kwargs: dict[str, Any] = field(default_factory=dict)
    missing: tuple[str, ...] = ()


class Backend(abc.ABC, Generic[RequestT]):
    """Where jobs run. One instance per Estimator call; keep no job state here."""

    #: Ctrl-C while ``fit()`` waits stops the job (True for jobs on this machine).
    stop_on_interrupt: bool = False

    def check_options(self, options: Mapping[str, Any]) -> None:
        """Check, when the Estimator is built, the backend-only arguments that need no job spec.

        Raises ``ConfigError`` naming the argument. Most are checked by ``dry_run``; this is for
        what must fail before anything else is done (a SageMaker image whose torch is too old)."""

    @abc.abstractmethod
    def dry_run(self, spec: JobSpec) -> RequestT:
        """Everything ``launch`` will do, as data; reads but never writes anything."""

    @abc.abstractmethod
    def launch(self, request: RequestT) -> Job:
        """Start the job the request describes and return its handle at once."""

    @abc.abstractmethod
    def attach(self, job_name: str, output_path: str | None = None) -> AttachedJob:
        """The job called ``job_name`` (and how to rebuild its Estimator)."""


class JobRules:
    """A backend's part in building an Estimator; the defaults are SageMaker's (``ml.*`` instance types)."""

    #: The Estimator argument only this backend takes (``"slurm_options"``), if any.
    option_argument: str | None = None
    #: ``fit()`` checks that the job fits in memory (the planner knows the machine or instance type).
    checks_memory: bool = True
    #: What this backend's jobs are called in messages ("Slurm jobs").
    jobs_name: str = "SageMaker jobs"

    def config_instance_type(self, instance_type: str) -> str:
        """The instance type the job's config is checked for."""
        return instance_type

    def check_output_path(self, output_path: Any, instance_type: str) -> str:
        """``output_path``, made absolute or checked ("": the session's default bucket); ``ConfigError`` naming it."""
        text = output_path_text(output_path)
        if text is None:
            return ""
        return text if text.startswith(S3_SCHEME) else local_directory(text)

    def check_checkpoint_uri(self, uri: Any, instance_type: str) -> str | None:
        """``checkpoint_s3_uri``, checked; ``ConfigError`` naming it."""
        return check_checkpoint_uri(uri)

    def check_environment_names(self, environment: Any) -> None:
        """Refuse variables this backend's own tools read (``ConfigError`` naming each)."""

    def check_option(self, value: Any, instance_type: str) -> Any:
        """The checked value of ``option_argument``; called for any backend whose rules own it."""
        if value is None:
            return None
        raise problem(
            self.option_argument or "options",
            f"applies to {self.jobs_name} only, and instance_type is {instance_type!r}",
            value,
        )
