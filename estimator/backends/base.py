"""The backend seam: ``launch(dry_run(spec))``, torchx-style.

A backend turns a validated ``JobSpec`` into a typed, printable request
without side effects (``dry_run``), and a request into a running ``Job``
(``launch``). ``attach`` finds a job started earlier. Backends are imported
lazily (see ``estimator.backends.backend_for``) so the client pays only for
the one it uses.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from estimator.job import Job
from estimator.spec import JobSpec

RequestT = TypeVar("RequestT")


@dataclass(frozen=True)
class AttachedJob:
    """A job found by name, plus the Estimator arguments that describe it."""

    job: Job
    estimator_kwargs: dict[str, Any] = field(default_factory=dict)


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
