"""The training loop of one rank: step plan -> this rank's data -> the step's action list ->
per-module gradient sync -> one AdamW step -> metrics, evaluation and checkpoints.

Every step is decided by the step plan (`hcp.plan`, docs/design.md 4.1), computed for step k+1
while step k runs (`hcp.plan.ahead.PlanAhead`); each rank loads only what its plan gives it (its
encoder lane's images; on the LLM's first stage the text of its micro-batches). The one executor
(`hcp.train.step.StepRunner`) runs the plan's action list: encoder forward, the route of image
rows to the LLM's CP shards (`hcp.schedule.colocated`), the LLM's 1F1B, the route back, the
encoder backward. Loss is token-level over the global batch; each module sums its gradients over
its own DP (x CP) group, the clipping norm is global, one optimizer steps all modules. Under
`placement=non_colocated` the trainer composes `hcp.train.islands.Islands` instead."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from hcp.config.layouts import resolve_layouts
from hcp.config.precision import Precision
from hcp.config.schema import LoggerConfig, OptimConfig, TrainerConfig
from hcp.config.settings import CheckpointSpec, PackingSpec
from hcp.config.specs import resolve_modules, typed
from hcp.data.build import build_datasets
from hcp.data.loader import GlobalBatchSampler
from hcp.dcp.policy import cp_histogram
from hcp.model import LlavaModel
from hcp.model.backends import resolve_backend
from hcp.model.init import materialize, meta_build
from hcp.model.hf_load import load_pretrained, loaded_modules
from hcp.model.encoder_side import llava_kwargs
from hcp.model.llava import LlavaEncoder
from hcp.model.stage import StageSpec
from hcp.parallel.groups import ProcessGroupRegistry
from hcp.parallel.roles import logging_rank
from hcp.plan.ahead import PlanAhead, use_worker
from hcp.plan.shared import node_planner
from hcp.train.planner import StepPlanner
from hcp.schedule.colocated import ColocatedStep
from hcp.train import checkpoint
from hcp.train.async_checkpoint import AsyncWriter
from hcp.launch.distributed import init_distributed
from hcp.launch.watchdog import stuck_collective, watch_collectives
from hcp.train.evaluate import eval_capacity, evaluate
from hcp.train.failures import NonFiniteGuard
from hcp.train.fake import host_values
from hcp.train.islands import Islands
from hcp.train.fsdp import shard_encoder, shard_model
from hcp.train.metrics_log import RunLogger
from hcp.train.profile import StepProfiler
from hcp.train.stragglers import StragglerWatch
from hcp.comm.trace import span
from hcp.train.throughput import WorldStats, rate_metrics
from hcp.train.modules import RankModules, clip_, local_grad_sq, module_sq_norm
from hcp.train.optim import build_optimizer, build_scheduler, module_overrides
from hcp.train.plan_check import check_plans_agree
from hcp.launch.preempt import Preemption, continue_wandb_run
from hcp.train.rank_data import llm_inputs, micro_batch_groups
from hcp.train.step import StepRunner, plan_counts
from hcp.launch.supervise import record_step
from hcp.train import encoders as sides  # one or several encoders (joins, branches)
from hcp.train.whole_encoder import whole_encoder


class Trainer:
    """Builds everything one rank needs from the resolved config and runs `fit()`.

    `run_dir` is the run directory chosen once by the launching process; only the logging
    rank writes into it (checkpoints are written by every rank, as DCP shards).
    Under `placement=non_colocated` it composes `islands` (`hcp.train.islands.Islands`: a rank
    builds only its island's modules; None under colocation).
    """

    def __init__(self, cfg, run_dir: str):
        self.cfg, self.run_dir = cfg, run_dir
        # read per step: resolved once
        self.settings: TrainerConfig = typed(cfg.trainer, TrainerConfig)
        self.device = init_distributed(cfg.launcher)
        # signal -> flag (hcp.launch.preempt)
        self.preempt = Preemption(cfg.launcher.slurm, self.device)
        # peak memory, bubble, flag: one step late
        self.stats = WorldStats(self.device, self.preempt)
        self.unlogged = None  # (step, metrics) to log once the step's world figures land
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # one policy: schedules, routes, links, backend
        self.precision = Precision.of(cfg.precision)
        self.layouts = resolve_layouts(cfg, self.world)
        self.specs = resolve_modules(cfg, self.layouts)  # once: the modules the layers build from
        self.packing, self.checkpointing = PackingSpec.of(cfg), CheckpointSpec.of(cfg)
        self.dynamic_cp = self.packing.dynamic_cp  # hcp.dcp.policy: per-micro-batch CP groups
        self.groups = ProcessGroupRegistry(self.layouts, ("llm",) if self.dynamic_cp else ())
        llm = self.layouts["llm"]
        self.dp, self.cp, self.lane, self.stage = llm.dp, llm.cp, None, None
        self.dp_group = self.grad_group = self.tp_group = self.cp_group = None
        if self.groups.runs("llm"):  # every rank but an encoder island's (non_colocated)
            coords = self.groups.grids["llm"].coords(self.rank)
            self.lane, self.stage = coords["dp"], StageSpec.of(llm.pp_layers, coords["pp"])
            self.dp_group = self.groups.group("llm", "dp")
            self.grad_group = self.groups.group("llm", "dp_cp")
            self.tp_group = self.groups.group("llm", "tp") if llm.tp > 1 else None
            self.cp_group = self.groups.group("llm", "cp") if llm.cp > 1 else None
        self.is_logging_rank = self.rank == logging_rank(self.layouts)
        if self.is_logging_rank:  # every rank's seconds per step land in `stats` (no collective)
            self.stats.watch = StragglerWatch(self.settings.straggler_factor)
        self.tok, self.train_set, self.eval_set = build_datasets(cfg, self.specs)
        self.islands = (Islands(self.specs, self.groups, self.rank, self.device, self.precision,
                                self.settings.fsdp_reduce)
                        if cfg.placement == "non_colocated" else None)
        self.encoder = self._build_encoder()  # both on the meta device: nothing allocated yet
        self.model = self._build_model()
        self.modules = self._rank_modules()
        if llm.dp_shard:
            shard_model(self.model, self.groups, self.device, self.precision)
        shard_encoder(self.encoder, self.layouts, self.groups, self.device,
                      self.precision)  # {vision,projector}.layout.dp_shard
        loaded = [getattr(self.modules, m) for m in loaded_modules(cfg)
                  if getattr(self.modules, m, None) is not None]  # init_from: no random draw
        for module in (self.encoder, self.model):  # only this rank's shards, made on its device
            if module is not None:
                materialize(module, self.device, cfg.seed, skip=loaded)
        # <module>.init_from: Hugging Face weights, this rank's shards
        load_pretrained(self.modules, cfg)
        self.runner = (StepRunner(self.model, self.groups, self.device, self.precision,
                                  llm.dp_shard, self.settings.fsdp_reduce)
                       if self.model is not None else None)
        self.colocated = (ColocatedStep(self.encoder, None,
                                        self.layouts["vision"].recompute == "full",
                                        precision=self.precision, device_type=self.device.type)
                          if self.encoder is not None and cfg.placement == "colocated" else None)
        optim = typed(cfg.optim, OptimConfig)
        # groups per module
        self.optimizer = build_optimizer(self.modules, optim, module_overrides(self.specs))
        self.writer = AsyncWriter() if self.checkpointing.asynchronous else None  # checkpoint.async
        tc = self.settings
        self.guard = NonFiniteGuard(tc.on_nonfinite, self.modules, self.checkpointing.dir,
                                    tc.max_skipped_steps, tc.loss_spike_factor)
        self.scheduler = build_scheduler(self.optimizer, optim, self.settings.max_steps)
        self.sampler = GlobalBatchSampler(len(self.train_set), self.settings.global_batch_size,
                                          cfg.seed)
        # one per stream into the LLM
        self.index = sides.LengthIndexes(self.specs, self.train_set, self.tok)
        self.record_encoder_grad_sq, self.encoder_grad_sq = False, None
        """Set `record_encoder_grad_sq` (tests) to keep in `encoder_grad_sq` the sum of squares
        of this rank's own encoder gradients before their DP sum: one host read per parameter
        tensor, so never on by default."""
        self.step, self.resume_note = checkpoint.resume(self.checkpointing, self.modules,
                                                        self.optimizer, self.scheduler,
                                                        self.sampler, self._tp_groups())
        self.planner = StepPlanner(self.packing, self.specs, self.index)
        if self.dynamic_cp and self.settings.plan_share == "node":  # hcp.plan.shared
            self.planner = node_planner(self.planner, run_dir, dist.get_backend() != "fake")
        in_process = self.dynamic_cp and use_worker(self.settings.plan_process,
                                                    self.device.type)  # hcp.train.planner
        self.ahead = PlanAhead(self.sampler, self.prepare, self.planner if in_process else None)
        self.log = None
        if self.is_logging_rank:
            logger = typed(cfg.logger, LoggerConfig)
            continue_wandb_run(logger, run_dir, resumed=self.step > 0)
            self.log = RunLogger(run_dir, logger, self.settings, self.step,
                                 OmegaConf.to_container(cfg, resolve=True))
        if self.log and self.resume_note:
            self.log.write(self.resume_note)
        self.profiler = StepProfiler(cfg.profile.steps, cfg.profile.memory, run_dir, self.rank,
                                     self.device, self.log.write if self.log else None)
        if self.islands is not None:  # every rank, last: the islands' P2P group
            self.islands.connect(self.world)

    @property
    def head(self) -> str | None:
        """This rank's island head module under non_colocated ("llm" on the LLM island), else
        None."""
        return self.islands.head if self.islands is not None else None

    @property
    def route_bytes(self):
        """The bytes this rank sent over island routes (`RouteBytes`), None under colocation."""
        return self.islands.route_bytes if self.islands is not None else None

    def _build_encoder(self) -> LlavaEncoder | None:
        """The encoder side (vision + projector) on its own TP group, on the meta device (`__init__`
        materializes this rank's shards), or None (text-only LM)."""
        if self.islands is not None:  # this rank's encoder island stage, or None
            return self.islands.build_encoder()
        return sides.build_encoder(self.specs, self.groups)

    def _build_model(self) -> LlavaModel:
        """This rank's LLM stage on the meta device (`__init__` materializes this rank's
        shards); image rows arrive routed from the encoder side."""
        if self.islands is not None and self.islands.head != "llm":
            return None
        with meta_build():
            model = LlavaModel(**llava_kwargs(self.specs), tp_group=self.tp_group,
                               cp_group=self.cp_group, stage=self.stage, encoder=False,
                               attention_backend=self.attention_backend())
        if self.specs.llm.freeze:
            model.llm.requires_grad_(False)
        return model

    def attention_backend(self) -> str:
        """The run's attention backend, resolved once from its device, its compute dtype (the
        precision policy's, not the residual stream's fp32) and its largest CP group (the CP
        pool under dynamic CP)."""
        llm = self.layouts["llm"]
        return resolve_backend(self.specs.llm.arch.attention_backend, self.device,
                               self.precision.compute, llm.cp_pool if self.dynamic_cp else llm.cp,
                               self.dynamic_cp)

    def _rank_modules(self) -> RankModules:
        """This rank's modules under one root keyed by module FQN (checkpoints, optimizer); with
        an encoder side, its checkpoints name every module's layout (`checkpoint.layouts_label`)."""
        if self.islands is not None:
            return self.islands.modules(self.encoder, self.model)
        modules = RankModules(self.encoder, self.model)
        if self.encoder is not None:
            modules.layout_label = checkpoint.layouts_label(self.layouts)
        return modules

    def _tp_groups(self):
        """TP group of each module's TP-sharded parameters, for checkpoints (None: no TP)."""
        if self.islands is not None:
            return self.islands.tp_groups(self.encoder, self.tp_group)
        groups = {"llm": self.tp_group}
        groups.update(sides.tp_groups(self.encoder))
        return groups if any(g is not None for g in groups.values()) else None

    def plan(self, indices):
        """The step plan of the global batch `indices` (pure; the same on every rank)."""
        return self.planner(indices)

    def prepare(self, indices, step=None):
        """On the plan-ahead thread: this rank's plan and data, (RankPlan, pixel values of its
        encoder samples [I, C, H, W] or None, its LLM micro-batches (first stage) or None, every
        micro-batch's `StageMeta` for the pipeline, the step's micro-batches per CP size under
        dynamic CP (`hcp.dcp.policy.cp_histogram`, else {})). Only this rank's samples are read:
        images only for its encoder samples, text by `hcp.train.rank_data.llm_inputs`.
        `step`: the plan when the plan-ahead worker process computed it."""
        step = self.plan(indices) if step is None else step
        mine = step.rank(self.rank, self.settings.check_plan)
        ds, device = self.train_set, self.device
        if self.islands is not None and self.model is None:  # an encoder island's rank
            return mine, self.islands.encoder_inputs(mine, indices, ds), None, None, {}
        pixels = None
        if self.encoder is not None:
            pixels = sides.encoder_inputs(ds, indices, mine, self.encoder, device)
        batches, metas = llm_inputs(mine, indices, ds, self.tok.image_token_id, self.stage, device)
        return mine, pixels, batches, metas, cp_histogram(step.packing) if self.dynamic_cp else {}

    def train_step(self) -> dict:
        """One optimizer step over the next global batch; returns this step's metrics (its
        `peak_memory_gib` and `bubble_fraction` land in the dict at the next step or at
        `stats.settle()`: `hcp.train.throughput.WorldStats`)."""
        t0 = time.perf_counter()
        with span("hcp.data_wait"):
            indices, prepared, plan_stats = self.ahead.next()
        data_wait_s = time.perf_counter() - t0
        if self.settings.check_plan:
            self._check_plan(prepared[0].checksum)
        loss, counts, n_micro = self.forward_backward(indices, prepared)
        with span("hcp.clip"):
            norm = self.clip(self.settings.grad_clip)
        # the step's one read, after its collectives
        read = host_values(torch.stack([loss.double(), norm.double()]))
        # fake tensors: no value
        loss, grad_norm = read if read is not None else (float("nan"), float("nan"))
        # NaN/Inf: stop or skip (trainer.on_nonfinite)
        update = read is None or self.guard.update_ok(self.step + 1, loss, grad_norm, indices)
        if update:
            with span("hcp.optimizer"):
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.lr
        if update:
            self.scheduler.step()
        self.step += 1
        metrics = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "loss_tokens": int(counts[0]),
                   "micro_batches": n_micro, **plan_stats, **prepared[4],
                   **rate_metrics(self.specs.llm.arch, counts, time.perf_counter() - t0,
                                  self.world)}
        # the previous step's figures land; this one's leave
        self.stats.issue(metrics, self.stage_times, data_wait_s)
        return metrics

    def forward_backward(self, global_batch: list[int], prepared=None) -> tuple[torch.Tensor,
                                                                                list[float], int]:
        """Gradients of the token-level loss of `global_batch` (sample indices), summed over each
        module's DP (x CP) group; `prepared` is `prepare(global_batch)` when already computed.
        Returns (global loss (0-d device tensor), [global loss tokens, global tokens, global sum of
        squared document lengths], micro-batches per lane)."""
        mine, pixels, batches, metas, _ = (prepared if prepared is not None
                                           else self.prepare(global_batch))
        if self.islands is not None:
            loss, counts, n_micro, self.stage_times, grad_sq = self.islands.forward_backward(
                mine, pixels, batches, metas, self.encoder, self.runner,
                self.record_encoder_grad_sq,
                self._cp_groups(mine) if self.model is not None else None)
            if grad_sq is not None:
                self.encoder_grad_sq = grad_sq
            return loss, counts, n_micro

        c = mine.counts  # the plan's global counts (no collective); trainer.check_counts counts too
        check = self.settings.check_counts and not self.dynamic_cp
        planned = None if check else [c.loss_tokens, c.tokens, c.sum_sq_lengths, c.image_rows]
        phases = (sides.colocated_phases(self.colocated, self.encoder, pixels, mine, batches)
                  if self.colocated is not None else None)  # the encoder and route actions
        loss, counts, n_micro, self.stage_times = self.runner.forward_backward(
            [b for _, b in batches] if batches is not None else None, metas, planned,
            mine.overlap_grad_sync, self._cp_groups(mine), mine.actions, phases and phases.handlers)
        if phases is None:
            return loss, plan_counts(mine, counts), n_micro
        self.phase_times = phases.times
        if self.record_encoder_grad_sq:  # before the DP sum (FSDP: after)
            self.encoder_grad_sq = local_grad_sq(self.encoder.parameters())
        # no row anywhere: no update
        sides.sync_encoder_grads(self.encoder, self.groups, mine.counts)
        return loss, plan_counts(mine, counts), n_micro

    def _cp_groups(self, mine):
        """Under dynamic CP, each micro-batch's CP group (`hcp.train.rank_data.micro_batch_groups`);
        else None: the model's own CP group."""
        return micro_batch_groups(self.groups, mine, self.rank) if self.dynamic_cp else None

    def _check_plan(self, checksum: int) -> None:
        """`trainer.check_plan`: every rank must have computed the same step plan
        (`hcp.train.plan_check`: one int64 all-reduce; RuntimeError naming the step on every
        rank)."""
        check_plans_agree(checksum, self.step + 1, self.device)

    def clip(self, max_norm: float) -> torch.Tensor:
        """Clip every module's gradients by their global L2 norm; return the norm before (a 0-d
        device tensor)."""
        if self.islands is not None:  # this rank's module only, one world all-reduce
            own, tp = ((self.encoder, self.encoder.tp_group) if self.encoder is not None
                       else (self.model, self.tp_group))
            return self.islands.clip(own, tp, self.modules.parameters(), max_norm)
        llm = self.layouts["llm"]
        sq = module_sq_norm(self.model.parameters(), self.device, self.tp_group,
                            self.grad_group if llm.dp_shard else None,
                            self.groups.group("llm", "pp") if llm.pp > 1 else None)
        if self.encoder is not None:
            sq = sq + sides.sq_norm(self.encoder, self.device, self.groups)
        norm = sq.sqrt()
        clip_(self.modules.parameters(), norm, max_norm)
        return norm

    def evaluate(self) -> dict:
        if self.eval_set is None:
            return {}
        n = len(self.eval_set)
        if self.settings.eval_samples:
            n = min(n, self.settings.eval_samples)
        whole = self._whole_encoder()  # a collective under non_colocated: before leaving
        if self.model is None:           # an encoder island's rank: the LLM island evaluates
            return {}
        per = -(-n // self.dp)
        indices = list(range(self.lane * per, min(n, (self.lane + 1) * per)))
        lent = dict(whole.named_children()) if whole is not None and self.stage.first else {}
        for name, module in lent.items():  # held-out images are encoded in place
            setattr(self.model, name, module)
        try:
            return evaluate(self.model, self.runner.forward_outputs, self.eval_set, self.tok,
                            indices, eval_capacity(self.packing, self.cp), self.device,
                            self.grad_group, self.dp_group, self.settings.eval_max_new_tokens)
        finally:
            for name in lent:
                setattr(self.model, name, None)

    def _whole_encoder(self) -> LlavaEncoder | None:
        """The encoder side whole on this rank, for evaluation (`hcp.train.whole_encoder`; under
        non_colocated every island's, on the LLM's first stage: `Islands.whole_encoders`)."""
        if self.islands is not None:
            return self.islands.whole_encoders(self.encoder)
        return whole_encoder(self.encoder, self.specs, self.device)

    def save(self, wait: bool = False) -> None:
        """Save a checkpoint of this step; under `checkpoint.async` it is written in the
        background unless `wait` (the end of the run, a preemption: it is on disk on return)."""
        state = {"step": self.step, "scheduler": self.scheduler.state_dict(),
                 "sampler": self.sampler.state_dict()}
        path = checkpoint.save(self.checkpointing.dir, self.step, self.modules, self.optimizer,
                               state, self.checkpointing.keep, self._tp_groups(), self.writer)
        if self.writer is not None and wait:
            self.writer.wait()
        if self.log:
            later = " (writing in the background)" if self.writer is not None and not wait else ""
            self.log.write(f"checkpoint step {self.step}: {path}{later}")

    def fit_step(self) -> dict:
        """One step of `fit`: `train_step`, then evaluation, logging, checkpoint and the
        preemption check as configured; returns the step's metrics (with any evaluation's).
        A step's record is logged at the next step, once its world figures have landed
        (`WorldStats`); a preemption flag is agreed there too, so every rank stops at the step
        boundary after the one the signal reached."""
        tc = self.settings
        with self.profiler.step(self.step + 1):  # profile.steps: a trace of this step
            metrics, evals = self.train_step(), {}  # the previous step's figures and flag landed
        record_step(self.step)
        if tc.eval_every and self.step % tc.eval_every == 0 and self.step < tc.max_steps:
            evals = self.evaluate()
            metrics.update(evals)
        self._log_landed()
        if self.log:
            due = self.step % tc.log_every == 0 or self.step == tc.max_steps or bool(evals)
            self.unlogged = (self.step, metrics) if due else None
            self.log.advance()
            if self.step % tc.log_every == 0:  # the steps landed so far: up to the previous one
                for line in self.stats.watch.report(self.step - 1):
                    self.log.write(line)
        if tc.save_every and self.step % tc.save_every == 0 and self.step < tc.max_steps:
            self.save()
        if self.step < tc.max_steps and self.preempt.stopping:  # agreed in train_step
            self.land_stats()
            self.save(wait=True)
            self.ahead.close()
            self.preempt.requeue_and_exit(self.step, self.checkpointing.dir)
        return metrics

    def land_stats(self) -> None:
        """Wait for the last step's world figures (every rank) and log its record if due."""
        self.stats.settle()
        self._log_landed()

    def _log_landed(self) -> None:
        """Log the record kept by `fit_step`, whose world figures have landed by now."""
        if self.unlogged is not None:
            self.log.log(*self.unlogged)
            self.unlogged = None

    def fit(self) -> dict:
        """Train to `trainer.max_steps`, evaluating and saving as configured; return the summary."""
        tc = self.settings
        t_start, history, metrics, evals = time.perf_counter(), [], {}, {}
        # the launcher names the step of a rank that dies (hcp.launch.supervise)
        record_step(self.step)
        while self.step < tc.max_steps:
            metrics = self.fit_step()
            history.append(metrics)
        self.land_stats()
        evals = self.evaluate()
        self.save(wait=True)
        self.ahead.close()
        summary = {"steps": self.step, "final_loss": metrics.get("loss"), **evals,
                   "wall_s": round(time.perf_counter() - t_start, 2),
                   **{k: sum(m[k] for m in history) / max(1, len(history))
                      for k in ("tokens_per_s", "step_time_s", "tflops_per_gpu",
                                "bubble_fraction")},
                   "peak_memory_gib": max((m["peak_memory_gib"] for m in history), default=0.0),
                   "world_size": self.world,
                   "skipped_records": dict(self.train_set.skipped.counts),
                   "nonfinite_skipped_steps": self.guard.skipped}
        if self.log:
            self.log.log(self.step, evals)
            self.log.finish(summary)
        return summary


def run_rank(cfg, run_dir: str) -> dict:
    """Entry point of one rank: train, then leave the process group cleanly. A collective that
    times out raises `CollectiveTimeout` naming this rank and the collective
    (`hcp.launch.watchdog`)."""
    watch_collectives(run_dir, cfg.launcher.backend == "nccl" or
                      (cfg.launcher.backend == "auto" and torch.cuda.is_available()))
    trainer = None
    try:
        trainer = Trainer(cfg, run_dir)
        return trainer.fit()
    except Exception as e:
        stuck = stuck_collective(e, cfg.launcher.timeout_s, trainer.step + 1 if trainer else None)
        if stuck is None:
            raise
        raise stuck from e
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
