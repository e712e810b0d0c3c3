# Follows torchtune: torchtune/modules/transformer.py TransformerCrossAttentionLayer (_skip_mask: rows whose encoder_mask
# is all False are filled True for the softmax, then attn/mlp outputs zeroed) with the per-image intervals of
# torchtune/modules/transforms/_transforms.py VisionCrossAttentionMask. Text before the first <image> sees no image tokens.
import torch
import torch.nn.functional as F
torch.manual_seed(9)
dt = torch.float64
D, H, P = 32, 4, 3            # P encoder tokens per image
IMG = -1                      # image special token id
texts = [[IMG, 5, 6, IMG, 7, 8, 9], [4, 4, IMG, 6, IMG, IMG, 2, 3, 1, 1]]   # 2nd: text before first image, 2 consecutive images
n_imgs = [t.count(IMG) for t in texts]
S, NI = max(map(len, texts)), max(n_imgs)

def image_intervals(tokens):   # VisionCrossAttentionMask._get_image_attention_intervals
    idx = [i for i, t in enumerate(tokens) if t == IMG]
    iv = [[i, len(tokens)] for i in idx]
    for j in range(len(iv) - 2, -1, -1):
        if idx[j + 1] == idx[j] + 1:
            iv[j][1] = iv[j + 1][1]     # consecutive images share the same end
        else:
            iv[j][1] = idx[j + 1]
    return iv

def encoder_mask_for(tokens, S, NI):
    m = torch.zeros(S, NI * P, dtype=torch.bool)     # True = text token may attend to the image token
    for j, (s, e) in enumerate(image_intervals(tokens)):
        m[s:e, j * P:(j + 1) * P] = True
    return m

Wq, Wk, Wv, Wo = (torch.randn(D, D, dtype=dt) / D ** 0.5 for _ in range(4))
mlp = torch.nn.Sequential(torch.nn.Linear(D, 64, dtype=dt), torch.nn.SiLU(), torch.nn.Linear(64, D, dtype=dt))
ca_norm = torch.nn.LayerNorm(D, dtype=dt); mlp_norm = torch.nn.LayerNorm(D, dtype=dt)

def attn(x, y, mask):
    b, s, _ = x.shape
    q = (x @ Wq).view(b, s, H, -1).transpose(1, 2)
    k = (y @ Wk).view(b, -1, H, D // H).transpose(1, 2); v = (y @ Wv).view(b, -1, H, D // H).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
    return o.transpose(1, 2).reshape(b, s, D) @ Wo

def _skip_mask(mask):
    mask = ~mask if mask.dtype == torch.bool else torch.isneginf(mask)
    return torch.all(mask, dim=-1, keepdim=True)

def cross_layer(x, encoder_input, encoder_mask):
    skip_mask = _skip_mask(encoder_mask)
    encoder_mask = encoder_mask.masked_fill(skip_mask, True)
    attn_out = attn(ca_norm(x), encoder_input, encoder_mask).masked_fill(skip_mask, 0)
    h = attn_out + x
    mlp_out = mlp(mlp_norm(h)).masked_fill(skip_mask, 0)
    return h + mlp_out

x = torch.randn(len(texts), S, D, dtype=dt)
enc = torch.randn(len(texts), NI * P, D, dtype=dt)
mask = torch.stack([encoder_mask_for(t, S, NI) for t in texts])   # padded text rows / padded image cols stay False
out = cross_layer(x, enc, mask)
assert torch.isfinite(out).all()

# reference: explicit per-query loop over allowed image tokens; a query with none passes through unchanged
diff = 0.0
for b, t in enumerate(texts):
    for i in range(len(t)):
        allowed = mask[b, i]
        xi = x[b, i]
        if not allowed.any():
            ref = xi
        else:
            q = (ca_norm(xi) @ Wq).view(H, -1)
            k = (enc[b][allowed] @ Wk).view(-1, H, D // H); v = (enc[b][allowed] @ Wv).view(-1, H, D // H)
            a = torch.einsum("hd,khd->hk", q, k) / (D // H) ** 0.5
            o = torch.einsum("hk,khd->hd", a.softmax(-1), v).reshape(D) @ Wo
            h = xi + o
            ref = h + mlp(mlp_norm(h))
        diff = max(diff, (out[b, i] - ref).abs().max().item())
print("rows with no image:", int(_skip_mask(mask).sum()), "max diff", diff)
assert diff < 1e-12
