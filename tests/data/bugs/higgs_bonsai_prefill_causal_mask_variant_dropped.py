# panbanda/higgs#203 (Rust bonsai_q1.rs, torch port): create_attention_mask returns the Causal variant for a
# multi-token prefill, the per-layer match keeps only the Array variant, so prefill ran with no mask at all.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class AttentionMask:
    def __init__(self, kind, array=None):
        self.kind = kind  # "causal" or "array"
        self.array = array


def create_causal_mask(n, offset):
    rinds = torch.arange(offset + n)
    linds = torch.arange(offset, offset + n)
    return linds[:, None] >= rinds[None, :]


def create_attention_mask(h, cache, return_array=None):
    t = h.shape[1]
    if t > 1:
        offset = cache[0].offset if cache is not None else 0
        if return_array:
            return AttentionMask("array", create_causal_mask(t, offset))
        return AttentionMask("causal")
    return None


class KVCache:
    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0

    def update_and_fetch(self, k, v):
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys = torch.cat([self.keys, k], dim=2)
            self.values = torch.cat([self.values, v], dim=2)
        self.offset += k.shape[2]
        return self.keys, self.values


def cached_scaled_dot_product_attention(q, k, v, mask):
    # takes Option<&Array>: no causal masking of its own
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class BonsaiAttention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x, mask, cache):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k, v = cache.update_and_fetch(k, v)
        out = cached_scaled_dot_product_attention(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class BonsaiBlock(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = BonsaiAttention(dim, n_heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, mask, cache):
        x = x + self.attn(self.ln1(x), mask, cache)
        return x + self.mlp(self.ln2(x))


class BonsaiModel(nn.Module):
    def __init__(self, vocab=64, dim=32, n_heads=4, n_layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(128, dim)
        self.layers = nn.ModuleList([BonsaiBlock(dim, n_heads) for _ in range(n_layers)])
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward_trunk(self, tokens, cache):
        offset = cache[0].offset
        h = self.embed(tokens) + self.pos(torch.arange(offset, offset + tokens.shape[1]))
        # before the fix: create_attention_mask(&h, cache, None); after: Some(true)
        mask = create_attention_mask(h, cache, True if FIXED else None)
        mask_arr = mask.array if (mask is not None and mask.kind == "array") else None
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask_arr, c)
        return self.lm_head(self.norm(h))


@torch.no_grad()
def generate(model, prompt, max_new_tokens):
    cache = [KVCache() for _ in model.layers]
    logits = model.forward_trunk(prompt, cache)  # prefill
    step_logits = [logits[:, -1]]
    tok = logits[:, -1].argmax(-1, keepdim=True)
    out = [tok]
    for _ in range(max_new_tokens - 1):  # decode, one token at a time
        logits = model.forward_trunk(tok, cache)
        step_logits.append(logits[:, -1])
        tok = logits[:, -1].argmax(-1, keepdim=True)
        out.append(tok)
    return torch.cat(out, 1), torch.stack(step_logits, 1)


@torch.no_grad()
def reference(model, seq):
    # token-by-token decoding from scratch: every step is causal by construction
    cache = [KVCache() for _ in model.layers]
    return torch.stack([model.forward_trunk(seq[:, i:i + 1], cache)[:, -1] for i in range(seq.shape[1])], 1)


model = BonsaiModel().eval()
prompt = torch.randint(0, 64, (1, 8))
gen, logits = generate(model, prompt, 4)
ref = reference(model, torch.cat([prompt, gen[:, :-1]], 1))[:, prompt.shape[1] - 1:]
print("generated:", gen.tolist())
print("max |logits - token-by-token reference| = %.5f" % (logits - ref).abs().max().item())
