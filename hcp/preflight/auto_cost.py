"""Step time and memory of one `layout=auto` candidate (hcp.preflight.auto_space.Candidate), from plan
mode's models: the per-rank memory of `hcp.preflight.memory` (under `hcp.preflight.plan_mode.running_layouts`)
and the LLM's cost model and 1F1B simulator of `hcp.preflight.estimate`. Pure: no process group.

Each encoder (`vision`, every `encoders.<name>`, with its projectors; `hcp.model.flops.
encoder_flops`) runs at the profile's peak x matmul efficiency per rank, divided by its tp;
under encoder CP c each rank computes its k = ceil(tokens / c) positions of every input (a k /
tokens share of its FLOPs) and receives K and V of the other (c - 1) x k positions per block
(the all-gather forward, the reduce-scatter of their gradients backward, not overlapped; the
profile's `cp_latency` per ring step), plus TP's two ring all-reduces of its positions'
activations per block forward (two more backward, two more under full recompute, which also
adds one forward); its route carries, per input, its streams' rows of `llm.hidden_size`
elements forward and the same gradient backward.
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
data). CPU ranks sharing a host's cores (a profile's `host:` entry, `Host`): each layer call
costs the host's dispatch seconds more, and the step is the larger of the critical path and
all ranks' CPU seconds (`Score.work_s`) over the cores. For the search's pruning,
`combine_bounds` of `encoder_part` and `llm_part` (or the cheaper `llm_bound`) is at most
`score`'s step (equal under colocated without a host).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
from omegaconf import OmegaConf

from hcp.config.errors import ConfigError
from hcp.config.specs import resolve_modules
from hcp.dcp.hardware import read_profile
from hcp.dcp.policy import several_per_round
from hcp.config.modules import patches
from hcp.model.flops import encoder_flops, model_flops
from hcp.parallel.encoder_cp import LEAD, chunk
from hcp.schedule.simulator import simulate_1f1b
from hcp.preflight.estimate import batch_lengths, cost_model, grad_sync_s, hardware, lane_stage_times, ring_s
from hcp.preflight.auto_space import Candidate, projector_for, sides
from hcp.preflight.memory import GIB, module_memory, rank_activations, stage_params
from hcp.preflight.plan_mode import named_shapes, running_layouts

FSDP_SYNC = 1.5
"""Gradient sync under dp_shard relative to the plain all-reduce (module docstring)."""


@dataclass(frozen=True)
class Host:
    """CPU ranks sharing one host's cores (a profile's `host:` entry, e.g. benchmarks/
    cpu_profile.yaml; accelerator profiles have none): the step is the larger of the critical
    path (a rank runs on at most one core: divided by min(1, cores)) and the CPU seconds of all
    ranks over the cores. `cores`: cores the ranks share (a loaded host: the share they get);
    `layer_s`: CPU seconds of one layer's forward + backward call on one rank beyond its FLOPs
    (Python and dispatch; a third of it forward), the LLM's, the encoder's and the projector's
    (one layer) alike; `cp_layer_s`: CPU seconds more per LLM layer call under CP (c > 1: its
    collectives' calls; the profile's `cp_latency` prices each ring step); `module_step_s`: CPU
    seconds per step of each module a rank holds (its gradient sync calls, optimizer, norm)."""

    cores: float
    layer_s: float
    cp_layer_s: float
    module_step_s: float


def host_model(profile) -> Host | None:
    """The `host:` entry of the profile file `profile` (None for `h100` or without one).
    Raises ConfigError naming `packing_profile` for a malformed entry."""
    if str(profile) == "h100":
        return None
    entry = read_profile(profile).get("host")
    if entry is None:
        return None
    try:
        host = Host(**entry)
        if not (host.cores > 0 and min(host.layer_s, host.cp_layer_s, host.module_step_s) >= 0):
            raise ValueError("cores > 0 and the seconds >= 0")
    except (TypeError, ValueError) as e:
        raise ConfigError("packing_profile", str(profile), f"its host: entry {entry} is invalid ({e})",
                          "give host: {cores: N, layer_s: S, cp_layer_s: S, module_step_s: S}") from None
    return host


@dataclass(frozen=True)
class Score:
    """A candidate's estimate: seconds, TFLOP/s per GPU, GiB per role (`vision`, `llm`;
    colocated: `all`), bytes of both routes per step, the critical module and why; `work_s`
    the busy seconds of all ranks together (on a `Host`, CPU seconds)."""

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
        batch = GlobalBatchSampler(len(train), int(cfg.trainer.global_batch_size), int(cfg.seed)).batch(0)
    except (ConfigError, DataError, OSError, ValueError) as e:
        return batch_lengths(cfg), f"the built-in length sample ({type(e).__name__} reading the data: {e})"
    return np.array([len(train[i].input_ids) for i in batch], dtype=np.int64), f"data.name={cfg.data.name}"


def encoder_cp_share(flops: float, tokens: int, blocks: int, hidden: int, cp: int, tp: int = 1,
                     bytes_per_element: float = 4) -> tuple[float, float]:
    """(training FLOPs, K/V bytes received per pass) of one encoder input on one rank under
    encoder CP size `cp` and TP size `tp` (`hcp.parallel.encoder_cp`): its k = ceil(tokens / cp)
    positions' share of the input's `flops`, over tp; per block, the K and V of the other
    (cp - 1) x k positions (2 x hidden / tp elements each) that the forward all-gathers, and as
    many bytes of their gradients that the backward reduce-scatters back. The one source of
    these terms for the estimate (`Scorer`) and benchmarks/encoder_floor.py."""
    k = chunk(tokens, cp)
    return flops * k / tokens / tp, blocks * (cp - 1) * k * 2 * hidden / tp * bytes_per_element


def _key(lay) -> tuple:
    return (lay.module, lay.tp, lay.cp, lay.pp, lay.dp, lay.pp_layers, lay.recompute, lay.dp_shard)


@dataclass(frozen=True)
class Encoder:
    """What the estimate reads of one encoder (`Scorer.encoders`): training FLOPs of one input
    (the ViT and one projector, `encoder_flops`), tokens per input (patches + CLS), blocks run,
    layer calls per pass (the blocks and the projector, as `cpu_profile.yaml`'s host model was
    fitted), width, and the rows its streams route into the LLM per input (`ModuleSpecs.rows`,
    summed over its projectors)."""

    flops: float
    tokens: int
    blocks: int
    layers: int
    hidden: int
    rows: int


class Scorer:
    """Scores candidates of one config on `world` ranks under the hardware `profile`, caching
    what candidates share (a module's memory, the LLM's simulated lanes)."""

    def __init__(self, cfg, world: int, profile: str = "h100", lengths=None):
        self.world = world
        self.specs = resolve_modules(cfg)  # the modules of every candidate (layouts are the candidates')
        self.shapes = named_shapes(self.specs)
        self.lens, self.lengths_from = data_lengths(cfg, self.specs) if lengths is None else (lengths, "given")
        cfg = self.cfg = plain(OmegaConf.to_container(cfg, resolve=True))
        self.hw = hardware(cfg, profile)
        self.host = host_model(profile)
        self.cap = float(cfg.cluster.device_memory_gib)
        self._cfgs, self._memory, self._llm, self._params, self._plans = {}, {}, {}, {}, {}
        lens = self.lens.astype(np.float64)
        self.llm_flops = model_flops(cfg.llm, float(lens.sum()), float((lens ** 2).sum()))
        self.images = float(cfg.trainer.global_batch_size) * float(cfg.data.images_per_sample)
        self.sides = sides(cfg)
        self.encoders = {}
        for side in self.sides:
            a = self.specs[side.encoder].arch
            blocks = a.num_layers + a.select_layer + 1
            rows = sum(self.specs.rows(s) for s in self.specs.streams if s.encoder == side.encoder)
            self.encoders[side.encoder] = Encoder(encoder_flops(a, cfg.llm.hidden_size, 1), patches(a) + LEAD,
                                                  blocks, blocks + 1, a.hidden_size, rows)

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
        """{role: GiB} of the candidate's largest rank per role (module docstring)."""
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
                self._memory[key] = module_memory(cfg, self.specs, lay, self.shapes[m], running, self._stage_params(lay))
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
            out[side.encoder] = max(total([s] + ([stages[q][0] for q in side.projectors] if i == last else []))
                                    for i, s in enumerate(stages[side.encoder]))
        return {**out, "llm": max(total([s]) for s in stages["llm"])}

    def _llm_lane(self, llm):
        """(iteration seconds, fwd, bwd, plan) of the LLM layout's slowest lane (`[pp, R]` s),
        and the busy seconds of all its ranks (the `Host`'s layer calls included)."""
        key = self._lane_key(llm)
        if key not in self._llm:
            calls = self._calls(np.asarray(llm.pp_layers, dtype=np.float64)[:, None], llm.cp > 1)
            lanes = [(f + calls[0], b + calls[1], plan) for plan, f, b in self._lane_times(llm)]
            runs = [(simulate_1f1b(f, b, record=False).iteration_time, f, b, plan) for f, b, plan in lanes]
            work = sum(float((f + b).sum()) for f, b, _ in lanes) * llm.tp * llm.cp
            self._llm[key] = (*max(runs, key=lambda r: r[0]), work)  # lanes wait for the slowest
        return self._llm[key]

    def _lane_times(self, llm) -> list:
        """`lane_stage_times` of the LLM layout, computed once per plan: under `packing=
        dynamic_cp` the planner (`hcp.dcp.policy`) sees the pool dp * cp, not its split."""
        key = (llm.tp, llm.pp, llm.pp_layers, llm.recompute == "full")
        if self.cfg.packing == "dynamic_cp":
            key += (llm.dp * llm.cp, several_per_round(llm))
        else:
            key += (llm.cp, llm.dp)
        if key not in self._plans:
            self._plans[key] = lane_stage_times(self.cfg, llm, cost_model(self.cfg, llm, self.hw), self.lens)
        return self._plans[key]

    def _calls(self, layers, cp: bool = False) -> tuple:
        """(forward, backward) CPU seconds of calling `layers` layers once on a `Host` (0
        without); `cp`: LLM layers under CP."""
        per = (self.host.layer_s + (self.host.cp_layer_s if cp else 0.0)) if self.host else 0.0
        each = per * np.asarray(layers, dtype=np.float64)
        return each / 3, 2 * each / 3

    def _encoder_calls(self, enc, share=1.0) -> tuple:
        """(forward, backward) seconds of one pass of `share` (a fraction, or an array of them)
        of the encoder layout `enc`'s layers that do not grow with its inputs: the `Host`'s
        layer calls and, under encoder CP, each block's collective calls (the host's
        `cp_layer_s`) and ring steps (`cp_latency` x (cp - 1), twice backward)."""
        e = self.encoders[enc.module]
        f, b = self._calls(np.asarray(share, dtype=np.float64) * e.layers)
        if enc.cp > 1:
            blocks = np.asarray(share, dtype=np.float64) * e.blocks
            host = self.host.cp_layer_s if self.host else 0.0
            f = f + blocks * (host / 3 + self.hw.cp_latency * (enc.cp - 1))
            b = b + blocks * (2 * host / 3 + 2 * self.hw.cp_latency * (enc.cp - 1))
        return f, b

    def has_lane(self, llm) -> bool:
        """Whether `llm_part` of this LLM layout is known without simulating."""
        return self._lane_key(llm) in self._llm

    @staticmethod
    def _lane_key(llm) -> tuple:
        """What `_llm_lane` depends on: the layout less its dp_shard beyond the planner's
        `several_per_round`, and its recompute beyond full or not."""
        return _key(llm)[1:6] + (llm.recompute == "full", several_per_round(llm))

    def sync(self, lay) -> float:
        """Gradient sync seconds of a module's layout (module docstring)."""
        return grad_sync_s(lay, self._stage_params(lay), self.hw) * (FSDP_SYNC if lay.dp_shard else 1.0)

    def _side_sync(self, enc) -> float:
        """Gradient sync seconds of an encoder's layout and its projectors' (`projector_for`)."""
        side = next(s for s in self.sides if s.encoder == enc.module)
        return self.sync(enc) + sum(self.sync(projector_for(enc, q)) for q in side.projectors)

    def _stage_params(self, lay) -> list[int]:
        """`hcp.preflight.memory.stage_params` of a layout, computed once per module, tp and split."""
        key = (lay.module, lay.tp, lay.pp_layers)
        if key not in self._params:
            vocab = self.cfg.llm.vocab_size if lay.module == "llm" else None
            self._params[key] = stage_params(self.shapes[lay.module], lay, vocab)
        return self._params[key]

    def _image_s(self, enc) -> tuple[float, float]:
        """(forward, backward) seconds of one input on one rank of the encoder layout `enc` (and
        its projector): its FLOPs at the profile's rate over tp, each CP rank computing its
        k = ceil(tokens / cp) positions (`hcp.parallel.encoder_cp`); TP's two ring all-reduces
        of the k positions' activations per block; encoder CP's all-gather of K and V per
        block ((cp - 1) x k positions of 2 x width / tp elements received, not overlapped) and
        the reduce-scatter of their gradients backward; full recompute repeats the forward's."""
        hw, e = self.hw, self.encoders[enc.module]
        k = chunk(e.tokens, enc.cp)
        flops, kv_bytes = encoder_cp_share(e.flops, e.tokens, e.blocks, e.hidden, enc.cp, enc.tp, hw.bytes_per_element)
        fwd = flops / 3 / (hw.peak_flops * hw.matmul_efficiency)
        bwd = 2 * fwd + (fwd if enc.recompute == "full" else 0.0)
        comm = 0.0
        if enc.tp > 1:
            comm += 2 * e.blocks * float(ring_s(k * e.hidden * hw.bytes_per_element, enc.tp, enc.tp, hw))
        if enc.cp > 1:
            bw = hw.nvlink_bandwidth if enc.tp * enc.cp <= hw.ranks_per_node else hw.ib_bandwidth
            comm += kv_bytes / bw
        return fwd + comm, bwd + comm * (2 if enc.recompute == "full" else 1)

    def _route_s(self, images, rows: int) -> float:
        """Seconds of one direction of the route of `images` inputs' `rows` rows each (one rank's share)."""
        bw = self.hw.nvlink_bandwidth if self.world <= self.hw.ranks_per_node else self.hw.ib_bandwidth
        return images * rows * self.cfg.llm.hidden_size * self.hw.bytes_per_element / bw

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

    def _colocated_encoder_s(self, enc) -> float:
        """Seconds of the colocated phases of one encoder: its lane's inputs forward and backward."""
        f, b = self._image_s(enc)
        return self.images / enc.dp * (f + b) + float(sum(self._encoder_calls(enc)))

    def encoder_part(self, encoders, placement: str) -> float:
        """The encoder side's share of a step bound (`encoders`: one layout per encoder):
        colocated its phases and routes on one rank, one encoder after the other; non_colocated
        the busiest stage of any island (routes on the last); plus their gradient syncs."""
        if placement == "colocated":
            rows = sum(self.encoders[e.module].rows for e in encoders)
            return (sum(self._colocated_encoder_s(e) + self._side_sync(e) for e in encoders)
                    + 2 * self._route_s(self.images / self.world, rows))
        out = 0.0
        for enc in encoders:
            f, b = self._image_s(enc)
            images = self.images / enc.dp
            share = np.asarray(enc.pp_layers, dtype=np.float64) / sum(enc.pp_layers) * images * (f + b)
            share[-1] += 2 * self._route_s(images, self.encoders[enc.module].rows)
            out = max(out, float(share.max()) + self._side_sync(enc))
        return out

    def llm_memory(self, llm) -> float:
        """GiB of the LLM's largest stage alone: below any rank memory of a candidate with it."""
        return max(self.memory(_llm_only(llm)).values())

    def _island_stages(self, enc, per) -> tuple[np.ndarray, np.ndarray, float]:
        """(forward, backward `[pp_e, R]` seconds, busy seconds of all its ranks) of an encoder
        island's stages over the LLM lane's R rounds, `per` `[R]` inputs each (routes on the last)."""
        fi, bi = self._image_s(enc)
        share = np.asarray(enc.pp_layers, dtype=np.float64)[:, None] / sum(enc.pp_layers)
        ef, eb = share * per[None, :] * fi, share * per[None, :] * bi
        calls = self._encoder_calls(enc, share * (per[None, :] > 0))
        ef, eb = ef + calls[0], eb + calls[1]
        work = float(np.sum(ef + eb)) * enc.tp * enc.cp * enc.dp
        route = np.array([self._route_s(n, self.encoders[enc.module].rows) for n in per])
        ef[-1] += route
        eb[-1] += route
        return ef, eb, work

    def score(self, cand) -> Score:
        """The candidate's estimated step, throughput and memory (module docstring)."""
        lays = cand.by_module
        llm = lays["llm"]
        encoders = [lays[s.encoder] for s in self.sides]
        iteration, f, b, plan, llm_work = self._llm_lane(llm)
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
            why = (f"colocated phases run one after the other: encoder{'s' if len(each) > 1 else ''} "
                   f"{enc_s:.3g} s + routes {route_s:.3g} s + LLM 1F1B {iteration:.3g} s + gradient sync {sync:.3g} s")
        else:
            samples = np.array([sum(len(g.seq_indices) for g in r.groups) for r in plan.rounds], dtype=np.float64)
            islands = [self._island_stages(e, samples * float(self.cfg.data.images_per_sample) * llm.dp / e.dp)
                       for e in encoders]
            depth = max(e.pp for e in encoders)  # islands run side by side: stage s waits for the slowest
            ef, eb = (np.max([np.vstack([np.zeros((depth - len(x[k]), len(samples))), x[k]]) for x in islands],
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
                e = int(np.argmax([float(np.sum(x[0][s] + x[1][s])) if s >= 0 else -1.0 for x, s in zip(islands, own)]))
                critical, stage = encoders[e].module, own[e]
            why = (f"graph 1F1B over {depth} encoder + {llm.pp} LLM stages: the busiest stage is "
                   f"{critical} stage {stage} ({stage_busy[worst]:.3g} s busy of {iteration:.3g} s)")
        work = llm_work + llm_sync * llm.num_ranks + enc_work
        work += sum(s * e.num_ranks for s, e in zip(side_syncs, encoders))
        if self.host is not None:  # ranks time-share the cores: the step is at least their work / cores
            held = (len(lays) * self.world if cand.placement == "colocated" else llm.num_ranks
                    + sum((1 + len(s.projectors)) * lays[s.encoder].num_ranks for s in self.sides))
            work += held * self.host.module_step_s
            step /= min(1.0, self.host.cores)  # a rank runs on at most one core
            if work / self.host.cores > step:
                step, critical = work / self.host.cores, "host"
                why = (f"{self.world} ranks share {self.host.cores:g} cores: {work:.3g} CPU s of work / "
                       f"{self.host.cores:g} cores exceeds the critical path ({why})")
        flops = self.llm_flops + self.images * sum(e.flops for e in self.encoders.values())
        return Score(float(step), flops / step / self.world / 1e12, float(bubble), mem,
                     max(mem.values()) <= self.cap, float(route), float(enc_s),
                     float(iteration), float(sync), critical, why, float(work))


def combine_bounds(placement: str, encoder, llm):
    """A step bound from `Scorer.encoder_part` and `Scorer.llm_part` / `llm_bound` (scalars or
    arrays): colocated phases add up; islands overlap, so the slower one bounds the step."""
    return encoder + llm if placement == "colocated" else np.maximum(encoder, llm)


def _llm_only(llm) -> Candidate:
    return Candidate("colocated", (("llm", llm),))


class Plain(dict):
    """A read-only attribute view of a resolved config (`plain`): the memory and cost models
    read the config for every candidate, where OmegaConf's access costs would dominate."""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


def plain(node):
    """`node` (a resolved container: dicts, lists, scalars) with every dict a `Plain`."""
    if isinstance(node, dict):
        return Plain({k: plain(v) for k, v in node.items()})
    return [plain(v) for v in node] if isinstance(node, list) else node
