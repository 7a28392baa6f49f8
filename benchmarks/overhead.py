"""hcp's framework overhead: its `dp4` training step beside a plain torch DDP loop of the same
model, data, initial weights and schedule (issue 10 part 3).

    python benchmarks/overhead.py                    # 4 gloo ranks, +recipe=llama_tiny, 12 steps
    python benchmarks/overhead.py --steps 20 --profile 3

On each of `--nproc` forked gloo ranks: hcp's `Trainer` (`+recipe=llama_tiny`, pure DP) and a
plain loop written here with nothing from hcp's model, step or trainer code (one file, the way a
torch user writes it: `nn.Module`s, per-document SDPA, `DistributedDataParallel` with `no_sync`
for gradient accumulation, `clip_grad_norm_`, AdamW, the same cosine schedule). Both start from
the same weights (copied from hcp's layout-invariant init by parameter name) and read the same
micro-batches (hcp's step plan and data reading, `Trainer.prepare`, which the plain loop calls
too, on its own prefetch thread like hcp's `PlanAhead`, so data costs the same). The two loops alternate step by step, so both see the same machine
load; each step's wall time and every rank's thread CPU time are measured.

Prints tokens/s of each (global tokens / mean step wall time), the ratio hcp / plain, the
critical path (largest per-rank CPU seconds per step) of each, thread CPU time per step in the
sections of a step (data, forward + backward with gradient sync, clipping, optimizer, hcp's
metrics), and the largest difference of
their per-step losses (they must be identical up to fp32 summation order: checked against
`--loss-rtol`). `--profile N` adds a torch.profiler table of N more steps of each on rank 0 (the
operators where hcp spends more CPU time than the plain loop).
"""
from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from hcp.train.launch import free_port  # noqa: E402

OVERRIDES = ["+recipe=llama_tiny", "trainer.eval_every=0", "trainer.progress_bar=false",
             "logger=none"]


def plain_model(cfg):
    """The LLaMA of `cfg` (an hcp LLMConfig) in plain torch, with hcp's parameter names."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class RMSNorm(nn.Module):
        def __init__(self, n, eps):
            super().__init__()
            self.eps, self.weight = eps, nn.Parameter(torch.ones(n))

        def forward(self, x):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight

    def rotate(x, cos, sin):
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            h, d = cfg.hidden_size, cfg.hidden_size // cfg.num_heads
            self.d = d
            self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
            self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
            self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
            self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)

        def forward(self, x, cos, sin, lengths):
            t = x.shape[0]
            q = rotate(self.q_proj(x).view(t, -1, self.d), cos, sin)
            k = rotate(self.k_proj(x).view(t, -1, self.d), cos, sin)
            v = self.v_proj(x).view(t, -1, self.d)
            outs = [F.scaled_dot_product_attention(a.transpose(0, 1)[None], b.transpose(0, 1)[None],
                                                   c.transpose(0, 1)[None], is_causal=True,
                                                   enable_gqa=True)[0].transpose(0, 1)
                    for a, b, c in zip(q.split(lengths), k.split(lengths), v.split(lengths))]
            return self.o_proj(torch.cat(outs).reshape(t, -1))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            h, f = cfg.hidden_size, cfg.ffn_hidden_size
            self.gate_proj, self.up_proj = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False)
            self.down_proj = nn.Linear(f, h, bias=False)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_norm, self.attn = RMSNorm(cfg.hidden_size, cfg.norm_eps), Attention()
            self.mlp_norm, self.mlp = RMSNorm(cfg.hidden_size, cfg.norm_eps), MLP()

        def forward(self, x, cos, sin, lengths):
            x = x + self.attn(self.attn_norm(x), cos, sin, lengths)
            return x + self.mlp(self.mlp_norm(x))

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.layers = nn.ModuleList(Block() for _ in range(cfg.num_layers))
            self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
            self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

        def forward(self, batch):
            """Sum of the token cross-entropies and their count."""
            d = cfg.hidden_size // cfg.num_heads
            inv = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
            freqs = batch.position_ids.float()[:, None] * inv
            emb = torch.cat([freqs, freqs], -1)[:, None]
            cos, sin = emb.cos(), emb.sin()
            lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
            x = self.embed_tokens(batch.input_ids)
            for layer in self.layers:
                x = layer(x, cos, sin, lengths)
            keep = batch.labels != -100
            h = self.norm(x)[keep]
            logits = self.lm_head(h) if self.lm_head is not None else h @ self.embed_tokens.weight.T
            return F.cross_entropy(logits.float(), batch.labels[keep], reduction="sum"), int(keep.sum())

    return Llama()


class Sections:
    """Thread CPU and wall seconds per named section of a step, summed over steps."""

    def __init__(self):
        self.total: dict = {}
        self.t = (0.0, 0.0)

    def start(self) -> None:
        self.t = (time.thread_time(), time.perf_counter())

    def mark(self, name: str) -> None:
        now = (time.thread_time(), time.perf_counter())
        cpu, wall = self.total.get(name, (0.0, 0.0))
        self.total[name] = (cpu + now[0] - self.t[0], wall + now[1] - self.t[1])
        self.t = now

    def wrap(self, obj, attr: str, name: str, start: bool = False) -> None:
        """Time obj.attr(...) as section `name` (from the last mark; `start`: from its call)."""
        fn = getattr(obj, attr)

        def timed(*args, **kwargs):
            if start:
                self.start()
            out = fn(*args, **kwargs)
            self.mark(name)
            return out
        setattr(obj, attr, timed)


def instrument(trainer) -> Sections:
    """Sections of hcp's `Trainer.train_step` (its data, forward/backward with gradient sync,
    clipping, optimizer and metrics), by wrapping the calls it makes."""
    import hcp.train.trainer as trainer_module

    sec = Sections()
    sec.wrap(trainer.ahead, "next", "data", start=True)
    sec.wrap(trainer.runner, "forward_backward", "forward_backward")
    sec.wrap(trainer, "clip", "clip")
    sec.wrap(trainer.scheduler, "step", "optimizer")
    sec.wrap(trainer_module, "whole_step_metrics", "metrics")
    return sec


class PlainLoop:
    """A plain DDP training loop over the same batches as `trainer` (an hcp Trainer)."""

    def __init__(self, trainer):
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        from hcp.data.loader import GlobalBatchSampler
        from hcp.model import LlavaModel, init_parameters
        from hcp.plan.ahead import PlanAhead

        cfg = trainer.cfg
        self.trainer, self.cfg = trainer, cfg
        ref = LlavaModel(cfg.vision, cfg.projector, cfg.llm)   # the same init as the trainer's
        init_parameters(ref, cfg.seed)
        model = plain_model(cfg.llm)
        model.load_state_dict(ref.llm.state_dict())
        self.model = DDP(model)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr,
                                           betas=tuple(cfg.optim.betas), eps=cfg.optim.eps,
                                           weight_decay=cfg.optim.weight_decay)
        steps, o = cfg.trainer.max_steps, cfg.optim
        warmup = math.ceil(o.warmup_ratio * steps)

        def factor(s):
            if s < warmup:
                return (s + 1) / warmup
            progress = min(1.0, (s - warmup) / max(1, steps - warmup))
            return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)
        self.step, self.sections = 0, Sections()
        sampler = GlobalBatchSampler(len(trainer.train_set), cfg.trainer.global_batch_size, cfg.seed)
        self.ahead = PlanAhead(sampler, trainer.prepare)  # the same batches, prefetched the same way

    def train_step(self) -> tuple[float, int]:
        """One step on global batch `self.step`: (global mean loss, global tokens)."""
        import torch
        import torch.distributed as dist

        sec = self.sections
        sec.start()
        batches = [b for _, b in self.ahead.next()[1][2]]
        sec.mark("data")
        counts = torch.tensor([float(sum(int((b.labels != -100).sum()) for b in batches)),
                               float(sum(b.labels.numel() for b in batches))], dtype=torch.float64)
        dist.all_reduce(counts)
        loss_total = torch.zeros((), dtype=torch.float64)
        for i, batch in enumerate(batches):
            ctx = self.model.no_sync() if i < len(batches) - 1 else torch.enable_grad()
            with ctx:
                loss_sum, _ = self.model(batch)
                # DDP averages gradients over ranks: scale by the world size (a power of two
                # here, so exact) to get the token-level sum hcp computes
                (loss_sum * (dist.get_world_size() / counts[0].item())).backward()
            loss_total += loss_sum.detach().double()
        dist.all_reduce(loss_total)
        sec.mark("forward_backward")
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.trainer.grad_clip)
        sec.mark("clip")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        sec.mark("optimizer")
        return (loss_total / counts[0]).item(), int(counts[1])


def _rank(rank, world, port, overrides, steps, warmup, profile, queue):
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from hcp.config.compose import compose_config
    from hcp.train.trainer import Trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    run_dir = tempfile.mkdtemp(prefix="hcp-overhead-")
    cfg = compose_config([*OVERRIDES, *overrides], run_dir=run_dir)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    hcp = Trainer(OmegaConf.create(OmegaConf.to_container(cfg)), run_dir)
    plain = PlainLoop(hcp)
    sections = {"hcp": instrument(hcp), "plain": plain.sections}
    rows = {"hcp": [], "plain": []}
    for i in range(warmup + steps):
        if i == warmup:
            for sec in sections.values():
                sec.total.clear()
        for name in ("hcp", "plain"):
            dist.barrier()
            cpu0, t0 = time.thread_time(), time.perf_counter()
            if name == "hcp":
                m = hcp.train_step()
                loss, tokens = m["loss"], m["tokens_per_s"] * m["step_time_s"]
            else:
                loss, tokens = plain.train_step()
            wall, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
            if i >= warmup:
                rows[name].append((wall, cpu, loss, tokens))
    table = None
    if profile and rank == 0:
        table = _profile(hcp, plain, profile)
    elif profile:
        for _ in range(profile):
            hcp.train_step()
            plain.train_step()
    dist.barrier()
    queue.put((rank, rows, table, {k: v.total for k, v in sections.items()}))
    dist.destroy_process_group()


def _profile(hcp, plain, steps: int) -> str:
    """Operators by CPU time per step, hcp beside plain, largest differences first."""
    from torch.profiler import ProfilerActivity, profile

    totals = {}
    for name, fn in (("hcp", hcp.train_step), ("plain", plain.train_step)):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                fn()
        totals[name] = {e.key: (e.self_cpu_time_total / steps, e.count / steps)
                        for e in prof.key_averages()}
    keys = set(totals["hcp"]) | set(totals["plain"])
    diff = sorted(keys, key=lambda k: -(totals["hcp"].get(k, (0, 0))[0] - totals["plain"].get(k, (0, 0))[0]))
    lines = [f"{'operator (self CPU per step, rank 0)':<48} {'hcp ms':>8} {'calls':>6} "
             f"{'plain ms':>8} {'calls':>6}"]
    for k in diff[:25]:
        (h, hc), (p, pc) = totals["hcp"].get(k, (0, 0)), totals["plain"].get(k, (0, 0))
        lines.append(f"{k[:48]:<48} {h / 1e3:8.2f} {hc:6.0f} {p / 1e3:8.2f} {pc:6.0f}")
    lines.append(f"{'total':<48} {sum(v[0] for v in totals['hcp'].values()) / 1e3:8.2f} {'':>6} "
                 f"{sum(v[0] for v in totals['plain'].values()) / 1e3:8.2f}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--nproc", type=int, default=4, help="gloo ranks (pure DP)")
    ap.add_argument("--steps", type=int, default=12, help="measured steps of each loop")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured first steps of each loop")
    ap.add_argument("--profile", type=int, default=0, help="profile this many more steps")
    ap.add_argument("--loss-rtol", type=float, default=1e-4)
    ap.add_argument("overrides", nargs="*", help="extra hcp config overrides")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.nproc < 1:
        ap.error("--steps and --nproc must be >= 1")
    ctx = mp.get_context("fork")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, args.nproc, port, args.overrides, args.steps,
                                             args.warmup, args.profile, queue))
             for r in range(args.nproc)]
    for p in procs:
        p.start()
    results = []
    while len(results) < len(procs):
        try:
            results.append(queue.get(timeout=5))
        except Exception:  # queue.Empty: a rank that died never reports, say so instead of waiting
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise SystemExit(f"rank(s) {dead} failed (traceback above)")
    results.sort(key=lambda r: r[0])
    for p in procs:
        p.join()
    out = {}
    for name in ("hcp", "plain"):
        per_rank = [rows[name] for _, rows, _, _ in results]
        wall = [max(r[i][0] for r in per_rank) for i in range(args.steps)]
        out[name] = dict(tokens_per_s=sum(r[3] for r in per_rank[0]) / sum(wall),
                         critical_cpu_s=sum(max(r[i][1] for r in per_rank) for i in range(args.steps)) / args.steps,
                         losses=[r[2] for r in per_rank[0]])
    diff = max(abs(a - b) / abs(b) for a, b in zip(out["hcp"]["losses"], out["plain"]["losses"]))
    print(f"{args.nproc} gloo ranks, +recipe=llama_tiny {' '.join(args.overrides)}, "
          f"{args.steps} steps each (after {args.warmup} warm-up), alternating")
    print(f"{'loop':<6} {'tokens/s':>9} {'cpu s/step':>10} {'first loss':>10} {'last loss':>10}")
    for name in ("hcp", "plain"):
        o = out[name]
        print(f"{name:<6} {o['tokens_per_s']:9.0f} {o['critical_cpu_s']:10.4f} {o['losses'][0]:10.5f} "
              f"{o['losses'][-1]:10.5f}")
    ratio = out["hcp"]["tokens_per_s"] / out["plain"]["tokens_per_s"]
    cpu_ratio = out["plain"]["critical_cpu_s"] / out["hcp"]["critical_cpu_s"]
    print(f"hcp / plain tokens/s: {ratio:.3f}x (critical-path CPU: {cpu_ratio:.3f}x); "
          f"largest relative loss difference {diff:.2e} (rtol {args.loss_rtol:g}): "
          f"{'identical' if diff <= args.loss_rtol else 'DIFFERENT'}")
    names = ["data", "forward_backward", "clip", "optimizer", "metrics"]
    for i, what in enumerate(("thread CPU", "wall")):
        mean = lambda loop, n: sum(r[3][loop].get(n, (0, 0))[i] for r in results) / len(results)  # noqa: E731
        print(f"{what} ms per step by section, mean over ranks (hcp / plain): " + ", ".join(
            f"{n} {mean('hcp', n) / args.steps * 1e3:.1f} / {mean('plain', n) / args.steps * 1e3:.1f}"
            for n in names))
    if results[0][2]:
        print(results[0][2])
    out.update(ratio=ratio, cpu_ratio=cpu_ratio, loss_rel_diff=diff)
    if diff > args.loss_rtol:
        raise SystemExit(f"the loss curves differ by {diff:.2e} > --loss-rtol {args.loss_rtol:g}")
    return out


if __name__ == "__main__":
    main()
