# Follows diffusers PixArtTransformer2DModel.forward: encoder_attention_mask (1 keep, 0 pad) converted to a float
# bias (1 - mask) * -10000.0, unsqueeze(1), then Attention.prepare_attention_mask repeats it per head for cross-attn
# where 16 image queries attend 6 T5 tokens (more queries than keys). Checked vs. the unpadded prompt.
import torch, torch.nn.functional as F
torch.manual_seed(0); torch.set_default_dtype(torch.float64)
D, H, NI, L = 32, 4, 16, 6
Wq, Wk, Wv = (torch.randn(D, D) / D**.5 for _ in range(3))
def sp(t): return t.view(t.shape[0], -1, H, D // H).transpose(1, 2)
def cross(x, enc, encoder_attention_mask):
    bias = None
    if encoder_attention_mask is not None:
        bias = (1 - encoder_attention_mask.to(x.dtype)) * -10000.0
        bias = bias.unsqueeze(1)                                  # (B,1,L)
        bias = bias.repeat_interleave(H, dim=0).view(x.shape[0], H, 1, -1)  # prepare_attention_mask, out_dim=4
    return F.scaled_dot_product_attention(sp(x @ Wq), sp(enc @ Wk), sp(enc @ Wv), attn_mask=bias)
x = torch.randn(3, NI, D); enc = torch.randn(3, L, D)
lens = torch.tensor([6, 2, 4]); m = (torch.arange(L)[None] < lens[:, None]).long()
out = cross(x, enc, m)
diff = max((cross(x[b:b+1], enc[b:b+1, :lens[b]], None) - out[b:b+1]).abs().max().item() for b in range(3))
print("max diff -10000 bias cross-attn vs unpadded prompt", diff); assert diff < 1e-10  # exp(-10000) underflows to 0
