# DeepTab (OpenTabular/DeepTab commit d2abc5a, "use batch_first attention to prevent cross-sample leakage"): the
# FT-Transformer's CustomTransformerEncoderLayer built nn.TransformerEncoderLayer without batch_first=True while being fed
# (batch, n_features, d_model) tokens, so self-attention ran over the batch axis: each row attended to the other rows.
import sys
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
warnings.filterwarnings("ignore")
torch.manual_seed(0)


class FTTransformerConfig:
    d_model = 32
    n_heads = 4
    n_layers = 2
    transformer_dim_feedforward = 64
    attn_dropout = 0.0
    transformer_activation = staticmethod(F.relu)
    layer_norm_eps = 1e-5
    norm_first = False
    bias = True
    pooling_method = "avg"


class CustomTransformerEncoderLayer(nn.TransformerEncoderLayer):
    def __init__(self, config):
        kwargs = dict(batch_first=True) if FIXED else {}
        super().__init__(
            d_model=getattr(config, "d_model", 128),
            nhead=getattr(config, "n_heads", 8),
            dim_feedforward=getattr(config, "transformer_dim_feedforward", 2048),
            dropout=getattr(config, "attn_dropout", 0.1),
            activation=getattr(config, "transformer_activation", F.relu),
            layer_norm_eps=getattr(config, "layer_norm_eps", 1e-5),
            norm_first=getattr(config, "norm_first", False),
            **kwargs,
        )
        self.bias = getattr(config, "bias", True)
        self.custom_activation = getattr(config, "transformer_activation", F.relu)

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal=False):
        src2 = self.self_attn(src, src, src, attn_mask=src_mask, key_padding_mask=src_key_padding_mask)[0]
        src = src + self.dropout1(src2)
        src = self.norm1(src)
        src2 = self.linear2(self.custom_activation(self.linear1(src)))
        src = src + self.dropout2(src2)
        src = self.norm2(src)
        return src


class EmbeddingLayer(nn.Module):
    """Trimmed: one linear embedding per numerical feature, one table per categorical feature -> (B, F, d_model)."""

    def __init__(self, n_num, cat_cardinalities, config):
        super().__init__()
        self.num_embeddings = nn.ModuleList([nn.Linear(1, config.d_model) for _ in range(n_num)])
        self.cat_embeddings = nn.ModuleList([nn.Embedding(c, config.d_model) for c in cat_cardinalities])

    def forward(self, num_features, cat_features):
        num = [emb(num_features[:, i : i + 1]) for i, emb in enumerate(self.num_embeddings)]
        cat = [emb(cat_features[:, i]) for i, emb in enumerate(self.cat_embeddings)]
        return torch.stack(num + cat, dim=1)


class FTTransformer(nn.Module):
    def __init__(self, n_num=3, cat_cardinalities=(4, 6), num_classes=1, config=FTTransformerConfig()):
        super().__init__()
        self.embedding_layer = EmbeddingLayer(n_num, cat_cardinalities, config)
        self.norm_f = nn.LayerNorm(config.d_model)
        encoder_layer = CustomTransformerEncoderLayer(config=config)
        extra = dict(enable_nested_tensor=False) if FIXED else {}
        self.encoder = nn.TransformerEncoder(encoder_layer, num_layers=config.n_layers, norm=self.norm_f, **extra)
        self.tabular_head = nn.Linear(config.d_model, num_classes)

    def pool_sequence(self, x):
        return x.mean(dim=1)  # pooling_method == "avg"

    def forward(self, *data):
        x = self.embedding_layer(*data)
        x = self.encoder(x)
        x = self.pool_sequence(x)
        if self.norm_f is not None:
            x = self.norm_f(x)
        return self.tabular_head(x)


model = FTTransformer().eval()
B = 3
num = torch.randn(B, 3)
cat = torch.stack([torch.randint(0, 4, (B,)), torch.randint(0, 6, (B,))], dim=1)
with torch.no_grad():
    batched = model(num, cat)
    alone = torch.cat([model(num[i : i + 1], cat[i : i + 1]) for i in range(B)])
print(f"max |batched - one row at a time| predictions: {(batched - alone).abs().max().item():.3e}")
