# The bug of NVIDIA/bionemo-framework beca937 (a boolean padding mask, True = masked, added to the attention
# scores) written another way: a fair-esm style ESM-1b encoder, time-major (T, B, C), heads folded into the batch
# for torch.bmm, whose key_padding_mask (B, S) is `tokens.eq(padding_idx)`. The scores are unfolded to (B, H, T, S)
# and the mask is added to them as it comes, so each padded residue's score gets +1 and stays attended. The fix
# fills the padded keys with -inf, as fair-esm's MultiheadAttention does.
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
PADDING_IDX = 1


class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, query, key_padding_mask=None):
        tgt_len, bsz, embed_dim = query.size()
        q = self.q_proj(query) * self.scaling
        k, v = self.k_proj(query), self.v_proj(query)
        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        src_len = k.size(1)
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        if key_padding_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            pad = key_padding_mask.unsqueeze(1).unsqueeze(2)  # (B, 1, 1, S), True = padding
            if FIXED:
                attn_weights = attn_weights.masked_fill(pad, float("-inf"))
            else:
                attn_weights = attn_weights + pad
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_probs = F.softmax(attn_weights, dim=-1)
        attn = torch.bmm(attn_probs, v).transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        return self.out_proj(attn)


class TransformerLayer(nn.Module):
    def __init__(self, embed_dim=24, ffn_embed_dim=48, attention_heads=3):
        super().__init__()
        self.self_attn = MultiheadAttention(embed_dim, attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(embed_dim)
        self.fc1 = nn.Linear(embed_dim, ffn_embed_dim)
        self.fc2 = nn.Linear(ffn_embed_dim, embed_dim)
        self.final_layer_norm = nn.LayerNorm(embed_dim)

    def forward(self, x, self_attn_padding_mask=None):
        x = x + self.self_attn(self.self_attn_layer_norm(x), key_padding_mask=self_attn_padding_mask)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class ProteinBertModel(nn.Module):
    def __init__(self, alphabet_size=33, embed_dim=24, layers=2):
        super().__init__()
        self.padding_idx = PADDING_IDX
        self.embed_tokens = nn.Embedding(alphabet_size, embed_dim, padding_idx=PADDING_IDX)
        self.layers = nn.ModuleList([TransformerLayer(embed_dim) for _ in range(layers)])
        self.emb_layer_norm_after = nn.LayerNorm(embed_dim)

    def forward(self, tokens):
        padding_mask = tokens.eq(self.padding_idx)  # B, T
        x = self.embed_tokens(tokens) * (1 - padding_mask.unsqueeze(-1).type_as(self.embed_tokens.weight))
        x = x.transpose(0, 1)  # (B, T, E) => (T, B, E)
        if not padding_mask.any():
            padding_mask = None
        for layer in self.layers:
            x = layer(x, self_attn_padding_mask=padding_mask)
        return self.emb_layer_norm_after(x).transpose(0, 1)


model = ProteinBertModel().eval()
# fair-esm's BatchConverter: <cls> residues <eos>, padded on the right with <pad> = 1
lengths = [10, 6, 8]
T = max(lengths)
tokens = torch.full((len(lengths), T), PADDING_IDX)
for i, n in enumerate(lengths):
    tokens[i, :n] = torch.cat([torch.tensor([0]), torch.randint(4, 24, (n - 2,)), torch.tensor([2])])
with torch.no_grad():
    batched = model(tokens)
    alone = [model(tokens[i:i + 1, :n])[0] for i, n in enumerate(lengths)]
diff = max((batched[i, :n] - alone[i]).abs().max().item() for i, n in enumerate(lengths))
print(f"max |padded batch - per-sequence| over real residues: {diff:.3e}")
