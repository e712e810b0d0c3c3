"""BART-style beam search: encoder outputs expanded per beam, decoder KV cache reordered by beam_idx each step.

Follows huggingface/transformers src/transformers/generation/utils.py (_expand_inputs_for_generation:
repeat_interleave(num_beams) of encoder_outputs and attention_mask; _beam_search with
beam_scores/topk over num_beams * vocab, beam_idx = next_tokens // vocab_size) and
models/bart/modeling_bart.py (_reorder_cache: past_state.index_select(0, beam_idx); BartAttention with
cross-attention keys/values computed once and cached). Masks meant: decoder self-attention in a decode
step is one query over all cached decoder keys of ITS beam (after reordering); cross-attention is one
query over the encoder, hiding the source padding of the batch item the beam belongs to.
"""
import torch
import torch.nn.functional as F
from torch import nn


class BartConfig:
    def __init__(self, d_model=32, decoder_attention_heads=4, vocab_size=40, pad_token_id=1,
                 decoder_start_token_id=2, eos_token_id=2):
        self.d_model, self.decoder_attention_heads, self.vocab_size = d_model, decoder_attention_heads, vocab_size
        self.pad_token_id, self.decoder_start_token_id, self.eos_token_id = pad_token_id, decoder_start_token_id, eos_token_id


class BartAttention(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
        self.q_proj, self.k_proj = nn.Linear(embed_dim, embed_dim), nn.Linear(embed_dim, embed_dim)
        self.v_proj, self.out_proj = nn.Linear(embed_dim, embed_dim), nn.Linear(embed_dim, embed_dim)

    def _shape(self, x):
        return x.view(x.shape[0], -1, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, hidden_states, key_value_states=None, past_key_value=None, attention_mask=None):
        is_cross_attention = key_value_states is not None
        q = self._shape(self.q_proj(hidden_states))
        if is_cross_attention and past_key_value is not None:
            k, v = past_key_value                      # encoder keys computed at the first step
        elif is_cross_attention:
            k, v = self._shape(self.k_proj(key_value_states)), self._shape(self.v_proj(key_value_states))
        else:
            k, v = self._shape(self.k_proj(hidden_states)), self._shape(self.v_proj(hidden_states))
            if past_key_value is not None:
                k, v = torch.cat([past_key_value[0], k], 2), torch.cat([past_key_value[1], v], 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        out = out.transpose(1, 2).reshape(hidden_states.shape[0], -1, self.num_heads * self.head_dim)
        return self.out_proj(out), (k, v)


def _reorder_cache(past_key_values, beam_idx):
    return tuple(tuple(past_state.index_select(0, beam_idx) for past_state in layer_past)
                 for layer_past in past_key_values)


@torch.no_grad()
def beam_search(config, embed_tokens, encoder_attn, self_attn, cross_attn, lm_head, input_ids, attention_mask,
                num_beams=3, max_length=6):
    batch_size = input_ids.shape[0]
    enc_mask = attention_mask.bool()[:, None, None, :]
    encoder_hidden_states, _ = encoder_attn(embed_tokens(input_ids), attention_mask=enc_mask)
    # _expand_inputs_for_generation
    encoder_hidden_states = encoder_hidden_states.repeat_interleave(num_beams, dim=0)
    encoder_attention_mask = attention_mask.repeat_interleave(num_beams, dim=0).bool()[:, None, None, :]

    decoder_input_ids = torch.full((batch_size * num_beams, 1), config.decoder_start_token_id)
    beam_scores = torch.zeros(batch_size, num_beams)
    beam_scores[:, 1:] = -1e9                          # all beams start identical: keep only the first
    beam_scores = beam_scores.view(-1)
    past_key_values = None
    for _ in range(max_length - 1):
        hidden = embed_tokens(decoder_input_ids[:, -1:])
        self_past, cross_past = (None, None) if past_key_values is None else past_key_values
        h, self_kv = self_attn(hidden, past_key_value=self_past)          # one query, all cached keys
        h2, cross_kv = cross_attn(hidden + h, key_value_states=encoder_hidden_states, past_key_value=cross_past,
                                  attention_mask=encoder_attention_mask)
        logits = lm_head(hidden + h + h2)[:, -1]
        next_token_scores = F.log_softmax(logits, dim=-1) + beam_scores[:, None]
        next_token_scores = next_token_scores.view(batch_size, num_beams * config.vocab_size)
        next_token_scores, next_tokens = torch.topk(next_token_scores, num_beams, dim=1)
        beam_idx = (next_tokens // config.vocab_size + torch.arange(batch_size)[:, None] * num_beams).view(-1)
        beam_next_tokens = (next_tokens % config.vocab_size).view(-1)
        beam_scores = next_token_scores.view(-1)
        decoder_input_ids = torch.cat([decoder_input_ids[beam_idx], beam_next_tokens[:, None]], dim=-1)
        past_key_values = _reorder_cache((self_kv, cross_kv), beam_idx)
    best = beam_scores.view(batch_size, num_beams).argmax(-1) + torch.arange(batch_size) * num_beams
    return decoder_input_ids[best]


def main():
    torch.manual_seed(0)
    config = BartConfig()
    embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
    encoder_attn = BartAttention(config.d_model, config.decoder_attention_heads)
    self_attn = BartAttention(config.d_model, config.decoder_attention_heads)
    cross_attn = BartAttention(config.d_model, config.decoder_attention_heads)
    lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
    p = config.pad_token_id
    input_ids = torch.tensor([[0, 5, 6, 7, 8, 9, 2], [0, 10, 11, 2, p, p, p]])
    attention_mask = (input_ids != p).long()
    print(beam_search(config, embed_tokens, encoder_attn, self_attn, cross_attn, lm_head, input_ids,
                      attention_mask).tolist())


if __name__ == "__main__":
    main()
