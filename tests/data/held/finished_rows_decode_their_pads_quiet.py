"""Greedy decoding of a batch of two with a KV cache (XLM's generate, as facebookresearch/XLM runs it): a row that has
emitted EOS keeps decoding PAD tokens, and `gen_len`, the lengths its step function holds, stops growing for it; the
decoder's self-attention is causal only (its own pads are behind each real query). Correct: a finished row's step
queries sit on its pads, and what they see is no real query's."""

import torch
import torch.nn.functional as F

PAD, EOS = 0, 1


class Decoder(torch.nn.Module):
    def __init__(self, vocab=20, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, vocab)

    def forward(self, tokens, cache):
        b, t = tokens.shape
        x = self.embed(tokens)
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if cache:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        cache[:] = [k, v]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1)
        return self.out(x + out.transpose(1, 2).reshape(b, t, -1))


def step(model, tokens, cache, gen_len):
    return model(tokens, cache)[:, -1]


torch.manual_seed(0)
model = Decoder().eval()
generated = torch.tensor([[2, 5, 7], [2, 9, 4]])
gen_len = torch.tensor([3, 3])
unfinished = torch.ones(2, dtype=torch.long)
stop_after = torch.tensor([1, 5])  # (row 0 emits EOS at its second step, row 1 runs on)
cache = []
with torch.no_grad():
    logits = step(model, generated, cache, gen_len)
    for i in range(5):
        words = logits.argmax(-1)
        words = torch.where(i >= stop_after, torch.full_like(words, EOS), words)
        words = words * unfinished + PAD * (1 - unfinished)
        generated = torch.cat([generated, words[:, None]], dim=1)
        gen_len += unfinished
        unfinished = unfinished * words.ne(EOS).long()
        logits = step(model, words[:, None], cache, gen_len)
print("generated:", generated.tolist(), "lengths:", gen_len.tolist())
