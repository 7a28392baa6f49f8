"""`mode=calibrate`: fit the dynamic-CP cost model's coefficients to measured passes.

`python train.py +recipe=llama_tiny mode=calibrate` times real forward + backward passes of the
configured LLM (`llm.*`, one pipeline stage, no TP; in the run's `precision` and attention
backend, `calibration_backend`) on this machine over a grid of document
lengths L, documents per micro-batch d and CP sizes c (powers of two up to the local ranks and
`CALIBRATE_MAX_CP`; on CPU gloo ranks, each with one thread). The grid covers what plans run
under the per-rank cap m = `trainer.micro_batch_tokens` (`grid`): at each c, lengths from m / 4
to the longest a group of c holds (c m), each as one document and packed to the group's
capacity, so that no point lies outside the region the solver plans in. Then it fits
(`robust_nnls`: non-negative, Huber loss of the relative errors, so that every point weighs the
same and one disturbed timing cannot bend the fit) the per-rank model of hcp/dcp/cost_model.py
at pp = 1, with one attention coefficient b_c per CP size (the fused SDPA of c = 1 and CP
attention at c > 1 run different kernels) and one fixed cost e_c per micro-batch at each CP
size c > 1 (CP attention's calls and the collectives' set-up; a ring latency l (c - 1) fitted
short documents worse):
    time(T, S, c) = (1 + k) a T / c + (1 + k') (b_c S / c + g T (c - 1) / c + e_c) + o
with T = d L tokens, S = d L^2, k = 2 + [recompute is full] for the matmuls and k' = 2 +
[recompute is full or selective] for the attention core (its scores, K/V traffic and calls:
what selective recompute runs again, `CostModel.core_fwd`), and writes `profile.yaml` in the run
directory: a HardwareProfile (so `packing_profile=PATH` and `benchmarks/dynamic_cp.py --cost
PATH` load it) whose rates reproduce a, b_c, g, l, o for this model:
    matmul rate    = (layers * 2 P_layer + 2 h V) / a      FLOP/s
    attention rate = layers * 2 h / b_c                     FLOP/s at CP size c
    peak_flops = the largest rate; each efficiency = its rate / peak (attention_efficiency
                     at the smallest c, cp_attention_efficiency {c: ...} at every c > 1);
    bandwidth      = layers * 2 d_kv * bytes / g, comm_overlap 0, every group on
                     one "node" (ranks_per_node = the next power of two >= the grid's largest c);
    cp_overhead    = {c: e_c / layers}                      s per micro-batch and layer
                     (cp_latency 0: e_c holds the ring steps' latency too)
    overheads      o_f = o / (1 + k), o_b = o - o_f.
A coefficient fitted to 0 is written as a negligible cost: rate or bandwidth 1e18, overhead 0.
The YAML's `fit:` entry lists every point's measured and predicted seconds, relative error
and weight in the fit (small: an outlier), also printed with the errors by micro-batch kind
(`error_table`). Measured per rank: its busy time (`busy_time`: CPU time of the whole process on
CPU, wall time after `torch.cuda.synchronize` on GPU, lazy, untested here). Every CP size runs
on the whole pool (the largest size's ranks) split into groups of c that all run the point at
once, as training keeps every rank busy: on 2 shared CPU cores a rank alone runs 1.2-1.6x faster
than beside 7 others, which made small-c micro-batches look cheap (`measure`). The slowest rank
of a group counts, the median over groups, the least of `REPEATS` runs is kept. The H100 profile
(profiles/h100.yaml) stays the analytic defaults until someone runs this on H100.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import yaml

from hcp.config.precision import Precision
from hcp.model.flops import (head_flops_per_token, kv_dim, layer_attention_flops_per_sq_token,
                             layer_matmul_flops_per_token)

LENGTHS = (128, 256, 512, 1024)  # tokens per document
DOCS = (1, 4)  # documents per micro-batch
MIN_LENGTH = 32  # tokens: the shortest document of a capped grid
CALIBRATE_MAX_CP = 8
REPEATS = 3
NEGLIGIBLE = 1e18  # rate (FLOP/s) or bandwidth (bytes/s) written for a coefficient fitted to 0


def busy_time() -> float:
    """Seconds a CPU rank has worked: CPU time of its whole process, every thread
    (`time.process_time`), so that gloo's communication counts: torch's gloo backend runs each
    collective on its own worker and transport threads while the calling thread sleeps in
    `wait()`, so the caller's thread CPU time (`time.thread_time`) leaves the CP all-gather,
    reduce-scatter and ring send/recv out. Waiting for a slow peer does not count (a blocked
    gloo rank sleeps, it does not poll): this is the time the rank would keep its own core busy,
    compute plus the CPU work of moving its data."""
    return time.process_time()


def grid(max_tokens_per_rank: int | None = None, cp: int = 1) -> list[tuple[int, int]]:
    """(document length, documents) per point, tokens. Without a cap: `LENGTHS` x `DOCS`. With
    the per-rank cap m at CP size `cp`: lengths L = m / 4, m / 2, m, 2m, ..., cp * m (powers of
    two times m / 4, at least `MIN_LENGTH`), each as one document and as `cp * m // L`
    documents (the group's capacity: m tokens per rank, head-tail padding being zero for
    these L, multiples of 2 cp when m / 4 is a multiple of 2 cp)."""
    if max_tokens_per_rank is None:
        return [(L, d) for L in LENGTHS for d in DOCS]
    out, L = [], max(MIN_LENGTH, max_tokens_per_rank // 4)
    while L <= cp * max_tokens_per_rank:
        out += [(L, d) for d in dict.fromkeys((1, max(1, cp * max_tokens_per_rank // L)))]
        L *= 2
    return out


def typical_group(secs, c: int) -> float:
    """Seconds of a typical group: `secs[r]` per rank of a pool split into groups of c
    consecutive ranks; each group lasts as long as its slowest rank; the median over groups."""
    return float(np.median(np.asarray(secs, dtype=np.float64).reshape(-1, c).max(axis=1)))


def calibration_backend(cfg, device, pool: int) -> tuple[str, Precision]:
    """The attention backend and precision policy the run computes with (`precision`,
    `llm.attention_backend` resolved as the trainer resolves it: from `device`, the compute
    dtype and the largest CP group, the `pool`, as under `packing=dynamic_cp`). Calibrating
    in fp32 without autocast timed other kernels than training runs: on CUDA, fp32 CP
    attention takes the math kernel (`hcp.model.cp_kernels`), scores [n, Hq, Lq, Lk] in memory."""
    from hcp.model.backends import resolve_backend

    precision = Precision.of(cfg.precision)
    return resolve_backend(cfg.llm.attention_backend, device, precision.compute, pool,
                           dynamic=pool > 1), precision


def timed_pass(model, precision: Precision, device, x, pos, cu, max_len: int, seqlens) -> float:
    """Seconds of one forward + backward of `model` (x [T, H] fp32, the residual stream) in the
    run's precision (`precision.autocast`): busy time on CPU (`busy_time`), wall time between
    `torch.cuda.synchronize` calls on GPU."""
    import torch

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter() if cuda else busy_time()
    with precision.autocast(device.type):
        out = model(x, pos, cu, max_len, seqlens=seqlens)
        loss = model.logits(out).float().square().mean()
    loss.backward()
    if cuda:
        torch.cuda.synchronize(device)
    return (time.perf_counter() if cuda else busy_time()) - start


def _rank(payload) -> None:
    """One gloo/NCCL rank of the pool (the world: the largest CP size's ranks), split into
    groups of `payload["cp"]` consecutive ranks: every group times the grid at once (the pool as
    busy as in training), each as one CP group, in the run's precision and attention backend
    (`calibration_backend`); rank 0 writes `[[L, d, c, seconds], ...]` (per run the
    slowest rank of each group, the median over the groups; the least of REPEATS runs) to
    `payload["out"]`."""
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from hcp.model.llama import LlamaDecoder
    from hcp.parallel.cp_sharding import cp_shard
    from hcp.launch.distributed import init_distributed
    from hcp.parallel.groups import new_group

    cfg = OmegaConf.create(payload["cfg"])
    device = init_distributed(cfg.launcher)
    if device.type == "cpu":
        torch.set_num_threads(1)
    rank, pool, c = dist.get_rank(), dist.get_world_size(), payload["cp"]
    blocks = [new_group(range(b, b + c)) if 1 < c < pool else None
              for b in range(0, pool, c)]  # every rank creates every group, in one order
    group = dist.group.WORLD if c == pool > 1 else blocks[rank // c]
    torch.manual_seed(0)
    backend, precision = calibration_backend(cfg, device, pool)
    model = LlamaDecoder(cfg.llm, cp_group=group, attention_backend=backend).to(device)
    rows = []
    for L, d in payload["points"]:
        cu = torch.arange(d + 1, dtype=torch.int32) * L
        shard = cp_shard(cu, c, rank % c, device) if c > 1 else None
        n = shard.token_index.numel() if shard else d * L
        pos = shard.position_ids if shard else torch.arange(L).repeat(d)
        best = np.inf
        for _ in range(REPEATS + 1):  # the first run warms up
            x = torch.randn(n, cfg.llm.hidden_size, device=device, requires_grad=True)
            dist.barrier()
            secs = timed_pass(model, precision, device, x, pos.to(device), cu.to(device), L,
                              (L,) * d)
            every = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(pool)]
            dist.all_gather(every, torch.tensor([secs], dtype=torch.float64, device=device))
            best = min(best, typical_group(torch.cat(every).tolist(), c)) if _ else best
        rows.append([L, d, c, best])
    if rank == 0:
        Path(payload["out"]).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def measure(cfg, run_dir: str, sizes, max_tokens_per_rank: int | None = None
            ) -> list[list[float]]:
    """Every point of `grid(max_tokens_per_rank, c)` at every CP size c of `sizes`: rows
    `[L, d, c, seconds]`. Each size runs on a pool of `max(sizes)` ranks, split into groups of
    c that run at once: a micro-batch of c ranks is timed beside the others that share the
    machine in training (on CPU ranks the cores; on GPUs the links), not alone."""
    from omegaconf import OmegaConf

    from hcp.launch.launch import local_start_method, start_local_ranks

    container = OmegaConf.to_container(cfg, resolve=True)
    pool = max(sizes)
    rows = []
    for c in sizes:
        out = os.path.join(run_dir, f"calibrate_cp{c}.json")
        start_local_ranks(_rank, pool, {"cfg": container, "out": out, "cp": c,
                                        "points": grid(max_tokens_per_rank, c)},
                          local_start_method(cfg.launcher))
        rows += json.loads(Path(out).read_text())
    return rows


HUBER = 1.345
"""Huber threshold of the robust fit, in robust standard deviations of the relative errors."""
NOISE_FLOOR = 0.01
"""Relative error below which a point always keeps its full weight (timing noise)."""


def robust_nnls(X: np.ndarray, y: np.ndarray, iters: int = 30) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative x minimising the Huber loss of the RELATIVE errors `X x / y - 1` (every point
    weighs the same whatever its size; one disturbed timing, e.g. a rank that shared its core,
    cannot bend the fit): iteratively reweighted NNLS, scale = 1.4826 * median |error| (at least
    `NOISE_FLOOR`). Returns (x, final weights in (0, 1], small = treated as an outlier)."""
    from scipy.optimize import nnls

    scale = X.max(axis=0)
    scale[scale == 0] = 1.0
    A = X / scale / y[:, None]                                     # relative-error rows
    w = np.ones_like(y)
    for _ in range(iters):
        x, _ = nnls(A * w[:, None], w)
        r = np.abs(A @ x - 1.0)
        s = max(1.4826 * float(np.median(r)), NOISE_FLOOR)
        new = np.sqrt(np.minimum(1.0, HUBER * s / np.maximum(r, 1e-300)))  # sqrt: weights rows
        if np.allclose(new, w, rtol=1e-6, atol=1e-9):
            break
        w = new
    return x / scale, w ** 2


def fit(rows, llm, recompute: str, bytes_per_element: int, max_cp: int) -> dict:
    """Robust relative-error coefficients (`robust_nnls`) and the profile mapping (module
    docstring), with one attention coefficient b_c per CP size c of `rows` (`[L, d, c,
    seconds]`) measured under `recompute` (`none`, `selective` or `full`: the passes ran the
    matmuls 3 or 4 times and the attention core 3 or 4 times). Returns the profile mapping plus
    its `fit:` report. ValueError for another `recompute`."""
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute={recompute!r}: one of none, selective, full")
    arr = np.asarray(rows, dtype=np.float64)
    L, d, c, y = arr.T
    T, S = d * L, d * L * L
    sizes = sorted({int(x) for x in c})
    wide = [ci for ci in sizes if ci > 1]
    X = np.stack([T / c, *(S / c * (c == ci) for ci in sizes), T * (c - 1) / c,
                  *((c == ci).astype(np.float64) for ci in wide), np.ones_like(T)], axis=1)
    coef, weight = robust_nnls(X, y)
    k1 = 3.0 + float(recompute == "full")          # forward + backward passes of the matmuls
    k_core = 3.0 + float(recompute != "none")      # ... and of the attention core
    a, g = coef[0] / k1, coef[len(sizes) + 1] / k_core
    b = {ci: float(bi / k_core) for ci, bi in zip(sizes, coef[1:len(sizes) + 1])}
    e = {ci: float(ei / k_core) for ci, ei in zip(wide, coef[len(sizes) + 2:-1])}
    o = coef[-1]
    mm_flops = llm.num_layers * layer_matmul_flops_per_token(llm) + head_flops_per_token(llm)
    at_flops = llm.num_layers * layer_attention_flops_per_sq_token(llm)
    comm_bytes = llm.num_layers * 2 * kv_dim(llm) * bytes_per_element
    rate_mm = mm_flops / a if a > 0 else NEGLIGIBLE
    rate_at = {ci: at_flops / bi if bi > 0 else NEGLIGIBLE for ci, bi in b.items()}
    bw = comm_bytes / g if g > 0 else NEGLIGIBLE
    peak = max(rate_mm, *rate_at.values())
    pred = X @ coef
    profile = {
        "peak_flops": float(peak), "matmul_efficiency": float(rate_mm / peak),
        "attention_efficiency": float(rate_at[sizes[0]] / peak),
        "nvlink_bandwidth": float(bw), "ib_bandwidth": float(bw),
        "ranks_per_node": int(1 << max(0, int(max_cp - 1).bit_length())),
        "comm_overlap": 0.0, "micro_batch_overhead_fwd": float(o / k1),
        "micro_batch_overhead_bwd": float(o - o / k1), "bytes_per_element": int(bytes_per_element),
        "cp_latency": 0.0,
    }
    if wide:
        profile["cp_attention_efficiency"] = {ci: float(r / peak) for ci, r in rate_at.items()
                                              if ci > 1}
        profile["cp_overhead"] = {ci: ei / llm.num_layers for ci, ei in e.items()}
    profile["fit"] = {
        "model": "seconds = (1 + k) a T / c + (1 + k') (b_c S / c + g T (c - 1) / c + e_c) + o, "
                 f"recompute {recompute}, Huber loss of the relative errors",
        "coefficients": {"a": float(a), "b": b, "g": float(g), "e": e, "o": float(o)},
        "points": [{"length": int(li), "docs": int(di), "cp": int(ci), "measured_s": float(yi),
                    "predicted_s": float(pi), "rel_error": float(pi / yi - 1),
                    "weight": float(wi)}
                   for li, di, ci, yi, pi, wi in zip(L, d, c, y, pred, weight)],
    }
    return profile


def error_table(points) -> list[str]:
    """Mean and largest |relative error| of the fit's points by micro-batch kind (CP size; one
    document or packed to capacity), worst kind first: lines to print."""
    kinds: dict = {}
    for p in points:
        kinds.setdefault((p["cp"], "1 doc" if p["docs"] == 1 else "packed"), []).append(
            abs(p["rel_error"]))
    rows = sorted(kinds.items(), key=lambda kv: -max(kv[1]))
    return [f"{'cp':>3} {'kind':>6} {'points':>6} {'mean |err|':>10} {'max |err|':>9}"] + [
        f"{c:>3} {kind:>6} {len(e):>6} {100 * np.mean(e):9.1f}% {100 * max(e):8.1f}%"
        for (c, kind), e in rows]


def check_cap(max_tokens_per_rank: int) -> None:
    """ConfigError naming `trainer.micro_batch_tokens` when the grid at this cap (tokens per
    rank) is empty: its shortest document, `MIN_LENGTH`, would not fit a rank."""
    if not grid(max_tokens_per_rank):
        from hcp.config.errors import ConfigError

        raise ConfigError("trainer.micro_batch_tokens", max_tokens_per_rank,
                          f"the calibration grid's shortest document is {MIN_LENGTH} tokens, more "
                          "than a rank holds", f"use trainer.micro_batch_tokens>={MIN_LENGTH}")


def run_calibrate(cfg, run_dir: str, sizes=None, max_tokens_per_rank: int | None = None) -> str:
    """Measure at the CP sizes `sizes` (default: powers of two up to the local ranks and
    CALIBRATE_MAX_CP) over `grid(max_tokens_per_rank, c)` (default cap:
    `trainer.micro_batch_tokens`), fit, write `run_dir/profile.yaml`, print the per-point fit;
    return its path. ConfigError (before any rank starts) when the cap is under `MIN_LENGTH`."""
    if max_tokens_per_rank is None:
        max_tokens_per_rank = int(cfg.trainer.micro_batch_tokens)
    check_cap(max_tokens_per_rank)
    if sizes is None:
        from hcp.launch.launch import resolve_nproc

        top = min(CALIBRATE_MAX_CP, resolve_nproc(cfg.launcher.nproc_per_node))  # training's `auto`
        sizes = [1 << e for e in range(top.bit_length()) if 1 << e <= top]
    print(f"hcp: calibrating the configured LLM at CP sizes {list(sizes)} up to "
          f"{max_tokens_per_rank} tokens per rank; the profile goes to {run_dir}/profile.yaml",
          flush=True)
    rows = measure(cfg, run_dir, sizes, max_tokens_per_rank)
    recompute = cfg.llm.layout.recompute
    bytes_per_element = Precision.of(cfg.precision).act_bytes  # K/V travel in the compute dtype
    profile = fit(rows, cfg.llm, recompute, bytes_per_element, max(sizes))
    path = os.path.join(run_dir, "profile.yaml")
    with open(path, "w") as f:
        f.write("# Fitted by `mode=calibrate` (hcp/preflight/calibrate.py) for this model on this "
                "machine.\n")
        yaml.safe_dump(profile, f, sort_keys=False)
    print(f"{'L':>6} {'docs':>4} {'cp':>3} {'measured_s':>11} {'predicted_s':>11} {'error':>7} "
          f"{'weight':>6}")
    for p in profile["fit"]["points"]:
        print(f"{p['length']:>6} {p['docs']:>4} {p['cp']:>3} {p['measured_s']:11.5f} "
              f"{p['predicted_s']:11.5f} {100 * p['rel_error']:6.1f}% {p['weight']:6.2f}")
    print("\n".join(error_table(profile["fit"]["points"])))
    errs = np.abs([p["rel_error"] for p in profile["fit"]["points"]])
    coef = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else
                     f"{k} " + "/".join(f"{x:.3g}" for x in v.values())
                     for k, v in profile["fit"]["coefficients"].items())
    print(f"fit: mean |error| {100 * errs.mean():.1f}%, max {100 * errs.max():.1f}% ({coef}); "
          f"profile written to {path} (load it with packing_profile={path})")
    return path
