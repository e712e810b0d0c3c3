# PyTorchTS (pts TransformerNetwork), zalandoresearch/pytorch-ts commit d0a19ab ("use helper function to generate mask"):
# tgt_mask was a float torch.triu(ones, diagonal=1), which nn.Transformer ADDS to the logits (+1 on future steps)
# instead of blocking them, so the teacher-forced decoder sees the future; fix uses generate_square_subsequent_mask.
import sys
from typing import List

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions import StudentT

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def prod(xs):
    p = 1
    for x in xs:
        p *= x
    return p


class StudentTOutput:
    args_dim = {"df": 1, "loc": 1, "scale": 1}
    event_shape = ()

    def get_args_proj(self, in_features):
        return PtArgProj(in_features, self.args_dim, self.domain_map)

    @classmethod
    def domain_map(cls, df, loc, scale):
        scale = F.softplus(scale)
        df = 2.0 + F.softplus(df)
        return df.squeeze(-1), loc.squeeze(-1), scale.squeeze(-1)

    def distribution(self, distr_args, scale=None):
        df, loc, s = distr_args
        if scale is not None:
            loc, s = loc * scale, s * scale
        return StudentT(df, loc, s)


class PtArgProj(nn.Module):
    def __init__(self, in_features, args_dim, domain_map):
        super().__init__()
        self.proj = nn.ModuleList([nn.Linear(in_features, d) for d in args_dim.values()])
        self.domain_map = domain_map

    def forward(self, x):
        return self.domain_map(*[proj(x) for proj in self.proj])


class MeanScaler(nn.Module):
    def __init__(self, minimum_scale: float = 1e-10, keepdim: bool = False):
        super().__init__()
        self.keepdim = keepdim
        self.register_buffer("minimum_scale", torch.tensor(minimum_scale))

    def forward(self, data, observed_indicator):
        num_observed = observed_indicator.sum(dim=1)
        sum_observed = (data.abs() * observed_indicator).sum(dim=1)
        scale = sum_observed / torch.max(num_observed, torch.ones_like(num_observed))
        scale = torch.max(scale, self.minimum_scale)
        if self.keepdim:
            scale = scale.unsqueeze(1)
            return data / scale, scale
        return data / scale.unsqueeze(1), scale


class FeatureEmbedder(nn.Module):
    def __init__(self, cardinalities: List[int], embedding_dims: List[int]):
        super().__init__()
        self._embedders = nn.ModuleList([nn.Embedding(c, d) for c, d in zip(cardinalities, embedding_dims)])

    def forward(self, features):
        return torch.cat([embed(features[:, i]) for i, embed in enumerate(self._embedders)], dim=-1)


class TransformerNetwork(nn.Module):
    def __init__(self, input_size, d_model, num_heads, act_type, dropout_rate, dim_feedforward_scale,
                 num_encoder_layers, num_decoder_layers, history_length, context_length, prediction_length,
                 distr_output, cardinality, embedding_dimension, lags_seq, scaling=True):
        super().__init__()
        self.history_length = history_length
        self.context_length = context_length
        self.prediction_length = prediction_length
        self.distr_output = distr_output
        lags_seq.sort()
        self.lags_seq = lags_seq
        self.target_shape = distr_output.event_shape
        self.encoder_input = nn.Linear(input_size, d_model)
        self.decoder_input = nn.Linear(input_size, d_model)
        self.transformer = nn.Transformer(
            d_model=d_model, nhead=num_heads, num_encoder_layers=num_encoder_layers,
            num_decoder_layers=num_decoder_layers, dim_feedforward=dim_feedforward_scale * d_model,
            dropout=dropout_rate, activation=act_type,
        )
        self.proj_dist_args = distr_output.get_args_proj(d_model)
        self.embedder = FeatureEmbedder(cardinalities=cardinality, embedding_dims=embedding_dimension)
        self.scaler = MeanScaler(keepdim=True)

        # mask
        if FIXED:
            self.register_buffer("tgt_mask", self.transformer.generate_square_subsequent_mask(prediction_length))
        else:
            self.register_buffer(
                "tgt_mask", torch.triu(torch.ones((prediction_length, prediction_length)), diagonal=1)
            )

    @staticmethod
    def get_lagged_subsequences(sequence, sequence_length, indices, subsequences_length=1):
        lagged_values = []
        for lag_index in indices:
            begin_index = -lag_index - subsequences_length
            end_index = -lag_index if lag_index > 0 else None
            lagged_values.append(sequence[:, begin_index:end_index, ...])
        return torch.stack(lagged_values, dim=-1)

    def create_network_input(self, feat_static_cat, feat_static_real, past_time_feat, past_target,
                             past_observed_values, future_time_feat, future_target):
        time_feat = torch.cat((past_time_feat[:, self.history_length - self.context_length:, ...],
                               future_time_feat), dim=1)
        sequence = torch.cat((past_target, future_target), dim=1)
        sequence_length = self.history_length + self.prediction_length
        subsequences_length = self.context_length + self.prediction_length
        lags = self.get_lagged_subsequences(sequence=sequence, sequence_length=sequence_length,
                                            indices=self.lags_seq, subsequences_length=subsequences_length)
        _, scale = self.scaler(past_target[:, -self.context_length:, ...],
                               past_observed_values[:, -self.context_length:, ...])
        embedded_cat = self.embedder(feat_static_cat)
        static_feat = torch.cat((embedded_cat, feat_static_real, torch.log(scale)), dim=1)
        repeated_static_feat = static_feat.unsqueeze(1).expand(-1, subsequences_length, -1)
        lags_scaled = lags / scale.unsqueeze(-1)
        input_lags = lags_scaled.reshape((-1, subsequences_length, len(self.lags_seq) * prod(self.target_shape)))
        inputs = torch.cat((input_lags, time_feat, repeated_static_feat), dim=-1)
        return inputs, scale, static_feat


class TransformerTrainingNetwork(TransformerNetwork):
    def forward(self, feat_static_cat, feat_static_real, past_time_feat, past_target, past_observed_values,
                future_time_feat, future_target, return_args=False):
        inputs, scale, _ = self.create_network_input(feat_static_cat, feat_static_real, past_time_feat,
                                                     past_target, past_observed_values, future_time_feat,
                                                     future_target)
        enc_input = inputs[:, : self.context_length, ...]
        dec_input = inputs[:, self.context_length:, ...]
        enc_out = self.transformer.encoder(self.encoder_input(enc_input).permute(1, 0, 2))
        dec_output = self.transformer.decoder(
            self.decoder_input(dec_input).permute(1, 0, 2),
            enc_out,  # memory
            tgt_mask=self.tgt_mask,
        )
        distr_args = self.proj_dist_args(dec_output.permute(1, 0, 2))
        if return_args:
            return distr_args
        distr = self.distr_output.distribution(distr_args, scale=scale)
        loss = -distr.log_prob(future_target)
        return loss.mean()


B, C, P, lags, n_tf = 3, 8, 6, [1, 2, 3], 2
H = C + max(lags)
input_size = len(lags) + n_tf + 4 + 1 + 1          # lags + time feats + embedding + static real + log scale
net = TransformerTrainingNetwork(
    input_size=input_size, d_model=32, num_heads=4, act_type="gelu", dropout_rate=0.0, dim_feedforward_scale=2,
    num_encoder_layers=2, num_decoder_layers=2, history_length=H, context_length=C, prediction_length=P,
    distr_output=StudentTOutput(), cardinality=[5], embedding_dimension=[4], lags_seq=lags,
)

batch = dict(
    feat_static_cat=torch.randint(0, 5, (B, 1)),
    feat_static_real=torch.randn(B, 1),
    past_time_feat=torch.randn(B, H, n_tf),
    past_target=torch.randn(B, H).abs() + 1.0,
    past_observed_values=torch.ones(B, H),
    future_time_feat=torch.randn(B, P, n_tf),
    future_target=torch.randn(B, P).abs() + 1.0,
)

# one training step, the way the estimator trains it (teacher forcing)
opt = torch.optim.Adam(net.parameters(), lr=1e-3)
loss = net(**batch)
opt.zero_grad()
loss.backward()
opt.step()

net.eval()
k = 2  # perturb the target at future step k: predictions for steps 0..k must not depend on it
with torch.no_grad():
    loc_a = net(**batch, return_args=True)[1]
    b2 = dict(batch)
    b2["future_target"] = batch["future_target"].clone()
    b2["future_target"][:, k] += 10.0
    loc_b = net(**b2, return_args=True)[1]
leak = (loc_a[:, : k + 1] - loc_b[:, : k + 1]).abs().max().item()
print(f"train loss: {loss.item():.4f}")
print(f"max |change of predicted loc at steps <= {k}| after changing future target at step {k}: {leak:.6f}")
