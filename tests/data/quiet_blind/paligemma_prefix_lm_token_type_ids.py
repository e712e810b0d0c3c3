"""PaliGemma prefix-LM training step: image + prompt attend bidirectionally, the answer (suffix) is causal.

Follows huggingface/transformers src/transformers/models/paligemma/modeling_paligemma.py
(_update_causal_mask in training: causal_mask filled with min_dtype, then the prefix columns where
token_type_ids == 0 are unmasked for every row, then padding columns are masked again) and
PaliGemmaProcessor (token_type_ids: 0 for image tokens + prefix prompt, 1 for the suffix).
Mask meant: every token sees the whole prefix (image + prompt, including prompt tokens to its right);
suffix tokens also see earlier suffix tokens; right padding is hidden. Additive float mask, eager softmax.
"""
import torch
from torch import nn


class PaliGemmaConfig:
    def __init__(self, hidden_size=32, num_attention_heads=4, num_image_tokens=16, vocab_size=80,
                 image_token_index=79, pad_token_id=0):
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.num_image_tokens = num_image_tokens
        self.vocab_size = vocab_size
        self.image_token_index = image_token_index
        self.pad_token_id = pad_token_id


def _update_causal_mask(attention_mask, token_type_ids, dtype):
    min_dtype = torch.finfo(dtype).min
    bsz, sequence_length = attention_mask.shape
    target_length = sequence_length
    causal_mask = torch.full((sequence_length, target_length), fill_value=min_dtype, dtype=dtype)
    causal_mask = torch.triu(causal_mask, diagonal=1)
    causal_mask = causal_mask[None, None, :, :].expand(bsz, 1, -1, -1).clone()
    # prefix (token_type_ids == 0) is visible to every query: bidirectional prefix
    causal_mask = causal_mask.masked_fill(token_type_ids[:, None, None, :] == 0, 0)
    padding_mask = causal_mask + attention_mask[:, None, None, :].to(dtype)
    padding_mask = padding_mask == 0
    causal_mask = causal_mask.masked_fill(padding_mask, min_dtype)
    return causal_mask


class GemmaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask):
        bsz, q_len, _ = hidden_states.shape
        q, k, v = self.qkv(hidden_states).view(bsz, q_len, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) * self.head_dim ** -0.5
        attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(attn_weights, v).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(out)


def main():
    torch.manual_seed(0)
    config = PaliGemmaConfig()
    n_img = config.num_image_tokens
    # processor output: [image tokens][bos prompt \n][answer eos][pad]
    prefix_lens, suffix_lens, seq_len = [6, 4], [5, 3], n_img + 12
    input_ids = torch.full((2, seq_len), config.pad_token_id)
    token_type_ids = torch.zeros(2, seq_len, dtype=torch.long)
    attention_mask = torch.zeros(2, seq_len, dtype=torch.long)
    for b, (p, s) in enumerate(zip(prefix_lens, suffix_lens)):
        input_ids[b, :n_img] = config.image_token_index
        input_ids[b, n_img:n_img + p + s] = torch.randint(1, config.vocab_size - 1, (p + s,))
        token_type_ids[b, n_img + p:n_img + p + s] = 1
        attention_mask[b, :n_img + p + s] = 1
    # padding positions are "suffix" type so the prefix unmasking never reaches them
    token_type_ids[attention_mask == 0] = 1

    embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
    image_features = torch.randn(2, n_img, config.hidden_size)   # multi_modal_projector(vision_tower(pixels))
    inputs_embeds = embed_tokens(input_ids)
    special_image_mask = (input_ids == config.image_token_index)[..., None].expand_as(inputs_embeds)
    inputs_embeds = inputs_embeds.masked_scatter(special_image_mask, image_features)

    causal_mask = _update_causal_mask(attention_mask, token_type_ids, inputs_embeds.dtype)
    with torch.no_grad():
        hidden = GemmaAttention(config)(inputs_embeds, causal_mask)
    print("hidden", tuple(hidden.shape))


if __name__ == "__main__":
    main()
