# The memory's padding mask built from the target, written another way than pengshuang/Transformer#7: a bentrevett-style
# Seq2Seq around nn.Transformer (batch_first, pad id 1 on each side, stated as src_pad_idx / trg_pad_idx) handed
# memory_key_padding_mask=trg_pad_mask, so the decoder's cross-attention hides memory keys where the *target* is
# padded (source and target padded to one length; every padded source key is a padded target one too, so no
# padded key is ever seen: only real ones are hidden). Fixed: memory_key_padding_mask=src_pad_mask.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class Seq2Seq(nn.Module):
    def __init__(self, vocab=24, d_model=16, src_pad_idx=1, trg_pad_idx=1):
        super().__init__()
        self.src_pad_idx, self.trg_pad_idx = src_pad_idx, trg_pad_idx
        self.src_tok = nn.Embedding(vocab, d_model)
        self.trg_tok = nn.Embedding(vocab, d_model)
        self.transformer = nn.Transformer(d_model=d_model, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                                          dim_feedforward=32, dropout=0.0, batch_first=True)
        self.out = nn.Linear(d_model, vocab)

    def forward(self, src, trg):
        src_pad_mask = src == self.src_pad_idx  # True = padding, as nn.Transformer takes it
        trg_pad_mask = trg == self.trg_pad_idx
        causal = nn.Transformer.generate_square_subsequent_mask(trg.size(1), dtype=torch.bool)
        memory_pad_mask = src_pad_mask if FIXED else trg_pad_mask
        out = self.transformer(self.src_tok(src), self.trg_tok(trg), tgt_mask=causal, src_key_padding_mask=src_pad_mask,
                               tgt_key_padding_mask=trg_pad_mask, memory_key_padding_mask=memory_pad_mask)
        return self.out(out)


def main():
    torch.manual_seed(0)
    model = Seq2Seq().eval()
    src = torch.tensor([[5, 6, 7, 8, 9, 10, 1], [11, 12, 13, 14, 15, 1, 1], [4, 5, 6, 7, 8, 9, 10]])
    trg = torch.tensor([[2, 15, 16, 1, 1, 1, 1], [2, 17, 18, 19, 20, 1, 1], [2, 21, 22, 23, 3, 1, 1]])
    with torch.no_grad():
        logits = model(src, trg)
        alone = model(src[:1, :6], trg[:1, :6])  # row 0 with its source's real tokens only
    print(f"{'fixed' if FIXED else 'buggy'}: row 0 step 0, padded batch vs. alone: "
          f"{(logits[0, 0] - alone[0, 0]).abs().max().item():.3e}")


if __name__ == "__main__":
    main()
