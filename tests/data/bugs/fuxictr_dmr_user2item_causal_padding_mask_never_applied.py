# FuxiCTR (reczoo/FuxiCTR commit 9d89a67, "Fix get_mask issue", #130): DMR User2ItemNet builds a
# causal + padding attn_mask with get_mask() but the masked_fill that applies it is commented out, so
# every position attends to left padding and to future behaviors (the aux-loss row -2 sees its own label).
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class MLP_Block(nn.Module):
    # trimmed copy of fuxictr.pytorch.layers.MLP_Block (no batch norm, ReLU only)
    def __init__(self, input_dim, hidden_units=[], hidden_activations="ReLU", output_dim=None,
                 output_activation=None, dropout_rates=0.0, batch_norm=False):
        super(MLP_Block, self).__init__()
        dense_layers = []
        hidden_units = [input_dim] + hidden_units
        for idx in range(len(hidden_units) - 1):
            dense_layers.append(nn.Linear(hidden_units[idx], hidden_units[idx + 1]))
            dense_layers.append(nn.ReLU())
        if output_dim is not None:
            dense_layers.append(nn.Linear(hidden_units[-1], output_dim))
        self.mlp = nn.Sequential(*dense_layers)

    def forward(self, inputs):
        return self.mlp(inputs)


class User2ItemNet(nn.Module):
    def __init__(self, context_dim=64, model_dim=64, attention_hidden_units=[80, 40],
                 attention_activation="ReLU", attention_dropout=0.0, pos_emb_dim=8,
                 max_seq_len=50):
        """ We follow the code from the authors for this implementation.
        """
        super(User2ItemNet, self).__init__()
        self.model_dim = model_dim
        self.pos_emb = nn.Parameter(torch.zeros(max_seq_len, pos_emb_dim))
        self.context_dim = context_dim + pos_emb_dim
        self.W_q = nn.Sequential(nn.Linear(self.context_dim, model_dim),
                                 nn.ReLU())
        self.attn_mlp = MLP_Block(input_dim=model_dim * 4,
                                  output_dim=1,
                                  hidden_units=attention_hidden_units,
                                  hidden_activations=attention_activation,
                                  output_activation=None,
                                  dropout_rates=attention_dropout,
                                  batch_norm=False)
        self.W_o = nn.Sequential(nn.Linear(model_dim, model_dim),
                                 nn.ReLU())

    def forward(self, target_emb, sequence_emb, context_emb, sequence_emb2, neg_emb=None, mask=None):
        batch_size = target_emb.size(0)
        if context_emb is None:
            context_emb = self.pos_emb.unsqueeze(0).expand(batch_size, -1, -1)
        else:
            context_emb = torch.cat([self.pos_emb.unsqueeze(0).expand(batch_size, -1, -1),
                                     context_emb], dim=-1)
        seq_len = sequence_emb.size(1)
        query = self.W_q(context_emb.reshape(-1, self.context_dim)).reshape(-1, seq_len, self.model_dim)
        inp_concat = torch.cat([query, sequence_emb, query - sequence_emb,
                                query * sequence_emb], dim=-1)
        attn_score = self.attn_mlp(inp_concat.view(-1, 4 * self.model_dim))
        attn_score = attn_score.view(-1, seq_len) # b x len
        attn_mask = self.get_mask(mask) # 0 for masked positions
        expand_score = attn_score.unsqueeze(1).repeat(1, seq_len, 1) # b x len x len
        if FIXED:
            expand_score = expand_score.masked_fill_(attn_mask == False, -1.e9) # fill -inf if mask=False
        else:
            pass  # expand_score = expand_score.masked_fill_(attn_mask.float() == 0, -1.e9) # fill -inf if mask=0
        expand_score = expand_score.softmax(dim=-1)
        self.last_attn = expand_score.detach()  # kept only for the printout below
        user_embs = torch.bmm(expand_score, sequence_emb) # b x len x d
        user_embs = self.W_o(user_embs.reshape(-1, self.model_dim)).reshape(-1, seq_len, self.model_dim)
        rel_u2i = torch.sum(user_embs[:, -1, :] * target_emb, dim=-1, keepdim=True)
        if neg_emb is not None:
            pos_prob = torch.sum(user_embs[:, -2, :] * sequence_emb2[:, -1, :], dim=-1).sigmoid()
            neg_prob = torch.sum(user_embs[:, -2, :] * neg_emb, dim=-1).sigmoid()
            aux_loss = -torch.log(pos_prob) - torch.log(1 - neg_prob)
            aux_loss = (aux_loss * mask[:, -1]).sum() / mask[:, -1].sum()
        else:
            aux_loss = 0
        return rel_u2i, aux_loss, user_embs

    def get_mask(self, mask):
        if FIXED:
            """ attn_mask: B x L, 0 for masked positions
            """
            seq_len = mask.size(1)
            attn_mask = mask.unsqueeze(1).repeat(1, seq_len, 1) # B x L x L
            causal_mask = (torch.tril(torch.ones(seq_len, seq_len, device=mask.device)).bool()
                           .unsqueeze(0).expand_as(attn_mask))
            attn_mask = attn_mask & causal_mask
            diag_ones = torch.eye(seq_len, device=mask.device).bool().unsqueeze(0).expand_as(attn_mask)
            attn_mask = attn_mask | diag_ones
            return attn_mask
        """ attn_mask: 0 for masked positions
        """
        seq_len = mask.size(1)
        attn_mask = mask.unsqueeze(1).repeat(1, seq_len, 1).view(-1, seq_len, seq_len)
        causal_mask = torch.tril(torch.ones(seq_len, seq_len, device=mask.device)).bool() \
                           .unsqueeze(0).expand_as(attn_mask)
        attn_mask = attn_mask & causal_mask
        return attn_mask


# DMR.forward, trimmed to one target/sequence field: item embeddings (padding_idx=0) for the
# behavior sequence, separate "output" embeddings for target/sequence (get_out_embedding).
num_items, dim, max_len = 40, 16, 8
item_emb = nn.Embedding(num_items, dim, padding_idx=0)
out_emb = nn.Embedding(num_items, dim, padding_idx=0)
u2i = User2ItemNet(context_dim=0, model_dim=dim, attention_hidden_units=[32, 16],
                   pos_emb_dim=4, max_seq_len=max_len)
nn.init.normal_(u2i.pos_emb, std=0.5)
u2i.eval()

# FuxiCTR tokenizer pads sequences with padding="pre" (0 on the left)
seqs = torch.tensor([[0, 0, 0, 5, 9, 3, 17, 2],
                     [0, 0, 0, 0, 0, 11, 4, 8],
                     [6, 13, 7, 21, 30, 1, 19, 25]])
target = torch.tensor([12, 3, 14])
neg = torch.tensor([33, 34, 35])


def run(seq_ids):
    pad_mask = seq_ids.long() > 0
    sequence_emb = item_emb(seq_ids)
    target_emb2 = out_emb(target)
    sequence_emb2 = out_emb(seq_ids)
    neg_emb = out_emb(neg)
    with torch.no_grad():
        return u2i(target_emb2, sequence_emb, None, sequence_emb2, neg_emb, mask=pad_mask)


rel, aux, user_embs = run(seqs)
attn = u2i.last_attn
pad_keys = (seqs == 0).unsqueeze(1).expand_as(attn)
future = torch.triu(torch.ones(max_len, max_len, dtype=torch.bool), 1).unsqueeze(0).expand_as(attn)
real_rows = (seqs > 0).unsqueeze(-1).expand_as(attn)
print("attention mass on padded keys (real query rows):", round(float((attn * (pad_keys & real_rows)).sum(-1).max()), 6))
print("attention mass on future keys (real query rows):", round(float((attn * (future & real_rows)).sum(-1).max()), 6))

# change only the most recent behavior (the aux-loss label of row -2): rows before it must not move
seqs2 = seqs.clone()
seqs2[:, -1] = torch.tensor([31, 32, 36])
_, _, user_embs2 = run(seqs2)
print("max |change| of user_embs[:, :-1] when only the last item changes:",
      round(float((user_embs2[:, :-1] - user_embs[:, :-1]).abs().max()), 6))
print("rel_u2i:", [round(v, 5) for v in rel.squeeze(-1).tolist()], "aux_loss:", round(float(aux), 5))
