# pytorch/translate, pytorch/translate#230 (commit 398657f, "self_attn_mask").
# After fairseq's refactor moved the future mask out of MultiheadAttention, pytorch_translate's TransformerDecoder
# kept calling fairseq's TransformerDecoderLayer without self_attn_mask, so teacher-forced training attended to future targets.
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def fill_with_neg_inf(t):
    """FP16-compatible function that fills a tensor with -inf."""
    return t.float().fill_(float("-inf")).type_as(t)


class MultiheadAttention(nn.Module):
    """fairseq.modules.MultiheadAttention (2018): hand-written softmax(QK^T) with attn_mask / key_padding_mask."""

    def __init__(self, embed_dim, num_heads, dropout=0.0):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.in_proj_weight = nn.Parameter(torch.Tensor(3 * embed_dim, embed_dim))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * embed_dim))
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        nn.init.xavier_uniform_(self.in_proj_weight)

    def forward(self, query, key, value, key_padding_mask=None, incremental_state=None,
                need_weights=True, static_kv=False, attn_mask=None):
        qkv_same = query.data_ptr() == key.data_ptr() == value.data_ptr()
        tgt_len, bsz, embed_dim = query.size()

        if incremental_state is not None:
            saved_state = incremental_state.setdefault(id(self), {})
            if "prev_key" in saved_state and static_kv:
                key = value = None
        else:
            saved_state = None

        if qkv_same:
            q, k, v = F.linear(query, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        else:
            q = F.linear(query, self.in_proj_weight[:embed_dim], self.in_proj_bias[:embed_dim])
            if key is None:
                k = v = None
            else:
                k, v = F.linear(key, self.in_proj_weight[embed_dim:], self.in_proj_bias[embed_dim:]).chunk(2, dim=-1)
        q = q * self.scaling

        if saved_state is not None:
            if "prev_key" in saved_state:
                if static_kv:
                    k, v = saved_state["prev_key"], saved_state["prev_value"]
                else:
                    k = torch.cat((saved_state["prev_key"], k), dim=0)
                    v = torch.cat((saved_state["prev_value"], v), dim=0)
            saved_state["prev_key"] = k
            saved_state["prev_value"] = v

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
        return attn, attn_weights.view(bsz, self.num_heads, tgt_len, src_len).sum(dim=1) / self.num_heads


class TransformerDecoderLayer(nn.Module):
    """fairseq.models.transformer.TransformerDecoderLayer (post-refactor: causal mask comes in as self_attn_mask)."""

    def __init__(self, embed_dim=32, heads=4, ffn_dim=64):
        super().__init__()
        self.self_attn = MultiheadAttention(embed_dim, heads)
        self.self_attn_layer_norm = nn.LayerNorm(embed_dim)
        self.encoder_attn = MultiheadAttention(embed_dim, heads)
        self.encoder_attn_layer_norm = nn.LayerNorm(embed_dim)
        self.fc1 = nn.Linear(embed_dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, embed_dim)
        self.final_layer_norm = nn.LayerNorm(embed_dim)

    def forward(self, x, encoder_out, encoder_padding_mask, incremental_state,
                prev_self_attn_state=None, prev_attn_state=None, self_attn_mask=None,
                self_attn_padding_mask=None):
        residual = x
        x, _ = self.self_attn(query=x, key=x, value=x, key_padding_mask=self_attn_padding_mask,
                              incremental_state=incremental_state, need_weights=False, attn_mask=self_attn_mask)
        x = self.self_attn_layer_norm(residual + x)
        residual = x
        x, attn = self.encoder_attn(query=x, key=encoder_out, value=encoder_out,
                                    key_padding_mask=encoder_padding_mask,
                                    incremental_state=incremental_state, static_kv=True)
        x = self.encoder_attn_layer_norm(residual + x)
        residual = x
        x = self.fc2(F.relu(self.fc1(x)))
        x = self.final_layer_norm(residual + x)
        return x, attn


class TransformerDecoder(nn.Module):
    """pytorch_translate.transformer.TransformerDecoder (training/incremental path, no onnx trace)."""

    def __init__(self, vocab=40, embed_dim=32, layers=2, padding_idx=1):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, embed_dim, padding_idx=padding_idx)
        self.embed_scale = math.sqrt(embed_dim)
        self.padding_idx = padding_idx
        self.layers = nn.ModuleList([TransformerDecoderLayer(embed_dim) for _ in range(layers)])
        self.embed_out = nn.Parameter(torch.randn(vocab, embed_dim) * embed_dim ** -0.5)

    def embed_positions(self, tokens):
        # sinusoidal positions, offset by padding_idx + 1 as in fairseq
        dim = self.embed_tokens.embedding_dim
        pos = torch.arange(tokens.size(1)).float() + self.padding_idx + 1
        inv = torch.exp(torch.arange(dim // 2).float() * -(math.log(10000) / (dim // 2 - 1)))
        ang = pos[:, None] * inv[None]
        return torch.cat([ang.sin(), ang.cos()], dim=1).unsqueeze(0).expand(tokens.size(0), -1, -1)

    def forward(self, prev_output_tokens, encoder_out, incremental_state=None):
        (encoder_x, src_tokens, encoder_padding_mask) = encoder_out
        positions = self.embed_positions(prev_output_tokens)
        if incremental_state is not None:
            prev_output_tokens = prev_output_tokens[:, -1:]
            positions = positions[:, -1:]
        x = self.embed_scale * self.embed_tokens(prev_output_tokens)
        x += positions
        x = x.transpose(0, 1)  # B x T x C -> T x B x C

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

        x = x.transpose(0, 1)  # T x B x C -> B x T x C
        return F.linear(x, self.embed_out), attn

    def buffered_future_mask(self, tensor):
        dim = tensor.size(0)
        if not hasattr(self, "_future_mask") or self._future_mask is None \
                or self._future_mask.device != tensor.device:
            self._future_mask = torch.triu(fill_with_neg_inf(tensor.new(dim, dim)), 1)
        if self._future_mask.size(0) < dim:
            self._future_mask = torch.triu(fill_with_neg_inf(self._future_mask.resize_(dim, dim)), 1)
        return self._future_mask[:dim, :dim]


decoder = TransformerDecoder()
bsz, src_len, tgt_len = 2, 9, 7
encoder_x = torch.randn(src_len, bsz, 32)            # T x B x C, as pytorch_translate's encoder returns
src_tokens = torch.randint(4, 40, (bsz, src_len))
src_tokens[1, 6:] = 1
encoder_padding_mask = src_tokens.eq(1)
encoder_out = (encoder_x, src_tokens, encoder_padding_mask)
prev_output_tokens = torch.randint(4, 40, (bsz, tgt_len))
target = torch.randint(4, 40, (bsz, tgt_len))

# teacher-forced training step
decoder.train()
logits, _ = decoder(prev_output_tokens, encoder_out)
loss = F.cross_entropy(logits.reshape(-1, 40), target.reshape(-1))
loss.backward()

# reference: incremental (step-by-step) decoding sees only the prefix, as at inference
with torch.no_grad():
    incremental_state = {}
    steps = [decoder(prev_output_tokens[:, :t + 1], encoder_out, incremental_state)[0] for t in range(tgt_len)]
    inc_logits = torch.cat(steps, dim=1)

diff = (logits.detach() - inc_logits).abs().max().item()
print(f"train loss = {loss.item():.4f}; max |teacher-forced logits - incremental logits| = {diff:.6f}")
