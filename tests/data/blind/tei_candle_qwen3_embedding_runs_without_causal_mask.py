# Citation: huggingface/text-embeddings-inference#646 ("Fix Qwen3", commit 1193add) together with its
#   follow-up huggingface/text-embeddings-inference#648 ("Fix Qwen3-Embedding batch vs single inference
#   inconsistency", commit f7aa35b). Code read at 1193add^ (before) and f7aa35b (after).
# Upstream: backends/candle/src/models/qwen3.rs -- Qwen3Model::forward (padded-batch preparation,
#   attention_bias, LastToken pooling), Qwen3Model::get_causal_attention_bias (added by the fix),
#   Qwen3Attention::forward (CPU path: scores * scale + attention_bias, softmax); layers/rotary.rs and
#   layers/rms_norm.rs. Rust/candle ported to torch, shrunk to tiny sizes with random weights.
# Bug: Qwen3-Embedding is a causal decoder, but TEI's candle Qwen3Model only ever built a key-padding
#   bias (right padding, -inf on pad keys) and no causal mask; a single request ran with no bias at
#   all. Every token attended to the tokens after it, so the last-token embedding was not the one the
#   model was trained to produce.
# Fix: pad on the left with the eos/pad id, build the padding bias and add a causal (j > i -> f32::MIN)
#   bias from get_causal_attention_bias, also for single sequences (zero bias + causal), and pool the
#   last token at max_length - 1 (batch) / cumulative_seq_lengths[1] - 1 (single).
import sys
from dataclasses import dataclass, field
from typing import List, Optional

import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

F32_MIN = torch.finfo(torch.float32).min


@dataclass
class Qwen3Config:
    attention_bias: bool = False
    vocab_size: int = 64
    head_dim: Optional[int] = 8
    hidden_size: int = 32
    intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    sliding_window: Optional[int] = None
    use_sliding_window: bool = False
    eos_token_id: int = 63


@dataclass
class Batch:
    # text_embeddings_backend_core::Batch: flat (unpadded) ids and positions of all requests
    input_ids: List[int]
    token_type_ids: List[int]
    position_ids: List[int]
    cumulative_seq_lengths: List[int]
    max_length: int
    pooled_indices: List[int]
    raw_indices: List[int] = field(default_factory=list)

    def __len__(self):
        return len(self.cumulative_seq_lengths) - 1


def make_batch(seqs):
    input_ids, position_ids, cu = [], [], [0]
    for s in seqs:
        input_ids += s
        position_ids += list(range(len(s)))
        cu.append(cu[-1] + len(s))
    return Batch(input_ids, [0] * len(input_ids), position_ids, cu,
                 max(len(s) for s in seqs), list(range(len(seqs))))


class Linear:
    def __init__(self, weight, bias=None):
        self.weight, self.bias = weight, bias

    def forward(self, x):
        y = x @ self.weight.t()
        return y if self.bias is None else y + self.bias


class RMSNorm:
    def __init__(self, hidden_size, epsilon):
        self.weight = 1.0 + 0.1 * torch.randn(hidden_size)
        self.epsilon = epsilon

    def forward(self, hidden_states, residual=None):
        # CPU path of layers/rms_norm.rs: returns (normed, residual_add)
        if residual is not None:
            hidden_states = hidden_states + residual
        residual_add = hidden_states
        hidden_size = hidden_states.shape[-1]
        norm_hidden_states = hidden_states.pow(2).sum(-1, keepdim=True) / hidden_size
        hidden_states_normed = hidden_states / (norm_hidden_states + self.epsilon).sqrt()
        return hidden_states_normed * self.weight, residual_add


def get_inv_freqs(dim, base):
    inv_freq = [1.0 / base ** (i / dim) for i in range(0, dim, 2)]
    return torch.tensor(inv_freq, dtype=torch.float32).reshape(1, -1)


def get_cos_sin(length, inv_freqs, repeat_freqs):
    t = torch.arange(length, dtype=torch.float32).reshape(length, 1)
    freqs = t @ inv_freqs
    if repeat_freqs:
        freqs = torch.cat([freqs, freqs], 1)
    return freqs.cos(), freqs.sin()


def apply_rotary(x, cos, sin, attention_head_size):
    dim = attention_head_size // 2
    x1 = x[..., :dim]
    x2 = x[..., dim:2 * dim]
    rotate_x = torch.cat([-x2, x1], -1)
    return x * cos + rotate_x * sin


def w(*shape):
    return torch.randn(*shape) * 0.2


class Qwen3Attention:
    def __init__(self, config: Qwen3Config):
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.head_dim or config.hidden_size // config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        h, d = config.hidden_size, self.attention_head_size
        self.q_proj = Linear(w(self.num_attention_heads * d, h))
        self.k_proj = Linear(w(self.num_key_value_heads * d, h))
        self.v_proj = Linear(w(self.num_key_value_heads * d, h))
        self.o_proj = Linear(w(h, self.num_attention_heads * d))
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.softmax_scale = 1.0 / d ** 0.5

    def forward(self, hidden_states, attention_bias, cos, sin):
        q = self.q_proj.forward(hidden_states)
        k = self.k_proj.forward(hidden_states)
        v = self.v_proj.forward(hidden_states)
        b, s = hidden_states.shape[:2]
        q = q.reshape(b, s, self.num_attention_heads, self.attention_head_size)
        k = k.reshape(b, s, self.num_key_value_heads, self.attention_head_size)
        v = v.reshape(b, s, self.num_key_value_heads, self.attention_head_size)

        q, _ = self.q_norm.forward(q, None)
        k, _ = self.k_norm.forward(k, None)

        q = q.transpose(1, 2)
        k = k.transpose(1, 2)
        v = v.transpose(1, 2)

        q = apply_rotary(q, cos, sin, self.attention_head_size)
        k = apply_rotary(k, cos, sin, self.attention_head_size)

        if self.num_key_value_heads != self.num_attention_heads:
            rep = self.num_attention_heads // self.num_key_value_heads
            bb, hh, ss, dd = k.shape
            k = k.unsqueeze(2).expand(bb, hh, rep, ss, dd).reshape(bb, hh * rep, ss, dd)
            v = v.unsqueeze(2).expand(bb, hh, rep, ss, dd).reshape(bb, hh * rep, ss, dd)

        # CPU path
        attn_weights = q @ k.transpose(-1, -2)
        attn_weights = attn_weights * self.softmax_scale
        if attention_bias is not None:
            attn_weights = attn_weights + attention_bias
        attn_weights = torch.softmax(attn_weights, dim=-1)
        context_layer = attn_weights @ v

        context_layer = context_layer.transpose(1, 2).flatten(-2)
        return self.o_proj.forward(context_layer)


class Qwen3MLP:
    def __init__(self, config: Qwen3Config):
        self.intermediate_size = config.intermediate_size
        gate = w(config.intermediate_size, config.hidden_size)
        up = w(config.intermediate_size, config.hidden_size)
        self.gate_up_proj = Linear(torch.cat([gate, up], 0))
        self.down_proj = Linear(w(config.hidden_size, config.intermediate_size))

    def forward(self, hidden_states):
        gate_up_states = self.gate_up_proj.forward(hidden_states)
        gate_states = gate_up_states[..., :self.intermediate_size]
        up_states = gate_up_states[..., self.intermediate_size:2 * self.intermediate_size]
        gate_states = torch.nn.functional.silu(gate_states)
        return self.down_proj.forward(gate_states * up_states)


class Qwen3Layer:
    def __init__(self, config: Qwen3Config):
        self.attention = Qwen3Attention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layer_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layer_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, attention_bias, cos, sin):
        normed_hidden_states, residual = self.input_layer_norm.forward(hidden_states, None)
        attn_output = self.attention.forward(normed_hidden_states, attention_bias, cos, sin)
        normed_attn_res_output, attn_res = self.post_attention_layer_norm.forward(
            attn_output, residual)
        mlp_output = self.mlp.forward(normed_attn_res_output)
        return mlp_output + attn_res


class Qwen3Model:
    def __init__(self, config: Qwen3Config, pool="last_token"):
        self.embeddings = torch.randn(config.vocab_size, config.hidden_size)
        self.layers = [Qwen3Layer(config) for _ in range(config.num_hidden_layers)]
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_dim = config.head_dim or config.hidden_size // config.num_attention_heads
        inv_freqs = get_inv_freqs(self.rotary_dim, config.rope_theta)
        self.rotary_cache = get_cos_sin(config.max_position_embeddings, inv_freqs, True)
        self.pool = pool
        self.num_attention_heads = config.num_attention_heads
        self.pad_token_id = config.eos_token_id

    def get_causal_attention_bias(self, attention_bias):
        bs, dim, seq_len, _ = attention_bias.shape
        mask = [int(j > i) for i in range(seq_len) for j in range(seq_len)]
        causal_mask = torch.tensor(mask, dtype=torch.uint8).reshape(seq_len, seq_len)
        causal_mask = causal_mask.expand(bs, dim, seq_len, seq_len)
        negatives = torch.full(attention_bias.shape, F32_MIN)
        zeros = torch.zeros_like(attention_bias)
        causal_mask = torch.where(causal_mask.bool(), negatives, zeros)
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
                if not FIXED:
                    for j in range(start, end):
                        input_ids.append(batch.input_ids[j])
                        position_ids.append(batch.position_ids[j])
                        attention_bias.append(0.0)
                    # Pad to max_length
                    for _ in range(seq_length, max_length):
                        input_ids.append(0)
                        position_ids.append(0)
                        attention_bias.append(float("-inf"))
                        masking = True
                else:
                    # Left padding for Qwen3-Embedding (pad at the beginning)
                    padding = max_length - seq_length
                    if padding > 0:
                        masking = True
                        for _ in range(padding):
                            input_ids.append(self.pad_token_id)
                            position_ids.append(0)
                            attention_bias.append(F32_MIN)
                    # Then add the actual sequence
                    for j in range(start, end):
                        input_ids.append(batch.input_ids[j])
                        position_ids.append(batch.position_ids[j])
                        attention_bias.append(0.0)

            input_ids = torch.tensor(input_ids).reshape(shape)
            position_ids = torch.tensor(position_ids).reshape(shape)
            if masking:
                attention_bias = torch.tensor(attention_bias).reshape(batch_size, 1, 1, max_length)
                # Broadcast once instead of at every layer
                attention_bias = attention_bias.expand(
                    batch_size, self.num_attention_heads, max_length, max_length).contiguous()
            else:
                attention_bias = None
        else:
            input_ids = torch.tensor(batch.input_ids).reshape(1, -1)
            position_ids = torch.tensor(batch.position_ids).reshape(1, -1)
            input_lengths = [len(batch.input_ids)]
            if not FIXED:
                attention_bias = None
            else:
                seq_len = len(batch.input_ids)
                # Create attention bias for causal masking even for single sequences
                attention_bias = torch.zeros(1, self.num_attention_heads, seq_len, seq_len)

        if FIXED and attention_bias is not None:
            attention_bias = self.get_causal_attention_bias(attention_bias)

        hidden_states = self.embeddings[input_ids]

        cos = self.rotary_cache[0].index_select(0, position_ids.flatten())
        sin = self.rotary_cache[1].index_select(0, position_ids.flatten())
        cos = cos.reshape(batch_size, 1, max_length, self.rotary_dim)
        sin = sin.reshape(batch_size, 1, max_length, self.rotary_dim)

        for layer in self.layers:
            hidden_states = layer.forward(hidden_states, attention_bias, cos, sin)

        outputs, _ = self.norm.forward(hidden_states, None)

        # Pool::LastToken
        if batch_size > 1:
            results = []
            for i in batch.pooled_indices:
                if not FIXED:
                    last_token_idx = input_lengths[i] - 1
                else:
                    # With left padding, the last token is always at max_length - 1
                    last_token_idx = max_length - 1
                results.append(outputs[i, last_token_idx].unsqueeze(0))
            pooled = torch.cat(results, 0)
        else:
            if not FIXED:
                last_idx = input_lengths[0] - 1
            else:
                last_idx = batch.cumulative_seq_lengths[1] - 1
            pooled = outputs[0, last_idx].unsqueeze(0)
        return pooled, None


def normalize(x):
    return x / x.norm(dim=-1, keepdim=True)


if __name__ == "__main__":
    config = Qwen3Config()
    model = Qwen3Model(config)

    # Three requests of different lengths, each ending with <|endoftext|> as Qwen3-Embedding tokenizes
    lengths = [9, 5, 7]
    seqs = [torch.randint(1, config.vocab_size - 1, (n - 1,)).tolist() + [config.eos_token_id]
            for n in lengths]

    with torch.no_grad():
        batched, _ = model.forward(make_batch(seqs))
        singles = torch.cat([model.forward(make_batch([s]))[0] for s in seqs], 0)

    e_b, e_s = normalize(batched), normalize(singles)
    print("mode:", "fixed" if FIXED else "buggy")
    for i in range(len(seqs)):
        print(f"request {i} (len {lengths[i]}): emb[:4] = {[round(v, 4) for v in e_b[i, :4].tolist()]}"
              f"  cos(batched, single) = {float((e_b[i] * e_s[i]).sum()):.6f}")
    print("query-doc scores:", [round(v, 4) for v in (e_b[0:1] @ e_b[1:].t()).flatten().tolist()])
