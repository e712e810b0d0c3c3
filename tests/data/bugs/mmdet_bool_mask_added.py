"""open-mmlab/mmdetection#12351: BiMultiHeadAttention (mmdet/models/utils/vlfuse_helper.py, GLIP and Grounding DINO's
vision-language fusion) is given the text's bool attention mask, True where a token is padding. `masked_fill(mask ==
0, -9e15)` on a bool tensor stays bool (the -9e15 becomes True), and `attn_weights + attention_mask` adds it as 0 and
1: no padded text token is masked, every score gets 1 more. The fix the issue gives: a float mask, filled where True.
Written as that function's vision-to-text branch."""

import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class BiMultiHeadAttention(nn.Module):
    def __init__(self, v_dim=8, l_dim=8, embed_dim=8, num_heads=2):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
        self.scale = self.head_dim ** (-0.5)
        self.v_proj = nn.Linear(v_dim, embed_dim)
        self.l_proj = nn.Linear(l_dim, embed_dim)
        self.values_l_proj = nn.Linear(l_dim, embed_dim)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, vision, lang, attention_mask_l):
        bsz, tgt_len, _ = vision.size()
        query_states = self.v_proj(vision) * self.scale
        key_states = self._shape(self.l_proj(lang), -1, bsz)
        value_l_states = self._shape(self.values_l_proj(lang), -1, bsz)
        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states = key_states.view(*proj_shape)
        value_l_states = value_l_states.view(*proj_shape)
        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        attention_mask = attention_mask_l.unsqueeze(1).unsqueeze(1)  # (bs, 1, 1, seq_len)
        attention_mask = attention_mask.expand(bsz, 1, tgt_len, src_len)
        if FIXED:
            attention_mask = torch.zeros(attention_mask.shape).masked_fill(attention_mask, -9e15)
        else:
            attention_mask = attention_mask.masked_fill(attention_mask == 0, -9e15)
        attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + attention_mask
        attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_weights_v = nn.functional.softmax(attn_weights, dim=-1)
        return torch.bmm(attn_weights_v, value_l_states)


torch.manual_seed(0)
text_padding = torch.tensor([[False, False, False, True, True], [False, False, False, False, False]])
with torch.no_grad():
    BiMultiHeadAttention()(torch.randn(2, 4, 8), torch.randn(2, 5, 8), text_padding)
