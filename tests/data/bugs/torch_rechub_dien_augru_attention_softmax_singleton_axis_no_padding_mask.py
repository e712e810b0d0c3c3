# torch-rechub (datawhalechina/torch-rechub#229, commit f072330): DIEN's AUGRU_Cell.attention took softmax
# over a size-1 axis per time step (every weight == 1) and never masked padded behaviors, so padded steps
# drive the interest-evolving state as hard as real ones; the fix masks padding and softmaxes over time.
import sys

import torch
from torch import nn
from torch.nn import Parameter, init

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


if not FIXED:
    class AUGRU(nn.Module):

        def __init__(self, embed_dim):
            super(AUGRU, self).__init__()
            self.embed_dim = embed_dim
            self.augru_cell = AUGRU_Cell(self.embed_dim)

        def forward(self, x, item):
            outs = []
            h = None
            for i in range(x.shape[1]):
                if h is None:
                    h = Parameter(torch.rand(x.shape[0], self.embed_dim).to(x.device))
                h = self.augru_cell(x[:, i], h, item)
                outs.append(torch.unsqueeze(h, dim=1))
            outs = torch.cat(outs, dim=1)
            return outs, h

    class AUGRU_Cell(nn.Module):

        def __init__(self, embed_dim):
            super(AUGRU_Cell, self).__init__()
            self.Wu = Parameter(torch.rand(embed_dim, embed_dim))
            self.Uu = Parameter(torch.rand(embed_dim, embed_dim))
            self.bu = init.xavier_uniform_(Parameter(torch.empty(1, embed_dim)))
            self.Wr = init.xavier_uniform_(Parameter(torch.empty(embed_dim, embed_dim)))
            self.Ur = init.xavier_uniform_(Parameter(torch.empty(embed_dim, embed_dim)))
            self.br = init.xavier_uniform_(Parameter(torch.empty(1, embed_dim)))
            self.Wh = init.xavier_uniform_(Parameter(torch.empty(embed_dim, embed_dim)))
            self.Uh = init.xavier_uniform_(Parameter(torch.empty(embed_dim, embed_dim)))
            self.bh = init.xavier_uniform_(Parameter(torch.empty(1, embed_dim)))
            self.Wa = init.xavier_uniform_(Parameter(torch.empty(embed_dim, embed_dim)))

        def attention(self, x, item):
            hW = torch.matmul(x, self.Wa)
            hWi = torch.sum(hW * item, dim=1)
            hWi = torch.unsqueeze(hWi, 1)
            return torch.softmax(hWi, dim=1)

        def forward(self, x, h_1, item):
            u = torch.sigmoid(torch.matmul(x, self.Wu) + torch.matmul(h_1, self.Uu) + self.bu)
            r = torch.sigmoid(torch.matmul(x, self.Wr) + torch.matmul(h_1, self.Ur) + self.br)
            h_hat = torch.tanh(torch.matmul(x, self.Wh) + r * torch.matmul(h_1, self.Uh) + self.bh)
            a = self.attention(x, item)
            AUGRU.last_attn.append(a.detach())  # kept only for the printout below
            u_hat = a * u
            h = (1 - u_hat) * h_1 + u_hat * h_hat
            return h
else:
    class AUGRU_Cell(nn.Module):

        def __init__(self, embed_dim):
            super(AUGRU_Cell, self).__init__()
            self.Wu = init.xavier_uniform_(Parameter(torch.empty(embed_dim, embed_dim)))
            self.Uu = init.xavier_uniform_(Parameter(torch.empty(embed_dim, embed_dim)))
            self.bu = init.xavier_uniform_(Parameter(torch.empty(1, embed_dim)))
            self.Wr = init.xavier_uniform_(Parameter(torch.empty(embed_dim, embed_dim)))
            self.Ur = init.xavier_uniform_(Parameter(torch.empty(embed_dim, embed_dim)))
            self.br = init.xavier_uniform_(Parameter(torch.empty(1, embed_dim)))
            self.Wh = init.xavier_uniform_(Parameter(torch.empty(embed_dim, embed_dim)))
            self.Uh = init.xavier_uniform_(Parameter(torch.empty(embed_dim, embed_dim)))
            self.bh = init.xavier_uniform_(Parameter(torch.empty(1, embed_dim)))

        def forward(self, x, h_1, a):
            # a: [ batch_size, 1 ] — pre-computed attention score for this step
            u = torch.sigmoid(torch.matmul(x, self.Wu) + torch.matmul(h_1, self.Uu) + self.bu)
            r = torch.sigmoid(torch.matmul(x, self.Wr) + torch.matmul(h_1, self.Ur) + self.br)
            h_hat = torch.tanh(torch.matmul(x, self.Wh) + r * torch.matmul(h_1, self.Uh) + self.bh)
            u_hat = a * u  # attentional update gate (paper Eq.16)
            return (1 - u_hat) * h_1 + u_hat * h_hat

    class AUGRU(nn.Module):

        def __init__(self, embed_dim):
            super(AUGRU, self).__init__()
            self.embed_dim = embed_dim
            self.augru_cell = AUGRU_Cell(embed_dim)
            self.Wa = init.xavier_uniform_(Parameter(torch.empty(embed_dim, embed_dim)))

        def forward(self, x, item, mask=None):
            # x: [B, T, D], item: [B, D], mask: [B, T] bool (True=valid)
            scores = torch.matmul(x, self.Wa)  # [B, T, D]
            scores = (scores * item.unsqueeze(1)).sum(-1)  # [B, T]
            if mask is not None:
                scores = scores.masked_fill(~mask, float('-inf'))
            attn = torch.softmax(scores, dim=1)
            # replace nan rows (all-padding) with uniform attention
            nan_rows = attn.isnan().any(dim=1)
            if nan_rows.any():
                attn[nan_rows] = 1.0 / attn.size(1)
            attn = attn.unsqueeze(-1)  # [B, T, 1]
            AUGRU.last_attn = [attn[:, i].detach() for i in range(x.size(1))]  # kept only for the printout below

            h = torch.zeros(x.size(0), self.embed_dim, device=x.device)
            outs = []
            for i in range(x.size(1)):
                h = self.augru_cell(x[:, i], h, attn[:, i])
                outs.append(h.unsqueeze(1))
            return torch.cat(outs, dim=1), h


AUGRU.last_attn = []

# DIEN.forward, interest-evolving stage, one history feature; the interest-extractor states are given
B, T, D = 3, 6, 8
augru = AUGRU(D)
hist_ids = torch.tensor([[5, 9, 2, 0, 0, 0],        # sequences padded with 0 (generate_seq_feature)
                         [7, 3, 11, 4, 8, 0],
                         [6, 1, 12, 15, 13, 10]])
mask = hist_ids != 0
interest_states = torch.randn(B, T, D)               # GRU outputs; non-zero at padded steps in the old path
target_emb = torch.randn(B, D)


def evolve(states):
    AUGRU.last_attn = []
    torch.manual_seed(1)  # same initial state for the old AUGRU's torch.rand hidden state in every call
    with torch.no_grad():
        if FIXED:
            _, h = augru(states, target_emb, mask)
        else:
            _, h = augru(states, target_emb)
    return h, torch.cat(AUGRU.last_attn, dim=1)  # (B, T)


h, attn = evolve(interest_states)
print("attention weight on padded steps (max):", round(float(attn[~mask].max()), 6))
print("attention weights of user 0:", [round(v, 4) for v in attn[0].tolist()])
states2 = interest_states.clone()
states2[~mask] = torch.randn(int((~mask).sum()), D)  # whatever sits at the padded steps
h2, _ = evolve(states2)
print("max |change| of the final interest state when only padded steps change:", round(float((h2 - h).abs().max()), 6))
