# dmlc/gluon-nlp#1015, fixed by commit 86bd0800 (in PR #1010, "Fix https://github.com/dmlc/gluon-nlp/issues/1015").
# scripts/text_generation/model/gpt.py, GPT2Model.forward (as at the commit 5e11334f, MXNet; ported to torch
# with the same layout). The cached states are [key, value] per layer, each (batch_size, num_heads, past_length,
# head_units). At a cached step the model numbers the new tokens from prev_len = states[0].shape[1], which is
# num_heads, not the number of cached tokens: every decoded token is looked up in the learned position table at
# position num_heads (and the length assert passes). The self-attention layer itself reads prev_key.shape[2].
# Fix: prev_len = states[0].shape[2].
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class GELU(nn.Module):
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


class DotProductAttentionCell(nn.Module):
    """gluonnlp.model.attention_cell.DotProductAttentionCell(scaled=True): mask is 1 = attend."""

    def __init__(self, scaled=True, dropout=0.0):
        super().__init__()
        self._scaled = scaled
        self._dropout = nn.Dropout(dropout)

    def forward(self, query, key, value, mask=None):
        if self._scaled:
            query = query / math.sqrt(query.shape[-1])
        att_score = torch.bmm(query, key.transpose(1, 2))
        if mask is not None:
            att_score = att_score.masked_fill(mask == 0, -1e18)
        att_weights = torch.softmax(att_score, dim=-1)
        if mask is not None:
            att_weights = att_weights * mask.to(att_weights.dtype)
        att_weights = self._dropout(att_weights)
        return torch.bmm(att_weights, value), att_weights


class GPT2SelfAttentionLayer(nn.Module):
    def __init__(self, units, num_heads, dropout=0.0):
        super().__init__()
        self._units = units
        self._num_heads = num_heads
        assert units % num_heads == 0
        self._multi_head_qkv_proj = nn.Linear(units, units * 3)
        self._base_attn_cell = DotProductAttentionCell(scaled=True, dropout=dropout)
        self._dropout_layer = nn.Dropout(dropout)
        self._out_proj = nn.Linear(units, units)

    def forward(self, data, states=None):
        batch_size = data.shape[0]
        seq_len = data.shape[1]
        # Generate mask
        if states is not None:
            prev_key, prev_value = states
            prev_len = prev_key.shape[2]
        else:
            prev_key, prev_value = None, None
            prev_len = 0
        data_pos = torch.arange(prev_len, prev_len + seq_len, device=data.device, dtype=data.dtype)
        all_pos = torch.arange(seq_len + prev_len, device=data.device, dtype=data.dtype)
        mask = (all_pos.reshape(1, -1) <= data_pos.reshape(-1, 1)).to(data.dtype)
        mask = mask.unsqueeze(0).expand(batch_size * self._num_heads, -1, -1)

        # Multi-head attention
        qkv = self._multi_head_qkv_proj(data)  # (batch_size, seq_len, 3 * units)
        query, key, value = qkv.split(self._units, dim=-1)
        h, d = self._num_heads, self._units // self._num_heads
        # (batch_size * num_heads, seq_len, ele_units)
        query = query.reshape(batch_size, seq_len, h, d).transpose(1, 2).reshape(batch_size * h, seq_len, d)
        key = key.reshape(batch_size, seq_len, h, d).transpose(1, 2).reshape(batch_size * h, seq_len, d)
        value = value.reshape(batch_size, seq_len, h, d).transpose(1, 2).reshape(batch_size * h, seq_len, d)
        if prev_key is not None:
            key = torch.cat([prev_key.reshape(batch_size * h, -1, d), key], dim=1)
        if prev_value is not None:
            value = torch.cat([prev_value.reshape(batch_size * h, -1, d), value], dim=1)

        out, _ = self._base_attn_cell(query, key, value, mask)
        out = out.reshape(batch_size, h, seq_len, d).transpose(1, 2).reshape(batch_size, seq_len, -1)
        out = self._out_proj(out)
        return out, [key.reshape(batch_size, h, -1, d), value.reshape(batch_size, h, -1, d)]


class GPT2FFNLayer(nn.Module):
    def __init__(self, units, hidden_size):
        super().__init__()
        self._hidden_map = nn.Linear(units, hidden_size)
        self._out_map = nn.Linear(hidden_size, units)
        self._act = GELU()

    def forward(self, data):
        return self._out_map(self._act(self._hidden_map(data)))


class GPT2Model(nn.Module):
    def __init__(self, units, vocab_size, max_length, num_layers, num_heads, dropout=0.0):
        super().__init__()
        self._units = units
        self._max_length = max_length
        self._num_layers = num_layers
        self._num_heads = num_heads
        self._pos_embed = nn.Embedding(max_length, units)
        nn.init.normal_(self._pos_embed.weight, std=0.01)
        self._embed = nn.Embedding(vocab_size, units)
        nn.init.normal_(self._embed.weight, std=0.02)
        self._self_attention_layers = nn.ModuleList()
        self._ffn_layers = nn.ModuleList()
        self._attn_ln = nn.ModuleList()
        self._ffn_ln = nn.ModuleList()
        for _ in range(num_layers):
            self._self_attention_layers.append(GPT2SelfAttentionLayer(units, num_heads, dropout))
            self._ffn_layers.append(GPT2FFNLayer(units, units * 4))
            self._attn_ln.append(nn.LayerNorm(units))
            self._ffn_ln.append(nn.LayerNorm(units))
        self._final_ln = nn.LayerNorm(units)

    def _logits_proj(self, out):
        # tied to the token embedding (params=self._embed.params)
        return F.linear(out, self._embed.weight)

    def forward(self, data, states=None):
        new_states = []
        batch_size, seq_len = data.shape[0], data.shape[1]
        if states is not None:
            if FIXED:
                prev_len = states[0].shape[2]
            else:
                prev_len = states[0].shape[1]
        else:
            prev_len = 0
        assert seq_len + prev_len <= self._max_length
        data_pos = torch.arange(prev_len, prev_len + seq_len, device=data.device)
        data_pos = data_pos.unsqueeze(0).expand(batch_size, -1)
        out = self._embed(data) + self._pos_embed(data_pos)
        for i in range(self._num_layers):
            attn_layer = self._self_attention_layers[i]
            ffn_layer = self._ffn_layers[i]
            attn_ln = self._attn_ln[i]
            ffn_ln = self._ffn_ln[i]
            layer_states = None if states is None else states[2 * i:(2 * i + 2)]
            h, new_layer_states = attn_layer(attn_ln(out), layer_states)
            out = out + h
            h = ffn_layer(ffn_ln(out))
            out = out + h
            new_states.extend(new_layer_states)
        out = self._final_ln(out)
        logits = self._logits_proj(out)
        return logits, new_states


# scripts/text_generation/sequence_sampling.py
class LMDecoder:
    def __init__(self, net):
        self.net = net


class GPT2Decoder(LMDecoder):
    def __call__(self, inputs, states):
        inputs = inputs.unsqueeze(1)
        out, new_states = self.net(inputs, states)
        out = out[:, 0:1].reshape(inputs.shape[0], -1)
        return out, new_states


def get_initial_input_state(decoder, bos_ids):
    inputs, begin_states = decoder.net(torch.tensor([bos_ids], dtype=torch.long), None)
    inputs = inputs[:, -1, :]
    inputs = inputs.argmax(dim=1)
    return inputs, begin_states


def main():
    torch.manual_seed(0)
    gpt2_tiny_hparams = {
        'units': 64,
        'max_length': 64,
        'num_heads': 4,
        'num_layers': 2,
        'dropout': 0.0,
    }
    net = GPT2Model(vocab_size=97, **gpt2_tiny_hparams).eval()
    decoder = GPT2Decoder(net)
    bos_ids = [5, 17, 42, 8, 63, 21, 30, 11, 2]
    max_length = 24
    with torch.no_grad():
        inputs, states = get_initial_input_state(decoder, bos_ids)
        samples = [int(inputs[0])]
        step_logits = []
        # greedy decoding over the cached states (SequenceSampler with beam_size=1, temperature -> 0)
        for _ in range(max_length - len(bos_ids)):
            log_probs, states = decoder(inputs, states)
            step_logits.append(log_probs)
            inputs = log_probs.argmax(dim=-1)
            samples.append(int(inputs[0]))
    print("prompt:", bos_ids)
    print("generated:", samples)
    print("last step logits[:6]:", [round(v, 4) for v in step_logits[-1][0, :6].tolist()])
    print("cached length:", states[0].shape[2])


if __name__ == "__main__":
    main()
