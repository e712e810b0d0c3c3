# x-transformers (lucidrains), PR lucidrains/x-transformers#103 (commit dcae403, follow-up cc107eb).
# RelativePositionBias numbered queries 0..i-1 and keys 0..j-1 even when Transformer-XL memories are
# prepended to the keys, so the T5 relative bias over [memory + segment] is offset by the memory length.
import sys, math
import torch
import torch.nn.functional as F
from torch import nn, einsum

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

def exists(v):
    return v is not None

def max_neg_value(t):
    return -torch.finfo(t.dtype).max

class RelativePositionBias(nn.Module):
    def __init__(self, scale, causal = False, num_buckets = 32, max_distance = 128, heads = 8):
        super().__init__()
        self.scale = scale
        self.causal = causal
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.relative_attention_bias = nn.Embedding(num_buckets, heads)

    @staticmethod
    def _relative_position_bucket(relative_position, causal = True, num_buckets = 32, max_distance = 128):
        ret = 0
        n = -relative_position
        if not causal:
            num_buckets //= 2
            ret += (n < 0).long() * num_buckets
            n = torch.abs(n)
        else:
            n = torch.max(n, torch.zeros_like(n))
        max_exact = num_buckets // 2
        is_small = n < max_exact
        val_if_large = max_exact + (
            torch.log(n.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
        ).long()
        val_if_large = torch.min(val_if_large, torch.full_like(val_if_large, num_buckets - 1))
        ret += torch.where(is_small, n, val_if_large)
        return ret

    def forward(self, qk_dots):
        i, j, device = *qk_dots.shape[-2:], qk_dots.device
        if FIXED:
            q_pos = torch.arange(j - i, j, dtype = torch.long, device = device)
            k_pos = torch.arange(j, dtype = torch.long, device = device)
        else:
            q_pos = torch.arange(i, dtype = torch.long, device = device)
            k_pos = torch.arange(j, dtype = torch.long, device = device)
        rel_pos = k_pos[None, :] - q_pos[:, None]
        rp_bucket = self._relative_position_bucket(rel_pos, causal = self.causal, num_buckets = self.num_buckets, max_distance = self.max_distance)
        values = self.relative_attention_bias(rp_bucket)
        bias = values.permute(2, 0, 1)  # 'i j h -> h i j'
        return qk_dots + (bias * self.scale)

class Attention(nn.Module):
    def __init__(self, dim, dim_head = 8, heads = 4, causal = False):
        super().__init__()
        self.scale = dim_head ** -0.5
        self.heads = heads
        self.causal = causal
        inner = dim_head * heads
        self.to_q = nn.Linear(dim, inner, bias = False)
        self.to_k = nn.Linear(dim, inner, bias = False)
        self.to_v = nn.Linear(dim, inner, bias = False)
        self.to_out = nn.Linear(inner, dim, bias = False)

    def forward(self, x, rel_pos = None, mem = None):
        b, n, _ = x.shape
        h, device = self.heads, x.device
        q_input, k_input, v_input = x, x, x
        if exists(mem):
            k_input = torch.cat((mem, k_input), dim = -2)
            v_input = torch.cat((mem, v_input), dim = -2)
        q, k, v = self.to_q(q_input), self.to_k(k_input), self.to_v(v_input)
        q, k, v = map(lambda t: t.reshape(b, t.shape[1], h, -1).transpose(1, 2), (q, k, v))
        dots = einsum('b h i d, b h j d -> b h i j', q, k) * self.scale
        mask_value = max_neg_value(dots)
        if exists(rel_pos):
            dots = rel_pos(dots)
        if self.causal:
            i, j = dots.shape[-2:]
            range_i = torch.arange(i, device = device)
            mask = range_i.view(1, 1, i, 1) < range_i.view(1, 1, 1, i)
            mask = F.pad(mask, (j - i, 0), value = False)
            dots.masked_fill_(mask, mask_value)
        attn = F.softmax(dots, dim = -1, dtype = torch.float32)
        out = einsum('b h i j, b h j d -> b h i d', attn, v)
        out = out.transpose(1, 2).reshape(b, n, -1)
        return self.to_out(out)

class Decoder(nn.Module):
    # AttentionLayers(causal = True, rel_pos_bias = True, pre_norm = False): post-norm, so the cached
    # hiddens (layer inputs) are exactly what the attention block sees
    def __init__(self, dim, depth, heads = 4, rel_pos_num_buckets = 32, rel_pos_max_distance = 128):
        super().__init__()
        dim_head = dim // heads
        self.rel_pos = RelativePositionBias(scale = dim_head ** 0.5, causal = True, heads = heads,
                                            num_buckets = rel_pos_num_buckets, max_distance = rel_pos_max_distance)
        self.layer_types = ('a', 'f') * depth
        self.num_attn_layers = depth
        self.layers = nn.ModuleList([])
        for t in self.layer_types:
            block = Attention(dim, dim_head = dim_head, heads = heads, causal = True) if t == 'a' else \
                nn.Sequential(nn.Linear(dim, dim * 4), nn.GELU(), nn.Linear(dim * 4, dim))
            self.layers.append(nn.ModuleList([nn.LayerNorm(dim), block]))

    def forward(self, x, mems = None):
        hiddens = []
        mems = mems.copy() if exists(mems) else [None] * self.num_attn_layers
        for layer_type, (post_main_norm, block) in zip(self.layer_types, self.layers):
            if layer_type == 'a':
                hiddens.append(x)
                layer_mem = mems.pop(0) if mems else None
            residual = x
            if layer_type == 'a':
                out = block(x, rel_pos = self.rel_pos, mem = layer_mem)
            else:
                out = block(x)
            x = out + residual
            x = post_main_norm(x)
        return x, hiddens

class TransformerWrapper(nn.Module):
    def __init__(self, num_tokens, max_mem_len, attn_layers, dim):
        super().__init__()
        self.token_emb = nn.Embedding(num_tokens, dim)   # abs pos emb disabled with rel_pos_bias
        self.attn_layers = attn_layers
        self.max_mem_len = max_mem_len
        self.to_logits = nn.Linear(dim, num_tokens)

    def forward(self, x, mems = None, return_mems = False):
        x = self.token_emb(x)
        x, hiddens = self.attn_layers(x, mems = mems)
        out = self.to_logits(x)
        if return_mems:
            new_mems = list(map(lambda pair: torch.cat(pair, dim = -2), zip(mems, hiddens))) if exists(mems) else hiddens
            new_mems = list(map(lambda t: t[..., -self.max_mem_len:, :].detach(), new_mems))
            return out, new_mems
        return out

dim = 32
model = TransformerWrapper(num_tokens = 64, max_mem_len = 8, dim = dim,
                           attn_layers = Decoder(dim = dim, depth = 2, heads = 4)).eval()

seq = torch.randint(0, 64, (2, 16))
with torch.no_grad():
    full = model(seq)                                   # whole sequence in one pass
    _, mems = model(seq[:, :8], return_mems = True)     # segment 1, keep XL memories
    seg2 = model(seq[:, 8:], mems = mems)               # segment 2 attends to [memories + segment]

diff = (seg2 - full[:, 8:]).abs().max().item()
print(f"max |logits(segment 2 with XL mems) - logits(full pass)| = {diff:.3e}")
