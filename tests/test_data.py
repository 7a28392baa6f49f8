"""LLaVA reader, digits_vqa, THD packing and deterministic global batches."""
import json
import os

import pytest
import torch
from PIL import Image

from hcp.data.digits import WORDS, build_digits_vqa
from hcp.data.llava import IGNORE_INDEX, DataError, LlavaDataset
from hcp.data.loader import GlobalBatchSampler, lane_slice
from hcp.data.packing import collate, first_fit
from hcp.data.tokenizer import ByteTokenizer
from cfg_utils import with_specs

TOK = ByteTokenizer()


def _write(tmp_path, records, images=("a.png", "b.png")):
    for name in images:
        Image.new("L", (4, 4), color=200).save(tmp_path / name)
    (tmp_path / "bad.png").write_bytes(b"not a png")
    path = tmp_path / "data.json"
    path.write_text(json.dumps(records))
    return str(path)


def _ds(path, tmp_path, tokenizer=TOK, **kw):
    args = dict(num_image_tokens=4, image_size=8, num_channels=1, max_seq_len=200)
    args.update(kw)
    return LlavaDataset(path, str(tmp_path), tokenizer, **args)


def rec(rid, image="a.png", human="<image>\nWhat is it?", gpt="seven", **extra):
    r = {"id": rid, "conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}]}
    if image is not None:
        r["image"] = image
    r.update(extra)
    return r


def test_labels_are_shifted_once_and_only_on_assistant_tokens(tmp_path):
    s = _ds(_write(tmp_path, [rec("r1")]), tmp_path)[0]
    ids, labels = s.input_ids, s.labels
    assert ids.count(TOK.image_token_id) == 4
    target_positions = [t for t, l in enumerate(labels) if l != IGNORE_INDEX]
    # labels[t] is the next token, and only the answer " seven" + EOS are targets
    assert all(labels[t] == ids[t + 1] for t in target_positions)
    assert TOK.decode([ids[t + 1] for t in target_positions]) == " seven"
    assert ids[target_positions[-1] + 1] == TOK.eos_id and labels[-1] == IGNORE_INDEX
    assert target_positions[0] == s.prompt_len - 1 and s.answer == "seven"


def test_images_per_sample_vary_and_no_image_is_valid(tmp_path):
    recs = [rec("two", image=["a.png", "b.png"], human="<image> and <image>?"), rec("none", image=None,
                                                                               human="Hi?")]
    ds = _ds(_write(tmp_path, recs), tmp_path)
    assert ds[0].input_ids.count(TOK.image_token_id) == 8 and ds.pixel_values(ds[0]).shape == (2, 1, 8, 8)
    assert TOK.image_token_id not in ds[1].input_ids and ds.pixel_values(ds[1]).shape[0] == 0


@pytest.mark.parametrize("record, kind", [
    (rec("m", image="missing.png"), "missing image"),
    (rec("u", image="bad.png"), "unreadable image"),
    ({"id": "x", "conversations": "nope"}, "malformed record"),
    ({"id": "y", "conversations": [{"from": "human", "value": "hi"}]}, "no assistant turn"),
    (rec("c", image=["a.png", "b.png"]), "image count mismatch"),
    (rec("l", gpt="x" * 500), "sample too long"),
])
def test_bad_record_error_names_file_id_and_kind(tmp_path, record, kind):
    path = _write(tmp_path, [rec("ok"), record])
    with pytest.raises(DataError) as e:
        _ds(path, tmp_path)
    msg = str(e.value)
    assert path in msg and repr(record["id"]) in msg and kind in msg and "on_error=skip" in msg


def test_on_error_skip_counts_kinds_and_ids(tmp_path):
    recs = [rec("ok"), rec("m", image="missing.png"), rec("m2", image="missing.png"),
            rec("c", image=["a.png", "b.png"])]
    ds = _ds(_write(tmp_path, recs), tmp_path, on_error="skip")
    assert len(ds) == 1 and ds[0].id == "ok"
    assert ds.skipped.counts == {"missing image": 2, "image count mismatch": 1}
    assert ds.skipped.ids["missing image"] == ["m", "m2"]


def test_digits_vqa_is_real_data_read_through_the_llava_reader(tmp_path):
    root = build_digits_vqa(str(tmp_path))
    train = LlavaDataset(os.path.join(root, "train.json"), root, TOK, 16, 8, 1, 128)
    held = LlavaDataset(os.path.join(root, "eval.json"), root, TOK, 16, 8, 1, 128)
    assert len(train) + len(held) == 1797 and len(held) == 270
    assert not {s.id for s in train.samples} & {s.id for s in held.samples}
    assert {s.answer for s in held.samples} == set(WORDS)
    px = train.pixel_values(train[0])
    assert px.shape == (1, 1, 8, 8) and px.min() >= -1 and px.max() <= 1 and px.std() > 0.3
    assert build_digits_vqa(str(tmp_path)) == root  # second call reuses the files


def test_first_fit_packs_in_arrival_order_and_rejects_overlong():
    assert first_fit([5, 4, 3, 2, 6], 8) == [[0, 2], [1, 3], [4]]
    with pytest.raises(ValueError, match="sample 1 has 9 tokens"):
        first_fit([1, 9], 8)


def test_collate_builds_thd_with_cu_seqlens_and_restarting_positions(tmp_path):
    ds = _ds(_write(tmp_path, [rec("a"), rec("b", image=None, human="Hi?", gpt="yes")]), tmp_path)
    b = collate(ds.samples, [ds.pixel_values(s) for s in ds.samples], TOK.image_token_id)
    n0, n1 = len(ds[0].input_ids), len(ds[1].input_ids)
    assert b.cu_seqlens.tolist() == [0, n0, n0 + n1] and b.cu_seqlens.dtype == torch.int32
    assert b.max_seqlen == max(n0, n1) and b.position_ids[n0] == 0 and b.position_ids[n0 - 1] == n0 - 1
    assert int(b.image_mask.sum()) == 4 and b.pixel_values.shape == (1, 1, 8, 8)


def test_global_batches_are_deterministic_and_lanes_contiguous():
    a, b = GlobalBatchSampler(100, 8, seed=3), GlobalBatchSampler(100, 8, seed=3)
    assert [a.next() for _ in range(30)] == [b.batch(k) for k in range(30)]
    first_epoch = sum((b.batch(k) for k in range(12)), [])
    assert len(set(first_epoch)) == 96
    assert lane_slice(list(range(8)), 4, 2) == [4, 5]
    with pytest.raises(ValueError, match="not divisible"):
        lane_slice(list(range(8)), 3, 0)


def test_a_local_hugging_face_tokenizer_json_replaces_bytes(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from hcp.data.tokenizer import build_tokenizer

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["USER: What digit is in the image? ASSISTANT: seven"] * 20,
                            trainers.BpeTrainer(special_tokens=["<unk>", "<s>", "</s>"], vocab_size=60))
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = build_tokenizer(str(tmp_path / "tokenizer.json"))
    assert (hf.pad_id, hf.bos_id, hf.eos_id) == (0, 1, 2)
    assert hf.image_token_id == hf.vocab_size - 1 >= 3
    ids = hf.encode("What digit")
    assert ids and hf.decode(ids).replace(" ", "") == "Whatdigit"
    s = _ds(_write(tmp_path, [rec("r")]), tmp_path, tokenizer=hf)[0]
    assert s.input_ids.count(hf.image_token_id) == 4 and s.input_ids[0] == hf.bos_id


def test_missing_tokenizer_file_is_named():
    from hcp.config.errors import ConfigError
    from hcp.data.tokenizer import build_tokenizer

    with pytest.raises(ConfigError, match=r"data.tokenizer=./nope/tokenizer.json.*or data.tokenizer=byte"):
        build_tokenizer("/nope/tokenizer.json")


def test_an_unreadable_file_is_named_without_the_per_record_hint(tmp_path):
    (tmp_path / "broken.json").write_text("[{")
    with pytest.raises(DataError) as e:
        _ds(str(tmp_path / "broken.json"), tmp_path, on_error="skip")
    assert "broken.json: unreadable file" in str(e.value) and "on_error" not in str(e.value)


def test_a_jsonl_file_reads_as_the_same_records_as_its_json_list(tmp_path):
    """LLaVA-style data often ships as JSON Lines: read either; a bad line is named."""
    records = [rec(1), rec(2, image="b.png", gpt="three")]
    as_json = _ds(_write(tmp_path, records), tmp_path)
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    as_jsonl = _ds(str(tmp_path / "data.jsonl"), tmp_path)
    assert len(as_jsonl) == len(as_json) == 2
    assert [as_jsonl[i].input_ids for i in range(2)] == [as_json[i].input_ids for i in range(2)]
    (tmp_path / "bad.jsonl").write_text(json.dumps(records[0]) + "\n{oops\n")
    with pytest.raises(DataError, match=r"bad.jsonl: unreadable file: line 2 is not one JSON "
                                        r"record"):
        _ds(str(tmp_path / "bad.jsonl"), tmp_path)


def test_changing_eval_fraction_rebuilds_the_digits_split(tmp_path):
    default = build_digits_vqa(str(tmp_path), 0.15)
    other = build_digits_vqa(str(tmp_path), 0.25)
    assert other != default
    with open(os.path.join(other, "eval.json")) as f:
        assert len(json.load(f)) == round(1797 * 0.25)


def test_a_conversation_opening_with_gpt_drops_that_turn_and_counts_it(tmp_path):
    opening = {"id": "g", "image": "a.png", "conversations": [
        {"from": "gpt", "value": "Hello!"}, {"from": "human", "value": "<image>\nWhat is it?"},
        {"from": "gpt", "value": "seven"}]}
    ds = _ds(_write(tmp_path, [rec("ok"), opening]), tmp_path)
    assert ds.leading_turns_dropped == 1
    plain = _ds(_write(tmp_path, [rec("ok"), rec("g")]), tmp_path)
    assert ds[1].answer == "seven" and ds[1].input_ids == plain[1].input_ids
    assert ds[1].labels == plain[1].labels  # "Hello!" is neither prompt nor target


def test_leading_gpt_turns_are_reported_before_ranks_start(tmp_path):
    from cfg_utils import compose_cfg
    from hcp.data.build import prepare_data

    opening = {"id": "g", "image": "a.png", "conversations": [
        {"from": "gpt", "value": "Hi"}, {"from": "human", "value": "<image>\nq"}, {"from": "gpt", "value": "a"}]}
    path = _write(tmp_path, [rec(str(i)) for i in range(4)] + [opening])
    lines = prepare_data(*with_specs(compose_cfg(["data=llava_json", f"data.path={path}", "trainer.global_batch_size=4"])))
    assert any("dropped the leading `gpt` turn of 1 train records" in line and path in line for line in lines)


def test_an_empty_file_says_so_and_names_it(tmp_path):
    path = _write(tmp_path, [])
    with pytest.raises(DataError, match=f"{path}: empty file"):
        _ds(path, tmp_path)
    path = _write(tmp_path, [rec("m", image="missing.png")])
    with pytest.raises(DataError, match=f"{path}: no usable records: all 1 records were skipped"):
        _ds(path, tmp_path, on_error="skip")
