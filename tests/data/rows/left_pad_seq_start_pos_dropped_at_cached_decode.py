"""Left-padded batched greedy decoding whose padding mask is lost after the prefill.

A small GPT-style decoder (2 layers, 4 heads, width 32, learned positions)
generates a few tokens for a batch of prompts of different lengths.  The
prompts are left-padded with id 0, and ``generate`` computes
``seq_start_pos = max_len - prompt_lens``: the column where each row's real
tokens begin.  It hands ``seq_start_pos=`` to the model at the prefill and at
every decode step, and the model is supposed to hide every key column before
that start.

The bug: the forward only builds the padding part of the mask when there is
no cache yet or when the call carries more than one query.  The prefill is
therefore masked correctly, but every single-token decode step runs with only
the (trivial) causal part, so the new token attends to the left-pad keys that
sit in the cache, and the shorter prompts' continuations drift away from what
the same prompt gives when it is decoded alone.

The fix: build the padding part at every call, so a decode step also keeps
only the keys at or after ``seq_start_pos``.

The script prints, for each row, the largest gap between its decode-step
logits in the batch and the logits of that row's prompt decoded on its own
(no padding, same tokens fed back).  With ``--fixed`` every gap is ~1e-6.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

VOCAB, DIM, HEADS, LAYERS, MAX_POS = 50, 32, 4, 2, 64
PAD_ID = 0


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.ln2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x, attn_mask, past):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(DIM, dim=-1)
        split = lambda z: z.view(b, t, HEADS, DIM // HEADS).transpose(1, 2)
        q, k, v = split(q), split(k), split(v)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        x = x + self.proj(out.transpose(1, 2).reshape(b, t, DIM))
        x = x + self.mlp(self.ln2(x))
        return x, (k, v)


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(MAX_POS, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids, cache=None, seq_start_pos=None):
        b, t = input_ids.shape
        past_len = 0 if cache is None else cache[0][0].shape[2]
        total = past_len + t
        q_idx = torch.arange(past_len, total)[:, None]          # (t, 1) buffer columns of the queries
        k_idx = torch.arange(total)[None, :]                     # (1, total)

        # causal part, shared by every row
        allowed = (k_idx <= q_idx)[None].expand(b, t, total)     # (b, t, total)

        if seq_start_pos is None:
            seq_start_pos = torch.zeros(b, dtype=torch.long)
        needs_pad_part = FIXED or cache is None or t > 1
        if needs_pad_part:
            keep = k_idx >= seq_start_pos[:, None]               # (b, total)
            allowed = allowed & keep[:, None, :]
            # a pad query would otherwise see no key at all: let it see itself
            allowed = allowed | (k_idx == q_idx)[None]

        pos_ids = (q_idx.T - seq_start_pos[:, None]).clamp(min=0)  # (b, t), counts from first real token
        x = self.tok(input_ids) + self.pos(pos_ids)

        attn_mask = allowed[:, None]                             # (b, 1, t, total)
        new_cache = []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, attn_mask, None if cache is None else cache[i])
            new_cache.append(kv)
        return self.head(self.ln_f(x)), new_cache


@torch.no_grad()
def generate(model, prompts, steps, forced=None):
    """Greedy decoding of left-padded prompts; returns (tokens, per-step logits).

    ``forced`` (list of lists of token ids, one per row) replaces the greedy pick,
    so a reference run can be fed the exact tokens the batched run chose.
    """
    lens = torch.tensor([len(p) for p in prompts])
    max_len = int(lens.max())
    ids = torch.full((len(prompts), max_len), PAD_ID, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, max_len - len(p):] = torch.tensor(p)
    seq_start_pos = max_len - lens

    logits, cache = model(ids, seq_start_pos=seq_start_pos)
    step_logits, chosen = [], []
    last = logits[:, -1]
    for s in range(steps):
        step_logits.append(last)
        nxt = last.argmax(-1) if forced is None else torch.tensor([f[s] for f in forced])
        chosen.append(nxt)
        logits, cache = model(nxt[:, None], cache=cache, seq_start_pos=seq_start_pos)
        last = logits[:, -1]
    return torch.stack(chosen, 1), torch.stack(step_logits, 1)


def main():
    model = TinyGPT().eval()
    prompts = [
        [5, 17, 33, 8, 21, 40, 12],
        [9, 3, 44],
        [27, 14, 6, 30, 2],
    ]
    steps = 5
    tokens, batch_logits = generate(model, prompts, steps)

    worst = 0.0
    for row, p in enumerate(prompts):
        _, alone = generate(model, [p], steps, forced=[tokens[row].tolist()])
        gap = (batch_logits[row] - alone[0]).abs().max().item()
        worst = max(worst, gap)
        print(f"row {row} (prompt len {len(p)}, pad {len(max(prompts, key=len)) - len(p)}): "
              f"tokens {tokens[row].tolist()}  max |logit gap| vs alone = {gap:.2e}")
    print(f"mode: {'fixed' if FIXED else 'buggy'}")
    print(f"largest decode-step logit gap to per-row reference: {worst:.2e}")


if __name__ == "__main__":
    main()
