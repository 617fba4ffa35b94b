"""Pack ``model/`` into ``model.tar.gz`` the way SageMaker does: files at the archive root."""

from __future__ import annotations

import tarfile
from pathlib import Path

from smsdp.util.atomic_files import atomic_writer


def pack_model(model_dir: Path, archive: Path) -> Path:
    """Write ``archive`` atomically (``smsdp.util.atomic_files``: a reader never sees half an archive).

    Its mode is any new file's of this process: 0600 in a job (the supervisor runs with umask 077).
    """
    with atomic_writer(archive, make_parents=True) as handle, tarfile.open(fileobj=handle, mode="w:gz") as tar:
        for path in sorted(model_dir.iterdir()) if model_dir.is_dir() else []:
            tar.add(path, arcname=path.name)
    return archive
