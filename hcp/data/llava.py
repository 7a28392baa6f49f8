"""LLaVA-1.5 conversation JSON -> token samples (Vicuna-v1 template, assistant-only loss).

A record is `{"id": ..., "image": "rel/path.png" | [paths] | absent, "conversations":
[{"from": "human", "value": "<image>\\nQuestion"}, {"from": "gpt", "value": "Answer"}, ...]}`.
Each `<image>` expands into `num_image_tokens` placeholder ids before the label shift, so image
tokens per sample vary with the number of images. Labels are shifted here, once.

Several encoders (`encoders`, `hcp.config.modules`): a named encoder `e` takes its inputs from
the record key `e` (a path or a list of paths) and the text marks each with `<e>`; each
placeholder of an encoder expands into every one of its streams' placeholder ids in turn (a
branch: one tower feeding two projectors gives each input two runs, one per projector).
"""
from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
from PIL import Image

from hcp.data.host import IGNORE_INDEX
from hcp.data.packing import collate

IMAGE_PLACEHOLDER = "<image>"


class DataError(ValueError):
    """A bad record: the message names the file, the record id and what is wrong."""

    def __init__(self, file: str, record_id, kind: str, detail: str):
        self.file, self.record_id, self.kind = file, record_id, kind
        where = f"{file}: record id={record_id!r}" if record_id is not None else file
        hint = (" (set data.on_error=skip to skip such records and report them)"
                if record_id is not None else "")
        super().__init__(f"{where}: {kind}: {detail}{hint}")


def read_records(path: str) -> list:
    """The records of a LLaVA-style data file: a JSON list (LLaVA's `llava_instruct_*.json`), or
    JSON Lines, one record per line (how such data often ships, `.jsonl`), whatever the name.

    Raises:
        DataError: the file cannot be read, or is neither (naming the line of a bad JSONL line).
    """
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise DataError(path, None, "unreadable file", str(e)) from e
    try:
        records = json.loads(text)
    except json.JSONDecodeError as whole:
        lines = [(n, ln) for n, ln in enumerate(text.splitlines(), 1) if ln.strip()]
        if not lines or not lines[0][1].lstrip().startswith("{"):
            raise DataError(path, None, "unreadable file",
                            f"neither a JSON list nor JSON Lines ({whole})")
        records = []
        for n, line in lines:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(path, None, "unreadable file", f"line {n} is not one JSON record "
                                f"(JSON Lines: one record per line): {e}") from e
        return records
    if isinstance(records, dict):  # a JSON Lines file of one record
        return [records]
    if not isinstance(records, list):
        raise DataError(path, None, "malformed file",
                        "expected a JSON list of records, or JSON Lines")
    return records


@dataclass
class Sample:
    """One tokenized conversation.

    `input_ids`/`labels`: `[S]` ids, labels already shifted (`IGNORE_INDEX` where no loss);
    `images`: absolute image paths in order of appearance; `prompt_len`: tokens before the first
    answer (greedy decoding starts there); `answer`: the first assistant reply text.
    """

    id: str
    input_ids: list[int]
    labels: list[int]
    images: list[str]
    prompt_len: int
    answer: str
    inputs: dict = field(default_factory=dict)
    """Named encoders' input paths, {encoder: [paths]} (`vision`'s are `images`)."""

    def items(self, encoder: str = "vision") -> list[str]:
        """Input paths of `encoder`, in order of appearance."""
        return self.images if encoder == "vision" else self.inputs.get(encoder, [])


@dataclass
class SkipReport:
    """Records skipped under `data.on_error=skip`: counts per kind and the ids."""

    counts: Counter = field(default_factory=Counter)
    ids: dict = field(default_factory=dict)

    def add(self, err: DataError) -> None:
        self.counts[err.kind] += 1
        self.ids.setdefault(err.kind, []).append(err.record_id)

    def summary(self) -> str:
        return ", ".join(f"{k}: {n} (ids {self.ids[k][:5]}{'...' if n > 5 else ''})"
                         for k, n in sorted(self.counts.items())) or "none"


def load_image(path: str, image_size: int, num_channels: int) -> torch.Tensor:
    """Read an image file, resize to `image_size` (bicubic), scale to [-1, 1]: `[C, H, W]` fp32."""
    with Image.open(path) as im:
        im = im.convert("L" if num_channels == 1 else "RGB").resize(
            (image_size, image_size), Image.BICUBIC)
        t = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8).float()
    t = t.view(image_size, image_size, num_channels).permute(2, 0, 1)
    return t / 127.5 - 1.0


@dataclass(frozen=True)
class EncoderInput:
    """How a sample feeds one encoder: its placeholder (`<image>`, `<name>`), record key
    (`image`, `name`), what each placeholder expands into ((projector, token id, count) per
    stream, in order) and how an input file is read into `[C, H, W]`."""

    name: str
    expansion: tuple[tuple[str, int, int], ...]
    image_size: int
    num_channels: int
    loader: Callable = None

    @property
    def placeholder(self) -> str:
        return IMAGE_PLACEHOLDER if self.name == "vision" else f"<{self.name}>"

    @property
    def record_key(self) -> str:
        return "image" if self.name == "vision" else self.name


class LlavaDataset:
    """Reads a LLaVA JSON file into `Sample`s, validating every record up front.

    Args:
        path: the JSON file (a list of records).
        image_folder: folder the records' `image` paths are relative to.
        tokenizer: `hcp.data.tokenizer` tokenizer.
        num_image_tokens: placeholder tokens per image (the encoder's patches).
        image_size / num_channels: encoder input resolution and channels.
        max_seq_len: longest sample in tokens, after `<image>` expansion.
        system_prompt: Vicuna-v1 system text ("" for none).
        on_error: `error` raises `DataError` on the first bad record; `skip` drops bad records
            and counts them in `self.skipped`.
        image_loader: (path, image_size, num_channels) -> `[C, H, W]`; `load_image` by default
            (`hcp.data.clip_image.load_clip_image` for a CLIP encoder).
        encoders: every encoder's `EncoderInput` when the model has several encoders or
            streams (module docstring); None: `vision` alone, from the arguments above.

    Raises:
        DataError: a bad record under `on_error=error`, or an unreadable JSON / JSONL file.
    """

    has_answers = True

    def __init__(self, path, image_folder, tokenizer, num_image_tokens, image_size, num_channels,
                 max_seq_len, system_prompt="", on_error="error", image_loader=load_image,
                 encoders=None):
        if on_error not in ("error", "skip"):
            raise ValueError(f"data.on_error={on_error!r}: use `error` or `skip`")
        self.path, self.image_folder = path, image_folder or os.path.dirname(path)
        self.tok, self.num_image_tokens = tokenizer, num_image_tokens
        self.image_size, self.num_channels = image_size, num_channels
        self.image_loader = image_loader
        self.encoders = {e.name: e for e in encoders} if encoders else {"vision": EncoderInput(
            "vision", (("projector", tokenizer.image_token_id, num_image_tokens),), image_size,
            num_channels, image_loader)}
        self._split = re.compile("(" + "|".join(re.escape(e.placeholder)
                                                for e in self.encoders.values()) + ")")
        self.max_seq_len, self.system_prompt = max_seq_len, system_prompt
        self.skipped = SkipReport()
        records = read_records(path)
        if not records:
            raise DataError(path, None, "empty file", "the file holds no records")
        self.leading_turns_dropped = 0
        """Records whose conversation opened with a `gpt` turn, dropped as LLaVA does."""
        self.samples: list[Sample] = []
        for i, rec in enumerate(records):
            try:
                self.samples.append(self._build(rec, i))
            except DataError as err:
                if on_error == "error":
                    raise
                self.skipped.add(err)
        if not self.samples:
            raise DataError(path, None, "no usable records", f"all {len(records)} records were "
                            f"skipped under data.on_error=skip: {self.skipped.summary()}")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Sample:
        return self.samples[i]

    @property
    def stream_ids(self) -> dict[str, int]:
        """Placeholder id of every stream into the LLM, by projector."""
        return {p: token for e in self.encoders.values() for p, token, _ in e.expansion}

    def collate(self, samples, sources=None):
        """`hcp.data.packing.collate` of `samples` with every encoder's inputs and every
        stream's mask (`Batch.stream_masks`, `Batch.encoder_pixels`). `sources`: the `Sample`s
        whose inputs to read, one per sample (default: `samples`; greedy decoding collates
        growing prompts of them)."""
        sources = samples if sources is None else sources
        named = [e for e in self.encoders if e != "vision"]
        return collate(samples, [self.pixel_values(s) for s in sources], self.tok.image_token_id,
                       self.stream_ids,
                       {e: [self.pixel_values(s, e) for s in sources] for e in named})

    def pixel_values(self, sample: Sample, encoder: str = "vision") -> torch.Tensor:
        """The sample's inputs of `encoder` (default: its images), `[I, C, H, W]` fp32 (I may be
        0)."""
        e = self.encoders[encoder]
        paths = sample.items(encoder)
        if not paths:
            return torch.zeros(0, e.num_channels, e.image_size, e.image_size)
        load = e.loader or self.image_loader
        return torch.stack([load(p, e.image_size, e.num_channels) for p in paths])

    def _build(self, rec, index) -> Sample:
        rid = rec.get("id", f"#{index}") if isinstance(rec, dict) else f"#{index}"
        fail = lambda kind, detail: DataError(self.path, rid, kind, detail)  # noqa: E731
        convs = rec.get("conversations") if isinstance(rec, dict) else None
        if not isinstance(convs, list) or not convs or not all(
                isinstance(t, dict)
                and t.get("from") in ("human", "gpt") and isinstance(t.get("value"), str)
                for t in convs):
            raise fail("malformed record", "`conversations` must be a non-empty list of "
                       "{'from': 'human'|'gpt', 'value': str}")
        if convs[0]["from"] != "human":
            # LLaVA's preprocess drops a conversation's leading non-human turn: it would otherwise
            # become a training target with no prompt, and evaluation's expected answer.
            convs = convs[1:]
            self.leading_turns_dropped += 1
        if not any(t["from"] == "gpt" for t in convs):
            raise fail("no assistant turn", "no turn has from='gpt'")
        inputs = {}
        for e in self.encoders.values():
            paths = rec.get(e.record_key)
            paths = [] if paths is None else [paths] if isinstance(paths, str) else paths
            if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
                raise fail("malformed record",
                           f"`{e.record_key}` must be a path or a list of paths")
            n_ph = sum(t["value"].count(e.placeholder) for t in convs)
            if n_ph != len(paths):
                what = "images" if e.name == "vision" else f"`{e.record_key}` inputs"
                raise fail("image count mismatch",
                           f"{n_ph} {e.placeholder} placeholders but {len(paths)} {what}")
            inputs[e.name] = [os.path.join(self.image_folder, p) for p in paths]
        for p in (p for paths in inputs.values() for p in paths):
            try:
                with Image.open(p) as im:
                    im.verify()
            except (OSError, SyntaxError) as e:
                kind = "missing image" if not os.path.exists(p) else "unreadable image"
                raise fail(kind, f"{p}: {e}") from e
        paths = inputs.pop("vision", [])
        ids, target = self._tokenize(convs)
        if len(ids) > self.max_seq_len:
            raise fail("sample too long",
                       f"{len(ids)} tokens > data.max_seq_len={self.max_seq_len}")
        labels = [ids[t + 1] if target[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)]
        labels.append(IGNORE_INDEX)
        prompt_len = target.index(True)
        answer = next(t["value"] for t in convs if t["from"] == "gpt")
        return Sample(str(rid), ids, labels, paths, prompt_len, answer, inputs)

    def _tokenize(self, convs):
        """Vicuna v1: `SYSTEM USER: q ASSISTANT: a</s>USER: ...`; returns ids and target mask."""
        tok = self.tok
        ids, target = [tok.bos_id], [False]

        def add(toks, is_target=False):
            ids.extend(toks)
            target.extend([is_target] * len(toks))

        if self.system_prompt:
            add(tok.encode(self.system_prompt + " "))
        for turn in convs:
            if turn["from"] == "human":
                add(tok.encode("USER: "))
                by_text = {e.placeholder: e for e in self.encoders.values()}
                for j, part in enumerate(self._split.split(turn["value"])):
                    if j % 2:  # a placeholder: every stream's ids of its encoder, in turn
                        for _, token, count in by_text[part].expansion:
                            add([token] * count)
                    elif part:
                        add(tok.encode(part))
                add(tok.encode(" ASSISTANT:"))
            else:
                add(tok.encode(" " + turn["value"]) + [tok.eos_id], is_target=True)
        return ids, target
