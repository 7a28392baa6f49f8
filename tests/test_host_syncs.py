"""Nothing stalls the GPU every micro-batch (issue 22, section 4): the pipeline times its
compute with CUDA events read once per run, never `torch.cuda.synchronize` around each pass;
a rank's training step reads the device back to the host a fixed number of times per step,
whatever its number of layers and micro-batches (`host_reads.HostReads` counts the reads)."""
import pytest
import torch
from omegaconf import OmegaConf

from cfg_utils import compose_container
from dist_utils import run_ranks
from hcp.comm.p2p import StageLink
from hcp.schedule.pipeline import one_f_one_b
from host_reads import HostReads


class _FakeEvent:
    """Stands in for `torch.cuda.Event` on CPU: counts host waits; every span lasts 2 ms."""

    waits = 0

    def __init__(self, enable_timing=False):
        assert enable_timing

    def record(self):
        pass

    def synchronize(self):
        _FakeEvent.waits += 1

    def elapsed_time(self, end):
        return 2.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_micro", [2, 6])
def test_pipeline_times_with_events_read_once_per_run(num_micro, monkeypatch):
    syncs = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(a))
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(_FakeEvent, "waits", 0)
    w = torch.ones(3, requires_grad=True)
    link = StageLink([0], 0, torch.device("cuda"))  # one stage: no exchange, so no CUDA tensor
    batches = [torch.full((3,), float(i)) for i in range(num_micro)]
    times = one_f_one_b(lambda i, x: (w * batches[i]).sum(), link, num_micro, lambda i: ((), torch.float32))
    assert syncs == [], f"{len(syncs)} device-wide synchronizations for {num_micro} micro-batches"
    assert _FakeEvent.waits == 1, "the host waits for the device once per run"
    assert times.busy_s == pytest.approx(2 * num_micro * 2e-3)  # every forward and backward timed
    assert w.grad.tolist() == [float(sum(range(num_micro)))] * 3


STEP = ["trainer.micro_batch_tokens=160", "trainer.progress_bar=false", "trainer.eval_every=0",
        "logger=none", "trainer.max_steps=3"]
# layouts of the LLM (the encoder side follows its TP, data parallel over the rest) at 2 ranks.
# Add a CP layout here ("cp2": ["llm.layout.cp=2"]) once CP takes its lengths from the plan.
LAYOUTS = {
    "tp2": ["llm.layout.tp=2"],
    "pp2": ["llm.layout.pp=2", "vision.layout.tp=1"],
    "dp2": ["llm.layout.dp=2"],
    "dp2_fsdp": ["llm.layout.dp=2", "llm.layout.dp_shard=true", "vision.layout.dp_shard=true"],
    "cp2": ["llm.layout.cp=2"],
}
SMALL = ["llm.num_layers=2", "trainer.global_batch_size=8"]
LARGE = ["llm.num_layers=4", "trainer.global_batch_size=16"]  # twice the layers and micro-batches


def _counted_step(rank, world, container, run_dir):
    """Reads of this rank's second training step (the first one warms up); the step plan and
    data of the next step are prepared on the plan-ahead thread, which is not counted."""
    from hcp.train.trainer import Trainer

    tr = Trainer(OmegaConf.create(container), run_dir)
    tr.train_step()
    with HostReads() as reads:
        metrics = tr.train_step()
    tr.ahead.close()
    layers = sum(1 for _ in tr.model.llm.layers)
    return reads.count, dict(reads.sites), metrics["micro_batches"], layers


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_step_reads_do_not_grow_with_layers_or_micro_batches(layout, tmp_path):
    runs = {}
    for size, extra in (("small", SMALL), ("large", LARGE)):
        run = tmp_path / size
        runs[size] = run_ranks(_counted_step, 2, compose_container([*STEP, *LAYOUTS[layout], *extra], run),
                               str(run), timeout=280)
    for rank, (small, large) in enumerate(zip(runs["small"], runs["large"])):
        assert large[2] > small[2] and large[3] == 2 * small[3], "the large step is not larger"
        assert large[0] == small[0], (
            f"rank {rank}: {small[0]} reads with {small[3]} layers x {small[2]} micro-batches, "
            f"{large[0]} with {large[3]} x {large[2]}: {large[1]}")


def _fit_vs_train(rank, world, container, run_dir):
    """(reads, world collectives) of a warm `train_step` and of a warm `fit_step`."""
    import torch.distributed as dist

    from hcp.train.trainer import Trainer

    tr = Trainer(OmegaConf.create(container), run_dir)
    calls = []
    for name in ("all_reduce", "all_gather", "broadcast", "barrier"):
        real = getattr(dist, name)
        setattr(dist, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
    out = []
    for step in (tr.train_step, tr.fit_step, tr.train_step, tr.fit_step):
        calls.clear()
        with HostReads() as reads:
            step()
        out.append((reads.count, sorted(calls)))
    tr.ahead.close()
    return out[2:]


@pytest.mark.timeout(120)
def test_fit_step_adds_no_collective_or_read_to_the_training_step(tmp_path):
    """The preemption flag rides in the step's metrics collective: `fit_step` (with logging and
    the preemption check, no evaluation or checkpoint) reads and communicates exactly what
    `train_step` does. One rank, a few seconds."""
    (train, fit), = run_ranks(_fit_vs_train, 1, compose_container([*STEP, *SMALL, "trainer.max_steps=10"], tmp_path), str(tmp_path),
                              timeout=110)
    assert fit == train
