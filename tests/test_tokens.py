"""`data=tokens`: Megatron indexed data sets (exact format, a file written by Megatron's own
IndexedDatasetBuilder checked in), JSONL text, long documents split or rejected, blending."""
import json
import os
import struct

import numpy as np
import pytest
from omegaconf import OmegaConf

from cfg_utils import REPO, compose_cfg
from dist_utils import run_ranks

from hcp.config.errors import ConfigError
from hcp.config.validate import validate
from hcp.data.build import build_datasets, prepare_data
from hcp.data.indexed import DTYPES, MAGIC, IndexedDataset, write_indexed
from hcp.data.llava import DataError
from hcp.data.loader import GlobalBatchSampler
from hcp.data.tokenizer import ByteTokenizer
from hcp.data.tokens import JsonlDocuments, TokenSamples, blend
from cfg_utils import with_specs

CHECKED_IN = os.path.join(REPO, "tests", "data", "megatron_tiny")
"""Written by megatron-core 0.16.1's IndexedDatasetBuilder (uint16): 5 documents, the second
made of two sequences (as with --split-sentences)."""
DOCS = [[[1, 72, 101, 108, 108, 111, 2]], [[1, 500, 40000], [65535, 7, 2]], [[3]],
        [[1, *range(10, 30), 2]], [[9, 8, 7, 6]]]


def test_megatron_written_file_reads_as_its_documents():
    ds = IndexedDataset(CHECKED_IN)
    assert len(ds) == 5 and ds.dtype == np.uint16
    assert [ds[j].tolist() for j in range(5)] == [sum(d, []) for d in DOCS]
    assert ds.doc_lengths().tolist() == [7, 6, 1, 22, 4]


def test_our_writer_is_byte_identical_to_megatrons_and_the_header_is_as_specified(tmp_path):
    write_indexed(str(tmp_path / "ours"), DOCS, np.uint16)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == open(CHECKED_IN + ext, "rb").read()
    raw = (tmp_path / "ours.idx").read_bytes()
    assert raw[:9] == MAGIC == b"MMIDIDX\x00\x00"
    assert struct.unpack("<QBQQ", raw[9:34]) == (1, 8, 6, 6)  # version, uint16 code, seqs, doc idx
    assert np.frombuffer(raw, np.int32, 6, 34).tolist() == [7, 3, 3, 1, 22, 4]
    assert np.frombuffer(raw, np.int64, 6, 58).tolist() == [0, 14, 20, 26, 28, 72]  # byte offsets
    assert np.frombuffer(raw, np.int64, 6, 106).tolist() == [0, 1, 3, 4, 5, 6]
    assert len(raw) == 154
    for code, dtype in DTYPES.items():  # every dtype code round-trips
        write_indexed(str(tmp_path / f"d{code}"), [[1, 2, 3], [4]], dtype)
        ds = IndexedDataset(str(tmp_path / f"d{code}"))
        assert (tmp_path / f"d{code}.idx").read_bytes()[17] == code
        assert [ds[0].tolist(), ds[1].tolist()] == [[1, 2, 3], [4]]


@pytest.mark.parametrize("damage, match", [
    (lambda b: b[:20], "truncated: 20 bytes, shorter than the 34-byte header"),
    (lambda b: b[:100], "truncated: 100 bytes, its header \\(6 sequences, 6 document indices\\) needs 154"),
    (lambda b: b"XXXXXXXXX" + b[9:], "not a Megatron index"),
    (lambda b: b[:17] + bytes([42]) + b[18:], "unknown dtype code 42"),
    (lambda b: b[:106] + np.array([0, 1, 5, 4, 5, 6], np.int64).tobytes(), "corrupt document index"),
])
def test_corrupt_or_truncated_idx_is_an_error_naming_the_file(tmp_path, damage, match):
    prefix = str(tmp_path / "bad")
    write_indexed(prefix, DOCS, np.uint16)
    raw = open(prefix + ".idx", "rb").read()
    open(prefix + ".idx", "wb").write(damage(raw))
    with pytest.raises(DataError, match=match) as e:
        IndexedDataset(prefix)
    assert str(e.value).startswith(f"{prefix}.idx: corrupt Megatron data set")


def test_truncated_bin_is_an_error_naming_it(tmp_path):
    prefix = str(tmp_path / "bad")
    write_indexed(prefix, DOCS, np.uint16)
    os.truncate(prefix + ".bin", 50)
    with pytest.raises(DataError, match=f"{prefix}.bin: .*truncated: 50 bytes"):
        IndexedDataset(prefix)


def test_long_documents_are_split_or_rejected_and_labels_shift_inside_each_piece():
    ds = IndexedDataset(CHECKED_IN)
    split = TokenSamples(ds, 8, "split", 65536)
    # docs: 7 tokens -> 1 piece, 6 -> 1, 1 -> none (no target), 22 -> 3 pieces, 4 -> 1
    assert len(split) == 6 and split.split == 1 and split.empty == 1
    pieces = [split[i] for i in range(2, 5)]
    assert [p.input_ids for p in pieces] == [[1, *range(10, 17)], list(range(17, 25)), list(range(25, 30))]
    assert [p.labels for p in pieces] == [list(range(10, 18)), list(range(18, 26)), [26, 27, 28, 29, 2]]
    assert split[1].input_ids == [1, 500, 40000, 65535, 7] and split[1].labels == [500, 40000, 65535, 7, 2]
    with pytest.raises(DataError, match=r"megatron_tiny: record id='document 3': document too long: "
                                        r"21 input tokens > data.max_seq_len=8"):
        TokenSamples(ds, 8, "reject", 65536)
    with pytest.raises(DataError, match="token id out of range"):
        TokenSamples(ds, 8, "split", 1000)[1]


def test_jsonl_is_tokenized_with_bos_eos_and_a_bad_line_names_file_and_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"text": "héllo"}) + "\n\n" + json.dumps({"text": "ab"}) + "\n")
    tok = ByteTokenizer()
    docs = JsonlDocuments(str(path), tok)
    assert docs[0].tolist() == [257, *"héllo".encode(), 258] and docs[1].tolist() == [257, 97, 98, 258]
    path.write_text(json.dumps({"text": "ok"}) + "\n" + '{"txt": 1}\n')
    with pytest.raises(DataError, match=r"t.jsonl: record id='line 2': bad JSONL line"):
        JsonlDocuments(str(path), tok)


def test_blend_is_within_one_draw_of_the_weights_at_every_prefix():
    source, local = blend([30, 300, 70], [0.5, 0.3, 0.2])
    assert len(source) == 400
    counts = np.cumsum(np.eye(3)[source], axis=0)
    ideal = np.arange(1, 401)[:, None] * np.array([0.5, 0.3, 0.2])
    assert np.abs(counts - ideal).max() <= 1.0
    assert sorted(local[source == 0].tolist()) == sorted(list(range(30)) * 6 + list(range(20)))  # upsampled


def _sources(tmp_path):
    rng = np.random.default_rng(0)
    write_indexed(str(tmp_path / "small"), [rng.integers(0, 256, rng.integers(5, 40)) for _ in range(40)])
    with open(tmp_path / "big.jsonl", "w") as f:
        for i in range(400):
            f.write(json.dumps({"text": "x" * int(rng.integers(3, 120))}) + "\n")
    return (f"data.sources=[{{path: {tmp_path / 'small'}, weight: 0.6}}, "
            f"{{path: {tmp_path / 'big.jsonl'}, weight: 0.4}}]")


def test_blending_gives_the_requested_proportions_over_many_batches(tmp_path):
    cfg = compose_cfg(["+recipe=llama_tiny", "data=tokens", "data.max_seq_len=64", _sources(tmp_path)])
    tok, train, held_out = build_datasets(*with_specs(cfg))
    assert held_out is None and tok.image_token_id == -1
    sampler = GlobalBatchSampler(len(train), 16, seed=3)
    seen = [train[i].id.startswith("small") for _ in range(200) for i in sampler.next()]
    assert np.mean(seen) == pytest.approx(0.6, abs=0.01)
    lines = prepare_data(*with_specs(cfg))
    assert any("big.jsonl" in l and "split into pieces (data.long_docs=split)" in l for l in lines), lines


def test_a_missing_source_is_one_config_error_naming_its_entry(tmp_path):
    cfg = compose_cfg(["+recipe=llama_tiny", "data=tokens", "data.max_seq_len=64",
                       f"data.sources=[{{path: {tmp_path / 'nope'}, weight: 1}}]"])
    with pytest.raises(ConfigError, match=r"data.sources\[0\].path=.*nope.idx does not exist.*Fix"):
        build_datasets(*with_specs(cfg))


def test_truncate_keeps_one_sample_per_document_its_first_piece(tmp_path):
    with open(tmp_path / "d.jsonl", "w") as f:
        for n in (5, 70, 200):
            f.write(json.dumps({"text": "y" * n}) + "\n")
    base = ["+recipe=llama_tiny", "data=tokens", "data.max_seq_len=64",
            f"data.sources=[{{path: {tmp_path / 'd.jsonl'}, weight: 1}}]", "trainer.global_batch_size=2"]
    _, split, _ = build_datasets(*with_specs(compose_cfg(base)))
    _, cut, _ = build_datasets(*with_specs(compose_cfg(base + ["data.long_docs=truncate"])))
    assert len(split) > len(cut) == 3
    lengths = sorted(len(cut[i].input_ids) for i in range(len(cut)))
    assert lengths == [6, 64, 64]  # bos + 5 bytes (eos is the last target); the others cut
    assert any("2 documents over max_seq_len=64 truncated (data.long_docs=truncate)" in l
               for l in prepare_data(*with_specs(compose_cfg(base + ["data.long_docs=truncate"])))), "stated"


def test_code_corpus_truncate_keeps_each_file_whole_up_to_max_seq_len(tmp_path):
    for name, n in (("a.py", 10), ("b.py", 300)):
        (tmp_path / name).write_text("x" * n)
    over = ["+recipe=llama_tiny", f"data.path={tmp_path}", "data.max_seq_len=64", "data.eval_fraction=0"]
    _, split, _ = build_datasets(*with_specs(compose_cfg(over)))
    _, cut, _ = build_datasets(*with_specs(compose_cfg(over + ["data.long_docs=truncate"])))
    assert len(split) == 1 + 5 and len(cut) == 2
    assert sorted(len(cut[i].input_ids) for i in range(2)) == [12, 64]  # [bos] + 10 bytes + [eos]
    with pytest.raises(ConfigError, match="data.long_docs"):
        validate(compose_cfg(over + ["data.long_docs=reject"]), 4)


def _steps(rank, world, container, run_dir):
    from hcp.train.trainer import Trainer

    return Trainer(OmegaConf.create(container), run_dir).fit()["final_loss"]


@pytest.mark.slow
def test_a_run_trains_on_blended_megatron_and_jsonl_data(tmp_path):
    cfg = compose_cfg(["+recipe=llama_tiny", "data=tokens", "data.max_seq_len=64", "trainer.max_steps=3",
                       "trainer.global_batch_size=8", "trainer.micro_batch_tokens=256",
                       "trainer.progress_bar=false", "trainer.eval_every=0",
                       _sources(tmp_path)],
                      run_dir=str(tmp_path))
    loss, = run_ranks(_steps, 1, OmegaConf.to_container(cfg), str(tmp_path))
    assert 0 < loss < 20

