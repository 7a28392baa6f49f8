"""The training loop of one rank: data -> micro-batches -> forward/backward -> gradient sync ->
AdamW step -> metrics, evaluation and checkpoints.

Loss is token-level over the whole global batch (DESIGN.md section 3); the step itself (the
pipeline schedule, gradient sync, clipping) is `hcp.train.step.StepRunner`. Under pipeline
parallelism each rank builds only its stage (`hcp.model.stage`), only the first stage reads
training data, and only the last computes the loss.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from hcp.config.layouts import resolve_layouts
from hcp.config.schema import MODULES
from hcp.data.build import build_datasets
from hcp.data.loader import GlobalBatchSampler, lane_slice
from hcp.data.packing import collate, first_fit
from hcp.model import LlavaModel, init_parameters
from hcp.model.hf_load import load_pretrained
from hcp.model.stage import StageSpec
from hcp.parallel.groups import ProcessGroupRegistry
from hcp.parallel.roles import logging_rank
from hcp.train import checkpoint
from hcp.train.distributed import init_distributed
from hcp.train.evaluate import evaluate
from hcp.train.failures import NonFiniteGuard
from hcp.train.fsdp import shard_model
from hcp.train.metrics_log import RunLogger, whole_step_metrics
from hcp.train.optim import build_optimizer, build_scheduler
from hcp.train.preempt import Preemption, continue_wandb_run
from hcp.train.step import StepRunner


class Trainer:
    """Builds everything one rank needs from the resolved config and runs `fit()`.

    `run_dir` is the run directory chosen once by the launching process; only the logging
    rank writes into it (checkpoints are written by every rank, as DCP shards).
    """

    def __init__(self, cfg, run_dir: str):
        self.cfg, self.run_dir = cfg, run_dir
        self.device = init_distributed(cfg.launcher)
        self.preempt = Preemption(cfg.launcher.slurm, self.device)  # signal -> flag (hcp.train.preempt)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.layouts = resolve_layouts(cfg, self.world)
        self.groups = ProcessGroupRegistry(self.layouts)
        llm = self.layouts["llm"]
        coords = self.groups.grids["llm"].coords(self.rank)
        # Every module runs on the LLM's lanes (hcp.train.support); samples are split over DP
        # lanes, each micro-batch is CP-sharded inside the model, gradients sum over DP x CP.
        self.dp, self.lane, self.cp = llm.dp, coords["dp"], llm.cp
        self.stage = StageSpec.of(llm.pp_layers, coords["pp"])
        self.dp_group = self.groups.group("llm", "dp")
        self.grad_group = self.groups.group("llm", "dp_cp")
        self.tp_group = self.groups.group("llm", "tp") if llm.tp > 1 else None
        self.cp_group = self.groups.group("llm", "cp") if llm.cp > 1 else None
        self.is_logging_rank = self.rank == logging_rank(self.layouts)
        self.tok, self.train_set, self.eval_set = build_datasets(cfg)
        self.model = self._build_model()
        if llm.dp_shard:
            shard_model(self.model, self.groups)
        self.runner = StepRunner(self.model, self.groups, self.device, cfg.precision, llm.dp_shard)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.guard = NonFiniteGuard(cfg.trainer.on_nonfinite, self.model, cfg.checkpoint.dir)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.trainer.max_steps)
        self.sampler = GlobalBatchSampler(len(self.train_set), cfg.trainer.global_batch_size, cfg.seed)
        self.step, self.resume_note = 0, None
        self._resume()
        if self.is_logging_rank:
            continue_wandb_run(cfg, run_dir, resumed=self.step > 0)
        self.log = (RunLogger(run_dir, cfg, cfg.trainer.max_steps, self.step)
                    if self.is_logging_rank else None)
        if self.log and self.resume_note:
            self.log.write(self.resume_note)

    def _build_model(self) -> LlavaModel:
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        model = LlavaModel(cfg.vision, cfg.projector, cfg.llm, tp_group=self.tp_group,
                           cp_group=self.cp_group, stage=self.stage)
        init_parameters(model, cfg.seed)
        load_pretrained(model, cfg)  # llm/vision.init_from: Hugging Face weights, this rank's slices
        for name in MODULES:
            if getattr(model, name, None) is not None and cfg[name].freeze:
                model.get_submodule(name).requires_grad_(False)
        return model.to(self.device)

    def _resume(self) -> None:
        resume = self.cfg.resume
        path = checkpoint.latest(self.cfg.checkpoint.dir) if resume == "auto" else resume
        if path is None and self.cfg.init_from_checkpoint:  # a new stage: weights only
            self.resume_note = checkpoint.load_weights(self.cfg.init_from_checkpoint, self.model,
                                                       self.tp_group)
            return
        if not resume:
            return
        if path is None:  # resume=auto with no checkpoint yet: a fresh start, said so
            self.resume_note = (f"resume=auto: no checkpoint in checkpoint.dir={self.cfg.checkpoint.dir}; "
                                "starting at step 0")
            return
        state = checkpoint.load(path, self.model, self.optimizer, self.tp_group)
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        self.step = state["step"]
        self.resume_note = state["note"]
        if self.scheduler.change_note:  # a changed trainer.max_steps / optim.lr: said, and followed
            self.resume_note += "\n" + self.scheduler.change_note

    def micro_batches(self, sample_indices):
        """This lane's samples packed first-fit into THD micro-batches of at most
        `micro_batch_tokens` per rank: `micro_batch_tokens * cp` tokens before CP sharding, each
        document counted padded to a multiple of 2 * cp (DESIGN.md section 3)."""
        samples = [self.train_set[i] for i in sample_indices]
        pad = 2 * self.cp
        packs = first_fit([-(-len(s.input_ids) // pad) * pad for s in samples],
                          self.cfg.trainer.micro_batch_tokens * self.cp)
        return [collate([samples[i] for i in p], [self.train_set.pixel_values(samples[i]) for i in p],
                        self.tok.image_token_id).to(self.device) for p in packs]

    def train_step(self) -> dict:
        """One optimizer step over the next global batch; returns this step's metrics."""
        t0 = time.perf_counter()
        loss, counts, n_micro = self.forward_backward(self.sampler.next())
        grad_norm = self.runner.clip(self.cfg.trainer.grad_clip)
        update = self.guard.update_ok(self.step + 1, loss, grad_norm)  # NaN/Inf: stop or skip
        if update:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        if update:
            self.scheduler.step()
        self.step += 1
        return {"loss": loss, "lr": lr, "grad_norm": grad_norm, "loss_tokens": int(counts[0]),
                "micro_batches": n_micro, **whole_step_metrics(self.cfg.llm, counts, t0,
                                                               self.stage_times, self.device)}

    def forward_backward(self, global_batch: list[int]) -> tuple[float, list[float], int]:
        """Gradients of the token-level loss of `global_batch` (sample indices), synchronized
        over DP x CP. Only the first stage reads the data. Returns (global loss, [global loss
        tokens, global tokens, global sum of squared document lengths], micro-batches per lane)."""
        batches = (self.micro_batches(lane_slice(global_batch, self.dp, self.lane))
                   if self.stage.first else None)
        loss, counts, n_micro, self.stage_times = self.runner.forward_backward(batches)
        return loss, counts, n_micro

    def evaluate(self) -> dict:
        if self.eval_set is None:
            return {}
        n = len(self.eval_set)
        if self.cfg.trainer.eval_samples:
            n = min(n, self.cfg.trainer.eval_samples)
        per = -(-n // self.dp)
        indices = list(range(self.lane * per, min(n, (self.lane + 1) * per)))
        return evaluate(self.model, self.runner.forward_outputs, self.eval_set, self.tok, indices,
                        self.cfg.trainer.micro_batch_tokens, self.device, self.grad_group, self.dp_group)

    def save(self) -> None:
        state = {"step": self.step, "scheduler": self.scheduler.state_dict(),
                 "sampler": self.sampler.state_dict()}
        path = checkpoint.save(self.cfg.checkpoint.dir, self.step, self.model, self.optimizer, state,
                               self.cfg.checkpoint.keep, self.tp_group)
        if self.log:
            self.log.write(f"checkpoint step {self.step}: {path}")

    def fit(self) -> dict:
        """Train to `trainer.max_steps`, evaluating and saving as configured; return the summary."""
        tc = self.cfg.trainer
        t_start, history, metrics, evals = time.perf_counter(), [], {}, {}
        while self.step < tc.max_steps:
            metrics, evals = self.train_step(), {}
            history.append(metrics)
            if tc.eval_every and self.step % tc.eval_every == 0 and self.step < tc.max_steps:
                evals = self.evaluate()
                metrics.update(evals)
            if self.log:
                if self.step % tc.log_every == 0 or self.step == tc.max_steps or evals:
                    self.log.log(self.step, metrics)
                self.log.advance()
            if tc.save_every and self.step % tc.save_every == 0 and self.step < tc.max_steps:
                self.save()
            if self.step < tc.max_steps and self.preempt.should_stop():  # all ranks agree
                self.save()
                self.preempt.requeue_and_exit(self.step, self.cfg.checkpoint.dir)
        evals = self.evaluate()
        self.save()
        summary = {"steps": self.step, "final_loss": metrics.get("loss"), **evals,
                   "wall_s": round(time.perf_counter() - t_start, 2),
                   **{k: sum(m[k] for m in history) / max(1, len(history))
                      for k in ("tokens_per_s", "tflops_per_gpu", "bubble_fraction")},
                   "peak_memory_gib": max((m["peak_memory_gib"] for m in history), default=0.0),
                   "world_size": self.world,
                   "skipped_records": dict(self.train_set.skipped.counts),
                   "nonfinite_skipped_steps": self.guard.skipped}
        if self.log:
            self.log.log(self.step, evals)
            self.log.finish(summary)
        return summary


def run_rank(cfg, run_dir: str) -> dict:
    """Entry point of one rank: train, then leave the process group cleanly."""
    try:
        return Trainer(cfg, run_dir).fit()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
