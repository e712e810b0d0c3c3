# osaurus-ai/vmlx-swift#429 (Glm5Next, ported to torch): below index_topk the indexer selection is
# skipped and the layer used the incoming mask, which the model never built, so prefill was bidirectional.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Glm5NextConfig:
    vocab_size = 64
    hidden_size = 32
    num_attention_heads = 4
    head_dim = 8
    index_n_heads = 2
    index_head_dim = 8
    index_topk = 16  # sparse selection only kicks in when the context is longer than this
    num_hidden_layers = 2


def create_attention_mask(h, offset=0):
    """Additive causal mask [L, offset + L]."""
    n = h.shape[1]
    rinds = torch.arange(offset + n)
    linds = torch.arange(offset, offset + n)
    visible = linds[:, None] >= rinds[None, :]
    return torch.where(visible, 0.0, torch.finfo(h.dtype).min)


class Indexer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = config.index_n_heads, config.index_head_dim, config.index_topk
        self.wq = nn.Linear(config.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)

    def __call__(self, x, mask):
        b, l, _ = x.shape
        if l <= self.topk:
            # every key would be selected anyway: skip the selection
            return None
        q = self.wq(x).view(b, l, self.n_heads, self.head_dim)
        k = self.wk(x)
        scores = torch.einsum("blhd,bsd->blhs", q, k).relu().sum(2)
        if mask is not None:
            scores = scores + mask
        return scores.topk(self.topk, dim=-1).indices

    def mask_from_indices(self, selected, kv_length):
        visible = torch.zeros(*selected.shape[:-1], kv_length, dtype=torch.bool)
        return visible.scatter(-1, selected, True)


class Glm5NextSparseAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.kv_proj = nn.Linear(config.hidden_size, 2 * self.n_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=False)
        self.indexer = Indexer(config)

    def forward(self, x, mask=None):
        b, l, _ = x.shape
        q = self.q_proj(x).view(b, l, self.n_heads, self.head_dim).transpose(1, 2)
        k, v = self.kv_proj(x).view(b, l, 2, self.n_heads, self.head_dim).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        effective_mask = mask
        selected = self.indexer(x, mask)
        if selected is not None:
            visible = self.indexer.mask_from_indices(selected, k.shape[2])[:, None]
            effective_mask = torch.where(visible, 0.0, torch.finfo(x.dtype).min)
            if mask is not None:
                effective_mask = effective_mask + mask
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=effective_mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, l, -1))


class Glm5NextLanguageModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Glm5NextSparseAttention(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, mask=None):
        h = self.embed_tokens(input_ids)
        if FIXED and mask is None:
            mask = create_attention_mask(h)
        for layer in self.layers:
            h = h + layer(h, mask)
        return self.lm_head(self.norm(h))


def main():
    torch.manual_seed(0)
    config = Glm5NextConfig()
    model = Glm5NextLanguageModel(config).eval()
    prompt = torch.randint(0, config.vocab_size, (1, 12))  # shorter than index_topk
    with torch.no_grad():
        full = model(prompt)
        prefix = model(prompt[:, :6])
    # a causal LM's logits for the first 6 tokens must not depend on tokens 6..11
    print(f"prefill logits drift from future tokens: {(full[:, :6] - prefix).abs().max().item():.4f}")


if __name__ == "__main__":
    main()
