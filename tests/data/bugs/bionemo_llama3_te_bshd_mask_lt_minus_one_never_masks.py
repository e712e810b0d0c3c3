# NVIDIA/bionemo-framework commit 2198daf (bionemo-recipes/models/llama3/modeling_llama_te.py, NVLlamaModel.forward),
# the genomic Llama3 recipe: the HF 2-D mask (1 = attend, 0 = pad) was converted to TE's boolean mask with `< -1`,
# which is False everywhere, so with BSHD input and left padding the padded positions were never masked.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaConfig

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class RotaryPositionEmbedding(nn.Module):
    """TE RotaryPositionEmbedding: returns [s, 1, 1, d] frequencies for positions 0..max_seq_len-1."""

    def __init__(self, dim, base=500000.0):
        super().__init__()
        self.inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))

    def forward(self, max_seq_len):
        freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), self.inv_freq)
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


def apply_rotary_pos_emb(t, freqs):  # t: [b, s, h, d] (bshd)
    freqs = freqs[: t.shape[1]].transpose(0, 1)  # [1, s, 1, d]
    x1, x2 = t.chunk(2, dim=-1)
    return t * freqs.cos() + torch.cat((-x2, x1), dim=-1) * freqs.sin()


class TransformerLayer(nn.Module):
    """Stand-in for transformer_engine.pytorch.TransformerLayer(normalization="RMSNorm", activation="swiglu",
    attn_input_format="bshd", self_attn_mask_type="padding_causal"); TE's boolean mask is True = masked."""

    def __init__(self, config):
        super().__init__()
        self.h = config.num_attention_heads
        self.g = config.num_key_value_heads
        self.d = config.hidden_size // self.h
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.qkv = nn.Linear(config.hidden_size, (self.h + 2 * self.g) * self.d, bias=False)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.post_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.fc1 = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask=None, rotary_pos_emb=None):
        b, s, _ = hidden_states.shape
        q, k, v = self.qkv(self.input_layernorm(hidden_states)).split(
            [self.h * self.d, self.g * self.d, self.g * self.d], dim=-1)
        q = apply_rotary_pos_emb(q.view(b, s, self.h, self.d), rotary_pos_emb).transpose(1, 2)
        k = apply_rotary_pos_emb(k.view(b, s, self.g, self.d), rotary_pos_emb).transpose(1, 2)
        v = v.view(b, s, self.g, self.d).transpose(1, 2)
        k = k.repeat_interleave(self.h // self.g, dim=1)
        v = v.repeat_interleave(self.h // self.g, dim=1)
        keep = torch.ones(s, s, dtype=torch.bool).tril()  # causal part of padding_causal
        if attention_mask is not None:
            keep = keep & ~attention_mask  # [b, 1, 1, s], True = masked
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        hidden_states = hidden_states + self.proj(ctx.transpose(1, 2).reshape(b, s, -1))
        gate, up = self.fc1(self.post_layernorm(hidden_states)).chunk(2, dim=-1)
        return hidden_states + self.fc2(F.silu(gate) * up)


class NVLlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([TransformerLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryPositionEmbedding(config.hidden_size // config.num_attention_heads)

    def forward(self, input_ids, attention_mask=None):
        hidden_states = self.embed_tokens(input_ids)
        if self.config.attn_input_format == "bshd" and attention_mask is not None and attention_mask.dim() == 2:
            if FIXED:
                # Convert HF mask (1=attend, 0=pad) to TE boolean mask (True=masked, False=attend)
                attention_mask = ~attention_mask[:, None, None, :].bool()
            else:
                # If we're using padded BSHD inputs, we need to convert the 2-dimensional mask to a 4-dimensional mask
                # in the expected boolean format for TE.
                attention_mask = attention_mask[:, None, None, :] < -1
        te_rope_emb = self.rotary_emb(max_seq_len=self.config.max_position_embeddings)
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(hidden_states, attention_mask=attention_mask, rotary_pos_emb=te_rope_emb)
        return self.norm(hidden_states)


config = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                     pad_token_id=0)
config.attn_input_format = "bshd"
config.self_attn_mask_type = "padding_causal"
model = NVLlamaModel(config).eval()

# nucleotide byte-level tokens (A, C, G, T, N) left-padded with pad_token_id, as HF generation does
lengths = [20, 11, 15]
L = max(lengths)
input_ids = torch.zeros(3, L, dtype=torch.long)
attention_mask = torch.zeros(3, L, dtype=torch.long)
for i, n in enumerate(lengths):
    input_ids[i, L - n:] = torch.randint(1, 6, (n,))
    attention_mask[i, L - n:] = 1

with torch.no_grad():
    batched = model(input_ids, attention_mask)
    err = 0.0
    for i, n in enumerate(lengths):
        alone = model(input_ids[i:i + 1, L - n:], attention_mask[i:i + 1, L - n:])
        err = max(err, (batched[i, L - n:] - alone[0]).abs().max().item())
print(f"max |left-padded batch - per-sequence| over real tokens: {err:.3e}")
