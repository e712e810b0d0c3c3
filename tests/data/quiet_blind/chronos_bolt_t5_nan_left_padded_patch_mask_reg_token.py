"""Chronos-Bolt: NaN left-padded contexts, patch-level attention mask, [REG] token, T5 encoder-decoder.

Follows amazon-science/chronos-forecasting src/chronos/chronos_bolt.py:
  ChronosBoltPipeline / left_pad_and_stack_1D: series of different lengths left-padded with NaN
  InstanceNorm.forward: loc = nanmean, scale = sqrt(nanmean((x - loc)^2)), NaN kept
  Patch.forward: left-pad with NaN to a multiple of patch_size, unfold into patches
  ChronosBoltModelForForecasting.encode: mask = ~isnan(context); context = where(mask, context, 0);
      patched_mask; input = cat(patched_context, patched_mask) -> input_patch_embedding (ResidualBlock);
      attention_mask = patched_mask.sum(-1) > 0; [REG] token appended with mask 1; T5 encoder with attention_mask
  ChronosBoltModelForForecasting.decode: one decoder token (id 0) cross-attending the encoder under the same
      attention_mask; output_patch_embedding -> quantiles, de-normalised with loc/scale
The T5 is transformers' T5Model built from T5Config (2+2 layers, d_model 32), used through inputs_embeds,
never from_pretrained. float64.
Reduced: 3 series of 45, 29 and 12 steps, patch 8, 3 quantiles, horizon 8.
Reference: each series alone (padded only to its own multiple of 8). T5's relative position buckets depend on
differences only, and whole-NaN patches are hidden keys, so forecasts must match.
"""
import torch
import torch.nn as nn
from transformers import T5Config, T5Model

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)

P, D, H_OUT, Q = 8, 32, 8, 3
config = T5Config(vocab_size=2, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                  relative_attention_num_buckets=8, relative_attention_max_distance=32, dropout_rate=0.0,
                  pad_token_id=0, decoder_start_token_id=0, feed_forward_proj="relu")
config._attn_implementation = "sdpa"


class ResidualBlock(nn.Module):
    def __init__(self, i, h, o):
        super().__init__()
        self.hidden, self.out, self.res = nn.Linear(i, h), nn.Linear(h, o), nn.Linear(i, o)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(x))) + self.res(x)


class TinyChronosBolt(nn.Module):
    def __init__(self):
        super().__init__()
        self.t5 = T5Model(config)
        self.input_patch_embedding = ResidualBlock(2 * P, 64, D)
        self.reg = nn.Parameter(torch.randn(D))
        self.output_patch_embedding = ResidualBlock(D, 64, Q * H_OUT)

    def forward(self, context):
        loc = torch.nanmean(context, dim=-1, keepdim=True)
        scale = torch.nanmean((context - loc).square(), dim=-1, keepdim=True).sqrt()
        context = (context - loc) / scale
        pad = (-context.shape[-1]) % P                       # Patch: left-pad with NaN to a multiple of P
        context = torch.cat([torch.full((context.shape[0], pad), float("nan")), context], -1)
        mask = ~torch.isnan(context)
        context = torch.where(mask, context, 0.0)
        pc = context.unfold(-1, P, P)
        pm = mask.double().unfold(-1, P, P)
        embeds = self.input_patch_embedding(torch.cat([pc, pm], -1))
        attention_mask = (pm.sum(-1) > 0).long()
        embeds = torch.cat([embeds, self.reg.expand(embeds.shape[0], 1, D)], 1)
        attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], 1)
        out = self.t5(inputs_embeds=embeds, attention_mask=attention_mask,
                      decoder_input_ids=torch.zeros(embeds.shape[0], 1, dtype=torch.long))
        q = self.output_patch_embedding(out.last_hidden_state[:, 0]).view(-1, Q, H_OUT)
        return q * scale.unsqueeze(-1) + loc.unsqueeze(-1), out.encoder_last_hidden_state, attention_mask


def left_pad_and_stack_1D(tensors):
    n = max(len(t) for t in tensors)
    return torch.stack([torch.cat([torch.full((n - len(t),), float("nan")), t]) for t in tensors])


t = torch.arange(45, dtype=torch.float64)
series = [10 + torch.sin(t[:n] / 3) * 4 + torch.randn(n) for n in (45, 29, 12)]
model = TinyChronosBolt().eval()
with torch.no_grad():
    batch = left_pad_and_stack_1D(series)
    fc, enc, am = model(batch)
    max_diff = 0.0
    for i, s in enumerate(series):
        f1, e1, am1 = model(s.unsqueeze(0))
        n_tok = am1.shape[1]
        assert am[i, -n_tok:].tolist() == am1[0].tolist() and am[i, :-n_tok].sum() == 0
        max_diff = max(max_diff, (fc[i] - f1[0]).abs().max().item(),
                       (enc[i, -n_tok:] - e1[0]).abs().max().item())

print("patch attention_mask", am.tolist())
print("median forecast", fc[:, Q // 2].round(decimals=2).tolist())
print("max |NaN left-padded batch - alone|:", max_diff)
assert max_diff < 1e-10
