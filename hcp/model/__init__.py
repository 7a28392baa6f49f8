"""Model layer: building blocks, the ViT encoder, the projector, the LLaMA decoder and their
LLaVA composition (docs/design.md section 2, layer 4).

The classes load on first access (PEP 562), so `hcp.model.flops` (pure Python, the cost model's
FLOPs) imports without torch: the plan-ahead worker (hcp/plan/ahead.py) plans without it."""
from importlib import import_module

_WHERE = {"LlamaDecoder": "llama", "LlavaEncoder": "llava", "LlavaModel": "llava",
          "Projector": "projector", "ViTEncoder": "vit", "init_parameters": "init"}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"hcp.model.{_WHERE[name]}"), name)
