# Follows huggingface/lerobot policies/pi0/modeling_pi0.py make_att_2d_masks (cumsum of att_masks: prefix images+
# padded language bidirectional, state then action chunk as later blocks) and sample_actions/denoise_step: prefix
# KV cached once, suffix attends [prefix_pad_2d | suffix_att_2d], position_ids = prefix_offsets + cumsum(pad) - 1.
import torch
torch.manual_seed(5); torch.set_default_dtype(torch.float64)
D, NL, IMG, LANG, ACT = 32, 2, 4, 5, 6
Wqkv = [torch.nn.Linear(D, 3 * D) for _ in range(NL)]; Wo = [torch.nn.Linear(D, D) for _ in range(NL)]
pos = torch.nn.Embedding(64, D)

def make_att_2d_masks(pad_masks, att_masks):
    cumsum = torch.cumsum(att_masks, dim=1)
    att_2d = cumsum[:, None, :] <= cumsum[:, :, None]
    pad_2d = pad_masks[:, None, :] * pad_masks[:, :, None]
    return att_2d & pad_2d

def forward(x, position_ids, mask2d, past=None):
    bias = torch.where(mask2d, 0.0, -2.3819763e38)          # True = attend -> float bias
    h = x + pos(position_ids); cache = []
    for l in range(NL):
        q, k, v = Wqkv[l](h).chunk(3, -1)
        if past is not None:
            k = torch.cat([past[l][0], k], 1); v = torch.cat([past[l][1], v], 1)
        cache.append((k, v))
        a = torch.softmax(q @ k.transpose(1, 2) / D ** 0.5 + bias, -1) @ v
        h = h + Wo[l](a)
    return h, cache

lang_lens = [5, 2, 3]; B = len(lang_lens)
img = torch.randn(B, IMG, D); lang = torch.randn(B, LANG, D); state = torch.randn(B, 1, D); act = torch.randn(B, ACT, D)
lang_pad = torch.arange(LANG)[None] < torch.tensor(lang_lens)[:, None]          # right-padded language
prefix_pad = torch.cat([torch.ones(B, IMG, dtype=torch.bool), lang_pad], 1)
prefix_att = torch.zeros(B, IMG + LANG, dtype=torch.long)
suffix_pad = torch.ones(B, 1 + ACT, dtype=torch.bool)
suffix_att = torch.tensor([1, 1] + [0] * (ACT - 1)).expand(B, -1)
with torch.no_grad():
    prefix = torch.cat([img, lang], 1)
    pre_pos = torch.cumsum(prefix_pad, 1) - 1
    _, cache = forward(prefix, pre_pos, make_att_2d_masks(prefix_pad, prefix_att))
    suffix = torch.cat([state, act], 1)
    suf2d = make_att_2d_masks(suffix_pad, suffix_att)
    pre2d = prefix_pad[:, None, :].expand(B, 1 + ACT, IMG + LANG)
    offsets = prefix_pad.sum(-1)[:, None]
    out, _ = forward(suffix, offsets + torch.cumsum(suffix_pad, 1) - 1, torch.cat([pre2d, suf2d], 2), past=cache)
    diff = 0.0
    for b, n in enumerate(lang_lens):                     # reference: one sample, unpadded, no cache, one pass
        x = torch.cat([img[b], lang[b, :n], state[b], act[b]])[None]
        att = torch.tensor([0] * (IMG + n) + [1, 1] + [0] * (ACT - 1))[None]
        full, _ = forward(x, torch.arange(x.shape[1])[None], make_att_2d_masks(torch.ones_like(att, dtype=torch.bool), att))
        diff = max(diff, (full[0, -(1 + ACT):] - out[b]).abs().max().item())
print("max diff cached padded suffix vs unpadded single pass:", diff)
assert diff < 1e-10
