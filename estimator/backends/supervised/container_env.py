"""The SageMaker container contract for a local job: ``SM_*`` and smsdp's variables.

Every rank gets these (exported by mpirun). Hosts are simulated on this
machine when ``instance_count > 1``: ``SM_HOSTS`` lists ``algo-1..algo-N`` and
``SMSDP_SIMULATED_HOSTS=1`` tells the launcher to derive each rank's host from
its rank (docs/architecture.md).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from functools import lru_cache

from estimator.backends.supervised.job_dir import JobDir
from estimator.spec import Hyperparameter, JobSpec
from estimator.tensorboard_output import ARGUMENT as TENSORBOARD_ARGUMENT
from estimator.tensorboard_output import tensorboard_environment
from smsdp.config import CONFIG_ENV_VAR
from smsdp.config.cluster import SIMULATED_HOSTS_ENV

#: The per-rank launcher every backend starts (``python -m entrypoints.launcher SCRIPT ARGS``).
LAUNCHER_MODULE = "entrypoints.launcher"


def host_names(instance_count: int) -> list[str]:
    return [f"algo-{i + 1}" for i in range(instance_count)]


def hyperparameter_args(hyperparameters: dict[str, Hyperparameter]) -> list[str]:
    """``{"max_steps": 5}`` -> ``["--max_steps", "5"]``, as SageMaker passes them."""
    args: list[str] = []
    for name, value in hyperparameters.items():
        args += [f"--{name}", str(value)]
    return args


def encoded_hyperparameters(hyperparameters: dict[str, Hyperparameter]) -> dict[str, str]:
    """hyperparameters.json: every value a JSON string, as SageMaker framework jobs write it."""
    return {name: json.dumps(value) for name, value in hyperparameters.items()}


def container_env(spec: JobSpec, job: JobDir) -> dict[str, str]:
    """The variables one local job adds to this process's environment."""
    hosts = host_names(spec.runtime.instance_count)
    hps = dict(spec.hyperparameters)
    env = {
        "SM_HOSTS": json.dumps(hosts),
        "SM_CURRENT_HOST": hosts[0],  # per rank from the launcher when hosts are simulated
        "SM_NUM_GPUS": str(visible_gpu_count()),
        "SM_NUM_CPUS": str(os.cpu_count() or 1),
        "SM_INPUT_DIR": str(job.input),
        "SM_INPUT_CONFIG_DIR": str(job.config),
        "SM_MODEL_DIR": str(job.model),
        "SM_OUTPUT_DIR": str(job.output),
        "SM_OUTPUT_DATA_DIR": str(job.output_data),
        "SM_CHECKPOINT_DIR": str(job.checkpoints),
        "SM_CHANNELS": json.dumps([c.name for c in spec.channels]),
        "SM_HPS": json.dumps(hps, sort_keys=True),
        "SM_USER_ARGS": json.dumps(hyperparameter_args(hps)),
        "SM_USER_ENTRY_POINT": spec.code.entry_point,
        "SM_TRAINING_JOB_NAME": spec.job_name,
        CONFIG_ENV_VAR: spec.runtime.to_env_value(),
    }
    for channel in spec.channels:
        env[f"SM_CHANNEL_{_env_suffix(channel.name)}"] = str(job.channel(channel.name))
    for name, value in hps.items():
        env[f"SM_HP_{_env_suffix(name)}"] = value if isinstance(value, str) else json.dumps(value)
    if spec.runtime.instance_count > 1:
        env[SIMULATED_HOSTS_ENV] = "1"
    env.update(tensorboard_environment(spec.backend_options.get(TENSORBOARD_ARGUMENT), spec.job_name, remote=False))
    return env


def start_env(world_size: int) -> dict[str, str]:
    """What a job's ranks read as they start, besides the package's path: unbuffered output, one share
    of the cores each (the warm-start pools the tests run are made with it)."""
    return {
        "PYTHONUNBUFFERED": "1",
        # Oversubscribed intra-op threads make CPU ranks crawl (DDP ran 5x slower with 2 threads per rank on 2 cores).
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world_size)),
    }


def process_env(spec: JobSpec, source_root: str | None) -> dict[str, str]:
    """How the ranks run: ``start_env``, and the package importable."""
    env = start_env(spec.world_size)
    if source_root is not None:
        inherited = [
            entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry and entry != source_root
        ]
        env["PYTHONPATH"] = os.pathsep.join([source_root, *inherited])
    return env


#: Who a process is in a world that already exists: torchrun's and the MPI launchers' rank variables.
#: Inherited from the process that submits a job (a notebook started under torchrun or mpirun, a shell
#: that exported MASTER_ADDR), they would name the wrong rendezvous or rank inside the job: a Slurm
#: rank on another node dialing a MASTER_ADDR of 127.0.0.1 waits out the collective timeout.
RANK_VARIABLES = frozenset(
    {
        "MASTER_ADDR",
        "MASTER_PORT",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "ROLE_NAME",
        "NODE_RANK",
        "PMI_RANK",
        "PMI_SIZE",
        "PMIX_RANK",
    }
)
RANK_VARIABLE_PREFIXES = ("TORCHELASTIC_", "OMPI_COMM_WORLD_")


def submitter_environment() -> dict[str, str]:
    """This process's environment as a job inherits it: everything but the rank variables of a world
    this process itself may be part of (the job's launcher sets its own)."""
    return {
        name: value
        for name, value in os.environ.items()
        if name not in RANK_VARIABLES and not name.startswith(RANK_VARIABLE_PREFIXES)
    }


def _env_suffix(name: str) -> str:
    return name.upper().replace("-", "_").replace(".", "_")


@lru_cache(maxsize=1)
def visible_gpu_count() -> int:
    """GPUs this machine shows (no torch in the client: ask nvidia-smi)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return 0
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    count = sum(1 for line in out.splitlines() if line.startswith("GPU "))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return min(count, len(visible.split(","))) if visible else count
