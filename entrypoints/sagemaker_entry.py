"""The in-job side of a SageMaker job: every rank passes through here before the user's script.

SageMaker's training toolkit starts the job's entry point on every rank under
mpirun (``python -m mpi4py smsdp_entry.py --name value ...``); the generated
``smsdp_entry.py`` calls ``main(script, args)``, which

1. joins ``SMSDP_CONFIG`` back from ``SMSDP_CONFIG_PART_0``, ``_1``, ... when
   the client had to split it (SageMaker allows 512 characters per variable);
2. finds the host this rank really runs on: mpirun forwards the first host's
   ``SM_CURRENT_HOST`` to every rank, so each rank reads its own host's
   ``resourceconfig.json`` (in ``$SM_INPUT_CONFIG_DIR``, default
   ``/opt/ml/input/config``) and sets ``SM_CURRENT_HOST`` (and ``SM_HOSTS``
   when missing) from it;
3. checks the layout the runtime relies on: as many ranks as the job config
   says, rank ``r`` on host ``r // processes_per_host`` (mpirun's
   ``--map-by slot``), no more processes per host than ``SM_NUM_GPUS``;
4. prints where it runs, then hands over to ``entrypoints.launcher`` exactly
   as a local job's ranks start.

A problem in 1-3 goes to ``$SM_OUTPUT_DIR/failure`` (SageMaker shows it as the
job's FailureReason) and ends the rank with status 1, which ends the job.
With ``SMSDP_SIMULATED_HOSTS=1`` (several hosts on one machine) the host of
rank ``r`` is host ``r // processes_per_host`` whatever the resource config says.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from smsdp.util import failure_files

CONFIG_ENV_VAR = "SMSDP_CONFIG"
CONFIG_PART_PREFIX = f"{CONFIG_ENV_VAR}_PART_"  # estimator.backends.sagemaker.environment splits
SIMULATED_HOSTS_ENV = "SMSDP_SIMULATED_HOSTS"
DEFAULT_CONFIG_DIR = "/opt/ml/input/config"
RESOURCE_CONFIG = "resourceconfig.json"


class EntryError(RuntimeError):
    """The container does not look like the job smsdp submitted."""


def main(script: str, args: list[str], environ: MutableMapping[str, str] | None = None) -> int:
    environ = os.environ if environ is None else environ
    try:
        environ.update(container_environment(environ))
    except EntryError as exc:
        return _fail(str(exc), environ)
    print(f"[smsdp] {_where(environ)}: running {script} (smsdp from {_smsdp_location()})", flush=True)
    from entrypoints import launcher

    return launcher.main([script, *args])


def container_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to set in this rank before the launcher runs (raises ``EntryError``)."""
    updates = {}
    config = joined_config(environ)
    if config is not None:
        updates[CONFIG_ENV_VAR] = config
    updates.update(_host_from_resource_config(environ))
    updates["SM_CURRENT_HOST"] = check_layout({**environ, **updates})
    return updates


def joined_config(environ: Mapping[str, str]) -> str | None:
    """``SMSDP_CONFIG`` from its parts, or None when it arrived whole (or not at all)."""
    parts = sorted(
        (int(name[len(CONFIG_PART_PREFIX) :]), value)
        for name, value in environ.items()
        if name.startswith(CONFIG_PART_PREFIX) and name[len(CONFIG_PART_PREFIX) :].isdigit()
    )
    if not parts:
        return None
    if [index for index, _ in parts] != list(range(len(parts))):
        raise EntryError(
            f"{CONFIG_PART_PREFIX}<i> variables are not numbered 0..{len(parts) - 1}: "
            f"{[index for index, _ in parts]} (was one not forwarded with -x?)"
        )
    return "".join(value for _, value in parts)


def check_layout(environ: Mapping[str, str]) -> str:
    """This rank's host, once the job's shape is what the runtime expects."""
    from smsdp.config import ConfigError, RuntimeConfig

    try:
        config = RuntimeConfig.from_env(environ)
    except ConfigError as exc:
        raise EntryError(f"the job config is invalid: {exc}") from None
    if config is None:
        raise EntryError(
            f"{CONFIG_ENV_VAR} is not set: smsdp forwards it to every rank with '-x "
            f"{CONFIG_ENV_VAR}' in mpi.custom_mpi_options; was that option removed?"
        )
    hosts = _hosts(environ)
    rank, size = _rank_and_size(environ)
    if size != config.world_size or len(hosts) != config.instance_count:
        raise EntryError(
            f"{_launcher(environ)} started {size} processes on {len(hosts)} host(s) {hosts}, but the job "
            f"asks for {config.instance_count} x {config.processes_per_host} = {config.world_size}"
        )
    expected = hosts[rank // config.processes_per_host]
    simulated = environ.get(SIMULATED_HOSTS_ENV) == "1"
    current = expected if simulated else environ.get("SM_CURRENT_HOST", expected)
    if current != expected:
        raise EntryError(
            f"rank {rank} runs on {current}, but smsdp lays ranks out host-major (rank r on "
            f"host r // {config.processes_per_host}, i.e. {expected}); mpirun must map by slot"
        )
    gpus = _int(environ, "SM_NUM_GPUS", 0)
    if 0 < gpus < config.processes_per_host:
        raise EntryError(
            f"{config.processes_per_host} processes per host but {current} has {gpus} GPUs "
            "(SM_NUM_GPUS): lower mpi.processes_per_host"
        )
    return current


def _rank_and_size(environ: Mapping[str, str]) -> tuple[int, int]:
    """mpirun's (SMP v1, MPI) or torchrun's (SMP v2, SDK 3's Torchrun driver) rank and world size."""
    if "OMPI_COMM_WORLD_SIZE" in environ:
        return _int(environ, "OMPI_COMM_WORLD_RANK", 0), _int(environ, "OMPI_COMM_WORLD_SIZE", 1)
    return _int(environ, "RANK", 0), _int(environ, "WORLD_SIZE", 1)


def _launcher(environ: Mapping[str, str]) -> str:
    return "mpirun" if "OMPI_COMM_WORLD_SIZE" in environ else "torchrun"


def _host_from_resource_config(environ: Mapping[str, str]) -> dict[str, str]:
    path = Path(environ.get("SM_INPUT_CONFIG_DIR") or DEFAULT_CONFIG_DIR) / RESOURCE_CONFIG
    if not path.is_file():
        return {}  # not in a SageMaker container: trust SM_* as given
    try:
        resource = json.loads(path.read_text())
        updates = {"SM_CURRENT_HOST": str(resource["current_host"])}
        hosts = [str(h) for h in resource["hosts"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise EntryError(f"{path} is not SageMaker's resource config: {exc!r}") from None
    if not environ.get("SM_HOSTS"):
        updates["SM_HOSTS"] = json.dumps(hosts)
    return updates


def _hosts(environ: Mapping[str, str]) -> list[str]:
    try:
        hosts = json.loads(environ.get("SM_HOSTS") or '["algo-1"]')
    except ValueError:
        raise EntryError(f"SM_HOSTS={environ.get('SM_HOSTS')!r} is not a JSON list of host names") from None
    if not isinstance(hosts, list) or not hosts:
        raise EntryError(f"SM_HOSTS={environ.get('SM_HOSTS')!r} is not a non-empty JSON list of host names")
    return [str(h) for h in hosts]


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    try:
        return int(environ.get(name, default))
    except ValueError:
        raise EntryError(f"{name}={environ.get(name)!r} is not an integer") from None


def _where(environ: Mapping[str, str]) -> str:
    try:
        rank, size = _rank_and_size(environ)
    except EntryError:
        rank, size = 0, 1
    host = environ.get("SM_CURRENT_HOST", "algo-1")
    return f"rank {rank} of {size} on {host}"


def _smsdp_location() -> str:
    spec = importlib.util.find_spec("smsdp")  # the copy this rank runs: the bundled one, or an installed one
    return str(Path(spec.origin).parent) if spec is not None and spec.origin else "nowhere"


def _fail(message: str, environ: Mapping[str, str]) -> int:
    rank = environ.get("OMPI_COMM_WORLD_RANK", environ.get("RANK", "0"))
    print(f"[smsdp] rank {rank}: {message}", file=sys.stderr, flush=True)
    output_dir = failure_files.output_dir_of(environ)
    if output_dir is not None:
        with contextlib.suppress(OSError):
            failure_files.claim_job_failure(output_dir, rank, f"{message}\n")  # the first rank's reason stands
    return 1
