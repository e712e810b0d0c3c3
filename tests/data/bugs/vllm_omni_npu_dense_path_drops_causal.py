# vllm-project/vllm-omni#7324 (fixes #7322): FlashAttentionImpl.forward_fa_npu called the dense kernel with
# attn_mask=None when self.causal=True and no explicit mask was given, so Cosmos3's causal
# understanding pathway ran as full bidirectional attention.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def attention_forward(query, key, value, attn_mask=None):
    """Stand-in for mindiesd.attention_forward: dense attention, layout (B, S, H, D), keep-mask True=attend."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    return out.transpose(1, 2)


class FlashAttentionImpl:
    def __init__(self, num_heads, head_size, causal=False):
        self.num_heads = num_heads
        self.head_size = head_size
        self.causal = causal

    def forward_fa_npu(self, query, key, value, attn_mask=None):
        if FIXED and self.causal:
            sq, skv = query.shape[1], key.shape[1]
            q_pos = torch.arange(sq, device=query.device)[:, None]
            k_pos = torch.arange(skv, device=query.device)[None, :]
            causal_mask = k_pos <= q_pos + (skv - sq)  # bottom-right aligned
            attn_mask = causal_mask if attn_mask is None else torch.logical_and(attn_mask, causal_mask)
            attn_mask = attn_mask.contiguous()
        # before the fix: the causal flag is never materialised on this path
        return attention_forward(query, key, value, attn_mask=attn_mask)


class Cosmos3SelfAttention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads, self.hd = heads, hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.o = nn.Linear(hidden, hidden)
        self.attn = FlashAttentionImpl(heads, self.hd, causal=True)

    def forward(self, x):
        B, S, _ = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, self.hd).unbind(2)
        return self.o(self.attn.forward_fa_npu(q, k, v).reshape(B, S, -1))


class Cosmos3UnderstandingBlock(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = Cosmos3SelfAttention(hidden, heads)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Cosmos3Understanding(nn.Module):
    def __init__(self, vocab=64, hidden=32, heads=4, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList([Cosmos3UnderstandingBlock(hidden, heads) for _ in range(layers)])
        self.lm_head = nn.Linear(hidden, vocab)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(h)


model = Cosmos3Understanding().eval()
prompt = torch.randint(0, 64, (1, 10))
with torch.no_grad():
    logits_full = model(prompt)
    # a causal model's logits at position 5 must not depend on tokens 6..9
    logits_prefix = model(prompt[:, :6])
diff = (logits_full[0, 5] - logits_prefix[0, 5]).abs().max().item()
print(f"fixed={FIXED} max |logit(pos 5 | full prompt) - logit(pos 5 | prefix)| = {diff:.3e}")
