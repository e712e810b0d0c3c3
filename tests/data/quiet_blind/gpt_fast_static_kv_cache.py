"""gpt-fast style generation with a statically preallocated KV cache of max_seq_length slots.

Follows pytorch-labs/gpt-fast model.py (KVCache.update with index_copy_ at input_pos, Transformer.setup_caches
building causal_mask = tril(ones(max_seq_length, max_seq_length)), Attention.forward with
mask = causal_mask[None, None, input_pos] and F.scaled_dot_product_attention over the WHOLE cache).
The keys are always all max_seq_length slots; slots not yet written are zeros and are hidden by the causal
rows (row p admits slots 0..p). That is the intended mask: causal over absolute positions.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class ModelArgs:
    block_size: int = 32
    vocab_size: int = 48
    n_head: int = 4
    dim: int = 32

    @property
    def head_dim(self):
        return self.dim // self.n_head


class KVCache(nn.Module):
    def __init__(self, max_batch_size, max_seq_length, n_heads, head_dim, dtype=torch.float32):
        super().__init__()
        cache_shape = (max_batch_size, n_heads, max_seq_length, head_dim)
        self.register_buffer("k_cache", torch.zeros(cache_shape, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(cache_shape, dtype=dtype))

    def update(self, input_pos, k_val, v_val):
        assert input_pos.shape[0] == k_val.shape[2]
        self.k_cache.index_copy_(2, input_pos, k_val)
        self.v_cache.index_copy_(2, input_pos, v_val)
        return self.k_cache, self.v_cache


class Attention(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.wqkv = nn.Linear(config.dim, 3 * config.dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)
        self.kv_cache = None
        self.n_head, self.head_dim, self.dim = config.n_head, config.head_dim, config.dim

    def forward(self, x: Tensor, mask: Tensor, input_pos: Tensor) -> Tensor:
        bsz, seqlen, _ = x.shape
        q, k, v = self.wqkv(x).split([self.dim, self.dim, self.dim], dim=-1)
        q, k, v = (t.view(bsz, seqlen, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(input_pos, k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        return self.wo(y.transpose(1, 2).contiguous().view(bsz, seqlen, self.dim))


class Transformer(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.attention = Attention(config)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.max_seq_length = -1

    def setup_caches(self, max_batch_size, max_seq_length):
        self.max_seq_length = max_seq_length
        self.attention.kv_cache = KVCache(max_batch_size, max_seq_length, self.config.n_head, self.config.head_dim)
        self.causal_mask = torch.tril(torch.ones(self.max_seq_length, self.max_seq_length, dtype=torch.bool))

    def forward(self, idx: Tensor, input_pos: Tensor) -> Tensor:
        mask = self.causal_mask[None, None, input_pos]
        x = self.tok_embeddings(idx)
        return self.output(self.attention(x, mask, input_pos))


@torch.no_grad()
def generate(model, prompt, max_new_tokens):
    T = prompt.size(0)
    model.setup_caches(max_batch_size=1, max_seq_length=model.config.block_size)
    input_pos = torch.arange(0, T)
    next_token = model(prompt.view(1, -1), input_pos)[:, -1].argmax(-1)
    out = [int(next_token)]
    input_pos = torch.tensor([T])
    for _ in range(max_new_tokens - 1):
        next_token = model(next_token.view(1, -1), input_pos)[:, -1].argmax(-1)
        out.append(int(next_token))
        input_pos += 1
    return out


def main():
    torch.manual_seed(0)
    model = Transformer(ModelArgs()).eval()
    prompt = torch.randint(0, model.config.vocab_size, (7,))
    print(generate(model, prompt, max_new_tokens=6))


if __name__ == "__main__":
    main()
