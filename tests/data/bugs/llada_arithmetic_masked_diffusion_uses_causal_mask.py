# LounesMD/LLaDA_Arithmetic#3: the LLaDA (masked-diffusion, bidirectional) model reuses the ARM
# TransformerModel, whose forward always builds a causal mask, so masked tokens cannot see later digits.
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class PositionalEmbedding(nn.Module):
    def __init__(self, d_model, dropout=0.1, max_len=5000):
        super(PositionalEmbedding, self).__init__()
        self.dropout = nn.Dropout(p=dropout)
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        pe = pe.unsqueeze(0).transpose(0, 1)
        self.register_buffer("pe", pe)

    def forward(self, x):
        x = x + self.pe[: x.size(0), :]
        return self.dropout(x)


class TransformerModel(nn.Transformer):
    def __init__(self, ntoken, ninp, nhead, nhid, nlayers, device, dropout=0.5, causal=True):
        super(TransformerModel, self).__init__(
            d_model=ninp, nhead=nhead, dim_feedforward=nhid, num_encoder_layers=nlayers
        )
        self.input_emb = nn.Embedding(ntoken, ninp)
        self.pos_encoder = PositionalEmbedding(ninp, dropout)
        self.decoder = nn.Linear(ninp, ntoken)
        self.device = device
        self.causal = causal
        self.ninp = ninp
        self.init_weights()

    def init_weights(self):
        initrange = 0.1
        nn.init.uniform_(self.input_emb.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def _generate_square_subsequent_mask(self, sz):
        return torch.log(torch.tril(torch.ones(sz, sz)))

    def forward(self, src):
        if FIXED:
            # ARM keeps its causal mask, LLaDA attends to the whole sequence
            mask = self._generate_square_subsequent_mask(len(src)).to(self.device) if self.causal else None
        else:
            mask = self._generate_square_subsequent_mask(len(src)).to(self.device)
        self.src_mask = mask

        src = self.input_emb(src) * math.sqrt(self.ninp)
        src = self.pos_encoder(src)
        output_enc = self.encoder(src, mask=self.src_mask)
        output_dec = self.decoder(output_enc)
        return F.log_softmax(output_dec, dim=-1), output_enc


class LLaDA:
    """Masked diffusion LM: tokens are replaced by [MASK] with prob t and predicted from both sides."""

    def __init__(self, model, mask_id):
        self.model = model
        self.mask_id = mask_id

    def forward_process(self, x, eps=1e-3):
        # x: [seq_len, batch]
        b = x.shape[1]
        t = torch.rand(b)
        p_mask = ((1 - eps) * t + eps)[None, :].expand_as(x)
        masked = torch.rand_like(p_mask) < p_mask
        noisy = torch.where(masked, torch.full_like(x, self.mask_id), x)
        return noisy, masked, p_mask

    def loss(self, x):
        noisy, masked, p_mask = self.forward_process(x)
        logp, _ = self.model(noisy)
        nll = -logp.gather(-1, x.unsqueeze(-1)).squeeze(-1)
        return (nll[masked] / p_mask[masked]).sum() / x.numel(), noisy, logp


def main():
    torch.manual_seed(0)
    ntoken, mask_id = 14, 13  # digits, '+', '=', pad, [MASK]
    model = TransformerModel(ntoken, 32, 4, 64, 2, "cpu", dropout=0.0, causal=False)
    model.eval()
    llada = LLaDA(model, mask_id)

    # "a+b=c" arithmetic strings, [seq, batch]
    x = torch.randint(0, 10, (12, 3))
    x[3], x[7] = 10, 11
    loss, noisy, logp = llada.loss(x)

    # reference: bidirectional attention over the same noisy input
    with torch.no_grad():
        h = model.pos_encoder(model.input_emb(noisy) * math.sqrt(model.ninp))
        ref = F.log_softmax(model.decoder(model.encoder(h)), dim=-1)
    diff = (logp - ref).abs().max().item()
    print(f"llada loss {loss.item():.4f}  max |logp - bidirectional ref| = {diff:.3e}")


if __name__ == "__main__":
    main()
