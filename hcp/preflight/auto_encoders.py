"""The encoder side of `layout=auto`'s estimate (hcp.preflight.auto_cost.Scorer): each encoder's
seconds per input, its calls on a host, its colocated phases, its island's pipeline stages and
its routes into the LLM. Pure: no process group.

Each encoder (`vision`, every `encoders.<name>`, with its projectors; `hcp.model.flops.
encoder_flops`) runs at the profile's peak x matmul efficiency per rank, divided by its tp;
under encoder CP c each rank computes its k = ceil(tokens / c) positions of every input (a k /
tokens share of its FLOPs) and receives K and V of the other (c - 1) x k positions per block
(the all-gather forward, the reduce-scatter of their gradients backward, not overlapped; the
profile's `cp_latency` per ring step), plus TP's two ring all-reduces of its positions'
activations per block forward (two more backward, two more under full recompute, which also
adds one forward); its route carries, per input, its streams' rows of `llm.hidden_size`
elements forward and the same gradient backward.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hcp.config.modules import patches
from hcp.model.flops import encoder_flops
from hcp.parallel.encoder_cp import LEAD, chunk
from hcp.preflight.auto_host import layer_calls
from hcp.preflight.auto_space import projector_for
from hcp.preflight.estimate import ring_s


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


@dataclass(frozen=True)
class Encoder:
    """What the estimate reads of one encoder (`encoder_terms`): training FLOPs of one input
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


def encoder_terms(cfg, specs, sides) -> dict[str, Encoder]:
    """{encoder: `Encoder`} of every side (`hcp.preflight.auto_space.sides`) of the resolved
    config `cfg` and its `specs` (`resolve_modules`)."""
    out = {}
    for side in sides:
        a = specs[side.encoder].arch
        blocks = a.num_layers + a.select_layer + 1
        rows = sum(specs.rows(s) for s in specs.streams if s.encoder == side.encoder)
        out[side.encoder] = Encoder(encoder_flops(a, cfg.llm.hidden_size, 1), patches(a) + LEAD,
                                    blocks, blocks + 1, a.hidden_size, rows)
    return out


class EncoderTerms:
    """The encoder-side terms of `hcp.preflight.auto_cost.Scorer` (module docstring), which
    sets what they read: `cfg` (plain), `hw`, `host`, `world`, `images` (inputs per step),
    `sides`, `encoders` (`encoder_terms`) and `sync(layout)`."""

    def _encoder_calls(self, enc, share=1.0) -> tuple:
        """(forward, backward) seconds of one pass of `share` (a fraction, or an array of them)
        of the encoder layout `enc`'s layers that do not grow with its inputs: the `Host`'s
        layer calls and, under encoder CP, each block's collective calls (the host's
        `cp_layer_s`) and ring steps (`cp_latency` x (cp - 1), twice backward)."""
        e = self.encoders[enc.module]
        f, b = layer_calls(self.host, np.asarray(share, dtype=np.float64) * e.layers)
        if enc.cp > 1:
            blocks = np.asarray(share, dtype=np.float64) * e.blocks
            host = self.host.cp_layer_s if self.host else 0.0
            f = f + blocks * (host / 3 + self.hw.cp_latency * (enc.cp - 1))
            b = b + blocks * (2 * host / 3 + 2 * self.hw.cp_latency * (enc.cp - 1))
        return f, b

    def _side_sync(self, enc) -> float:
        """Gradient sync seconds of an encoder's layout and its projectors' (`projector_for`)."""
        side = next(s for s in self.sides if s.encoder == enc.module)
        return self.sync(enc) + sum(self.sync(projector_for(enc, q)) for q in side.projectors)

    def _image_s(self, enc) -> tuple[float, float]:
        """(forward, backward) seconds of one input on one rank of the encoder layout `enc` (and
        its projector): its FLOPs at the profile's rate over tp, each CP rank computing its
        k = ceil(tokens / cp) positions (`hcp.parallel.encoder_cp`); TP's two ring all-reduces
        of the k positions' activations per block; encoder CP's all-gather of K and V per
        block ((cp - 1) x k positions of 2 x width / tp elements received, not overlapped) and
        the reduce-scatter of their gradients backward; full recompute repeats the forward's."""
        hw, e = self.hw, self.encoders[enc.module]
        k = chunk(e.tokens, enc.cp)
        flops, kv_bytes = encoder_cp_share(e.flops, e.tokens, e.blocks, e.hidden, enc.cp, enc.tp,
                                           hw.bytes_per_element)
        fwd = flops / 3 / (hw.peak_flops * hw.matmul_efficiency)
        bwd = 2 * fwd + (fwd if enc.recompute == "full" else 0.0)
        comm = 0.0
        if enc.tp > 1:
            comm += (2 * e.blocks
                     * float(ring_s(k * e.hidden * hw.bytes_per_element, enc.tp, enc.tp, hw)))
        if enc.cp > 1:
            bw = hw.nvlink_bandwidth if enc.tp * enc.cp <= hw.ranks_per_node else hw.ib_bandwidth
            comm += kv_bytes / bw
        return fwd + comm, bwd + comm * (2 if enc.recompute == "full" else 1)

    def _route_s(self, images, rows: int) -> float:
        """Seconds of one direction of the route of `images` inputs' `rows` rows each (one rank's
        share)."""
        bw = (self.hw.nvlink_bandwidth
              if self.world <= self.hw.ranks_per_node else self.hw.ib_bandwidth)
        return images * rows * self.cfg.llm.hidden_size * self.hw.bytes_per_element / bw

    def _colocated_encoder_s(self, enc) -> float:
        """Seconds of the colocated phases of one encoder: its lane's inputs forward and
        backward."""
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
            share = (np.asarray(enc.pp_layers, dtype=np.float64) / sum(enc.pp_layers) * images
                     * (f + b))
            share[-1] += 2 * self._route_s(images, self.encoders[enc.module].rows)
            out = max(out, float(share.max()) + self._side_sync(enc))
        return out

    def _island_stages(self, enc, per) -> tuple[np.ndarray, np.ndarray, float]:
        """(forward, backward `[pp_e, R]` seconds, busy seconds of all its ranks) of an encoder
        island's stages over the LLM lane's R rounds, `per` `[R]` inputs each (routes on the
        last)."""
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
