# The same bug as allenai/allennlp#3465 written another way: an AllenNLP-style model handed its TextFieldTensors
# (`{"tokens": {"tokens": ids}}`, one dict per indexer), the ids left-padded with the embedding's padding_idx=1, and a
# seq2vec encoder on nn.MultiheadAttention that is never given a key_padding_mask. --fixed: the mask from the ids
# (`get_text_field_mask`: ids != padding_idx), handed on as key_padding_mask.
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
PAD = 1


def get_text_field_mask(text_field_tensors):
    """allennlp.nn.util.get_text_field_mask for one indexer's ids: True on the real tokens."""
    (indexer_tensors,) = text_field_tensors.values()
    (ids,) = indexer_tensors.values()
    return ids != PAD


class SelfAttentiveClassifier(nn.Module):
    def __init__(self, vocab=50, dim=16, heads=2, classes=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=PAD)
        self.encoder = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.out = nn.Linear(dim, classes)

    def forward(self, tokens, label=None):
        (ids,) = tokens["tokens"].values()
        x = self.embed(ids)
        padding = ~get_text_field_mask(tokens) if FIXED else None
        h, _ = self.encoder(x, x, x, key_padding_mask=padding, need_weights=False)
        mask = get_text_field_mask(tokens).unsqueeze(-1).float()
        return self.out((h * mask).sum(1) / mask.sum(1))


model = SelfAttentiveClassifier().eval()
lengths = [7, 4, 2]
seq = max(lengths)
ids = torch.full((len(lengths), seq), PAD)
for row, n in enumerate(lengths):
    ids[row, seq - n:] = torch.randint(2, 50, (n,))  # left-padded, as a collate that pads on the left does

with torch.no_grad():
    batched = model({"tokens": {"tokens": ids}})
    alone = model({"tokens": {"tokens": ids[1:2, seq - lengths[1]:]}})
print("max |batched - alone| for row 1:", (batched[1] - alone[0]).abs().max().item())
