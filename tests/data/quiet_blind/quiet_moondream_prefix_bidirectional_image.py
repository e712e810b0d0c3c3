# Correct program. Ported from vikhyat/moondream moondream/torch/text.py / moondream.py (_prefill_prompt):
# the causal mask is made bidirectional over the image prefix: attn_mask[..., :730, :730] = 1.
import torch, torch.nn.functional as F
torch.manual_seed(0)
D, H, n_img, n_txt = 16, 2, 5, 4
T = n_img + n_txt
x = torch.randn(1, T, D)
wq, wk, wv = (torch.nn.Linear(D, D) for _ in range(3))
attn_mask = torch.tril(torch.ones(1, 1, T, T, dtype=torch.bool))
attn_mask[..., :n_img, :n_img] = 1
sp = lambda t: t.view(1, -1, H, D // H).transpose(1, 2)
o = F.scaled_dot_product_attention(sp(wq(x)), sp(wk(x)), sp(wv(x)), attn_mask=attn_mask)
q, k, v = sp(wq(x)), sp(wk(x)), sp(wv(x))
for i in range(T):
    j = n_img if i < n_img else i + 1                 # image tokens see the whole image, text is causal
    s = (q[..., i:i + 1, :] @ k[..., :j, :].transpose(-1, -2)) / (D // H) ** 0.5
    assert torch.allclose(o[..., i:i + 1, :], s.softmax(-1) @ v[..., :j, :], atol=1e-5)
print("ok")
