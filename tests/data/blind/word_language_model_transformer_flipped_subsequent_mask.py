# pytorch/examples#649 ("Transformer Language Model Example Wrong Mask"), word_language_model/model.py.
# TransformerModel._generate_square_subsequent_mask built its mask as
#     mask = (torch.triu(torch.ones(sz, sz)) == 1).transpose(0, 1)
#     mask = mask.float().masked_fill(mask == 0, float('-inf')).masked_fill(mask == 1, float(0.0))
# and under torch 1.3.0 (pytorch/pytorch#28272, #28508: masked_fill read the transposed bool view in its
# storage order) this gave the upper triangle of zeros: every position attends to the tokens after it and not
# the ones before it, so the language model reads the word it must predict. Fixed upstream by torch 1.3.1
# (pytorch/pytorch#28253) and in the example by building the mask as torch.log(torch.tril(torch.ones(sz, sz))).
# Before the fix the mask below is the one torch 1.3.0 handed the encoder (the triu layout); --fixed builds it as
# the example now does.
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


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
        super(TransformerModel, self).__init__(d_model=ninp, nhead=nhead, dim_feedforward=nhid,
                                               num_encoder_layers=nlayers)
        self.model_type = 'Transformer'
        self.src_mask = None
        self.pos_encoder = PositionalEncoding(ninp, dropout)
        self.input_emb = nn.Embedding(ntoken, ninp)
        self.ninp = ninp
        self.decoder = nn.Linear(ninp, ntoken)
        self.init_weights()

    def _generate_square_subsequent_mask(self, sz):
        if FIXED:
            return torch.log(torch.tril(torch.ones(sz, sz)))
        # what torch 1.3.0 produced from the (triu == 1).transpose(0, 1) / masked_fill recipe
        mask = (torch.triu(torch.ones(sz, sz)) == 1)
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


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    return data.view(bsz, -1).t().contiguous()


def get_batch(source, i, bptt):
    seq_len = min(bptt, len(source) - 1 - i)
    data = source[i:i + seq_len]
    target = source[i + 1:i + 1 + seq_len].view(-1)
    return data, target


def main():
    torch.manual_seed(0)
    ntokens, bptt = 50, 8
    corpus = torch.randint(0, ntokens, (200,))
    train_data = batchify(corpus, 4)  # (seq_len, batch), seq-first as the example lays it
    model = TransformerModel(ntokens, 32, 2, 64, 2, dropout=0.0)
    criterion = nn.NLLLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)

    model.train()
    for step, i in enumerate(range(0, 4 * bptt, bptt)):
        data, targets = get_batch(train_data, i, bptt)
        model.zero_grad()
        output = model(data)
        output = output.view(-1, ntokens)
        loss = criterion(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        optimizer.step()
        print(f"step {step} loss {loss.item():.4f}")

    model.eval()
    with torch.no_grad():
        data, targets = get_batch(train_data, 4 * bptt, bptt)
        output = model(data).view(-1, ntokens)
        print(f"eval loss {criterion(output, targets).item():.4f}")


if __name__ == "__main__":
    main()
