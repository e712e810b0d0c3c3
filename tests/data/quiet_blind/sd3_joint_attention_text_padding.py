# Follows diffusers models/attention_processor.py JointAttnProcessor2_0 (SD3 MMDiT: concat image and text
# q/k/v, one SDPA, split back). Padded prompt tokens masked as keys only (image+text queries keep all valid keys);
# padded text query rows are produced and then discarded. Checked vs the unpadded prompt alone.
import torch, torch.nn.functional as F
torch.manual_seed(0); torch.set_default_dtype(torch.float64)
D, H, NI = 32, 4, 9
W = {n: torch.randn(D, D) / D**.5 for n in ["q", "k", "v", "aq", "ak", "av"]}
def sp(t): return t.view(t.shape[0], -1, H, D // H).transpose(1, 2)
def joint(img, txt, txt_keep):
    q = torch.cat([sp(img @ W["q"]), sp(txt @ W["aq"])], 2)
    k = torch.cat([sp(img @ W["k"]), sp(txt @ W["ak"])], 2)
    v = torch.cat([sp(img @ W["v"]), sp(txt @ W["av"])], 2)
    keep = None
    if txt_keep is not None:
        keep = torch.cat([torch.ones(img.shape[0], img.shape[1], dtype=torch.bool), txt_keep], 1)[:, None, None, :]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).flatten(2)
    return o[:, :img.shape[1]], o[:, img.shape[1]:]
img = torch.randn(2, NI, D); txt = torch.randn(2, 8, D)
lens = torch.tensor([8, 3]); txt_keep = torch.arange(8)[None] < lens[:, None]
oi, ot = joint(img, txt, txt_keep)
diff = 0.0
for b in range(2):
    ri, rt = joint(img[b:b+1], txt[b:b+1, :lens[b]], None)
    diff = max(diff, (ri - oi[b:b+1]).abs().max().item(), (rt - ot[b:b+1, :lens[b]]).abs().max().item())
print("max diff padded joint attention vs unpadded prompt", diff); assert diff < 1e-10
