# The slip of pytorch/translate#230 written another way: the program's own decoder wraps torch's nn.TransformerDecoder
# and holds generate_square_subsequent_mask as a static method, but its training forward hands the layers only the
# targets' key padding mask (tgt_mask=None, as pytorch_translate's decoder never passed self_attn_mask once fairseq's
# layer stopped masking the future itself), so teacher forcing attends to later targets. Right-padded targets, the
# first row the padded one; a right-padded memory. The fix passes tgt_mask=generate_square_subsequent_mask(T).
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
PAD = 0


class Seq2SeqDecoder(nn.Module):
    def __init__(self, vocab=30, d_model=32, nhead=4, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model, padding_idx=PAD)
        layer = nn.TransformerDecoderLayer(d_model, nhead, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.layers = nn.TransformerDecoder(layer, layers)
        self.out = nn.Linear(d_model, vocab)

    @staticmethod
    def generate_square_subsequent_mask(size):
        return torch.ones(size, size, dtype=torch.bool).triu(diagonal=1)  # True = a later target, masked

    def forward(self, prev_output_tokens, encoder_out, encoder_padding_mask):
        x = self.embed(prev_output_tokens)
        tgt_mask = self.generate_square_subsequent_mask(x.size(1)) if FIXED else None
        x = self.layers(x, encoder_out, tgt_mask=tgt_mask, tgt_key_padding_mask=prev_output_tokens.eq(PAD),
                        memory_key_padding_mask=encoder_padding_mask)
        return self.out(x)


decoder = Seq2SeqDecoder().train()  # (dropout 0: the training path)
memory = torch.randn(2, 7, 32)
memory_pad = torch.tensor([[False] * 5 + [True] * 2, [False] * 7])
prev = torch.tensor([[2, 5, 6, 7, PAD, PAD], [2, 8, 9, 10, 11, 12]])
logits = decoder(prev, memory, memory_pad)
changed = prev.clone()
changed[1, -1] = 13
leak = (decoder(changed, memory, memory_pad) - logits)[1, :-1].abs().max().item()
print(f"a change to the last target moves earlier outputs by {leak:.6f}")
