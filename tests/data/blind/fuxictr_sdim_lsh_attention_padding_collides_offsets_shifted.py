# reczoo/FuxiCTR#72, fixed in commit 60dc5f8 ("Bug fix #72 for SDIM"; model_zoo/SDIM/src/SDIM.py diff read)
# SDIM's long-sequence LSH attention summed every behaviour whose hash bucket collides with the target's,
# padding positions included (no sequence mask), and its embedding_bag offsets were a cumsum without a
# leading 0, so each (hash, sample) bag took the colliding behaviours of the next bag instead of its own.
import sys

import torch
from torch import nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

# model_zoo/SDIM/config/model_config.yaml: SDIM_test (sizes kept small)
params = {
    "model": "SDIM",
    "learning_rate": 1.0e-3,
    "embedding_dim": 8,
    "dnn_hidden_units": [64, 32],
    "dnn_activations": "relu",
    "reuse_hash": True,
    "num_hashes": 2,
    "hash_bits": 4,
    "short_target_field": [],
    "short_sequence_field": [],
    "long_target_field": "adgroup_id",
    "long_sequence_field": "click_sequence",
}
VOCAB = 50
MAX_LEN = 32


class SDIM(nn.Module):
    def __init__(self, embedding_dim=10, dnn_hidden_units=[512, 128, 64], reuse_hash=True, num_hashes=1,
                 hash_bits=4, long_target_field=[("item_id", "cate_id")],
                 long_sequence_field=[("click_history", "cate_history")], **kwargs):
        super(SDIM, self).__init__()
        if type(long_target_field) != list:
            long_target_field = [long_target_field]
        if type(long_sequence_field) != list:
            long_sequence_field = [long_sequence_field]
        self.long_target_field = long_target_field
        self.long_sequence_field = long_sequence_field
        self.embedding_dim = embedding_dim
        self.reuse_hash = reuse_hash
        self.num_hashes = num_hashes
        self.hash_bits = hash_bits
        self.powers_of_two = nn.Parameter(torch.tensor([2.0 ** i for i in range(hash_bits)]),
                                          requires_grad=False)
        # the sequence field shares its embedding table with the target field (share_embedding)
        self.embedding_layer = nn.ModuleDict({"adgroup_id": nn.Embedding(VOCAB, embedding_dim, padding_idx=0),
                                              "userid": nn.Embedding(VOCAB, embedding_dim, padding_idx=0)})
        self.random_rotations = nn.ParameterList()
        for target_field in self.long_target_field:
            input_dim = embedding_dim
            self.random_rotations.append(nn.Parameter(torch.randn(input_dim, self.num_hashes,
                                                                  self.hash_bits), requires_grad=False))
        layers, in_dim = [], 3 * embedding_dim
        for h in dnn_hidden_units:
            layers += [nn.Linear(in_dim, h), nn.ReLU()]
            in_dim = h
        layers += [nn.Linear(in_dim, 1), nn.Sigmoid()]
        self.dnn = nn.Sequential(*layers)

    def forward(self, X):
        feature_emb_dict = {"userid": self.embedding_layer["userid"](X["userid"]),
                            "adgroup_id": self.embedding_layer["adgroup_id"](X["adgroup_id"]),
                            "click_sequence": self.embedding_layer["adgroup_id"](X["click_sequence"])}
        # long interest attention
        for idx, (target_field, sequence_field) in enumerate(zip(self.long_target_field,
                                                                 self.long_sequence_field)):
            target_emb = feature_emb_dict[target_field]
            sequence_emb = feature_emb_dict[sequence_field]
            if FIXED:
                mask = X[sequence_field].long() != 0  # padding_idx = 0 required in input data
                long_interest_emb = self.lsh_attentioin(self.random_rotations[idx],
                                                        target_emb, sequence_emb, mask)
            else:
                long_interest_emb = self.lsh_attentioin(self.random_rotations[idx],
                                                        target_emb, sequence_emb)
            feature_emb_dict[sequence_field] = long_interest_emb
        feature_emb = torch.cat([feature_emb_dict[f] for f in ["userid", "adgroup_id", "click_sequence"]], dim=-1)
        y_pred = self.dnn(feature_emb)
        return {"y_pred": y_pred}

    def lsh_attentioin(self, random_rotations, target_item, history_sequence, mask=None):
        if not self.reuse_hash:
            random_rotations = torch.randn(target_item.size(1), self.num_hashes,
                                           self.hash_bits, device=target_item.device)
        if FIXED:
            sequence_bucket = self.lsh_hash(history_sequence, random_rotations)
            target_bucket = self.lsh_hash(target_item.unsqueeze(1), random_rotations)
            bucket_match = (sequence_bucket - target_bucket).permute(2, 0, 1)  # num_hashes x B x seq_len
            collide_mask = ((bucket_match == 0) * mask.unsqueeze(0)).float()  # both hash collision mask and sequence mask
            hash_index, collide_index = torch.nonzero(collide_mask.flatten(start_dim=1), as_tuple=True)
            offsets = collide_mask.sum(dim=-1).flatten().cumsum(dim=0)
            offsets = torch.cat([torch.zeros(1, device=offsets.device), offsets]).long()
            attn_out = F.embedding_bag(collide_index, history_sequence.view(-1, target_item.size(1)),
                                       offsets, mode='sum', include_last_offset=True)  # (num_hashes x B) x d
        else:
            target_bucket = self.lsh_hash(history_sequence, random_rotations)
            sequence_bucket = self.lsh_hash(target_item.unsqueeze(1), random_rotations)
            bucket_match = (sequence_bucket - target_bucket).permute(2, 0, 1)  # num_hashes x B x seq_len
            collide_mask = (bucket_match == 0).float()
            hash_index, collide_index = torch.nonzero(collide_mask.flatten(start_dim=1), as_tuple=True)
            offsets = collide_mask.sum(dim=-1).long().flatten().cumsum(dim=0)
            attn_out = F.embedding_bag(collide_index, history_sequence.view(-1, target_item.size(1)),
                                       offsets, mode='sum')  # (num_hashes x B) x d
        attn_out = attn_out.view(self.num_hashes, -1, target_item.size(1)).mean(dim=0)  # B x d
        return attn_out

    def lsh_hash(self, vecs, random_rotations):
        rotated_vecs = torch.einsum("bld,dht->blht", vecs, random_rotations)  # B x seq_len x num_hashes x hash_bits
        hash_code = torch.relu(torch.sign(rotated_vecs))
        hash_bucket = torch.matmul(hash_code, self.powers_of_two.unsqueeze(-1)).squeeze(-1)
        return hash_bucket


def make_batch(batch_size=16, g=None):
    # tokenizer pads "pre" (left) with __PAD__ = 0
    lengths = torch.randint(3, MAX_LEN + 1, (batch_size,), generator=g)
    seq = torch.zeros(batch_size, MAX_LEN, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        seq[i, MAX_LEN - n:] = torch.randint(1, VOCAB, (n,), generator=g)
    return {"userid": torch.randint(1, VOCAB, (batch_size,), generator=g),
            "adgroup_id": torch.randint(1, VOCAB, (batch_size,), generator=g),
            "click_sequence": seq,
            "clk": torch.randint(0, 2, (batch_size, 1), generator=g).float()}


model = SDIM(**params)
optimizer = torch.optim.Adam(model.parameters(), lr=params["learning_rate"])
X = make_batch(g=torch.Generator().manual_seed(5))
y_pred = model(X)["y_pred"]
loss = F.binary_cross_entropy(y_pred, X["clk"])
optimizer.zero_grad()
loss.backward()
optimizer.step()
print("SDIM fixed=%s loss %.5f" % (FIXED, loss.item()))
