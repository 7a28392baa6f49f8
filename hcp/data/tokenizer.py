"""Tokenizers: byte-level (built in, nothing to download) or a local Hugging Face
`tokenizer.json`."""
from __future__ import annotations

import json
import os

from hcp.config.errors import ConfigError


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then the special ids pad, bos, eos and image.

    `vocab_size` is 260; the LLM's embedding may be larger (padded for TP), never smaller.
    """

    pad_id, bos_id, eos_id, image_token_id = 256, 257, 258, 259
    vocab_size = 260
    eos_text = "</s>"

    def add_placeholders(self, names) -> dict[str, int]:
        """Placeholder ids for more row streams (`hcp.data.build.stream_token_ids`)."""
        return _add_placeholders(self, names)

    def encode(self, text: str) -> list[int]:
        """Text -> byte ids (no specials added)."""
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        """Ids -> text; special ids are dropped, invalid UTF-8 replaced."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local Hugging Face `tokenizer.json` (loaded with the `tokenizers` package).

    Special tokens are looked up by their LLaMA names (`<s>`, `</s>`, `<unk>` as pad). Image
    positions are marked by the file's `<image>` token; without one, in a byte-fallback model
    (LLaMA / Vicuna) by `<unk>`, which `encode` never produces there (LLaVA-1.5 adds no token to
    Vicuna's 32000 either; a stray one fails the image-slot count check loudly); otherwise by an
    id after the vocabulary.

    Raises:
        ConfigError: the path does not exist (names data.tokenizer and the fix).
        ImportError: the `tokenizers` package is missing (message says how to install it).
    """

    eos_text = "</s>"

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise ConfigError("data.tokenizer", path, "no such tokenizer.json file",
                              "give the path of a local Hugging Face tokenizer.json, or "
                              "data.tokenizer=byte (the default)")
        try:
            from tokenizers import Tokenizer
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("data.tokenizer is a tokenizer.json path but the `tokenizers` "
                              "package is missing: pip install tokenizers") from e
        self._tok = Tokenizer.from_file(path)
        vocab = self._tok.get_vocab()
        self.bos_id = vocab.get("<s>", 1)
        self.eos_id = vocab.get("</s>", 2)
        self.pad_id = vocab.get("<unk>", 0)
        n = self._tok.get_vocab_size()
        byte_fallback = json.loads(self._tok.to_str())["model"].get("byte_fallback", False)
        spare = vocab.get("<unk>", n) if byte_fallback else n
        self.image_token_id = vocab.get("<image>", spare)
        self.vocab_size = max(n, self.image_token_id + 1)

    def add_placeholders(self, names) -> dict[str, int]:
        """Placeholder ids for more row streams (`hcp.data.build.stream_token_ids`)."""
        return _add_placeholders(self, names)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        extra = set(getattr(self, "placeholder_ids", {}).values())
        return self._tok.decode([i for i in ids if i != self.image_token_id and i not in extra])


def _add_placeholders(tok, names) -> dict[str, int]:
    """Give each name in `names` (row streams besides the default `<image>` one) an id after the
    tokenizer's vocabulary, once: the vocabulary grows by one id per new name (the LLM's
    embedding must hold them: `llm.vocab_size >= vocab_size`). Returns {name: id} for `names`."""
    ids = tok.__dict__.setdefault("placeholder_ids", {})
    for name in names:
        if name not in ids:
            ids[name] = tok.vocab_size
            tok.vocab_size += 1
    return {name: ids[name] for name in names}


def build_tokenizer(spec: str):
    """`byte` -> ByteTokenizer; anything else is a path to a `tokenizer.json`."""
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec)
