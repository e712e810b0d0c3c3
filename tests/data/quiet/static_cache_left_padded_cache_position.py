"""A static cache under batched generation from a left-padded prompt, as transformers' StaticCache and
`generate(cache_implementation="static")` run a Llama (modeling_llama.py with cache_utils.StaticLayer, written by
hand): `max_cache_len` slots, slot j holding position j; the model call gets `cache_position` (where its queries
are), and the 2-D `attention_mask` over the tokens seen so far (1 = real, grown by one per step); the 4-D mask
covers every slot: a key is kept where its slot is at or before the query's position and is a real token.

Right: no real query sees a pad, a later position, or an unwritten slot."""
import torch
import torch.nn.functional as F
from torch import nn

MAX_CACHE_LEN = 8


class LlamaAttention(nn.Module):
    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv_proj = nn.Linear(d, 3 * d, bias=False)
        self.register_buffer("keys", torch.zeros(2, heads, MAX_CACHE_LEN, d // heads))
        self.register_buffer("values", torch.zeros(2, heads, MAX_CACHE_LEN, d // heads))

    def forward(self, hidden_states, attention_mask, cache_position):
        b, t, d = hidden_states.shape
        q, k, v = self.qkv_proj(hidden_states).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        self.keys.index_copy_(2, cache_position, k)
        self.values.index_copy_(2, cache_position, v)
        out = F.scaled_dot_product_attention(q, self.keys, self.values, attn_mask=attention_mask)
        return out.transpose(1, 2).reshape(b, t, d)


class LlamaModel(nn.Module):
    def __init__(self, d=16, vocab=32):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d, padding_idx=0)
        self.layers = nn.ModuleList(LlamaAttention(d) for _ in range(2))
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids, attention_mask, cache_position):
        slots = torch.arange(MAX_CACHE_LEN)
        padded = torch.zeros(input_ids.shape[0], MAX_CACHE_LEN, dtype=torch.bool)
        padded[:, :attention_mask.shape[1]] = attention_mask.bool()
        mask = (slots[None, :] <= cache_position[:, None])[None, None] & padded[:, None, None, :]
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = h + layer(h, mask, cache_position)
        return self.lm_head(h)


def main():
    torch.manual_seed(0)
    model = LlamaModel().eval()
    input_ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    attention_mask = (input_ids != 0).long()
    cache_position = torch.arange(4)
    with torch.no_grad():
        for _ in range(3):
            logits = model(input_ids, attention_mask, cache_position)
            input_ids = logits[:, -1:].argmax(-1)
            attention_mask = torch.cat([attention_mask, torch.ones(2, 1, dtype=torch.long)], 1)
            cache_position = cache_position[-1:] + 1
    print(tuple(attention_mask.shape))


if __name__ == "__main__":
    main()
