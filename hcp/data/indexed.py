"""Megatron-LM indexed token data sets (`PREFIX.bin` + `PREFIX.idx`, as written by Megatron's
`tools/preprocess_data.py` / `IndexedDatasetBuilder`): a reader and a writer of the exact format.

`.idx` (little-endian):
    9 bytes   magic b"MMIDIDX\\x00\\x00"
    <Q        version, 1
    <B        dtype code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    <Q        S, the number of sequences
    <Q        D, the number of document indices (documents + 1)
    int32[S]  tokens per sequence
    int64[S]  byte offset of each sequence in `.bin`
    int64[D]  document boundaries in sequences: document j = sequences [doc[j], doc[j + 1])
`.bin` holds the sequences' tokens back to back in that dtype. A document is usually one
sequence (several with `--split-sentences`); hcp reads a document as the concatenation of its
sequences. The `.bin` is memory-mapped: nothing is read until a document is.
"""
from __future__ import annotations

import os
import struct

import numpy as np

from hcp.data.llava import DataError

MAGIC = b"MMIDIDX\x00\x00"
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
          7: np.float32, 8: np.uint16}
_HEADER = len(MAGIC) + 8 + 1 + 8 + 8


def _corrupt(path: str, detail: str) -> DataError:
    """A corrupt or truncated `.idx` / `.bin`: the message names the file and what is wrong."""
    return DataError(path, None, "corrupt Megatron data set", detail)


class IndexedDataset:
    """Documents of a Megatron indexed data set `prefix` (`prefix.idx`, `prefix.bin`).

    `len(ds)` documents; `ds[j]` -> int64 tokens of document j (np.ndarray [L_j]).

    Raises:
        FileNotFoundError: a file is missing (names it).
        hcp.data.llava.DataError: bad magic, version or dtype code, an `.idx` shorter than its
        header says,
            document boundaries out of order, or a `.bin` shorter than the sequences it indexes.
    """

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx, bin_ = prefix + ".idx", prefix + ".bin"
        for path in (idx, bin_):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"data.sources: {path} does not exist (a Megatron data set "
                                        "is PREFIX.bin + PREFIX.idx; give the PREFIX)")
        size = os.path.getsize(idx)
        with open(idx, "rb") as f:
            head = f.read(_HEADER)
        if len(head) < _HEADER:
            raise _corrupt(idx, f"truncated: {size} bytes, shorter than the {_HEADER}-byte header")
        if head[:9] != MAGIC:
            raise _corrupt(idx, f"not a Megatron index (magic {head[:9]!r}, expected {MAGIC!r})")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
        if version != 1:
            raise _corrupt(idx, f"index version {version}, only version 1 is known")
        if code not in DTYPES:
            raise _corrupt(idx, f"unknown dtype code {code} (known: {sorted(DTYPES)})")
        need = _HEADER + n_seq * 4 + n_seq * 8 + n_doc * 8
        if size < need:
            raise _corrupt(idx, f"truncated: {size} bytes, its header ({n_seq} sequences, "
                              f"{n_doc} document indices) needs {need}")
        mm = np.memmap(idx, mode="r", dtype=np.uint8)
        self.dtype = np.dtype(DTYPES[code])
        self.sequence_lengths = np.frombuffer(mm, np.int32, n_seq, _HEADER)
        self.sequence_pointers = np.frombuffer(mm, np.int64, n_seq, _HEADER + n_seq * 4)
        self.document_indices = np.frombuffer(mm, np.int64, n_doc, _HEADER + n_seq * 12)
        doc = self.document_indices
        if n_doc < 1 or doc[0] != 0 or doc[-1] != n_seq or np.any(np.diff(doc) < 0):
            raise _corrupt(idx, f"corrupt document index (must rise from 0 to the {n_seq} "
                              f"sequences; starts {doc[:3].tolist()}, ends {doc[-2:].tolist()})")
        end = (int(self.sequence_pointers[-1])
               + int(self.sequence_lengths[-1]) * self.dtype.itemsize if n_seq else 0)
        if os.path.getsize(bin_) < end:
            raise _corrupt(bin_, f"truncated: {os.path.getsize(bin_)} bytes, {idx} indexes {end}")
        self._bin = np.memmap(bin_, mode="r", dtype=self.dtype) if end else np.zeros(0, self.dtype)

    def __len__(self) -> int:
        return len(self.document_indices) - 1

    def doc_lengths(self) -> np.ndarray:
        """Tokens of every document, int64 [len(self)] (from the index only, vectorized)."""
        ends = np.concatenate([[0], np.cumsum(self.sequence_lengths, dtype=np.int64)])
        return ends[self.document_indices[1:]] - ends[self.document_indices[:-1]]

    def __getitem__(self, j: int) -> np.ndarray:
        a, b = int(self.document_indices[j]), int(self.document_indices[j + 1])
        parts = [self._bin[p // self.dtype.itemsize: p // self.dtype.itemsize + n]
                 for p, n in zip(self.sequence_pointers[a:b].tolist(),
                                 self.sequence_lengths[a:b].tolist())]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def write_indexed(prefix: str, documents, dtype=np.uint16) -> None:
    """Write `documents` (each a list of sequences, or one token sequence) as Megatron's
    `prefix.bin` / `prefix.idx`, byte for byte what Megatron's `IndexedDatasetBuilder` writes.

    Raises:
        ValueError: a dtype without a Megatron code.
    """
    codes = {np.dtype(v): k for k, v in DTYPES.items()}
    dt = np.dtype(dtype)
    if dt not in codes:
        raise ValueError(f"dtype {dt} has no Megatron code (use one of "
                         f"{[np.dtype(v).name for v in DTYPES.values()]})")
    lengths, doc_idx = [], [0]
    with open(prefix + ".bin", "wb") as f:
        for doc in documents:
            seqs = doc if len(doc) and not np.isscalar(doc[0]) else [doc]
            for seq in seqs:
                f.write(np.asarray(seq, dtype=dt).tobytes(order="C"))
                lengths.append(len(seq))
            doc_idx.append(len(lengths))
    pointers = np.concatenate([[0], np.cumsum(np.asarray(lengths, np.int64) * dt.itemsize)[:-1]]) \
        if lengths else np.zeros(0, np.int64)
    with open(prefix + ".idx", "wb") as f:
        f.write(MAGIC + struct.pack("<QBQQ", 1, codes[dt], len(lengths), len(doc_idx)))
        f.write(np.asarray(lengths, np.int32).tobytes())
        f.write(np.asarray(pointers, np.int64).tobytes())
        f.write(np.asarray(doc_idx, np.int64).tobytes())
