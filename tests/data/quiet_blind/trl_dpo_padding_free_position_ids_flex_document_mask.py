"""TRL DPO with padding_free: chosen and rejected of every pair packed into ONE row, split by position_ids.

Follows huggingface/trl's DPOTrainer padding-free path (trl/trainer/dpo_trainer.py concatenated_forward with
padding_free=True: prompt+chosen and prompt+rejected rows are flattened into a single row, attention_mask is
dropped, and position_ids restart at 0 for each sequence so a flash-attention varlen kernel sees separate
documents). Here the varlen attention is written with FlexAttention: the document id is the running count of
position_ids == 0, and the block mask is causal within a document. Mask meant: block-diagonal causal, one block
per (prompt + chosen) and per (prompt + rejected) sequence; no padding anywhere.
"""
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

torch.manual_seed(0)
warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")


class Policy(nn.Module):
    def __init__(self, vocab=50, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(128, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.lm = nn.Linear(d, vocab)

    def forward(self, input_ids, position_ids):
        t = input_ids.shape[1]
        h = self.emb(input_ids) + self.pos(position_ids)
        q, k, v = self.qkv(h).view(1, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        doc = torch.cumsum(position_ids[0] == 0, 0)

        def mask_mod(b, hh, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

        block_mask = create_block_mask(mask_mod, None, None, t, t, device="cpu")
        o = flex_attention(q, k, v, block_mask=block_mask)
        return self.lm(h + o.transpose(1, 2).reshape(1, t, -1))


def main():
    pairs = [([3, 4, 5], [10, 11, 1], [12, 1]), ([6, 7], [13, 1], [14, 15, 16, 1])]
    ids, pos, loss_mask = [], [], []
    for is_rejected in (0, 1):  # concatenated_forward: all chosen first, then all rejected
        for prompt, chosen, rejected in pairs:
            completion = rejected if is_rejected else chosen
            seq = prompt + completion
            ids += seq
            pos += list(range(len(seq)))
            loss_mask += [0] * len(prompt) + [1] * len(completion)
    n_seq = 2 * len(pairs)
    input_ids = torch.tensor([ids])
    position_ids = torch.tensor([pos])
    seq_idx = torch.cumsum(position_ids[0] == 0, 0) - 1
    loss_mask = torch.tensor(loss_mask).bool()

    model = Policy()
    # FlexAttention has no CPU backward: this evaluates the DPO loss (e.g. an eval step), no gradient
    with torch.no_grad():
        ref_logits = Policy()(input_ids, position_ids)
        logits = model(input_ids, position_ids)

    def seq_logps(lg):
        # shift inside each sequence: label at i is token i, predicted at i-1 of the same sequence
        lp = torch.log_softmax(lg[0, :-1], -1).gather(-1, input_ids[0, 1:, None]).squeeze(-1)
        valid = loss_mask[1:] & (position_ids[0, 1:] != 0)
        return torch.zeros(n_seq).index_add(0, seq_idx[1:], lp * valid)

    pol, ref = seq_logps(logits), seq_logps(ref_logits)
    half = len(pairs)
    beta = 0.1
    logits_dpo = beta * ((pol[:half] - ref[:half]) - (pol[half:] - ref[half:]))
    loss = -F.logsigmoid(logits_dpo).mean()
    assert torch.isfinite(loss)
    print(f"dpo loss {loss.item():.4f} over {n_seq} packed sequences, row length {input_ids.shape[1]}")


if __name__ == "__main__":
    main()
