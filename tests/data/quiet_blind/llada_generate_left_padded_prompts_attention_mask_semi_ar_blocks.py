"""LLaDA-style masked-diffusion generation for a batch of prompts of different lengths.

Follows ML-GSAI/LLaDA generate.py (generate: x filled with mask_id after the prompt, gen_length split
into blocks, get_num_transfer_tokens spreading each block's masked tokens over its steps,
remasking='low_confidence': confidence = softmax prob of the argmax, -inf past the current block,
the top-k masked positions committed per row; at commit 41760b9 generate takes one prompt, here a
batch of left-padded prompts is run with an attention_mask, as batched serving of it does). The denoiser is bidirectional: every real token attends to every real token,
including later still-masked ones; padding keys are excluded with a boolean SDPA mask, and RoPE
positions count real tokens only. Reference: each prompt generated alone, no padding, no mask; the
generated tokens must be identical and the final logits equal.
"""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
D, H, HD, V, NL = 32, 2, 16, 48, 2
MASK_ID, PAD_ID = V - 1, 0
GEN, BLOCK, STEPS = 8, 4, 4  # 2 blocks, 2 steps per block

emb = torch.nn.Embedding(V, D).double()
head = torch.nn.Linear(D, V).double()
layers = [dict(qkv=torch.nn.Linear(D, 3 * H * HD).double(), o=torch.nn.Linear(H * HD, D).double(),
               mlp=torch.nn.Sequential(torch.nn.Linear(D, 64), torch.nn.SiLU(), torch.nn.Linear(64, D)).double())
          for _ in range(NL)]


def rope(x, pos):
    inv = 1.0 / (10000 ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD))
    ang = pos[..., None].double() * inv
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = x[..., : HD // 2], x[..., HD // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def model(x, attention_mask=None):
    b, n = x.shape
    if attention_mask is None:
        pos, mask = torch.arange(n).expand(b, n), None
    else:
        pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        mask = attention_mask.bool()[:, None, None, :]  # keys only: bidirectional, no causal part
    h = emb(x)
    for ly in layers:
        q, k, v = ly["qkv"](h).view(b, n, 3, H, HD).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(rope(q, pos), rope(k, pos), v, attn_mask=mask, is_causal=False)
        h = h + ly["o"](a.transpose(1, 2).reshape(b, n, H * HD))
        h = h + ly["mlp"](h)
    return head(h)


def get_num_transfer_tokens(mask_index, steps):
    mask_num = mask_index.sum(dim=1, keepdim=True)
    base, rem = mask_num // steps, mask_num % steps
    out = base.expand(-1, steps).clone()
    for i in range(mask_num.size(0)):
        out[i, :rem[i]] += 1
    return out


@torch.no_grad()
def generate(prompt, attention_mask=None):
    b, p = prompt.shape
    x = torch.full((b, p + GEN), MASK_ID, dtype=torch.long)
    x[:, :p] = prompt
    if attention_mask is not None:
        attention_mask = torch.cat([attention_mask, torch.ones(b, GEN, dtype=attention_mask.dtype)], 1)
    steps = STEPS // (GEN // BLOCK)
    for nb in range(GEN // BLOCK):
        s, e = p + nb * BLOCK, p + (nb + 1) * BLOCK
        ntt = get_num_transfer_tokens(x[:, s:e] == MASK_ID, steps)
        for i in range(steps):
            mask_index = x == MASK_ID
            logits = model(x, attention_mask)
            x0 = logits.argmax(-1)
            x0_p = torch.gather(F.softmax(logits, -1), -1, x0[..., None])[..., 0]
            x0_p[:, e:] = -float("inf")
            x0 = torch.where(mask_index, x0, x)
            conf = torch.where(mask_index, x0_p, torch.tensor(-float("inf"), dtype=torch.float64))
            transfer = torch.zeros_like(x0, dtype=torch.bool)
            for j in range(b):
                _, sel = torch.topk(conf[j], k=int(ntt[j, i]))
                transfer[j, sel] = True
            x[transfer] = x0[transfer]
    return x, model(x, attention_mask)


prompts = [torch.randint(1, V - 1, (n,)) for n in (5, 2, 4)]
B, P = len(prompts), max(len(p) for p in prompts)
batch = torch.full((B, P), PAD_ID)
am = torch.zeros(B, P, dtype=torch.long)
for i, p in enumerate(prompts):
    batch[i, P - len(p):] = p; am[i, P - len(p):] = 1
xb, lb = generate(batch, am)
same, maxdiff = True, 0.0
for i, p in enumerate(prompts):
    xr, lr = generate(p[None])
    same &= torch.equal(xb[i, P - len(p):], xr[0])
    maxdiff = max(maxdiff, (lb[i, P - len(p):] - lr[0]).abs().max().item())
print("generated:", xb[:, P:].tolist())
print("tokens identical:", same, " max |final logits diff| =", maxdiff)
assert same and maxdiff < 1e-10 and not (xb[:, P:] == MASK_ID).any()
