# Follows facebookresearch/esm esm/model/esm2.py (ESM2.forward: padding_mask = tokens.eq(padding_idx); x = x * (1 -
# padding_mask); layers get self_attn_padding_mask, True = pad key; here nn.TransformerEncoderLayer stands in for its layers).
import torch
torch.manual_seed(0)
padding_idx, D, H = 1, 32, 4
emb = torch.nn.Embedding(33, D, padding_idx=padding_idx).double()
layers = torch.nn.ModuleList([torch.nn.TransformerEncoderLayer(D, H, 64, dropout=0.0, batch_first=True,
                              dtype=torch.float64) for _ in range(2)]).eval()
seqs = [torch.randint(4, 29, (n,)) for n in (12, 5, 9)]
T = max(len(s) for s in seqs)
tokens = torch.full((3, T), padding_idx)
for i, s in enumerate(seqs):
    tokens[i, :len(s)] = s
def forward(tokens):
    padding_mask = tokens.eq(padding_idx)
    x = emb(tokens)
    x = x * (1 - padding_mask.unsqueeze(-1).type_as(x))
    for layer in layers:
        x = layer(x, src_key_padding_mask=padding_mask if padding_mask.any() else None)
    return x
with torch.no_grad():
    out = forward(tokens)
    diff = max((forward(s[None])[0] - out[i, :len(s)]).abs().max().item() for i, s in enumerate(seqs))
print("max diff", diff)
assert diff < 1e-12
