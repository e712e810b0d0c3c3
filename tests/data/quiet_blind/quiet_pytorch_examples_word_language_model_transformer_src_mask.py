"""The Transformer language model of PyTorch's word_language_model example, trained and evaluated on bptt chunks.

Ported from pytorch/examples @001d493285083b54cacbc1334cb26338bdff2455: word_language_model/model.py
(PositionalEncoding, TransformerModel subclassing nn.Transformer: _generate_square_subsequent_mask, a float mask
0 / -inf from triu(...).transpose, cached in self.src_mask and rebuilt when the chunk length changes; the forward
runs only self.encoder, sequence-first) and word_language_model/main.py (batchify into bsz columns, get_batch with
bptt, the Transformer branches of train() and evaluate() with nn.NLLLoss). The corpus is a random token stream; the
sizes are tiny. Each column is a separate stream, so no padding: the mask only keeps each position to the tokens
before it. Checked against each column's prefix run alone, position by position, and against a per-position loss
sum; a gradient check shows no later token reaches an earlier position's loss.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


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
        x = x + self.pe[:x.size(0), :]
        return self.dropout(x)


class TransformerModel(nn.Transformer):
    """Container module with an encoder, a recurrent or transformer module, and a decoder."""

    def __init__(self, ntoken, ninp, nhead, nhid, nlayers, dropout=0.5):
        super(TransformerModel, self).__init__(d_model=ninp, nhead=nhead, dim_feedforward=nhid, num_encoder_layers=nlayers)
        self.model_type = 'Transformer'
        self.src_mask = None
        self.pos_encoder = PositionalEncoding(ninp, dropout)

        self.input_emb = nn.Embedding(ntoken, ninp)
        self.ninp = ninp
        self.decoder = nn.Linear(ninp, ntoken)

        self.init_weights()

    def _generate_square_subsequent_mask(self, sz):
        mask = (torch.triu(torch.ones(sz, sz)) == 1).transpose(0, 1)
        mask = mask.float().masked_fill(mask == 0, float('-inf')).masked_fill(mask == 1, float(0.0))
        return mask

    def init_weights(self):
        initrange = 0.1
        nn.init.uniform_(self.input_emb.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, src, has_mask=True):
        if has_mask:
            device = src.device
            if self.src_mask is None or self.src_mask.size(0) != len(src):
                mask = self._generate_square_subsequent_mask(len(src)).to(device)
                self.src_mask = mask
        else:
            self.src_mask = None

        src = self.input_emb(src) * math.sqrt(self.ninp)
        src = self.pos_encoder(src)
        output = self.encoder(src, mask=self.src_mask)
        output = self.decoder(output)
        return F.log_softmax(output, dim=-1)


# main.py ---------------------------------------------------------------------------------------------------------
bptt = 8
device = torch.device("cpu")


def batchify(data, bsz):
    # Work out how cleanly we can divide the dataset into bsz parts.
    nbatch = data.size(0) // bsz
    # Trim off any extra elements that wouldn't cleanly fit (remainders).
    data = data.narrow(0, 0, nbatch * bsz)
    # Evenly divide the data across the bsz batches.
    data = data.view(bsz, -1).t().contiguous()
    return data.to(device)


def get_batch(source, i):
    seq_len = min(bptt, len(source) - 1 - i)
    data = source[i:i + seq_len]
    target = source[i + 1:i + 1 + seq_len].view(-1)
    return data, target


def main():
    torch.manual_seed(1111)
    ntokens = 50
    model = TransformerModel(ntokens, 32, 4, 64, 2, 0.2).to(device)
    criterion = nn.NLLLoss()

    g = torch.Generator().manual_seed(3)
    train_data = batchify(torch.randint(ntokens, (4 * 21 + 3,), generator=g), 4)
    val_data = batchify(torch.randint(ntokens, (3 * 19,), generator=g), 3)

    # train(): one epoch of plain SGD as main.py does it (the Transformer branch: no hidden state)
    lr, clip = 0.5, 0.25
    model.train()
    for batch, i in enumerate(range(0, train_data.size(0) - 1, bptt)):
        data, targets = get_batch(train_data, i)
        model.zero_grad()
        output = model(data)
        output = output.view(-1, ntokens)
        loss = criterion(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for p in model.parameters():
            if p.grad is not None:
                p.data.add_(p.grad, alpha=-lr)

    # evaluate(): val chunks of bptt, the last one shorter, so the cached src_mask is rebuilt for it
    model.eval()
    total_loss = 0.
    ref_total = 0.
    with torch.no_grad():
        for i in range(0, val_data.size(0) - 1, bptt):
            data, targets = get_batch(val_data, i)
            output = model(data)
            assert model.src_mask.size(0) == len(data)
            out3 = output
            output = output.view(-1, ntokens)
            total_loss += len(data) * criterion(output, targets).item()

            # reference: every column's prefix 0..t run alone, its last position read
            chunk_nll = 0.
            for col in range(data.size(1)):
                for t in range(len(data)):
                    alone = model(data[:t + 1, col:col + 1])
                    assert torch.allclose(out3[t, col], alone[-1, 0], atol=1e-5), (i, col, t)
                    chunk_nll -= alone[-1, 0, val_data[i + 1 + t, col]].item()
            ref_total += chunk_nll / data.size(1)
    val_loss = total_loss / (len(val_data) - 1)
    ref_loss = ref_total / (len(val_data) - 1)
    assert abs(val_loss - ref_loss) < 1e-4, (val_loss, ref_loss)

    # no later token reaches an earlier position's loss
    data, targets = get_batch(val_data, 0)
    emb = model.input_emb
    captured = {}

    def keep(module, inp, out):
        out.retain_grad()
        captured['emb'] = out

    h = emb.register_forward_hook(keep)
    output = model(data)
    h.remove()
    k = 4
    partial = criterion(output[:k].reshape(-1, ntokens), targets.view(len(data), -1)[:k].reshape(-1))
    partial.backward()
    grad = captured['emb'].grad
    assert grad[k:].abs().max().item() == 0.0
    assert grad[:k].abs().max().item() > 0.0
    print("ok: valid loss %.4f (ppl %.2f) matches the per-prefix runs" % (val_loss, math.exp(val_loss)))


if __name__ == "__main__":
    main()
