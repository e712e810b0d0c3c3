"""Beam search with a KV cache, as fairseq's SequenceGenerator and transformers' `_reorder_cache` do it: after each
step the cache is reordered with `index_select(0, beam_idx)` so that each beam continues from its parent's keys;
every beam's query attends its whole (reordered) history, one new token per step, no padding. The model is a
hand-written decoder-only LM; the batch is 1 sentence x 3 beams.

Right: at each decode step every beam's single query sees every cached key of its own (parent's) history."""
import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x, past=None):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=past is None)
        return out.transpose(1, 2).reshape(b, t, d), (k, v)


class DecoderLM(nn.Module):
    def __init__(self, d=16, vocab=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Attention(d) for _ in range(2))
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, input_ids, past_key_values=None):
        x = self.embed(input_ids)
        new = []
        for i, layer in enumerate(self.layers):
            out, kv = layer(x, None if past_key_values is None else past_key_values[i])
            x = x + out
            new.append(kv)
        return self.lm_head(x), new


def reorder_cache(past, beam_idx):
    return [(k.index_select(0, beam_idx), v.index_select(0, beam_idx)) for k, v in past]


def main():
    torch.manual_seed(0)
    beams = 3
    model = DecoderLM().eval()
    input_ids = torch.tensor([[4, 5, 6, 7]]).repeat(beams, 1)
    scores = torch.tensor([0.0, -1e9, -1e9])  # the beams start as one
    with torch.no_grad():
        logits, past = model(input_ids)
        for _ in range(3):
            logp = logits[:, -1].log_softmax(-1) + scores[:, None]
            top = logp.view(-1).topk(beams)
            beam_idx, tokens = top.indices // logp.shape[1], top.indices % logp.shape[1]
            scores = top.values
            past = reorder_cache(past, beam_idx)
            logits, past = model(tokens[:, None], past_key_values=past)
    print(scores.shape)


if __name__ == "__main__":
    main()
