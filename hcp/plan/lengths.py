"""The length index: every sample's sizes, read once when the data is read (docs/design.md 4.1).

The step plan needs, per sample of a global batch, its merged length (text tokens after each
`<image>` is expanded into its image-token placeholders), its loss tokens and where its image
rows sit in the merged sequence; it must never load samples (let alone decode images) to learn
them. `build_length_index(dataset, image_token_id)` reads each sample's token ids once (LLaVA
samples are tokenized in memory when the data set is read; no image is opened) and keeps flat
numpy arrays; `LengthIndex.take(indices)` gathers one global batch's `SampleSizes` in O(batch).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hcp.data.host import IGNORE_INDEX


def _ragged_take(offsets: np.ndarray, values: np.ndarray, rows: np.ndarray):
    """(new offsets [len(rows) + 1], values of `rows` concatenated) of a ragged array."""
    counts = offsets[rows + 1] - offsets[rows]
    new_off = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(counts, out=new_off[1:])
    start = np.repeat(offsets[rows] - new_off[:-1], counts)
    return new_off, values[start + np.arange(new_off[-1])]


@dataclass(frozen=True)
class SampleSizes:
    """Per-sample sizes of a sequence of samples (a global batch, or a whole data set).

    All arrays are int64. Image `i` of sample `s` is entry `image_offsets[s] + i` of the image
    arrays, in order of appearance; it occupies merged positions
    `[image_starts[k], image_starts[k] + image_rows_each[k])` of its sample, and its rows are
    the sample's image rows in that order (row keys of `hcp.parallel.routing`).
    """

    tokens: np.ndarray
    """[B] merged length of each sample (text + image-token placeholders), in tokens."""
    loss_tokens: np.ndarray
    """[B] tokens with a label (not IGNORE_INDEX)."""
    image_offsets: np.ndarray
    """[B + 1] prefix sums of images per sample."""
    image_starts: np.ndarray
    """[I] first merged position of each image."""
    image_rows_each: np.ndarray
    """[I] image rows (tokens) of each image."""

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def images(self) -> np.ndarray:
        """[B] images per sample."""
        return np.diff(self.image_offsets)

    @property
    def image_rows(self) -> np.ndarray:
        """[B] image rows per sample (sum over its images)."""
        c = np.zeros(len(self.image_rows_each) + 1, dtype=np.int64)
        np.cumsum(self.image_rows_each, out=c[1:])
        return c[self.image_offsets[1:]] - c[self.image_offsets[:-1]]

    def take(self, indices) -> "SampleSizes":
        """The sizes of samples `indices` (in that order)."""
        idx = np.asarray(indices, dtype=np.int64)
        off, starts = _ragged_take(self.image_offsets, self.image_starts, idx)
        _, rows = _ragged_take(self.image_offsets, self.image_rows_each, idx)
        return SampleSizes(self.tokens[idx], self.loss_tokens[idx], off, starts, rows)

    @classmethod
    def from_lists(cls, tokens, loss_tokens, images: list[list[tuple[int, int]]]) -> "SampleSizes":
        """From per-sample lists; `images[s]` is [(start, rows), ...] in order of appearance.

        Raises ValueError when an image leaves its sample or images overlap.
        """
        flat = [im for per in images for im in per]
        off = np.zeros(len(images) + 1, dtype=np.int64)
        np.cumsum([len(per) for per in images], out=off[1:])
        sizes = cls(np.asarray(tokens, dtype=np.int64), np.asarray(loss_tokens, dtype=np.int64),
                    off, np.asarray([a for a, _ in flat], dtype=np.int64).reshape(-1),
                    np.asarray([b for _, b in flat], dtype=np.int64).reshape(-1))
        for s, per in enumerate(images):
            end = 0
            for a, b in per:
                if a < end or b < 1 or a + b > sizes.tokens[s]:
                    raise ValueError(f"sample {s}: image at [{a}, {a + b}) overlaps another or "
                                     f"leaves its {int(sizes.tokens[s])} tokens")
                end = a + b
        return sizes


def _text_only(tokens: np.ndarray, loss_tokens: np.ndarray) -> SampleSizes:
    n = len(tokens)
    none = np.zeros(0, dtype=np.int64)
    return SampleSizes(tokens.astype(np.int64), loss_tokens.astype(np.int64),
                       np.zeros(n + 1, dtype=np.int64), none, none)


def _runs(positions: np.ndarray, rows_per_image: int) -> tuple[np.ndarray, np.ndarray]:
    """Image starts and rows from a sample's placeholder positions (each image is one run of
    `rows_per_image` placeholders; adjacent images are told apart by the count)."""
    if rows_per_image == 0 and len(positions) == 0:  # a text-only model
        return positions, positions
    if rows_per_image == 0 or len(positions) % rows_per_image:
        raise ValueError(f"{len(positions)} image placeholders are not a multiple of "
                         f"{rows_per_image} per image")
    starts = positions[::rows_per_image]
    return starts, np.full(len(starts), rows_per_image, dtype=np.int64)


def build_length_index(dataset, image_token_id: int, rows_per_image: int,
                       encoder: str = "vision") -> SampleSizes:
    """Sizes of every sample of `dataset` (`hcp.data` LLaVA, code corpus or token data sets),
    without images.

    Args:
        dataset: indexable samples with `input_ids`, `labels` (already shifted) and `images`;
            `hcp.data.code_corpus.CodeCorpus` and `hcp.data.tokens.BlendedTokens` are read
            from their document tables instead (no token is read).
        image_token_id: the placeholder id; rows_per_image: placeholders per image (patches).
        encoder: whose inputs the placeholders stand for (`Sample.items(encoder)`; several
            encoders: one index per stream into the LLM, `hcp.plan.lengths.stream_indexes`).

    Raises:
        ValueError: a sample's placeholders do not form whole images.
    """
    from hcp.data.code_corpus import CodeCorpus
    from hcp.data.tokens import BlendedTokens

    if isinstance(dataset, CodeCorpus):  # every chunk is text: sizes from the document table
        doc_len = np.array([len(d) for d in dataset.docs], dtype=np.int64)
        chunks = np.array(dataset.chunks, dtype=np.int64).reshape(-1, 2)
        left = doc_len[chunks[:, 0]] - chunks[:, 1]
        return _text_only(np.minimum(dataset.max_seq_len, left),
                          np.minimum(dataset.max_seq_len + 1, left) - 1)
    if isinstance(dataset, BlendedTokens):  # pieces of max_seq_len + 1 tokens, every label valid
        per_part = [np.minimum(p.max_seq_len, p.docs.doc_lengths()[p.doc_of] - p.start - 1)
                    for p in dataset.parts]
        tokens = np.concatenate([per_part[k][dataset.local[dataset.source == k]] for k in
                                 range(len(per_part))]) if len(dataset) else np.zeros(0, np.int64)
        order = np.concatenate([np.flatnonzero(dataset.source == k) for k in range(len(per_part))])
        out = np.empty(len(dataset), np.int64)
        out[order] = tokens
        return _text_only(out, out)
    n = len(dataset)
    tokens, loss, counts, starts, rows = (np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64),
                                          np.zeros(n, dtype=np.int64), [], [])
    for i in range(n):
        s = dataset[i]
        ids = np.asarray(s.input_ids, dtype=np.int64)
        tokens[i] = len(ids)
        loss[i] = int(np.count_nonzero(np.asarray(s.labels) != IGNORE_INDEX))
        a, b = _runs(np.flatnonzero(ids == image_token_id), rows_per_image)
        items = s.items(encoder) if hasattr(s, "items") else s.images
        if len(a) != len(items):
            raise ValueError(f"sample {s.id!r}: {len(a)} image-token runs but {len(items)} images")
        counts[i] = len(a)
        starts.append(a)
        rows.append(b)
    off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=off[1:])
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, dtype=np.int64)  # noqa: E731
    return SampleSizes(tokens, loss, off, cat(starts), cat(rows))


def stream_indexes(dataset, token_ids: dict[str, int], rows_per_item: dict[str, int],
                   encoders: dict[str, str]) -> dict[str, SampleSizes]:
    """One length index per stream into the LLM (`hcp.config.modules.streams`), by projector:
    the stream's placeholder id (`token_ids`), rows per input (`rows_per_item`) and encoder
    (`encoders`). Tokens and loss tokens are the same in every index; the image arrays are the
    stream's rows. Raises ValueError as `build_length_index`."""
    return {p: build_length_index(dataset, token_ids[p], rows_per_item[p], encoders[p])
            for p in token_ids}


class LengthIndexes:
    """The length index of the default stream (LLaVA's `<image>` rows, or a text-only model's
    lengths) and, with several streams, one per stream into the LLM (`stream_indexes`).
    `specs`: the run's `hcp.config.specs.ModuleSpecs`."""

    def __init__(self, specs, dataset, tok):
        flows = specs.streams if hasattr(dataset, "stream_ids") else ()
        self.streams = stream_indexes(dataset, dataset.stream_ids,
                                      {s.projector: specs.rows(s) for s in flows},
                                      {s.projector: s.encoder for s in flows}) if flows else {}
        first = ("projector"
                 if "projector" in self.streams else flows[0].projector if flows else None)
        self.default = (self.streams[first]
                        if first else build_length_index(dataset, tok.image_token_id, 0))

    def take(self, indices):
        """(the batch's default sizes, {projector: sizes} of every stream or {})."""
        return self.default.take(indices), {p: ix.take(indices) for p, ix in self.streams.items()}
