"""NeMo Automodel LlamaBidirectionalModel (biencoder): layers keep is_causal=True, embeddings causal.

Citation: NVIDIA-NeMo/Automodel#1349 "fix: biencoder bidirectional masking and consistent
attn_implementation default", commit ff716f38532e25ab0722ac858e55978cf78b6e0f (diff of
nemo_automodel/components/models/llama_bidirectional/model.py read).

Bug: the model's docstring says it "removes causal masking from all attention layers", and its
`_update_causal_mask` comment says "bidirectional attention is ensured by is_causal=False on all
layers" -- but no code ever set `layer.self_attn.is_causal = False` (the unit test asserting it was
commented out). `_update_causal_mask` returns None when no attention_mask is given (and the raw 2-D
mask under flash_attention_2, then the default), so the attention kernel falls back to the
module's own `is_causal=True`: the embedding is computed causally.
Fix: `__init__` sets `layer.self_attn.is_causal = False` on every layer, and `forward` builds the
mask with `transformers.masking_utils.create_bidirectional_mask`.

This program: transformers 5.24 LlamaModel subclass built from a config (random weights, SDPA),
written as the project wrote it (the forward's cache arguments renamed to 5.24's `cache`;
`_prepare_4d_attention_mask`, gone from 5.24, is inlined as transformers defined it). A single
unpadded passage is encoded without an attention_mask (the call the fix's own test makes) and
average-pooled. Flash-attention (the PR's main path) needs a GPU and is not exercised.
"""
import sys
from typing import Optional

import torch
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.llama.configuration_llama import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaModel

FIXED = "--fixed" in sys.argv


def _prepare_4d_attention_mask(mask: torch.Tensor, dtype: torch.dtype, tgt_len: Optional[int] = None):
    """transformers' helper: [bsz, src_len] 1/0 -> additive [bsz, 1, tgt_len, src_len]."""
    bsz, src_len = mask.size()
    tgt_len = tgt_len if tgt_len is not None else src_len
    expanded_mask = mask[:, None, None, :].expand(bsz, 1, tgt_len, src_len).to(dtype)
    inverted_mask = 1.0 - expanded_mask
    return inverted_mask.masked_fill(inverted_mask.to(torch.bool), torch.finfo(dtype).min)


class LlamaBidirectionalConfig(LlamaConfig):
    model_type = "LlamaBidirectionalModel"

    def __init__(self, pooling: str = "avg", temperature: float = 1.0, **kwargs):
        self.pooling = pooling
        self.temperature = temperature
        super().__init__(**kwargs)


class LlamaBidirectionalModel(LlamaModel):
    """
    Llama Model with bidirectional attention.

    This model removes causal masking from all attention layers, allowing tokens
    to attend to all other tokens in the sequence. This is useful for embedding
    and retrieval tasks where bidirectional context is beneficial.
    """

    config_class = LlamaBidirectionalConfig

    def __init__(self, config: LlamaConfig):
        super().__init__(config)
        if FIXED:
            # Disable causal attention for all layers
            for layer in self.layers:
                layer.self_attn.is_causal = False

    def _update_causal_mask(self, attention_mask: torch.Tensor, input_tensor: Optional[torch.Tensor] = None, **kwargs):
        if attention_mask is None:
            return None
        if getattr(self.config, "_attn_implementation", None) == "flash_attention_2":
            # Flash Attention handles padding from the raw 2D mask;
            # bidirectional attention is ensured by is_causal=False on all layers.
            return attention_mask
        dtype = input_tensor.dtype if input_tensor is not None else torch.float32
        return _prepare_4d_attention_mask(attention_mask, dtype)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, use_cache=None, **kwargs) -> BaseModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device).unsqueeze(0)

        if FIXED:
            bidirectional_mask = create_bidirectional_mask(
                config=self.config,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
            )
        else:
            bidirectional_mask = self._update_causal_mask(attention_mask=attention_mask, input_tensor=inputs_embeds)

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=bidirectional_mask,
                position_ids=position_ids,
                cache=cache,
                position_embeddings=position_embeddings,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states)


def _pool(last_hidden_states: torch.Tensor, attention_mask: torch.Tensor, pool_type: str) -> torch.Tensor:
    last_hidden = last_hidden_states.masked_fill(~attention_mask[..., None].bool(), 0.0)
    if pool_type == "avg":
        return last_hidden.sum(dim=1) / attention_mask.sum(dim=1)[..., None]
    return last_hidden[:, 0]


def main():
    torch.manual_seed(0)
    cfg = LlamaBidirectionalConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, pad_token_id=0, pooling="avg",
    )
    cfg._attn_implementation = "sdpa"
    model = LlamaBidirectionalModel(cfg).eval()
    input_ids = torch.tensor([[5, 17, 33, 48, 61, 72, 90, 101]])
    with torch.no_grad():
        out = model(input_ids=input_ids)
        emb = _pool(out.last_hidden_state, torch.ones_like(input_ids), cfg.pooling)
    print("embedding[:4]:", [round(float(x), 4) for x in emb[0, :4]])


if __name__ == "__main__":
    main()
