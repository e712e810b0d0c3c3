# Follows huggingface/diffusers src/diffusers/models/transformers/transformer_cogview4.py CogView4AttnProcessor:
# text tokens (right-padded) are concatenated before image tokens, mix_attn_mask = m m^T (outer product), so padded
# text queries see nothing at all (SDPA gives zero rows) and no query sees padded text; pad-text outputs are discarded.
import torch
import torch.nn.functional as F

torch.manual_seed(0)
D, H, IMG, TXT = 32, 4, 16, 8

to_qkv = torch.nn.Linear(D, 3 * D).double()
add_qkv = torch.nn.Linear(D, 3 * D).double()  # MMDiT: separate projections for the text stream
to_out = torch.nn.Linear(D, D).double()
add_out = torch.nn.Linear(D, D).double()


def joint_attention(img, txt, text_attn_mask):
    b = img.shape[0]
    qi, ki, vi = add_qkv(txt).chunk(3, -1)
    qm, km, vm = to_qkv(img).chunk(3, -1)
    q, k, v = [torch.cat(p, 1) for p in ((qi, qm), (ki, km), (vi, vm))]
    L = q.shape[1]
    q, k, v = [t.view(b, L, H, D // H).transpose(1, 2) for t in (q, k, v)]
    mask = None
    if text_attn_mask is not None:
        mix = torch.ones(b, L, dtype=torch.float64)
        mix[:, :txt.shape[1]] = text_attn_mask.to(torch.float64)
        mix = mix.unsqueeze(2) @ mix.unsqueeze(1)  # (b, L, L)
        mask = (mix > 0).unsqueeze(1)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, L, D)
    return add_out(o[:, :txt.shape[1]]), to_out(o[:, txt.shape[1]:])


text_lens = [8, 3, 5]
img = torch.randn(3, IMG, D, dtype=torch.float64)
txt = torch.randn(3, TXT, D, dtype=torch.float64)
tmask = torch.zeros(3, TXT, dtype=torch.long)
for i, n in enumerate(text_lens):
    tmask[i, :n] = 1
    txt[i, n:] = 0.0
t_out, i_out = joint_attention(img, txt, tmask)

diff = 0.0
for i, n in enumerate(text_lens):
    t_ref, i_ref = joint_attention(img[i:i + 1], txt[i:i + 1, :n], None)
    diff = max(diff, (i_out[i] - i_ref[0]).abs().max().item(), (t_out[i, :n] - t_ref[0]).abs().max().item())
assert torch.isfinite(t_out).all()
print("max |padded joint batch - each prompt unpadded| =", diff)
assert diff < 1e-12
