"""Hugging Face checkpoint folders on disk: `config.json` plus safetensors weights, one
`model.safetensors` or shards listed by `model.safetensors.index.json` (`weight_map`).

Reading is lazy: `HFCheckpoint.read` opens the shard holding a tensor and reads only the rows
(or columns) asked for (safetensors' `get_slice`), so a TP rank never loads a whole 7B file.
Writing (`write_folder`, one file per call) produces the layout transformers' `save_pretrained`
writes; `hcp.train.export` adds the index of a sharded one.
safetensors is imported on first use, with a message saying how to install it.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _safetensors():
    try:
        from safetensors import safe_open
        from safetensors.torch import save_file
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("init_from / mode=export read and write safetensors checkpoints: "
                          "pip install safetensors") from e
    return safe_open, save_file


@dataclass(frozen=True)
class Source:
    """Where one of our whole tensors comes from in a checkpoint: `key`, optionally only rows
    [row_start, row_start + rows) of it (a part of a fused tensor such as `qkv_proj`), optionally
    reshaped to `shape` (CLIP's conv patch embedding [D, C, p, p] -> our linear [D, C*p*p])."""

    key: str
    row_start: int = 0
    rows: Optional[int] = None
    shape: Optional[tuple[int, ...]] = None


class HFCheckpoint:
    """A local Hugging Face checkpoint folder.

    Raises:
        FileNotFoundError: no config.json, or neither model.safetensors nor its index (names
            the folder and what it holds; `.bin` files get a conversion hint).
    """

    def __init__(self, folder: str, field: str = "init_from"):
        self.folder, self.field = folder, field
        cfg_path = os.path.join(folder, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"{field}={folder!r}: no config.json there (expected a Hugging "
                                    "Face checkpoint folder)")
        with open(cfg_path) as f:
            self.config = json.load(f)
        if os.path.isfile(os.path.join(folder, INDEX)):
            with open(os.path.join(folder, INDEX)) as f:
                self.files = dict(json.load(f)["weight_map"])
        elif os.path.isfile(os.path.join(folder, SINGLE)):
            safe_open, _ = _safetensors()
            with safe_open(os.path.join(folder, SINGLE), "pt") as f:
                self.files = {k: SINGLE for k in f.keys()}
        else:
            held = sorted(os.listdir(folder))
            hint = (" (.bin weights: convert them once with transformers, "
                    "`AutoModel.from_pretrained(DIR).save_pretrained(OUT)`, which writes "
                    "safetensors)"
                    if any(n.endswith(".bin") for n in held) else "")
            raise FileNotFoundError(f"{field}={folder!r}: neither {SINGLE} nor {INDEX}; the folder "
                                    f"holds {held[:8]}{hint}")
        self._meta: dict[str, tuple[tuple[int, ...], str]] = {}

    def keys(self) -> list[str]:
        return sorted(self.files)

    def _header(self, key: str) -> None:
        safe_open, _ = _safetensors()
        with safe_open(os.path.join(self.folder, self.files[key]), "pt") as f:
            for k in f.keys():
                if self.files.get(k) == self.files[key]:
                    sl = f.get_slice(k)
                    self._meta[k] = (tuple(sl.get_shape()), sl.get_dtype())

    def shape(self, key: str) -> tuple[int, ...]:
        """The stored shape of `key` (read from the shard's header only)."""
        if key not in self._meta:
            self._header(key)
        return self._meta[key][0]

    def dtype(self) -> str:
        """The dtype the checkpoint declares (`torch_dtype` / `dtype` in config.json), else
        float32."""
        name = self.config.get("torch_dtype") or self.config.get("dtype") or "float32"
        return name if name in DTYPES else "float32"

    def read(self, src: Source, dim: Optional[int] = None, start: int = 0,
             length: Optional[int] = None) -> torch.Tensor:
        """Our tensor from `src`, or only its [start, start + length) slice along `dim` (0 or 1)
        when given: only those bytes are read from disk. Returns the stored dtype."""
        safe_open, _ = _safetensors()
        shape = src.shape or self.shape(src.key)
        row0, rows = src.row_start, src.rows if src.rows is not None else shape[0]
        with safe_open(os.path.join(self.folder, self.files[src.key]), "pt") as f:
            sl = f.get_slice(src.key)
            if dim is None:
                t = sl[row0:row0 + rows]
            elif dim == 0:
                t = sl[row0 + start:row0 + start + length]
            elif src.shape is None:
                t = sl[row0:row0 + rows, start:start + length]
            else:
                raise ValueError(f"{src.key}: a reshaped tensor is sliced along dim 0 only")
        if src.shape is not None:
            t = t.reshape(t.shape[0], *src.shape[1:])
        return t


def write_folder(folder: str, name: str, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """Write `config.json` and one safetensors file `name` of {key: tensor} (contiguous, in
    their dtype) into `folder`; a sharded checkpoint's index is written by its caller."""
    _, save_file = _safetensors()
    os.makedirs(folder, exist_ok=True)
    save_file({k: t.contiguous() for k, t in tensors.items()}, os.path.join(folder, name),
              metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
