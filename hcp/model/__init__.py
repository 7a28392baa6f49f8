"""Model layer: building blocks, the ViT encoder, the projector, the LLaMA decoder and their
LLaVA composition (docs/design.md section 2, layer 4)."""
from hcp.model.init import init_parameters
from hcp.model.llama import LlamaDecoder
from hcp.model.llava import LlavaEncoder, LlavaModel
from hcp.model.projector import Projector
from hcp.model.vit import ViTEncoder

__all__ = ["LlamaDecoder", "LlavaEncoder", "LlavaModel", "Projector", "ViTEncoder", "init_parameters"]
