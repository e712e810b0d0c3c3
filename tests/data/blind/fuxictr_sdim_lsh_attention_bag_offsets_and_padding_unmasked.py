# Citation: reczoo/FuxiCTR#72 ("[Bug] SDIM was not correctly implemented."), fixed in
#   reczoo/FuxiCTR commit 60dc5f8 ("... 3. Bug fix #72 for SDIM"); bug state read at 60dc5f8^.
# Upstream: model_zoo/SDIM/src/SDIM.py, SDIM.forward (long-interest branch) and
#   SDIM.lsh_attentioin / SDIM.lsh_hash; FeatureEmbeddingDict (padding_idx=0, "pre" padding).
# Bug: SDIM's LSH "attention" gathers, per (hash, user) bag, the behaviours whose hash bucket
#   collides with the target item and sums them with F.embedding_bag. The collide mask had no
#   sequence padding mask, and the bag offsets were `collide_mask.sum(-1).flatten().cumsum(0)`
#   (no leading 0): every bag starts where the previous one ends, so each user's bag holds the
#   NEXT user's colliding behaviours and the last bag is empty (it only runs when the first bag
#   happens to be empty; otherwise embedding_bag raises, the "errors occasionally" of #72).
# Fix: collide_mask = (bucket_match == 0) * mask (mask = history ids != 0), offsets prefixed
#   with 0 and embedding_bag(..., include_last_offset=True).
import sys

import torch
from torch import nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def flatten(x):
    for item in x:
        if isinstance(item, (list, tuple)):
            yield from flatten(item)
        else:
            yield item


class FeatureEmbeddingDict(nn.Module):
    def __init__(self, feature_specs, embedding_dim):
        super().__init__()
        self.embedding_layers = nn.ModuleDict()
        self._feature_specs = feature_specs
        for name, spec in feature_specs.items():
            if "share_embedding" in spec:
                continue
            self.embedding_layers[name] = nn.Embedding(spec["vocab_size"], embedding_dim,
                                                       padding_idx=spec.get("padding_idx", None))
        self.reset_parameters()

    def reset_parameters(self):
        for k, v in self.embedding_layers.items():
            if v.padding_idx is not None:  # using 0 index as padding_idx
                nn.init.normal_(v.weight[1:, :], std=1.0)
            else:
                nn.init.normal_(v.weight, std=1.0)

    def forward(self, X):
        feature_emb_dict = {}
        for name, spec in self._feature_specs.items():
            layer = self.embedding_layers[spec.get("share_embedding", name)]
            feature_emb_dict[name] = layer(X[name].long())
        return feature_emb_dict

    def dict2tensor(self, embedding_dict, flatten_emb=False):
        emb_list = list(embedding_dict.values())
        if flatten_emb:
            return torch.cat(emb_list, dim=-1)
        return torch.stack(emb_list, dim=1)


class MLP_Block(nn.Module):
    def __init__(self, input_dim, hidden_units, output_dim=1):
        super().__init__()
        layers = []
        dims = [input_dim] + hidden_units
        for i in range(len(hidden_units)):
            layers += [nn.Linear(dims[i], dims[i + 1]), nn.ReLU()]
        layers += [nn.Linear(dims[-1], output_dim), nn.Sigmoid()]
        self.mlp = nn.Sequential(*layers)

    def forward(self, x):
        return self.mlp(x)


class SDIM(nn.Module):
    def __init__(self, feature_specs, embedding_dim=4, dnn_hidden_units=[16, 8], reuse_hash=True,
                 num_hashes=2, hash_bits=4, long_target_field=[("item_id", "cate_id")],
                 long_sequence_field=[("click_history", "cate_history")]):
        super().__init__()
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
        self.embedding_layer = FeatureEmbeddingDict(feature_specs, embedding_dim)
        self.random_rotations = nn.ParameterList()
        for target_field in self.long_target_field:
            if type(target_field) == tuple:
                input_dim = embedding_dim * len(target_field)
            else:
                input_dim = embedding_dim
            self.random_rotations.append(nn.Parameter(torch.randn(input_dim, self.num_hashes,
                                                                  self.hash_bits), requires_grad=False))
        self.dnn = MLP_Block(input_dim=embedding_dim * len(feature_specs),
                             hidden_units=dnn_hidden_units)

    def forward(self, X):
        feature_emb_dict = self.embedding_layer(X)
        # long interest attention
        for idx, (target_field, sequence_field) in enumerate(zip(self.long_target_field,
                                                                 self.long_sequence_field)):
            target_emb = self.concat_embedding(target_field, feature_emb_dict)
            sequence_emb = self.concat_embedding(sequence_field, feature_emb_dict)
            if FIXED:
                seq_field = list(flatten([sequence_field]))[0]  # flatten nested list to pick the first field
                mask = X[seq_field].long() != 0  # padding_idx = 0 required in input data
                long_interest_emb = self.lsh_attentioin(self.random_rotations[idx],
                                                        target_emb, sequence_emb, mask)
            else:
                long_interest_emb = self.lsh_attentioin(self.random_rotations[idx],
                                                        target_emb, sequence_emb)
            for field, field_emb in zip(list(flatten([sequence_field])),
                                        long_interest_emb.split(self.embedding_dim, dim=-1)):
                feature_emb_dict[field] = field_emb
        feature_emb = self.embedding_layer.dict2tensor(feature_emb_dict, flatten_emb=True)
        y_pred = self.dnn(feature_emb)
        return {"y_pred": y_pred}

    def concat_embedding(self, field, feature_emb_dict):
        if type(field) == tuple:
            emb_list = [feature_emb_dict[f] for f in field]
            return torch.cat(emb_list, dim=-1)
        else:
            return feature_emb_dict[field]

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
        """Input: vecs, B x seq_len x d. Output: hash_bucket, B x seq_len x num_hashes."""
        rotated_vecs = torch.einsum("bld,dht->blht", vecs, random_rotations)  # B x seq_len x num_hashes x hash_bits
        hash_code = torch.relu(torch.sign(rotated_vecs))
        hash_bucket = torch.matmul(hash_code, self.powers_of_two.unsqueeze(-1)).squeeze(-1)
        return hash_bucket


def pad_pre(seqs, max_len):
    # FuxiCTR's Tokenizer pads sequences with padding="pre" (zeros on the left)
    out = torch.zeros(len(seqs), max_len, dtype=torch.long)
    for i, s in enumerate(seqs):
        s = s[-max_len:]
        out[i, max_len - len(s):] = torch.tensor(s)
    return out


def main():
    torch.manual_seed(0)
    feature_specs = {
        "user_id": {"vocab_size": 8},
        "item_id": {"vocab_size": 21, "padding_idx": 0},
        "cate_id": {"vocab_size": 6, "padding_idx": 0},
        "click_history": {"vocab_size": 21, "padding_idx": 0, "share_embedding": "item_id"},
        "cate_history": {"vocab_size": 6, "padding_idx": 0, "share_embedding": "cate_id"},
    }
    model = SDIM(feature_specs, embedding_dim=4, num_hashes=2, hash_bits=4)
    model.eval()

    item_cate = {i: 1 + (i % 5) for i in range(1, 21)}
    histories = [
        [3, 7],
        [1, 4, 9, 12, 15, 2],
        [5, 6, 11, 18, 7, 3, 20, 14],
        [8, 13, 2, 19],
    ]
    targets = [17, 9, 4, 13]
    click_history = pad_pre(histories, 8)
    cate_history = pad_pre([[item_cate[i] for i in h] for h in histories], 8)
    X = {
        "user_id": torch.tensor([0, 1, 2, 3]),
        "item_id": torch.tensor(targets),
        "cate_id": torch.tensor([item_cate[t] for t in targets]),
        "click_history": click_history,
        "cate_history": cate_history,
    }
    y = torch.tensor([1.0, 1.0, 0.0, 1.0])
    with torch.no_grad():
        y_pred = model(X)["y_pred"].squeeze(-1)
        loss = F.binary_cross_entropy(y_pred, y)
    print("fixed" if FIXED else "buggy", "y_pred:", [round(v, 5) for v in y_pred.tolist()])
    print("logloss: %.6f" % loss.item())


if __name__ == "__main__":
    main()
