# pytorch/translate, PR pytorch/translate#230 (commit 398657f): after the fairseq refactor, TransformerDecoder.forward
# called each fairseq TransformerDecoderLayer without self_attn_mask, so the full-sequence (training / scoring) pass had
# no causal mask and every target position attended to future target tokens; the fix passes buffered_future_mask(x).
import sys
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def fill_with_neg_inf(t):
    """FP16-compatible function that fills a tensor with -inf (fairseq.utils)."""
    return t.float().fill_(float("-inf")).type_as(t)


class MultiheadAttention(nn.Module):
    """fairseq.modules.MultiheadAttention (2018): T x B x C, incremental_state holds prev_key/prev_value."""

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.in_proj_weight = nn.Parameter(torch.Tensor(3 * embed_dim, embed_dim))
        self.in_proj_bias = nn.Parameter(torch.Tensor(3 * embed_dim))
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        nn.init.xavier_uniform_(self.in_proj_weight)
        nn.init.normal_(self.in_proj_bias, std=0.02)

    def forward(self, query, key, value, key_padding_mask=None, incremental_state=None,
                need_weights=True, static_kv=False, attn_mask=None):
        qkv_same = query.data_ptr() == key.data_ptr() == value.data_ptr()
        kv_same = key.data_ptr() == value.data_ptr()
        tgt_len, bsz, embed_dim = query.size()

        if incremental_state is not None:
            saved_state = incremental_state.get(id(self), {})
            if "prev_key" in saved_state and static_kv:
                assert kv_same and not qkv_same
                key = value = None
        else:
            saved_state = None

        if qkv_same:
            q, k, v = F.linear(query, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        elif kv_same:
            q = F.linear(query, self.in_proj_weight[:embed_dim], self.in_proj_bias[:embed_dim])
            if key is None:
                k = v = None
            else:
                k, v = F.linear(key, self.in_proj_weight[embed_dim:], self.in_proj_bias[embed_dim:]).chunk(2, dim=-1)
        q = q * self.scaling

        if saved_state is not None:
            if "prev_key" in saved_state:
                if static_kv:
                    k = saved_state["prev_key"]
                else:
                    k = torch.cat((saved_state["prev_key"], k), dim=0)
            if "prev_value" in saved_state:
                if static_kv:
                    v = saved_state["prev_value"]
                else:
                    v = torch.cat((saved_state["prev_value"], v), dim=0)
            saved_state["prev_key"] = k
            saved_state["prev_value"] = v
            incremental_state[id(self)] = saved_state

        src_len = k.size(0)
        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(src_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(src_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)

        attn_weights = torch.bmm(q, k.transpose(1, 2))
        if attn_mask is not None:
            attn_weights += attn_mask.unsqueeze(0)
        if key_padding_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            attn_weights = attn_weights.float().masked_fill(
                key_padding_mask.unsqueeze(1).unsqueeze(2), float("-inf")).type_as(attn_weights)
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_weights = F.softmax(attn_weights.float(), dim=-1).type_as(attn_weights)
        attn_weights = F.dropout(attn_weights, p=self.dropout, training=self.training)
        attn = torch.bmm(attn_weights, v)
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        attn = self.out_proj(attn)
        attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len).sum(dim=1) / self.num_heads
        return attn, attn_weights


class TransformerDecoderLayer(nn.Module):
    """fairseq.models.transformer.TransformerDecoderLayer (post-norm, as in Sept 2018)."""

    def __init__(self, args):
        super().__init__()
        self.embed_dim = args.decoder_embed_dim
        self.self_attn = MultiheadAttention(self.embed_dim, args.decoder_attention_heads)
        self.encoder_attn = MultiheadAttention(self.embed_dim, args.decoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(self.embed_dim)
        self.encoder_attn_layer_norm = nn.LayerNorm(self.embed_dim)
        self.fc1 = nn.Linear(self.embed_dim, args.decoder_ffn_embed_dim)
        self.fc2 = nn.Linear(args.decoder_ffn_embed_dim, self.embed_dim)
        self.final_layer_norm = nn.LayerNorm(self.embed_dim)

    def forward(self, x, encoder_out, encoder_padding_mask, incremental_state,
                prev_self_attn_state=None, prev_attn_state=None, self_attn_mask=None,
                self_attn_padding_mask=None):
        residual = x
        x, _ = self.self_attn(query=x, key=x, value=x, key_padding_mask=self_attn_padding_mask,
                              incremental_state=incremental_state, need_weights=False,
                              attn_mask=self_attn_mask)
        x = self.self_attn_layer_norm(residual + x)
        residual = x
        x, attn = self.encoder_attn(query=x, key=encoder_out, value=encoder_out,
                                    key_padding_mask=encoder_padding_mask,
                                    incremental_state=incremental_state, static_kv=True,
                                    need_weights=not self.training)
        x = self.encoder_attn_layer_norm(residual + x)
        residual = x
        x = F.relu(self.fc1(x))
        x = self.fc2(x)
        x = self.final_layer_norm(residual + x)
        return x, attn


class TransformerDecoder(nn.Module):
    """pytorch_translate.transformer.TransformerDecoder (non-ONNX path), trimmed."""

    def __init__(self, args, vocab_size, padding_idx):
        super().__init__()
        embed_dim = args.decoder_embed_dim
        self.embed_tokens = nn.Embedding(vocab_size, embed_dim, padding_idx=padding_idx)
        self.embed_scale = math.sqrt(embed_dim)
        self.embed_positions = nn.Embedding(64, embed_dim)  # learned positions
        self.layers = nn.ModuleList([TransformerDecoderLayer(args) for _ in range(args.decoder_layers)])
        self.embed_out = nn.Parameter(torch.Tensor(vocab_size, embed_dim))
        nn.init.normal_(self.embed_out, mean=0, std=embed_dim ** -0.5)

    def forward(self, prev_output_tokens, encoder_out, incremental_state=None):
        (encoder_x, src_tokens, encoder_padding_mask) = encoder_out
        pos = torch.arange(prev_output_tokens.size(1)).unsqueeze(0).expand_as(prev_output_tokens)
        positions = self.embed_positions(pos)
        if incremental_state is not None:
            prev_output_tokens = prev_output_tokens[:, -1:]
            positions = positions[:, -1:]
        x = self.embed_scale * self.embed_tokens(prev_output_tokens)
        x += positions
        # B x T x C -> T x B x C
        x = x.transpose(0, 1)
        for layer in self.layers:
            if FIXED:
                x, attn = layer(
                    x,
                    encoder_x,
                    encoder_padding_mask,
                    incremental_state,
                    self_attn_mask=self.buffered_future_mask(x)
                    if incremental_state is None
                    else None,
                )
            else:
                x, attn = layer(x, encoder_x, encoder_padding_mask, incremental_state)
        x = x.transpose(0, 1)
        logits = F.linear(x, self.embed_out)
        return logits, attn

    def buffered_future_mask(self, tensor):
        dim = tensor.size(0)
        if not hasattr(self, "_future_mask") or self._future_mask is None or self._future_mask.device != tensor.device:
            self._future_mask = torch.triu(fill_with_neg_inf(tensor.new(dim, dim)), 1)
        if self._future_mask.size(0) < dim:
            self._future_mask = torch.triu(fill_with_neg_inf(self._future_mask.resize_(dim, dim)), 1)
        return self._future_mask[:dim, :dim]


class Args:
    decoder_embed_dim = 32
    decoder_attention_heads = 4
    decoder_ffn_embed_dim = 64
    decoder_layers = 2


PAD, EOS, V = 1, 2, 20
B, S, T = 2, 7, 6
dec = TransformerDecoder(Args(), V, PAD).eval()

# encoder output as pytorch_translate passes it: (encoder_x T x B x C, src_tokens, encoder_padding_mask B x S)
src_tokens = torch.randint(4, V, (B, S))
src_tokens[1, :2] = PAD  # source is left-padded in fairseq / pytorch_translate
encoder_padding_mask = src_tokens.eq(PAD)
encoder_x = torch.randn(S, B, Args.decoder_embed_dim)
encoder_out = (encoder_x, src_tokens, encoder_padding_mask)

# target shifted right (prev_output_tokens starts with EOS)
prev_output_tokens = torch.cat([torch.full((B, 1), EOS), torch.randint(4, V, (B, T - 1))], dim=1)

with torch.no_grad():
    # full-sequence pass (training / forced-decoding scoring): incremental_state is None
    full_logits, _ = dec(prev_output_tokens, encoder_out)
    # step-by-step incremental decoding, as SequenceGenerator runs it
    incremental_state = {}
    step_logits = []
    for t in range(T):
        lo, _ = dec(prev_output_tokens[:, : t + 1], encoder_out, incremental_state=incremental_state)
        step_logits.append(lo[:, -1])
    step_logits = torch.stack(step_logits, dim=1)

diff = (full_logits - step_logits).abs().max().item()
print(f"max |full-sequence logits - incremental logits| = {diff:.6f}")
