"""Build the train and held-out data sets named by `data.name`."""
from __future__ import annotations

import os
import sysconfig

from hcp.config.errors import ConfigError
from hcp.data.clip_image import load_clip_image
from hcp.data.code_corpus import CodeCorpus, stdlib_sources
from hcp.data.digits import build_digits_pair, build_digits_tiles, build_digits_vqa, build_lock
from hcp.data.llava import EncoderInput, LlavaDataset, load_image
from hcp.data.tokenizer import build_tokenizer
from hcp.data.tokens import build_tokens


BUILT_IN = {"digits_vqa": build_digits_vqa, "digits_pair": build_digits_pair,
            "digits_tiles": build_digits_tiles}
"""Built-in image data sets (`data.name`) -> their builder (`hcp.data.digits`)."""

def num_image_tokens(vision_cfg) -> int:
    """Image tokens per image: the encoder's patches, (image_size / patch_size)^2."""
    return 0 if vision_cfg is None else (vision_cfg.image_size // vision_cfg.patch_size) ** 2


def stream_token_ids(specs, tok) -> dict[str, int]:
    """Placeholder id of every stream into the LLM (`hcp.config.specs.ModuleSpecs.streams`), by
    projector: the default `projector` takes the tokenizer's image id, every other stream an id
    after the vocabulary (`add_placeholders`: the tokenizer's vocab_size grows accordingly)."""
    names = [s.projector for s in specs.streams]
    extra = tok.add_placeholders([n for n in names if n != "projector"])
    return {n: tok.image_token_id if n == "projector" else extra[n] for n in names}


def encoder_inputs(specs, tok) -> tuple[EncoderInput, ...] | None:
    """What each encoder reads from a sample and what its placeholder expands into
    (`hcp.data.llava.EncoderInput`), or None for the plain LLaVA graph (vision -> projector ->
    llm, unpooled), which `LlavaDataset` builds from its own arguments."""
    plain = [(s.projector, s.encoder) for s in specs.streams] == [("projector", "vision")]
    if ("vision" not in specs
        or (plain and specs["projector"].pool == 1 and len(specs.of_kind("encoder")) == 1)):
        return None
    ids = stream_token_ids(specs, tok)
    out = []
    for e in specs.of_kind("encoder"):
        c = e.arch
        expansion = tuple((s.projector, ids[s.projector], specs.rows(s)) for s in specs.streams
                          if s.encoder == e.name)
        out.append(EncoderInput(e.name, expansion, c.image_size, c.num_channels,
                                load_clip_image if c.arch == "clip" else load_image))
    return tuple(out)


def build_builtin(name: str, root: str, eval_fraction: float) -> str:
    """Write the built-in data set `name` (`BUILT_IN`) under `root` unless it is there, one task
    at a time (`hcp.data.digits.build_lock`: under srun the first task builds, the others wait
    and read it); returns its folder."""
    with build_lock(root):
        return BUILT_IN[name](root, eval_fraction)


def prepare_data(cfg, specs) -> list[str]:
    """In the launching process, before ranks start: check that the LLM's vocabulary holds the
    tokenizer's ids, write built-in data sets once and read every record (so a bad record stops
    the run here, naming its file and id, instead of inside N ranks). Returns the lines that
    report skipped records (`data.on_error=skip`) and conversations whose leading `gpt` turn
    was dropped.

    Raises:
        ConfigError: `llm.vocab_size` is smaller than the tokenizer's vocabulary, or the global
            batch is larger than the training set.
        hcp.data.llava.DataError: a bad record under `data.on_error=error`, an empty file, or a
            file none of whose records is usable.
    """
    tok = build_tokenizer(cfg.data.tokenizer)
    encoder_inputs(specs, tok)  # more streams: more placeholder ids the LLM's vocabulary must hold
    if cfg.llm.vocab_size < tok.vocab_size:
        raise ConfigError("llm.vocab_size", cfg.llm.vocab_size,
                          f"smaller than the {tok.vocab_size} "
                          f"ids of data.tokenizer={cfg.data.tokenizer!r}",
                          f"set llm.vocab_size to at least {tok.vocab_size} (a multiple of tp)")
    if cfg.data.name in BUILT_IN:
        build_builtin(cfg.data.name, cfg.data.root, cfg.data.eval_fraction)
    _, train, held_out = build_datasets(cfg, specs)  # every record validated here, before any rank
    if len(train) < cfg.trainer.global_batch_size:
        raise ConfigError("trainer.global_batch_size", cfg.trainer.global_batch_size,
                          f"exceeds the {len(train)} training samples", "lower it or add data")
    sets = [(name, ds) for name, ds in (("train", train), ("held-out", held_out)) if ds is not None]
    stated = (train.describe(cfg.data.max_seq_len, cfg.data.long_docs) if cfg.data.name == "tokens"
              else [])
    return stated + ([f"data.on_error=skip: skipped {sum(ds.skipped.counts.values())} {name} "
                      f"records: "
             f"{ds.skipped.summary()}" for name, ds in sets if ds.skipped.counts] +
            [f"data: dropped the leading `gpt` turn of {ds.leading_turns_dropped} {name} records "
             f"of {ds.path} (a conversation opens with the human turn; LLaVA drops it too)"
             for name, ds in sets if getattr(ds, "leading_turns_dropped", 0)])


def build_datasets(cfg, specs):
    """Return (tokenizer, train set, held-out set or None) for `cfg.data`, with the encoders of
    `specs` (`hcp.config.specs.ModuleSpecs`).

    Raises:
        ConfigError: unknown `data.name`, a missing `data.path` (or a path that is not there),
        images without an encoder.
        hcp.data.llava.DataError: a bad record under `data.on_error=error`.
    """
    d, v = cfg.data, specs["vision"].arch if "vision" in specs else None
    tok = build_tokenizer(d.tokenizer)
    if d.name in BUILT_IN:
        root = build_builtin(d.name, d.root, d.eval_fraction)
        train_path, eval_path, folder = (os.path.join(root, "train.json"),
                                         os.path.join(root, "eval.json"), root)
    elif d.name == "code_corpus":
        root = d.path or sysconfig.get_paths()["stdlib"]
        files = stdlib_sources(root)
        make = lambda held: CodeCorpus(files, root, tok, d.max_seq_len, held, d.eval_fraction,
                                         d.long_docs)  # noqa: E731
        return tok, make(False), make(True)
    elif d.name == "tokens":  # text only: no id may stand for an image position
        tok.image_token_id = -1
        return tok, build_tokens(d, tok, cfg.llm.vocab_size), None
    elif d.name == "llava_json":
        if not d.path:
            raise ConfigError("data.path", d.path, "data=llava_json needs the JSON file",
                              "add data.path=FILE.json (and data.image_folder=DIR)")
        for key, path in (("data.path", d.path), ("data.eval_path", d.eval_path)):
            if path and not os.path.isfile(path):
                raise ConfigError(key, path, "no such file", "give the path of a LLaVA-1.5 "
                                  "conversation file (a JSON list, or JSON Lines)")
        if d.image_folder and not os.path.isdir(d.image_folder):
            raise ConfigError("data.image_folder", d.image_folder, "no such folder",
                              "give the folder "
                              "the records' image paths are relative to (default: data.path's "
                              "folder)")
        train_path, eval_path, folder = d.path, d.eval_path, d.image_folder
    else:
        raise ConfigError("data.name", d.name, "unknown data set",
                          "use digits_vqa, digits_pair, digits_tiles, "
                          "llava_json, code_corpus or tokens")
    if v is None:
        raise ConfigError("data.name", d.name, "LLaVA data has images but the config has no vision "
                          "encoder",
                          "use a LLaVA model config, or data=code_corpus for a text-only LM")
    # CLIP: LLaVA-1.5's pad + normalize
    loader = load_clip_image if v.arch == "clip" else load_image
    inputs = encoder_inputs(specs, tok)  # several encoders or streams (hcp.config.modules)
    make = lambda p: LlavaDataset(p, folder, tok, num_image_tokens(v), v.image_size,  # noqa: E731
                                  v.num_channels, d.max_seq_len, d.system_prompt, d.on_error,
                                  loader, inputs)
    return tok, make(train_path), (make(eval_path) if eval_path else None)
