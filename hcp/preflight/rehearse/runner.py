"""Run each rank of the job's world through the real trainer on a recording process group.

Each rank runs in its own forked process (`rehearse.jobs` at a time): torch's fake process
group (`FakeStore`, backend `"fake"`: every collective returns at once, its output untouched)
at rank r of the full world W, the `Trainer` built exactly as training builds it, then
`rehearse.steps` `train_step()`s under the `Recorder` (every c10d op and group creation),
torch's `MemTracker` (peak bytes of the steps, parameters and the optimizer's state included,
allocated before the first step as a steady-state step holds it) and `FlopCounterMode` (the
last step, per micro-batch: `hcp.preflight.rehearse.count`). Everything runs under torch's
`FakeTensorMode`: every tensor has its shape, dtype and device but no storage, so a 70B recipe's
rank costs what its number of ops costs, not its FLOPs or bytes. The step plan and the rank's data
are real host values (the plan-ahead thread runs outside the fake mode); what the device computes
has no value, so nothing reads it: the loss and gradient norm are not known and the update always
runs.
"""
from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import traceback
from dataclasses import dataclass, field

from omegaconf import OmegaConf

REHEARSAL_OVERRIDES = {"logger.name": "none", "trainer.eval_every": 0,
                       "trainer.progress_bar": False, "resume": None}
"""What a rehearsal changes in the config: no logger, no evaluation, no resume."""


@dataclass
class RankResult:
    """One rank's rehearsal: its ops (`hcp.preflight.rehearse.record.Op`, issue order), group
    creations, its trained parameters' bytes, peak bytes tracked by `MemTracker` (the largest of
    each step's, `step_peaks`), FLOPs counted in the last step, the plan's global (tokens, sum of
    squared document lengths) of each step, its device events (`rehearse.device=cuda`:
    `hcp.preflight.rehearse.device.DeviceEvents.counts`), its LLM micro-batches' worth of tokens (in
    `trainer.micro_batch_tokens` of its CP size each, `step_worth`: what plan mode's estimate of
    the step takes), the last step's LLM micro-batches as `(FLOPs counted, document lengths, CP
    size, CP rank, loss tokens known on the host or None)` (`hcp.preflight.rehearse.count`), the
    bytes of each `MemTracker` category (parameters, gradients, optimizer states, activations,
    temporaries) at the peak, the name of every group created (rank set -> name), the representative
    it was derived from (`hcp.preflight.rehearse.classes.derive`; None: rehearsed) and the traceback
    if the rank raised (then the rest may be partial)."""

    rank: int
    ops: list = field(default_factory=list)
    creations: list = field(default_factory=list)
    peak_bytes: int = 0
    flops: int = 0
    param_bytes: int = 0
    step_counts: list = field(default_factory=list)
    step_peaks: list = field(default_factory=list)
    step_worth: list = field(default_factory=list)
    peak_categories: dict = field(default_factory=dict)
    micro_batches: list = field(default_factory=list)
    device_events: dict = field(default_factory=dict)
    group_names: dict = field(default_factory=dict)
    derived_from: int | None = None
    error: str | None = None


def rehearsal_config(cfg):
    """`cfg` with `REHEARSAL_OVERRIDES` applied (a copy); on fake CUDA (`rehearse.device=cuda`)
    the step plan is computed on the rank's thread, not in a worker process (its CUDA default)."""
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    cuda = {"trainer.plan_process": False} if cfg.rehearse.get("device") == "cuda" else {}
    for key, value in {**REHEARSAL_OVERRIDES, **cuda}.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def rehearse_rank(cfg, run_dir: str, rank: int, world: int, steps: int) -> RankResult:
    """Rank `rank` of `world` on the fake process group, in this process: set-up and `steps`
    training steps, recorded. Leaves the process group destroyed."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from hcp.preflight.rehearse.count import flop_counter, per_micro_batch
    from hcp.preflight.rehearse.device import DeviceEvents
    from hcp.preflight.rehearse.record import Recorder
    from hcp.train.trainer import Trainer

    result, rec = RankResult(rank), Recorder()
    rec.install()
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    trainer = None
    fake = FakeTensorMode(allow_non_fake_inputs=True)  # the host data it meets become fake
    events = DeviceEvents()  # entered on fake CUDA only (`_on_device`)
    try:
        with fake, _host_metadata(), _no_values(), _on_device(cfg, events, fake):
            with rec:
                trainer = Trainer(cfg, run_dir)
            result.param_bytes = sum(_local(p).numel() * p.element_size()
                                     for p in trainer.modules.parameters() if p.requires_grad)
            fb, planned, metas = trainer.forward_backward, [], []

            def forward_backward(global_batch, prepared=None):
                mine = prepared[0]
                result.step_counts.append((mine.counts.tokens, mine.counts.sum_sq_lengths))
                planned[:] = [mb for mb in mine.micro_batches if mine.keep_empty or not mb.empty]
                result.step_worth.append(sum(sum(lengths) / (c * cfg.trainer.micro_batch_tokens)
                                             for lengths, c, _ in map(_sizes, planned)))
                metas[:] = prepared[3] or [None] * len(planned)  # the LLM's (None: no LLM stage)
                return fb(global_batch, prepared)

            trainer.forward_backward = forward_backward
            _as_on_the_device(trainer.optimizer)
            _allocate_optimizer_state(trainer.optimizer)
            tracker = _peak_tracker()  # entered inside the fake mode: it tracks the fake tensors
            tracker.track_external(trainer.modules, trainer.optimizer)
            peaks = []
            with tracker:
                for step in range(1, steps):
                    rec.step = events.step = step
                    with rec:
                        trainer.train_step()
                    peaks.append(tracker.step_peak())
                rec.step, counter = steps, _totals_only(flop_counter())  # FLOPs: the last step only
                events.step = steps
                with rec, counter, per_micro_batch(counter) as micro_flops:
                    trainer.train_step()
                peaks.append(tracker.step_peak())
                result.flops = counter.get_total_flops()
                result.micro_batches = [(micro_flops.get(i, 0), *_sizes(mb),
                                         getattr(meta, "loss_tokens", None))
                                        for i, (mb, meta) in enumerate(zip(planned, metas))]
        result.step_peaks = [peak.pop("Total", 0) for peak in peaks]
        result.peak_bytes = max(result.step_peaks)
        result.peak_categories = peaks[result.step_peaks.index(result.peak_bytes)]
    except Exception:  # noqa: BLE001 - a rank that raises is a finding, reported with its traceback
        result.error = traceback.format_exc()
    finally:
        if trainer is not None:
            trainer.ahead.close()
        rec.uninstall()
        result.ops, result.creations, result.group_names = rec.ops, rec.creations, rec.names
        result.device_events = dict(events.counts)
        dist.destroy_process_group()
        torch.set_grad_enabled(True)
    return result


@contextlib.contextmanager
def _on_device(cfg, events, fake):
    """On fake CUDA: the trainer's device is `cuda:0` (every rank's: a rank sees its own GPU),
    `torch.cuda`'s calls stand in (`fake_cuda.patched`), `events` records every step, per
    micro-batch, and the plan-ahead thread's work (the next step's data and uploads) runs on
    the rank's thread when it is asked for (`_Inline`): dispatch modes are per thread, and a
    real CPU tensor copied to CUDA outside the fake mode would need a GPU. On the CPU: nothing."""
    if cfg.rehearse.get("device") != "cuda":
        yield
        return
    import torch

    import hcp.plan.ahead as ahead
    import hcp.train.trainer as trainer_mod
    from hcp.preflight.rehearse import fake_cuda
    from hcp.preflight.rehearse.device import FakeUploads

    if not fake_cuda.active():
        raise RuntimeError("rehearse.device=cuda: this process has no fake CUDA (start it "
                           "through `python train.py ... mode=rehearse rehearse.device=cuda`, "
                           "which preloads it)")
    init, pool = trainer_mod.init_distributed, ahead.ThreadPoolExecutor
    trainer_mod.init_distributed = lambda launcher: torch.device("cuda", 0)
    uploads = FakeUploads(fake)
    ahead.ThreadPoolExecutor = lambda *args, **kwargs: _Inline(lambda: uploads.around(events))
    try:
        with fake_cuda.patched(events.read), events.recording():
            yield
    finally:
        trainer_mod.init_distributed, ahead.ThreadPoolExecutor = init, pool


class _Inline:
    """A `ThreadPoolExecutor` that runs each job on the caller's thread when submitted, inside
    `context()`."""

    def __init__(self, context):
        self.context = context

    def submit(self, fn, *args):
        from concurrent.futures import Future

        done = Future()
        try:
            with self.context():
                done.set_result(fn(*args))
        except Exception as err:  # noqa: BLE001 - surfaces from result(), as a thread's would
            done.set_exception(err)
        return done

    def shutdown(self, *args, **kwargs):
        pass


@contextlib.contextmanager
def _host_metadata():
    """FSDP's (`dp_shard`) mesh and shard-offset arithmetic outside the fake mode: they compute
    host values (a mesh's ranks, a shard's offset) with small tensors, which fake tensors
    cannot answer."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    import hcp.model.init as init

    def on_host(fn):
        def wrapped(*args, **kwargs):
            with unset_fake_temporarily():
                return fn(*args, **kwargs)
        return wrapped

    mesh, offset = DeviceMesh.from_group, init.compute_local_shape_and_global_offset
    DeviceMesh.from_group = staticmethod(on_host(mesh))
    init.compute_local_shape_and_global_offset = on_host(offset)
    try:
        yield
    finally:
        DeviceMesh.from_group, init.compute_local_shape_and_global_offset = (staticmethod(mesh),
                                                                             offset)


@contextlib.contextmanager
def _no_values():
    """Parameter initialization draws no values: `hcp.model.init._normal_rows` draws a whole
    tensor's rows block by block so that a shard's values equal the whole tensor's, which a fake
    tensor (no values) does not need and which costs a rank's set-up most of its time. One
    `normal_` on the shard stands for it: the same tensor, no collective, and before the tracked
    steps (the blocks are temporaries freed at once)."""
    import hcp.model.init as init

    draw = init._normal_rows
    init._normal_rows = lambda out, whole, offset, generator, std: out.normal_(0.0, std)
    try:
        yield
    finally:
        init._normal_rows = draw


def _sizes(mb) -> tuple[list[int], int, int]:
    """(document lengths, CP size, CP rank) of a `MicroBatchPlan`."""
    return ([int(b - a) for a, b in zip(mb.cu_seqlens[:-1], mb.cu_seqlens[1:])], mb.cp_size,
            mb.cp_rank)


def _local(p):
    """This rank's part of a parameter (an FSDP `DTensor`'s local shard)."""
    return p.to_local() if hasattr(p, "to_local") else p


def _peak_tracker():
    """torch's `MemTracker` for one figure per step, the rank's peak bytes (`step_peak`): its
    per-module statistics are off (they raise when a root module runs once per micro-batch,
    and cost a snapshot per module call)."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

    class RankPeakTracker(MemTracker):
        def _pre_fw_hook(self, *args):
            pass

        _post_fw_hook = _pre_bw_hook = _post_bw_hook = _pre_fw_hook

        def step_peak(self) -> dict[str, int]:
            """Bytes of each `MemTracker` category (and "Total") at the peak since the last
            call (or entering), summed over devices; the next peak starts from the bytes held
            now, as entering starts it."""
            out: dict[str, int] = {}
            for snap in self.get_tracker_snapshot("peak").values():
                for key, nbytes in snap.items():
                    name = getattr(key, "value", str(key))
                    out[name] = out.get(name, 0) + nbytes
            self._peak_mem_snap = self.get_tracker_snapshot()
            self._peak_mem = {dev: snap[_TOTAL_KEY] for dev, snap in self._peak_mem_snap.items()}
            return out

    return RankPeakTracker()


def _as_on_the_device(optimizer) -> None:
    """The optimizer's multi-tensor (`foreach`) update, which torch picks by default for CUDA
    parameters: the rehearsal's fake tensors are on the CPU device, where torch would take its
    per-tensor loop (other temporaries; a dispatch per tensor, 15% of a LLaVA rank's time). A
    group that sets `foreach` or `fused` itself keeps it."""
    for group in optimizer.param_groups:
        if group.get("foreach") is None and not group.get("fused"):
            group["foreach"] = True


def _allocate_optimizer_state(optimizer) -> None:
    """Allocate the optimizer's state as its first step does (Adam's moments are created
    lazily), so the rehearsed steps hold it through their forward and backward as every step
    after the first of a real run does: without it, a one-step rehearsal's peak misses the
    moments under the activations. A step on zero gradients (fake tensors: values unused)."""
    import torch

    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class _GlobalOnly:
    """A stand-in for `FlopCounterMode`'s module tracker that attributes every op to `Global`."""

    parents = frozenset({"Global"})

    def __enter__(self):
        return self

    def __exit__(self, *args):
        pass


def _totals_only(counter):
    """`counter` without its per-module tracking (the rehearsal reads totals only). torch's
    `ModuleTracker` hooks every module call's inputs and outputs with `register_multi_grad_hook`
    until the counter exits, also inside activation recompute's re-run forward, whose graph is never
    backwarded: the hook's closure holds the node it hangs on, a cycle through C++, so every
    recomputed layer's saved tensors (the all-gathered CP K/V among them) would stay alive
    through the optimizer step and inflate the tracked peak. A real run has no such hook."""
    counter.mod_tracker = _GlobalOnly()
    return counter


def _child(work, rank, out):
    import torch

    torch.set_num_threads(1)
    try:  # the rank's own console lines (skipped non-finite steps) would only repeat W times
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            result = work(rank)
        out.put((rank, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - even a failure outside the trainer reaches the parent
        out.put((rank, pickle.dumps(RankResult(rank, error=traceback.format_exc()))))


def _forked(work, ranks: list[int], jobs: int, timeout_s: float, progress=None) -> dict:
    """`work(rank)` of each of `ranks` in its own forked process, `jobs` at a time; rank -> its
    result (a `RankResult` with the traceback when `work` raised). `progress(rank, result)` is
    called as each finishes."""
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    todo, running, results = list(ranks), {}, {}
    while todo or running:
        while todo and len(running) < max(1, jobs):
            rank = todo.pop(0)
            running[rank] = ctx.Process(target=_child, args=(work, rank, out), daemon=True)
            running[rank].start()
        try:
            rank, blob = out.get(timeout=timeout_s)
        except queue_mod.Empty:
            raise RuntimeError(f"rehearsal of ranks {sorted(running)} took over {timeout_s:.0f} "
                               f"s") from None
        results[rank] = pickle.loads(blob)
        running.pop(rank).join()
        if progress is not None:
            progress(rank, results[rank])
    return results


def _preload() -> None:
    """Import once in the parent what every forked child needs (AdamW imports dynamo: ~6 s)."""
    import torch._dynamo  # noqa: F401
    import torch.distributed._tools.mem_tracker  # noqa: F401
    import torch.utils.flop_counter  # noqa: F401

    import hcp.train.trainer  # noqa: F401


def rehearse_ranks(cfg, run_dir: str, ranks: list[int], world: int, steps: int, jobs: int,
                   timeout_s: float = 3600.0, progress=None) -> dict[int, RankResult]:
    """`rehearse_rank` of each of `ranks`, `jobs` forked processes at a time; rank -> result.
    `progress(rank, result)` is called as each finishes."""
    _preload()
    return _forked(lambda rank: rehearse_rank(cfg, run_dir, rank, world, steps), ranks, jobs,
                   timeout_s, progress)


def plan_slices(cfg, world: int, steps: int, jobs: int,
                timeout_s: float = 3600.0) -> dict[int, list | None]:
    """Every rank's plan slice (`hcp.preflight.rehearse.classes.slice_of`) of each of the first
    `steps` steps, computed as the rank computes its plan: in its own process, as rank r of the
    fake process group, by the trainer's planner and sampler (the model is not built). None for
    a rank whose planner raised (its rehearsal reports it)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hcp.config.layouts import resolve_layouts
    from hcp.config.settings import PackingSpec
    from hcp.config.specs import resolve_modules
    from hcp.data.build import build_datasets
    from hcp.data.loader import GlobalBatchSampler
    from hcp.preflight.rehearse.classes import slice_of
    from hcp.train import encoders as sides
    from hcp.train.planner import StepPlanner

    specs = resolve_modules(cfg, resolve_layouts(cfg, world))
    tok, train_set, _ = build_datasets(cfg, specs)
    index = sides.LengthIndexes(specs, train_set, tok)
    batches = GlobalBatchSampler(len(train_set), cfg.trainer.global_batch_size, cfg.seed)
    indices = [batches.batch(k) for k in range(steps)]

    def plan(rank):
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        try:
            planner = StepPlanner(PackingSpec.of(cfg), specs, index)
            return [slice_of(planner(ix), rank) for ix in indices]
        finally:
            dist.destroy_process_group()

    out = _forked(plan, list(range(world)), jobs, timeout_s)
    return {r: None if isinstance(s, RankResult) else s for r, s in out.items()}


def default_jobs() -> int:
    """Processes at a time when `rehearse.jobs` is unset: one per CPU core."""
    return os.cpu_count() or 1
