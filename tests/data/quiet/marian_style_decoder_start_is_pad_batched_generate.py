"""A Marian-style translation model (encoder-decoder) generating greedily for a right-padded batch of sources.

As in Marian / mBART / T5 configs, `decoder_start_token_id` is the pad id: every decoder row begins with one token at
the pad id, which is the start token, real, and attended by every later target position. The source's padding is
hidden from the encoder's keys and from the decoder's memory keys; the decoder's self-attention is causal.
The config is a dataclass the model holds (no transformers class), the layers call F.scaled_dot_product_attention.
"""

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class MarianConfig:
    vocab_size: int = 40
    d_model: int = 16
    heads: int = 2
    layers: int = 2
    pad_token_id: int = 3
    eos_token_id: int = 0
    decoder_start_token_id: int = 3  # Marian: the decoder starts from the pad id
    max_new_tokens: int = 4


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.heads = config.heads
        self.q, self.kv, self.o = nn.Linear(config.d_model, config.d_model), nn.Linear(config.d_model, 2 * config.d_model), nn.Linear(config.d_model, config.d_model)

    def forward(self, x, memory, mask):
        b, t, d = x.shape
        q = self.q(x).view(b, t, self.heads, -1).transpose(1, 2)
        k, v = self.kv(memory).view(b, memory.size(1), 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        return self.o(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, d))


class EncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn, self.ff = Attention(config), nn.Linear(config.d_model, config.d_model)

    def forward(self, x, key_mask):
        x = x + self.self_attn(x, x, key_mask)
        return x + torch.relu(self.ff(x))


class DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn, self.memory_attention = Attention(config), Attention(config)
        self.ff = nn.Linear(config.d_model, config.d_model)

    def forward(self, y, memory, self_mask, memory_mask):
        y = y + self.self_attn(y, y, self_mask)
        y = y + self.memory_attention(y, memory, memory_mask)
        return y + torch.relu(self.ff(y))


class MarianDecoder(nn.Module):
    def __init__(self, config, embed):
        super().__init__()
        self.embed = embed
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.layers))

    def forward(self, input_ids, attention_mask, encoder_hidden_states, encoder_attention_mask):
        t = input_ids.size(1)
        self_mask = torch.ones(t, t, dtype=torch.bool).tril()[None, None] & attention_mask.bool()[:, None, None, :]
        memory_mask = encoder_attention_mask.bool()[:, None, None, :]
        y = self.embed(input_ids)
        for layer in self.layers:
            y = layer(y, encoder_hidden_states, self_mask, memory_mask)
        return y


class MarianMTModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model, padding_idx=config.pad_token_id)
        self.encoder_layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.layers))
        self.decoder = MarianDecoder(config, self.embed)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size)

    def encode(self, input_ids, attention_mask):
        key_mask = attention_mask.bool()[:, None, None, :]
        x = self.embed(input_ids)
        for layer in self.encoder_layers:
            x = layer(x, key_mask)
        return x

    @torch.no_grad()
    def generate(self, input_ids, attention_mask):
        memory = self.encode(input_ids, attention_mask)
        out = torch.full((input_ids.size(0), 1), self.config.decoder_start_token_id)
        for _ in range(self.config.max_new_tokens):
            hidden = self.decoder(out, torch.ones_like(out), memory, attention_mask)
            logits = self.lm_head(hidden[:, -1])
            logits[:, self.config.pad_token_id] = float("-inf")  # never generate the pad id
            out = torch.cat([out, logits.argmax(-1, keepdim=True)], 1)
        return out


def main():
    torch.manual_seed(0)
    config = MarianConfig()
    model = MarianMTModel(config).eval()
    src = [[5, 6, 7, 8, 0], [9, 10, 0]]
    width = max(map(len, src))
    input_ids = torch.tensor([s + [config.pad_token_id] * (width - len(s)) for s in src])
    attention_mask = (input_ids != config.pad_token_id).long()
    out = model.generate(input_ids, attention_mask)
    alone = model.generate(input_ids[1:, :3], attention_mask[1:, :3])
    assert torch.equal(out[1], alone[0]), (out, alone)  # the padding changes nothing
    print("translations", out[:, 1:].tolist())


if __name__ == "__main__":
    main()
