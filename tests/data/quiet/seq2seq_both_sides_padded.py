"""A seq2seq model as the PyTorch tutorial "Language Translation with nn.Transformer" writes it (create_mask):
source and target each padded with PAD_IDX, `src_padding_mask = (src == PAD_IDX)`, `tgt_padding_mask`, the target
causal, and the source padding handed again as `memory_key_padding_mask`. Source and target have the same length
(6), so a cross-attention cannot be told apart by its length.

Right: the encoder's real tokens see each real source token; the decoder's real tokens see earlier real target
tokens and every real source token; no real query sees a pad."""
import torch
from torch import nn

PAD_IDX = 1


class Seq2SeqTransformer(nn.Module):
    def __init__(self, d=16, vocab=20):
        super().__init__()
        self.transformer = nn.Transformer(d_model=d, nhead=2, num_encoder_layers=2, num_decoder_layers=2,
                                          dim_feedforward=32, dropout=0.0, batch_first=True)
        self.src_tok_emb = nn.Embedding(vocab, d)
        self.tgt_tok_emb = nn.Embedding(vocab, d)

    def forward(self, src, trg, src_mask, tgt_mask, src_padding_mask, tgt_padding_mask, memory_key_padding_mask):
        return self.transformer(self.src_tok_emb(src), self.tgt_tok_emb(trg), src_mask, tgt_mask, None,
                                src_padding_mask, tgt_padding_mask, memory_key_padding_mask)


def create_mask(src, tgt):
    src_len, tgt_len = src.shape[1], tgt.shape[1]
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(tgt_len)
    src_mask = torch.zeros((src_len, src_len)).type(torch.bool)
    return src_mask, tgt_mask, src == PAD_IDX, tgt == PAD_IDX


def main():
    torch.manual_seed(0)
    src = torch.tensor([[2, 5, 6, 7, 8, 3], [2, 9, 3, 1, 1, 1]])
    tgt = torch.tensor([[2, 4, 3, 1, 1, 1], [2, 6, 7, 8, 9, 3]])
    src_mask, tgt_mask, src_padding_mask, tgt_padding_mask = create_mask(src, tgt)
    model = Seq2SeqTransformer().eval()
    with torch.no_grad():
        out = model(src, tgt, src_mask, tgt_mask, src_padding_mask, tgt_padding_mask, src_padding_mask)
    print(tuple(out.shape))


if __name__ == "__main__":
    main()
