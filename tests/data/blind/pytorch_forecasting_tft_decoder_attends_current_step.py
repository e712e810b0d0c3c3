# sktime/pytorch-forecasting#68 (commit 949bfe79): TemporalFusionTransformer.get_attention_mask says "do not
# attend to steps to self or after prediction" but built `attend_step > predict_step`, so each decoder step
# attended to itself; the fix is `attend_step >= predict_step`.
import sys
from typing import Tuple

import torch
import torch.nn as nn
from torch.nn.utils import rnn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class ScaledDotProductAttention(nn.Module):
    def __init__(self, dropout: float = None, scale: bool = True):
        super(ScaledDotProductAttention, self).__init__()
        self.dropout = nn.Dropout(p=dropout) if dropout is not None else dropout
        self.softmax = nn.Softmax(dim=2)
        self.scale = scale

    def forward(self, q, k, v, mask=None):
        attn = torch.bmm(q, k.permute(0, 2, 1))  # query-key overlap
        if self.scale:
            dimension = torch.sqrt(torch.tensor(k.shape[-1]).to(torch.float32))
            attn = attn / dimension
        if mask is not None:
            attn = attn.masked_fill(mask, -1e9)
        attn = self.softmax(attn)
        if self.dropout is not None:
            attn = self.dropout(attn)
        output = torch.bmm(attn, v)
        return output, attn


class InterpretableMultiHeadAttention(nn.Module):
    def __init__(self, n_head: int, d_model: int, dropout: float = 0.0):
        super(InterpretableMultiHeadAttention, self).__init__()
        self.n_head = n_head
        self.d_model = d_model
        self.d_k = self.d_q = self.d_v = d_model // n_head
        self.dropout = nn.Dropout(p=dropout)
        self.v_layer = nn.Linear(self.d_model, self.d_v, bias=False)
        self.q_layers = nn.ModuleList([nn.Linear(self.d_model, self.d_q, bias=False) for _ in range(self.n_head)])
        self.k_layers = nn.ModuleList([nn.Linear(self.d_model, self.d_k, bias=False) for _ in range(self.n_head)])
        self.attention = ScaledDotProductAttention()
        self.w_h = nn.Linear(self.d_v, self.d_model, bias=False)

    def forward(self, q, k, v, mask=None) -> Tuple[torch.Tensor, torch.Tensor]:
        heads, attns = [], []
        vs = self.v_layer(v)
        for i in range(self.n_head):
            qs = self.q_layers[i](q)
            ks = self.k_layers[i](k)
            head, attn = self.attention(qs, ks, vs, mask)
            heads.append(self.dropout(head))
            attns.append(attn)
        head = torch.stack(heads, dim=2) if self.n_head > 1 else heads[0]
        attn = torch.stack(attns, dim=2)
        outputs = torch.mean(head, dim=2) if self.n_head > 1 else head
        outputs = self.dropout(self.w_h(outputs))
        return outputs, attn


class TemporalFusionTransformer(nn.Module):
    """Reduced TFT: real-valued inputs, LSTM encoder/decoder, static enrichment, interpretable attention."""

    def __init__(self, n_reals_encoder=3, n_reals_decoder=2, hidden_size=16, attention_head_size=2, lstm_layers=1):
        super().__init__()
        self.lstm_layers = lstm_layers
        self.encoder_variable_selection = nn.Linear(n_reals_encoder, hidden_size)
        self.decoder_variable_selection = nn.Linear(n_reals_decoder, hidden_size)
        self.lstm_encoder = nn.LSTM(hidden_size, hidden_size, lstm_layers, batch_first=True)
        self.lstm_decoder = nn.LSTM(hidden_size, hidden_size, lstm_layers, batch_first=True)
        self.static_enrichment = nn.Linear(hidden_size, hidden_size)
        self.multihead_attn = InterpretableMultiHeadAttention(n_head=attention_head_size, d_model=hidden_size)
        self.post_attn_gate_norm = nn.LayerNorm(hidden_size)
        self.output_layer = nn.Linear(hidden_size, 1)

    @property
    def device(self):
        return next(self.parameters()).device

    def _get_mask(self, size, lengths, inverse=False):
        if inverse:  # return where values are
            return torch.arange(size, device=self.device).unsqueeze(0) < lengths.unsqueeze(-1)
        else:  # return where no values are
            return torch.arange(size, device=self.device).unsqueeze(0) >= lengths.unsqueeze(-1)

    def get_attention_mask(self, encoder_lengths: torch.LongTensor, decoder_length: int):
        """Returns causal mask to apply for self-attention layer."""
        # indices to which is attended
        attend_step = torch.arange(decoder_length, device=self.device)
        # indices for which is predicted
        predict_step = torch.arange(0, decoder_length, device=self.device)[:, None]
        # do not attend to steps to self or after prediction
        if FIXED:
            decoder_mask = attend_step >= predict_step
        else:
            decoder_mask = attend_step > predict_step
        # do not attend to steps where data is padded
        encoder_mask = self._get_mask(encoder_lengths.max(), encoder_lengths)
        # combine masks along attended time - first encoder and then decoder
        mask = torch.cat(
            (
                encoder_mask.unsqueeze(1).expand(-1, decoder_length, -1),
                decoder_mask.unsqueeze(0).expand(encoder_lengths.size(0), -1, -1),
            ),
            dim=2,
        )
        return mask

    def forward(self, x):
        encoder_lengths = x["encoder_lengths"]
        max_encoder_length = int(encoder_lengths.max())
        timesteps = max_encoder_length + x["decoder_cont"].size(1)
        embeddings_varying_encoder = self.encoder_variable_selection(x["encoder_cont"])
        embeddings_varying_decoder = self.decoder_variable_selection(x["decoder_cont"])
        encoder_output, (hidden, cell) = self.lstm_encoder(
            rnn.pack_padded_sequence(embeddings_varying_encoder, encoder_lengths, enforce_sorted=False, batch_first=True)
        )
        encoder_output, _ = rnn.pad_packed_sequence(encoder_output, batch_first=True, total_length=max_encoder_length)
        decoder_output, _ = self.lstm_decoder(embeddings_varying_decoder, (hidden, cell))
        lstm_output = torch.cat([encoder_output, decoder_output], dim=1)
        attn_input = self.static_enrichment(lstm_output)

        # Attention
        attn_output, attn_output_weights = self.multihead_attn(
            q=attn_input[:, max_encoder_length:],  # query only for predictions
            k=attn_input,
            v=attn_input,
            mask=self.get_attention_mask(encoder_lengths=encoder_lengths, decoder_length=timesteps - max_encoder_length),
        )
        output = self.post_attn_gate_norm(attn_output + attn_input[:, max_encoder_length:])
        return dict(prediction=self.output_layer(output), attention=attn_output_weights, encoder_lengths=encoder_lengths)


model = TemporalFusionTransformer().eval()
batch_size, max_encoder_length, max_prediction_length = 3, 8, 4
x = {
    "encoder_cont": torch.randn(batch_size, max_encoder_length, 3),
    "decoder_cont": torch.randn(batch_size, max_prediction_length, 2),
    "encoder_lengths": torch.tensor([8, 6, 5]),
    "decoder_lengths": torch.tensor([4, 4, 4]),
}
with torch.no_grad():
    out = model(x)

# attention: batch x decoder step x heads x attended time (encoder then decoder)
att = out["attention"].mean(2)
self_weight = torch.stack([att[:, t, max_encoder_length + t] for t in range(max_prediction_length)], dim=1)
print("mode:", "fixed" if FIXED else "buggy")
print("attention of each prediction step on its own step (sample 0):", [round(v, 4) for v in self_weight[0].tolist()])
print("prediction (sample 0):", [round(v, 4) for v in out["prediction"][0, :, 0].tolist()])
