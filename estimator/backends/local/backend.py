"""The local backend: a job directory shaped like /opt/ml and mpirun on this machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence

import estimator.interrupts as interrupts
from estimator.backends.base import AttachedJob, Backend
from estimator.backends.local.job import LocalJob
from estimator.backends.local.mpirun import mpirun_argv, require_mpirun
from estimator.backends.local.request import LocalRequest
from estimator.backends.supervised.attach import estimator_kwargs, find_job_dir
from estimator.backends.supervised.container_env import (
    container_env,
    hyperparameter_args,
    process_env,
    submitter_environment,
)
from estimator.backends.supervised.host_restart import DEFAULT_MAX_RESTARTS, HOST_VARIABLES, host_restart_argv
from estimator.backends.supervised.job_dir import JobDir, write_job_text
from estimator.backends.supervised.launch import create_job_dir
from estimator.backends.supervised.layout import describe_spec, job_root, plan_job_dir, source_root
from estimator.backends.supervised.process_session import JOB_MARKER
from estimator.backends.supervised.status import SecondaryStatus, StatusRecord, write_status
from estimator.backends.supervised.supervisor import hold_stop_signals
from estimator.backends.supervised.torchrun import LOG_SUBDIR, standalone_rendezvous, torchrun_argv
from estimator.job import JobStatus
from estimator.redact import is_secret
from estimator.spec import JobSpec
from smsdp.config import TORCHRUN

SUPERVISOR_MODULE = "estimator.backends.local.supervisor"
JOB_UMASK = 0o077  # what the supervisor, mpirun and every rank create is the owner's alone


class LocalBackend(Backend[LocalRequest]):
    stop_on_interrupt = True  # the job runs on the user's own cores

    def dry_run(self, spec: JobSpec) -> LocalRequest:
        root = job_root(spec)
        job = JobDir(root)
        env = {
            **process_env(spec, source_root()),
            **spec.environment,  # the user's word wins over our process defaults...
            **container_env(spec, job),  # ...but never over the container contract
            JOB_MARKER: str(root),  # every process of the job carries it (process_session)
        }
        script_argv = [spec.code.entry_point, *hyperparameter_args(dict(spec.hyperparameters))]
        custom_options, custom_env = _values_off_the_command_line(spec.custom_mpi_options)
        env = {**custom_env, **env}
        if spec.launcher == TORCHRUN:  # one torchrun for the simulated hosts, as one mpirun runs them all
            log_dir = job.logs / LOG_SUBDIR
            argv = torchrun_argv(1, spec.world_size, standalone_rendezvous(), log_dir, script_argv)
        elif spec.runtime.parameters.sdp_fault_tolerant_replicas:  # one mpirun per host: a failed host restarts alone
            pph = spec.runtime.processes_per_host
            per_host = mpirun_argv(pph, [*env.keys(), *HOST_VARIABLES], custom_options, script_argv)
            argv = host_restart_argv(spec.runtime.instance_count, pph, per_host, DEFAULT_MAX_RESTARTS)
        else:
            argv = mpirun_argv(spec.world_size, env.keys(), custom_options, script_argv)
        return LocalRequest(
            job_name=spec.job_name,
            argv=tuple(argv),
            env=env,
            cwd=job.code,
            job_dir=plan_job_dir(spec, root),
            description=describe_spec(spec, argv, env),
            max_run_s=spec.max_run_s,
            world_size=spec.world_size,
        )

    def launch(self, request: LocalRequest) -> LocalJob:
        require_mpirun(request.argv[0])
        # A Ctrl-C while the job directory is made (its code copy can be long) removes it: JobDirPlan.create.
        job = create_job_dir(request.job_dir, request.job_name, request.description)
        # From then to the handle's return a Ctrl-C waits (estimator.interrupts): raised in between, it would
        # leave a job running that nobody holds, or one without its argv.
        with interrupts.critical():
            try:
                supervisor = _start_supervisor(job, request.env, request.argv)
            except Exception as exc:  # no fork, no memory: the job must not stay "Starting" for ever
                write_status(
                    job.status_file,
                    StatusRecord.starting().moved_to(
                        JobStatus.FAILED,
                        SecondaryStatus.FAILED,
                        failure_reason=f"the supervisor did not start: {exc!r}",
                    ),
                )
                raise
            return LocalJob(job.root, supervisor=supervisor)

    def attach(self, job_name: str, output_path: str | None = None) -> AttachedJob:
        """The job under ``output_path``; without one, under ./smsdp-jobs or any output path used before."""
        root = find_job_dir(job_name, output_path)
        kwargs, missing = estimator_kwargs(root)
        return AttachedJob(LocalJob(root), kwargs, missing)


def _values_off_the_command_line(options: tuple[str, ...]) -> tuple[list[str], dict[str, str]]:
    """A secret ``-x NAME=VALUE`` in custom_mpi_options becomes ``-x NAME`` plus NAME=VALUE in
    mpirun's environment: secret values never sit on a command line or in job.json."""
    argv, env = [], {}
    for i, word in enumerate(options):
        name, sep, value = word.partition("=")
        if i and options[i - 1] in ("-x", "--x") and sep and name and is_secret(name, value):
            env[name] = value
            word = name
        argv.append(word)
    return argv, env


def _start_supervisor(job: JobDir, env: Mapping[str, str], argv: Sequence[str]) -> subprocess.Popen:
    """The supervisor, detached; the real argv (secrets unredacted) goes through its stdin, not a file."""
    # Owner-only (0600 files, 0700 directories) for the job's logs, status, outputs and checkpoints.
    log_fd = os.open(job.supervisor_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with open(log_fd, "ab") as supervisor_log:
        supervisor = subprocess.Popen(
            [sys.executable, "-m", SUPERVISOR_MODULE, str(job.root)],
            env={**submitter_environment(), **env},  # not this process's own rank variables
            cwd=job.root,
            stdin=subprocess.PIPE,
            stdout=supervisor_log,
            stderr=subprocess.STDOUT,
            umask=JOB_UMASK,
            start_new_session=True,  # the job outlives this process, like a SageMaker job
            preexec_fn=hold_stop_signals,  # stop() at once after the start is a stop, not the supervisor's death
        )
    assert supervisor.stdin is not None
    with supervisor.stdin:
        supervisor.stdin.write(json.dumps(list(argv)).encode())
    write_job_text(job.pid_file, str(supervisor.pid))
    return supervisor
