"""DN-DETR / DINO-style denoising queries, as IDEA-Research/DN-DETR writes them:
models/DN_DAB_DETR/dn_components.py prepare_for_dn (scalar groups of single_pad = max #GT boxes in the
batch; label noise, box noise; attn_mask with "match query cannot see the reconstruct" and
"reconstruct cannot see each other"), fed to the decoder self-attention as a bool attn_mask
(True = blocked), and DETR's padded image batch: util/misc.py nested_tensor_from_tensor_list (mask True
on padding), models/position_encoding.py PositionEmbeddingSine (cumsum of ~mask, normalize), decoder
cross-attention with memory_key_padding_mask.

Intent kept as the project keeps it: a denoising group sees itself and the matching queries; the
matching queries never see any denoising group (at inference there is none); groups never see each
other. An image with fewer boxes than single_pad keeps its zero-label/zero-box pad slots inside each
group, exactly as prepare_for_dn leaves them. Image padding is masked as memory keys.

Checks: (1) the matching queries' outputs equal a run with no denoising part at all (inference);
(2) each denoising group equals a run of [that group, matching] with only the matching->group
direction blocked; (3) each image of the padded batch equals that image alone, unpadded.
"""
import math
import torch
import torch.nn as nn

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
D, NH, NQ, NCLS, SCALAR = 32, 4, 5, 6, 3


def pos_sine(mask, num_pos_feats=D // 2, temperature=10000):
    not_mask = ~mask
    y_embed, x_embed = not_mask.cumsum(1, dtype=torch.float64), not_mask.cumsum(2, dtype=torch.float64)
    eps, scale = 1e-6, 2 * math.pi
    y_embed = y_embed / (y_embed[:, -1:, :] + eps) * scale
    x_embed = x_embed / (x_embed[:, :, -1:] + eps) * scale
    dim_t = temperature ** (2 * (torch.arange(num_pos_feats) // 2) / num_pos_feats)
    pos_x, pos_y = x_embed[:, :, :, None] / dim_t, y_embed[:, :, :, None] / dim_t
    pos_x = torch.stack((pos_x[..., 0::2].sin(), pos_x[..., 1::2].cos()), dim=4).flatten(3)
    pos_y = torch.stack((pos_y[..., 0::2].sin(), pos_y[..., 1::2].cos()), dim=4).flatten(3)
    return torch.cat((pos_y, pos_x), dim=3).permute(0, 3, 1, 2)


class DecLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn, self.cross_attn = nn.MultiheadAttention(D, NH), nn.MultiheadAttention(D, NH)
        self.n1, self.n2, self.n3 = nn.LayerNorm(D), nn.LayerNorm(D), nn.LayerNorm(D)
        self.ffn = nn.Sequential(nn.Linear(D, 64), nn.ReLU(), nn.Linear(64, D))

    def forward(self, tgt, qpos, memory, pos, attn_mask, mem_kpm):   # seq-first, as DETR
        q = k = tgt + qpos
        tgt = self.n1(tgt + self.self_attn(q, k, tgt, attn_mask=attn_mask)[0])
        tgt = self.n2(tgt + self.cross_attn(tgt + qpos, memory + pos, memory, key_padding_mask=mem_kpm)[0])
        return self.n3(tgt + self.ffn(tgt))


label_enc = nn.Embedding(NCLS + 1, D - 1)          # DN-DETR: hidden_dim - 1 plus an indicator
tgt_embed = nn.Embedding(NQ, D - 1)
refpoint = nn.Embedding(NQ, 4)
box_mlp = nn.Sequential(nn.Linear(4, D), nn.ReLU(), nn.Linear(D, D))
layers = nn.ModuleList([DecLayer(), DecLayer()])
for m in (label_enc, tgt_embed, refpoint, box_mlp, layers):
    m.eval()

# targets: image 0 has 3 boxes, image 1 has 1 box
targets = [dict(labels=torch.tensor([1, 4, 2]), boxes=torch.rand(3, 4) * 0.5 + 0.25),
           dict(labels=torch.tensor([5]), boxes=torch.rand(1, 4) * 0.5 + 0.25)]
single_pad = max(len(t["labels"]) for t in targets)
pad_size = single_pad * SCALAR
B = len(targets)


def prepare_for_dn():
    lab = torch.zeros(B, pad_size, D - 1)
    box = torch.zeros(B, pad_size, 4)
    for b, t in enumerate(targets):
        n = len(t["labels"])
        for g in range(SCALAR):
            noisy = t["labels"].clone()
            flip = torch.rand(n) < 0.2
            noisy[flip] = torch.randint(0, NCLS, (int(flip.sum()),))
            nb = (t["boxes"] + (torch.rand(n, 4) * 2 - 1) * 0.4 * t["boxes"][:, 2:].repeat(1, 2)).clamp(0, 1)
            lab[b, g * single_pad: g * single_pad + n] = label_enc(noisy)
            box[b, g * single_pad: g * single_pad + n] = nb
    dn_tgt = torch.cat([lab, torch.ones(B, pad_size, 1)], -1)           # indicator 1: denoising
    tgt_size = pad_size + NQ
    attn_mask = torch.ones(tgt_size, tgt_size) < 0
    attn_mask[pad_size:, :pad_size] = True                               # match query cannot see the reconstruct
    for i in range(SCALAR):                                              # reconstruct cannot see each other
        if i == 0:
            attn_mask[single_pad * i:single_pad * (i + 1), single_pad * (i + 1):pad_size] = True
        if i == SCALAR - 1:
            attn_mask[single_pad * i:single_pad * (i + 1), :single_pad * i] = True
        else:
            attn_mask[single_pad * i:single_pad * (i + 1), single_pad * (i + 1):pad_size] = True
            attn_mask[single_pad * i:single_pad * (i + 1), :single_pad * i] = True
    return dn_tgt, box, attn_mask


def match_queries(Bn):
    t = torch.cat([tgt_embed.weight, torch.zeros(NQ, 1)], -1)            # indicator 0: matching
    return t[None].expand(Bn, -1, -1), refpoint.weight.sigmoid()[None].expand(Bn, -1, -1)


def decode(tgt, boxes, feats, mask, attn_mask):
    pos = pos_sine(mask).flatten(2).permute(2, 0, 1)
    memory, kpm = feats.flatten(2).permute(2, 0, 1), mask.flatten(1)
    x, qpos = tgt.transpose(0, 1), box_mlp(boxes).transpose(0, 1)
    for layer in layers:
        x = layer(x, qpos, memory, pos, attn_mask, kpm)
    return x.transpose(0, 1)


sizes = [(5, 7), (3, 4)]
H, W = max(h for h, _ in sizes), max(w for _, w in sizes)
imgs = [torch.randn(D, h, w) for h, w in sizes]
feats = torch.zeros(B, D, H, W)
mask = torch.ones(B, H, W, dtype=torch.bool)                             # nested_tensor_from_tensor_list
for b, im in enumerate(imgs):
    feats[b, :, :im.shape[1], :im.shape[2]], mask[b, :im.shape[1], :im.shape[2]] = im, False

with torch.no_grad():
    dn_tgt, dn_box, attn_mask = prepare_for_dn()
    mt, mb = match_queries(B)
    tgt, boxes = torch.cat([dn_tgt, mt], 1), torch.cat([dn_box, mb], 1)
    out = decode(tgt, boxes, feats, mask, attn_mask)
    infer = decode(mt, mb, feats, mask, None)                            # (1) inference: no dn part
    d1 = (out[:, pad_size:] - infer).abs().max().item()
    d2 = 0.0
    for g in range(SCALAR):                                              # (2) one group + matching
        sl = slice(g * single_pad, (g + 1) * single_pad)
        m = torch.zeros(single_pad + NQ, single_pad + NQ, dtype=torch.bool)
        m[single_pad:, :single_pad] = True
        o = decode(torch.cat([dn_tgt[:, sl], mt], 1), torch.cat([dn_box[:, sl], mb], 1), feats, mask, m)
        d2 = max(d2, (o[:, :single_pad] - out[:, sl]).abs().max().item())
    d3 = 0.0
    for b, im in enumerate(imgs):                                        # (3) each image alone
        o = decode(tgt[b:b + 1], boxes[b:b + 1], im[None], torch.zeros(1, *im.shape[1:], dtype=torch.bool), attn_mask)
        d3 = max(d3, (o[0] - out[b]).abs().max().item())

print(f"matching queries vs inference without denoising queries: max diff = {d1:.3e}")
print(f"each denoising group vs [group, matching] alone: max diff = {d2:.3e}")
print(f"padded image batch vs each image alone: max diff = {d3:.3e}")
assert d1 < 1e-12 and d2 < 1e-12 and d3 < 1e-12
