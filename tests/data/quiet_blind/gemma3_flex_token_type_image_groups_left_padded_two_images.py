"""Gemma3-style VLM attention: image tokens see each other bidirectionally inside causal text.

Follows huggingface/transformers src/transformers/masking_utils.py (token_type_ids_mask_function,
or_masks, padding_mask_function, causal_mask_function) as used by
src/transformers/models/gemma3/modeling_gemma3.py (create_causal_mask_mapping): each contiguous
run of image tokens (token_type_ids == 1) gets an image group id; a query attends to a key when the
key is causally earlier, OR both are image tokens of the same image; AND the key is not padding.
Here written with torch flex_attention (mask_mod composed with or/and) over a LEFT-padded batch
whose rows hold one or two images, with position ids from the cumulative padding mask as
generate() computes them. Reference: each row alone, unpadded, mask built by a Python loop.
"""
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention, create_block_mask

torch.manual_seed(0)
D, H, HD, V, NL = 32, 2, 16, 50, 2
IMG = 4  # tokens per image (mm_tokens_per_image, tiny)

# rows: list of segments ("t", n) text tokens or ("i",) one image of IMG tokens
rows = [
    [("t", 2), ("i",), ("t", 5)],
    [("t", 1), ("i",), ("t", 2), ("i",), ("t", 3)],
    [("t", 6)],
]


def build(row):
    ids, tt = [], []
    for seg in row:
        if seg[0] == "t":
            ids += torch.randint(1, V, (seg[1],)).tolist(); tt += [0] * seg[1]
        else:
            ids += [V - 1] * IMG; tt += [1] * IMG
    return ids, tt


data = [build(r) for r in rows]
L = max(len(d[0]) for d in data)
B = len(data)
input_ids = torch.zeros(B, L, dtype=torch.long)
token_type_ids = torch.zeros(B, L, dtype=torch.long)
attention_mask = torch.zeros(B, L, dtype=torch.long)
for b, (ids, tt) in enumerate(data):  # left padding, as for batched generation
    n = len(ids)
    input_ids[b, L - n:] = torch.tensor(ids)
    token_type_ids[b, L - n:] = torch.tensor(tt)
    attention_mask[b, L - n:] = 1
position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)

# image group ids as in transformers: a new group starts where an image run begins
is_image = token_type_ids == 1
starts = is_image & ~F.pad(is_image, (1, 0), value=False)[:, :-1]
image_group_ids = torch.where(is_image, starts.cumsum(-1), -1)

emb = torch.nn.Embedding(V, D).double()
img_proj = torch.nn.Linear(D, D).double()  # stands in for the multi-modal projector
layers = [dict(qkv=torch.nn.Linear(D, 3 * H * HD).double(), o=torch.nn.Linear(H * HD, D).double(),
               mlp=torch.nn.Sequential(torch.nn.Linear(D, 64), torch.nn.GELU(), torch.nn.Linear(64, D)).double())
          for _ in range(NL)]


def rope(x, pos):
    inv = 1.0 / (10000 ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD))
    ang = pos[..., None].double() * inv
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = x[..., : HD // 2], x[..., HD // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def embed(ids, tt):
    h = emb(ids)
    return torch.where((tt == 1)[..., None], img_proj(h), h)


def forward(h, pos, attn):
    b, n, _ = h.shape
    for ly in layers:
        q, k, v = ly["qkv"](h).view(b, n, 3, H, HD).permute(2, 0, 3, 1, 4)
        q, k = rope(q, pos), rope(k, pos)
        h = h + ly["o"](attn(q, k, v).transpose(1, 2).reshape(b, n, H * HD))
        h = h + ly["mlp"](h)
    return h


def causal(b, h, qi, kv): return kv <= qi
def padding(b, h, qi, kv): return attention_mask[b, kv] > 0
def same_image(b, h, qi, kv):
    g = image_group_ids[b, qi]
    return (g >= 0) & (g == image_group_ids[b, kv])
def mask_mod(b, h, qi, kv): return (causal(b, h, qi, kv) | same_image(b, h, qi, kv)) & padding(b, h, qi, kv)


block_mask = create_block_mask(mask_mod, B, None, L, L, device="cpu")
with torch.no_grad():
    out = forward(embed(input_ids, token_type_ids), position_ids,
                  lambda q, k, v: flex_attention(q, k, v, block_mask=block_mask))

    # reference: one row at a time, unpadded, boolean mask built by loops
    maxdiff = 0.0
    for b, (ids, tt) in enumerate(data):
        n = len(ids)
        grp, g, prev = [], 0, 0
        for t in tt:
            if t == 1 and prev == 0: g += 1
            grp.append(g if t == 1 else -1); prev = t
        allowed = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            for j in range(n):
                allowed[i, j] = j <= i or (grp[i] >= 0 and grp[i] == grp[j])
        ids_t, tt_t = torch.tensor([ids]), torch.tensor([tt])
        ref = forward(embed(ids_t, tt_t), torch.arange(n)[None],
                      lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed))
        maxdiff = max(maxdiff, (out[b, L - n:] - ref[0]).abs().max().item())
print("max |flex batched - per-row unpadded| =", maxdiff)
assert maxdiff < 1e-10
