"""The encoder types: `arch` (`vision.arch`, `encoders.NAME.arch`) -> the builder of its module.

Every encoder module is built here (`build_encoder`), so a new encoder type joins by one entry in
`ENCODERS` plus its name in `hcp.config.choices.ENCODER_ARCHS` (validation's list: config sits
above the model layer and cannot import this); importing this module checks the two agree."""
from __future__ import annotations

from functools import partial

import torch.nn.functional as F
from torch import nn

from hcp.config.choices import ENCODER_ARCHS
from hcp.model.vit import ViTEncoder, quick_gelu

ENCODERS = {
    "vit": partial(ViTEncoder, act=F.gelu),       # GELU MLP (the tiny default)
    "clip": partial(ViTEncoder, act=quick_gelu),  # OpenAI CLIP: quick-GELU MLP
}
"""arch -> `(cfg, tp_group, stage, recompute, cp_group) -> nn.Module` (pixel values [I, C, H, W] ->
[I, P, D]; under encoder CP this rank's rows of each input)."""

if set(ENCODERS) != set(ENCODER_ARCHS):
    raise ImportError(f"hcp.model.encoder_types.ENCODERS {sorted(ENCODERS)} and "
                      f"hcp.config.choices.ENCODER_ARCHS {sorted(ENCODER_ARCHS)} must name the "
                      f"same types")


def build_encoder(cfg, tp_group=None, stage=None, recompute: bool = False,
                  cp_group=None) -> nn.Module:
    """The encoder of `cfg.arch` (a `EncoderArch`); see `ViTEncoder` for the other arguments.
    Raises ValueError for an unknown arch (validation rejects it first, naming the field)."""
    if cfg.arch not in ENCODERS:
        raise ValueError(f"arch={cfg.arch!r} is not an encoder type: use one of {sorted(ENCODERS)}")
    return ENCODERS[cfg.arch](cfg, tp_group, stage, recompute, cp_group)
