"""Nothing stalls the GPU every micro-batch (issue 22, section 4): the pipeline times its
compute with CUDA events read once per run, never `torch.cuda.synchronize` around each pass."""
import pytest
import torch

from hcp.comm.p2p import StageLink
from hcp.schedule.pipeline import one_f_one_b


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
    times = one_f_one_b(lambda batch, x: (w * batch).sum(), link, 0, 1,
                        [torch.full((3,), float(i)) for i in range(num_micro)], [None] * num_micro,
                        lambda meta: ((), torch.float32))
    assert syncs == [], f"{len(syncs)} device-wide synchronizations for {num_micro} micro-batches"
    assert _FakeEvent.waits == 1, "the host waits for the device once per run"
    assert times.busy_s == pytest.approx(2 * num_micro * 2e-3)  # every forward and backward timed
    assert w.grad.tolist() == [float(sum(range(num_micro)))] * 3
