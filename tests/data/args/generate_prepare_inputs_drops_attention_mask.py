# The padding-ignored slip of parler-tts#225 (generate prepares the left-padded prompts' attention mask, then the
# model runs without it), written another way: a decoder-only LM whose config states pad_token_id, SDPA attention,
# a cache kept in a list, and a prepare_inputs_for_generation that builds every step's inputs without the
# attention_mask, so the model falls back to plain causal attention over the pads. The fix hands the mask on, one
# column longer each step.
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class Config:
    vocab_size: int = 24
    hidden_size: int = 16
    num_attention_heads: int = 2
    num_hidden_layers: int = 2
    pad_token_id: int = 0


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.heads = config.num_attention_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x, past, mask):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=past is None and t > 1)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(b, t, d)), (k, v)


class TinyLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Attention(config) for _ in range(config.num_hidden_layers))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, input_ids, attention_mask=None, past_key_values=None):
        x = self.wte(input_ids)
        t = input_ids.shape[1]
        mask = None
        if attention_mask is not None:
            keep = attention_mask.bool()
            queries = keep[:, -t:]
            total = keep.shape[1]
            causal = torch.ones(t, total, dtype=torch.bool).tril(total - t)
            # a padded query keeps its causal keys (no row without a key); a real query never sees a pad
            mask = (causal[None] & (keep[:, None, :] | ~queries[:, :, None]))[:, None]
        presents = []
        for i, layer in enumerate(self.layers):
            y, present = layer(x, None if past_key_values is None else past_key_values[i], mask)
            x = x + y
            presents.append(present)
        return self.lm_head(x), presents

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None):
        if past_key_values is not None:
            input_ids = input_ids[:, -1:]
        inputs = {"input_ids": input_ids, "past_key_values": past_key_values}
        if FIXED:
            inputs["attention_mask"] = attention_mask
        return inputs

    @torch.no_grad()
    def generate(self, input_ids, attention_mask, max_new_tokens=3):
        past = None
        for _ in range(max_new_tokens):
            logits, past = self(**self.prepare_inputs_for_generation(input_ids, past, attention_mask))
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            input_ids = torch.cat([input_ids, nxt], 1)
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], 1)], 1)
        return input_ids


model = TinyLM(Config()).eval()
input_ids = torch.tensor([[5, 9, 3, 7, 11], [0, 0, 4, 8, 6]])  # the second prompt left-padded with pad_token_id 0
attention_mask = (input_ids != model.config.pad_token_id).long()
print("generated:", model.generate(input_ids, attention_mask).tolist())
