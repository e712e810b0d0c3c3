# datawhalechina/torch-rechub commit b0c1516 ("Refactor BST transformer"): BST ran nn.TransformerEncoder over
# [zero-padded behaviour history, target item] with no src_key_padding_mask, so real items and the target attended
# to the padding slots; the fix builds a padding mask from the history ids (pad id) and passes it to the encoder.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class SparseFeature:
    def __init__(self, name, vocab_size, embed_dim=8, shared_with=None, padding_idx=None):
        self.name, self.vocab_size, self.embed_dim = name, vocab_size, embed_dim
        self.shared_with, self.padding_idx = shared_with, padding_idx


class SequenceFeature(SparseFeature):
    def __init__(self, name, vocab_size, embed_dim=8, pooling="concat", shared_with=None, padding_idx=None):
        super().__init__(name, vocab_size, embed_dim, shared_with, padding_idx)
        self.pooling = pooling


class EmbeddingLayer(nn.Module):
    def __init__(self, features):
        super().__init__()
        self.embed_dict = nn.ModuleDict()
        for fea in features:
            if fea.shared_with is None and fea.name not in self.embed_dict:
                self.embed_dict[fea.name] = nn.Embedding(fea.vocab_size, fea.embed_dim, padding_idx=fea.padding_idx)

    def forward(self, x, features):
        embs = []
        for fea in features:
            table = self.embed_dict[fea.shared_with or fea.name]
            # SparseFeature -> (batch_size, 1, emb_dim); SequenceFeature pooling="concat" -> (batch_size, 1, seq_length, emb_dim)
            embs.append(table(x[fea.name].long()).unsqueeze(1))
        return torch.cat(embs, dim=1)


class MLP(nn.Module):
    def __init__(self, input_dim, output_layer=True, dims=(), dropout=0.0, activation="relu"):
        super().__init__()
        layers = []
        for d in dims:
            layers += [nn.Linear(input_dim, d), nn.BatchNorm1d(d), nn.ReLU(), nn.Dropout(dropout)]
            input_dim = d
        if output_layer:
            layers.append(nn.Linear(input_dim, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, x):
        return self.mlp(x)


class BST(nn.Module):
    """Behavior Sequence Transformer (torch_rechub/models/ranking/bst.py)."""

    def __init__(self, features, history_features, target_features, mlp_params, nhead=8, dropout=0.2, num_layers=1, max_seq_len=51):
        super(BST, self).__init__()
        self.features = features
        self.history_features = history_features
        self.target_features = target_features
        self.num_history_features = len(history_features)
        self.embed_dim = history_features[0].embed_dim
        self.max_seq_len = max_seq_len
        self.item_dim = sum([fea.embed_dim for fea in history_features])
        self.embedding = EmbeddingLayer(features + history_features + target_features)
        if FIXED:
            self.all_dims = sum([fea.embed_dim for fea in features + target_features]) + self.item_dim
            self.pos_embedding = nn.Embedding(max_seq_len, self.item_dim)
            encoder_layer = nn.TransformerEncoderLayer(d_model=self.item_dim, nhead=nhead, dropout=dropout, activation=nn.LeakyReLU(), batch_first=True)
        else:
            self.all_dims = sum([fea.embed_dim for fea in features + history_features + target_features])
            encoder_layer = nn.TransformerEncoderLayer(d_model=self.embed_dim, nhead=nhead, dropout=dropout, batch_first=True)
        self.transformer_layers = nn.TransformerEncoder(encoder_layer, num_layers=num_layers)
        self.mlp = MLP(self.all_dims, **mlp_params)

    def forward(self, x):
        embed_x_features = self.embedding(x, self.features)  # (batch_size, num_features, emb_dim)
        embed_x_history = self.embedding(x, self.history_features)  # (batch_size, num_history_features, seq_length, emb_dim)
        embed_x_target = self.embedding(x, self.target_features)  # (batch_size, num_target_features, emb_dim)
        if not FIXED:
            transformer_pooling = []
            for i in range(self.num_history_features):
                # (batch_size, seq_length + num_target_features, emb_dim)
                transformer_seq = self.transformer_layers(torch.cat([embed_x_history[:, i, :, :], embed_x_target], dim=1))
                transformer_pooling.append(torch.mean(transformer_seq, dim=1).unsqueeze(1))
            transformer_pooling = torch.cat(transformer_pooling, dim=1)
            mlp_in = torch.cat([transformer_pooling.flatten(start_dim=1), embed_x_target.flatten(start_dim=1), embed_x_features.flatten(start_dim=1)], dim=1)
            return torch.sigmoid(self.mlp(mlp_in).squeeze(1))

        hist = torch.cat([embed_x_history[:, i] for i in range(len(self.history_features))], dim=-1)
        tgt = torch.cat([embed_x_target[:, i] for i in range(len(self.target_features))], dim=-1)
        seq = torch.cat([hist, tgt.unsqueeze(1)], dim=1)  # append target at end of sequence: [B, T+1, item_dim]
        positions = torch.arange(seq.size(1), device=seq.device).unsqueeze(0)
        seq = seq + self.pos_embedding(positions)
        # padding mask: a position is padding only if ALL history features are padding there
        pad_mask = torch.ones(embed_x_history.size(0), embed_x_history.size(2), dtype=torch.bool, device=embed_x_history.device)
        for fea in self.history_features:
            pidx = fea.padding_idx if fea.padding_idx is not None else 0
            pad_mask = pad_mask & (x[fea.name].long() == pidx)
        tgt_mask = torch.zeros(pad_mask.size(0), 1, dtype=torch.bool, device=pad_mask.device)
        src_key_padding_mask = torch.cat([pad_mask, tgt_mask], dim=1)  # [B, T+1]
        out = self.transformer_layers(seq, src_key_padding_mask=src_key_padding_mask)
        interest = out[:, -1, :]  # take target position output as interest representation
        mlp_in = torch.cat([interest, embed_x_target.flatten(start_dim=1), embed_x_features.flatten(start_dim=1)], dim=1)
        return torch.sigmoid(self.mlp(mlp_in).squeeze(1))


n_items, seq_len = 50, 8
features = [SparseFeature("user_id", 20, embed_dim=8), SparseFeature("gender", 3, embed_dim=8)]
history_features = [SequenceFeature("hist_movie_id", n_items, embed_dim=8, pooling="concat", shared_with="movie_id", padding_idx=0)]
target_features = [SparseFeature("movie_id", n_items, embed_dim=8, padding_idx=0)]
model = BST(features, history_features, target_features, mlp_params={"dims": [16], "dropout": 0.0}, nhead=2, dropout=0.0, max_seq_len=seq_len + 1)

# pad_sequences(..., padding="post", value=0): users with 8, 3 and 5 watched movies
hist = torch.zeros(3, seq_len, dtype=torch.long)
for b, n in enumerate([8, 3, 5]):
    hist[b, :n] = torch.randint(1, n_items, (n,))
x = {"user_id": torch.tensor([1, 2, 3]), "gender": torch.tensor([0, 1, 2]), "hist_movie_id": hist, "movie_id": torch.tensor([7, 11, 13])}
y = torch.tensor([1.0, 0.0, 1.0])

model.train()  # one training step on the padded batch
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
pred = model(x)
loss = nn.BCELoss()(pred, y)
optimizer.zero_grad()
loss.backward()
optimizer.step()
print("mode:", "fixed" if FIXED else "buggy")
print("history lengths [8, 3, 5], padded slots per user:", (hist == 0).sum(1).tolist())
print("predicted CTR:", [round(v, 4) for v in pred.tolist()], "loss: %.4f" % loss.item())
