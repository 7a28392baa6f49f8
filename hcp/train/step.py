"""One training step's forward/backward on one rank of the LLM's grid, and gradient clipping.

Token-level loss (docs/design.md section 3): every micro-batch's loss sum is divided by the
global batch's loss-token count (from the step plan, or counted with one DP all-reduce), so
gradients summed over DP x CP equal the single-process gradient. Every step runs the 1F1B
schedule (`hcp.schedule.pipeline`; plain gradient accumulation at pp = 1); with pp > 1 the first
stage broadcasts the counts and each micro-batch's `StageMeta` unless the plan gives them.
Activations travel in the compute dtype. Gradient sync: DDP-like buckets over DP x CP
(`hcp.train.grad_reduce.GradReducer`), or FSDP's reduce-scatter (`trainer.fsdp_reduce`: in every
backward or the last one, `hcp.train.fsdp.grad_sync`). Under FSDP
a lane with fewer micro-batches is padded with empty ones (`pad_micro_batches`), so every rank
issues the same collectives; with no image anywhere the encoder gets no gradient, as in one
process."""
from __future__ import annotations

import torch
import torch.distributed as dist

from hcp.comm.trace import traced
from hcp.comm.p2p import StageLink, StageMeta, broadcast_metas
from hcp.config.precision import Precision
from hcp.data.packing import pad_micro_batches
from hcp.model.collectives import group_rank, group_size
from hcp.model.llava import OWN_CP_GROUP
from hcp.schedule import actions as A
from hcp.schedule.pipeline import StageTimes, forward_only, run
from hcp.train.fsdp import grad_sync
from hcp.train.grad_reduce import GradReducer


class StepRunner:
    """Forward/backward of one global batch on this rank.

    Args:
        model: this rank's `LlavaModel` stage (possibly FSDP-wrapped); groups: the
            `ProcessGroupRegistry`; device: this rank's device; precision: the run's
            `Precision` (or its name: `fp32`, `bf16`); sharded: FSDP is on; fsdp_reduce:
            `trainer.fsdp_reduce` (`per_micro_batch`, `per_step`).
    """

    def __init__(self, model, groups, device, precision: Precision | str = "fp32",
                 sharded: bool = False, fsdp_reduce: str = "per_micro_batch"):
        self.model, self.device, self.sharded = model, device, sharded
        self.fsdp_reduce = fsdp_reduce
        self.stage = model.stage
        self.dp_group = groups.group("llm", "dp")
        self.grad_group = groups.group("llm", "dp_cp")
        self.tp_group = groups.group("llm", "tp")
        self.pp_group = groups.group("llm", "pp")
        pp_ranks = groups.ranks("llm", "pp")
        self.first_rank, self.last_rank = pp_ranks[0], pp_ranks[-1]
        self.link = StageLink(pp_ranks, self.stage.index, device, self.pp_group)
        self.precision = Precision.of(precision)
        # every trainable parameter joins, frozen ones stay out on every rank; never over TP
        # (TP shards are distinct, TP replicas already hold full gradients)
        self.reducer = (GradReducer(model.parameters(), self.grad_group)
                        if not sharded and group_size(self.grad_group) > 1 else None)

    def stage_forward(self, batch, x, head=None, cp_group=OWN_CP_GROUP):
        """This stage's model forward under the precision policy's autocast. The activation
        travels in the compute dtype; a received one is widened back to the parameter dtype, so
        the residual stream keeps the precision it has without pipeline stages."""
        return self.precision.stage_forward(
            self.device.type, lambda h: self.model(batch, h, head, cp_group=cp_group), x,
            not self.stage.last)

    def act_spec(self, meta, cp_group=OWN_CP_GROUP) -> tuple[tuple[int, int], torch.dtype]:
        """(shape, dtype) of the activation a stage sends for micro-batch `meta` over its CP
        group `cp_group` (default: the model's)."""
        return self.model.residual_shape(meta, cp_group), self.precision.compute

    def _metas(self, batches, n_micro: int) -> list:
        """Every micro-batch's `StageMeta` on every stage (from the first stage). The step plan
        will compute them locally on each rank instead: this is the one place to change."""
        if self.stage.num_stages == 1:
            return [StageMeta.of(b) for b in batches]
        return broadcast_metas(batches, n_micro, self.pp_group, self.first_rank, self.device)

    def _counts(self, batches) -> torch.Tensor:
        """[micro-batches per lane, global loss tokens, global tokens, global sum of squared
        document lengths, global images, then each DP lane's micro-batches] (float64), from the
        first stage to every stage. One all-reduce over DP: each lane writes its own count in
        its own slot. Under FSDP every lane runs the largest count (`pad_micro_batches`)."""
        lanes = group_size(self.dp_group)
        counts = torch.zeros(5 + lanes, dtype=torch.float64, device=self.device)
        if self.stage.first:
            counts[1] = sum(int((b.labels != -100).sum()) for b in batches)
            counts[2] = sum(b.labels.numel() for b in batches)
            counts[3] = sum(float((b.cu_seqlens[1:] - b.cu_seqlens[:-1]).double().pow(2).sum())
                            for b in batches)
            counts[4] = sum(0
                            if b.pixel_values is None else b.pixel_values.shape[0] for b in batches)
            counts[5 + group_rank(self.dp_group)] = len(batches)
            dist.all_reduce(counts, group=self.dp_group)  # whole micro-batches: once per lane
            counts[0] = counts[5:].max() if self.sharded else len(batches)
        if self.stage.num_stages > 1:
            dist.broadcast(counts, self.first_rank, group=self.pp_group)
        return counts

    def forward_backward(self, batches, metas=None, planned=None, overlap_grad_sync: bool = True,
                         cp_groups=None, actions=None,
                         handlers=None) -> tuple[torch.Tensor, list[float], int, StageTimes]:
        """Gradients of the token-level loss of this lane's micro-batches `batches` (first
        stage; None elsewhere), synchronized over DP x CP. `metas`: every micro-batch's
        `StageMeta` when the caller knows them (the step plan), else broadcast from the first
        stage. `planned`: the step plan's global [loss tokens, tokens, sum of squared document
        lengths, image rows], used instead of counting them with a collective (`_counts`); the
        micro-batch count is then `len(metas)` (the plan pads every lane of an FSDP group to
        the same count). `overlap_grad_sync`: launch the DP x CP gradient all-reduces during
        the last backward (`GradReducer`), as the step plan decides (`StepPlan.
        overlap_grad_sync`); without it every bucket goes after the rank's last micro-batch.
        `cp_groups`: each micro-batch's CP process group (`packing=dynamic_cp`: the plan's group,
        resolved by the trainer; None at CP size 1), else None: the model's own.
        `actions`: this rank's action list (the step plan's `RankPlan.actions`, with its
        `SyncGrads`; the colocated step's around the 1F1B with `handlers` for its encoder and
        route actions, `hcp.schedule.colocated`), else the 1F1B of the micro-batches.
        Returns (global loss, [global loss tokens, global tokens, global sum of squared
        document lengths], micro-batches run per lane (padded under FSDP), this stage's
        timings). The loss is a 0-d float64 device tensor: the caller reads it once per step."""
        if planned is not None and metas is None:
            raise ValueError("planned counts need every micro-batch's metas (the step plan's)")
        # the plan's counts stay on the host; counted ones are read back once per step
        counts = [len(metas), *planned] if planned is not None else self._counts(batches).tolist()
        n_micro, global_tokens = int(counts[0]), counts[1]
        if self.stage.first:  # FSDP: a lane with fewer micro-batches still joins every collective
            batches = pad_micro_batches(batches, n_micro, self.device)
        loss_total = torch.zeros((), dtype=torch.float64, device=self.device)
        metas = metas if metas is not None else self._metas(batches, n_micro)
        groups = cp_groups if cp_groups is not None else [OWN_CP_GROUP] * len(metas)

        def forward(i, x):
            nonlocal loss_total
            out = self.stage_forward(batches[i] if self.stage.first else metas[i], x,
                                     cp_group=groups[i])
            if not self.stage.last:
                return out
            loss_sum = out[0]
            loss_total = loss_total + loss_sum.detach().double()
            return loss_sum.float() / global_tokens

        sync = (grad_sync(self.model, self.fsdp_reduce) if self.sharded else
                None if self.reducer is None
                or not overlap_grad_sync else self.reducer.sync_in_backward)
        if actions is None:
            actions = A.one_f_one_b(self.stage.index, self.stage.num_stages, len(metas))
            actions = A.with_grad_sync(actions) if sync is not None else actions
        times = run(forward, self.link, actions, lambda i: self.act_spec(metas[i], groups[i]), sync,
                    handlers)
        self.sync_grads()
        if counts[4] == 0:
            self._drop_unused_image_grads()
        return self._share_loss(loss_total) / global_tokens, counts[1:4], n_micro, times

    @traced("hcp.grad_sync")
    def sync_grads(self) -> None:
        """Sum the gradients over DP x CP after the backward passes: the buckets not launched
        during the last backward (all of them when no schedule armed the reducer), then the
        sums (`GradReducer.finish`). Nothing under FSDP (its backward reduce-scatters) or on a
        DP x CP group of one."""
        if self.reducer is not None:
            self.reducer.finish()

    def _share_loss(self, loss_total: torch.Tensor) -> torch.Tensor:
        """Sum over DP x CP on the last stage (each CP rank holds part of the loss), then give
        it to every stage (a device tensor: no host read here)."""
        dist.all_reduce(loss_total, group=self.grad_group)
        if self.stage.num_stages > 1:
            dist.broadcast(loss_total, self.last_rank, group=self.pp_group)
        return loss_total

    def _drop_unused_image_grads(self) -> None:
        """No image anywhere in the global batch: the encoder and projector got no gradient on
        any rank (only the zeros of the `GradReducer`, or FSDP's reduce-scatter of unused
        parameters). Set them to None, as in one process, so AdamW leaves them untouched."""
        for name in ("vision", "projector"):
            module = getattr(self.model, name, None)
            for p in module.parameters() if module is not None else ():
                p.grad = None

    def forward_outputs(self, batches, head) -> list:
        """Evaluation through the pipeline: `head(batch, hidden)` of every micro-batch, computed
        on the last stage and broadcast to every stage (a tensor each). Every stage passes the
        same number of `batches`; the first stage's are the ones run (the others get their
        metadata from it, as in training)."""
        metas = self._metas(batches if self.stage.first else None, len(batches))
        src = batches if self.stage.first else metas
        outs = forward_only(lambda i, x: self.stage_forward(src[i], x, head), self.link, len(metas),
                            lambda i: self.act_spec(metas[i]))
        if self.stage.num_stages == 1:
            return outs
        shared = []
        for i, batch in enumerate(batches):
            size = torch.tensor(outs[i].numel() if outs else 0, device=self.device)
            dist.broadcast(size, self.last_rank, group=self.pp_group)
            out = (outs[i].flatten().to(self.device, torch.float64) if outs
                   else torch.empty(int(size), dtype=torch.float64, device=self.device))
            dist.broadcast(out, self.last_rank, group=self.pp_group)
            shared.append(out)
        return shared


def plan_counts(mine, counted) -> list[float]:
    """The plan's global [loss tokens, tokens, sum of squared document lengths] of this rank's
    `RankPlan` `mine`, checked against the loss tokens the schedule counted (`counted`, under
    `trainer.check_counts` with a collective; else the plan's). Raises RuntimeError when they
    differ (a stale length index)."""
    c = mine.counts
    if counted[0] != c.loss_tokens:
        raise RuntimeError(f"the step plan counts {c.loss_tokens} loss tokens, the micro-batches "
                           f"{counted[0]:.0f}: the length index is stale")
    return [float(c.loss_tokens), float(c.tokens), c.sum_sq_lengths]
