"""`packing=dynamic_cp` under TP, PP, dp_shard and the tiny LLaVA, through the trainer on forked
gloo ranks: one step's loss, global counts and every gradient (made whole over TP and FSDP,
merged over PP stages) equal `packing=first_fit` on one rank (dp-only) for the same global
batch, rtol 1e-5 / atol 1e-6, while the step really ran micro-batches on CP groups of more than
one size (asserted from the plan's histogram, so the test cannot hold by construction)."""
import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from cfg_utils import compose_container, long_tail_corpus, long_tail_llava
from dist_utils import run_ranks
from parity_utils import assert_all_close, merged, whole
from hcp.dcp.packing import Group, Packing, Round

TOL = dict(rtol=1e-5, atol=1e-6)
COMMON = ["trainer.progress_bar=false", "trainer.eval_every=0",
          "logger=none", "trainer.check_plan=true"]
TEXT = ["+recipe=llama_tiny", "data.max_seq_len=512"]
LLAVA = ["data=llava_json", "data.max_seq_len=256", "data.system_prompt=''"]  # + long_tail_llava

# name: (model, dynamic-CP layout on 4 ranks, tokens per rank, global batch). The cap makes the
# long samples (300-500 text tokens; 150-250 merged LLaVA tokens) need CP > 1, the short ones not.
# dp4 (no TP/PP/FSDP, text and LLaVA) runs in tests/test_dcp_runtime.py and the CLI tests.
CASES = {
    "pp2_dp2": ("text", ["llm.layout.pp=2"], 256, 16),
    "cp2_dp2_dp_shard": ("text", ["llm.layout.cp=2", "llm.layout.dp_shard=true"], 128, 16),
    "llava_tp2_dp2": ("llava", ["llm.layout.tp=2", "vision.layout.tp=1"], 128, 16),
    # 2 samples on a pool of 4 under FSDP: ranks without a sample run empty micro-batches
    "cp4_dp_shard_2_samples": ("text", ["llm.layout.cp=4", "llm.layout.dp_shard=true"], 512, 2),
    # 10 samples on dp 4: no static LLM lanes under dynamic CP, so the batch need not divide by dp
    "dp4_10_samples": ("text", [], 256, 10),
}


def _step(rank, world, container, run_dir, policy=None):
    from hcp.plan.step import register_policy
    from hcp.train.trainer import Trainer

    tr = Trainer(OmegaConf.create(container), run_dir)
    if policy is not None:  # a given plan instead of the solver's
        register_policy("dynamic_cp", policy)
    indices = tr.sampler.batch(0)
    new_group = dist.new_group

    def refuse(*args, **kwargs):
        raise AssertionError("a process group was created during the step")

    dist.new_group = refuse   # every micro-batch's CP group must be a pre-built one
    try:
        prepared = tr.prepare(indices)
        tr._check_plan(prepared[0].checksum)
        loss, counts, _ = tr.forward_backward(indices, prepared)
    finally:
        dist.new_group = new_group
    groups = tr._tp_groups() or {}   # each module's TP group (by the FQN's first name)
    grads = {n: whole(p.grad, p, groups.get(n.split(".")[0])) for n, p in tr.modules.named_parameters()
             if p.grad is not None}
    return dict(loss=float(loss), counts=counts, grads=grads, histogram=prepared[4],
                cp_sizes=sorted({mb.cp_size for mb in prepared[0].micro_batches if not mb.empty}),
                run=[mb.cp_size for mb in prepared[0].micro_batches if not mb.empty])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return str(long_tail_corpus(tmp_path_factory.mktemp("src")))


@pytest.fixture(scope="module")
def llava_data(tmp_path_factory):
    return long_tail_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def models(corpus, llava_data):
    return {"text": [*TEXT, f"data.path={corpus}"], "llava": [*LLAVA, *llava_data]}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The comparisons in this process on one thread: a fork after torch ran a multi-threaded
    op in the parent can leave the child's first parallel op waiting forever."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, models):
    """first_fit on one rank (dp-only, every sample whole) of (model, global batch), every one
    computed before any test compares."""
    out = {}
    for model, batch in sorted({(m, b) for m, _, _, b in CASES.values()}):
        run = tmp_path_factory.mktemp(f"ref_{model}")
        container = compose_container([*models[model], *COMMON, "trainer.micro_batch_tokens=512",
                                f"trainer.global_batch_size={batch}"], run)
        out[model, batch] = run_ranks(_step, 1, container, str(run))[0]
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", CASES)
def test_dynamic_cp_step_equals_first_fit_on_one_rank(name, reference, models, tmp_path):
    model, layout, cap, batch = CASES[name]
    ref = reference[model, batch]
    container = compose_container([*models[model], *COMMON, *layout, "packing=dynamic_cp",
                            f"trainer.micro_batch_tokens={cap}", f"trainer.global_batch_size={batch}"],
                           tmp_path)
    results = run_ranks(_step, 4, container, str(tmp_path), timeout=280)
    sizes = {c for r in results for c in r["cp_sizes"]}
    hist = results[0]["histogram"]
    assert {int(k.removeprefix("micro_batches_cp")) for k in hist} == sizes
    if batch < 4:   # fewer samples than pool ranks: some ranks ran only empty micro-batches
        assert any(not r["cp_sizes"] for r in results), hist
    else:
        assert len(sizes) > 1 and max(sizes) > 1, sizes   # several CP sizes really ran
    grads = {}
    for r in results:  # stages hold different names; TP/DP replicas hold equal whole tensors
        assert r["histogram"] == hist
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert r["counts"] == ref["counts"]
        grads.update(r["grads"])
    assert set(grads) == set(ref["grads"])
    for key, g in ref["grads"].items():
        torch.testing.assert_close(grads[key], g, **TOL, msg=lambda m, key=key: f"grad {key}: {m}")


def _pool_then_rank_0(tokens, llm, micro_batch_tokens):
    """A plan whose ranks run different micro-batch counts: every sample longer than the cap
    alone on the whole pool, then every other one alone on pool position 0 (the rest idle)."""
    pool = llm.dp * llm.cp
    long = [i for i, n in enumerate(tokens) if n > micro_batch_tokens]
    short = [i for i, n in enumerate(tokens) if n <= micro_batch_tokens]
    return Packing([Round([Group([i], pool, 0)]) for i in long] +
                [Round([Group([i], 1, 0), *(Group([], 1, p) for p in range(1, pool))]) for i in short])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_that_ends_on_the_whole_pool_syncs_gradients_after_the_others(reference, models, tmp_path):
    """At pp = 1 without FSDP the ranks of a pool run different micro-batch counts. Ranks 1-3
    end on a micro-batch of the whole pool, whose CP group has the ranks (so the communicator)
    of the gradient all-reduce, while rank 0 goes on: a bucket launched inside their last
    backward would cross the pool group's CP collectives on rank 0 (gloo failed: a collective
    mismatch at step 4 of a pool of 8 in tests/test_dcp_train.py)."""
    container = compose_container([*models["text"], *COMMON, "packing=dynamic_cp", "trainer.micro_batch_tokens=256",
                            "trainer.global_batch_size=16"], tmp_path)
    results = run_ranks(_step, 4, container, str(tmp_path), _pool_then_rank_0, timeout=280)
    ref = reference["text", 16]
    assert results[1]["run"][-1] == 4 and len(results[0]["run"]) > len(results[1]["run"]) > 0
    for r in results:
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert r["counts"] == ref["counts"]
    assert_all_close(merged(results, "grads"), ref["grads"], "grad", **TOL)
