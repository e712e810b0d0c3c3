"""text-embeddings-inference candle Qwen3: an equal-length batch runs without the causal mask.

Citation: huggingface/text-embeddings-inference commit a361df66311a05cc9d49ea6ca53595d56495b039
"fix(candle): always apply causal masks for Qwen3 and Gemma3" (diff of
backends/candle/src/models/qwen3.rs read; the PR number was not found).

Bug: `Qwen3Model::forward` (candle backend, Rust) builds an additive `attention_bias` for a batch
of more than one sequence only when some sequence needs left padding (`masking`). The causal
bias is then added by `get_causal_attention_bias` only `if let Some(attn_bias) = attention_bias`.
When every sequence of the batch has the same length there is no padding, `attention_bias` is
None, and the causal model (config `use_bidirectional_attention` unset -> false) silently runs
bidirectional attention; single-sequence requests (always given a zero bias) stay causal.
Fix: when the model is causal and `attention_bias` is None, start from a zero
(batch, heads, L, L) bias and always add the causal mask.

This program: a torch port of the candle model (random weights; q/k RMSNorm, RoPE, grouped-query
heads, softmax over q @ k^T plus the bias), served TEI's way: a packed `Batch` with
`cumulative_seq_lengths`, left-padded into (batch, max_length), last-token pooling. Two texts of
equal length are embedded together.
"""
import sys
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class Qwen3Config:
    vocab_size: int = 100
    hidden_size: int = 32
    intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: Optional[int] = 8
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_position_embeddings: int = 64
    eos_token_id: int = 1
    use_bidirectional_attention: Optional[bool] = None


@dataclass
class Batch:
    input_ids: List[int]
    token_type_ids: List[int]
    position_ids: List[int]
    cumulative_seq_lengths: List[int]
    max_length: int
    pooled_indices: List[int] = field(default_factory=list)
    raw_indices: List[int] = field(default_factory=list)

    def __len__(self):
        return len(self.cumulative_seq_lengths) - 1


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Qwen3Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.attention_head_size = config.head_dim
        self.softmax_scale = self.attention_head_size ** -0.5
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_attention_heads * self.attention_head_size, bias=False)
        self.k_proj = nn.Linear(h, self.num_key_value_heads * self.attention_head_size, bias=False)
        self.v_proj = nn.Linear(h, self.num_key_value_heads * self.attention_head_size, bias=False)
        self.o_proj = nn.Linear(self.num_attention_heads * self.attention_head_size, h, bias=False)
        self.q_norm = nn.RMSNorm(self.attention_head_size, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.attention_head_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_bias, cos, sin):
        b, s, _ = hidden_states.shape
        q = self.q_norm(self.q_proj(hidden_states).view(b, s, self.num_attention_heads, -1)).transpose(1, 2)
        k = self.k_norm(self.k_proj(hidden_states).view(b, s, self.num_key_value_heads, -1)).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, s, self.num_key_value_heads, -1).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        n_rep = self.num_attention_heads // self.num_key_value_heads
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
        attention_scores = (q @ k.transpose(-1, -2)) * self.softmax_scale
        if attention_bias is not None:
            attention_scores = attention_scores + attention_bias
        attention_probs = torch.softmax(attention_scores, dim=-1)
        context_layer = (attention_probs @ v).transpose(1, 2).reshape(b, s, -1)
        return self.o_proj(context_layer)


class Qwen3Layer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = Qwen3Attention(config)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.input_layer_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layer_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_bias, cos, sin):
        h = hidden_states + self.attention(self.input_layer_norm(hidden_states), attention_bias, cos, sin)
        gate, up = self.gate_up_proj(self.post_attention_layer_norm(h)).chunk(2, dim=-1)
        return h + self.down_proj(F.silu(gate) * up)


class Qwen3Model(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Qwen3Layer(config) for _ in range(config.num_hidden_layers)])
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_dim = config.head_dim or config.hidden_size // config.num_attention_heads
        inv_freqs = 1.0 / (config.rope_theta ** (torch.arange(0, self.rotary_dim, 2).float() / self.rotary_dim))
        freqs = torch.outer(torch.arange(config.max_position_embeddings).float(), inv_freqs)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rotary_cache = (emb.cos(), emb.sin())
        self.pad_token_id = config.eos_token_id
        self.num_attention_heads = config.num_attention_heads
        self.use_bidirectional_attention = bool(config.use_bidirectional_attention or False)
        self.dtype = torch.float32

    def get_causal_attention_bias(self, attention_bias):
        bs, dim, seq_len, _ = attention_bias.shape
        i = torch.arange(seq_len)
        causal_mask = (i[None, :] > i[:, None]).expand(bs, dim, seq_len, seq_len)
        min_value = torch.finfo(self.dtype).min
        causal_mask = torch.where(causal_mask, torch.full_like(attention_bias, min_value),
                                  torch.zeros_like(attention_bias))
        return attention_bias + causal_mask

    def forward(self, batch: Batch):
        batch_size = len(batch)
        max_length = batch.max_length
        shape = (batch_size, max_length)
        if batch_size > 1:
            # Prepare padded batch
            input_ids, position_ids, attention_bias, input_lengths = [], [], [], []
            masking = False
            for i in range(batch_size):
                start = batch.cumulative_seq_lengths[i]
                end = batch.cumulative_seq_lengths[i + 1]
                seq_length = end - start
                input_lengths.append(seq_length)
                # Left padding for Qwen3-Embedding (pad at the beginning)
                padding = max_length - seq_length
                if padding > 0:
                    masking = True
                    input_ids += [self.pad_token_id] * padding
                    position_ids += [0] * padding
                    attention_bias += [float("-inf")] * padding
                input_ids += batch.input_ids[start:end]
                position_ids += batch.position_ids[start:end]
                attention_bias += [0.0] * seq_length
            input_ids = torch.tensor(input_ids).view(shape)
            position_ids = torch.tensor(position_ids).view(shape)
            if masking:
                attention_bias = torch.tensor(attention_bias).view(batch_size, 1, 1, max_length)
                # Broadcast once instead of at every layer
                attention_bias = attention_bias.expand(
                    batch_size, self.num_attention_heads, max_length, max_length).contiguous()
            else:
                attention_bias = None
        else:
            input_ids = torch.tensor(batch.input_ids).view(1, -1)
            position_ids = torch.tensor(batch.position_ids).view(1, -1)
            input_lengths = [len(batch.input_ids)]
            seq_len = len(batch.input_ids)
            # Create attention bias for causal masking even for single sequences
            attention_bias = torch.zeros(1, self.num_attention_heads, seq_len, seq_len)

        if self.use_bidirectional_attention:
            pass
        elif attention_bias is not None:
            attention_bias = self.get_causal_attention_bias(attention_bias)
        elif FIXED:
            # causal models must always apply the causal mask, padded batch or not
            attention_bias = self.get_causal_attention_bias(
                torch.zeros(batch_size, self.num_attention_heads, max_length, max_length, dtype=self.dtype))

        hidden_states = self.embeddings(input_ids)
        cos = self.rotary_cache[0][position_ids.flatten()].view(batch_size, 1, max_length, self.rotary_dim)
        sin = self.rotary_cache[1][position_ids.flatten()].view(batch_size, 1, max_length, self.rotary_dim)
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_bias, cos, sin)
        outputs = self.norm(hidden_states)
        # Pool::LastToken: with left padding, the last token is always at max_length - 1
        return torch.stack([outputs[i, max_length - 1] for i in batch.pooled_indices])


def main():
    torch.manual_seed(0)
    config = Qwen3Config()
    model = Qwen3Model(config).eval()
    texts = [[12, 40, 7, 55, 23, 9, 1], [31, 8, 66, 2, 47, 18, 1]]
    batch = Batch(
        input_ids=[t for s in texts for t in s],
        token_type_ids=[0] * sum(len(s) for s in texts),
        position_ids=[p for s in texts for p in range(len(s))],
        cumulative_seq_lengths=[0, len(texts[0]), len(texts[0]) + len(texts[1])],
        max_length=max(len(s) for s in texts),
        pooled_indices=[0, 1],
    )
    with torch.no_grad():
        pooled = model(batch)
        single = model(Batch(texts[0], [0] * len(texts[0]), list(range(len(texts[0]))),
                             [0, len(texts[0])], len(texts[0]), pooled_indices=[0]))
    print("batch vs single cosine:", round(float(F.cosine_similarity(pooled[0], single[0], dim=0)), 5))


if __name__ == "__main__":
    main()
