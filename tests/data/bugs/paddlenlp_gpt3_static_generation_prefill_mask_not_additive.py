# PaddlePaddle/PaddleNLP#4986 ("fix static gpt3 generation attention_mask").
#
# Bug read in examples/language_model/gpt-3/static/modeling.py @0025c3d29c3f (GPTForGeneration.forward).
# The static-graph GPT-3 generation model
# takes the caller's `input_mask` as 1 = token / 0 = pad (a left-padded prompt batch). For the context
# (prefill) pass it built `encode_mask = attention_mask + causal_mask`, adding the 1/0 flags to the -1e4
# causal bias as they were, so a prompt's real tokens attended its left padding: the first generated token
# and the cached keys/values came out of a contaminated prefill. The decode loop already converted the mask
# with `(1 - decode_mask) * -1e4`. The fix converts the prompt mask the same way before adding the causal
# bias. Ported to torch with PaddleNLP's names (GPTModel / GPTForGeneration, MultiHeadAttention.Cache,
# src_ids / pos_ids / input_mask inputs), tiny random weights.
import sys
from collections import namedtuple

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class MultiHeadAttention(nn.Module):
    Cache = namedtuple("Cache", ["k", "v"])

    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def _split(self, x):
        b, s, _ = x.shape
        return x.reshape(b, s, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, query, attn_mask=None, use_cache=False, cache=None):
        q = self._split(self.q_proj(query))
        k = self._split(self.k_proj(query))
        v = self._split(self.v_proj(query))
        if cache is not None:
            k = torch.cat([cache.k, k], dim=2)
            v = torch.cat([cache.v, v], dim=2)
        product = torch.matmul(q * self.head_dim ** -0.5, k.transpose(-1, -2))
        if attn_mask is not None:
            product = product + attn_mask
        weights = F.softmax(product, dim=-1)
        out = torch.matmul(weights, v)
        out = out.transpose(1, 2).reshape(query.shape[0], query.shape[1], -1)
        out = self.out_proj(out)
        if use_cache:
            return out, self.Cache(k, v)
        return out


class TransformerDecoderLayer(nn.Module):
    def __init__(self, d_model, nhead, dim_feedforward):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, nhead)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.linear2 = nn.Linear(dim_feedforward, d_model)

    def forward(self, tgt, tgt_mask=None, use_cache=False, cache=None):
        residual = tgt
        tgt = self.norm1(tgt)
        tgt, incremental_cache = self.self_attn(tgt, tgt_mask, use_cache=True, cache=cache)
        tgt = residual + tgt
        residual = tgt
        tgt = self.norm2(tgt)
        tgt = residual + self.linear2(F.gelu(self.linear1(tgt)))
        return tgt, incremental_cache


class GPTEmbeddings(nn.Module):
    def __init__(self, vocab_size, hidden_size, max_position_embeddings):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, hidden_size)
        self.position_embeddings = nn.Embedding(max_position_embeddings, hidden_size)

    def forward(self, input_ids, position_ids=None):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[-1]).unsqueeze(0).expand_as(input_ids)
        return self.word_embeddings(input_ids) + self.position_embeddings(position_ids)


class GPTModel(nn.Module):
    def __init__(self, vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, max_position_embeddings=64, initializer_range=0.02):
        super().__init__()
        self.initializer_range = initializer_range
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.embeddings = GPTEmbeddings(vocab_size, hidden_size, max_position_embeddings)
        self.layers = nn.ModuleList(
            [TransformerDecoderLayer(hidden_size, num_attention_heads, intermediate_size)
             for _ in range(num_hidden_layers)])
        self.norm = nn.LayerNorm(hidden_size)
        self.apply(self.init_weights)

    def init_weights(self, layer):
        # GPTPretrainedModel.init_weights: normal(0, initializer_range) on Linear / Embedding weights.
        if isinstance(layer, (nn.Linear, nn.Embedding)):
            layer.weight.data.normal_(mean=0.0, std=self.initializer_range)

    def forward(self, input_ids, position_ids=None, attention_mask=None, use_cache=False, cache=None):
        output = self.embeddings(input_ids, position_ids)
        new_caches = []
        for i, layer in enumerate(self.layers):
            output, new_cache = layer(output, tgt_mask=attention_mask, use_cache=use_cache,
                                      cache=None if cache is None else cache[i])
            new_caches.append(new_cache)
        output = self.norm(output)
        if use_cache:
            return output, new_caches
        return output


class GPTForGeneration(nn.Module):
    def __init__(self, gpt, max_length=6, eos_id=None):
        super().__init__()
        self.gpt = gpt
        self.vocab_size = gpt.vocab_size
        self.eos_token_id = eos_id or 7
        self.max_dec_len = max_length

    def model(self, input_ids, position_ids=None, attention_mask=None, use_cache=False, cache=None):
        outputs = self.gpt(input_ids, position_ids=position_ids, attention_mask=attention_mask,
                           use_cache=use_cache, cache=cache)
        encoder_outputs, cached_kvs = outputs[:2]
        logits = torch.matmul(encoder_outputs, self.gpt.embeddings.word_embeddings.weight.t())
        return logits, cached_kvs

    @torch.no_grad()
    def forward(self, inputs):
        ######### forward context #########
        input_ids = inputs["src_ids"]
        position_ids = inputs["pos_ids"] if "pos_ids" in inputs else None
        attention_mask = inputs["input_mask"] if "input_mask" in inputs else None

        seq_len = input_ids.shape[-1]
        causal_mask = torch.triu(torch.ones(seq_len, seq_len) * -1e4, diagonal=1)
        if attention_mask is not None:
            tgt_pos = attention_mask.sum(dim=-1, keepdim=True).long()
            if attention_mask.dim() == 2:
                attention_mask = attention_mask[:, None, None, :]
            if FIXED:
                encode_mask = (1.0 - attention_mask) * -1e4 + causal_mask
            else:
                encode_mask = attention_mask + causal_mask
        else:
            encode_mask = causal_mask
            tgt_pos = None

        logits, cached_kvs = self.model(input_ids, position_ids, encode_mask, use_cache=True, cache=None)
        next_id = logits[:, -1, :].argmax(dim=-1).reshape(-1, 1)
        ####################################

        ids = [next_id]
        if attention_mask is not None:
            append_mask = torch.ones(next_id.shape[0], 1, 1, 1, dtype=attention_mask.dtype)
        for step_idx in range(self.max_dec_len - 1):
            pre_ids = ids[-1]
            if attention_mask is not None:
                decode_mask = torch.cat([attention_mask, append_mask], dim=-1)
                step_pos = tgt_pos + step_idx
                att_mask = (1 - decode_mask) * -1e4
            else:
                att_mask = None
                step_pos = None
            logits, cached_kvs = self.model(pre_ids, step_pos, att_mask, use_cache=True, cache=cached_kvs)
            logits = logits.reshape(-1, self.vocab_size)
            selected_ids = logits.argmax(dim=-1, keepdim=True)  # top_k = 1
            ids.append(selected_ids)
            if attention_mask is not None:
                attention_mask = decode_mask
        return torch.cat(ids, dim=1)


def main():
    gpt = GPTModel(initializer_range=0.3)
    gpt.eval()
    generator = GPTForGeneration(gpt, max_length=6)

    # Two prompts, left padded with pad id 0 (as the static GPT-3 inference script feeds them).
    prompts = [[5, 11, 23, 9, 40, 17, 3], [12, 30, 8]]
    max_len = max(len(p) for p in prompts)
    src_ids = torch.tensor([[0] * (max_len - len(p)) + p for p in prompts])
    input_mask = torch.tensor([[0.0] * (max_len - len(p)) + [1.0] * len(p) for p in prompts])
    pos_ids = (input_mask.cumsum(-1) - 1).clamp(min=0).long()

    out = generator({"src_ids": src_ids, "pos_ids": pos_ids, "input_mask": input_mask})
    for prompt, row in zip(prompts, out.tolist()):
        print(prompt, "->", row)


if __name__ == "__main__":
    main()
