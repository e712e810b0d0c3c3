"""LongformerEncoderDecoder (LED on BART): the BART encoder's invert_mask erases global attention.

Citation: allenai/longformer#28 (comments of 2020-08-03..06 by hannes89 and ibeltagy; the same
report again as allenai/longformer#147 and #254). The fix was pushed to ibeltagy's fork of
transformers (branch longformer_encoder_decoder); that diff was not read, the change below is the
one proposed in the thread and acknowledged by the maintainer.

Bug: the user marks tokens with attention_mask values 0 (padding), 1 (local), 2 (global).
`BartEncoder.forward` (transformers 3.0 modeling_bart) runs `attention_mask = invert_mask(attention_mask)`,
i.e. `attention_mask.eq(0)`, so 1 and 2 both become False. `LongformerSelfAttentionForBart` then
passes `key_padding_mask * -1` to `LongformerSelfAttention`, which reads -ve as padding, 0 as local
and +ve as global: no token is ever global, every token only sees its sliding window.
Fix: `attention_mask = (1.0 - attention_mask)` in the encoder, so padding -> -1, local -> 0,
global -> +1 after the wrapper's `* -1`.

This program: a small BART-style encoder whose layers' self-attention is replaced by
LongformerSelfAttentionForBart (random weights). The Longformer attention is the dense equivalent
of its sliding-chunks kernel: softmax over q @ k^T with the band |i - j| <= attention_window / 2,
global keys added for every query, and global queries (own q/k/v projections) over all keys.
Batch of two, the second right-padded, token 0 (<s>) global in both.
"""
import math
import sys
from typing import List

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class LongformerEncoderDecoderConfig:
    def __init__(self, attention_window: List[int] = None, attention_dilation: List[int] = None,
                 autoregressive: bool = False, attention_mode: str = 'sliding_chunks',
                 d_model=32, encoder_attention_heads=4, encoder_layers=2, encoder_ffn_dim=64,
                 vocab_size=50, pad_token_id=1, max_position_embeddings=64, attention_dropout=0.0):
        self.attention_window = attention_window
        self.attention_dilation = attention_dilation
        self.autoregressive = autoregressive
        self.attention_mode = attention_mode
        self.d_model = self.hidden_size = d_model
        self.encoder_attention_heads = self.num_attention_heads = encoder_attention_heads
        self.encoder_layers = encoder_layers
        self.encoder_ffn_dim = encoder_ffn_dim
        self.vocab_size = vocab_size
        self.pad_token_id = pad_token_id
        self.max_position_embeddings = max_position_embeddings
        self.attention_probs_dropout_prob = attention_dropout


def invert_mask(attention_mask):
    """Turns 1->0, 0->1, False->True, True-> False"""
    assert attention_mask.dim() == 2
    return attention_mask.eq(0)


class LongformerSelfAttention(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = int(config.hidden_size / config.num_attention_heads)
        self.embed_dim = config.hidden_size
        self.query = nn.Linear(config.hidden_size, self.embed_dim)
        self.key = nn.Linear(config.hidden_size, self.embed_dim)
        self.value = nn.Linear(config.hidden_size, self.embed_dim)
        self.query_global = nn.Linear(config.hidden_size, self.embed_dim)
        self.key_global = nn.Linear(config.hidden_size, self.embed_dim)
        self.value_global = nn.Linear(config.hidden_size, self.embed_dim)
        self.layer_id = layer_id
        self.attention_window = config.attention_window[self.layer_id]
        self.autoregressive = config.autoregressive

    def _heads(self, x, bsz, seqlen):
        return x.view(bsz, seqlen, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, hidden_states, attention_mask=None, head_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, output_attentions=False):
        '''
        The `attention_mask` is changed in `BertModel.forward` from 0, 1, 2 to
            -ve: no attention
              0: local attention
            +ve: global attention
        '''
        attention_mask = attention_mask.squeeze(dim=2).squeeze(dim=1)
        key_padding_mask = attention_mask < 0
        extra_attention_mask = attention_mask > 0
        bsz, seqlen, _ = hidden_states.size()
        w = self.attention_window // 2

        q = self._heads(self.query(hidden_states), bsz, seqlen) / math.sqrt(self.head_dim)
        k = self._heads(self.key(hidden_states), bsz, seqlen)
        v = self._heads(self.value(hidden_states), bsz, seqlen)
        attn_weights = q @ k.transpose(-1, -2)
        pos = torch.arange(seqlen)
        band = (pos[:, None] - pos[None, :]).abs() <= w
        if self.autoregressive:
            band = band & (pos[None, :] <= pos[:, None])
        allowed = band[None, None] | extra_attention_mask[:, None, None, :]
        attn_weights = attn_weights.masked_fill(~allowed, float('-inf'))
        # padding keys get -10000 added (as the sliding-chunks kernel's float_mask), not -inf
        float_mask = key_padding_mask.type_as(q).masked_fill(key_padding_mask, -10000.0)
        attn_weights = attn_weights + float_mask[:, None, None, :]
        attn_probs = F.softmax(attn_weights, dim=-1, dtype=torch.float32)
        attn = attn_probs @ v

        if extra_attention_mask.any():
            # global tokens attend to every non-padding key with their own projections
            q_g = self._heads(self.query_global(hidden_states), bsz, seqlen) / math.sqrt(self.head_dim)
            k_g = self._heads(self.key_global(hidden_states), bsz, seqlen)
            v_g = self._heads(self.value_global(hidden_states), bsz, seqlen)
            g_weights = (q_g @ k_g.transpose(-1, -2)).masked_fill(
                key_padding_mask[:, None, None, :], -10000.0)
            g_attn = F.softmax(g_weights, dim=-1, dtype=torch.float32) @ v_g
            attn = torch.where(extra_attention_mask[:, None, :, None], g_attn, attn)

        context_layer = attn.transpose(1, 2).reshape(bsz, seqlen, self.embed_dim)
        return (context_layer,)


class LongformerSelfAttentionForBart(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        self.embed_dim = config.d_model
        self.longformer_self_attn = LongformerSelfAttention(config, layer_id=layer_id)
        self.output = nn.Linear(self.embed_dim, self.embed_dim)

    def forward(self, query, key, key_padding_mask=None, layer_state=None, attn_mask=None,
                need_weights=False, output_attentions=False):
        tgt_len, bsz, embed_dim = query.size()
        assert embed_dim == self.embed_dim
        assert attn_mask is None
        outputs = self.longformer_self_attn(
            query.transpose(0, 1),  # LongformerSelfAttention expects (bsz, seqlen, embd_dim)
            attention_mask=key_padding_mask.unsqueeze(dim=1).unsqueeze(dim=1) * -1,
            head_mask=None,
            encoder_hidden_states=None,
            encoder_attention_mask=None,
            output_attentions=output_attentions,
        )
        attn_output = outputs[0].transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        attn_output = self.output(attn_output)
        return attn_output, None


class EncoderLayer(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        self.embed_dim = config.d_model
        self.self_attn = LongformerSelfAttentionForBart(config, layer_id=layer_id)
        self.self_attn_layer_norm = nn.LayerNorm(self.embed_dim)
        self.fc1 = nn.Linear(self.embed_dim, config.encoder_ffn_dim)
        self.fc2 = nn.Linear(config.encoder_ffn_dim, self.embed_dim)
        self.final_layer_norm = nn.LayerNorm(self.embed_dim)

    def forward(self, x, encoder_padding_mask):
        residual = x
        x, attn_weights = self.self_attn(query=x, key=x, key_padding_mask=encoder_padding_mask)
        x = self.self_attn_layer_norm(residual + x)
        residual = x
        x = self.fc2(F.gelu(self.fc1(x)))
        x = self.final_layer_norm(residual + x)
        return x, attn_weights


class BartEncoder(nn.Module):
    def __init__(self, config, embed_tokens):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.embed_positions = nn.Embedding(config.max_position_embeddings, config.d_model)
        self.layers = nn.ModuleList([EncoderLayer(config, i) for i in range(config.encoder_layers)])
        self.layernorm_embedding = nn.LayerNorm(config.d_model)

    def forward(self, input_ids, attention_mask=None):
        # check attention mask and invert
        if attention_mask is not None:
            if FIXED:
                attention_mask = (1.0 - attention_mask)
            else:
                attention_mask = invert_mask(attention_mask)
        inputs_embeds = self.embed_tokens(input_ids)
        embed_pos = self.embed_positions(torch.arange(input_ids.shape[1]))
        x = self.layernorm_embedding(inputs_embeds + embed_pos)
        # B x T x C -> T x B x C
        x = x.transpose(0, 1)
        for encoder_layer in self.layers:
            x, attn = encoder_layer(x, attention_mask)
        return x.transpose(0, 1)


def main():
    torch.manual_seed(0)
    config = LongformerEncoderDecoderConfig(attention_window=[4, 4], attention_dilation=[1, 1])
    encoder = BartEncoder(config, nn.Embedding(config.vocab_size, config.d_model, config.pad_token_id)).eval()
    seqlen = 16
    input_ids = torch.randint(3, config.vocab_size, (2, seqlen))
    input_ids[1, 11:] = config.pad_token_id
    # Attention mask values -- 0: no attention, 1: local attention, 2: global attention
    attention_mask = (input_ids != config.pad_token_id).long()
    attention_mask[:, 0] = 2
    with torch.no_grad():
        out = encoder(input_ids, attention_mask=attention_mask)
    print("<s> state:", [round(float(x), 4) for x in out[:, 0, :3].flatten()])


if __name__ == "__main__":
    main()
