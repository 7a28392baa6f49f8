"""Built-in `code_corpus`: the Python standard library's own source files as a real text corpus.

Documents of very different lengths (median ~6.5 KB, a long tail past 500 KB), byte-level
tokens. Each file becomes `[bos] + bytes + [eos]`, split into samples of at most
`max_seq_len` tokens (`long_docs=split`) or cut to its first sample (`truncate`: one sample
per file, so sample lengths follow the files' own length distribution); labels are shifted inside
each sample, once. Files are assigned to the held-out split by a stable hash of their relative path,
so the split never changes.
"""
from __future__ import annotations

import os
import sysconfig
import zlib

import numpy as np
import torch

from hcp.data.llava import IGNORE_INDEX, Sample, SkipReport


def stdlib_sources(root: str | None = None) -> list[str]:
    """Sorted `.py` files of the standard library under `root` (hidden names skipped, as
    `glob`'s `**` does). `site-packages` folders are not entered at all (walking them is slow)."""
    root = root or sysconfig.get_paths()["stdlib"]
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d != "site-packages" and not d.startswith(".")]
        files += [os.path.join(folder, n)
                  for n in names if n.endswith(".py") and not n.startswith(".")]
    return sorted(files)


class CodeCorpus:
    """Byte-level LM samples from source files.

    Args:
        files: paths to read; `root` is stripped from their ids.
        tokenizer: supplies `bos_id` / `eos_id` (byte tokenizer).
        max_seq_len: tokens per sample (long documents are split).
        held_out: True for the held-out split, False for training.
        eval_fraction: fraction of files held out (by crc32 of the relative path).
        long_docs: `split` (every max_seq_len piece is a sample) or `truncate` (the first).
    """

    has_answers = False

    def __init__(self, files, root, tokenizer, max_seq_len, held_out, eval_fraction,
                 long_docs="split"):
        self.tok, self.max_seq_len = tokenizer, max_seq_len
        self.skipped = SkipReport()
        self.docs: list[np.ndarray] = []
        self.ids: list[str] = []
        self.chunks: list[tuple[int, int]] = []  # (doc index, start token)
        for path in files:
            rel = os.path.relpath(path, root)
            if ((zlib.crc32(rel.encode()) % 10_000) < eval_fraction * 10_000) != held_out:
                continue
            with open(path, "rb") as f:
                body = np.frombuffer(f.read(), dtype=np.uint8).astype(np.int64)
            doc = np.concatenate([[tokenizer.bos_id], body, [tokenizer.eos_id]])
            starts = range(0, len(doc) - 1, max_seq_len)
            self.chunks += [(len(self.docs), s)
                            for s in (starts[:1] if long_docs == "truncate" else starts)]
            self.docs.append(doc)
            self.ids.append(rel)

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, i: int) -> Sample:
        d, start = self.chunks[i]
        piece = self.docs[d][start:start + self.max_seq_len + 1]  # one extra token: the last target
        ids = piece[:self.max_seq_len].tolist()
        labels = piece[1:].tolist() + [IGNORE_INDEX] * (len(ids) - len(piece) + 1)
        return Sample(f"{self.ids[d]}@{start}", ids, labels, [], 0, "")

    def pixel_values(self, sample: Sample) -> torch.Tensor:
        return torch.zeros(0, 1, 1, 1)
