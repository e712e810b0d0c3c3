# lucidrains/alphafold2 commit 21b02a7 ("apply padding mask correctly").
#
# alphafold2_pytorch/transformer.py Seq2SeqTransformer, the torsion-angle baseline trained by train_simple.py on
# sidechainnet batches: residues as int tokens (20 = padding, IGNORE_INDEX), angles (phi, psi, omega) per residue.
# train_simple.py builds src/tgt key padding masks with create_mask() and hands them to the model, but
# Seq2SeqTransformer.forward took `use_padding_mask: bool = False` and, with the default, ran the encoder and decoder
# without them, so the padding residues were attended.
# Fix: the default became `use_padding_mask: bool = True`, so the encoder gets src_key_padding_mask and the decoder
# tgt_key_padding_mask.
#
# Ported as the project wrote it (nn.TransformerEncoder/Decoder, default sequence-first layout, the batch (b, l)
# handed in as train_simple.py does, create_mask's transpose, MSE loss over mask-selected angles), shrunk.
import math
import sys

import torch
from torch import nn
from torch import Tensor
from torch.nn import (TransformerEncoder, TransformerDecoder,
                      TransformerEncoderLayer, TransformerDecoderLayer)

FIXED = "--fixed" in sys.argv


class Seq2SeqTransformer(nn.Module):
    def __init__(self, num_encoder_layers: int, num_decoder_layers: int,
                 emb_size: int, src_vocab_size: int, tgt_vocab_size: int,
                 dim_feedforward: int = 512, num_head: int = 8, dropout: float = 0.0, activation: str = "relu",
                 max_len: int = 5000):
        super(Seq2SeqTransformer, self).__init__()
        encoder_layer = TransformerEncoderLayer(d_model=emb_size, nhead=num_head,
                                                dim_feedforward=dim_feedforward, dropout=dropout, activation=activation)
        self.transformer_encoder = TransformerEncoder(encoder_layer, num_layers=num_encoder_layers)
        decoder_layer = TransformerDecoderLayer(d_model=emb_size, nhead=num_head,
                                                dim_feedforward=dim_feedforward, dropout=dropout, activation=activation)
        self.transformer_decoder = TransformerDecoder(decoder_layer, num_layers=num_decoder_layers)

        self.generator = nn.Linear(emb_size, tgt_vocab_size)
        self.src_tok_emb = TokenEmbedding(src_vocab_size, emb_size)
        self.tgt_tok_emb = TokenEmbedding(src_vocab_size, emb_size)
        self.positional_encoding = PositionalEncoding(emb_size, dropout=dropout, maxlen=max_len)

    # todo make mask work
    def forward(self, src: Tensor, trg: Tensor, src_mask: Tensor,
                tgt_mask: Tensor, src_padding_mask: Tensor,
                tgt_padding_mask: Tensor, memory_key_padding_mask: Tensor,
                use_padding_mask: bool = FIXED):
        src_emb = self.positional_encoding(self.src_tok_emb(src))
        tgt_emb = self.positional_encoding(self.tgt_tok_emb(trg))
        if use_padding_mask:
            memory = self.transformer_encoder(src_emb, src_key_padding_mask=src_padding_mask)
            outs = self.transformer_decoder(tgt_emb, memory, tgt_key_padding_mask=tgt_padding_mask)
        else:
            memory = self.transformer_encoder(src_emb)
            outs = self.transformer_decoder(tgt_emb, memory)
        return self.generator(outs)


class PositionalEncoding(nn.Module):
    def __init__(self, emb_size: int, dropout, maxlen: int = 5000):
        super(PositionalEncoding, self).__init__()
        den = torch.exp(- torch.arange(0, emb_size, 2) * math.log(10000) / emb_size)
        pos = torch.arange(0, maxlen).reshape(maxlen, 1)
        pos_embedding = torch.zeros((maxlen, emb_size))
        pos_embedding[:, 0::2] = torch.sin(pos * den)
        pos_embedding[:, 1::2] = torch.cos(pos * den)
        pos_embedding = pos_embedding.unsqueeze(-2)

        self.dropout = nn.Dropout(dropout)
        self.register_buffer('pos_embedding', pos_embedding)

    def forward(self, token_embedding: Tensor):
        return self.dropout(token_embedding +
                            self.pos_embedding[:token_embedding.size(0), :])


class TokenEmbedding(nn.Module):
    def __init__(self, vocab_size: int, emb_size):
        super(TokenEmbedding, self).__init__()
        self.embedding = nn.Embedding(vocab_size, emb_size)
        self.emb_size = emb_size

    def forward(self, tokens: Tensor):
        return self.embedding(tokens.long()) * math.sqrt(self.emb_size)


# train_simple.py constants, shrunk
IGNORE_INDEX = 20
SRC_VOCAB_SIZE = 21  # number of amino acids + padding 20
TGT_VOCAB_SIZE = 3  # backbone torsion angle
NUM_ENCODER_LAYERS = 2
NUM_DECODER_LAYERS = 2
EMB_SIZE = 32
NUM_HEAD = 4
FFN_HID_DIM = 64
DROPOUT = 0.0
LOSS_WITHOUT_PADDING = False


def create_mask(src, tgt):
    src_padding_mask = (src == IGNORE_INDEX).transpose(0, 1)
    tgt_padding_mask = (tgt == IGNORE_INDEX).transpose(0, 1)
    return src_padding_mask, tgt_padding_mask


def sidechainnet_like_batch(lengths, max_len, gen):
    # int_seqs padded with 20, msks 1 on real residues, angs zero on padding
    b = len(lengths)
    int_seqs = torch.full((b, max_len), IGNORE_INDEX, dtype=torch.long)
    msks = torch.zeros(b, max_len)
    angs = torch.zeros(b, max_len, TGT_VOCAB_SIZE)
    for i, n in enumerate(lengths):
        int_seqs[i, :n] = torch.randint(0, 20, (n,), generator=gen)
        msks[i, :n] = 1
        angs[i, :n] = (torch.rand(n, TGT_VOCAB_SIZE, generator=gen) * 2 - 1) * math.pi
    return int_seqs, angs, msks


def main():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    transformer = Seq2SeqTransformer(num_encoder_layers=NUM_ENCODER_LAYERS, num_decoder_layers=NUM_DECODER_LAYERS,
                                     emb_size=EMB_SIZE, src_vocab_size=SRC_VOCAB_SIZE, tgt_vocab_size=TGT_VOCAB_SIZE,
                                     dim_feedforward=FFN_HID_DIM, num_head=NUM_HEAD, activation='gelu', max_len=5000,
                                     dropout=DROPOUT)
    for p in transformer.parameters():
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)
    transformer.eval()
    loss_fn = torch.nn.MSELoss()

    seq, angs, mask = sidechainnet_like_batch([12, 9, 5], 12, gen)
    b, l = seq.shape
    mask = mask.bool()

    src_padding_mask, tgt_padding_mask = create_mask(seq, seq)

    with torch.no_grad():
        logits = transformer(seq, seq, src_mask=mask,
                             tgt_mask=mask, src_padding_mask=src_padding_mask,
                             tgt_padding_mask=tgt_padding_mask, memory_key_padding_mask=src_padding_mask)

    mask1 = mask.unsqueeze(2).expand(-1, -1, 3)
    angs1 = torch.acos(torch.zeros(1)).item() * 4 * \
        (angs < -torch.acos(torch.zeros(1)).item() * 1.5) + \
        angs
    if LOSS_WITHOUT_PADDING:
        loss_ = loss_fn(logits[:, :l, :].reshape(-1, logits.shape[-1]), angs.reshape(-1, angs.shape[-1]))
    else:
        loss_ = loss_fn(torch.masked_select(logits, mask1), torch.masked_select(angs1, mask1))

    print("fixed" if FIXED else "buggy", "logits", tuple(logits.shape))
    print("loss", round(loss_.item(), 6))
    print("protein 0 predicted angles (residue 6)", [round(v, 5) for v in logits[0, 6].tolist()])


if __name__ == "__main__":
    main()
