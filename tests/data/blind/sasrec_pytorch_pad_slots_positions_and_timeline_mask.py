# pmixer/SASRec.pytorch commit 33bc1d8 ("0th embedding should always be all zero values but was not,
# checkin the fix for this issue"); model.py SASRec.log2feats / predict and main.py's init loop.
#
# Histories are LEFT-padded with item 0 (utils.py fills each row from the end).  Before the fix the
# positional table had no padding row: every slot got pos_emb(0..T-1), pad slots included, and
# log2feats then multiplied the stream by ~timeline_mask (log_seqs == 0) after the embedding and
# after every block.  The fix gives pos_emb a padding row (maxlen + 1 rows, padding_idx=0), numbers
# real slots 1..T and sends pad slots to position 0 (poss *= (log_seqs != 0)), zeroes row 0 of both
# tables after the xavier init in main.py, and drops the timeline_mask multiplications.
import sys
import argparse

import numpy as np
import torch

FIXED = "--fixed" in sys.argv


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
        outputs = outputs.transpose(-1, -2)  # as Conv1D requires (N, C, Length)
        outputs += inputs
        return outputs


class SASRec(torch.nn.Module):
    def __init__(self, user_num, item_num, args):
        super(SASRec, self).__init__()

        self.user_num = user_num
        self.item_num = item_num
        self.dev = args.device

        self.item_emb = torch.nn.Embedding(self.item_num + 1, args.hidden_units, padding_idx=0)
        if FIXED:
            self.pos_emb = torch.nn.Embedding(args.maxlen + 1, args.hidden_units, padding_idx=0)
        else:
            self.pos_emb = torch.nn.Embedding(args.maxlen, args.hidden_units)  # TO IMPROVE
        self.emb_dropout = torch.nn.Dropout(p=args.dropout_rate)

        self.attention_layernorms = torch.nn.ModuleList()  # to be Q for self-attention
        self.attention_layers = torch.nn.ModuleList()
        self.forward_layernorms = torch.nn.ModuleList()
        self.forward_layers = torch.nn.ModuleList()

        self.last_layernorm = torch.nn.LayerNorm(args.hidden_units, eps=1e-8)

        for _ in range(args.num_blocks):
            new_attn_layernorm = torch.nn.LayerNorm(args.hidden_units, eps=1e-8)
            self.attention_layernorms.append(new_attn_layernorm)

            new_attn_layer = torch.nn.MultiheadAttention(args.hidden_units,
                                                         args.num_heads,
                                                         args.dropout_rate)
            self.attention_layers.append(new_attn_layer)

            new_fwd_layernorm = torch.nn.LayerNorm(args.hidden_units, eps=1e-8)
            self.forward_layernorms.append(new_fwd_layernorm)

            new_fwd_layer = PointWiseFeedForward(args.hidden_units, args.dropout_rate)
            self.forward_layers.append(new_fwd_layer)

    def log2feats(self, log_seqs):
        seqs = self.item_emb(torch.LongTensor(log_seqs).to(self.dev))
        seqs *= self.item_emb.embedding_dim ** 0.5
        if FIXED:
            poss = np.tile(np.arange(1, log_seqs.shape[1] + 1), [log_seqs.shape[0], 1])
            poss *= (log_seqs != 0)
            seqs += self.pos_emb(torch.LongTensor(poss).to(self.dev))
            seqs = self.emb_dropout(seqs)
        else:
            positions = np.tile(np.array(range(log_seqs.shape[1])), [log_seqs.shape[0], 1])
            seqs += self.pos_emb(torch.LongTensor(positions).to(self.dev))
            seqs = self.emb_dropout(seqs)

            timeline_mask = torch.BoolTensor(log_seqs == 0).to(self.dev)
            seqs *= ~timeline_mask.unsqueeze(-1)  # broadcast in last dim

        tl = seqs.shape[1]  # time dim len for enforce causality
        attention_mask = ~torch.tril(torch.ones((tl, tl), dtype=torch.bool, device=self.dev))

        for i in range(len(self.attention_layers)):
            seqs = torch.transpose(seqs, 0, 1)
            Q = self.attention_layernorms[i](seqs)
            mha_outputs, _ = self.attention_layers[i](Q, seqs, seqs,
                                                      attn_mask=attention_mask)
            seqs = Q + mha_outputs
            seqs = torch.transpose(seqs, 0, 1)

            seqs = self.forward_layernorms[i](seqs)
            seqs = self.forward_layers[i](seqs)
            if not FIXED:
                seqs *= ~timeline_mask.unsqueeze(-1)

        log_feats = self.last_layernorm(seqs)  # (U, T, C) -> (U, -1, C)

        return log_feats

    def predict(self, user_ids, log_seqs, item_indices):  # for inference
        log_feats = self.log2feats(log_seqs)  # user_ids hasn't been used yet

        final_feat = log_feats[:, -1, :]  # only use last QKV classifier, a waste

        item_embs = self.item_emb(torch.LongTensor(item_indices).to(self.dev))  # (U, I, C)

        logits = item_embs.matmul(final_feat.unsqueeze(-1)).squeeze(-1)

        return logits  # (U, I)


def main():
    torch.manual_seed(0)
    np.random.seed(0)
    args = argparse.Namespace(maxlen=8, hidden_units=16, num_blocks=2, num_heads=1,
                              dropout_rate=0.2, device="cpu")
    usernum, itemnum = 3, 40
    model = SASRec(usernum, itemnum, args).to(args.device)

    for name, param in model.named_parameters():
        try:
            torch.nn.init.xavier_normal_(param.data)
        except:
            pass  # just ignore those failed init layers
    if FIXED:
        model.pos_emb.weight.data[0, :] = 0
        model.item_emb.weight.data[0, :] = 0

    # evaluate(): seq = np.zeros([args.maxlen]); filled from the end with the user's history
    histories = {1: [5, 9, 13, 2, 7, 30, 11, 4], 2: [3, 17, 8], 3: [21, 6, 14, 1, 33]}
    seqs = np.zeros([len(histories), args.maxlen], dtype=np.int64)
    for r, u in enumerate(sorted(histories)):
        idx = args.maxlen - 1
        for i in reversed(histories[u]):
            seqs[r, idx] = i
            idx -= 1
            if idx == -1:
                break
    item_idx = np.tile(np.arange(1, 11), [len(histories), 1])

    model.eval()
    with torch.no_grad():
        logits = model.predict(np.array(sorted(histories)), seqs, item_idx)
    for r, u in enumerate(sorted(histories)):
        top = torch.argsort(-logits[r])[:3] + 1
        print("user", u, "logits", [round(v, 4) for v in logits[r].tolist()], "top3", top.tolist())


if __name__ == "__main__":
    main()
