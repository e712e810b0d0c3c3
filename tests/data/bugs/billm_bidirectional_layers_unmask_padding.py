# WhereIsAI/BiLLM#6: Bi-Mistral replaced the 4D causal mask of its bidirectional layers with
# torch.zeros_like(attention_mask), which drops the padding part too, so real tokens attend to pad tokens.
import os
import sys

import torch
from transformers import MistralConfig
from transformers.models.mistral.modeling_mistral import MistralModel as _HFMistralModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

os.environ.setdefault("BiLLM_START_INDEX", "0")  # as the README says: turn every layer bidirectional

# billm/config.py
BiLLM_START_INDEX = int(os.getenv("BiLLM_START_INDEX", -1))


def _prepare_4d_causal_attention_mask(attention_mask, input_shape, inputs_embeds, past_key_values_length):
    """transformers' (4.40) eager helper: causal + padding, additive."""
    bsz, tgt_len = input_shape
    dtype, min_value = inputs_embeds.dtype, torch.finfo(inputs_embeds.dtype).min
    causal = torch.full((tgt_len, tgt_len), min_value, dtype=dtype).triu(1)
    causal = causal[None, None].expand(bsz, 1, tgt_len, tgt_len)
    if attention_mask is None:
        return causal
    inverted = 1.0 - attention_mask[:, None, None, :].to(dtype).expand(bsz, 1, tgt_len, tgt_len)
    return causal.masked_fill(inverted.bool(), min_value)


class MistralModel(_HFMistralModel):
    def __init__(self, config: MistralConfig):
        super().__init__(config)
        self.bidirectionas = [BiLLM_START_INDEX > -1 and layer_idx >= BiLLM_START_INDEX
                              for layer_idx in range(config.num_hidden_layers)]

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
        batch_size, seq_length = input_ids.shape
        inputs_embeds = self.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = torch.arange(seq_length).unsqueeze(0).view(-1, seq_length)
        padding_mask = attention_mask
        # 4d mask is passed through the layers
        attention_mask = _prepare_4d_causal_attention_mask(attention_mask, (batch_size, seq_length), inputs_embeds, 0)
        if FIXED and padding_mask is not None:
            # keep the key padding, drop only the look-ahead part
            bi_attention_mask = (1.0 - padding_mask[:, None, None, :].to(inputs_embeds.dtype)).expand_as(
                attention_mask) * torch.finfo(inputs_embeds.dtype).min
        else:
            bi_attention_mask = torch.zeros_like(attention_mask) if attention_mask is not None else None

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        for is_bidirectional, decoder_layer in zip(self.bidirectionas, self.layers):
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=bi_attention_mask if is_bidirectional else attention_mask,
                position_ids=position_ids,
                position_embeddings=position_embeddings,
            )
        return self.norm(hidden_states)


config = MistralConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       sliding_window=None, pad_token_id=0, attn_implementation="eager")
model = MistralModel(config).eval()

# a padded NER batch (right padding, pad_token_id=0)
input_ids = torch.tensor([[11, 12, 13, 14, 15, 16, 17, 18],
                          [21, 22, 23, 24, 0, 0, 0, 0]])
attention_mask = (input_ids != config.pad_token_id).long()

with torch.no_grad():
    batched = model(input_ids=input_ids, attention_mask=attention_mask)
    alone = model(input_ids=input_ids[1:, :4], attention_mask=attention_mask[1:, :4])

print(f"fixed={FIXED} BiLLM_START_INDEX={BiLLM_START_INDEX} max |padded row - unpadded run| over real tokens: "
      f"{(batched[1, :4] - alone[0]).abs().max().item():.5f}")
