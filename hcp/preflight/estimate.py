"""The LLM's step terms that `hcp.preflight.auto_cost` prices layouts with (plan mode and
`layout=auto` alike: `auto_cost.price_step`), from the dynamic-CP cost model and the 1F1B
pipeline simulator (the ones `packing=dynamic_cp`'s planner uses: `hcp.dcp.cost_model`,
`hcp.schedule.simulator`); `estimate_step` is the LLM-only estimate on a fixed length sample
that benchmarks compare layouts with.

What `estimate_step` assumes:
- the batch: `trainer.global_batch_size` sequence lengths drawn (seed 0) from the shipped sample
  of FlexSP's published Wikipedia lengths (`hcp/data/lengths/wikipedia_sample.txt`: mean ~1K,
  long tail), clipped to `data.max_seq_len`; the same lengths for every layout of a config, so
  a sweep compares layouts on one batch;
- the hardware: the shipped H100 profile (`hcp/dcp/profiles/h100.yaml`: BF16 peak, achieved
  matmul/attention efficiencies, NVLink/InfiniBand bandwidths), with `cluster.gpus_per_node`
  ranks per node;
- the LLM only (the cost model of the run's `llm`, its tp, pp and `pp_layers`): the encoder and
  projector are not timed; `llm.layout.recompute` as the cost model prices it (full: one more
  forward in backward; selective: the attention core's forward again);
- packing: the policy training runs (`hcp.plan.policies`): `first_fit` packs each DP lane's
  samples into micro-batches of `micro_batch_tokens * cp` tokens, each on the layout's CP group;
  `dynamic_cp` runs the solver over the whole CP pool (dp * cp ranks, `hcp.dcp.policy` under
  `packing_profile`);
- TP of size t: the cost model divides compute and CP traffic by t; the estimate adds TP's own
  two ring all-reduces of the activations per layer forward (`2 (t-1)/t * tokens/c * h * 2 B`),
  the same again in backward and once more under full recompute, over NVLink inside a node,
  InfiniBand across (the analytic profile's matmul efficiency does not include them);
- the gradient all-reduce over each stage's DP x CP group (fp32 gradients of the stage's
  parameters / t, ring: `2 (n-1)/n` of them per rank) follows the pipeline, not overlapped.
Step time = simulated 1F1B iteration + gradient sync; bubble = 1 - mean stage busy time / the
iteration; TFLOPS/GPU = model FLOPs of the batch (3 x forward, `CostModel.model_flops`) / step
time / world size.
"""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np

from hcp.dcp.cost_model import CostModel
from hcp.dcp.hardware import HardwareProfile, load_profile
from hcp.dcp.packing import Packing, Round
from hcp.plan.policies import first_fit_policy
from hcp.schedule.simulator import simulate_1f1b

LENGTHS = Path(__file__).resolve().parents[1] / "data" / "lengths" / "wikipedia_sample.txt"


@functools.lru_cache(maxsize=1)
def _sample() -> np.ndarray:
    return np.loadtxt(LENGTHS, dtype=np.int64, ndmin=1)


def batch_lengths(cfg) -> np.ndarray:
    """The estimate's global batch: `trainer.global_batch_size` lengths (tokens, int64) drawn
    with seed 0 from `LENGTHS`, clipped to `data.max_seq_len`."""
    sample = _sample()
    picked = np.random.default_rng(0).choice(sample, size=int(cfg.trainer.global_batch_size))
    return np.clip(picked, 1, int(cfg.data.max_seq_len))


def hardware(cfg, profile: str = "h100") -> HardwareProfile:
    """The hardware profile `profile` with `cluster.gpus_per_node` ranks per node (when a
    power of two)."""
    hw = load_profile(profile)
    g = int(cfg.cluster.gpus_per_node)
    return dataclasses.replace(hw, ranks_per_node=g) if g & (g - 1) == 0 else hw


def cost_model(cfg, lay, hw: HardwareProfile) -> CostModel:
    """The LLM's cost model under the layout `lay` (its tp, pp, pp_layers, recompute)."""
    return CostModel(cfg.llm, hw, pp=lay.pp, tp=lay.tp, recompute=lay.recompute,
                     pp_layers=list(lay.pp_layers))


def pool_plans(cfg, lay, lens=None) -> list[tuple[Packing, np.ndarray]]:
    """The plans of the CP pools (one per DP lane under first_fit, one pool under dynamic_cp),
    each with its lengths, from the packing policy training runs; one micro-batch per round.
    `lens`: the global batch's lengths (default `batch_lengths`). The layout's recompute enters
    only as the planner prices it (`hcp.dcp.policy.planned_recompute`)."""
    lens = batch_lengths(cfg) if lens is None else lens
    m = int(cfg.trainer.micro_batch_tokens)
    if cfg.packing == "dynamic_cp":
        from hcp.dcp.policy import dynamic_cp_policy

        return [(dynamic_cp_policy(cfg.llm, cfg.packing_profile)(lens, lay, m), lens)]
    plan = first_fit_policy(lens, lay, m)  # each lane its own pipeline
    return [(Packing([Round([r.groups[lane]]) for r in plan.rounds if r.groups[lane].seq_indices]),
             lens)
            for lane in range(lay.dp)]


def _tokens_per_rank(plan: Packing, lens: np.ndarray) -> np.ndarray:
    """[R] the largest tokens per rank of any group of each round."""
    return np.array([max((lens[g.seq_indices].sum() / g.cp_size for g in r.groups if g.seq_indices),
                         default=0.0) for r in plan.rounds])


def ring_s(nbytes, ranks: int, span: int, hw: HardwareProfile) -> np.ndarray:
    """Seconds of a ring all-reduce of `nbytes` over `ranks` ranks spread over `span`
    consecutive ranks (NVLink inside a node, InfiniBand across)."""
    bw = hw.nvlink_bandwidth if span <= hw.ranks_per_node else hw.ib_bandwidth
    return 2 * (ranks - 1) / ranks * np.asarray(nbytes, dtype=np.float64) / bw


def grad_sync_s(lay, stage_params: list[int], hw: HardwareProfile) -> float:
    """Seconds of the gradient all-reduce of one rank of the busiest stage of `lay` (fp32
    gradients over its DP x CP group; NVLink when the group fits in a node)."""
    ranks = lay.dp * lay.cp
    return float(ring_s(max(stage_params) * 4, ranks, ranks * lay.tp, hw)) if ranks > 1 else 0.0


def estimate_step(cfg, lay, world: int, stage_params: list[int], profile: str = "h100") -> dict:
    """Estimated step of the LLM layout `lay` (a `ResolvedLayout`) in a world of `world` ranks;
    `stage_params` are the parameters one rank of each PP stage holds (after TP); `profile`:
    the hardware profile (`hcp.dcp.hardware.load_profile`).

    Returns {step_time_s, tflops_per_gpu, bubble_fraction, micro_batches, grad_sync_s}
    (seconds, TFLOP/s per GPU, a fraction in [0, 1)); see the module doc for the assumptions."""
    cost = cost_model(cfg, lay, hardware(cfg, profile))
    lanes = lane_stage_times(cfg, lay, cost)
    runs = [(simulate_1f1b(fwd, bwd), plan) for plan, fwd, bwd in lanes]
    timeline, plan = max(runs, key=lambda r: r[0].iteration_time)  # lanes wait for the slowest
    busy = np.array([timeline.busy(s) for s in range(lay.pp)])
    grad_sync = grad_sync_s(lay, stage_params, cost.hw)
    step = timeline.iteration_time + grad_sync
    flops = cost.model_flops(batch_lengths(cfg))
    return {"step_time_s": step, "tflops_per_gpu": flops / step / world / 1e12,
            "bubble_fraction": float(1 - busy.mean() / timeline.iteration_time),
            "micro_batches": plan.num_rounds, "grad_sync_s": grad_sync}


def lane_stage_times(cfg, lay, cost: CostModel, lens=None,
                     pools=None) -> list[tuple[Packing, np.ndarray, np.ndarray]]:
    """[(plan, fwd, bwd)] of each CP pool (one per DP lane under first_fit): its micro-batches
    and their forward / backward seconds per PP stage, `[pp, R]`, TP's all-reduces included.
    `lens`: the global batch's lengths (default `batch_lengths`); `pools`: `pool_plans`' result
    for them (default: planned here)."""
    pools = pool_plans(cfg, lay, lens) if pools is None else pools
    return [(plan, *_stage_times(cfg, lay, cost, plan, lens)) for plan, lens in pools]


def _stage_times(cfg, lay, cost: CostModel, plan: Packing, lens: np.ndarray):
    """(fwd, bwd) `[pp, R]` seconds of one CP pool's plan under TP."""
    fwd, bwd = cost.stage_times(plan, lens)  # [pp, R] seconds, per-micro-batch overhead included
    hw, t = cost.hw, lay.tp
    if t > 1:
        layers = np.asarray(lay.pp_layers, dtype=np.float64)
        act = _tokens_per_rank(plan, lens) * cfg.llm.hidden_size * hw.bytes_per_element  # [R] bytes
        comm = 2 * layers[:, None] * ring_s(act, t, t, hw)[None, :]
        recompute = 1.0 if cost.recompute == "full" else 0.0  # the core has no TP collective
        fwd = fwd + comm
        bwd = bwd + (1 + recompute) * comm
    return fwd, bwd
