# PaddlePaddle/PaddleRec#904 ("Recall model mind | b2i routing | softmax dim should be 2"),
# merged as commit ef86749a ("softmax dim should be 2 (#904)"); bug state read at ef86749a^,
# models/recall/mind/net.py (Mind_Capsual_Layer, MindLayer) and mind_reader.py.
#
# MIND's behaviour-to-interest (B2I) dynamic routing keeps routing logits B of shape
# [batch, k_max, maxlen] over a user's right-padded item history (mind_reader pads with item 0
# up to maxlen). Padded history slots are masked by writing -2**32+1 into B before the softmax.
# Before the fix the in-loop softmax ran over axis=1 (the k_max interest capsules), so every
# padded slot got weight 1/k_max instead of 0 and each real item's routing weights were
# normalised across interests rather than across the history. The fix softmaxes over axis=2,
# the history axis that the mask covers. (The post-loop softmax was left as the project had it.)
#
# Ported from Paddle to torch with the project's names and layout; tiny sizes, CPU only.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Mind_Capsual_Layer(nn.Module):
    """Mind_Capsual_Layer"""

    def __init__(self, input_units, output_units, iters=3, maxlen=32, k_max=3, init_std=1.0, batch_size=None):
        super(Mind_Capsual_Layer, self).__init__()
        self.iters = iters
        self.input_units = input_units
        self.output_units = output_units
        self.maxlen = maxlen
        self.init_std = init_std
        self.k_max = k_max
        self.batch_size = batch_size

        # B2I routing
        self.routing_logits = nn.Parameter(
            torch.randn(1, self.k_max, self.maxlen) * self.init_std, requires_grad=False)
        # bilinear mapping
        self.bilinear_mapping_matrix = nn.Parameter(
            torch.randn(self.input_units, self.output_units) * self.init_std)
        self.relu_layer = nn.Linear(self.output_units, self.output_units)

    def squash(self, Z):
        """squash"""
        vec_squared_norm = torch.sum(torch.square(Z), dim=-1, keepdim=True)
        scalar_factor = vec_squared_norm / (1 + vec_squared_norm) / torch.sqrt(vec_squared_norm + 1e-8)
        vec_squashed = scalar_factor * Z
        return vec_squashed

    def sequence_mask(self, lengths, maxlen=None, dtype=torch.bool):
        """sequence_mask"""
        batch_size = lengths.shape[0]
        if maxlen is None:
            maxlen = lengths.max()
        row_vector = torch.arange(0, maxlen, 1).unsqueeze(0).expand(batch_size, maxlen).reshape(
            (batch_size, -1, maxlen))
        lengths = lengths.unsqueeze(-1)
        mask = row_vector < lengths
        return mask.to(dtype)

    def forward(self, item_his_emb, seq_len):
        """forward

        Args:
            item_his_emb : [B, seqlen, dim]
            seq_len : [B, 1]
        """
        batch_size = item_his_emb.shape[0]
        seq_len_tile = torch.tile(seq_len, [1, self.k_max])

        mask = self.sequence_mask(seq_len_tile, self.maxlen)
        pad = torch.ones_like(mask, dtype=torch.float32) * (-2**32 + 1)
        # S*e
        low_capsule_new = torch.matmul(item_his_emb, self.bilinear_mapping_matrix)

        low_capsule_new_tile = torch.tile(low_capsule_new, [1, 1, self.k_max])
        low_capsule_new_tile = torch.reshape(low_capsule_new_tile, [-1, self.maxlen, self.k_max, self.output_units])
        low_capsule_new_tile = low_capsule_new_tile.permute(0, 2, 1, 3)
        low_capsule_new_tile = torch.reshape(low_capsule_new_tile, [-1, self.k_max, self.maxlen, self.output_units])
        low_capsule_new_nograd = low_capsule_new_tile.detach().clone()

        B = torch.tile(self.routing_logits, [item_his_emb.shape[0], 1, 1]).detach()

        for i in range(self.iters - 1):
            B_mask = torch.where(mask, B, pad)
            if FIXED:
                W = F.softmax(B_mask, dim=2)
            else:
                W = F.softmax(B_mask, dim=1)
            W = torch.unsqueeze(W, dim=2)
            high_capsule_tmp = torch.matmul(W, low_capsule_new_nograd)
            high_capsule = self.squash(high_capsule_tmp)
            B_delta = torch.matmul(low_capsule_new_nograd, high_capsule.permute(0, 1, 3, 2))
            B_delta = torch.reshape(B_delta, shape=[-1, self.k_max, self.maxlen])
            B = B + B_delta

        B_mask = torch.where(mask, B, pad)
        W = F.softmax(B_mask, dim=1)
        W = torch.unsqueeze(W, dim=2)
        interest_capsule = torch.matmul(W, low_capsule_new_tile)
        interest_capsule = self.squash(interest_capsule)
        high_capsule = torch.reshape(interest_capsule, [-1, self.k_max, self.output_units])

        high_capsule = F.relu(self.relu_layer(high_capsule))
        return high_capsule, W, seq_len


class MindLayer(nn.Module):
    """MindLayer"""

    def __init__(self, item_count, embedding_dim, hidden_size, neg_samples=100, maxlen=30, pow_p=1.0,
                 capsual_iters=3, capsual_max_k=3, capsual_init_std=1.0, batch_size=None):
        super(MindLayer, self).__init__()
        self.pow_p = pow_p
        self.hidden_size = hidden_size
        self.item_count = item_count
        self.item_emb = nn.Embedding(item_count, embedding_dim, padding_idx=0)
        nn.init.xavier_uniform_(self.item_emb.weight)
        with torch.no_grad():
            self.item_emb.weight[0].zero_()  # paddle's padding_idx looks up zeros
        self.capsual_layer = Mind_Capsual_Layer(
            embedding_dim, hidden_size, maxlen=maxlen, iters=capsual_iters,
            k_max=capsual_max_k, init_std=capsual_init_std, batch_size=batch_size)

    def label_aware_attention(self, keys, query):
        """label_aware_attention"""
        weight = torch.matmul(keys, torch.reshape(query, [-1, query.shape[-1], 1]))  # [B, k, 1]
        weight = torch.squeeze(weight, dim=-1)
        weight = torch.pow(weight, self.pow_p)  # [x,k_max]
        weight = F.softmax(weight, dim=-1)  # [x, k_max]
        weight = torch.unsqueeze(weight, 1)  # [B, 1, k_max]
        output = torch.matmul(weight, keys)  # [B, 1, dim]
        return output.squeeze(1), weight

    def forward(self, hist_item, seqlen, labels=None):
        hit_item_emb = self.item_emb(hist_item)  # [B, seqlen, embed_dim]
        user_cap, cap_weights, cap_mask = self.capsual_layer(hit_item_emb, seqlen)
        if not self.training:
            return user_cap, cap_weights
        target_emb = self.item_emb(labels)
        user_emb, W = self.label_aware_attention(user_cap, target_emb)
        logits = torch.matmul(user_emb, self.item_emb.weight.t())
        loss = F.cross_entropy(logits, labels.reshape(-1))
        return loss, W, user_cap, cap_weights, cap_mask


def mind_reader_sample(item_list, k, maxlen):
    # mind_reader.py: history before position k, right-padded with item 0 up to maxlen
    item_id = item_list[k]
    if k >= maxlen:
        hist_item_list = item_list[k - maxlen:k]
        hist_item_len = len(hist_item_list)
    else:
        hist_item_list = item_list[:k] + [0] * (maxlen - k)
        hist_item_len = k
    return hist_item_list, [item_id], [hist_item_len]


def main():
    torch.manual_seed(0)
    item_count, embedding_dim, hidden_size, maxlen = 60, 16, 16, 12
    model = MindLayer(item_count, embedding_dim, hidden_size, maxlen=maxlen, pow_p=1.0,
                      capsual_iters=3, capsual_max_k=4, capsual_init_std=1.0)

    users = [
        [5, 9, 13, 21, 34, 2, 7, 40, 41],
        [11, 12, 3, 58, 20, 19, 33, 30, 8, 14, 27, 44, 45, 50, 51],
        [17, 4, 6, 22, 23, 29],
    ]
    ks = [7, 14, 5]
    hist, labels, seqlen = [], [], []
    for items, k in zip(users, ks):
        h, l, s = mind_reader_sample(items, k, maxlen)
        hist.append(h)
        labels.append(l)
        seqlen.append(s)
    hist_item = torch.tensor(hist, dtype=torch.long)
    labels = torch.tensor(labels, dtype=torch.long)
    seqlen = torch.tensor(seqlen, dtype=torch.long)

    model.train()
    loss, W, user_cap, cap_weights, _ = model(hist_item, seqlen, labels)
    print("train loss:", round(loss.item(), 6))

    model.eval()
    with torch.no_grad():
        user_cap, cap_weights = model(hist_item, seqlen)
        print("user interest capsules [0, :, :4]:")
        print(user_cap[0, :, :4])
        # infer: recall top items by max score over the user's interests
        scores = torch.matmul(user_cap, model.item_emb.weight[1:].t()).max(dim=1).values
        topk = torch.topk(scores, 5, dim=-1).indices + 1
        print("top-5 recalled items:", topk.tolist())


if __name__ == "__main__":
    main()
