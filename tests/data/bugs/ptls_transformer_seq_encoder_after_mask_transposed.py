# Citation: pytorch-lifestream/pytorch-lifestream (then dllllb/pytorch-lifestream, package `dltranz`)
#   bug introduced in commit c4058261 ("use_src_key_padding_mask for transformer"),
#   fixed in commit d7d6aa8b ("remove debug code").
# Upstream: dltranz/transf_seq_encoder.py, TransformerSeqEncoder.generate_square_subsequent_mask / forward
#   (transformer encoder over sequences of tabular transaction records, embedded by dltranz/trx_encoder.py).
# Bug: with `use_after_mask` the square subsequent mask was built and then transposed
#   (`generate_square_subsequent_mask(...).t()`), so each transaction attended to itself and all LATER
#   transactions (and the trailing padding) instead of itself and earlier ones.
# Fix: drop the `.t()`; the additive mask is the usual lower-triangular (causal) one.
import math
import sys

import torch
from torch import nn
from torch.nn import TransformerEncoder, TransformerEncoderLayer, LayerNorm

FIXED = "--fixed" in sys.argv


class PaddedBatch:
    def __init__(self, payload, length):
        self._payload = payload
        self._length = length

    @property
    def payload(self):
        return self._payload

    @property
    def seq_lens(self):
        return self._length


class TrxEncoder(nn.Module):
    """Shrunk dltranz.trx_encoder.TrxEncoder: embeddings of categorical fields + numeric fields, concatenated."""

    def __init__(self, params):
        super().__init__()
        self.embeddings = nn.ModuleDict({
            name: nn.Embedding(opt['in'], opt['out'], padding_idx=0)
            for name, opt in params['embeddings'].items()
        })
        self.numeric_values = params['numeric_values']

    def forward(self, x: PaddedBatch):
        processed = []
        for name, emb in self.embeddings.items():
            processed.append(emb(x.payload[name].long()))
        for name in self.numeric_values:
            v = x.payload[name].float().unsqueeze(-1)
            processed.append(torch.sign(v) * torch.log1p(v.abs()))
        return PaddedBatch(torch.cat(processed, -1), x.seq_lens)

    @staticmethod
    def output_size(params):
        return sum(opt['out'] for opt in params['embeddings'].values()) + len(params['numeric_values'])


class PerTransTransf(nn.Module):
    def __init__(self, input_size, out_size):
        super().__init__()
        self.net = nn.Linear(input_size, out_size)

    def forward(self, x: PaddedBatch):
        return PaddedBatch(self.net(x.payload), x.seq_lens)


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, dropout=0.1, max_len=5000):
        super(PositionalEncoding, self).__init__()
        self.dropout = nn.Dropout(p=dropout)

        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        pe = pe.unsqueeze(0).transpose(0, 1)
        self.register_buffer('pe', pe)

    def forward(self, x):
        x = x + self.pe[:x.size(0), :x.size(1)]
        return self.dropout(x)


class TransformerSeqEncoder(nn.Module):
    def __init__(self, input_size, params):
        super().__init__()

        self.shared_layers = params['shared_layers']
        self.n_layers = params['n_layers']
        self.use_after_mask = params['use_after_mask']
        self.use_src_key_padding_mask = params['use_src_key_padding_mask']
        self.use_positional_encoding = params['use_positional_encoding']

        self.starter = torch.nn.Parameter(torch.randn(1, 1, input_size)) if params['train_starter'] else None

        self.enc_layer = TransformerEncoderLayer(
            d_model=input_size,
            nhead=params['n_heads'],
            dim_feedforward=params['dim_hidden'],
            dropout=params['dropout'])

        enc_norm = LayerNorm(input_size)
        self.enc = TransformerEncoder(self.enc_layer, params['n_layers'], enc_norm)
        self.pe = PositionalEncoding(max_len=params['max_seq_len'], d_model=input_size, dropout=params['dropout'])

    @staticmethod
    def generate_square_subsequent_mask(sz):
        r"""Generate a square mask for the sequence. The masked positions are filled with float('-inf').
            Unmasked positions are filled with float(0.0).
        """
        mask = (torch.triu(torch.ones(sz, sz)) == 1).transpose(0, 1)
        mask = mask.float().masked_fill(mask == 0, float('-inf')).masked_fill(mask == 1, float(0.0))
        return mask

    def forward(self, x):
        batch_size = x.payload.size()[0]
        seq_len_max = x.payload.size()[1]
        x_t = torch.transpose(x.payload, 0, 1)

        if self.starter is not None:
            x_t = torch.cat([self.starter.expand(1, batch_size, -1), x_t], dim=0)

        if self.use_after_mask:
            if FIXED:
                mask = self.generate_square_subsequent_mask(x_t.size(0)).to(x_t.device)
            else:
                mask = self.generate_square_subsequent_mask(x_t.size(0)).to(x_t.device).t()
        else:
            mask = None

        if self.use_src_key_padding_mask:
            src_key_padding_mask = torch.stack([torch.BoolTensor([False] * l + [True] * (seq_len_max - l))
                                                for l in x.seq_lens]).to(x.payload.device)
        else:
            src_key_padding_mask = None

        if self.use_positional_encoding:
            x_t = self.pe(x_t)

        if not self.shared_layers:
            out = self.enc(x_t, mask=mask, src_key_padding_mask=src_key_padding_mask)
        else:
            out = x_t
            for _ in range(self.n_layers):
                out = self.enc_layer(out, mask=mask, src_key_padding_mask=src_key_padding_mask)

        out = torch.transpose(out, 0, 1)

        return PaddedBatch(out, x.seq_lens)


class LastStepEncoder(nn.Module):
    def forward(self, x: PaddedBatch):
        h = x.payload[range(len(x.payload)), [l - 1 for l in x.seq_lens]]
        return h


def padded_collate(records):
    """Right-pad a list of variable-length transaction sequences (dltranz.data_load.padded_collate)."""
    lengths = torch.tensor([len(r['mcc_code']) for r in records])
    T = int(lengths.max())
    payload = {}
    for k in records[0]:
        payload[k] = torch.stack([
            torch.cat([r[k], torch.zeros(T - len(r[k]), dtype=r[k].dtype)]) for r in records])
    return PaddedBatch(payload, lengths)


def main():
    torch.manual_seed(0)
    params = {
        'trx_encoder': {
            'embeddings': {'mcc_code': {'in': 20, 'out': 8}, 'tr_type': {'in': 6, 'out': 4}},
            'numeric_values': ['amount'],
        },
        'transf': {
            'input_size': 16,
            'shared_layers': False,
            'n_layers': 2,
            'n_heads': 2,
            'dim_hidden': 32,
            'dropout': 0.1,
            'max_seq_len': 64,
            'use_after_mask': True,
            'use_src_key_padding_mask': False,
            'use_positional_encoding': True,
            'train_starter': False,
        },
    }
    p = TrxEncoder(params['trx_encoder'])
    trx_size = TrxEncoder.output_size(params['trx_encoder'])
    inp_reshape = PerTransTransf(trx_size, params['transf']['input_size'])
    e = TransformerSeqEncoder(params['transf']['input_size'], params['transf'])
    l = LastStepEncoder()
    head = nn.Linear(params['transf']['input_size'], 1)
    model = nn.Sequential(p, inp_reshape, e, l)

    # clients with different numbers of transactions -> right padded batch
    lens = [9, 5, 7, 3]
    records = []
    for n in lens:
        records.append({
            'mcc_code': torch.randint(1, 20, (n,)),
            'tr_type': torch.randint(1, 6, (n,)),
            'amount': torch.randn(n) * 500.0,
        })
    batch = padded_collate(records)
    target = torch.tensor([[0.3], [-1.2], [0.8], [0.1]])

    opt = torch.optim.Adam(list(model.parameters()) + list(head.parameters()), lr=1e-2)
    model.train()
    for step in range(20):
        opt.zero_grad()
        pred = head(model(batch))
        loss = nn.functional.mse_loss(pred, target)
        loss.backward()
        opt.step()
        if step % 5 == 0:
            print(f"step {step:2d} loss {loss.item():.5f}")

    model.eval()
    with torch.no_grad():
        emb = model(batch)
        pred = head(emb)
    print("client embeddings (first 4 dims):")
    print(emb[:, :4])
    print("predictions:", pred.squeeze(-1))


if __name__ == "__main__":
    main()
