# Written another way (ROLL#304's kind, helper fix-cd): an SFT collator whose tokenizer pads with its eos id (pad ==
# eos, as GPT-2's and many base models' do) appends the eos to each example, right-pads the batch with the same id and
# builds the attention mask as `input_ids != pad_id`, so the eos each example ends with is masked as padding; the
# model (nn.MultiheadAttention, a causal attn_mask and a key_padding_mask) never sees it. The program's check runs
# each example alone, eos included. Fixed: the mask comes from each example's length, its eos counted in.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

EOS_ID = PAD_ID = 2


class TinyLM(nn.Module):
    def __init__(self, vocab=40, dim=32, heads=4, layers=2):
        super().__init__()
        self.pad_token_id = PAD_ID
        self.eos_token_id = EOS_ID
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.MultiheadAttention(dim, heads, batch_first=True) for _ in range(layers))
        self.value = nn.Linear(dim, 1)

    def forward(self, input_ids, attention_mask=None):
        T = input_ids.size(1)
        causal = torch.ones(T, T, dtype=torch.bool).triu(1)  # True = not allowed
        pad = None if attention_mask is None else attention_mask == 0  # True = padding
        x = self.embed(input_ids)
        for attn in self.layers:
            x = x + attn(x, x, x, attn_mask=causal, key_padding_mask=pad, need_weights=False)[0]
        return self.value(x).squeeze(-1)


def collate(examples):
    seqs = [e + [EOS_ID] for e in examples]
    width = max(len(s) for s in seqs)
    input_ids = torch.tensor([s + [PAD_ID] * (width - len(s)) for s in seqs])
    if FIXED:
        lengths = torch.tensor([len(s) for s in seqs])
        attention_mask = (torch.arange(width)[None] < lengths[:, None]).long()
    else:
        attention_mask = (input_ids != PAD_ID).long()
    return input_ids, attention_mask


model = TinyLM().eval()
examples = [[5, 6, 7, 8, 9], [11, 12, 13]]
input_ids, attention_mask = collate(examples)
with torch.no_grad():
    values = model(input_ids, attention_mask)
    for b, e in enumerate(examples):
        alone = model(torch.tensor([e + [EOS_ID]]))
        print(f"fixed={FIXED} example {b}: value at eos batched {values[b, len(e)]:.4f} alone {alone[0, -1]:.4f}")
