"""LLaVA-1.5's image preprocessing for a CLIP encoder (`vision.arch=clip`): pad to a square with
the mean colour (`image_aspect_ratio=pad`, LLaVA's `expand2square`), then transformers'
CLIPImageProcessor: bicubic resize to `image_size` (shortest edge; the centre crop of a square
is the whole of it), scale to [0, 1], normalize with OpenAI CLIP's mean and std per channel."""
from __future__ import annotations

import numpy as np
import torch
from PIL import Image

MEAN = (0.48145466, 0.4578275, 0.40821073)
STD = (0.26862954, 0.26130258, 0.27577711)


def load_clip_image(path: str, image_size: int, num_channels: int = 3) -> torch.Tensor:
    """Read an image file as CLIP pixel values `[3, image_size, image_size]` fp32.

    Raises:
        ValueError: `num_channels` is not 3 (CLIP encoders read RGB).
    """
    if num_channels != 3:
        raise ValueError(f"vision.num_channels={num_channels}: a CLIP encoder reads RGB images (3)")
    with Image.open(path) as im:
        im = im.convert("RGB")
        w, h = im.size
        side = max(w, h)
        square = Image.new("RGB", (side, side), tuple(int(m * 255) for m in MEAN))
        square.paste(im, ((side - w) // 2, (side - h) // 2))
        square = square.resize((image_size, image_size), Image.BICUBIC)
        x = np.asarray(square, dtype=np.float32) / 255.0                  # [S, S, 3]
    x = (x - np.asarray(MEAN, np.float32)) / np.asarray(STD, np.float32)
    return torch.from_numpy(x).permute(2, 0, 1).contiguous()
