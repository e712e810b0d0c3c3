# ant-research/EasyTemporalPointProcess commit 2c4ce4e ("Fixed THP"): commit 0bc41b8 changed
# EventTokenizer.make_attn_mask_for_pad_sequence so an event attends to itself (subsequent mask triu k=1, was k=0),
# but THP.loglike_loss kept slicing that mask as attention_mask[:, 1:, :-1] (written for the old k=0 mask). Row i of
# the slice is the tokenizer's row i+1, so the state at event i read event i+1 -- the event whose type and
# inter-event time it is scored on. 2c4ce4e slices attention_mask[:, :-1, :-1].
import math
import sys

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class ModelConfig:  # easy_tpp.config_factory.ModelConfig, the fields THP reads
    def __init__(self, **kw):
        self.__dict__.update(kw)


# ---------------------------------------------------------------- easy_tpp/preprocess/event_tokenizer.py
class EventTokenizer:
    padding_side = "right"
    model_input_names = ["time_seqs", "time_delta_seqs", "type_seqs", "seq_non_pad_mask", "attention_mask"]

    def __init__(self, config):
        self.num_event_types = config.num_event_types
        self.pad_token_id = config.pad_token_id

    @staticmethod
    def make_pad_sequence(seqs, pad_token_id, padding_side, max_len, dtype=np.float32):
        pad_seq = np.array([seq + [pad_token_id] * (max_len - len(seq)) for seq in seqs], dtype=dtype)
        return pad_seq

    def make_attn_mask_for_pad_sequence(self, pad_seqs, pad_token_id):
        seq_num, seq_len = pad_seqs.shape

        # [batch_size, seq_len]
        seq_pad_mask = pad_seqs == pad_token_id

        # [batch_size, seq_len, seq_len]
        attention_key_pad_mask = np.tile(seq_pad_mask[:, None, :], (1, seq_len, 1))
        subsequent_mask = np.tile(np.triu(np.ones((seq_len, seq_len), dtype=bool), k=1)[None, :, :], (seq_num, 1, 1))

        attention_mask = subsequent_mask | attention_key_pad_mask

        return attention_mask

    def pad(self, encoded_inputs):
        required_input = encoded_inputs[self.model_input_names[0]]
        seq_lens = np.array([len(seq) for seq in required_input])
        max_length = seq_lens.max()

        batch_output = dict()
        batch_output[self.model_input_names[0]] = self.make_pad_sequence(
            encoded_inputs[self.model_input_names[0]], self.pad_token_id, self.padding_side, max_length)
        batch_output[self.model_input_names[1]] = self.make_pad_sequence(
            encoded_inputs[self.model_input_names[1]], self.pad_token_id, self.padding_side, max_length)
        batch_output[self.model_input_names[2]] = self.make_pad_sequence(
            encoded_inputs[self.model_input_names[2]], self.pad_token_id, self.padding_side, max_length,
            dtype=np.int64)

        # non_pad_mask; replaced the use of event types by using the original sequence length
        seq_pad_mask = np.full_like(batch_output[self.model_input_names[2]], fill_value=True, dtype=bool)
        for i, seq_len in enumerate(seq_lens):
            seq_pad_mask[i, seq_len:] = False
        batch_output[self.model_input_names[3]] = seq_pad_mask

        batch_output[self.model_input_names[4]] = self.make_attn_mask_for_pad_sequence(
            batch_output[self.model_input_names[2]], self.pad_token_id)
        return [torch.as_tensor(batch_output[name]) for name in self.model_input_names]


# ---------------------------------------------------------------- easy_tpp/model/torch_model/torch_baselayer.py
def attention(query, key, value, mask=None, dropout=None):
    d_k = query.size(-1)
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(d_k)
    if mask is not None:
        # small change here -- we use "1" for masked element
        scores = scores.masked_fill(mask > 0, -1e9)
    p_attn = torch.softmax(scores, dim=-1)
    if dropout is not None:
        p_attn = dropout(p_attn)
    return torch.matmul(p_attn, value), p_attn


class MultiHeadAttention(nn.Module):
    def __init__(self, n_head, d_input, d_model, dropout=0.1, output_linear=False):
        super(MultiHeadAttention, self).__init__()
        assert d_model % n_head == 0
        self.n_head = n_head
        self.d_k = d_model // n_head
        self.d_v = self.d_k
        self.d_model = d_model
        self.output_linear = output_linear
        self.linears = nn.ModuleList([nn.Linear(d_input, d_model) for _ in range(3)])
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, query, key, value, mask, output_weight=False):
        if mask is not None:
            mask = mask.unsqueeze(1)
        nbatches = query.size(0)

        query, key, value = [
            lin_layer(x).view(nbatches, -1, self.n_head, self.d_k).transpose(1, 2)
            for lin_layer, x in zip(self.linears, (query, key, value))
        ]
        x, attn_weight = attention(query, key, value, mask=mask, dropout=self.dropout)

        x = x.transpose(1, 2).contiguous().view(nbatches, -1, self.n_head * self.d_k)
        return x


class EncoderLayer(nn.Module):
    def __init__(self, d_model, self_attn, feed_forward=None, use_residual=False, dropout=0.1):
        super(EncoderLayer, self).__init__()
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.use_residual = use_residual
        self.d_model = d_model

    def forward(self, x, mask):
        x = self.self_attn(x, x, x, mask)
        if self.feed_forward is not None:
            return self.feed_forward(x)
        else:
            return x


class TimePositionalEncoding(nn.Module):
    def __init__(self, d_model, max_len=5000, device='cpu'):
        super().__init__()
        i = torch.arange(0, d_model, 1, device=device)
        div_term = (2 * (i // 2).float() * -(math.log(10000.0) / d_model)).exp()
        self.register_buffer('div_term', div_term)

    def forward(self, x):
        result = x.unsqueeze(-1) * self.div_term
        result[:, :, 0::2] = torch.sin(result[:, :, 0::2])
        result[:, :, 1::2] = torch.cos(result[:, :, 1::2])
        return result


# ---------------------------------------------------------------- easy_tpp/model/torch_model/torch_basemodel.py
class TorchBaseModel(nn.Module):
    def __init__(self, model_config):
        super(TorchBaseModel, self).__init__()
        self.loss_integral_num_sample_per_step = model_config.loss_integral_num_sample_per_step
        self.hidden_size = model_config.hidden_size
        self.num_event_types = model_config.num_event_types
        self.num_event_types_pad = model_config.num_event_types_pad
        self.pad_token_id = model_config.pad_token_id
        self.eps = torch.finfo(torch.float32).eps
        self.layer_type_emb = nn.Embedding(self.num_event_types_pad, self.hidden_size, padding_idx=self.pad_token_id)
        self.device = torch.device("cpu")
        self.use_mc_samples = model_config.use_mc_samples

    def compute_loglikelihood(self, time_delta_seq, lambda_at_event, lambdas_loss_samples, seq_mask, type_seq):
        lambda_at_event = lambda_at_event + self.eps
        lambdas_loss_samples = lambdas_loss_samples + self.eps

        log_marked_event_lambdas = lambda_at_event.log()
        total_sampled_lambdas = lambdas_loss_samples.sum(dim=-1)

        event_ll = -F.nll_loss(
            log_marked_event_lambdas.permute(0, 2, 1),
            target=type_seq,
            ignore_index=self.pad_token_id,
            reduction='none',
        )

        if self.use_mc_samples:
            non_event_ll = total_sampled_lambdas.mean(dim=-1) * time_delta_seq * seq_mask
        else:  # Use trapezoid rule
            non_event_ll = 0.5 * (total_sampled_lambdas[..., 1:] + total_sampled_lambdas[..., :-1]).mean(
                dim=-1) * time_delta_seq * seq_mask

        num_events = torch.masked_select(event_ll, event_ll.ne(0.0)).size()[0]
        return event_ll, non_event_ll, num_events

    def make_dtime_loss_samples(self, time_delta_seq):
        dtimes_ratio_sampled = torch.linspace(start=0.0, end=1.0, steps=self.loss_integral_num_sample_per_step,
                                              device=self.device)[None, None, :]
        sampled_dtimes = time_delta_seq[:, :, None] * dtimes_ratio_sampled
        return sampled_dtimes


# ---------------------------------------------------------------- easy_tpp/model/torch_model/torch_thp.py
class THP(TorchBaseModel):
    def __init__(self, model_config):
        super(THP, self).__init__(model_config)
        self.d_model = model_config.hidden_size
        self.d_time = model_config.time_emb_size
        self.use_norm = model_config.use_ln

        self.n_layers = model_config.num_layers
        self.n_head = model_config.num_heads
        self.dropout = model_config.dropout_rate

        self.layer_temporal_encoding = TimePositionalEncoding(self.d_model, device=self.device)

        self.factor_intensity_base = nn.Parameter(torch.empty([1, self.num_event_types], device=self.device))
        self.factor_intensity_decay = nn.Parameter(torch.empty([1, self.num_event_types], device=self.device))
        nn.init.xavier_normal_(self.factor_intensity_base)
        nn.init.xavier_normal_(self.factor_intensity_decay)

        self.layer_intensity_hidden = nn.Linear(self.d_model, self.num_event_types)
        self.softplus = nn.Softplus()

        self.feed_forward = nn.Sequential(
            nn.Linear(self.d_model, self.d_model * 2),
            nn.ReLU(),
            nn.Linear(self.d_model * 2, self.d_model)
        )

        self.stack_layers = nn.ModuleList(
            [EncoderLayer(
                self.d_model,
                MultiHeadAttention(self.n_head, self.d_model, self.d_model, self.dropout, output_linear=False),
                use_residual=False,
                feed_forward=self.feed_forward,
                dropout=self.dropout
            ) for _ in range(self.n_layers)])

    def forward(self, time_seqs, type_seqs, attention_mask):
        tem_enc = self.layer_temporal_encoding(time_seqs)
        enc_output = self.layer_type_emb(type_seqs)

        for enc_layer in self.stack_layers:
            enc_output += tem_enc
            enc_output = enc_layer(enc_output, mask=attention_mask)

        return enc_output

    def loglike_loss(self, batch):
        time_seqs, time_delta_seqs, type_seqs, batch_non_pad_mask, attention_mask = batch

        # 1. compute event-loglik
        if FIXED:
            enc_out = self.forward(time_seqs[:, :-1], type_seqs[:, :-1], attention_mask[:, :-1, :-1])
        else:
            enc_out = self.forward(time_seqs[:, :-1], type_seqs[:, :-1], attention_mask[:, 1:, :-1])

        factor_intensity_decay = self.factor_intensity_decay[None, ...]
        factor_intensity_base = self.factor_intensity_base[None, ...]

        intensity_states = factor_intensity_decay * time_delta_seqs[:, 1:, None] + self.layer_intensity_hidden(
            enc_out) + factor_intensity_base

        lambda_at_event = self.softplus(intensity_states)

        # 2. compute non-event-loglik (using MC sampling to compute integral)
        sample_dtimes = self.make_dtime_loss_samples(time_delta_seqs[:, 1:])
        state_t_sample = self.compute_states_at_sample_times(event_states=enc_out, sample_dtimes=sample_dtimes)
        lambda_t_sample = self.softplus(state_t_sample)

        event_ll, non_event_ll, num_events = self.compute_loglikelihood(lambda_at_event=lambda_at_event,
                                                                        lambdas_loss_samples=lambda_t_sample,
                                                                        time_delta_seq=time_delta_seqs[:, 1:],
                                                                        seq_mask=batch_non_pad_mask[:, 1:],
                                                                        type_seq=type_seqs[:, 1:])

        loss = - (event_ll - non_event_ll).sum()
        return loss, num_events

    def compute_states_at_sample_times(self, event_states, sample_dtimes):
        event_states = event_states[:, :, None, :]
        sample_dtimes = sample_dtimes[..., None]
        factor_intensity_decay = self.factor_intensity_decay[None, None, ...]
        factor_intensity_base = self.factor_intensity_base[None, None, ...]
        intensity_states = factor_intensity_decay * sample_dtimes + self.layer_intensity_hidden(
            event_states) + factor_intensity_base
        return intensity_states


config = ModelConfig(hidden_size=32, time_emb_size=16, use_ln=False, num_layers=2, num_heads=2, dropout_rate=0.0,
                     num_event_types=5, num_event_types_pad=6, pad_token_id=5, loss_integral_num_sample_per_step=10,
                     use_mc_samples=True)
tokenizer = EventTokenizer(config)
model = THP(config)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

# a few retweet-style sequences: (time_since_start, time_since_last_event, type_event), variable lengths
rng = np.random.RandomState(0)
raw = []
for n in [7, 5, 9, 6]:
    dts = [0.0] + list(rng.exponential(1.0, n - 1))
    raw.append(dict(time_seqs=list(np.cumsum(dts)), time_delta_seqs=dts, type_seqs=list(rng.randint(0, 5, n))))
batch = tokenizer.pad({k: [r[k] for r in raw] for k in EventTokenizer.model_input_names[:3]})

model.train()
for step in range(30):
    loss, num_events = model.loglike_loss(batch)
    optimizer.zero_grad()
    (loss / num_events).backward()
    optimizer.step()
    if step % 10 == 0 or step == 29:
        print(f"fixed={FIXED} step {step:2d} loglike loss per event {loss.item() / num_events:.4f}")
