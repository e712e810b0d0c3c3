"""Beam search over a left-padded batch of two prompts, 2 beams each, as transformers' beam search runs a
decoder: inputs expanded with `repeat_interleave(num_beams)`, the 2-D `attention_mask` grown by one each step, the
KV cache reordered each step by the chosen beams (`cache.reorder_cache(beam_idx)`, index_select on the batch),
and the attention_mask and the positions following the same beam index (they are equal within one prompt). A
hand-written decoder taking `attention_mask` and `position_ids`, SDPA with a 4-D mask: causal and no pad key.

Right: every real query sees its own prompt's real tokens and its beam's history, never a pad."""
import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x, mask, past):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(b, t, d), (k, v)


class Decoder(nn.Module):
    def __init__(self, d=16, vocab=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=0)
        self.layers = nn.ModuleList(Attention(d) for _ in range(2))
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, input_ids, attention_mask, position_ids, past_key_values=None):
        t, total = input_ids.shape[1], attention_mask.shape[1]
        q_pos = torch.arange(total - t, total)[:, None]
        mask = (torch.arange(total)[None, :] <= q_pos)[None, None] & attention_mask.bool()[:, None, None, :]
        x, new = self.embed(input_ids), []
        for i, layer in enumerate(self.layers):
            out, kv = layer(x, mask, None if past_key_values is None else past_key_values[i])
            x, _ = x + out, new.append(kv)
        return self.lm_head(x), new


def main():
    torch.manual_seed(0)
    beams, model = 2, Decoder().eval()
    prompts = torch.tensor([[0, 0, 4, 5], [6, 7, 8, 9]])
    input_ids = prompts.repeat_interleave(beams, 0)
    attention_mask = (input_ids != 0).long()
    scores = torch.tensor([0.0, -1e9]).repeat(2)
    with torch.no_grad():
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        logits, past = model(input_ids, attention_mask, position_ids)
        for _ in range(3):
            logp = (logits[:, -1].log_softmax(-1) + scores[:, None]).view(2, -1)
            top = logp.topk(beams, dim=-1)
            beam_idx = (top.indices // logits.shape[-1] + torch.arange(2)[:, None] * beams).view(-1)
            tokens, scores = (top.indices % logits.shape[-1]).view(-1, 1), top.values.view(-1)
            past = [(k.index_select(0, beam_idx), v.index_select(0, beam_idx)) for k, v in past]
            attention_mask = torch.cat([attention_mask.index_select(0, beam_idx), torch.ones(4, 1, dtype=torch.long)], 1)
            position_ids = attention_mask.sum(-1, keepdim=True) - 1
            logits, past = model(tokens, attention_mask, position_ids, past_key_values=past)
    print(tuple(attention_mask.shape))


if __name__ == "__main__":
    main()
