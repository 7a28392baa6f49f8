"""Peak memory of a checkpoint save and of a resume next to a training step's, for one rank of a
full-size recipe, without a GPU: the rank is built and stepped as the rehearsal does it
(`hcp.preflight.rehearse.runner`: torch's fake process group and `FakeTensorMode`, tracked by
torch's `MemTracker`), then `hcp.train.checkpoint.save` and `load` run on its fake state with the
file I/O of torch DCP left out (`dcp.save` / `dcp.load` take the state dict and return: no
values to write or read). What the tracker sees is what the device holds: the state dict the
save builds (a gathered copy, or the training shards themselves) and what a resume allocates
to load it. DCP's own writing copies one tensor at a time to the host and is not counted.
`scripts/checkpoint_memory.py` prints the figures for a recipe.
"""
from __future__ import annotations

import contextlib
import json
import os


@contextlib.contextmanager
def _without_file_io():
    """`dcp.save` / `dcp.load` / `dcp.async_save` as no-ops that hold the state dict while they
    run, and `all_gather_object` answering with this rank's object (the fake process group
    returns its output untouched)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    saved = dcp.save, dcp.load, dcp.async_save, dist.all_gather_object

    def gather(out, obj, group=None):
        out[:] = [obj] * len(out)

    dcp.save = dcp.load = lambda state_dict, **kwargs: None
    dcp.async_save = dcp.save
    dist.all_gather_object = gather
    try:
        yield
    finally:
        dcp.save, dcp.load, dcp.async_save, dist.all_gather_object = saved


def checkpoint_peaks(cfg, run_dir: str, rank: int, world: int) -> dict[str, int]:
    """Rank `rank` of `world` (config `cfg`, as `rehearsal_config` makes it) built under fake
    tensors: peak bytes tracked during one training step (its optimizer state allocated first,
    as every step after the first holds it), then during `checkpoint.save` of that state, then
    during `checkpoint.load` of it into the model and optimizer (a resume). Returns {"train",
    "save", "resume": bytes, "held": the bytes held between steps (weights, Adam's moments)}. Leaves
    the process group destroyed.

    Raises whatever the rank's set-up, step, save or load raises."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hcp.preflight.rehearse.runner import (_allocate_optimizer_state, _as_on_the_device,
                                               _host_metadata, _no_values, _peak_tracker)
    from hcp.train import checkpoint
    from hcp.train.trainer import Trainer

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    trainer, peaks = None, {}
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), _host_metadata(), _no_values():
            trainer = Trainer(cfg, run_dir)
            _as_on_the_device(trainer.optimizer)
            _allocate_optimizer_state(trainer.optimizer)
            tracker = _peak_tracker()
            tracker.track_external(trainer.modules, trainer.optimizer)
            root = os.path.join(run_dir, "checkpoint_memory")
            with tracker, _without_file_io():
                trainer.train_step()
                peaks["train"] = tracker.step_peak()["Total"]
                peaks["held"] = sum(snap[_TOTAL_KEY]
                                    for snap in tracker.get_tracker_snapshot().values())
                path = checkpoint.save(root, 1, trainer.modules, trainer.optimizer, {"step": 1}, 0,
                                       trainer._tp_groups())
                peaks["save"] = tracker.step_peak()["Total"]
                with open(os.path.join(path, "trainer.json"), "w") as f:
                    json.dump({"step": 1}, f)  # the layout unnamed: per-rank RNG derived, not read
                checkpoint.load(path, trainer.modules, trainer.optimizer, trainer._tp_groups())
                peaks["resume"] = tracker.step_peak()["Total"]
    finally:
        if trainer is not None:
            trainer.ahead.close()
        dist.destroy_process_group()
        torch.set_grad_enabled(True)
    return peaks
