"""The plain torch DDP training loop `benchmarks/overhead.py` measures hcp against: nothing from
hcp's model, plan, step or trainer code (the way a torch user writes it; see overhead.py's
docstring), and `Sections`, the per-section CPU / wall clock both loops are timed with.
"""
from __future__ import annotations

import itertools
import math
import time
from types import SimpleNamespace


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


class PlainLoop:
    """A plain DDP training loop (module docstring) of hcp's config `cfg` on this rank."""

    def __init__(self, cfg):
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        from hcp.config.specs import resolve_modules
        from hcp.data.build import build_datasets      # the same samples (data reading only)
        from hcp.data.loader import GlobalBatchSampler  # the same global batches
        from hcp.model import LlavaModel, init_parameters  # only to copy hcp's initial weights

        self.cfg, self.rank, self.world = cfg, dist.get_rank(), dist.get_world_size()
        ref = LlavaModel(cfg.vision, cfg.projector, cfg.llm)
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
        _, self.data, _ = build_datasets(cfg, resolve_modules(cfg))
        self.sampler = GlobalBatchSampler(len(self.data), cfg.trainer.global_batch_size, cfg.seed)

    def batches(self) -> list:
        """This rank's micro-batches of global batch `self.step`: its lane's contiguous block,
        packed first-fit (arrival order) into THD micro-batches of micro_batch_tokens."""
        import torch

        indices = self.sampler.batch(self.step)
        n = len(indices) // self.world
        cap, packs = int(self.cfg.trainer.micro_batch_tokens), []
        for i in indices[self.rank * n:(self.rank + 1) * n]:
            s = self.data[i]
            pack = next((p for p in packs if p[0] + len(s.input_ids) <= cap), None)
            if pack is None:
                packs.append(pack := [0, []])
            pack[0] += len(s.input_ids)
            pack[1].append(s)
        out = []
        for _, samples in packs:
            lengths = [len(s.input_ids) for s in samples]
            out.append(SimpleNamespace(
                input_ids=torch.tensor([t for s in samples for t in s.input_ids]),
                labels=torch.tensor([t for s in samples for t in s.labels]),
                position_ids=torch.cat([torch.arange(k) for k in lengths]),
                cu_seqlens=torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)))
        return out

    def train_step(self) -> tuple[float, int, int]:
        """One step on global batch `self.step`: (global mean loss, global tokens, this rank's
        micro-batches)."""
        import torch
        import torch.distributed as dist

        sec = self.sections
        sec.start()
        batches = self.batches()
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
                (loss_sum * (self.world / counts[0].item())).backward()
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
        return (loss_total / counts[0]).item(), int(counts[1]), len(batches)
