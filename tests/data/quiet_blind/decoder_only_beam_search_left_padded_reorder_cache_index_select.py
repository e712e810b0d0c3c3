"""Decoder-only beam search over left-padded prompts, KV cache and attention_mask reordered by beam_idx.

Follows huggingface/transformers src/transformers/generation/utils.py (_expand_inputs_for_generation
repeat_interleave of input_ids and attention_mask by num_beams; _beam_search: beam_idx from topk over
num_beams * vocab, `input_ids = input_ids[beam_idx]`, cache reorder by index_select on dim 0, the
attention_mask grown by a column of ones each step; position_ids = attention_mask.cumsum(-1) - 1 in
prepare_inputs_for_generation). Plain torch model, eager attention with an additive float mask.

Mask meant: each beam row is causal over its own real tokens; the prompt's left-pad slots are hidden
keys for every step. Beams of one prompt share that prompt's padding, but after reordering the cache
and the mask must still come from the same parent row (both are index_select-ed with beam_idx).
"""
import torch
import torch.nn.functional as F

torch.manual_seed(0)

VOCAB, D, H, PAD = 20, 16, 2, 0
NUM_BEAMS, MAX_NEW = 3, 4


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, D)
        self.qkv = torch.nn.Linear(D, 3 * D)
        self.pos = torch.nn.Embedding(32, D)
        self.head = torch.nn.Linear(D, VOCAB)

    def forward(self, input_ids, attention_mask, position_ids, past_key_values=None):
        b, s = input_ids.shape
        x = self.embed(input_ids) + self.pos(position_ids.clamp(min=0))
        q, k, v = self.qkv(x).view(b, s, 3, H, -1).permute(2, 0, 3, 1, 4)
        if past_key_values is not None:
            k = torch.cat([past_key_values[0], k], 2)
            v = torch.cat([past_key_values[1], v], 2)
        past = k.shape[2] - s
        min_dtype = torch.finfo(x.dtype).min
        causal = torch.full((s, k.shape[2]), min_dtype).triu(past + 1)
        mask = causal[None, None].expand(b, 1, s, -1).clone()
        mask = mask.masked_fill(attention_mask[:, None, None, :] == 0, min_dtype)
        attn = (q @ k.transpose(-1, -2) / (D // H) ** 0.5 + mask).softmax(-1)
        out = (attn @ v).transpose(1, 2).reshape(b, s, D)
        return self.head(x + out), (k, v)


def _reorder_cache(past_key_values, beam_idx):
    return tuple(t.index_select(0, beam_idx) for t in past_key_values)


def beam_search(model, input_ids, attention_mask):
    batch = input_ids.shape[0]
    input_ids = input_ids.repeat_interleave(NUM_BEAMS, 0)
    attention_mask = attention_mask.repeat_interleave(NUM_BEAMS, 0)
    beam_scores = torch.zeros(batch, NUM_BEAMS)
    beam_scores[:, 1:] = -1e9  # all beams start identical; keep only the first alive
    beam_scores = beam_scores.view(-1)
    past, cur = None, input_ids
    for _ in range(MAX_NEW):
        position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
        logits, past = model(cur, attention_mask, position_ids[:, -cur.shape[1]:], past)
        logp = logits[:, -1].log_softmax(-1) + beam_scores[:, None]
        top, idx = logp.view(batch, -1).topk(NUM_BEAMS, -1)
        beam_idx = (idx // VOCAB + torch.arange(batch)[:, None] * NUM_BEAMS).view(-1)
        next_tokens = (idx % VOCAB).view(-1, 1)
        beam_scores = top.view(-1)
        input_ids = torch.cat([input_ids[beam_idx], next_tokens], -1)
        attention_mask = torch.cat([attention_mask[beam_idx], torch.ones_like(next_tokens)], -1)
        past = _reorder_cache(past, beam_idx)
        cur = next_tokens
    return input_ids, attention_mask, beam_scores


def main():
    model = TinyLM()
    prompts = [[5, 6, 7, 8, 9], [11, 12]]
    n = max(map(len, prompts))
    input_ids = torch.tensor([[PAD] * (n - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        seqs, mask, scores = beam_search(model, input_ids, attention_mask)
        # every final beam, rescored from scratch without padding or cache, gives its beam score
        for row in range(seqs.shape[0]):
            ids = seqs[row][mask[row].bool()][None]
            plen = len(prompts[row // NUM_BEAMS])
            logits, _ = model(ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None])
            lp = logits[0, plen - 1:-1].log_softmax(-1).gather(-1, ids[0, plen:, None]).sum()
            assert torch.allclose(lp, scores[row], atol=1e-4), row
    print("beams", seqs.shape[0], "scores", [round(s, 3) for s in scores.tolist()])


if __name__ == "__main__":
    main()
