"""A static (preallocated) KV cache as pytorch-labs/gpt-fast's model.py writes it: `KVCache` holds max_seq_length
slots, `k_cache[:, :, input_pos] = k_val`, the model keeps `causal_mask = tril(ones(max_seq_length, ...))` and hands
SDPA `mask = self.causal_mask[None, None, input_pos]`: queries at `input_pos`, keys over every slot (slots past the
written ones hidden by the triangle). Prefill of 4 tokens into 10 slots, then two decode steps.

Right: query at position p sees slots 0..p, every slot it sees written."""
import torch
import torch.nn.functional as F
from torch import nn


class KVCache(nn.Module):
    def __init__(self, batch, heads, max_seq_length, head_dim):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(batch, heads, max_seq_length, head_dim))
        self.register_buffer("v_cache", torch.zeros(batch, heads, max_seq_length, head_dim))

    def update(self, input_pos, k_val, v_val):
        self.k_cache[:, :, input_pos] = k_val
        self.v_cache[:, :, input_pos] = v_val
        return self.k_cache, self.v_cache


class Attention(nn.Module):
    def __init__(self, dim=16, n_head=2):
        super().__init__()
        self.n_head = n_head
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.kv_cache = None

    def forward(self, x, mask, input_pos):
        b, t, d = x.shape
        q, k, v = self.wqkv(x).view(b, t, 3, self.n_head, -1).permute(2, 0, 3, 1, 4)
        k, v = self.kv_cache.update(input_pos, k, v)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0).transpose(1, 2).reshape(b, t, d)


class Transformer(nn.Module):
    def __init__(self, dim=16, n_layer=2, vocab=32):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Attention(dim) for _ in range(n_layer))
        self.output = nn.Linear(dim, vocab, bias=False)

    def setup_caches(self, max_batch_size, max_seq_length):
        for layer in self.layers:
            layer.kv_cache = KVCache(max_batch_size, layer.n_head, max_seq_length, 8)
        self.causal_mask = torch.tril(torch.ones(max_seq_length, max_seq_length, dtype=torch.bool))

    def forward(self, idx, input_pos):
        mask = self.causal_mask[None, None, input_pos]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = x + layer(x, mask, input_pos)
        return self.output(x)


def main():
    torch.manual_seed(0)
    model = Transformer().eval()
    model.setup_caches(max_batch_size=1, max_seq_length=10)
    prompt = torch.tensor([[3, 5, 7, 9]])
    with torch.no_grad():
        logits = model(prompt, torch.arange(4))
        token = logits[:, -1:].argmax(-1)
        for pos in (4, 5):
            token = model(token, torch.tensor([pos]))[:, -1:].argmax(-1)
    print(int(token))


if __name__ == "__main__":
    main()
