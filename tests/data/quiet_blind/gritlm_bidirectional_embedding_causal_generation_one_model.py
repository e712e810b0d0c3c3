"""GritLM: one decoder used bidirectionally for embeddings and causally for generation.

Follows ContextualAI/gritlm gritlm/gritlm.py (GritLM.encode: the tokenizer batch gets ``is_causal=False`` for
attn="bbcc", mean pooling over the real tokens after the instruction, ``instruction_lens`` zeroed out of the
pooling mask only, not out of attention) and scripts/modeling_mistral_gritlm.py (the Mistral forward takes an
``is_causal`` argument and builds the 4D mask from it). Written here as a tiny plain-torch Mistral-like model.
Mask meant: embedding pass -- every real token sees every real token of its own text (instruction included),
pad keys hidden; generation pass -- causal over real tokens, pad keys hidden.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class MistralConfig:
    vocab_size: int = 50
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_hidden_layers: int = 2
    pad_token_id: int = 0


def build_attention_mask(attention_mask, is_causal):
    """Boolean [B, 1, q, k], True = may attend."""
    bsz, seq_len = attention_mask.shape
    allowed = attention_mask.bool()[:, None, None, :].expand(bsz, 1, seq_len, seq_len)
    if is_causal:
        allowed = allowed & torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    return allowed


class MistralAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, mask):
        bsz, q_len, _ = hidden_states.shape
        q, k, v = self.qkv_proj(hidden_states).view(bsz, q_len, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        attn_weights = torch.where(mask, attn_weights, torch.finfo(attn_weights.dtype).min)
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32)
        out = torch.matmul(attn_weights, v).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(out)


class MistralDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = MistralAttention(config)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, 64), nn.SiLU(), nn.Linear(64, config.hidden_size))
        self.input_layernorm = nn.RMSNorm(config.hidden_size)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size)

    def forward(self, x, mask):
        x = x + self.self_attn(self.input_layernorm(x), mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class MistralModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.pos = nn.Embedding(64, config.hidden_size)
        self.layers = nn.ModuleList([MistralDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = nn.RMSNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask, is_causal=True):
        h = self.embed_tokens(input_ids) + self.pos(torch.arange(input_ids.size(1)))
        mask = build_attention_mask(attention_mask, is_causal)
        for layer in self.layers:
            h = layer(h, mask)
        return self.norm(h)


class GritLM:
    def __init__(self, model, pooling_method="mean", attn="bbcc"):
        self.model = model
        self.pooling_method = pooling_method
        self.attn = attn

    def encode(self, input_ids, attention_mask, instruction_lens):
        is_causal = self.attn[:2] == "cc"
        last_hidden_state = self.model(input_ids, attention_mask, is_causal=is_causal)
        # instruction tokens are attended to but left out of the pooled embedding
        pool_mask = attention_mask.clone()
        for i, l in enumerate(instruction_lens):
            pool_mask[i, :l] = 0
        s = torch.sum(last_hidden_state * pool_mask.unsqueeze(-1).float(), dim=1)
        return s / pool_mask.sum(dim=1, keepdim=True).float()

    def generate_logits(self, input_ids, attention_mask):
        is_causal = self.attn[2:] == "cc"
        return self.model.lm_head(self.model(input_ids, attention_mask, is_causal=is_causal))


def main():
    torch.manual_seed(0)
    config = MistralConfig()
    grit = GritLM(MistralModel(config).eval())
    lengths, instruction_lens = [9, 6, 4], [3, 2, 2]
    input_ids = torch.randint(1, config.vocab_size, (3, 9))
    attention_mask = torch.zeros(3, 9, dtype=torch.long)
    for b, n in enumerate(lengths):
        input_ids[b, n:] = config.pad_token_id
        attention_mask[b, :n] = 1
    with torch.no_grad():
        emb = grit.encode(input_ids, attention_mask, instruction_lens)
        logits = grit.generate_logits(input_ids, attention_mask)
        for b, n in enumerate(lengths):
            ids, am = input_ids[b:b + 1, :n], attention_mask[b:b + 1, :n]
            assert torch.allclose(emb[b], grit.encode(ids, am, instruction_lens[b:b + 1])[0], atol=1e-5)
            assert torch.allclose(logits[b, :n], grit.generate_logits(ids, am)[0], atol=1e-5)
        # embeddings are bidirectional: changing the last token moves the first token's state;
        # generation is causal: it does not
        changed = input_ids[:1].clone()
        changed[0, 8] = (changed[0, 8] % (config.vocab_size - 1)) + 1
        first_bi = grit.model(changed, attention_mask[:1], is_causal=False)[0, 0]
        first_causal = grit.model(changed, attention_mask[:1], is_causal=True)[0, 0]
        assert not torch.allclose(first_bi, grit.model(input_ids[:1], attention_mask[:1], is_causal=False)[0, 0])
        assert torch.allclose(first_causal, grit.model(input_ids[:1], attention_mask[:1], is_causal=True)[0, 0])
    print("gritlm ok", tuple(emb.shape), tuple(logits.shape))


if __name__ == "__main__":
    main()
