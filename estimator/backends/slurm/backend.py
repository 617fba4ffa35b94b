"""The Slurm backend: the local job directory under a shared ``output_path``, ``sbatch``, ``srun``.

``dry_run`` is pure: it reads the spec and writes nothing (the batch script is
data in the request). ``launch`` checks the cluster first (``preflight``),
lays out the job directory exactly as a local job's, writes the batch script
into it and submits it with ``sbatch``. The batch script runs the Slurm
supervisor on the job's first node, which starts the ranks with ``srun``.
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from pathlib import Path

import estimator.backends.slurm.scheduler as scheduler
from estimator import interrupts
from estimator.backends.base import AttachedJob, Backend
from estimator.backends.slurm.job import SlurmJob
from estimator.backends.slurm.job_files import BATCH_SCRIPT, JOB_ID_FILE, LAUNCH_ARGV_VARIABLE, SLURM_OUTPUT
from estimator.backends.slurm.options import OWNED_SBATCH_VARIABLES, SLURM, gpus_per_node, sbatch_lines
from estimator.backends.slurm.request import SlurmRequest
from estimator.backends.slurm.srun import srun_argv, torchrun_srun_argv
from estimator.backends.supervised.attach import estimator_kwargs, find_job_dir
from estimator.backends.supervised.container_env import (
    container_env,
    hyperparameter_args,
    process_env,
    submitter_environment,
)
from estimator.backends.supervised.host_restart import (
    DEFAULT_MAX_RESTARTS,
    HOST_PLACEHOLDER,
    host_restart_argv,
)
from estimator.backends.supervised.job_dir import JobDir, read_json, write_job_text
from estimator.backends.supervised.launch import create_job_dir
from estimator.backends.supervised.layout import OWN_SECTION, describe_spec, job_root, plan_job_dir, source_root
from estimator.spec import JobSpec
from estimator.validation import problem
from smsdp.config import TORCHRUN
from smsdp.config.cluster import SIMULATED_HOSTS_ENV

SUPERVISOR_MODULE = "estimator.backends.slurm.supervisor"
#: Set per node by the launcher or the supervisor, not from the submitting machine.
_PER_NODE = ("OMP_NUM_THREADS", SIMULATED_HOSTS_ENV)


class SlurmBackend(Backend[SlurmRequest]):
    stop_on_interrupt = False  # the job runs on the cluster: Ctrl-C stops waiting, not the job

    def dry_run(self, spec: JobSpec) -> SlurmRequest:
        root = job_root(spec)
        if spec.custom_mpi_options:
            raise problem(
                ("distribution", "mpi", "custom_mpi_options"),
                "are mpirun options, and Slurm jobs start their ranks with srun; "
                "pass sbatch options in slurm_options instead",
                spec.custom_mpi_options_text,
            )
        job = JobDir(root)
        env = {**process_env(spec, source_root()), **spec.environment, **container_env(spec, job)}
        env = {name: value for name, value in env.items() if name not in _PER_NODE}
        options: dict[str, str | bool] = dict(spec.backend_options.get("slurm_options") or {})
        runtime = spec.runtime
        script_argv = [spec.code.entry_point, *hyperparameter_args(dict(spec.hyperparameters))]
        launch = torchrun_srun_argv if spec.launcher == TORCHRUN else srun_argv
        srun = launch(runtime.instance_count, runtime.processes_per_host, root, script_argv)
        if runtime.parameters.sdp_fault_tolerant_replicas:  # one srun step per node: a failed node restarts alone
            per_node = srun_argv(1, runtime.processes_per_host, root, script_argv)
            per_node[1:1] = [f"--relative={HOST_PLACEHOLDER}"]
            srun = host_restart_argv(
                runtime.instance_count, runtime.processes_per_host, per_node, DEFAULT_MAX_RESTARTS, labels="srun"
            )
        description = describe_spec(spec, srun, env, backend=SLURM)  # job.json: secrets scrubbed
        description[OWN_SECTION]["SlurmOptions"] = options
        return SlurmRequest(
            job_name=spec.job_name,
            batch_script=batch_script(spec, root, options),
            sbatch_argv=("sbatch", "--parsable", str(root / BATCH_SCRIPT)),
            srun_argv=tuple(srun),
            env=env,
            job_dir=plan_job_dir(spec, root),
            description=description,
            slurm_options=options,
            instance_count=runtime.instance_count,
            processes_per_host=runtime.processes_per_host,
        )

    def launch(self, request: SlurmRequest) -> SlurmJob:
        preflight(request)
        # A Ctrl-C while the job directory is made (its code copy can be long) removes it: JobDirPlan.create.
        job = create_job_dir(request.job_dir, request.job_name, request.description)
        # From then to the handle's return a Ctrl-C waits (estimator.interrupts): raised in between, it would
        # leave a job submitted that nobody holds.
        with interrupts.critical():
            try:
                write_job_text(job.root / BATCH_SCRIPT, request.batch_script)
            except OSError as exc:
                shutil.rmtree(request.job_path, ignore_errors=True)
                raise problem(
                    "output_path",
                    f"cannot hold the job directory {request.job_path}: {exc}",
                    str(request.job_path.parent),
                ) from exc
            try:
                job_id = scheduler.submit(list(request.sbatch_argv), submission_environment(request))
            except scheduler.SlurmCommandError:
                shutil.rmtree(job.root, ignore_errors=True)  # nothing was submitted: the name is free again
                raise
            write_job_text(job.root / JOB_ID_FILE, job_id + "\n")
            return SlurmJob(job.root)

    def attach(self, job_name: str, output_path: str | None = None) -> AttachedJob:
        """The job directory's job (as a local job attaches), with the Slurm job's handle and options."""
        root = find_job_dir(job_name, output_path)
        own = read_json(JobDir(root).description_file)[OWN_SECTION]
        kwargs, missing = estimator_kwargs(root)
        kwargs.update(instance_type=SLURM, slurm_options=own.get("SlurmOptions") or None)
        return AttachedJob(SlurmJob(root), kwargs, missing)


def submission_environment(request: SlurmRequest) -> dict[str, str]:
    """sbatch's environment, which it exports to the job: this process's, the job's, and the real srun argv
    (secret values in it: the supervisor runs it; job.json has it scrubbed). Without the ``SBATCH_*``
    variables that would override what smsdp sets (sbatch reads them as options, over the script's lines),
    nor this process's own rank variables (``container_env.RANK_VARIABLES``)."""
    env = {**submitter_environment(), **request.env, LAUNCH_ARGV_VARIABLE: json.dumps(list(request.srun_argv))}
    return {name: value for name, value in env.items() if name not in OWNED_SBATCH_VARIABLES}


def batch_script(spec: JobSpec, root: Path, options: dict[str, str | bool]) -> str:
    """The script sbatch runs on the job's first node: our options, the user's, then the supervisor.

    Every value is data: user options are single words (``options.check_slurm_options``), paths
    are quoted for sbatch's parser (``sbatch_value``) and for bash (``shlex.quote``).
    """
    runtime = spec.runtime
    own = {
        "job-name": spec.job_name,
        "nodes": runtime.instance_count,
        "ntasks-per-node": runtime.processes_per_host,
        "output": output_pattern(root),
        "chdir": str(root),
        "no-requeue": True,
    }
    if "time" not in options:  # SageMaker's max_run, as Slurm's time limit (the supervisor also keeps it)
        minutes = -(-spec.max_run_s // 60) + 1
        own["time"] = f"{minutes // 1440}-{minutes % 1440 // 60:02d}:{minutes % 60:02d}:00"
    return "\n".join(
        [
            "#!/bin/bash",
            f"# smsdp training job {spec.job_name}: {runtime.instance_count} node(s) x {runtime.processes_per_host} "
            "process(es); written by estimator.backends.slurm.",
            *sbatch_lines(own),
            *sbatch_lines(options),
            "# The supervisor starts the ranks with srun, keeps logs/job.log and status.json, and ends the job.",
            f"exec {shlex.quote(sys.executable)} -m {SUPERVISOR_MODULE} {shlex.quote(str(root))}",
            "",
        ]
    )


def output_pattern(root: Path) -> str:
    """``--output``'s file name pattern for ``root / SLURM_OUTPUT``: Slurm reads ``%j`` in it as the job
    id, so a ``%`` of the path is written ``%%`` (a backslash, which Slurm drops, is refused earlier)."""
    return str(root).replace("%", "%%") + "/" + SLURM_OUTPUT


def preflight(request: SlurmRequest) -> None:
    """What can be checked before submitting: the directory, sbatch, and the partition's size."""
    output = request.job_path.parent
    if not output.is_dir():
        raise problem(
            "output_path",
            "does not exist: a Slurm job's directory must be on a file system every node "
            "sees; create it there first (mkdir -p) or pick one that exists",
            str(output),
        )
    try:
        scheduler.require("sbatch")
        partition = scheduler.partition_info(request.partition)
    except scheduler.SlurmCommandError as exc:
        raise problem("instance_type", f"is 'slurm', but {exc}", SLURM) from None
    problems = []
    if request.instance_count > partition.nodes:
        problems.append(
            f"instance_count {request.instance_count} exceeds the {partition.nodes} node(s) of "
            f"partition {partition.name!r}; use at most {partition.nodes} or another partition"
        )
    if request.processes_per_host > partition.cpus_per_node:
        problems.append(
            f"processes_per_host {request.processes_per_host} exceeds the {partition.cpus_per_node} "
            f"CPUs of each node of partition {partition.name!r}; use at most {partition.cpus_per_node}"
        )
    gpus = gpus_per_node(request.slurm_options)
    if gpus is not None and gpus > partition.gpus_per_node:
        problems.append(
            f"slurm_options asks {gpus} GPU(s) per node, and the nodes of partition {partition.name!r} "
            f"have {partition.gpus_per_node}; ask at most {partition.gpus_per_node}"
        )
    elif gpus is not None and request.processes_per_host > gpus:
        problems.append(
            f"processes_per_host {request.processes_per_host} exceeds the {gpus} GPU(s) per node "
            f"slurm_options asks for (one process per GPU); use at most {gpus} or ask more GPUs"
        )
    if problems:
        raise problem(
            "slurm_options" if gpus is not None else "instance_count", "; ".join(problems), dict(request.slurm_options)
        )
