"""Step time and memory of one `layout=auto` candidate (hcp.preflight.auto_space.Candidate), from
plan mode's models: the per-rank memory of `hcp.preflight.memory` (under
`hcp.preflight.running.running_layouts`) and the LLM's cost model and 1F1B simulator of
`hcp.preflight.estimate`. Pure: no process group.

The encoders' terms (seconds per input, island stages, routes): `hcp.preflight.auto_encoders`;
the host model of CPU ranks: `hcp.preflight.auto_host`. The step:
- colocated (three phases one after the other): step = each encoder's forward + backward of
  one of its lanes' inputs, one encoder after the other, + both routes (each rank's share of
  the rows at the node's or the network's bandwidth) + the LLM's simulated 1F1B + the
  gradient syncs;
- non_colocated (graph-aware 1F1B: the encoders' stages before the LLM's): the LLM's slowest
  lane's micro-batches through the stacked stages (`hcp.schedule.simulator.simulate_1f1b`):
  an encoder stage's share of a micro-batch's inputs (`data.images_per_sample` per sample) is
  divided over the dp_e / dp_llm encoder lanes that feed one LLM lane, and the route of the
  micro-batch's rows is charged to the encoder's last stage; islands of several encoders run
  side by side, their stages aligned on the last (the LLM waits for the slowest island at
  each); step = that + the slowest island's gradient sync.
Gradient sync: `hcp.preflight.estimate.grad_sync_s`; `dp_shard` (FSDP) adds half of it again (the
weights' all-gathers). The batch priced: `data_lengths` (the run's first global batch of its own
data). CPU ranks sharing a host's cores (a profile's `host:` entry, `hcp.preflight.auto_host.
Host`): each layer call costs the host's dispatch seconds more, and the step is the larger of
the critical path and all ranks' CPU seconds (`Score.work_s`) over the cores (the LLM's long
stretches without a collective, `Score.stacked_s`, over the host's stacked cores). For the search's
pruning, `combine_bounds` of `encoder_part` and `llm_part` (or the cheaper `llm_bound`) is at most
`score`'s step (equal under colocated without a host).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
from omegaconf import OmegaConf

from hcp.config.errors import ConfigError
from hcp.config.specs import resolve_modules
from hcp.dcp.policy import planned_recompute, several_per_round
from hcp.model.flops import model_flops
from hcp.schedule.simulator import simulate_1f1b
from hcp.preflight.auto_encoders import EncoderTerms, encoder_terms
from hcp.preflight.auto_host import host_model, host_seconds, layer_calls, plain, stacked_seconds
from hcp.preflight.rehearse.report import job_facts, memory_correction
from hcp.preflight.estimate import (batch_lengths, cost_model, grad_sync_s, hardware,
                                    lane_stage_times, pool_plans)
from hcp.preflight.auto_space import Candidate, sides
from hcp.preflight.memory import GIB, fsdp_units, module_memory, rank_activations, stage_params
from hcp.preflight.running import named_shapes, running_layouts

FSDP_SYNC = 1.5
"""Gradient sync under dp_shard relative to the plain all-reduce (module docstring)."""


@dataclass(frozen=True)
class Score:
    """A candidate's estimate: seconds, TFLOP/s per GPU, GiB per role (`vision`, `llm`;
    colocated: `all`), bytes of both routes per step, the critical module and why; `work_s`
    the busy seconds of all ranks together (on a `Host`, CPU seconds), `stacked_s` those of
    them the host runs stacked (`hcp.preflight.auto_host.stacked_seconds`; 0 without)."""

    step_time_s: float
    tflops_per_gpu: float
    bubble_fraction: float
    memory_gib: dict
    fits: bool
    route_bytes: float
    encoder_s: float
    llm_s: float
    grad_sync_s: float
    critical: str
    why: str
    work_s: float = 0.0
    stacked_s: float = 0.0


def data_lengths(cfg, specs) -> tuple[np.ndarray, str]:
    """(lengths `[B]` tokens, where from) of the global batch the estimate prices: the run's
    first global batch of its own training set (the trainer's sampler and seed), or, when the
    data cannot be read here (a path only the cluster has), `hcp.preflight.estimate.batch_lengths`'
    built-in sample."""
    from hcp.data.build import build_datasets
    from hcp.data.llava import DataError
    from hcp.data.loader import GlobalBatchSampler

    try:
        train = build_datasets(cfg, specs)[1]
        batch = GlobalBatchSampler(len(train), int(cfg.trainer.global_batch_size),
                                   int(cfg.seed)).batch(0)
    except (ConfigError, DataError, OSError, ValueError) as e:
        return (batch_lengths(cfg),
                f"the built-in length sample ({type(e).__name__} reading the data: {e})")
    return (np.array([len(train[i].input_ids) for i in batch], dtype=np.int64),
            f"data.name={cfg.data.name}")


def _key(lay) -> tuple:
    return (lay.module, lay.tp, lay.cp, lay.pp, lay.dp, lay.pp_layers, lay.recompute, lay.dp_shard)


class Scorer(EncoderTerms):
    """Scores candidates of one config on `world` ranks under the hardware `profile`, caching
    what candidates share (a module's memory, the LLM's simulated lanes)."""

    def __init__(self, cfg, world: int, profile: str = "h100", lengths=None):
        self.world = world
        # the modules of every candidate (layouts are the candidates')
        self.specs = resolve_modules(cfg)
        self.shapes = named_shapes(self.specs)
        self.lens, self.lengths_from = (data_lengths(cfg, self.specs) if lengths is None
                                        else (lengths, "given"))
        cfg = self.cfg = plain(OmegaConf.to_container(cfg, resolve=True))
        self.hw = hardware(cfg, profile)
        self.host = host_model(profile)
        self.cap = float(cfg.cluster.device_memory_gib)
        self.correction = (memory_correction(cfg.rehearse.report, job_facts(cfg, self.specs, world))
                           if cfg.rehearse.get("report") else 1.0)
        self._cfgs, self._memory, self._llm, self._params, self._plans, self._times = ({}, {}, {},
                                                                                       {}, {}, {})
        lens = self.lens.astype(np.float64)
        self.llm_flops = model_flops(cfg.llm, float(lens.sum()), float((lens ** 2).sum()))
        self.images = float(cfg.trainer.global_batch_size) * float(cfg.data.images_per_sample)
        self.sides = sides(cfg)
        self.encoders = encoder_terms(cfg, self.specs, self.sides)

    def _cfg(self, placement: str, side_recompute: str | None):
        """The config with this placement and encoder recompute (what the memory model reads:
        `vision`'s, which every colocated encoder shares when there are several)."""
        key = (placement, side_recompute)
        if key not in self._cfgs:
            c = copy.deepcopy(self.cfg)
            c["placement"] = placement
            if side_recompute is not None:
                c.vision.layout["recompute"] = side_recompute
            self._cfgs[key] = c
        return self._cfgs[key]

    def memory(self, cand) -> dict:
        """{role: GiB} of the candidate's largest rank per role (module docstring), times the
        rehearsal's correction (`rehearse.report`, 1 without one)."""
        return {role: gib * self.correction for role, gib in self._estimate(cand).items()}

    def _estimate(self, cand) -> dict:
        """{role: GiB}: plan mode's memory model of the candidate's largest rank per role."""
        lays = cand.by_module
        vis = lays.get("vision")
        cfg = self._cfg(cand.placement, vis.recompute if vis else None)
        running = running_layouts(cfg, lays)
        llm = lays["llm"]
        stages = {}
        for m, lay in running.items():
            key = (cand.placement, vis.recompute if vis else None, _key(lay),
                   (llm.cp, llm.pp) if m != "llm" and cand.placement == "non_colocated" else None)
            if key not in self._memory:
                self._memory[key] = module_memory(cfg, self.specs, lay, self.shapes[m], running,
                                                  self._stage_params(lay), units=self._units(lay))
            stages[m] = self._memory[key]

        def total(parts):
            state = sum(p.weights + p.grads + p.optimizer for p in parts)
            return (state + rank_activations(parts)) / GIB

        if cand.placement == "colocated" or vis is None:
            side = [stages[m][0] for m in stages if m != "llm"]
            return {"all": max(total(side + [s]) for s in stages["llm"])}
        out = {}
        for side in self.sides:
            last = len(stages[side.encoder]) - 1
            out[side.encoder] = max(total([s] + ([stages[q][0] for q in side.projectors]
                                                 if i == last else []))
                                    for i, s in enumerate(stages[side.encoder]))
        return {**out, "llm": max(total([s]) for s in stages["llm"])}

    def _llm_lane(self, llm):
        """(iteration seconds, fwd, bwd, plan) of the LLM layout's slowest lane (`[pp, R]` s),
        the busy seconds of all its ranks (the `Host`'s layer calls included) and {placement:
        those of them in long stretches} (`_stacked`)."""
        key = self._lane_key(llm)
        if key not in self._llm:
            layers = np.asarray(llm.pp_layers, dtype=np.float64)[:, None]
            calls = layer_calls(self.host, layers, llm.cp > 1)
            lanes = [(f + calls[0], b + calls[1], plan) for plan, f, b in self._lane_times(llm)]
            runs = [(simulate_1f1b(f, b, record=False).iteration_time, f, b, plan)
                    for f, b, plan in lanes]
            work = sum(float((f + b).sum()) for f, b, _ in lanes) * llm.tp * llm.cp
            stacked = {p: self._stacked(llm, layers, lanes, p)
                       for p in ("colocated", "non_colocated")}
            # lanes wait for the slowest
            self._llm[key] = (*max(runs, key=lambda r: r[0]), work, stacked)
        return self._llm[key]

    def _stacked(self, llm, layers, lanes, placement: str) -> float:
        """`stacked_seconds` of all LLM ranks' compute, cut into the stretches between two
        blocking calls of the runtime: each layer call under TP or CP (their collectives); else
        each stage's micro-batch forward and backward under PP (its p2p receives); else, at
        pp 1, each micro-batch's forward + backward when islands send its encoder rows, and
        the lane's whole LLM phase when colocated (nothing blocks between its micro-batches)."""
        ranks = llm.tp * llm.cp
        if ranks > 1 or llm.pp > 1:
            n = layers if ranks > 1 else np.ones_like(layers)
            return ranks * sum(stacked_seconds(self.host, x / n, np.broadcast_to(n, x.shape))
                               for f, b, _ in lanes for x in (f, b))
        # [R] per lane: forward + backward of each micro-batch
        each = [(f + b)[0] for f, b, _ in lanes]
        return sum(stacked_seconds(self.host, x if placement == "non_colocated" else x.sum())
                   for x in each)

    def _lane_times(self, llm) -> list:
        """`lane_stage_times` of the LLM layout, each plan computed once: under `packing=
        dynamic_cp` the planner (`hcp.dcp.policy`) sees the pool dp * cp, not its split, and
        the recompute it prices (`planned_recompute`); each recompute times it."""
        pool = (llm.tp, llm.pp, llm.pp_layers, planned_recompute(llm.recompute))
        if self.cfg.packing == "dynamic_cp":
            pool += (llm.dp * llm.cp, several_per_round(llm))
        else:
            pool += (llm.cp, llm.dp)
        if pool not in self._plans:
            self._plans[pool] = pool_plans(self.cfg, llm, self.lens)
        key = pool + (llm.recompute,)
        if key not in self._times:
            cost = cost_model(self.cfg, llm, self.hw)
            self._times[key] = lane_stage_times(self.cfg, llm, cost, self.lens, self._plans[pool])
        return self._times[key]

    def has_lane(self, llm) -> bool:
        """Whether `llm_part` of this LLM layout is known without simulating."""
        return self._lane_key(llm) in self._llm

    @staticmethod
    def _lane_key(llm) -> tuple:
        """What `_llm_lane` depends on: the layout less its dp_shard beyond the planner's
        `several_per_round`."""
        return _key(llm)[1:7] + (several_per_round(llm),)

    def sync(self, lay) -> float:
        """Gradient sync seconds of a module's layout (module docstring)."""
        return (grad_sync_s(lay, self._stage_params(lay), self.hw)
                * (FSDP_SYNC if lay.dp_shard else 1.0))

    def _stage_params(self, lay) -> list[int]:
        """`hcp.preflight.memory.stage_params` of a layout, computed once per module, tp and
        split."""
        key = (lay.module, lay.tp, lay.pp_layers)
        if key not in self._params:
            vocab = self.cfg.llm.vocab_size if lay.module == "llm" else None
            self._params[key] = stage_params(self.shapes[lay.module], lay, vocab)
        return self._params[key]

    def _units(self, lay) -> list | None:
        """`hcp.preflight.memory.fsdp_units` of a `dp_shard` layout (None otherwise), computed
        once per module, tp and split."""
        if not lay.dp_shard:
            return None
        key = ("units", lay.module, lay.tp, lay.pp_layers)
        if key not in self._params:
            vocab = self.cfg.llm.vocab_size if lay.module == "llm" else None
            self._params[key] = fsdp_units(self.shapes[lay.module], lay, vocab)
        return self._params[key]

    def llm_bound(self, llm) -> float:
        """Seconds below `llm_part` without simulating: the LLM's FLOPs (4/3 under full
        recompute) over its ranks at the profile's best efficiency, plus its gradient sync."""
        factor = 4 / 3 if llm.recompute == "full" else 1.0
        eff = max(self.hw.matmul_efficiency, self.hw.attention_efficiency)
        return self.llm_flops * factor / (llm.num_ranks * self.hw.peak_flops * eff) + self.sync(llm)

    def llm_part(self, llm) -> float:
        """The LLM's share of a step bound (`combine_bounds`): its own 1F1B iteration plus its
        gradient sync, under either placement: stacking encoder stages before the LLM's keeps
        each LLM stage's 1F1B order (its warm-up counts only the stages after it) and only adds
        dependencies, so no LLM event of the graph pipeline comes earlier."""
        return self._llm_lane(llm)[0] + self.sync(llm)

    def llm_memory(self, llm) -> float:
        """GiB of the LLM's largest stage alone: below any rank memory of a candidate with it."""
        return max(self.memory(_llm_only(llm)).values())

    def score(self, cand) -> Score:
        """The candidate's estimated step, throughput and memory (module docstring)."""
        lays = cand.by_module
        llm = lays["llm"]
        encoders = [lays[s.encoder] for s in self.sides]
        iteration, f, b, plan, llm_work, stacked = self._llm_lane(llm)
        stacked = stacked[cand.placement]
        llm_sync = self.sync(llm)
        mem = self.memory(cand)
        busy = (f + b).sum(axis=1)  # each stage's seconds of compute
        rows = sum(e.rows for e in self.encoders.values())
        route = 2 * self.images * rows * self.cfg.llm.hidden_size * self.hw.bytes_per_element
        side_syncs = [self._side_sync(e) for e in encoders]
        if not encoders:
            step, enc_s, sync, route, enc_work = iteration + llm_sync, 0.0, llm_sync, 0.0, 0.0
            bubble = 1 - np.mean(busy) / iteration
            critical, why = "llm", "the LLM is the only module"
        elif cand.placement == "colocated":
            each = [self._colocated_encoder_s(e) for e in encoders]
            enc_s = sum(each)
            enc_work = enc_s * self.world
            route_s = 2 * self._route_s(self.images / self.world, rows)
            sync = llm_sync + sum(side_syncs)
            step = enc_s + route_s + iteration + sync
            bubble = 1 - (enc_s + route_s + np.mean(busy)) / (step - sync)
            critical = "llm" if iteration >= enc_s else encoders[int(np.argmax(each))].module
            why = (f"colocated phases run one after the other: "
                   f"encoder{'s' if len(each) > 1 else ''} {enc_s:.3g} s + routes {route_s:.3g} s "
                   f"+ LLM 1F1B {iteration:.3g} s + gradient sync {sync:.3g} s")
        else:
            samples = np.array([sum(len(g.seq_indices) for g in r.groups) for r in plan.rounds],
                               dtype=np.float64)
            islands = [self._island_stages(e, samples * float(self.cfg.data.images_per_sample)
                                           * llm.dp / e.dp)
                       for e in encoders]
            # islands run side by side: stage s waits for the slowest
            depth = max(e.pp for e in encoders)
            ef, eb = (np.max([np.vstack([np.zeros((depth - len(x[k]), len(samples))), x[k]])
                              for x in islands],
                             axis=0) for k in (0, 1))
            enc_work = sum(x[2] for x in islands)
            fs, bs = np.vstack([ef, f]), np.vstack([eb, b])
            iteration = simulate_1f1b(fs, bs, record=False).iteration_time
            sync = max(llm_sync, *side_syncs)
            step = iteration + sync
            stage_busy = (fs + bs).sum(axis=1)
            bubble = 1 - np.mean(stage_busy) / iteration
            enc_s = float(sum(np.sum(x[0] + x[1]) for x in islands))
            worst = int(np.argmax(stage_busy))
            critical, stage = "llm", worst - depth
            if worst < depth:  # the island busiest at that stage (its stages end at `depth`)
                own = [worst - depth + len(x[0]) for x in islands]
                e = int(np.argmax([float(np.sum(x[0][s] + x[1][s])) if s >= 0 else -1.0
                                   for x, s in zip(islands, own)]))
                critical, stage = encoders[e].module, own[e]
            why = (f"graph 1F1B over {depth} encoder + {llm.pp} LLM stages: the busiest stage is "
                   f"{critical} stage {stage} ({stage_busy[worst]:.3g} s busy of {iteration:.3g} "
                   f"s)")
        work = llm_work + llm_sync * llm.num_ranks + enc_work
        work += sum(s * e.num_ranks for s, e in zip(side_syncs, encoders))
        # ranks time-share the cores: the step is at least their work / cores
        if self.host is not None:
            held = (len(lays) * self.world if cand.placement == "colocated" else llm.num_ranks
                    + sum((1 + len(s.projectors)) * lays[s.encoder].num_ranks for s in self.sides))
            work += held * self.host.module_step_s
            step /= min(1.0, self.host.cores)  # a rank runs on at most one core
            shared = host_seconds(self.host, work, stacked)
            if shared > step:
                step, critical = shared, "host"
                why = (f"{self.world} ranks share {self.host.cores:g} cores: {work:.3g} CPU s of "
                       f"work ({stacked:.3g} of it stacked) take longer than the critical path "
                       f"({why})")
        flops = self.llm_flops + self.images * sum(e.flops for e in self.encoders.values())
        return Score(float(step), flops / step / self.world / 1e12, max(0.0, float(bubble)), mem,
                     max(mem.values()) <= self.cap, float(route), float(enc_s),
                     float(iteration), float(sync), critical, why, float(work), float(stacked))


def combine_bounds(placement: str, encoder, llm):
    """A step bound from `Scorer.encoder_part` and `Scorer.llm_part` / `llm_bound` (scalars or
    arrays): colocated phases add up; islands overlap, so the slower one bounds the step."""
    return encoder + llm if placement == "colocated" else np.maximum(encoder, llm)


def _llm_only(llm) -> Candidate:
    return Candidate("colocated", (("llm", llm),))


def price_step(cfg, layouts: dict, world: int, scorer: "Scorer | None" = None) -> Score:
    """THE priced step of one layout, shared by plan mode's estimate and `layout=auto` (its
    candidates and the given layout's row), so both print the same figures for the same layout:
    `Scorer.score` of the Candidate of `layouts` ({module: `ResolvedLayout`}, the config's
    placement and projectors) on `world` ranks, priced on `data_lengths` under
    `packing_profile` (`scorer`: one built for `cfg` already, else built here)."""
    from hcp.config.modules import projector_names
    from hcp.preflight.auto_space import Candidate

    scorer = scorer or Scorer(cfg, world, cfg.packing_profile)
    return scorer.score(Candidate(cfg.placement, tuple(layouts.items()), projector_names(cfg)))


def priced_on(scorer: "Scorer", cfg, here: bool = False) -> str:
    """The one statement of what a price assumes: the batch (`data_lengths`: how many samples,
    from where, their mean) and the hardware profile. `here`: the figures describe a run on
    this machine (`layout=auto` of a training run), so a GPU profile priced for a machine
    without a GPU says so."""
    lens = scorer.lens
    text = (f"the batch priced: {len(lens)} samples of {scorer.lengths_from}, mean "
            f"{lens.mean():.0f} tokens; hardware profile packing_profile={cfg.packing_profile}")
    if here and scorer.host is None:
        from hcp.launch.launch import cuda_device_count

        if cuda_device_count() == 0:
            text += (" (GPU figures: this machine has no GPU, so they are not this CPU run's; "
                     "packing_profile=hcp/dcp/profiles/gloo_llama_tiny.yaml prices CPU ranks)")
    return text
