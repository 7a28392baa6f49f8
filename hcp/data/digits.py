"""Built-in `digits_vqa`: scikit-learn's 1,797 handwritten digit scans as a LLaVA data set.

On first use the 8x8 scans (UCI optical recognition of handwritten digits, bundled with
scikit-learn) are written as PNG files plus `train.json` / `eval.json` in LLaVA conversation
format ("What digit is in the image?" -> "seven"); they are then read back through the same
`LlavaDataset` that users' data takes. The split is fixed (a seeded permutation).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile

import numpy as np
from PIL import Image

WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
QUESTION = "What digit is in the image?"
SPLIT_SEED = 0


@contextlib.contextmanager
def _written_in_place(root: str, out: str, prefix: str):
    """Yield a new temporary folder under `root` to write a data set into; when the body
    finishes, rename it to `out` (if another run got there first, keep theirs); if the body
    raises, remove it. Concurrent runs and a crash never leave a half-written set."""
    tmp = tempfile.mkdtemp(prefix=prefix, dir=root)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.rename(tmp, out)
    except OSError:  # another run finished first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def build_lock(root: str):
    """Hold an exclusive lock on `root/.build.lock` (created) while building a data set there.
    Under `srun` every task prepares the data at once, before any process group exists: the
    first task to take the lock builds, the others wait on it (no collective, no polling) and
    then find the set written. A lock is per filesystem, so tasks on other nodes with a local
    `data.root` build their own copy. Where the filesystem refuses `flock` (Lustre mounted
    without `-o flock`), every task builds, as safely as without the lock
    (`_written_in_place`). The kernel drops the lock of a task that dies: no hang."""
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, ".build.lock"), "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:  # no flock on this filesystem
            pass
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(f, fcntl.LOCK_UN)


def build_digits_vqa(root: str, eval_fraction: float = 0.15) -> str:
    """Write the data set under `root/digits_vqa-eval{eval_fraction}` unless it is already there;
    return that folder. Each held-out fraction has its own folder, so changing
    `data.eval_fraction` builds a new split instead of reading the old one.

    The write goes to a temporary sibling folder renamed into place, so concurrent runs and a
    crash never leave a half-written set.
    """
    out = os.path.join(root, f"digits_vqa-eval{eval_fraction:g}")
    if os.path.isfile(os.path.join(out, "eval.json")):
        return out
    from sklearn.datasets import load_digits

    os.makedirs(root, exist_ok=True)
    with _written_in_place(root, out, ".digits_vqa-") as tmp:
        digits = load_digits()
        os.makedirs(os.path.join(tmp, "images"))
        records = []
        for i, (scan, label) in enumerate(zip(digits.images, digits.target)):
            rel = f"images/{i:04d}.png"
            pixels = np.clip(np.rint(scan * (255.0 / 16.0)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels, mode="L").save(os.path.join(tmp, rel))
            records.append({"id": f"digits-{i:04d}", "image": rel, "conversations": [
                {"from": "human", "value": f"<image>\n{QUESTION}"},
                {"from": "gpt", "value": WORDS[int(label)]}]})
        order = np.random.default_rng(SPLIT_SEED).permutation(len(records))
        n_eval = int(round(len(records) * eval_fraction))
        for name, idx in (("train.json", order[n_eval:]), ("eval.json", order[:n_eval])):
            with open(os.path.join(tmp, name), "w") as f:
                json.dump([records[j] for j in sorted(idx)], f)
    return out


PAIR_QUESTION = "Which two digits are shown?"
PAIR_KEY = "vision2"
"""The record key (and encoder name) of the second digit of `digits_pair`."""


def build_digits_pair(root: str, eval_fraction: float = 0.15) -> str:
    """Built-in `digits_pair`, the tiny two-encoder task: each record shows two digit scans,
    the first to the `vision` encoder (`image`, `<image>`) and the second to the encoder named
    `vision2` (`vision2`, `<vision2>`), and asks for both ("<image> <vision2>\\nWhich two digits
    are shown?" -> "7 3"); neither encoder alone can answer (digits, not words: each answer
    token then depends on the images). The scans are
    `digits_vqa`'s (built under root if needed); the pairs follow its split (a held-out record
    pairs two held-out scans) and a seeded shuffle. Written once to
    `root/digits_pair-v2-eval{eval_fraction}` (a temporary folder renamed into place; `v2` is
    the record format, so a cache of an older format is never read). Returns it."""
    out = os.path.join(root, f"digits_pair-v2-eval{eval_fraction:g}")
    if os.path.isfile(os.path.join(out, "eval.json")):
        return out
    scans = build_digits_vqa(root, eval_fraction)
    rel = os.path.join("..", os.path.basename(scans))  # the scans' folder, relative to `out`
    with _written_in_place(root, out, ".digits_pair-") as tmp:
        for name in ("train.json", "eval.json"):
            with open(os.path.join(scans, name)) as f:
                singles = json.load(f)
            partner = np.random.default_rng([SPLIT_SEED, len(singles)]).permutation(len(singles))
            records = []
            for a, b in zip(singles, (singles[j] for j in partner)):
                words = [str(WORDS.index(r["conversations"][1]["value"])) for r in (a, b)]
                records.append({"id": f"{a['id']}+{b['id'][len('digits-'):]}",
                                "image": os.path.join(rel, a["image"]),
                                PAIR_KEY: os.path.join(rel, b["image"]), "conversations": [
                                    {"from": "human",
                                     "value": f"<image> <{PAIR_KEY}>\n{PAIR_QUESTION}"},
                                    {"from": "gpt", "value": " ".join(words)}]})
            with open(os.path.join(tmp, name), "w") as f:
                json.dump(records, f)
    return out


TILE_GRIDS = ((1, 1), (1, 2), (2, 1), (2, 2))
"""(rows, columns) of the tile grids `digits_tiles` draws from (InternVL's aspect-ratio grids,
small)."""


def build_digits_tiles(root: str, eval_fraction: float = 0.15) -> str:
    """Built-in `digits_tiles`, InternVL-style dynamic tiling in miniature: each record shows a
    digit scan as its 8x8 thumbnail plus the tiles of a seeded grid (1x1, 1x2, 2x1 or 2x2: the
    scan resized to rows*8 x cols*8 and cut into 8x8 tiles), so a sample brings 2 to 5 images of
    one size ("<image>" per image, then "What digit is in the image?" -> "seven"). Built from
    `digits_vqa`'s scans and split under root if needed; written once to
    `root/digits_tiles-eval{eval_fraction}` (a temporary folder renamed into place). Returns it."""
    out = os.path.join(root, f"digits_tiles-eval{eval_fraction:g}")
    if os.path.isfile(os.path.join(out, "eval.json")):
        return out
    scans = build_digits_vqa(root, eval_fraction)
    with _written_in_place(root, out, ".digits_tiles-") as tmp:
        os.makedirs(os.path.join(tmp, "tiles"))
        for name in ("train.json", "eval.json"):
            with open(os.path.join(scans, name)) as f:
                singles = json.load(f)
            grids = np.random.default_rng([SPLIT_SEED, len(singles)]).integers(0, len(TILE_GRIDS),
                                                                               len(singles))
            records = []
            for record, g in zip(singles, grids):
                rows, cols = TILE_GRIDS[int(g)]
                scan = Image.open(os.path.join(scans, record["image"])).convert("L")
                big = scan.resize((cols * 8, rows * 8), Image.BILINEAR)
                thumb = os.path.relpath(os.path.join(scans, record["image"]), tmp)
                images = [thumb]
                for t in range(rows * cols):
                    rel = f"tiles/{record['id']}-{t}.png"
                    x, y = t % cols * 8, t // cols * 8
                    big.crop((x, y, x + 8, y + 8)).save(os.path.join(tmp, rel))
                    images.append(rel)
                records.append({"id": record["id"], "image": images, "conversations": [
                    {"from": "human", "value": "<image>" * len(images) + f"\n{QUESTION}"},
                    record["conversations"][1]]})
            with open(os.path.join(tmp, name), "w") as f:
                json.dump(records, f)
    return out
