# shenweichen/DeepCTR-Torch#128 (fixed in commit 61b5775): DIN.forward passed keys_length = torch.ones((B, 1)) to
# AttentionSequencePoolingLayer, so the key mask `arange(T) < keys_length` let every user's candidate item attend
# only to the first behaviour; the fix reads each user's history length from the `seq_length` feature.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class DNN(nn.Module):
    def __init__(self, inputs_dim, hidden_units, activation="relu"):
        super().__init__()
        dims = [inputs_dim] + list(hidden_units)
        self.linears = nn.ModuleList([nn.Linear(dims[i], dims[i + 1]) for i in range(len(hidden_units))])
        self.act = nn.Sigmoid() if activation == "sigmoid" else nn.ReLU()

    def forward(self, x):
        for fc in self.linears:
            x = self.act(fc(x))
        return x


class LocalActivationUnit(nn.Module):
    def __init__(self, hidden_units=(64, 32), embedding_dim=4, activation="sigmoid"):
        super(LocalActivationUnit, self).__init__()
        self.dnn = DNN(inputs_dim=4 * embedding_dim, hidden_units=hidden_units, activation=activation)
        self.dense = nn.Linear(hidden_units[-1], 1)

    def forward(self, query, user_behavior):
        user_behavior_len = user_behavior.size(1)
        queries = query.expand(-1, user_behavior_len, -1)
        attention_input = torch.cat([queries, user_behavior, queries - user_behavior, queries * user_behavior], dim=-1)
        return self.dense(self.dnn(attention_input))  # [B, T, 1]


class AttentionSequencePoolingLayer(nn.Module):
    """The Attentional sequence pooling operation used in DIN & DIEN."""

    def __init__(self, att_hidden_units=(80, 40), att_activation="sigmoid", weight_normalization=False,
                 return_score=False, supports_masking=False, embedding_dim=4):
        super(AttentionSequencePoolingLayer, self).__init__()
        self.return_score = return_score
        self.weight_normalization = weight_normalization
        self.supports_masking = supports_masking
        self.local_att = LocalActivationUnit(hidden_units=att_hidden_units, embedding_dim=embedding_dim, activation=att_activation)

    def forward(self, query, keys, keys_length, mask=None):
        batch_size, max_length, dim = keys.size()
        # Mask
        keys_masks = torch.arange(max_length, device=keys_length.device, dtype=keys_length.dtype).repeat(batch_size, 1)  # [B, T]
        keys_masks = keys_masks < keys_length.view(-1, 1)  # 0, 1 mask
        keys_masks = keys_masks.unsqueeze(1)  # [B, 1, T]

        attention_score = self.local_att(query, keys)  # [B, T, 1]
        outputs = torch.transpose(attention_score, 1, 2)  # [B, 1, T]
        if self.weight_normalization:
            paddings = torch.ones_like(outputs) * (-2 ** 32 + 1)
        else:
            paddings = torch.zeros_like(outputs)
        outputs = torch.where(keys_masks, outputs, paddings)  # [B, 1, T]
        if self.weight_normalization:
            outputs = F.softmax(outputs, dim=-1)  # [B, 1, T]
        if not self.return_score:
            outputs = torch.matmul(outputs, keys)  # Weighted sum [B, 1, E]
        return outputs


class DIN(nn.Module):
    """Deep Interest Network: item_id / cate_id queries attend over hist_item_id / hist_cate_id (length: seq_length)."""

    def __init__(self, vocab=(40, 8), embedding_dim=4, dnn_hidden_units=(32, 16), att_hidden_size=(16, 8),
                 att_activation="sigmoid", att_weight_normalization=False):
        super(DIN, self).__init__()
        self.history_feature_list = ["item_id", "cate_id"]
        self.embedding_dict = nn.ModuleDict({
            "item_id": nn.Embedding(vocab[0], embedding_dim, padding_idx=0),
            "cate_id": nn.Embedding(vocab[1], embedding_dim, padding_idx=0),
            "gender": nn.Embedding(2, embedding_dim),
        })
        att_emb_dim = len(self.history_feature_list) * embedding_dim
        self.attention = AttentionSequencePoolingLayer(att_hidden_units=att_hidden_size, embedding_dim=att_emb_dim,
                                                       att_activation=att_activation,
                                                       weight_normalization=att_weight_normalization)
        self.dnn = DNN(inputs_dim=embedding_dim + 2 * att_emb_dim + 1, hidden_units=dnn_hidden_units)
        self.dnn_linear = nn.Linear(dnn_hidden_units[-1], 1, bias=False)

    def forward(self, X):
        query_emb = torch.cat([self.embedding_dict[f](X[f]).unsqueeze(1) for f in self.history_feature_list], dim=-1)  # [B, 1, E]
        keys_emb = torch.cat([self.embedding_dict[f](X["hist_" + f]) for f in self.history_feature_list], dim=-1)  # [B, T, E]
        deep_input_emb = torch.cat([self.embedding_dict["gender"](X["gender"]), query_emb.squeeze(1)], dim=-1)
        if FIXED:
            keys_length = X["seq_length"].view(-1, 1)  # [B, 1]
        else:
            keys_length = torch.ones((query_emb.size(0), 1))  # [B, 1]
        hist = self.attention(query_emb, keys_emb, keys_length)  # [B, 1, E]
        dnn_input = torch.cat([deep_input_emb, hist.squeeze(1), X["pay_score"].view(-1, 1)], dim=-1)
        return torch.sigmoid(self.dnn_linear(self.dnn(dnn_input)))


# examples/run_din.py style batch: behaviour histories padded with 0 to T=6, true lengths in seq_length
B, T = 4, 6
seq_length = torch.tensor([3, 6, 2, 4])
hist_item_id = torch.zeros(B, T, dtype=torch.long)
hist_cate_id = torch.zeros(B, T, dtype=torch.long)
for b in range(B):
    n = int(seq_length[b])
    hist_item_id[b, :n] = torch.randint(1, 40, (n,))
    hist_cate_id[b, :n] = torch.randint(1, 8, (n,))
X = {"gender": torch.tensor([0, 1, 0, 1]), "item_id": torch.tensor([5, 17, 23, 31]), "cate_id": torch.tensor([1, 2, 3, 4]),
     "pay_score": torch.tensor([0.1, 0.2, 0.3, 0.2]), "hist_item_id": hist_item_id, "hist_cate_id": hist_cate_id,
     "seq_length": seq_length}

model = DIN(att_weight_normalization=True).eval()
with torch.no_grad():
    pctr = model(X).squeeze(1)
print("mode:", "fixed" if FIXED else "buggy")
print("history lengths:", seq_length.tolist(), "pCTR:", [round(v, 4) for v in pctr.tolist()])
