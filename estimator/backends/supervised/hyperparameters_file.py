"""A job's ``input/config/hyperparameters.json``: the real values while the job runs, none of its secrets after.

The file is the container contract (a script may read it, as SageMaker's toolkits do), so it holds
every hyperparameter, secret ones included, while the job can still read it: across retried
attempts too. When the job ends, the values of secret-looking names (``estimator.redact``) are
blanked, so a finished job's directory keeps no secret. ``Estimator.attach`` then finds them
blanked and asks for them again, as it does for secret ``environment`` values.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from estimator.backends.supervised.job_dir import JobDir, write_job_json
from estimator.redact import REDACTED, secret_name

#: Its path inside the job directory.
HYPERPARAMETERS_FILE = "input/config/hyperparameters.json"
#: A blanked value, as the file holds it (every value JSON-encoded, as SageMaker writes them).
BLANKED = json.dumps(REDACTED)


def hyperparameters_path(job: JobDir) -> Path:
    return job.root / HYPERPARAMETERS_FILE


def blank_secrets(job: JobDir) -> str | None:
    """Blank the secret values of the job's hyperparameters.json; one sentence when that failed."""
    path = hyperparameters_path(job)
    try:
        encoded = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        return f"could not read {path} to blank its secrets: {exc}"
    if not isinstance(encoded, dict) or not any(secret_name(name) for name in encoded):
        return None
    try:
        write_job_json(path, {name: BLANKED if secret_name(name) else value for name, value in encoded.items()})
    except OSError as exc:
        with contextlib.suppress(OSError):  # a full disk: the secrets must go even if the file does
            path.unlink()
        return f"could not blank the secrets of {path} ({exc}); it was removed"
    return None


def decoded(job: JobDir) -> dict[str, Any] | None:
    """The hyperparameters as the script got them (each value JSON-decoded); None when unreadable."""
    try:
        encoded = json.loads(hyperparameters_path(job).read_text())
        return {name: json.loads(value) for name, value in encoded.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return None
