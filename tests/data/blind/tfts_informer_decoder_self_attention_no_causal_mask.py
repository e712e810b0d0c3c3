# LongxingTan/Time-series-prediction (tfts) commit 1e3651a, "Fix casual mask for transformer decoder (#33)".
# tfts/models/informer.py: Informer.__call__ ran its decoder as self.decoder(decoder_feature, memory=memory),
# so DecoderLayer's first attention (attn1, self-attention over the decoder's horizon features) got
# x_mask=None and every forecast step attended to every later step of the horizon.
# The fix builds CausalMask(B * num_heads, L) (a [B*H, L, L] band_part triangle, heads split onto the batch
# axis as FullAttention does) and passes it as x_mask. FullAttention applies a mask as `score * mask`,
# as the project writes it. Ported from TensorFlow/Keras to torch, names and layout kept.
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)

params = {
    "n_encoder_layers": 1,
    "n_decoder_layers": 1,
    "attention_hidden_sizes": 32 * 1,
    "num_heads": 2,
    "attention_dropout": 0.0,
    "ffn_hidden_sizes": 32 * 1,
    "ffn_filter_sizes": 32 * 1,
    "ffn_dropout": 0.0,
    "skip_connect_circle": False,
    "skip_connect_mean": False,
    "prob_attention": False,
    "distil_conv": False,
}


class CausalMask:
    """Casual Mask is used for transformer decoder, used in first self-attention for decoder feature"""

    def __init__(self, B, L):
        mask_shape = [B, L, L]  # for multi-heads split [B, 1, L, L]
        mask_a = torch.triu(torch.ones(mask_shape))  # band_part(ones, 0, -1): upper triangular 0s and 1s
        mask_b = torch.triu(torch.tril(torch.ones(mask_shape)))  # band_part(ones, 0, 0): diagonal 0s and 1s
        mask = (mask_a - mask_b).float()
        self._mask = mask.detach()

    @property
    def mask(self):
        return self._mask


class TokenEmbedding(nn.Module):
    def __init__(self, input_dim, embed_size):
        super().__init__()
        self.token_weights = nn.Parameter(torch.randn(input_dim, embed_size) * embed_size**-0.5)

    def forward(self, x):
        return torch.einsum("bsf,fk->bsk", x, self.token_weights)


class FullAttention(nn.Module):
    """Multi-head attention layer"""

    def __init__(self, hidden_size, num_heads, attention_dropout=0.0):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.dense_q = nn.Linear(hidden_size, hidden_size, bias=False)
        self.dense_k = nn.Linear(hidden_size, hidden_size, bias=False)
        self.dense_v = nn.Linear(hidden_size, hidden_size, bias=False)
        self.dropout = nn.Dropout(attention_dropout)

    def forward(self, q, k, v, mask=None):
        q = self.dense_q(q)
        k = self.dense_k(k)
        v = self.dense_v(v)

        # tf.concat(tf.split(q, num_heads, axis=2), axis=0): multi-heads transfer to multi-sample
        q_ = torch.cat(torch.chunk(q, self.num_heads, dim=2), dim=0)
        k_ = torch.cat(torch.chunk(k, self.num_heads, dim=2), dim=0)
        v_ = torch.cat(torch.chunk(v, self.num_heads, dim=2), dim=0)

        score = torch.matmul(q_, k_.transpose(1, 2))  # => (batch * heads) * seq_q * seq_k
        score = score / float(q_.shape[-1]) ** 0.5

        if mask is not None:
            score = score * mask.float()

        score = torch.softmax(score, dim=-1)
        score = self.dropout(score)

        outputs = torch.matmul(score, v_)  # (batch * heads) * seq_q * units
        outputs = torch.cat(torch.chunk(outputs, self.num_heads, dim=0), dim=2)
        return outputs


class EncoderLayer(nn.Module):
    def __init__(self, attn_layer, attention_hidden_sizes, ffn_hidden_sizes, ffn_dropout):
        super().__init__()
        self.attn_layer = attn_layer
        self.drop = nn.Dropout(ffn_dropout)
        self.norm1 = nn.LayerNorm(attention_hidden_sizes)
        self.conv1 = nn.Linear(attention_hidden_sizes, ffn_hidden_sizes)  # Conv1D kernel_size=1
        self.conv2 = nn.Linear(ffn_hidden_sizes, attention_hidden_sizes)
        self.norm2 = nn.LayerNorm(attention_hidden_sizes)

    def forward(self, x, mask=None):
        input = x
        x = self.attn_layer(x, x, x, mask)
        x = self.drop(x)
        x = x + input
        y = x = self.norm1(x)
        y = self.conv1(y)
        y = self.drop(y)
        y = self.conv2(y)
        y = self.drop(y)
        y = x + y
        return self.norm2(y)


class Encoder(nn.Module):
    def __init__(self, layers, norm_layer=None):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm_layer = norm_layer

    def forward(self, x, mask=None):
        for attn_layer in self.layers:
            x = attn_layer(x, mask)
        if self.norm_layer is not None:
            x = self.norm_layer(x)
        return x


class DecoderLayer(nn.Module):
    def __init__(self, attn_layer1, attn_layer2, attention_hidden_sizes, ffn_hidden_sizes, ffn_dropout):
        super().__init__()
        self.attn1 = attn_layer1
        self.attn2 = attn_layer2
        self.conv1 = nn.Linear(attention_hidden_sizes, ffn_hidden_sizes)
        self.conv2 = nn.Linear(ffn_hidden_sizes, attention_hidden_sizes)
        self.drop = nn.Dropout(ffn_dropout)
        self.norm1 = nn.LayerNorm(attention_hidden_sizes)
        self.norm2 = nn.LayerNorm(attention_hidden_sizes)
        self.norm3 = nn.LayerNorm(attention_hidden_sizes)
        self.activation = nn.ReLU()

    def forward(self, x, memory=None, x_mask=None, memory_mask=None):
        x0 = x
        x = self.attn1(x, x, x, mask=x_mask)
        x = self.drop(x)
        x = x + x0
        x = self.norm1(x)

        x1 = x
        x = self.attn2(x, memory, memory, mask=memory_mask)
        x = self.drop(x)
        x = x + x1
        x = self.norm2(x)

        x2 = x
        x = self.conv1(x)
        x = self.activation(x)
        x = self.drop(x)
        x = self.conv2(x)
        x = x + x2
        return self.norm3(x)


class Decoder(nn.Module):
    def __init__(self, layers, norm_layer=None):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = norm_layer

    def forward(self, x, memory=None, x_mask=None, memory_mask=None):
        for layer in self.layers:
            x = layer(x, memory, x_mask, memory_mask)
        if self.norm is not None:
            x = self.norm(x)
        return x


class Informer(nn.Module):
    """Informer model for time series"""

    def __init__(self, predict_sequence_length, encoder_dim, decoder_dim, custom_model_params=None):
        super().__init__()
        if custom_model_params:
            params.update(custom_model_params)
        self.params = params
        self.predict_sequence_length = predict_sequence_length
        h = params["attention_hidden_sizes"]
        self.encoder_embedding = TokenEmbedding(encoder_dim, h)
        self.decoder_embedding = TokenEmbedding(decoder_dim, h)
        self.encoder = Encoder(
            layers=[
                EncoderLayer(
                    FullAttention(h, params["num_heads"], params["attention_dropout"]),
                    h,
                    params["ffn_hidden_sizes"],
                    params["ffn_dropout"],
                )
                for _ in range(params["n_encoder_layers"])
            ],
            norm_layer=nn.LayerNorm(h),
        )
        self.decoder = Decoder(
            layers=[
                DecoderLayer(
                    attn_layer1=FullAttention(h, params["num_heads"], params["attention_dropout"]),
                    attn_layer2=FullAttention(h, params["num_heads"], params["attention_dropout"]),
                    attention_hidden_sizes=h,
                    ffn_hidden_sizes=params["ffn_hidden_sizes"],
                    ffn_dropout=params["ffn_dropout"],
                )
                for _ in range(params["n_decoder_layers"])
            ]
        )
        self.projection = nn.Linear(h, 1)

    def forward(self, inputs):
        x, encoder_feature, decoder_feature = inputs
        encoder_feature = torch.cat([x, encoder_feature], dim=-1)

        encoder_feature = self.encoder_embedding(encoder_feature)  # batch * seq * embedding_size
        memory = self.encoder(encoder_feature, mask=None)

        if FIXED:
            B, L, _ = decoder_feature.shape
            casual_mask = CausalMask(B * self.params["num_heads"], L).mask
            decoder_feature = self.decoder_embedding(decoder_feature)
            outputs = self.decoder(decoder_feature, memory=memory, x_mask=casual_mask)
        else:
            decoder_feature = self.decoder_embedding(decoder_feature)
            outputs = self.decoder(decoder_feature, memory=memory)
        outputs = self.projection(outputs)
        return outputs


def main():
    train_length, predict_length, batch = 24, 8, 3
    t = torch.arange(train_length + predict_length, dtype=torch.float32)
    phase = torch.rand(batch, 1)
    series = torch.sin(0.3 * t[None, :] + 6.28 * phase)  # sine demo data, as examples/run_prediction.py
    x = series[:, :train_length, None]
    encoder_feature = torch.stack([torch.cos(0.3 * t[:train_length])] * batch)[..., None]
    # known future covariates over the horizon (time features)
    decoder_feature = torch.stack(
        [torch.stack([t[train_length:] / 10.0, torch.cos(0.3 * t[train_length:])], dim=-1)] * batch
    )
    y = series[:, train_length:, None]

    model = Informer(predict_length, encoder_dim=2, decoder_dim=2)
    model.eval()
    with torch.no_grad():
        pred = model((x, encoder_feature, decoder_feature))
        loss = torch.mean((pred - y) ** 2)
    print("mode:", "fixed" if FIXED else "buggy")
    print("first horizon step predictions:", [round(v, 5) for v in pred[:, 0, 0].tolist()])
    print("mse:", round(loss.item(), 6))


if __name__ == "__main__":
    main()
