# datawhalechina/torch-rechub PR #195, commit 199e591 ("Refactor BST transformer handling", diff of
# torch_rechub/models/ranking/bst.py read). BST built nn.TransformerEncoderLayer without batch_first=True but fed it
# (batch, seq_len + num_targets, emb) tensors, so self-attention ran over the batch axis: each behaviour attended to
# the same slot of the other users in the batch instead of to its own history and target item.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class SparseFeature(object):
    def __init__(self, name, vocab_size, embed_dim=None, shared_with=None):
        self.name = name
        self.vocab_size = vocab_size
        self.embed_dim = embed_dim
        self.shared_with = shared_with

    def get_embedding_layer(self):
        return nn.Embedding(self.vocab_size, self.embed_dim)


class SequenceFeature(SparseFeature):
    def __init__(self, name, vocab_size, embed_dim=None, pooling="mean", shared_with=None, padding_idx=None):
        super().__init__(name, vocab_size, embed_dim, shared_with)
        self.pooling = pooling
        self.padding_idx = padding_idx


class ConcatPooling(nn.Module):
    def forward(self, x, mask=None):
        return x


class EmbeddingLayer(nn.Module):
    def __init__(self, features):
        super().__init__()
        self.features = features
        self.embed_dict = nn.ModuleDict()
        for fea in features:
            if fea.name in self.embed_dict:  # exist
                continue
            if fea.shared_with is None:
                self.embed_dict[fea.name] = fea.get_embedding_layer()

    def forward(self, x, features):
        sparse_emb = []
        for fea in features:
            if isinstance(fea, SequenceFeature):
                pooling_layer = ConcatPooling()
                if fea.shared_with is None:
                    sparse_emb.append(pooling_layer(self.embed_dict[fea.name](x[fea.name].long())).unsqueeze(1))
                else:
                    sparse_emb.append(pooling_layer(self.embed_dict[fea.shared_with](x[fea.name].long())).unsqueeze(1))
            else:
                if fea.shared_with is None:
                    sparse_emb.append(self.embed_dict[fea.name](x[fea.name].long()).unsqueeze(1))
                else:
                    sparse_emb.append(self.embed_dict[fea.shared_with](x[fea.name].long()).unsqueeze(1))
        return torch.cat(sparse_emb, dim=1)  # [batch_size, num_features, embed_dim]


class MLP(nn.Module):
    def __init__(self, input_dim, output_layer=True, dims=None, dropout=0, activation="relu"):
        super().__init__()
        if dims is None:
            dims = []
        act = nn.LeakyReLU if activation == "leakyrelu" else nn.ReLU
        layers = list()
        for i_dim in dims:
            layers.append(nn.Linear(input_dim, i_dim))
            layers.append(nn.BatchNorm1d(i_dim))
            layers.append(act())
            layers.append(nn.Dropout(p=dropout))
            input_dim = i_dim
        if output_layer:
            layers.append(nn.Linear(input_dim, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, x):
        return self.mlp(x)


class BST(nn.Module):
    def __init__(self, features, history_features, target_features, mlp_params, nhead=8, dropout=0.2, num_layers=1):
        super(BST, self).__init__()
        self.features = features
        self.history_features = history_features
        self.target_features = target_features
        self.nhead = nhead
        self.dropout = dropout
        self.num_layers = num_layers
        self.num_history_features = len(history_features)
        if FIXED:
            self.embed_dim = history_features[0].embed_dim
            self.all_dims = sum([fea.embed_dim for fea in features + history_features + target_features])
        else:
            self.embed_dim = target_features[0].embed_dim
            self.seq_len = 50
            self.all_dims = (len(features) + len(history_features) * (self.seq_len + len(target_features))) * self.embed_dim
        self.embedding = EmbeddingLayer(features + history_features + target_features)
        if FIXED:
            self.encoder_layer = nn.TransformerEncoderLayer(
                d_model=self.embed_dim,
                nhead=nhead,
                dropout=dropout,
                batch_first=True,
            )
        else:
            self.encoder_layer = nn.TransformerEncoderLayer(d_model=self.embed_dim, nhead=nhead, dropout=dropout)
        self.transformer_layers = nn.TransformerEncoder(self.encoder_layer, num_layers=num_layers)
        if FIXED:
            self.mlp = MLP(self.all_dims, **mlp_params)
        else:
            self.mlp = MLP(self.all_dims, activation="leakyrelu", **mlp_params)

    def forward(self, x):
        # (batch_size, num_features, emb_dim)
        embed_x_features = self.embedding(x, self.features)
        # (batch_size, num_history_features, seq_length, emb_dim)
        embed_x_history = self.embedding(x, self.history_features)
        # (batch_size, num_target_features, emb_dim)
        embed_x_target = self.embedding(x, self.target_features)
        if FIXED:
            transformer_pooling = []
            for i in range(self.num_history_features):
                # (batch_size, seq_length + num_target_features, emb_dim)
                transformer_seq = self.transformer_layers(torch.cat([embed_x_history[:, i, :, :], embed_x_target], dim=1))
                # (batch_size, emb_dim)
                transformer_pooling.append(torch.mean(transformer_seq, dim=1).unsqueeze(1))
            # (batch_size, num_history_features, emb_dim)
            transformer_pooling = torch.cat(transformer_pooling, dim=1)
            mlp_in = torch.cat([transformer_pooling.flatten(start_dim=1), embed_x_target.flatten(start_dim=1), embed_x_features.flatten(start_dim=1)], dim=1)  # (batch_size, N)
        else:
            attention_pooling = []
            for i in range(self.num_history_features):
                attention_seq = self.transformer_layers(torch.cat([torch.squeeze(embed_x_history[:, i, :, :], 1), embed_x_target], dim=1))
                # (batch_size, seq_length + num_target_features, emb_dim)
                attention_pooling.append(attention_seq)
            # (batch_size, num_history_features * (seq_length + num_target_features), emb_dim)
            attention_pooling = torch.cat(attention_pooling, dim=1)
            mlp_in = torch.cat([attention_pooling.flatten(start_dim=1), embed_x_features.flatten(start_dim=1)], dim=1)  # (batch_size, N)
        y = self.mlp(mlp_in)
        return torch.sigmoid(y.squeeze(1))


# examples/ranking: user profile features + item-id behaviour sequence, target item shares the item table
n_users, n_items, seq_len, batch_size, embed_dim = 100, 200, 50, 16, 16
features = [SparseFeature("user_id", vocab_size=n_users, embed_dim=embed_dim),
            SparseFeature("gender", vocab_size=3, embed_dim=embed_dim)]
history_features = [SequenceFeature("hist_item_id", vocab_size=n_items, embed_dim=embed_dim, pooling="concat",
                                    shared_with="target_item_id", padding_idx=0)]
target_features = [SparseFeature("target_item_id", vocab_size=n_items, embed_dim=embed_dim)]

model = BST(features=features, history_features=history_features, target_features=target_features,
            mlp_params={"dims": [64, 32]}, nhead=8, dropout=0.0, num_layers=1)

lengths = torch.randint(5, seq_len + 1, (batch_size,))
hist = torch.zeros(batch_size, seq_len, dtype=torch.long)
for b, n in enumerate(lengths.tolist()):
    hist[b, seq_len - n:] = torch.randint(1, n_items, (n,))  # pad_sequences(padding="pre")
x = {"user_id": torch.randint(0, n_users, (batch_size,)),
     "gender": torch.randint(0, 3, (batch_size,)),
     "hist_item_id": hist,
     "target_item_id": torch.randint(1, n_items, (batch_size,))}
y = torch.randint(0, 2, (batch_size,)).float()

optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
model.train()
loss_fn = nn.BCELoss()
for step in range(3):
    y_pred = model(x)
    loss = loss_fn(y_pred, y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print("BST fixed=%s loss %.5f" % (FIXED, loss.item()))
