"""What a Slurm job changes in building an Estimator: its output path, its ``slurm_options``, no memory check."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from estimator.backends.slurm.options import SLURM_VARIABLE_PREFIXES, check_slurm_options, check_slurm_output_path
from estimator.backends.supervised.rules import JobDirRules
from smsdp.config import ConfigError, ConfigProblem


class SlurmRules(JobDirRules):
    """A Slurm job's files and rules are a local job's (a shared directory, no ml.* capacity table)."""

    option_argument = "slurm_options"
    # The client does not know the nodes' memory (the planner would size this machine's RAM).
    checks_memory = False
    jobs_name = "Slurm jobs"

    def check_output_path(self, output_path: Any, instance_type: str) -> str:
        return check_slurm_output_path(output_path)

    def check_environment_names(self, environment: Any) -> None:
        if not isinstance(environment, Mapping):
            return  # check_environment says what is wrong with it
        problems = [
            ConfigProblem(
                ("environment", name),
                "is read by sbatch or srun as one of their own settings (it would change how Slurm runs the job); "
                "pass Slurm settings in slurm_options",
            )
            for name in environment
            if isinstance(name, str) and name.startswith(SLURM_VARIABLE_PREFIXES)
        ]
        if problems:
            raise ConfigError.from_problems(problems)

    def check_option(self, value: Any, instance_type: str) -> Any:
        return check_slurm_options(value, instance_type)


RULES = SlurmRules()
