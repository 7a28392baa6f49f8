"""The encoder side made whole on one rank, for evaluation: greedy decoding re-encodes each
prompt's images inside the LLM's first stage, so the LLM's ranks need the whole encoder."""
from __future__ import annotations

from hcp.model.encoder_side import EncoderSide
from hcp.model.llava import LlavaEncoder
from hcp.train.encoders import whole_encoder_side
from hcp.train.modules import whole_state


def whole_encoder(encoder, specs, device) -> LlavaEncoder | None:
    """The colocated encoder side (`LlavaEncoder`) whole on this rank: the training encoder itself
    when its parameters are whole here and it runs without CP, else a copy (without CP, which
    shards tokens, not weights) gathered over the encoder's TP group and, under dp_shard, its
    DP x CP group (`hcp.train.modules.whole_state`; collectives: every rank of the encoder calls
    it). None for a text-only LM."""
    if encoder is None:
        return None
    if isinstance(encoder, EncoderSide):  # several encoders (hcp.train.encoders)
        return whole_encoder_side(encoder, specs, device)
    state = whole_state(encoder, encoder.tp_group)
    if state is None and encoder.vision.cp == 1:
        return encoder
    state = state or encoder.state_dict()
    whole = LlavaEncoder(specs["vision"].arch, specs["projector"].arch,
                         specs.llm.hidden_size).to(device)
    whole.load_state_dict(state)
    return whole
