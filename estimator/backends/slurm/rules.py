"""What a Slurm job changes in building an Estimator: its output path, its ``slurm_options``, no memory check."""

from __future__ import annotations

from typing import Any

from estimator.backends.slurm.options import check_slurm_options, check_slurm_output_path
from estimator.backends.supervised.rules import JobDirRules


class SlurmRules(JobDirRules):
    """A Slurm job's files and rules are a local job's (a shared directory, no ml.* capacity table)."""

    option_argument = "slurm_options"
    # The client does not know the nodes' memory (the planner would size this machine's RAM).
    checks_memory = False
    jobs_name = "Slurm jobs"

    def check_output_path(self, output_path: Any, instance_type: str) -> str:
        return check_slurm_output_path(output_path)

    def check_option(self, value: Any, instance_type: str) -> Any:
        return check_slurm_options(value, instance_type)


RULES = SlurmRules()
