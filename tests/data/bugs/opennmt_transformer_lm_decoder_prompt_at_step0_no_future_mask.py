# OpenNMT-py, OpenNMT/OpenNMT-py commit 628b4726 ("fix lm cache decoding that can receive long input requiring masking at step 0").
# TransformerLMDecoderLayer builds dec_mask only when step is None, so a multi-token prompt fed at step 0
# (cached decoding) gets no future mask and every prompt token attends to later prompt tokens.
import math
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class MultiHeadedAttention(nn.Module):
    def __init__(self, head_count, model_dim, dropout=0.0):
        super().__init__()
        self.dim_per_head = model_dim // head_count
        self.model_dim = model_dim
        self.head_count = head_count
        self.linear_keys = nn.Linear(model_dim, head_count * self.dim_per_head)
        self.linear_values = nn.Linear(model_dim, head_count * self.dim_per_head)
        self.linear_query = nn.Linear(model_dim, head_count * self.dim_per_head)
        self.softmax = nn.Softmax(dim=-1)
        self.dropout = nn.Dropout(dropout)
        self.final_linear = nn.Linear(model_dim, model_dim)

    def forward(self, key, value, query, mask=None, layer_cache=None, attn_type=None):
        batch_size = key.size(0)
        dim_per_head = self.dim_per_head
        head_count = self.head_count

        def shape(x):
            return x.view(batch_size, -1, head_count, dim_per_head).transpose(1, 2)

        def unshape(x):
            return x.transpose(1, 2).contiguous().view(batch_size, -1, head_count * dim_per_head)

        if layer_cache is not None:
            if attn_type == "self":
                query, key, value = (
                    self.linear_query(query),
                    self.linear_keys(query),
                    self.linear_values(query),
                )
                key = shape(key)
                value = shape(value)
                if layer_cache["self_keys"] is not None:
                    key = torch.cat((layer_cache["self_keys"], key), dim=2)
                if layer_cache["self_values"] is not None:
                    value = torch.cat((layer_cache["self_values"], value), dim=2)
                layer_cache["self_keys"] = key
                layer_cache["self_values"] = value
        else:
            key = shape(self.linear_keys(key))
            value = shape(self.linear_values(value))
            query = self.linear_query(query)

        query = shape(query)
        key_len = key.size(2)
        query_len = query.size(2)

        query = query / math.sqrt(dim_per_head)
        query_key = torch.matmul(query, key.transpose(2, 3))
        scores = query_key.float()

        if mask is not None:
            mask = mask.unsqueeze(1)  # [B, 1, 1, T_values]
            scores = scores.masked_fill(mask, -1e18)

        attn = self.softmax(scores).to(query.dtype)
        drop_attn = self.dropout(attn)
        context = unshape(torch.matmul(drop_attn, value))
        output = self.final_linear(context)
        attns = attn.view(batch_size, head_count, query_len, key_len)
        return output, attns


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_model, d_ff, dropout=0.0):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-6)
        self.dropout_1 = nn.Dropout(dropout)
        self.activation = nn.ReLU()
        self.dropout_2 = nn.Dropout(dropout)

    def forward(self, x):
        inter = self.dropout_1(self.activation(self.w_1(self.layer_norm(x))))
        output = self.dropout_2(self.w_2(inter))
        return output + x


class TransformerLMDecoderLayer(nn.Module):
    def __init__(self, d_model, heads, d_ff, dropout, attention_dropout):
        super().__init__()
        self.self_attn = MultiHeadedAttention(heads, d_model, dropout=attention_dropout)
        self.feed_forward = PositionwiseFeedForward(d_model, d_ff, dropout)
        self.layer_norm_1 = nn.LayerNorm(d_model, eps=1e-6)
        self.drop = nn.Dropout(dropout)

    def forward(self, *args, **kwargs):
        output, attns = self._forward(*args, **kwargs)
        top_attn = attns[:, 0, :, :].contiguous()
        return output, top_attn, None

    @staticmethod
    def _compute_dec_mask(tgt_pad_mask, future):
        tgt_len = tgt_pad_mask.size(-1)
        if not future:  # apply future_mask, result mask in (B, T, T)
            future_mask = torch.ones([tgt_len, tgt_len], device=tgt_pad_mask.device, dtype=torch.uint8)
            future_mask = future_mask.triu_(1).view(1, tgt_len, tgt_len)
            future_mask = future_mask.bool()
            dec_mask = torch.gt(tgt_pad_mask + future_mask, 0)
        else:  # only mask padding, result mask in (B, 1, T)
            dec_mask = tgt_pad_mask
        return dec_mask

    def _forward_self_attn(self, inputs_norm, dec_mask, layer_cache, step):
        return self.self_attn(inputs_norm, inputs_norm, inputs_norm, mask=dec_mask,
                              layer_cache=layer_cache, attn_type="self")

    def _forward(self, inputs, tgt_pad_mask, layer_cache=None, step=None, future=False):
        dec_mask = None

        if FIXED:
            cond = step is None or inputs.size(1) > 1
        else:
            cond = step is None
        if cond:
            # masking is necessary when sequence length is greater than one
            dec_mask = self._compute_dec_mask(tgt_pad_mask, future)

        inputs_norm = self.layer_norm_1(inputs)
        query, attns = self._forward_self_attn(inputs_norm, dec_mask, layer_cache, step)
        output = self.drop(query) + inputs
        output_feedforward = self.feed_forward(output)
        return output_feedforward, attns


class TransformerLMDecoder(nn.Module):
    def __init__(self, num_layers, d_model, heads, d_ff, dropout, attention_dropout, embeddings):
        super().__init__()
        self.embeddings = embeddings
        self.state = {}
        self.transformer_layers = nn.ModuleList(
            [TransformerLMDecoderLayer(d_model, heads, d_ff, dropout, attention_dropout) for _ in range(num_layers)]
        )
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-6)

    def forward(self, tgt, memory_bank=None, step=None, **kwargs):
        """Decode, possibly stepwise."""
        if step == 0:
            self._init_cache()

        tgt_words = tgt[:, :, 0].transpose(0, 1)
        emb = self.embeddings(tgt[:, :, 0])  # position_encoding=False
        output = emb.transpose(0, 1).contiguous()

        pad_idx = self.embeddings.padding_idx
        tgt_pad_mask = tgt_words.data.eq(pad_idx).unsqueeze(1)  # [B, 1, T_tgt]

        for i, layer in enumerate(self.transformer_layers):
            layer_cache = self.state["cache"]["layer_{}".format(i)] if step is not None else None
            output, attn, _ = layer(output, tgt_pad_mask, layer_cache=layer_cache, step=step)

        output = self.layer_norm(output)
        dec_outs = output.transpose(0, 1).contiguous()
        return dec_outs, {"std": attn.transpose(0, 1).contiguous()}

    def _init_cache(self, memory_bank=None):
        self.state["cache"] = {}
        for i, layer in enumerate(self.transformer_layers):
            self.state["cache"]["layer_{}".format(i)] = {"self_keys": None, "self_values": None}


vocab, pad = 40, 1
emb = nn.Embedding(vocab, 32, padding_idx=pad)
decoder = TransformerLMDecoder(2, 32, 4, 64, 0.0, 0.0, emb).eval()

prompt_len, batch = 7, 2
tokens = torch.randint(4, vocab, (prompt_len + 3, batch, 1))  # [T, B, 1] like OpenNMT

with torch.no_grad():
    # reference: teacher-forced full forward (step=None, future mask applied)
    ref, _ = decoder(tokens, step=None)

    # LM inference: the prompt is fed at step 0, then one token at a time with the cache
    outs = []
    out0, _ = decoder(tokens[:prompt_len], step=0)
    outs.append(out0)
    for t in range(prompt_len, tokens.size(0)):
        o, _ = decoder(tokens[t:t + 1], step=t)
        outs.append(o)
    cached = torch.cat(outs, 0)

diff = (cached - ref).abs().max().item()
print(f"max |cached prompt decoding - full causal forward| = {diff:.6f}")
