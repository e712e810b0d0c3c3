# A small GPT-style language model built on nn.TransformerEncoder (a common tutorial shape): the model states
# itself causal (`self.is_causal = True`) but its forward hands the stack only the batch's key padding, so every
# token attends to the later ones. Fixed: the square subsequent mask is passed with is_causal=True.
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
PAD = 0


class TinyCausalLM(nn.Module):
    def __init__(self, vocab=40, d_model=32, nhead=4, layers=2):
        super().__init__()
        self.is_causal = True
        self.embed = nn.Embedding(vocab, d_model, padding_idx=PAD)
        self.pos = nn.Embedding(64, d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead, 64, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, input_ids):
        length = input_ids.shape[1]
        h = self.embed(input_ids) + self.pos(torch.arange(length))[None]
        pad = input_ids == PAD
        if FIXED:
            causal = nn.Transformer.generate_square_subsequent_mask(length)
            h = self.blocks(h, mask=causal, src_key_padding_mask=pad, is_causal=True)
        else:
            h = self.blocks(h, src_key_padding_mask=pad)
        return self.head(h)


model = TinyCausalLM().train()  # (a training step: the encoder layers take their plain path)
batch = torch.tensor([[5, 9, 12, 7, 3, 8], [4, 11, 6, 2, PAD, PAD]])
logits = model(batch)
changed = batch.clone()
changed[0, 5] = 30
later = (model(changed)[0, :5] - logits[0, :5]).abs().max().item()
print(f"fixed={FIXED} change of tokens 0-4's logits when token 5 changes: {later:.3e}")
