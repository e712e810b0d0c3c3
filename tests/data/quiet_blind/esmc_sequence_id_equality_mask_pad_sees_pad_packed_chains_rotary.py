# Follows evolutionaryscale/esm esm/layers/attention.py MultiHeadAttention.forward (mask_BLL = seq_id.unsqueeze(-1) ==
# seq_id.unsqueeze(-2) into F.scaled_dot_product_attention) with ESMC.forward's sequence_id = tokens != pad: padding rows attend
# to padding only (rows later discarded). Also packed proteins with integer ids; rotary is relative so packing offsets don't matter.
import math
import torch
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
d_model, n_heads, vocab, BOS, PAD, EOS = 32, 4, 33, 0, 1, 2
d_head = d_model // n_heads


def rotary(x):  # x [B, L, H, Dh], positions 0..L-1 of the row
    L, hd = x.shape[1], x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2) / hd))
    ang = torch.arange(L)[:, None] * inv
    cos = torch.cat([ang, ang], -1).cos()[None, :, None]
    sin = torch.cat([ang, ang], -1).sin()[None, :, None]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class MultiHeadAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layernorm_qkv = torch.nn.Sequential(torch.nn.LayerNorm(d_model), torch.nn.Linear(d_model, 3 * d_model, bias=False))
        self.out_proj = torch.nn.Linear(d_model, d_model, bias=False)
        self.q_ln = torch.nn.LayerNorm(d_model, bias=False)
        self.k_ln = torch.nn.LayerNorm(d_model, bias=False)

    def forward(self, x, seq_id):
        q, k, v = self.layernorm_qkv(x).chunk(3, dim=-1)
        q, k = self.q_ln(q), self.k_ln(k)
        B, L, _ = x.shape
        q = rotary(q.view(B, L, n_heads, d_head)).transpose(1, 2)
        k = rotary(k.view(B, L, n_heads, d_head)).transpose(1, 2)
        v = v.view(B, L, n_heads, d_head).transpose(1, 2)
        if seq_id is not None:
            mask_BLL = seq_id.unsqueeze(-1) == seq_id.unsqueeze(-2)
            mask_BHLL = mask_BLL.unsqueeze(1)
            ctx = F.scaled_dot_product_attention(q, k, v, mask_BHLL)
        else:
            ctx = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(ctx.transpose(1, 2).reshape(B, L, d_model))


class ESMCLike(torch.nn.Module):
    def __init__(self, n_layers=2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d_model)
        self.attn = torch.nn.ModuleList([MultiHeadAttention() for _ in range(n_layers)])
        self.ffn = torch.nn.ModuleList(
            [torch.nn.Sequential(torch.nn.LayerNorm(d_model), torch.nn.Linear(d_model, 2 * d_model), torch.nn.GELU(), torch.nn.Linear(2 * d_model, d_model)) for _ in range(n_layers)]
        )
        self.norm = torch.nn.LayerNorm(d_model)

    def forward(self, sequence_tokens, sequence_id=None):
        if sequence_id is None:
            sequence_id = sequence_tokens != PAD
        x = self.embed(sequence_tokens)
        for a, f in zip(self.attn, self.ffn):
            x = x + a(x, sequence_id)
            x = x + f(x)
        return self.norm(x)


model = ESMCLike().eval()
proteins = [torch.randint(4, 24, (n,)).tolist() for n in (9, 4, 6)]
seqs = [[BOS] + p + [EOS] for p in proteins]
L = max(len(s) for s in seqs)
tokens = torch.full((len(seqs), L), PAD)
for i, s in enumerate(seqs):
    tokens[i, : len(s)] = torch.tensor(s)

with torch.no_grad():
    out = model(tokens)  # bool sequence_id: real==real, pad==pad
    d_pad = 0.0
    alone = [model(torch.tensor([s]))[0] for s in seqs]
    for i, s in enumerate(seqs):
        d_pad = max(d_pad, (out[i, : len(s)] - alone[i]).abs().max().item())
    print(f"right-padded batch, seq_id = tokens != pad, vs each protein alone: max diff = {d_pad:.3e}")

    # packed: the three proteins back to back in one row, integer ids, trailing pad with its own id
    packed = torch.tensor([sum(seqs, []) + [PAD, PAD]])
    ids = torch.tensor([sum([[i] * len(s) for i, s in enumerate(seqs)], []) + [-1, -1]])
    outp = model(packed, sequence_id=ids)[0]
    d_pack, off = 0.0, 0
    for i, s in enumerate(seqs):
        d_pack = max(d_pack, (outp[off : off + len(s)] - alone[i]).abs().max().item())
        off += len(s)
    print(f"packed row with integer sequence_id (rotary offsets differ) vs each alone: max diff = {d_pack:.3e}")
worst = max(d_pad, d_pack)
assert worst < 1e-12, worst
print(f"max difference: {worst:.3e}")
