# GluonTS (torch TemporalFusionTransformer), awslabs/gluonts commit 8e2e909 (PR #2536, "Fix network"):
# TemporalFusionDecoder passes past_observed_values (1 = observed) straight as nn.MultiheadAttention's
# key_padding_mask (True = ignore), so the decoder attends only to MISSING past steps, plus a top-left causal attn_mask.
import sys
from typing import Optional

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class GatedLinearUnit(nn.Module):
    def __init__(self, dim: int = -1, nonlinear: bool = True):
        super().__init__()
        self.dim = dim
        self.nonlinear = nonlinear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value, gate = torch.chunk(x, chunks=2, dim=self.dim)
        if self.nonlinear:
            value = torch.tanh(value)
        gate = torch.sigmoid(gate)
        return gate * value


class GatedResidualNetwork(nn.Module):
    def __init__(self, d_hidden: int, d_input: Optional[int] = None, d_output: Optional[int] = None,
                 d_static: Optional[int] = None, dropout: float = 0.0):
        super().__init__()
        self.d_hidden = d_hidden
        self.d_input = d_input or d_hidden
        self.d_static = d_static or 0
        if d_output is None:
            self.d_output = self.d_input
            self.add_skip = False
        else:
            self.d_output = d_output
            if d_output != self.d_input:
                self.add_skip = True
                self.skip_proj = nn.Linear(in_features=self.d_input, out_features=self.d_output)
            else:
                self.add_skip = False
        self.mlp = nn.Sequential(
            nn.Linear(in_features=self.d_input + self.d_static, out_features=self.d_hidden),
            nn.ELU(),
            nn.Linear(in_features=self.d_hidden, out_features=self.d_hidden),
            nn.Dropout(p=dropout),
            nn.Linear(in_features=self.d_hidden, out_features=self.d_output * 2),
            GatedLinearUnit(nonlinear=False),
        )
        self.layer_norm = nn.LayerNorm([self.d_output])

    def forward(self, x: torch.Tensor, c: Optional[torch.Tensor] = None) -> torch.Tensor:
        skip = self.skip_proj(x) if self.add_skip else x
        if c is not None:
            x = torch.concat([x, c], dim=-1)
        x = self.mlp(x)
        return self.layer_norm(x + skip)


class TemporalFusionDecoder(nn.Module):
    def __init__(self, context_length: int, prediction_length: int, d_hidden: int, d_var: int,
                 num_heads: int, dropout: float = 0.0):
        super().__init__()
        self.context_length = context_length
        self.prediction_length = prediction_length
        self.enrich = GatedResidualNetwork(d_hidden=d_hidden, d_static=d_var, dropout=dropout)
        self.attention = nn.MultiheadAttention(embed_dim=d_hidden, num_heads=num_heads,
                                               dropout=dropout, batch_first=True)
        self.att_net = nn.Sequential(nn.Linear(in_features=d_hidden, out_features=d_hidden * 2), nn.GLU())
        self.att_lnorm = nn.LayerNorm(d_hidden)
        self.ff_net = nn.Sequential(
            GatedResidualNetwork(d_hidden=d_hidden, dropout=dropout),
            nn.Linear(in_features=d_hidden, out_features=d_hidden * 2),
            nn.GLU(),
        )
        self.ff_lnorm = nn.LayerNorm(d_hidden)
        if not FIXED:
            self.register_buffer(
                "attn_mask",
                self._generate_subsequent_mask(prediction_length, prediction_length + context_length),
            )

    @staticmethod
    def _generate_subsequent_mask(target_length: int, source_length: int) -> torch.Tensor:
        mask = (torch.triu(torch.ones(source_length, target_length)) == 1).transpose(0, 1)
        mask = mask.float().masked_fill(mask == 0, float("-inf")).masked_fill(mask == 1, float(0.0))
        return mask

    def forward(self, x, static, mask=None, causal: bool = True, return_weights=False):
        expanded_static = static.repeat((1, self.context_length + self.prediction_length, 1))
        skip = x[:, self.context_length:, ...]
        x = self.enrich(x, expanded_static)

        mask_pad = torch.ones_like(mask)[:, 0:1, ...]
        mask_pad = mask_pad.repeat((1, self.prediction_length))
        if FIXED:
            key_padding_mask = (1.0 - torch.cat((mask, mask_pad), dim=1)).bool()
        else:
            key_padding_mask = torch.cat((mask, mask_pad), dim=1).bool()

        query_key_value = x
        if FIXED:
            attn_output, weights = self.attention(
                query=query_key_value[:, self.context_length:, ...],
                key=query_key_value, value=query_key_value,
                key_padding_mask=key_padding_mask,
            )
        else:
            attn_output, weights = self.attention(
                query=query_key_value[:, self.context_length:, ...],
                key=query_key_value, value=query_key_value,
                key_padding_mask=key_padding_mask,
                attn_mask=self.attn_mask if causal else None,
            )
        att = self.att_net(attn_output)
        x = x[:, self.context_length:, ...]
        x = self.att_lnorm(x + att)
        x = self.ff_net(x)
        x = self.ff_lnorm(x + skip)
        return (x, weights) if return_weights else x


N, T, H, D = 3, 12, 4, 32
dec = TemporalFusionDecoder(context_length=T, prediction_length=H, d_hidden=D, d_var=D, num_heads=4).eval()

encoding = torch.randn(N, T + H, D)          # output of TemporalFusionEncoder [N, T + H, d_hidden]
c_enrichment = torch.randn(N, 1, D)
past_observed_values = torch.ones(N, T)
past_observed_values[:, 0] = 0.0              # first step missing in every series (imputed)
past_observed_values[1, 5] = 0.0
past_observed_values[2, 7:9] = 0.0

with torch.no_grad():
    out, w = dec(encoding, c_enrichment, past_observed_values, return_weights=True)
    # attention mass that the forecast steps put on MISSING (imputed) past values
    missing = (past_observed_values == 0).float()
    mass_missing = (w[..., :T] * missing[:, None, :]).sum(-1).mean().item()
    # reference: changing the encodings at missing steps must not change the forecast
    enc2 = encoding.clone()
    enc2[:, :T][past_observed_values == 0] += 5.0 * torch.randn_like(enc2[:, :T][past_observed_values == 0])
    out2 = dec(enc2, c_enrichment, past_observed_values)
    dep = (out - out2).abs().max().item()

print(f"attention mass on missing past steps: {mass_missing:.4f}")
print(f"max |forecast change| when only missing past steps change: {dep:.6f}")
