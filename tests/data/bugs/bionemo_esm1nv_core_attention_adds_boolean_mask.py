# NVIDIA/bionemo-framework commit beca937 (bionemo/model/protein/esm1nv/attention.py, ESMnvCoreAttention.torch_attention).
# With use_esm_attention the Megatron boolean padding mask (True = masked) was *added* to the scores (+1 on padded
# keys) instead of being turned into a large negative bias, so padded residues were attended to.
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def bert_extended_attention_mask(attention_mask):
    """NeMo megatron utils: [b, s] (1 = token) -> [b, 1, s, s] bool, True = masked."""
    attention_mask_b1s = attention_mask.unsqueeze(1)
    attention_mask_bs1 = attention_mask.unsqueeze(2)
    attention_mask_bss = attention_mask_b1s * attention_mask_bs1
    extended_attention_mask = attention_mask_bss.unsqueeze(1)
    extended_attention_mask = extended_attention_mask < 0.5
    return extended_attention_mask


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t, freqs):
    # t: [s, b, np, hn], freqs: [s, 1, 1, hn]  (NeMo rotary_position_embedding)
    return (t * freqs.cos()) + (rotate_half(t) * freqs.sin())


class RotaryEmbedding(nn.Module):
    def __init__(self, dim):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, max_seq_len):
        seq = torch.arange(max_seq_len, dtype=self.inv_freq.dtype)
        freqs = torch.einsum("i , j -> i j", seq, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]


class ESMnvCoreAttention(nn.Module):
    def __init__(self, num_attention_heads, hidden_size, use_esm_attention=True):
        super().__init__()
        self.np = num_attention_heads
        self.hidden_size_per_attention_head = hidden_size // num_attention_heads
        self.hidden_size_per_partition = hidden_size
        self.use_esm_attention = use_esm_attention
        self.normalize_attention_scores = False  # ESM scales the query itself
        self.norm_factor = math.sqrt(self.hidden_size_per_attention_head)

    def scale_mask_softmax(self, input, mask):
        # MatchedScaleMaskSoftmax with mask=None, scale=None: plain softmax over keys
        if mask is not None:
            input = input.masked_fill(mask, -10000.0)
        return torch.softmax(input, dim=-1)

    def forward(self, query_layer, key_layer, value_layer, attention_mask, rotary_pos_emb=None):
        # BIONEMO custom attention normalization
        if self.use_esm_attention:
            query_layer = query_layer * self.hidden_size_per_attention_head ** -0.5
        if rotary_pos_emb is not None:
            q_pos_emb, k_pos_emb = rotary_pos_emb
            query_layer = apply_rotary_pos_emb(query_layer, q_pos_emb)
            key_layer = apply_rotary_pos_emb(key_layer, k_pos_emb)
        context_layer = self.torch_attention(query_layer, key_layer, value_layer, attention_mask)
        # [b, np, sq, hn] --> [sq, b, hp]
        context_layer = context_layer.permute(2, 0, 1, 3).contiguous()
        return context_layer.view(*context_layer.size()[:-2], self.hidden_size_per_partition)

    def torch_attention(self, query_layer, key_layer, value_layer, attention_mask):
        sq, b, np, hn = query_layer.shape
        sk = key_layer.shape[0]
        query_layer = query_layer.permute(1, 2, 0, 3).reshape(b * np, sq, hn)   # (b np) sq hn
        key_layer = key_layer.permute(1, 2, 3, 0).reshape(b * np, hn, sk)       # (b np) hn sk
        value_layer = value_layer.permute(1, 2, 0, 3).reshape(b * np, sk, hn)   # (b np) sv hn
        matmul_input_buffer = torch.empty(b * np, sq, sk, dtype=query_layer.dtype)
        matmul_result = torch.baddbmm(
            matmul_input_buffer, query_layer, key_layer, beta=0.0,
            alpha=(1.0 / self.norm_factor) if self.normalize_attention_scores else 1.0)
        attention_scores = matmul_result.view(b, np, sq, sk)
        # BIONEMO CUSTOM ATTENTION MASKING
        if self.use_esm_attention:
            if FIXED:
                attention_probs = self.scale_mask_softmax(
                    attention_scores + attention_mask[:, :, 0:1, :] * -3.4028e+38, None)
            else:
                attention_probs = self.scale_mask_softmax(attention_scores + attention_mask, None)
        # END BIONEMO
        else:
            attention_probs = self.scale_mask_softmax(attention_scores, attention_mask)
        attention_probs = attention_probs.reshape(b * np, sq, sk)
        context_layer = torch.bmm(attention_probs, value_layer)
        return context_layer.view(b, np, sq, hn)


class ESMnvParallelTransformerLayer(nn.Module):
    def __init__(self, hidden_size, num_attention_heads, ffn_hidden_size):
        super().__init__()
        self.np = num_attention_heads
        self.hn = hidden_size // num_attention_heads
        self.input_layernorm = nn.LayerNorm(hidden_size)
        self.query_key_value = nn.Linear(hidden_size, 3 * hidden_size)
        self.core_attention = ESMnvCoreAttention(num_attention_heads, hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.post_attention_layernorm = nn.LayerNorm(hidden_size)
        self.dense_h_to_4h = nn.Linear(hidden_size, ffn_hidden_size)
        self.dense_4h_to_h = nn.Linear(ffn_hidden_size, hidden_size)

    def forward(self, hidden_states, attention_mask, rotary_pos_emb):
        # hidden_states: [s, b, h]
        ln = self.input_layernorm(hidden_states)
        mixed = self.query_key_value(ln).view(*ln.shape[:2], self.np, 3 * self.hn)
        query_layer, key_layer, value_layer = mixed.split(self.hn, dim=-1)
        context = self.core_attention(query_layer, key_layer, value_layer, attention_mask,
                                      rotary_pos_emb=(rotary_pos_emb, rotary_pos_emb))
        hidden_states = hidden_states + self.dense(context)
        ln = self.post_attention_layernorm(hidden_states)
        return hidden_states + self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(ln)))


class ESMnvBertModel(nn.Module):
    def __init__(self, vocab_size=33, hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=64):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, hidden_size)
        self.rotary_pos_emb = RotaryEmbedding(hidden_size // num_attention_heads)
        self.layers = nn.ModuleList([ESMnvParallelTransformerLayer(hidden_size, num_attention_heads, ffn_hidden_size)
                                     for _ in range(num_layers)])
        self.final_layernorm = nn.LayerNorm(hidden_size)

    def forward(self, input_ids, attention_mask):
        extended_attention_mask = bert_extended_attention_mask(attention_mask)
        hidden_states = self.word_embeddings(input_ids).transpose(0, 1).contiguous()  # [s, b, h]
        rotary_pos_emb = self.rotary_pos_emb(input_ids.shape[1])
        for layer in self.layers:
            hidden_states = layer(hidden_states, extended_attention_mask, rotary_pos_emb)
        return self.final_layernorm(hidden_states).transpose(0, 1)  # [b, s, h]


model = ESMnvBertModel().eval()
# ESM-1nv tokenizer: <cls>=0 <pad>=1 <eos>=2, residues 4..23
lengths = [16, 9, 12]
L = max(lengths)
input_ids = torch.full((3, L), 1)
attention_mask = torch.zeros(3, L, dtype=torch.long)
for i, n in enumerate(lengths):
    input_ids[i, :n] = torch.cat([torch.tensor([0]), torch.randint(4, 24, (n - 2,)), torch.tensor([2])])
    attention_mask[i, :n] = 1

with torch.no_grad():
    batched = model(input_ids, attention_mask)
    err = 0.0
    for i, n in enumerate(lengths):
        alone = model(input_ids[i:i + 1, :n], attention_mask[i:i + 1, :n])
        err = max(err, (batched[i, :n] - alone[0]).abs().max().item())
print(f"max |padded batch - per-sequence| over real residues: {err:.3e}")
