# The verl-SpeCo#18 bug (a packed row's document lengths kept in the batch dict, never reaching the mask, so the packed
# documents attend each other) written another way: a supervised fine-tuning step over three documents packed into one
# row padded at its end, the collator's `inputs["doc_lens"]` beside input_ids / attention_mask, position_ids counting up
# over the row (pads included), a small nn.Module LM with SDPA and a boolean mask. Buggy: the model builds causal &
# padding only; fixed: the trainer hands doc_lens on and the mask keeps causal within each document.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
V, D, H = 30, 16, 2


class PackedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.pos = nn.Embedding(64, D)
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, V)

    def forward(self, input_ids, position_ids, attention_mask, doc_lens=None):
        b, t = input_ids.shape
        x = self.emb(input_ids) + self.pos(position_ids)
        q, k, v = self.qkv(x).view(b, t, 3, H, D // H).permute(2, 0, 3, 1, 4)
        keep = torch.ones(t, t, dtype=torch.bool).tril()[None] & attention_mask.bool()[:, None, :]
        if doc_lens is not None:
            doc = torch.repeat_interleave(torch.arange(len(doc_lens)), doc_lens)
            doc = torch.cat([doc, torch.full((t - len(doc),), -1)])
            keep = keep & (doc[:, None] == doc[None, :])[None]
        keep = keep | torch.eye(t, dtype=torch.bool)[None]              # (a pad row keeps itself: no NaN)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None])
        return self.out(y.transpose(1, 2).reshape(b, t, D))


def training_step(model, inputs):
    doc_lens = inputs["doc_lens"] if FIXED else None
    return model(inputs["input_ids"], inputs["position_ids"], inputs["attention_mask"], doc_lens=doc_lens)


docs = [torch.randint(0, V, (n,)) for n in (5, 4, 6)]
T = 18                                                                 # 15 real tokens, 3 pads
ids = torch.cat(docs + [torch.zeros(T - 15, dtype=torch.long)])[None]
inputs = {
    "input_ids": ids,
    "attention_mask": (torch.arange(T) < 15).long()[None],
    "position_ids": torch.arange(T)[None],
    "doc_lens": torch.tensor([len(d) for d in docs]),
}
model = PackedLM().eval()
with torch.no_grad():
    logits = training_step(model, inputs)
    # reference: the last document alone, at the same positions
    start = 9
    alone = model(docs[2][None], torch.arange(start, start + 6)[None], torch.ones(1, 6, dtype=torch.long))
print(f"max |packed doc 3 logits - doc 3 alone| = {(logits[0, start:start + 6] - alone[0]).abs().max().item():.6f}")
