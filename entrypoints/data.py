# The shipped corpus, entrypoints/data/corpus.txt (683 KB), is the plain-text
# pydoc of 41 Python standard-library modules (documentation under the PSF
# licence), generated once with Python 3.11.7 from the repository root by:
#
#   python - > entrypoints/data/corpus.txt <<'EOF'
#   import importlib, pydoc, re
#   for name in ("textwrap string functools itertools collections heapq bisect json csv argparse "
#                "difflib fractions statistics random shlex pathlib dataclasses contextlib copy pprint "
#                "datetime base64 zipfile gzip queue sched secrets uuid html logging fnmatch glob "
#                "shutil tempfile operator abc numbers math cmath struct threading").split():
#       text = pydoc.render_doc(importlib.import_module(name), renderer=pydoc.plaintext)
#       text = re.sub(r"\nFILE\n.*", "\n", text, flags=re.S)  # drop this machine's file paths
#       print(re.sub(r" at 0x[0-9a-f]+", "", text))            # and object addresses
#   EOF
"""Byte-level tokenizer and a deterministic, rank-sliced batch sampler.

Sampling contract (the distributed tests rely on it): global batch number
``i`` is ``batch_size * dp_size`` windows whose start offsets depend only on
``(seed, split, i)``; data-parallel rank ``r`` gets rows
``[r * batch_size, (r + 1) * batch_size)`` of it. So the concatenation of every
rank's slice equals what one process draws with ``batch_size * dp_size``, and
a run is reproducible whatever the number of ranks.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

__all__ = ["CORPUS_PATH", "ByteTokenizer", "TokenDataset"]

#: The corpus shipped inside the package (see the module docstring).
CORPUS_PATH = Path(__file__).resolve().parent / "data" / "corpus.txt"

_SPLITS = ("train", "val")


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, lossless, nothing to train.

    Any model vocabulary >= 256 works; ids above 255 are simply never seen.
    """

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        # A window can cut a multi-byte character in half: replace, don't fail.
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def _text_files(path_or_dir: str | os.PathLike | None) -> list[Path]:
    if path_or_dir is None:
        return [CORPUS_PATH]
    path = Path(path_or_dir)
    if path.is_file():
        return [path]
    if path.is_dir():
        # Sorted so every rank reads the files in the same order.
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise FileNotFoundError(f"no .txt files under {path}")
        return files
    raise FileNotFoundError(f"{path} is neither a file nor a directory")


class TokenDataset:
    """Every ``.txt`` file of a channel (or the shipped corpus) as byte tokens.

    The files are joined with a newline and split once: the last
    ``val_fraction`` of the tokens is held out for the validation loss.
    """

    def __init__(
        self,
        path_or_dir: str | os.PathLike | None = None,
        seq_len: int = 128,
        val_fraction: float = 0.1,
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be >= 1")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} must be in (0, 1)")
        self.seq_len = seq_len
        self.files = _text_files(path_or_dir)
        self.tokenizer = ByteTokenizer()
        raw = b"\n".join(f.read_bytes() for f in self.files)
        # uint8 keeps the whole corpus at one byte per token; batches are
        # widened to int64 only when sliced.
        tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        n_val = int(len(tokens) * val_fraction)
        self._splits = {"train": tokens[: len(tokens) - n_val], "val": tokens[len(tokens) - n_val :]}
        for split, data in self._splits.items():
            if len(data) < seq_len + 1:
                raise ValueError(
                    f"the {split} split has {len(data)} tokens, fewer than seq_len + 1 = "
                    f"{seq_len + 1}; provide more text than {len(tokens)} bytes "
                    f"({', '.join(map(str, self.files))}) or use a smaller --seq_len"
                )

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def num_tokens(self, split: str = "train") -> int:
        return len(self._split(split))

    def _split(self, split: str) -> torch.Tensor:
        if split not in self._splits:
            raise ValueError(f"split={split!r}; use one of {_SPLITS}")
        return self._splits[split]

    def global_offsets(
        self, global_batch_index: int, global_batch_size: int, seed: int, split: str = "train"
    ) -> torch.Tensor:
        """Start offsets of the windows of one global batch (all ranks)."""
        data = self._split(split)
        # A private generator per batch: no dependence on the global RNG or on
        # how many batches were drawn before (resuming at step k is exact).
        digest = hashlib.blake2b(f"{seed}/{split}/{global_batch_index}".encode(), digest_size=8).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
        # The last valid start leaves room for seq_len inputs plus the shifted target.
        return torch.randint(0, len(data) - self.seq_len, (global_batch_size,), generator=gen)

    def batches(
        self,
        global_batch_index: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        batch_size: int = 4,
        seed: int = 0,
        split: str = "train",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(inputs, targets)`` of global batch ``global_batch_index``.

        Both are int64 of shape ``(batch_size, seq_len)``; targets are the
        inputs shifted by one token.
        """
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, dp_size={dp_size})")
        offsets = self.global_offsets(global_batch_index, batch_size * dp_size, seed, split)
        mine = offsets[dp_rank * batch_size : (dp_rank + 1) * batch_size]
        window = mine[:, None] + torch.arange(self.seq_len + 1)
        chunk = self._split(split)[window].long()
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)
