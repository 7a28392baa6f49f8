"""Document-length pools and seed lists shared by the dynamic-CP benchmarks (`dynamic_cp.py`,
simulated; `dynamic_cp_train.py`, measured on gloo ranks).

Pools, in tokens: `wikipedia` (FlexSP's Wikipedia sample, hcp/data/lengths/), `code` (this
Python's standard-library sources as byte-level documents `[bos] + bytes + [eos]`: the
`code_corpus` data set's lengths), `lognormal` (Megatron's dynamic-CP example's: numpy
`lognormal(ln(max_len / 8), 1.5)`, rounded and clipped to [max_len / 64, max_len], a fixed pool of
100,000 draws of default_rng(20260101); at max_len 8192 median 1024, clipped to [128, 8192]), or a
file of one positive integer per line.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

WIKIPEDIA = Path(__file__).resolve().parents[1] / "hcp/data/lengths/wikipedia_sample.txt"
DISTRIBUTIONS = ("wikipedia", "code", "lognormal")


def lognormal_lengths(max_len: int = 8192) -> np.ndarray:
    """The `lognormal` pool scaled to `max_len` (module docstring), in draw order."""
    rng = np.random.default_rng(20260101)
    draws = np.rint(rng.lognormal(np.log(max_len / 8), 1.5, 100_000))
    return np.clip(draws, max(1, max_len // 64), max_len).astype(np.int64)


def distribution(name: str, max_len: int = 8192) -> np.ndarray:
    """The pool `name` (one of `DISTRIBUTIONS`, or a file of lengths), unsorted; `max_len` scales
    only `lognormal`. ValueError for a bad file (`read_lengths`)."""
    if name == "wikipedia":
        return read_lengths(WIKIPEDIA)
    if name == "code":
        from hcp.data.code_corpus import stdlib_sources
        return np.array([os.path.getsize(f) + 2 for f in stdlib_sources()], dtype=np.int64)
    if name == "lognormal":
        return lognormal_lengths(max_len)
    return read_lengths(name)


def read_lengths(path) -> np.ndarray:
    """Sequence lengths (tokens) from a text file: one positive integer per line, blank lines
    and `#` comments allowed; ValueError naming the file, line number and text otherwise."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        if not text.isdecimal() or int(text) < 1:
            raise ValueError(f"--lengths {path}, line {n}: {line.strip()!r} is not a positive "
                             f"integer; give one token count per line (# starts a comment)")
        out.append(int(text))
    return np.array(out, dtype=np.int64)


def parse_seeds(text: str) -> list[int]:
    """`A-B` (inclusive) or `a,b,c` -> seeds; ValueError naming the text otherwise."""
    try:
        a, _, b = text.partition("-")
        seeds = list(range(int(a), int(b) + 1)) if b else [int(x) for x in text.split(",")]
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0:
        raise ValueError(f"--seeds {text!r}: give A-B or a comma list of seeds >= 0, e.g. 100-104")
    return seeds
