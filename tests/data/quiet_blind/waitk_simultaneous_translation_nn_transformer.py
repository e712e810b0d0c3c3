"""Wait-k simultaneous translation trained with nn.Transformer: target step i reads only the first i + k source tokens.

Follows facebookresearch/fairseq examples/simultaneous_translation (wait-k policy, Ma et al. 2019; the
training-time "waitk" mask over encoder states) written with torch.nn.Transformer, as in the PyTorch
translation tutorial (generate_square_subsequent_mask, src/tgt/memory key padding masks).
Masks meant: encoder is uni-directional too (a streaming encoder: causal src_mask), decoder self-attention
causal, cross-attention memory_mask[i, j] = -inf for j >= i + waitk, plus padding of the source batch.
"""
import argparse

import torch
from torch import nn


def waitk_memory_mask(tgt_len, src_len, waitk):
    """Float [tgt_len, src_len]: 0 where target step i may read source j (j < i + waitk), -inf elsewhere."""
    i = torch.arange(tgt_len)[:, None]
    j = torch.arange(src_len)[None, :]
    return torch.zeros(tgt_len, src_len).masked_fill(j >= i + waitk, float("-inf"))


class WaitkTransformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.src_tok_emb = nn.Embedding(args.src_vocab, args.emb_size)
        self.tgt_tok_emb = nn.Embedding(args.tgt_vocab, args.emb_size)
        self.transformer = nn.Transformer(d_model=args.emb_size, nhead=args.nhead, num_encoder_layers=1,
                                          num_decoder_layers=1, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.generator = nn.Linear(args.emb_size, args.tgt_vocab)

    def forward(self, src, tgt, src_padding_mask, tgt_padding_mask):
        src_len, tgt_len = src.shape[1], tgt.shape[1]
        src_mask = nn.Transformer.generate_square_subsequent_mask(src_len)
        tgt_mask = nn.Transformer.generate_square_subsequent_mask(tgt_len)
        memory_mask = waitk_memory_mask(tgt_len, src_len, self.args.waitk)
        outs = self.transformer(self.src_tok_emb(src), self.tgt_tok_emb(tgt), src_mask=src_mask, tgt_mask=tgt_mask,
                                memory_mask=memory_mask, src_key_padding_mask=src_padding_mask,
                                tgt_key_padding_mask=tgt_padding_mask, memory_key_padding_mask=src_padding_mask)
        return self.generator(outs)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--waitk", type=int, default=3)
    parser.add_argument("--emb-size", dest="emb_size", type=int, default=32)
    parser.add_argument("--nhead", type=int, default=4)
    parser.add_argument("--src-vocab", dest="src_vocab", type=int, default=40)
    parser.add_argument("--tgt-vocab", dest="tgt_vocab", type=int, default=40)
    args = parser.parse_args()
    torch.manual_seed(0)
    PAD_IDX = 1
    src = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 14, 15, 16, 17, 18, PAD_IDX, PAD_IDX, PAD_IDX]])
    tgt = torch.tensor([[2, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29], [2, 30, 31, 32, 33, 34, 35, PAD_IDX, PAD_IDX,
                                                                     PAD_IDX, PAD_IDX]])
    model = WaitkTransformer(args).eval()

    def padding_mask(tokens):
        # float like the attention masks above (nn.Transformer deprecates mixing bool and float masks)
        return torch.zeros(tokens.shape).masked_fill(tokens == PAD_IDX, float("-inf"))

    with torch.no_grad():
        logits = model(src, tgt, padding_mask(src), padding_mask(tgt))
    print("logits", tuple(logits.shape))


if __name__ == "__main__":
    main()
