# Follows tonyzhaozh/act detr/models/detr_vae.py DETRVAE.forward: CVAE encoder input [cls, qpos, action chunk],
# is_pad = cat([cls_joint_is_pad (False), is_pad]) as src_key_padding_mask (True = ignore, right-padded episode end);
# decoder: num_queries action queries cross-attend to fewer memory tokens, no mask (more queries than keys).
import torch
torch.manual_seed(6); torch.set_default_dtype(torch.float64)
D, H, K, NQ, MEM = 32, 4, 10, 16, 5
enc = torch.nn.TransformerEncoderLayer(D, H, 64, dropout=0.0, batch_first=True)
cross = torch.nn.MultiheadAttention(D, H, batch_first=True)
cls_embed = torch.randn(1, 1, D); pos_table = torch.randn(1, K + 2, D)
query_embed = torch.randn(NQ, D)
valid = [10, 6, 3]; B = len(valid)
actions = torch.randn(B, K, D); qpos = torch.randn(B, 1, D); memory = torch.randn(B, MEM, D)
is_pad = torch.arange(K)[None] >= torch.tensor(valid)[:, None]
with torch.no_grad():
    encoder_input = torch.cat([cls_embed.expand(B, -1, -1), qpos, actions], 1) + pos_table
    cls_joint_is_pad = torch.full((B, 2), False)
    full_pad = torch.cat([cls_joint_is_pad, is_pad], 1)
    latent_info = enc(encoder_input, src_key_padding_mask=full_pad)[:, 0]
    d1 = 0.0
    for b, n in enumerate(valid):                 # episode chunk truncated, alone, no mask
        x = (torch.cat([cls_embed[0], qpos[b], actions[b, :n]]) + pos_table[0, :n + 2])[None]
        d1 = max(d1, (enc(x)[0, 0] - latent_info[b]).abs().max().item())
    tgt = query_embed[None].expand(B, -1, -1)
    hs, _ = cross(tgt, memory, memory, need_weights=False)
    d2 = 0.0
    for b in range(B):
        for i in range(NQ):                       # explicit per-query loop
            o, _ = cross(tgt[b:b + 1, i:i + 1], memory[b:b + 1], memory[b:b + 1], need_weights=False)
            d2 = max(d2, (o[0, 0] - hs[b, i]).abs().max().item())
print("max diff padded CVAE encoder vs truncated:", d1, " cross-attn vs per-query loop:", d2)
assert d1 < 1e-10 and d2 < 1e-10
