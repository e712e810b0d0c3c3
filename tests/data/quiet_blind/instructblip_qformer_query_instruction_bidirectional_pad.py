# Follows transformers models/instructblip/modeling_instructblip.py: InstructBlipQFormerModel.forward
# (attention_mask = cat([query_attention_mask ones, qformer_attention_mask]), extended (1 - mask) * min, NOT causal)
# and InstructBlipQFormerLayer (cross-attention to image only for the first query_length rows; text rows skip it).
import torch
torch.manual_seed(0); dt = torch.float64; D = 32; nh = 4; hd = D // nh; Nq = 4; Nimg = 3; NL = 2
def P(*s): return torch.randn(*s, dtype=dt) / 5
layers = [dict(sa=[P(D, D) for _ in range(4)], xa=[P(D, D) for _ in range(4)],
               ffq=(P(D, 2 * D), P(2 * D, D)), fft=(P(D, 2 * D), P(2 * D, D))) for _ in range(NL)]
query_tokens = P(1, Nq, D); wemb = P(30, D)

def attn(x, kv, W, ext):
    Wq, Wk, Wv, Wo = W; B, T, _ = x.shape; S = kv.shape[1]
    q = (x @ Wq).view(B, T, nh, hd).transpose(1, 2); k = (kv @ Wk).view(B, S, nh, hd).transpose(1, 2)
    v = (kv @ Wv).view(B, S, nh, hd).transpose(1, 2)
    s = q @ k.transpose(-1, -2) / hd ** 0.5 + ext
    return x + (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D) @ Wo

def ln(x): return torch.nn.functional.layer_norm(x, (D,))
def qformer(input_ids, qformer_attention_mask, image_embeds):
    B = input_ids.shape[0]
    x = torch.cat([query_tokens.expand(B, -1, -1), wemb[input_ids]], 1)
    mask = torch.cat([torch.ones(B, Nq, dtype=torch.long), qformer_attention_mask], 1)
    ext = (1.0 - mask[:, None, None, :].to(dt)) * torch.finfo(dt).min          # get_extended_attention_mask, 2D -> bidirectional
    img_mask = torch.ones(image_embeds.shape[:-1], dtype=torch.long)
    enc_ext = (1.0 - img_mask[:, None, None, :].to(dt)) * torch.finfo(dt).min   # invert_attention_mask
    for L in layers:
        x = ln(attn(x, x, L["sa"], ext))
        q = ln(attn(x[:, :Nq], image_embeds, L["xa"], enc_ext))                  # 4 queries vs 3 image tokens
        q = ln(q + torch.relu(q @ L["ffq"][0]) @ L["ffq"][1])
        t = x[:, Nq:]
        t = ln(t + torch.relu(t @ L["fft"][0]) @ L["fft"][1])
        x = torch.cat([q, t], 1)
    return x

B, T = 3, 6
lens = [6, 2, 4]
ids = torch.randint(1, 30, (B, T)); am = (torch.arange(T)[None] < torch.tensor(lens)[:, None]).long()
ids = ids * am                                       # pad id 0 on the right
img = P(B, Nimg, D)
out = qformer(ids, am, img)
md = 0.0
for b in range(B):
    o = qformer(ids[b:b + 1, : lens[b]], torch.ones(1, lens[b], dtype=torch.long), img[b:b + 1])
    md = max(md, (o[0, : Nq] - out[b, : Nq]).abs().max().item(),                 # query_output fed to the LLM
             (o[0, Nq:] - out[b, Nq: Nq + lens[b]]).abs().max().item())           # real text rows; pad rows discarded
print("max diff", md); assert md < 1e-10
