"""Pack ``model/`` into ``model.tar.gz`` the way SageMaker does: files at the archive root."""

from __future__ import annotations

import os
import secrets
import tarfile
from pathlib import Path


def pack_model(model_dir: Path, archive: Path) -> Path:
    """Write ``archive`` atomically (a reader never sees half an archive).

    Its mode is any new file's of this process: 0600 in a job (the supervisor runs with umask 077).
    """
    archive.parent.mkdir(parents=True, exist_ok=True)
    tmp = archive.parent / f".{archive.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        with tarfile.open(tmp, "w:gz") as tar:
            for path in sorted(model_dir.iterdir()) if model_dir.is_dir() else []:
                tar.add(path, arcname=path.name)
        os.replace(tmp, archive)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return archive
