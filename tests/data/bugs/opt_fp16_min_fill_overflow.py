"""huggingface/transformers#17433, fixed by #17437: OPT in float16 gave NaN in batched generation with left padding.
The padding mask fills with torch.finfo(float16).min, and `attn_weights + attention_mask` adds a score below -16 to
it, past float16's range: -inf. A padding query's row (its own key padding, every later key causal -inf) is then -inf
everywhere, softmax gives NaN there, and the NaN reaches every token through the values. The fix clamps the sum back
to finfo.min (torch.max) and upcasts the softmax. Written as transformers 4.19.2's OPT attention and mask helpers
(modeling_opt.py), in one float16 layer whose weights make the padding token's score with itself below -16, as the
1.3B checkpoint's are."""

import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


def _make_causal_mask(input_ids_shape, dtype):
    bsz, tgt_len = input_ids_shape
    mask = torch.full((tgt_len, tgt_len), float("-inf"))
    mask_cond = torch.arange(mask.size(-1))
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    mask = mask.to(dtype)
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len)


def _expand_mask(mask, dtype, tgt_len):
    bsz, src_len = mask.size()
    expanded_mask = mask[:, None, None, :].expand(bsz, 1, tgt_len, src_len).to(dtype)
    inverted_mask = 1.0 - expanded_mask
    return inverted_mask.masked_fill(inverted_mask.bool(), torch.finfo(dtype).min)


class OPTAttention(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, attention_mask):
        bsz, tgt_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scaling
        key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
        value_states = self._shape(self.v_proj(hidden_states), -1, bsz)
        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states = key_states.view(*proj_shape)
        value_states = value_states.view(*proj_shape)
        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + attention_mask
        if FIXED:
            attn_weights = torch.max(attn_weights, torch.tensor(torch.finfo(attn_weights.dtype).min))
        attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        if FIXED and attn_weights.dtype == torch.float16:
            attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(torch.float16)
        else:
            attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        return torch.bmm(attn_weights, value_states)


class OPTDecoder(nn.Module):
    def __init__(self, embed_dim=16, num_heads=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(10, embed_dim)
        self.self_attn = OPTAttention(embed_dim, num_heads)

    def forward(self, input_ids, attention_mask):
        inputs_embeds = self.embed_tokens(input_ids)
        combined = _make_causal_mask(input_ids.shape, inputs_embeds.dtype)
        combined = _expand_mask(attention_mask, inputs_embeds.dtype, tgt_len=input_ids.shape[-1]) + combined
        return self.self_attn(inputs_embeds, combined)


torch.manual_seed(0)
model = OPTDecoder()
with torch.no_grad():  # a token's score with itself below -16, as the 1.3B checkpoint's padding token has it
    attention = model.self_attn
    attention.q_proj.weight.mul_(4)
    attention.k_proj.weight.copy_(-attention.q_proj.weight)
    attention.q_proj.bias.zero_()
    attention.k_proj.bias.zero_()
model = model.half().eval()
input_ids = torch.tensor([[1, 1, 5, 6], [2, 3, 4, 7]])  # "Who are you?" left-padded beside a longer prompt
with torch.no_grad():
    model(input_ids, attention_mask=(input_ids != 1).long())
