"""Language-model tutorial whose nn.TransformerEncoder runs without a causal mask.

Citation: pytorch/tutorials#2478 ("TransformerEncoder is not causal"), fixed by PR #2662
("Patch 2478"). Upstream: beginner_source/transformer_tutorial.py ("Language Modeling with
nn.Transformer and torchtext").

Bug: `TransformerModel.forward(src, src_mask=None)` passed `src_mask` straight to
`nn.TransformerEncoder`, and `train()` / `evaluate()` call `model(data)` without a mask, so the
next-word model attended to the words it is asked to predict (the targets are the inputs
shifted by one), giving a low perplexity and useless predictions.

Fix: in forward, `if src_mask is None: src_mask =
nn.Transformer.generate_square_subsequent_mask(len(src)).to(device)` ("Generate a square causal
mask for the sequence").

Reproduction: the tutorial's TransformerModel / PositionalEncoding / batchify / get_batch,
sequence-first layout ``[seq_len, batch_size]``, with a synthetic token stream in place of
WikiText2 (no download) and smaller sizes; one `evaluate()` pass computes the loss.
"""
import math
import sys
from typing import Tuple

import torch
from torch import nn, Tensor
from torch.nn import TransformerEncoder, TransformerEncoderLayer

FIXED = "--fixed" in sys.argv

device = torch.device('cpu')


class TransformerModel(nn.Module):

    def __init__(self, ntoken: int, d_model: int, nhead: int, d_hid: int,
                 nlayers: int, dropout: float = 0.5):
        super().__init__()
        self.model_type = 'Transformer'
        self.pos_encoder = PositionalEncoding(d_model, dropout)
        encoder_layers = TransformerEncoderLayer(d_model, nhead, d_hid, dropout)
        self.transformer_encoder = TransformerEncoder(encoder_layers, nlayers)
        self.embedding = nn.Embedding(ntoken, d_model)
        self.d_model = d_model
        self.linear = nn.Linear(d_model, ntoken)
        self.init_weights()

    def init_weights(self) -> None:
        initrange = 0.1
        self.embedding.weight.data.uniform_(-initrange, initrange)
        self.linear.bias.data.zero_()
        self.linear.weight.data.uniform_(-initrange, initrange)

    def forward(self, src: Tensor, src_mask: Tensor = None) -> Tensor:
        """
        Arguments:
            src: Tensor, shape ``[seq_len, batch_size]``
            src_mask: Tensor, shape ``[seq_len, seq_len]``

        Returns:
            output Tensor of shape ``[seq_len, batch_size, ntoken]``
        """
        src = self.embedding(src) * math.sqrt(self.d_model)
        src = self.pos_encoder(src)
        if FIXED and src_mask is None:
            """Generate a square causal mask for the sequence. The masked positions are filled with float('-inf').
            Unmasked positions are filled with float(0.0).
            """
            src_mask = nn.Transformer.generate_square_subsequent_mask(len(src)).to(device)
        output = self.transformer_encoder(src, src_mask)
        output = self.linear(output)
        return output


class PositionalEncoding(nn.Module):

    def __init__(self, d_model: int, dropout: float = 0.1, max_len: int = 5000):
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        position = torch.arange(max_len).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, 1, d_model)
        pe[:, 0, 0::2] = torch.sin(position * div_term)
        pe[:, 0, 1::2] = torch.cos(position * div_term)
        self.register_buffer('pe', pe)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.pe[:x.size(0)]
        return self.dropout(x)


def batchify(data: Tensor, bsz: int) -> Tensor:
    """Divides the data into ``bsz`` separate sequences, removing extra elements that wouldn't cleanly fit."""
    seq_len = data.size(0) // bsz
    data = data[:seq_len * bsz]
    data = data.view(bsz, seq_len).t().contiguous()
    return data.to(device)


bptt = 35


def get_batch(source: Tensor, i: int) -> Tuple[Tensor, Tensor]:
    seq_len = min(bptt, len(source) - 1 - i)
    data = source[i:i+seq_len]
    target = source[i+1:i+1+seq_len].reshape(-1)
    return data, target


def evaluate(model: nn.Module, eval_data: Tensor, ntokens: int, criterion) -> float:
    model.eval()  # turn on evaluation mode
    total_loss = 0.
    with torch.no_grad():
        for i in range(0, eval_data.size(0) - 1, bptt):
            data, targets = get_batch(eval_data, i)
            seq_len = data.size(0)
            output = model(data)
            output_flat = output.view(-1, ntokens)
            total_loss += seq_len * criterion(output_flat, targets).item()
    return total_loss / (len(eval_data) - 1)


def main():
    torch.manual_seed(0)
    ntokens = 100  # size of vocabulary (WikiText2's vocab replaced by a synthetic stream)
    val_data = batchify(torch.randint(0, ntokens, (10 * 71,)), 10)  # 71 steps -> two bptt chunks
    model = TransformerModel(ntokens, 32, 2, 32, 2, 0.2).to(device)
    criterion = nn.CrossEntropyLoss()
    val_loss = evaluate(model, val_data, ntokens, criterion)
    print(f'valid loss {val_loss:5.4f} | valid ppl {math.exp(val_loss):8.2f}')


if __name__ == "__main__":
    main()
