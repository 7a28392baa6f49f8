"""`packing=dynamic_cp` trains through the CLI: over 10 steps the per-step token-level losses,
and the held-out loss of the final evaluation (which keeps the static layout), equal
`packing=first_fit` on the same global batches within 1e-4, both dp-only (dp 4) and with a static
CP (cp 2 x dp 2): on 4 ranks (dp 2 x cp 2 with dp_shard; pp 2 x dp 2) and on 8 (tp 2 x pp 2 x
dp 2; dp 4 x cp 2, a pool of 8), while the micro-batches really ran on CP groups of several
sizes (the whole pool of 8 among them). The tiny LLaVA: tp 2 x dp 2 against first_fit dp 4.
Bad input is refused before ranks start, naming the field and a fix. One step at 1e-5 through
the trainer: TP, PP, dp_shard and LLaVA in tests/test_dcp_layouts.py, pools of 4 and 8 in
tests/test_dcp_runtime.py."""
import json

import pytest

from cfg_utils import compose_cfg, long_tail_corpus, long_tail_llava, train_cli
from hcp.config.errors import ConfigError
from hcp.config.validate import validate
from hcp.train.support import check_trainable
from hcp.config.specs import resolve_modules

RUN = ["+recipe=llama_tiny", "trainer.max_steps=10", "logger=none", "trainer.log_every=1",
       "trainer.eval_every=0", "trainer.eval_samples=8", "trainer.progress_bar=false",
       "trainer.global_batch_size=16", "data.max_seq_len=512", "launcher.nproc_per_node=4"]


def _run(run_dir, extra):
    """(per-step records, summary) of one CLI run."""
    records = train_cli(run_dir, [*RUN, *extra], timeout=600)
    return [r for r in records if "loss" in r], json.load(open(run_dir / "summary.json"))


def _cp_sizes(records) -> set[int]:
    """The CP sizes of the non-empty micro-batches a run logged (`micro_batches_cp{c}`)."""
    return {int(k.removeprefix("micro_batches_cp")) for r in records for k in r
            if k.startswith("micro_batches_cp")}


# name: (ranks, layout, tokens per rank). Caps that make the long samples (300-512 tokens) need
# CP > 1 and leave the short ones at CP 1; at 64 tokens a 300-token sample needs the whole pool.
DYNAMIC = {"dp2_cp2_dp_shard": (4, ["llm.layout.cp=2", "llm.layout.dp_shard=true"], 128),
           "pp2_dp2": (4, ["llm.layout.pp=2"], 256),
           "tp2_pp2_dp2": (8, ["llm.layout.tp=2", "llm.layout.pp=2"], 256),
           "dp4_cp2_pool8": (8, ["llm.layout.cp=2"], 64)}


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_dynamic_cp_trains_with_the_losses_of_first_fit(tmp_path):
    """Every dynamic-CP run against both references, `first_fit` dp-only (dp 4) and with a
    static CP (cp 2 x dp 2), on 4 ranks and the same global batches."""
    data = f"data.path={long_tail_corpus(tmp_path / 'src')}"
    refs = {"dp4": _run(tmp_path / "ff", [data, "trainer.micro_batch_tokens=512"]),
            "cp2_dp2": _run(tmp_path / "ff_cp2", [data, "llm.layout.cp=2", "trainer.micro_batch_tokens=256"])}
    runs = {name: _run(tmp_path / name, [data, "packing=dynamic_cp", f"launcher.nproc_per_node={ranks}",
                                         *layout, f"trainer.micro_batch_tokens={cap}"])
            for name, (ranks, layout, cap) in DYNAMIC.items()}
    losses = [r["loss"] for r in refs["dp4"][0]]
    assert len(losses) == 10 and losses[-1] < losses[0]
    pairs = {f"{name} against first_fit {ref}": (runs[name], refs[ref]) for ref in refs for name in runs}
    pairs["first_fit cp2_dp2 against dp4"] = (refs["cp2_dp2"], refs["dp4"])
    for what, ((run, summary), (ref, ref_sum)) in pairs.items():
        assert [r["loss"] for r in run] == pytest.approx([r["loss"] for r in ref], rel=1e-4, abs=1e-4), what
        assert [r["loss_tokens"] for r in run] == [r["loss_tokens"] for r in ref], what
        assert summary["eval/loss"] == pytest.approx(ref_sum["eval/loss"], rel=1e-4), what
        assert summary["eval/samples"] == ref_sum["eval/samples"] > 0, what
    assert not any(_cp_sizes(ref) for ref, _ in refs.values())
    for name, (run, _) in runs.items():
        assert 1 in _cp_sizes(run) and len(_cp_sizes(run)) > 1, (name, _cp_sizes(run))  # several CP sizes ran
    pool8 = _cp_sizes(runs["dp4_cp2_pool8"][0])
    assert 8 in pool8 and len(pool8) >= 3, pool8  # the whole pool of 8 as one group, and smaller ones


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dynamic_cp_trains_the_tiny_llava_with_the_losses_of_first_fit(tmp_path):
    """The encoder side at its own layout (tp 1, dp 4) feeds the LLM (tp 2 x dp 2) whose image
    rows go to the CP rank that holds their positions in each dynamic group; references:
    first_fit dp-only (dp 4) and with a static CP (cp 2 x dp 2)."""
    (tmp_path / "data").mkdir()
    llava = ["data=llava_json", "data.system_prompt=''", "data.max_seq_len=256", "vision.layout.tp=1",
             *long_tail_llava(tmp_path / "data")]
    run = [x for x in RUN if not x.startswith(("+recipe", "data."))]

    def steps(name, extra):
        return [r for r in train_cli(tmp_path / name, [*run, *llava, *extra], timeout=600) if "loss" in r]

    refs = {"dp4": steps("ff", ["trainer.micro_batch_tokens=512"]),
            "cp2_dp2": steps("ff_cp2", ["llm.layout.cp=2", "trainer.micro_batch_tokens=128"])}
    dyn = steps("dyn", ["packing=dynamic_cp", "llm.layout.tp=2", "trainer.micro_batch_tokens=128"])
    losses = [r["loss"] for r in refs["dp4"]]
    assert len(losses) == 10 and losses[-1] < losses[0]
    pairs = {"dynamic_cp against dp4": (dyn, refs["dp4"]),
             "dynamic_cp against cp2_dp2": (dyn, refs["cp2_dp2"]),
             "first_fit cp2_dp2 against dp4": (refs["cp2_dp2"], refs["dp4"])}
    for what, (got, ref) in pairs.items():
        assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-4, abs=1e-4), what
        assert [r["loss_tokens"] for r in got] == [r["loss_tokens"] for r in ref], what
    assert _cp_sizes(dyn) == {1, 2}, _cp_sizes(dyn)


@pytest.mark.parametrize("overrides, world, field, words", [
    # pool dp*cp = 6: dp (inferred from 6 ranks) is the cause, cp=1 is a power of two
    (["trainer.global_batch_size=12"], 6, "llm.layout.dp", "run the LLM on 4 or 8 ranks"),
    (["trainer.global_batch_size=12", "llm.layout.dp=6"], 6, "llm.layout.dp", "factor 3"),
    (["llm.layout.cp=3", "trainer.micro_batch_tokens=384"], 6, "llm.layout.cp", "llm.layout.cp=2 or 4"),
    # the pool's rule comes before the token rule (1024 is no multiple of 2*cp = 6)
    (["llm.layout.cp=3"], 6, "llm.layout.cp", "llm.layout.cp=2 or 4"),
    # 4 ranks x 1023 tokens hold 4092, but head-tail padding (2c chunks) leaves 4088
    (["data.max_seq_len=4090", "trainer.micro_batch_tokens=1023"], 4, "trainer.micro_batch_tokens",
     "at most 4088 tokens"),
    (["packing_profile=nowhere.yaml"], 4, "packing_profile", "h100"),
    # the tiny LLaVA's encoder side keeps static lanes: 10 samples do not split over its dp 4
    (["data=llava_json", "trainer.global_batch_size=10"], 4, "trainer.global_batch_size", "vision's dp=4"),
])
def test_dynamic_cp_training_refuses_bad_input_before_ranks_start(overrides, world, field, words):
    recipe = [] if "data=llava_json" in overrides else ["+recipe=llama_tiny"]
    cfg = compose_cfg([*recipe, "packing=dynamic_cp", f"launcher.nproc_per_node={world}", *overrides])
    with pytest.raises(ConfigError) as e:
        check_trainable(cfg, resolve_modules(cfg, validate(cfg, world_size=world)))
    assert e.value.field == field and "Fix:" in str(e.value) and words in str(e.value), str(e.value)


@pytest.mark.parametrize("overrides, world", [
    (["+recipe=llama_tiny", "llm.layout.cp=2"], 4),
    (["+recipe=llama_tiny", "llm.layout.tp=2", "llm.layout.pp=2", "llm.layout.dp_shard=true"], 8),
    (["llm.layout.tp=2"], 4),                                    # the tiny LLaVA: an encoder side
    (["+recipe=llama_tiny", "trainer.global_batch_size=2", "llm.layout.cp=4"], 4),  # 2 samples, 4 ranks
    # no static LLM lanes: 10 samples on dp 4 (trains: tests/test_dcp_layouts.py dp4_10_samples)
    (["+recipe=llama_tiny", "trainer.global_batch_size=10"], 4),
])
def test_dynamic_cp_training_accepts_tp_pp_dp_shard_and_llava(overrides, world):
    cfg = compose_cfg(["packing=dynamic_cp", f"launcher.nproc_per_node={world}", *overrides])
    check_trainable(cfg, resolve_modules(cfg, validate(cfg, world_size=world)))
