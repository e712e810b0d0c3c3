"""Medusa speculative decoding: verify a tree of candidate continuations in one forward pass.

Follows FasterDecoding/Medusa medusa/model/utils.py (generate_medusa_buffers: medusa_attn_mask starts as
eye, column 0 (the root) set to 1, each tree node gets 1 on all its ancestors; medusa_position_ids = depth)
and medusa/model/modeling_llama_kv.py (_prepare_decoder_attention_mask: the usual causal mask, then
combined_attention_mask[:, :, -tree_len:, -tree_len:][medusa_mask == 0] = finfo.min).
Mask meant: every tree node sees the whole cached prefix, its ancestors in the tree and itself, but not its
siblings or cousins, even though they sit earlier in the flattened sequence. Position ids are prefix_len + depth,
so several tokens share one position.
"""
import torch
from torch import nn

# the tree: each tuple is a path of top-k indices from the Medusa heads (like medusa_choices.mc_sim_7b_63, cut down)
medusa_choices = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def generate_medusa_buffers(medusa_choices):
    sorted_medusa_choices = sorted(medusa_choices, key=lambda x: (len(x), x))
    medusa_len = len(sorted_medusa_choices) + 1
    medusa_attn_mask = torch.eye(medusa_len, medusa_len)
    medusa_attn_mask[:, 0] = 1
    for i, cur in enumerate(sorted_medusa_choices):
        for c in range(len(cur) - 1):
            ancestor_idx = sorted_medusa_choices.index(cur[:c + 1]) + 1
            medusa_attn_mask[i + 1, ancestor_idx] = 1
    medusa_position_ids = torch.tensor([0] + [len(c) for c in sorted_medusa_choices])
    return {"medusa_attn_mask": medusa_attn_mask[None, None], "medusa_position_ids": medusa_position_ids}


def _prepare_decoder_attention_mask(q_len, past_key_values_length, medusa_mask, dtype):
    kv_len = past_key_values_length + q_len
    min_dtype = torch.finfo(dtype).min
    i = torch.arange(q_len)[:, None] + past_key_values_length
    j = torch.arange(kv_len)[None, :]
    combined_attention_mask = torch.zeros(q_len, kv_len, dtype=dtype).masked_fill(j > i, min_dtype)[None, None]
    if medusa_mask is not None:
        medusa_len = medusa_mask.size(-1)
        combined_attention_mask[:, :, -medusa_len:, -medusa_len:][medusa_mask == 0] = min_dtype
    return combined_attention_mask


def apply_rotary_pos_emb(x, position_ids, base=10000.0):
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (base ** (torch.arange(half, dtype=torch.float32) / half))
    freqs = position_ids[None, None, :, None].float() * inv_freq
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * freqs.cos() - x2 * freqs.sin(), x1 * freqs.sin() + x2 * freqs.cos()], dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value=None):
        bsz, q_len, _ = hidden_states.shape
        shape = (bsz, q_len, self.num_heads, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, position_ids), apply_rotary_pos_emb(k, position_ids)
        if past_key_value is not None:
            k, v = torch.cat([past_key_value[0], k], 2), torch.cat([past_key_value[1], v], 2)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) / self.head_dim ** 0.5 + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32)
        return torch.matmul(attn_weights, v).transpose(1, 2).reshape(bsz, q_len, -1), (k, v)


def main():
    torch.manual_seed(0)
    hidden, vocab = 32, 50
    embed_tokens, attn = nn.Embedding(vocab, hidden), LlamaAttention(hidden)
    buffers = generate_medusa_buffers(medusa_choices)
    medusa_len = buffers["medusa_attn_mask"].shape[-1]
    input_ids = torch.randint(0, vocab, (1, 9))
    with torch.no_grad():
        mask = _prepare_decoder_attention_mask(input_ids.shape[1], 0, None, torch.float32)
        _, past_key_value = attn(embed_tokens(input_ids), mask, torch.arange(input_ids.shape[1]))   # prefill
        tree_candidates = torch.randint(0, vocab, (1, medusa_len))            # root + Medusa-head guesses
        position_ids = buffers["medusa_position_ids"] + input_ids.shape[1]
        mask = _prepare_decoder_attention_mask(medusa_len, input_ids.shape[1], buffers["medusa_attn_mask"],
                                               torch.float32)
        tree_out, _ = attn(embed_tokens(tree_candidates), mask, position_ids, past_key_value)
    print("tree", tuple(tree_out.shape), "positions", position_ids.tolist())


if __name__ == "__main__":
    main()
