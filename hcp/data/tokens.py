"""`data=tokens`: your pretraining text as token documents, blended across sources.

Each entry of `data.sources: [{path, weight}]` is a Megatron indexed data set (`path` is the
PREFIX of PREFIX.bin / PREFIX.idx, `hcp.data.indexed`) or a `.jsonl` file whose `data.text_key`
field is tokenized with `data.tokenizer` as `[bos] + text + [eos]`. Documents are read as they
are (Megatron's preprocessing already appended its end-of-document token) and packed into
micro-batches by the step plan. A document with more than `data.max_seq_len` input tokens is
split into pieces of max_seq_len (`data.long_docs=split`; each piece its own sample, labels
shifted inside it) or stops the run naming the file and document (`reject`).

Blending: an epoch holds as many samples as all sources together; source k gets a share
`weight_k / sum(weights)` of them, interleaved evenly (every prefix of the epoch is within one
sample of the exact proportions), and a source smaller than its share repeats (upsampling) while
a larger one is only partly read. The trainer's sampler then shuffles the epoch.
"""
from __future__ import annotations

import json
import os

import numpy as np
import torch

from hcp.config.errors import ConfigError
from hcp.data.indexed import IndexedDataset
from hcp.data.llava import DataError, Sample, SkipReport


class JsonlDocuments:
    """Documents of a JSONL file, tokenized once at start: `ds[j]` -> int64 tokens [L_j].

    Raises:
        FileNotFoundError: no such file. hcp.data.llava.DataError: a line that is not a JSON
            object with a string `key` (names the file and line).
    """

    def __init__(self, path: str, tokenizer, key: str = "text"):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"data.sources: {path} does not exist")
        self.prefix, self.docs = path, []
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)[key]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise DataError(path, f"line {line_no}", "bad JSONL line",
                                    f"expected a JSON object with a string {key!r} field "
                                    f"({e!r})") from None
                if not isinstance(text, str):
                    raise DataError(path, f"line {line_no}", "bad JSONL line",
                                    f"{key!r} is not a string")
                self.docs.append(np.asarray([tokenizer.bos_id, *tokenizer.encode(text),
                                             tokenizer.eos_id],
                                            dtype=np.int64))

    def __len__(self) -> int:
        return len(self.docs)

    def doc_lengths(self) -> np.ndarray:
        return np.array([len(d) for d in self.docs], dtype=np.int64)

    def __getitem__(self, j: int) -> np.ndarray:
        return self.docs[j]


def open_source(path: str, tokenizer, key: str):
    """A `.jsonl` file or a Megatron PREFIX (a trailing `.bin` / `.idx` is dropped)."""
    if path.endswith(".jsonl"):
        return JsonlDocuments(path, tokenizer, key)
    return IndexedDataset(path[:-4] if path.endswith((".bin", ".idx")) else path)


class TokenSamples:
    """Samples of one source: each document, each max_seq_len piece of it, or its first piece
    (`long_docs`: reject, split, truncate).

    Raises:
        hcp.data.llava.DataError: `long_docs=reject` and a document is too long (names the
            file, the document and its length).
    """

    def __init__(self, docs, max_seq_len: int, long_docs: str, vocab_size: int):
        self.docs, self.max_seq_len, self.vocab_size = docs, max_seq_len, vocab_size
        self.skipped = SkipReport()
        lengths = docs.doc_lengths()
        if long_docs == "reject" and np.any(lengths - 1 > max_seq_len):
            j = int(np.argmax(lengths - 1 > max_seq_len))
            raise DataError(docs.prefix, f"document {j}", "document too long",
                            f"{lengths[j] - 1} input tokens > data.max_seq_len={max_seq_len} under "
                            "data.long_docs=reject (use data.long_docs=split, or raise "
                            "max_seq_len)")
        pieces = np.maximum(0, -(-(lengths - 1) // max_seq_len))  # a 0/1-token doc has no target
        self.empty = int(np.sum(pieces == 0))
        self.split = int(np.sum(pieces > 1))  # documents over max_seq_len (split or truncated)
        if long_docs == "truncate":
            pieces = np.minimum(pieces, 1)
        self.doc_of = np.repeat(np.arange(len(lengths)), pieces)
        first = np.repeat(np.cumsum(pieces) - pieces, pieces)
        self.start = (np.arange(len(self.doc_of)) - first) * max_seq_len

    def __len__(self) -> int:
        return len(self.doc_of)

    def __getitem__(self, i: int) -> Sample:
        j, start = int(self.doc_of[i]), int(self.start[i])
        piece = self.docs[j][start:start + self.max_seq_len + 1]
        if piece.max() >= self.vocab_size or piece.min() < 0:
            raise DataError(self.docs.prefix, f"document {j}", "token id out of range",
                            f"ids in [{piece.min()}, {piece.max()}] but "
                            f"llm.vocab_size={self.vocab_size}")
        ids = piece[:-1].tolist()
        return Sample(f"{os.path.basename(self.docs.prefix)}:{j}@{start}", ids, piece[1:].tolist(),
                      [], 0, "")


def blend(sizes: list[int], weights: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """One epoch of `sum(sizes)` draws: (source of each draw, sample index in that source).

    Source k gets round(w_k / sum(w) * n) draws (largest remainders fill the total), placed at
    the evenly spread keys (j + 0.5) / count_k, so every prefix is within one draw of the exact
    proportions; its samples are taken in order, wrapping around when it has fewer.
    """
    n, w = int(sum(sizes)), np.asarray(weights, dtype=np.float64) / sum(weights)
    exact = w * n
    counts = np.floor(exact).astype(np.int64)
    counts[np.argsort(-(exact - counts), kind="stable")[:n - counts.sum()]] += 1
    keys = np.concatenate([(np.arange(c) + 0.5) / c for c in counts if c])
    source = np.concatenate([np.full(c, k) for k, c in enumerate(counts) if c])
    local = np.concatenate([np.arange(c) % max(1, sizes[k]) for k, c in enumerate(counts) if c])
    order = np.argsort(keys, kind="stable")
    return source[order], local[order]


class BlendedTokens:
    """The training set of `data=tokens`: `ds[i]` -> `Sample` (see the module docstring)."""

    has_answers = False

    def __init__(self, parts: list[TokenSamples], weights: list[float], names: list[str]):
        self.parts, self.names, self.weights = parts, names, weights
        self.source, self.local = blend([len(p) for p in parts], weights)
        self.skipped = SkipReport()

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> Sample:
        return self.parts[int(self.source[i])][int(self.local[i])]

    def pixel_values(self, sample: Sample) -> torch.Tensor:
        return torch.zeros(0, 1, 1, 1)

    def describe(self, max_seq_len: int, long_docs: str) -> list[str]:
        """Lines stating what was read and how long documents were handled."""
        lines = [f"data=tokens: {name}: {len(p.docs)} documents -> {len(p)} samples, weight "
                 f"{w / sum(self.weights):.3f} ({int(np.sum(self.source == k))} of {len(self)} per "
                 f"epoch)"
                 + (f"; {p.split} documents over max_seq_len={max_seq_len} "
                    + ("truncated" if long_docs == "truncate" else "split into pieces")
                    + f" (data.long_docs={long_docs})" if p.split else "")
                 + (f"; {p.empty} documents without a target token skipped" if p.empty else "")
                 for k, (name, p, w) in enumerate(zip(self.names, self.parts, self.weights))]
        return lines


def build_tokens(d, tokenizer, vocab_size: int) -> BlendedTokens:
    """`data=tokens` from its config block `d`.

    Raises:
        ConfigError: no sources, an entry without a path or with a weight <= 0, a missing file.
        hcp.data.llava.DataError: a corrupt or bad source file.
    """
    if not d.get("sources"):
        raise ConfigError("data.sources", d.get("sources"), "data=tokens needs at least one source",
                          "data.sources='[{path: PREFIX_OR_FILE.jsonl, weight: 1.0}]'")
    parts, weights, names = [], [], []
    for i, src in enumerate(d.sources):
        path, weight = src.get("path"), float(src.get("weight", 1.0))
        if not path or weight <= 0:
            raise ConfigError(f"data.sources[{i}]", dict(src), "needs a path and a weight > 0",
                              "write {path: PREFIX_OR_FILE.jsonl, weight: 0.5}")
        try:
            docs = open_source(path, tokenizer, d.text_key)
        except FileNotFoundError as e:  # a user error: one line before any rank starts
            raise ConfigError(f"data.sources[{i}].path", path,
                              str(e).removeprefix("data.sources: "),
                              "give a .jsonl file or the PREFIX of PREFIX.bin + "
                              "PREFIX.idx") from None
        parts.append(TokenSamples(docs, d.max_seq_len, d.long_docs, vocab_size))
        weights.append(weight)
        names.append(path)
    return BlendedTokens(parts, weights, names)
