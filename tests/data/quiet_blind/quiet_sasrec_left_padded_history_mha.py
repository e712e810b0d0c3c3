# Citation: pmixer/SASRec.pytorch python/model.py (SASRec.log2feats / forward / predict) and python/utils.py
#   (sample_function: histories left-padded with item 0), commit 22c909f948e3d7f52abcd3d4bbb2e07ae66ae420.
# nn.MultiheadAttention (seq-first) with a bool *block* mask attn_mask = ~tril(ones(tl, tl)): causal over a left-padded
# history. Pad slots carry zero item/position embeddings; no pad query row is ever fully masked (each sees itself),
# and the loss/prediction use only real positions (pos != 0) and the last slot, so padding never reaches a result.
import argparse
import numpy as np
import torch

torch.manual_seed(0)
np.random.seed(0)


class PointWiseFeedForward(torch.nn.Module):
    def __init__(self, hidden_units, dropout_rate):
        super(PointWiseFeedForward, self).__init__()
        self.conv1 = torch.nn.Conv1d(hidden_units, hidden_units, kernel_size=1)
        self.dropout1 = torch.nn.Dropout(p=dropout_rate)
        self.relu = torch.nn.ReLU()
        self.conv2 = torch.nn.Conv1d(hidden_units, hidden_units, kernel_size=1)
        self.dropout2 = torch.nn.Dropout(p=dropout_rate)

    def forward(self, inputs):
        outputs = self.dropout2(self.conv2(self.relu(self.dropout1(self.conv1(inputs.transpose(-1, -2))))))
        outputs = outputs.transpose(-1, -2)
        return outputs


class SASRec(torch.nn.Module):
    def __init__(self, user_num, item_num, args):
        super(SASRec, self).__init__()
        self.user_num = user_num
        self.item_num = item_num
        self.dev = args.device
        self.norm_first = args.norm_first
        maxlen = 200
        self.item_emb = torch.nn.Embedding(self.item_num + 1, args.hidden_units, padding_idx=0)
        self.pos_emb = torch.nn.Embedding(maxlen + 1, args.hidden_units, padding_idx=0)
        self.emb_dropout = torch.nn.Dropout(p=args.dropout_rate)
        self.attention_layernorms = torch.nn.ModuleList()
        self.attention_layers = torch.nn.ModuleList()
        self.forward_layernorms = torch.nn.ModuleList()
        self.forward_layers = torch.nn.ModuleList()
        self.last_layernorm = torch.nn.LayerNorm(args.hidden_units, eps=1e-8)
        for _ in range(args.num_blocks):
            self.attention_layernorms.append(torch.nn.LayerNorm(args.hidden_units, eps=1e-8))
            self.attention_layers.append(torch.nn.MultiheadAttention(args.hidden_units, args.num_heads,
                                                                     args.dropout_rate))
            self.forward_layernorms.append(torch.nn.LayerNorm(args.hidden_units, eps=1e-8))
            self.forward_layers.append(PointWiseFeedForward(args.hidden_units, args.dropout_rate))

    def log2feats(self, log_seqs, causal=True):
        log_seqs_t = torch.tensor(log_seqs, dtype=torch.long, device=self.dev)
        seqs = self.item_emb(log_seqs_t)
        seqs *= self.item_emb.embedding_dim ** 0.5
        B, L = log_seqs.shape
        poss = torch.arange(1, L + 1, dtype=torch.long, device=self.dev).unsqueeze(0).expand(B, -1)
        poss = poss * (log_seqs_t != 0)
        seqs += self.pos_emb(poss)
        seqs = self.emb_dropout(seqs)

        tl = seqs.shape[1]  # time dim len for enforce causality
        if causal:
            attention_mask = ~torch.tril(torch.ones((tl, tl), dtype=torch.bool, device=self.dev))
        else:
            attention_mask = None

        for i in range(len(self.attention_layers)):
            seqs = torch.transpose(seqs, 0, 1)
            if self.norm_first:
                x = self.attention_layernorms[i](seqs)
                mha_outputs, _ = self.attention_layers[i](x, x, x, attn_mask=attention_mask)
                seqs = seqs + mha_outputs
                seqs = torch.transpose(seqs, 0, 1)
                seqs = seqs + self.forward_layers[i](self.forward_layernorms[i](seqs))
            else:
                mha_outputs, _ = self.attention_layers[i](seqs, seqs, seqs, attn_mask=attention_mask)
                seqs = self.attention_layernorms[i](seqs + mha_outputs)
                seqs = torch.transpose(seqs, 0, 1)
                seqs = self.forward_layernorms[i](seqs + self.forward_layers[i](seqs))
        log_feats = self.last_layernorm(seqs)
        return log_feats

    def forward(self, user_ids, log_seqs, pos_seqs, neg_seqs):
        log_feats = self.log2feats(log_seqs)
        pos_embs = self.item_emb(torch.tensor(pos_seqs, dtype=torch.long, device=self.dev))
        neg_embs = self.item_emb(torch.tensor(neg_seqs, dtype=torch.long, device=self.dev))
        pos_logits = (log_feats * pos_embs).sum(dim=-1)
        neg_logits = (log_feats * neg_embs).sum(dim=-1)
        return pos_logits, neg_logits

    def predict(self, user_ids, log_seqs, item_indices):
        log_feats = self.log2feats(log_seqs)
        final_feat = log_feats[:, -1, :]
        item_embs = self.item_emb(torch.tensor(item_indices, dtype=torch.long, device=self.dev))
        logits = item_embs.matmul(final_feat.unsqueeze(-1)).squeeze(-1)
        return logits


def random_neq(l, r, s):
    t = np.random.randint(l, r)
    while t in s:
        t = np.random.randint(l, r)
    return t


def sample(user_train, usernum, itemnum, maxlen, uid):
    # utils.py sample_function: fill from the right, leaving zeros (padding) on the left
    seq = np.zeros([maxlen], dtype=np.int32)
    pos = np.zeros([maxlen], dtype=np.int32)
    neg = np.zeros([maxlen], dtype=np.int32)
    nxt = user_train[uid][-1]
    idx = maxlen - 1
    ts = set(user_train[uid])
    for i in reversed(user_train[uid][:-1]):
        seq[idx] = i
        pos[idx] = nxt
        if nxt != 0:
            neg[idx] = random_neq(1, itemnum + 1, ts)
        nxt = i
        idx -= 1
        if idx == -1:
            break
    return uid, seq, pos, neg


args = argparse.Namespace(device="cpu", norm_first=False, hidden_units=32, num_heads=2, num_blocks=2,
                          dropout_rate=0.2, maxlen=12, lr=0.001, l2_emb=0.0)
usernum, itemnum = 6, 50
user_train = {u: list(np.random.randint(1, itemnum + 1, size=np.random.randint(3, 20))) for u in range(1, usernum + 1)}
batch = [sample(user_train, usernum, itemnum, args.maxlen, u) for u in range(1, usernum + 1)]
u, seq, pos, neg = (np.array(x) for x in zip(*batch))

model = SASRec(usernum, itemnum, args)
for name, param in model.named_parameters():
    try:
        torch.nn.init.xavier_normal_(param.data)
    except Exception:
        pass
model.pos_emb.weight.data[0, :] = 0
model.item_emb.weight.data[0, :] = 0
bce_criterion = torch.nn.BCEWithLogitsLoss()
adam_optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98))
model.train()
for step in range(3):
    pos_logits, neg_logits = model(u, seq, pos, neg)
    pos_labels, neg_labels = torch.ones(pos_logits.shape), torch.zeros(neg_logits.shape)
    adam_optimizer.zero_grad()
    indices = np.where(pos != 0)
    loss = bce_criterion(pos_logits[indices], pos_labels[indices])
    loss += bce_criterion(neg_logits[indices], neg_labels[indices])
    loss.backward()
    adam_optimizer.step()

model.eval()
with torch.no_grad():
    item_idx = np.arange(1, 21)
    predictions = -model.predict(u, seq, item_idx)
print(f"loss={loss.item():.4f} pred_norm={predictions.norm().item():.4f}")
