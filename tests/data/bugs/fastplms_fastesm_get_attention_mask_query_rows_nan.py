# Synthyra/FastPLMs commit 0a5ffc4 (FastESM2, esm2/modeling_fastesm.py get_attention_mask).
# The SDPA/manual mask was built as query&key (pad x pad), so padded query rows were fully masked:
# softmax(-inf,...) = NaN on the manual path, which then leaks into real residues through V at the next layer.
import sys

import torch
import torch.nn as nn
from torch.nn import functional as F
from transformers import EsmConfig
from transformers.models.esm.modeling_esm import (
    EsmEmbeddings,
    EsmIntermediate,
    EsmOutput,
    EsmSelfOutput,
)

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# RotaryEmbedding as FastPLMs imported it from transformers' ESM (the q/k rotary of the ESM repo);
# re-declared here because the installed transformers no longer exports it.
def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(x, cos, sin):
    cos = cos[:, :, : x.shape[-2], :]
    sin = sin[:, :, : x.shape[-2], :]
    return (x * cos) + (rotate_half(x) * sin)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, q, k):
        t = torch.arange(k.shape[-2], device=k.device).type_as(self.inv_freq)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1).to(k.device)
        cos, sin = emb.cos()[None, None, :, :], emb.sin()[None, None, :, :]
        return apply_rotary_pos_emb(q, cos, sin), apply_rotary_pos_emb(k, cos, sin)


def get_attention_mask(batch_size, seq_len, device, attention_mask=None):
    """Build padding masks once for all encoder layers (SDPA / manual backend)."""
    if attention_mask is None:
        return None, None
    attention_mask_2d = attention_mask.bool()
    if FIXED:
        # SDPA / manual -- only mask the key dimension so padding query positions attend to
        # real keys and produce valid (non-NaN) outputs instead of NaN from softmax(-inf,...,-inf).
        attention_mask_4d = attention_mask_2d[:, None, None, :]
    else:
        attention_mask_4d = attention_mask_2d[:, None, :, None] & attention_mask_2d[:, None, None, :]
    return attention_mask_2d, attention_mask_4d


class EsmSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = int(config.hidden_size / config.num_attention_heads)
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        self.scale = self.attention_head_size ** -0.5
        self.rotary_embeddings = RotaryEmbedding(dim=self.attention_head_size)

    def forward(self, hidden_states, attention_mask_4d=None, output_attentions=False):
        batch_size, seq_length = hidden_states.shape[:-1]
        hidden_shape = (batch_size, seq_length, -1, self.attention_head_size)
        query_BHLD = self.query(hidden_states).view(hidden_shape).transpose(1, 2)
        key_BHLD = self.key(hidden_states).view(hidden_shape).transpose(1, 2)
        value_BHLD = self.value(hidden_states).view(hidden_shape).transpose(1, 2)
        query_BHLD = query_BHLD * self.scale
        query_BHLD, key_BHLD = self.rotary_embeddings(query_BHLD, key_BHLD)
        if output_attentions:
            return self._manual_attn(query_BHLD, key_BHLD, value_BHLD, attention_mask_4d)
        return self._sdpa_attn(query_BHLD, key_BHLD, value_BHLD, attention_mask_4d)

    def _manual_attn(self, query_BHLD, key_BHLD, value_BHLD, attention_mask_4d=None):
        attn_weights = torch.matmul(query_BHLD, key_BHLD.transpose(-1, -2))
        if attention_mask_4d is not None:
            attn_weights = attn_weights.masked_fill(attention_mask_4d.logical_not(), float("-inf"))
        attn_weights = F.softmax(attn_weights, dim=-1)
        context_BHLD = torch.matmul(attn_weights, value_BHLD)
        b, h, s, d = context_BHLD.shape
        return context_BHLD.transpose(1, 2).reshape(b, s, h * d), attn_weights

    def _sdpa_attn(self, query_BHLD, key_BHLD, value_BHLD, attention_mask_4d=None):
        context_BHLD = F.scaled_dot_product_attention(
            query_BHLD, key_BHLD, value_BHLD, attn_mask=attention_mask_4d, scale=1.0)
        b, h, s, d = context_BHLD.shape
        return context_BHLD.transpose(1, 2).reshape(b, s, h * d), None


class EsmAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self = EsmSelfAttention(config)
        self.output = EsmSelfOutput(config)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask_4d=None, output_attentions=False):
        hidden_states_ln = self.LayerNorm(hidden_states)
        attn_output, attn_weights = self.self(hidden_states_ln, attention_mask_4d, output_attentions)
        return self.output(attn_output, hidden_states), attn_weights


class EsmLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = EsmAttention(config)
        self.intermediate = EsmIntermediate(config)
        self.output = EsmOutput(config)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask_4d=None, output_attentions=False):
        attention_output, attn_weights = self.attention(hidden_states, attention_mask_4d, output_attentions)
        attention_output_ln = self.LayerNorm(attention_output)
        layer_output = self.output(self.intermediate(attention_output_ln), attention_output)
        return layer_output, attn_weights


class FastEsmModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings = EsmEmbeddings(config)
        self.layer = nn.ModuleList([EsmLayer(config) for _ in range(config.num_hidden_layers)])
        self.emb_layer_norm_after = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids, attention_mask=None, output_attentions=False):
        hidden_states = self.embeddings(input_ids=input_ids, attention_mask=attention_mask)
        _, attention_mask_4d = get_attention_mask(input_ids.shape[0], input_ids.shape[1],
                                                  input_ids.device, attention_mask)
        attentions = ()
        for layer_module in self.layer:
            hidden_states, attn_weights = layer_module(hidden_states, attention_mask_4d, output_attentions)
            attentions += (attn_weights,)
        return self.emb_layer_norm_after(hidden_states), attentions


config = EsmConfig(vocab_size=33, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=64, max_position_embeddings=64, position_embedding_type="rotary",
                   pad_token_id=1, mask_token_id=32, token_dropout=False, emb_layer_norm_before=False,
                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
model = FastEsmModel(config).eval()

# ESM alphabet: <cls>=0 <pad>=1 <eos>=2, residues 4..23
lengths = [12, 7, 9]
L = max(lengths)
input_ids = torch.full((3, L), 1)
attention_mask = torch.zeros(3, L, dtype=torch.long)
for i, n in enumerate(lengths):
    input_ids[i, :n] = torch.cat([torch.tensor([0]), torch.randint(4, 24, (n - 2,)), torch.tensor([2])])
    attention_mask[i, :n] = 1

with torch.no_grad():
    # embedding with attention maps (output_attentions=True takes the manual path)
    batched, _ = model(input_ids, attention_mask, output_attentions=True)
    diffs = []
    for i, n in enumerate(lengths):
        alone, _ = model(input_ids[i:i + 1, :n], attention_mask[i:i + 1, :n], output_attentions=True)
        diffs.append((batched[i, :n] - alone[0]).abs().max())
err = torch.stack(diffs).max().item()  # NaN propagates
print(f"NaN real-residue embeddings in the padded batch: {int(torch.isnan(batched[attention_mask.bool()]).any(-1).sum())}")
print(f"max |batched - per-sequence| over real residues (output_attentions path): {err}")
