"""Pack ``model/`` into ``model.tar.gz`` the way SageMaker does: files at the archive root."""

from __future__ import annotations

import os
import tarfile
import tempfile
from pathlib import Path


def pack_model(model_dir: Path, archive: Path) -> Path:
    """Write ``archive`` atomically (a reader never sees half an archive)."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{archive.name}.", suffix=".tmp", dir=archive.parent)
    os.close(fd)
    try:
        with tarfile.open(tmp, "w:gz") as tar:
            for path in sorted(model_dir.iterdir()) if model_dir.is_dir() else []:
                tar.add(path, arcname=path.name)
        os.chmod(tmp, 0o644)
        os.replace(tmp, archive)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return archive
