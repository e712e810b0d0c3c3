# unit8co/darts#1392 (commit 071c7e8, "Add TFTExplainer"); CHANGELOG: "Fixed an issue when using
# `TFTModel.predict()` with `full_attention=True` where the attention mask was not applied properly."
#
# darts' TFTModel forecasts `output_chunk_length` steps at once from an LSTM encoder over the past
# chunk and an LSTM decoder over the future (known) covariates, then runs interpretable multi-head
# attention over [encoder steps, decoder steps].  With `full_attention=True` the module before the fix
# built `get_attention_mask_full`: a cumsum of an identity matrix, i.e. a causal mask over all
# encoder+decoder steps, queried every step and kept the decoder rows afterwards.  So a horizon step
# never attended to later horizon steps although `full_attention` is meant to let every forecast step
# attend to the whole past and future window.  The fix builds one mask, `get_attention_mask_future(...,
# full_attention)`, queries the decoder steps only, and for `full_attention=True` leaves the decoder
# block unmasked (all False = attend).
#
# Ported from darts/models/forecasting/tft_model.py (_TFTModule) and tft_submodels.py at 071c7e8^ /
# 071c7e8; the variable selection networks and static covariate context are trimmed to a linear
# projection of all variables and a zero static embedding (the series below has no static covariates).
import sys
from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


# ---- tft_submodels.py ---------------------------------------------------------------------------
class _GatedLinearUnit(nn.Module):
    def __init__(self, input_size: int, hidden_size: int = None, dropout: float = None):
        super().__init__()
        self.dropout = nn.Dropout(dropout) if dropout is not None else None
        self.hidden_size = hidden_size or input_size
        self.fc = nn.Linear(input_size, self.hidden_size * 2)

    def forward(self, x):
        if self.dropout is not None:
            x = self.dropout(x)
        x = self.fc(x)
        x = F.glu(x, dim=-1)
        return x


class _AddNorm(nn.Module):
    def __init__(self, input_size: int, skip_size: int = None, trainable_add: bool = True):
        super().__init__()
        self.input_size = input_size
        self.trainable_add = trainable_add
        if self.trainable_add:
            self.mask = nn.Parameter(torch.zeros(self.input_size, dtype=torch.float))
            self.gate = nn.Sigmoid()
        self.norm = nn.LayerNorm(self.input_size)

    def forward(self, x: torch.Tensor, skip: torch.Tensor):
        if self.trainable_add:
            skip = skip * self.gate(self.mask) * 2.0
        output = self.norm(x + skip)
        return output


class _GateAddNorm(nn.Module):
    def __init__(self, input_size: int, hidden_size: int = None, skip_size: int = None,
                 trainable_add: bool = False, dropout: float = None):
        super().__init__()
        self.input_size = input_size
        self.hidden_size = hidden_size or input_size
        self.skip_size = skip_size or self.hidden_size
        self.glu = _GatedLinearUnit(self.input_size, hidden_size=self.hidden_size, dropout=dropout)
        self.add_norm = _AddNorm(self.hidden_size, skip_size=self.skip_size, trainable_add=trainable_add)

    def forward(self, x, skip):
        output = self.glu(x)
        output = self.add_norm(output, skip)
        return output


class _GatedResidualNetwork(nn.Module):
    def __init__(self, input_size: int, hidden_size: int, output_size: int, dropout: float = 0.1,
                 context_size: int = None):
        super().__init__()
        self.fc1 = nn.Linear(input_size, hidden_size)
        self.elu = nn.ELU()
        if context_size is not None:
            self.context = nn.Linear(context_size, hidden_size, bias=False)
        self.fc2 = nn.Linear(hidden_size, hidden_size)
        self.gate_norm = _GateAddNorm(input_size=hidden_size, skip_size=output_size,
                                      hidden_size=output_size, dropout=dropout, trainable_add=False)

    def forward(self, x, context=None, residual=None):
        if residual is None:
            residual = x
        x = self.fc1(x)
        if context is not None:
            context = self.context(context)
            x = x + context
        x = self.elu(x)
        x = self.fc2(x)
        x = self.gate_norm(x, residual)
        return x


class _ScaledDotProductAttention(nn.Module):
    def __init__(self, dropout: float = None, scale: bool = True):
        super().__init__()
        self.dropout = nn.Dropout(p=dropout) if dropout is not None else None
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


class _InterpretableMultiHeadAttention(nn.Module):
    def __init__(self, n_head: int, d_model: int, dropout: float = 0.0):
        super().__init__()
        self.n_head = n_head
        self.d_model = d_model
        self.d_k = self.d_q = self.d_v = d_model // n_head
        self.dropout = nn.Dropout(p=dropout)

        self.v_layer = nn.Linear(self.d_model, self.d_v)
        self.q_layers = nn.ModuleList([nn.Linear(self.d_model, self.d_q) for _ in range(self.n_head)])
        self.k_layers = nn.ModuleList([nn.Linear(self.d_model, self.d_k) for _ in range(self.n_head)])
        self.attention = _ScaledDotProductAttention()
        self.w_h = nn.Linear(self.d_v, self.d_model, bias=False)

        for name, p in self.named_parameters():
            if "bias" not in name:
                torch.nn.init.xavier_uniform_(p)
            else:
                torch.nn.init.zeros_(p)

    def forward(self, q, k, v, mask=None) -> Tuple[torch.Tensor, torch.Tensor]:
        heads = []
        attns = []
        vs = self.v_layer(v)
        for i in range(self.n_head):
            qs = self.q_layers[i](q)
            ks = self.k_layers[i](k)
            head, attn = self.attention(qs, ks, vs, mask)
            head_dropout = self.dropout(head)
            heads.append(head_dropout)
            attns.append(attn)

        head = torch.stack(heads, dim=2) if self.n_head > 1 else heads[0]
        attn = torch.stack(attns, dim=2)

        outputs = torch.mean(head, dim=2) if self.n_head > 1 else head
        outputs = self.w_h(outputs)
        outputs = self.dropout(outputs)
        return outputs, attn


# ---- tft_model.py ------------------------------------------------------------------------------
class _TFTModule(nn.Module):
    def __init__(self, output_dim: Tuple[int, int], input_chunk_length: int, output_chunk_length: int,
                 n_past_variables: int, n_future_variables: int, hidden_size: int = 16,
                 lstm_layers: int = 1, num_attention_heads: int = 4, full_attention: bool = False,
                 hidden_continuous_size: int = 8, add_relative_index: bool = True, dropout: float = 0.0):
        super().__init__()
        self.n_targets, self.loss_size = output_dim
        self.input_chunk_length = input_chunk_length
        self.output_chunk_length = output_chunk_length
        self.hidden_size = hidden_size
        self.lstm_layers = lstm_layers
        self.num_attention_heads = num_attention_heads
        self.full_attention = full_attention
        self.add_relative_index = add_relative_index
        self.dropout = dropout

        self.batch_size_last = -1
        self.attention_mask = None
        self.relative_index = None

        n_past = n_past_variables + int(add_relative_index)
        n_future = n_future_variables + int(add_relative_index)
        # stand-ins for encoder_vsn / decoder_vsn (variable selection networks)
        self.encoder_vsn = nn.Linear(n_past, hidden_size)
        self.decoder_vsn = nn.Linear(n_future, hidden_size)

        self.lstm_encoder = nn.LSTM(input_size=hidden_size, hidden_size=hidden_size,
                                    num_layers=lstm_layers, batch_first=True)
        self.lstm_decoder = nn.LSTM(input_size=hidden_size, hidden_size=hidden_size,
                                    num_layers=lstm_layers, batch_first=True)

        self.post_lstm_gan = _GateAddNorm(input_size=hidden_size, dropout=dropout)
        self.static_enrichment_grn = _GatedResidualNetwork(
            input_size=hidden_size, hidden_size=hidden_size, output_size=hidden_size,
            dropout=dropout, context_size=hidden_size)
        self.multihead_attn = _InterpretableMultiHeadAttention(
            d_model=hidden_size, n_head=num_attention_heads, dropout=dropout)
        self.post_attn_gan = _GateAddNorm(hidden_size, dropout=dropout)
        self.feed_forward_block = _GatedResidualNetwork(
            hidden_size, hidden_size, hidden_size, dropout=dropout)
        self.pre_output_gan = _GateAddNorm(hidden_size, dropout=None)
        self.output_layer = nn.Linear(hidden_size, self.n_targets * self.loss_size)

    @staticmethod
    def expand_static_context(context: torch.Tensor, time_steps: int) -> torch.Tensor:
        return context[:, None].expand(-1, time_steps, -1)

    @staticmethod
    def get_relative_index(encoder_length: int, decoder_length: int, batch_size: int,
                           dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        index = torch.arange(encoder_length + decoder_length, dtype=dtype, device=device)
        prediction_index = encoder_length - 1
        index[:encoder_length] = index[:encoder_length] / prediction_index
        index[encoder_length:] = index[encoder_length:] / prediction_index
        return index.reshape(1, len(index), 1).repeat(batch_size, 1, 1)

    @staticmethod
    def get_attention_mask_full(time_steps: int, batch_size: int, dtype: torch.dtype,
                                device: torch.device) -> torch.Tensor:
        """
        Returns causal mask to apply for self-attention layer.
        """
        eye = torch.eye(time_steps, dtype=dtype, device=device)
        mask = torch.cumsum(eye.unsqueeze(0).repeat(batch_size, 1, 1), dim=1)
        return mask < 1

    @staticmethod
    def get_attention_mask_future(encoder_length: int, decoder_length: int, batch_size: int,
                                  device: str, full_attention: bool = False) -> torch.Tensor:
        """
        Returns causal mask to apply for self-attention layer that acts on future input only.
        The model will attend to all `False` values.
        """
        if full_attention:
            # attend to entire past and future input
            decoder_mask = torch.zeros((decoder_length, decoder_length), dtype=torch.bool, device=device)
        else:
            # attend only to past steps relative to forecasting step in the future
            attend_step = torch.arange(decoder_length, device=device)
            predict_step = torch.arange(0, decoder_length, device=device)[:, None]
            # do not attend to steps to self or after prediction
            decoder_mask = attend_step >= predict_step
        # attend to all past input
        encoder_mask = torch.zeros(batch_size, encoder_length, dtype=torch.bool, device=device)
        # combine masks along attended time - first encoder and then decoder
        mask = torch.cat(
            (
                encoder_mask.unsqueeze(1).expand(-1, decoder_length, -1),
                decoder_mask.unsqueeze(0).expand(batch_size, -1, -1),
            ),
            dim=2,
        )
        return mask

    def forward(self, x_in):
        x_cont_past, x_cont_future, x_static = x_in
        dim_samples, dim_time, dim_variable = 0, 1, 2
        device = x_in[0].device

        batch_size = x_cont_past.shape[dim_samples]
        encoder_length = self.input_chunk_length
        decoder_length = self.output_chunk_length
        time_steps = encoder_length + decoder_length

        # avoid unnecessary regeneration of attention mask
        if batch_size != self.batch_size_last:
            if FIXED:
                self.attention_mask = self.get_attention_mask_future(
                    encoder_length=encoder_length, decoder_length=decoder_length,
                    batch_size=batch_size, device=device, full_attention=self.full_attention)
            elif self.full_attention:
                self.attention_mask = self.get_attention_mask_full(
                    time_steps=time_steps, batch_size=batch_size, dtype=x_cont_past.dtype, device=device)
            else:
                self.attention_mask = self.get_attention_mask_future(
                    encoder_length=encoder_length, decoder_length=decoder_length,
                    batch_size=batch_size, device=device)
            if self.add_relative_index:
                self.relative_index = self.get_relative_index(
                    encoder_length=encoder_length, decoder_length=decoder_length,
                    batch_size=batch_size, device=device, dtype=x_cont_past.dtype)
            self.batch_size_last = batch_size

        if self.add_relative_index:
            x_cont_past = torch.cat(
                [ts[:, :encoder_length, :] for ts in [x_cont_past, self.relative_index] if ts is not None],
                dim=dim_variable)
            x_cont_future = torch.cat(
                [ts[:, -decoder_length:, :] for ts in [x_cont_future, self.relative_index] if ts is not None],
                dim=dim_variable)

        # no static covariates
        static_embedding = torch.zeros((x_cont_past.shape[0], self.hidden_size),
                                       dtype=x_cont_past.dtype, device=device)

        embeddings_varying_encoder = self.encoder_vsn(x_cont_past)
        embeddings_varying_decoder = self.decoder_vsn(x_cont_future)

        input_hidden = static_embedding.expand(self.lstm_layers, -1, -1).contiguous()
        input_cell = static_embedding.expand(self.lstm_layers, -1, -1).contiguous()

        encoder_out, (hidden, cell) = self.lstm_encoder(input=embeddings_varying_encoder,
                                                        hx=(input_hidden, input_cell))
        decoder_out, _ = self.lstm_decoder(input=embeddings_varying_decoder, hx=(hidden, cell))

        lstm_layer = torch.cat([encoder_out, decoder_out], dim=dim_time)
        input_embeddings = torch.cat([embeddings_varying_encoder, embeddings_varying_decoder], dim=dim_time)

        # post lstm GateAddNorm
        lstm_out = self.post_lstm_gan(x=lstm_layer, skip=input_embeddings)

        # static enrichment
        attn_input = self.static_enrichment_grn(
            x=lstm_out, context=self.expand_static_context(context=static_embedding, time_steps=time_steps))

        if FIXED:
            # multi-head attention
            attn_out, attn_out_weights = self.multihead_attn(
                q=attn_input[:, encoder_length:], k=attn_input, v=attn_input, mask=self.attention_mask)
            attn_out = self.post_attn_gan(x=attn_out, skip=attn_input[:, encoder_length:])
            out = self.feed_forward_block(x=attn_out)
            out = self.pre_output_gan(x=out, skip=lstm_out[:, encoder_length:])
            out = self.output_layer(out)
        else:
            # multi-head attention
            attn_out, attn_out_weights = self.multihead_attn(
                q=attn_input if self.full_attention else attn_input[:, encoder_length:],
                k=attn_input, v=attn_input, mask=self.attention_mask)
            attn_out = self.post_attn_gan(
                x=attn_out, skip=attn_input if self.full_attention else attn_input[:, encoder_length:])
            out = self.feed_forward_block(x=attn_out)
            out = self.pre_output_gan(
                x=out, skip=lstm_out if self.full_attention else lstm_out[:, encoder_length:])
            out = self.output_layer(out[:, encoder_length:] if self.full_attention else out)
        out = out.view(batch_size, self.output_chunk_length, self.n_targets, self.loss_size)
        return out


def main():
    torch.manual_seed(0)
    input_chunk_length, output_chunk_length = 12, 6
    # past chunk: target + past covariate + future covariate; future chunk: the future covariate
    model = _TFTModule(output_dim=(1, 1), input_chunk_length=input_chunk_length,
                       output_chunk_length=output_chunk_length, n_past_variables=3, n_future_variables=1,
                       hidden_size=16, num_attention_heads=4, full_attention=True)
    model.eval()

    t = torch.arange(input_chunk_length + output_chunk_length, dtype=torch.float32)
    batch = []
    for phase in (0.0, 0.7):
        target = torch.sin(0.5 * t + phase)
        past_cov = torch.cos(0.3 * t + phase)
        future_cov = (t % 7 == 0).float() + 0.1 * t / t.max()   # e.g. a known holiday flag
        batch.append((target, past_cov, future_cov))
    x_past = torch.stack([torch.stack([b[0][:input_chunk_length], b[1][:input_chunk_length],
                                       b[2][:input_chunk_length]], dim=-1) for b in batch])
    x_future = torch.stack([b[2][input_chunk_length:].unsqueeze(-1) for b in batch])

    with torch.no_grad():
        out = model((x_past, x_future, None))
    torch.set_printoptions(precision=5, sci_mode=False)
    print("fixed" if FIXED else "buggy")
    print("forecast (batch, horizon):")
    print(out[..., 0, 0])


if __name__ == "__main__":
    main()
