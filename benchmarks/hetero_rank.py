"""One rank's part of `benchmarks/hetero.py`: runs timed training steps of one layout on a forked
gloo rank and returns what it measured.

Every layout runs the same model, global batch (`data_config`: a LLaVA-JSON data set written once,
read by the trainer's own data path), step plan, weights and seed. What runs the step:
- `heterogeneous` (colocated, docs/design.md 4.4) and `non_colocated` (islands): the trainer's
  own step, `hcp.train.trainer.Trainer.forward_backward` (its plan, data, the plan's action list
  on the one executor, each module's gradient sum) on a `Trainer` built from the config;
- `homogeneous` (before issue 12, deliberately not hcp's path: a baseline): the vision encoder
  and projector inside the LLM's first PP stage (`LlavaModel(encoder=True)`), so every rank of a
  first-stage TP x CP group encodes every image of its micro-batches; run by the trainer's
  `StepRunner` (1F1B, token-level loss, DP x CP sync) on the trainer's plan and data.
Timing hooks only wrap what runs (`time_micro_batches` on the executor; the colocated step's own
`PhaseTimes`): one step = forward and backward of every micro-batch plus each module's gradient
sum; data loading and the optimizer step are left out (the same in all).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist

from harness import report  # beside this file (benchmarks/hetero.py puts it on the path)
from hcp.model.flops import encoder_flops  # noqa: F401  (hetero.py and hetero_plan.py import it from here)
from hcp.train.trainer import Trainer  # imported once here, before the ranks fork (seconds each)

PHASES = ("encoder_forward", "route_forward", "llm", "route_backward", "encoder_backward")


def compose(overrides):
    """(config, layouts resolved over `launcher.nproc_per_node` ranks) of the overrides."""
    from hcp.config.compose import compose_config
    from hcp.config.layouts import resolve_layouts

    cfg = compose_config(["+recipe=llava_tiny_hetero", "trainer.eval_every=0", *overrides])
    return cfg, resolve_layouts(cfg, int(cfg.launcher.nproc_per_node))


def _write_data(cfg, num_samples: int, text_tokens: int) -> str:
    """Write the global batch as LLaVA JSON with PNG images (once per content, renamed into
    place); return its folder. Sample s has 1 + s % 2 images, the second in the middle of its
    question; question and answer hold `text_tokens` // 2 bytes each."""
    v = cfg.vision
    key = json.dumps([num_samples, text_tokens, v.image_size, v.num_channels]).encode()
    out = os.path.join(tempfile.gettempdir(), "hcp-hetero-" + hashlib.sha1(key).hexdigest()[:12])
    if os.path.isfile(os.path.join(out, "train.json")):
        return out
    from PIL import Image

    rng = np.random.default_rng(0)
    tmp = tempfile.mkdtemp(prefix=".hcp-hetero-", dir=tempfile.gettempdir())
    text = lambda n: "".join(rng.choice(list("abcdefgh "), n))  # noqa: E731
    records = []
    for s in range(num_samples):
        images = []
        for i in range(1 + s % 2):
            pixels = rng.integers(0, 256, (v.image_size, v.image_size, v.num_channels), dtype=np.uint8)
            Image.fromarray(pixels.squeeze(-1) if v.num_channels == 1 else pixels).save(
                os.path.join(tmp, f"{s}_{i}.png"))
            images.append(f"{s}_{i}.png")
        half = text(text_tokens // 2)
        question = "<image>" + half[:len(half) // 2] + "<image>" * (len(images) - 1) + half[len(half) // 2:]
        records.append({"id": f"s{s}", "image": images, "conversations": [
            {"from": "human", "value": question}, {"from": "gpt", "value": text(text_tokens // 2)}]})
    with open(os.path.join(tmp, "train.json"), "w") as f:
        json.dump(records, f)
    try:
        os.rename(tmp, out)
    except OSError:  # another process wrote it first
        pass
    return out


def data_config(cfg, num_samples: int, text_tokens: int):
    """The config reading the benchmark's global batch (`_write_data`), all of it one global batch."""
    from omegaconf import OmegaConf

    folder = _write_data(cfg, num_samples, text_tokens)
    return OmegaConf.merge(cfg, {"data": {"name": "llava_json", "path": os.path.join(folder, "train.json"),
                                          "image_folder": folder, "eval_path": None, "system_prompt": "",
                                          "max_seq_len": 1 << 16},
                                 "trainer": {"global_batch_size": num_samples}})


def make_data(cfg, num_samples: int, text_tokens: int):
    """(`data_config(cfg, ...)`, the global batch's `SampleSizes` in order)."""
    from hcp.config.layouts import resolve_layouts
    from hcp.config.specs import resolve_modules
    from hcp.data.build import build_datasets
    from hcp.train.encoders import LengthIndexes

    cfg = data_config(cfg, num_samples, text_tokens)
    specs = resolve_modules(cfg, resolve_layouts(cfg, int(cfg.launcher.nproc_per_node)))
    tok, train, _ = build_datasets(cfg, specs)
    sizes, _ = LengthIndexes(specs, train, tok).take(list(range(num_samples)))
    return cfg, sizes


def row_offsets(sizes) -> np.ndarray:
    """[B + 1] first global image-row id of each sample (rows in sample order)."""
    return np.concatenate([[0], np.cumsum(sizes.image_rows)]).astype(np.int64)


def dst_keys(mb, dataset, image_token_id: int, offset) -> np.ndarray:
    """Global image-row ids one LLM rank needs for micro-batch `mb` (its `MicroBatchPlan`; the
    global batch is the data set in order): the image rows of its CP shard of the merged
    sequence, in local slot order."""
    from hcp.parallel.cp_sharding import cp_shard

    if mb.empty:
        return np.zeros(0, dtype=np.int64)
    ids = np.concatenate([dataset[s].input_ids for s in mb.samples])
    key = np.full(len(ids), -1)
    key[ids == image_token_id] = np.concatenate([np.arange(offset[s], offset[s + 1]) for s in mb.samples])
    shard = cp_shard(torch.from_numpy(np.asarray(mb.cu_seqlens)), mb.cp_size, mb.cp_rank)
    local = np.where(shard.valid.numpy(), key[shard.token_index.numpy()], -1)
    return local[local >= 0].astype(np.int64)


def schedule_graph(cfg, layouts):
    """The `StageGraph` the step's pipeline runs: the encoder island as one stage before the LLM's
    stages under `non_colocated`, the LLM's stages alone otherwise."""
    from hcp.schedule.graph import stage_graph

    if cfg.placement == "non_colocated":
        return stage_graph({"vision": layouts["vision"].pp, "llm": layouts["llm"].pp}, [["vision", "llm"]])
    return stage_graph({"llm": layouts["llm"].pp}, [])


@contextlib.contextmanager
def time_micro_batches(fwd: list, bwd: list):
    """Hook on the one executor (`hcp.schedule.executor.Executor`) while inside: adds the thread
    CPU seconds of every forward and backward it runs to fwd[i] / bwd[i] of micro-batch i."""
    from hcp.schedule.executor import Executor

    run, backward = Executor.run, Executor._backward

    def timed_run(self, actions, train=True):
        inner = self.forward

        def forward(i, x):
            t0 = time.thread_time()
            out = inner(i, x)
            fwd[i] += time.thread_time() - t0
            return out
        self.forward = forward
        try:
            return run(self, actions, train)
        finally:
            self.forward = inner

    def timed_backward(self, i):
        t0 = time.thread_time()
        backward(self, i)
        bwd[i] += time.thread_time() - t0

    Executor.run, Executor._backward = timed_run, timed_backward
    try:
        yield
    finally:
        Executor.run, Executor._backward = run, backward


def run_rank(rank: int, world: int, port: int, name: str, composed, args, queue) -> None:
    """Fork target (`harness.fork_ranks`): measure, put (rank, result dict or traceback text) on
    `queue`. composed: `compose(overrides)`, done once in the parent (Hydra is slow to start)."""
    report(queue, rank, _measure, rank, world, port, name, composed, args)


def _homogeneous(trainer):
    """The baseline's LLM stage with the encoder side inside (`LlavaModel(encoder=True)`, same
    layout-invariant weights) and the trainer's `StepRunner` on it."""
    from hcp.model import LlavaModel
    from hcp.model.encoder_side import llava_kwargs
    from hcp.model.init import materialize, meta_build
    from hcp.train.step import StepRunner

    with meta_build():
        model = LlavaModel(**llava_kwargs(trainer.specs), tp_group=trainer.tp_group, cp_group=trainer.cp_group,
                           stage=trainer.stage, encoder=True)
    materialize(model, trainer.device, trainer.cfg.seed)
    return model, StepRunner(model, trainer.groups, trainer.device)


def _measure(rank, world, port, name, composed, args) -> dict:
    from hcp.config.layouts import resolve_layouts

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = data_config(composed[0], args.samples, args.text_tokens)
    run_dir = tempfile.mkdtemp(prefix="hcp-hetero-run-")
    cfg.checkpoint.dir = os.path.join(run_dir, "checkpoints")
    trainer = Trainer(cfg, run_dir)
    layouts = resolve_layouts(cfg, world)
    ds, image_id = trainer.train_set, trainer.tok.image_token_id
    indices = list(range(args.samples))
    plan = trainer.plan(indices)
    num_micro, sizes = plan.num_micro_batches, plan.sizes
    graph = schedule_graph(cfg, layouts)
    llm_rank = trainer.model is not None
    stage_id = graph.index("llm", trainer.stage.index) if llm_rank else graph.index("vision", 0)
    model = runner = None
    if name == "homogeneous":
        model, runner = _homogeneous(trainer)
    fwd, bwd = [0.0] * num_micro, [0.0] * num_micro
    records, per_micro, phases = [], [], []
    params = list(model.parameters() if model is not None else trainer.modules.parameters())
    for it in range(args.warmup + args.steps):
        for p in params:
            p.grad = None
        fwd[:], bwd[:] = [0.0] * num_micro, [0.0] * num_micro
        prepared = trainer.prepare(indices, plan)
        mine, pixels, batches = prepared[:3]
        if model is not None and batches is not None:  # the baseline encodes in its first stage
            for mb, b in batches:
                b.pixel_values = torch.cat([ds.pixel_values(ds[s]) for s in mb.samples])
        dist.barrier()
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        with time_micro_batches(fwd, bwd):
            if model is None:
                loss, _, _ = trainer.forward_backward(indices, prepared)
            else:
                c = mine.counts
                loss = runner.forward_backward([b for _, b in batches] if batches is not None else None,
                                               prepared[3], [c.loss_tokens, c.tokens, c.sum_sq_lengths, c.image_rows],
                                               mine.overlap_grad_sync)[0]
        busy, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
        if it >= args.warmup:
            records.append((busy, wall, float(loss)))
            per_micro.append((list(fwd), list(bwd)))
            if name == "heterogeneous":
                phases.append([getattr(trainer.phase_times, k) for k in PHASES])
    dist.barrier()
    first = llm_rank and trainer.stage.first
    if name == "homogeneous":
        images = sum(int(sizes.images[list(mb.samples)].sum()) for mb in mine.micro_batches) if first else 0
    elif trainer.islands is not None:
        images = sum(mine.encoder_inputs.get("vision", ()))
    else:
        images = 0 if pixels is None else int(pixels.shape[0])
    counter = (trainer.route_bytes if trainer.islands is not None else
               trainer.colocated.counter if name == "heterogeneous" else None)
    here = np.zeros(0, np.int64)  # image-row ids this rank needs over the step (minimum bytes)
    if first and name != "homogeneous":
        offset = row_offsets(sizes)
        here = np.concatenate([dst_keys(mb, ds, image_id, offset) for mb in mine.micro_batches])
    vis = layouts["vision"]
    dist.destroy_process_group()
    shutil.rmtree(run_dir, ignore_errors=True)  # the trainer's run directory: nothing kept
    return dict(records=records, per_micro=per_micro, phases=phases, stage=stage_id,
                last_llm=llm_rank and trainer.stage.last, images=images,
                route=(counter.forward, counter.backward) if counter is not None else (0, 0),
                flops=encoder_flops(cfg.vision, cfg.llm.hidden_size, images) / (vis.tp if model is None else 1),
                dst_keys=here, micro_batches=num_micro if llm_rank else 0)
