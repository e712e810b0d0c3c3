"""PyTorch "Language Translation with nn.Transformer and torchtext" tutorial: Seq2SeqTransformer with
create_mask() returning an all-False src_mask, a square subsequent tgt_mask, and per-row padding masks
for source, target and memory.

Follows pytorch/tutorials beginner_source/translation_transformer.py (generate_square_subsequent_mask
built with torch.triu(...) == 1 .transpose(0, 1) then masked_fill float('-inf'); create_mask;
Seq2SeqTransformer.forward passing memory_key_padding_mask=src_padding_mask; train_epoch using
CrossEntropyLoss(ignore_index=PAD_IDX)).  Batches are sequence-first (batch_first=False).

Mask meant: encoder = bidirectional over each row's real source tokens; decoder self-attention =
causal AND not target padding; cross-attention = every target position sees that row's real source
tokens only.  Target rows at padding positions are queries whose outputs the loss ignores (ignore_index=PAD_IDX).
"""
import math

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn import Transformer

PAD_IDX, BOS_IDX, EOS_IDX = 1, 2, 3
DEVICE = torch.device("cpu")


class PositionalEncoding(nn.Module):
    def __init__(self, emb_size: int, dropout: float, maxlen: int = 64):
        super().__init__()
        den = torch.exp(-torch.arange(0, emb_size, 2) * math.log(10000) / emb_size)
        pos = torch.arange(0, maxlen).reshape(maxlen, 1)
        pos_embedding = torch.zeros((maxlen, emb_size))
        pos_embedding[:, 0::2] = torch.sin(pos * den)
        pos_embedding[:, 1::2] = torch.cos(pos * den)
        pos_embedding = pos_embedding.unsqueeze(-2)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("pos_embedding", pos_embedding)

    def forward(self, token_embedding: Tensor):
        return self.dropout(token_embedding + self.pos_embedding[: token_embedding.size(0), :])


class TokenEmbedding(nn.Module):
    def __init__(self, vocab_size: int, emb_size):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, emb_size)
        self.emb_size = emb_size

    def forward(self, tokens: Tensor):
        return self.embedding(tokens.long()) * math.sqrt(self.emb_size)


class Seq2SeqTransformer(nn.Module):
    def __init__(self, num_encoder_layers, num_decoder_layers, emb_size, nhead, src_vocab_size,
                 tgt_vocab_size, dim_feedforward=64, dropout=0.1):
        super().__init__()
        self.transformer = Transformer(d_model=emb_size, nhead=nhead, num_encoder_layers=num_encoder_layers,
                                       num_decoder_layers=num_decoder_layers, dim_feedforward=dim_feedforward,
                                       dropout=dropout)
        self.generator = nn.Linear(emb_size, tgt_vocab_size)
        self.src_tok_emb = TokenEmbedding(src_vocab_size, emb_size)
        self.tgt_tok_emb = TokenEmbedding(tgt_vocab_size, emb_size)
        self.positional_encoding = PositionalEncoding(emb_size, dropout=dropout)

    def forward(self, src, trg, src_mask, tgt_mask, src_padding_mask, tgt_padding_mask, memory_key_padding_mask):
        src_emb = self.positional_encoding(self.src_tok_emb(src))
        tgt_emb = self.positional_encoding(self.tgt_tok_emb(trg))
        outs = self.transformer(src_emb, tgt_emb, src_mask, tgt_mask, None,
                                src_padding_mask, tgt_padding_mask, memory_key_padding_mask)
        return self.generator(outs)


def generate_square_subsequent_mask(sz):
    mask = (torch.triu(torch.ones((sz, sz), device=DEVICE)) == 1).transpose(0, 1)
    mask = mask.float().masked_fill(mask == 0, float("-inf")).masked_fill(mask == 1, float(0.0))
    return mask


def create_mask(src, tgt):
    src_seq_len = src.shape[0]
    tgt_seq_len = tgt.shape[0]
    tgt_mask = generate_square_subsequent_mask(tgt_seq_len)
    src_mask = torch.zeros((src_seq_len, src_seq_len), device=DEVICE).type(torch.bool)
    src_padding_mask = (src == PAD_IDX).transpose(0, 1)
    tgt_padding_mask = (tgt == PAD_IDX).transpose(0, 1)
    return src_mask, tgt_mask, src_padding_mask, tgt_padding_mask


def collate_fn(batch):
    src_batch = nn.utils.rnn.pad_sequence([torch.tensor([BOS_IDX] + s + [EOS_IDX]) for s, _ in batch], padding_value=PAD_IDX)
    tgt_batch = nn.utils.rnn.pad_sequence([torch.tensor([BOS_IDX] + t + [EOS_IDX]) for _, t in batch], padding_value=PAD_IDX)
    return src_batch, tgt_batch


if __name__ == "__main__":
    torch.manual_seed(0)
    model = Seq2SeqTransformer(2, 2, 32, 4, 40, 40)
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)
    loss_fn = nn.CrossEntropyLoss(ignore_index=PAD_IDX)
    pairs = [([5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25, 26]),  # longest source, no padding
             ([13], [30, 31]),  # one-token source: the rest of the column is padding
             ([14, 15, 16], [32, 33, 34, 35, 36, 37, 38, 39])]
    src, tgt = collate_fn(pairs)
    # the tutorial's evaluate(): same masks as train_epoch, no optimizer step
    model.eval()
    with torch.no_grad():
        tgt_input = tgt[:-1, :]
        src_mask, tgt_mask, src_padding_mask, tgt_padding_mask = create_mask(src, tgt_input)
        logits = model(src, tgt_input, src_mask, tgt_mask, src_padding_mask, tgt_padding_mask, src_padding_mask)
        tgt_out = tgt[1:, :]
        loss = loss_fn(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1))
        # pair 1 translated alone (no padding anywhere) gives the same logits on its real target positions
        s1, t1 = collate_fn(pairs[1:2])
        m = create_mask(s1, t1[:-1])
        alone = model(s1, t1[:-1], m[0], m[1], m[2], m[3], m[2])
    assert torch.allclose(logits[: t1.shape[0] - 1, 1], alone[:, 0], atol=1e-4)
    print(f"eval loss {loss.item():.4f}")
