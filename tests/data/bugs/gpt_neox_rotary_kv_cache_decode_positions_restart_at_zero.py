"""GPT-NeoX (2021 megatron/model/transformer.py): rotary positions of a cached decode step restart at 0.

Citation: EleutherAI/gpt-neox commit c0986cfd ("fix recompute + rotary embeddings"), fixing the
cached path as it stood after EleutherAI/gpt-neox#363 (commit 9ae9fb32, "cache un-RoPE'd KVs").

The bug: ParallelSelfAttention.forward concatenated ``layer_past`` (the cached keys / values,
[sk, b, np, hn]) onto the new ones and then took ``cos, sin = self.rotary_emb(query_layer,
seq_dim=0)``: RotaryEmbedding builds its table from ``torch.arange(x.shape[seq_dim])``, i.e. from
the number of *new* tokens. On a decode step (one new token) the table is position 0 only, and it
is broadcast over the query and over every key, cached ones included: the positions of the cached
tokens and of the new one are all 0.

The fix: rotate the new query / key only, from a table of ``seq_len = sq + layer_past[0].shape[0]``
positions sliced at ``offset = layer_past[0].shape[0]`` (apply_rotary_pos_emb(..., offset=offset)),
and cache the rotated keys afterwards.

Ported at toy sizes on CPU with random weights: mpu's Column/RowParallelLinear become nn.Linear
(one partition), FusedScaleMaskSoftmax becomes its unfused path (gpt2_attention_mask_func), and
stream_tokens keeps neox's loop (right-padded prompts via pad_batch, get_ltor_masks_and_position_ids,
layer_past grown step by step, recompute=False).
"""

import math
import sys
from types import SimpleNamespace
from typing import List

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


def exists(x):
    return x is not None


# ---------------------------------------------------------------- megatron/model/positional_embeddings.py

class RotaryEmbedding(torch.nn.Module):

    def __init__(self, dim, base=10000):
        super().__init__()
        inv_freq = 1. / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer('inv_freq', inv_freq)
        self.seq_len_cached = None
        self.cos_cached = None
        self.sin_cached = None

    def forward(self, x, seq_dim=1, seq_len=None):
        if seq_len is None:
            seq_len = x.shape[seq_dim]
        if seq_len != self.seq_len_cached:
            self.seq_len_cached = seq_len
            t = torch.arange(seq_len, device=x.device).type_as(self.inv_freq)
            freqs = torch.einsum('i,j->ij', t, self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1).to(x.device)
            self.cos_cached = emb.cos()[:, None, None, :]
            self.sin_cached = emb.sin()[:, None, None, :]
        return self.cos_cached, self.sin_cached


def rotate_half(x):
    x1, x2 = x[..., :x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=x1.ndim - 1)


def apply_rotary_pos_emb(q, k, cos, sin, offset: int = 0):
    if FIXED:
        cos, sin = cos[offset:q.shape[0] + offset, ...], sin[offset:q.shape[0] + offset, ...]
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


# ---------------------------------------------------------------- megatron/model/gpt2_model.py, utils.py

def gpt2_attention_mask_func(attention_scores, ltor_mask):
    attention_scores.masked_fill_(ltor_mask, -10000.0)
    return attention_scores


def get_ltor_masks_and_position_ids(data, eod_token, reset_position_ids, reset_attention_mask,
                                    eod_mask_loss):
    """Build masks and position id for left to right model."""
    batch_size, seq_length = data.size()
    att_mask_batch = batch_size if reset_attention_mask else 1
    attention_mask = torch.tril(torch.ones(
        (att_mask_batch, seq_length, seq_length), device=data.device)).view(
        att_mask_batch, 1, seq_length, seq_length)
    loss_mask = torch.ones(data.size(), dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    position_ids = torch.arange(seq_length, dtype=torch.long, device=data.device)
    position_ids = position_ids.unsqueeze(0).expand_as(data)
    # Convert attention mask to binary:
    attention_mask = (attention_mask < 0.5)
    return attention_mask, loss_mask, position_ids


# ---------------------------------------------------------------- megatron/model/transformer.py

class ParallelSelfAttention(nn.Module):

    def __init__(self, neox_args, attention_mask_func, layer_number, rotary=False, get_key_value=False):
        super().__init__()
        self.attention_mask_func = attention_mask_func
        self.get_key_value = get_key_value
        self.layer_number = layer_number
        self.hidden_size_per_partition = neox_args.hidden_size
        self.hidden_size_per_attention_head = neox_args.hidden_size // neox_args.num_attention_heads
        self.num_attention_heads_per_partition = neox_args.num_attention_heads
        self.query_key_value = nn.Linear(neox_args.hidden_size, 3 * neox_args.hidden_size)
        self.norm_factor = math.sqrt(self.hidden_size_per_attention_head)
        if rotary:
            if neox_args.rotary_pct == 1:
                self.rotary_ndims = None
            else:
                assert neox_args.rotary_pct < 1
                self.rotary_ndims = int(self.hidden_size_per_attention_head * neox_args.rotary_pct)
            dim = self.rotary_ndims if self.rotary_ndims is not None else self.hidden_size_per_attention_head
            self.rotary_emb = RotaryEmbedding(dim, base=neox_args.rotary_emb_base)
        else:
            self.rotary_emb = None
        self.attention_dropout = nn.Dropout(neox_args.attention_dropout)
        self.dense = nn.Linear(neox_args.hidden_size, neox_args.hidden_size)

    def scale_mask_softmax(self, attention_scores, attention_mask):
        # FusedScaleMaskSoftmax, unfused path
        mask_output = self.attention_mask_func(attention_scores, attention_mask)
        return torch.nn.Softmax(dim=-1)(mask_output.float()).type_as(attention_scores)

    def attention(self, query_layer, key_layer, value_layer, layer_past, attention_mask):
        # [b, np, sq, sk]
        output_size = (query_layer.size(1), query_layer.size(2), query_layer.size(0), key_layer.size(0))
        # [sq, b, np, hn] -> [sq, b * np, hn]
        query_layer = query_layer.reshape(output_size[2], output_size[0] * output_size[1], -1)
        key_layer = key_layer.reshape(output_size[3], output_size[0] * output_size[1], -1)
        matmul_result = torch.empty(output_size[0] * output_size[1], output_size[2], output_size[3],
                                    dtype=query_layer.dtype, device=query_layer.device)
        matmul_result = torch.baddbmm(matmul_result,
                                      query_layer.transpose(0, 1),
                                      key_layer.transpose(0, 1).transpose(1, 2),
                                      beta=0.0, alpha=(1.0 / self.norm_factor))
        attention_scores = matmul_result.view(*output_size)

        # Update attention mask for inference. [b, np, sq, sk]
        if self.get_key_value:
            with torch.no_grad():
                if layer_past is not None and layer_past.numel() > 0:
                    attention_mask = attention_mask[
                                     ...,
                                     attention_scores.size(3) - 1,
                                     :attention_scores.size(3)].unsqueeze(2)
                else:
                    attention_mask = attention_mask[
                                     ...,
                                     :attention_scores.size(3),
                                     :attention_scores.size(3)]

        attention_probs = self.scale_mask_softmax(attention_scores, attention_mask)
        attention_probs = self.attention_dropout(attention_probs)

        output_size = (value_layer.size(1), value_layer.size(2), query_layer.size(0), value_layer.size(3))
        value_layer = value_layer.reshape(value_layer.size(0), output_size[0] * output_size[1], -1)
        attention_probs = attention_probs.view(output_size[0] * output_size[1], output_size[2], -1)
        context_layer = torch.bmm(attention_probs, value_layer.transpose(0, 1))
        context_layer = context_layer.view(*output_size)
        return context_layer

    def _cache(self, key_layer, value_layer, layer_past):
        if exists(layer_past) and layer_past.numel() > 0:
            past_key, past_value = layer_past
            key_layer = torch.cat((past_key.type_as(key_layer), key_layer), dim=0)
            value_layer = torch.cat((past_value.type_as(value_layer), value_layer), dim=0)
        present = torch.stack((key_layer, value_layer)) if self.get_key_value else None
        return key_layer, value_layer, present

    def forward(self, hidden_states, attention_mask, layer_past=None):
        # hidden_states: [sq, b, h]
        mixed_x_layer = self.query_key_value(hidden_states)
        new_tensor_shape = mixed_x_layer.size()[:-1] + (self.num_attention_heads_per_partition,
                                                        3 * self.hidden_size_per_attention_head)
        mixed_x_layer = mixed_x_layer.view(*new_tensor_shape)
        (query_layer, key_layer, value_layer) = torch.split(
            mixed_x_layer, self.hidden_size_per_attention_head, dim=-1)

        if not FIXED:
            # ==================================
            # Cache key and value for inference
            # ==================================
            key_layer, value_layer, present = self._cache(key_layer, value_layer, layer_past)

        if exists(self.rotary_emb):
            if exists(self.rotary_ndims):
                query_rot, query_pass = query_layer[..., :self.rotary_ndims], query_layer[..., self.rotary_ndims:]
                key_rot, key_pass = key_layer[..., :self.rotary_ndims], key_layer[..., self.rotary_ndims:]
            else:
                query_rot, key_rot = query_layer, key_layer

            if FIXED:
                seq_len = key_layer.shape[0]
                offset = 0
                if exists(layer_past) and layer_past.numel() > 0:
                    offset = layer_past[0].shape[0]
                    seq_len += offset
                cos, sin = self.rotary_emb(value_layer, seq_len=seq_len)
                query_layer, key_layer = apply_rotary_pos_emb(query_rot, key_rot, cos, sin, offset=offset)
            else:
                cos, sin = self.rotary_emb(query_rot, seq_dim=0)
                query_layer, key_layer = apply_rotary_pos_emb(query_rot, key_rot, cos, sin)

            if exists(self.rotary_ndims):
                query_layer = torch.cat((query_layer, query_pass), dim=-1)
                key_layer = torch.cat((key_layer, key_pass), dim=-1)

        if FIXED:
            key_layer, value_layer, present = self._cache(key_layer, value_layer, layer_past)

        context_layer = self.attention(query_layer, key_layer, value_layer, layer_past, attention_mask)
        # [b, np, sq, hn] --> [sq, b, np, hn] --> [sq, b, hp]
        context_layer = context_layer.permute(2, 0, 1, 3).contiguous()
        context_layer = context_layer.view(*context_layer.size()[:-2], self.hidden_size_per_partition)
        output = self.dense(context_layer)
        if self.get_key_value:
            output = [output, present]
        return output


class ParallelMLP(nn.Module):

    def __init__(self, neox_args):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(neox_args.hidden_size, 4 * neox_args.hidden_size)
        self.dense_4h_to_h = nn.Linear(4 * neox_args.hidden_size, neox_args.hidden_size)

    def forward(self, x):
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))


class ParallelTransformerLayer(nn.Module):

    def __init__(self, neox_args, attention_mask_func, layer_number, rotary=False, get_key_value=False):
        super().__init__()
        self.get_key_value = get_key_value
        self.input_layernorm = nn.LayerNorm(neox_args.hidden_size, eps=1e-5)
        self.attention = ParallelSelfAttention(neox_args, attention_mask_func, layer_number,
                                               rotary=rotary, get_key_value=get_key_value)
        self.post_attention_layernorm = nn.LayerNorm(neox_args.hidden_size, eps=1e-5)
        self.mlp = ParallelMLP(neox_args)

    def forward(self, hidden_states, attention_mask, layer_past=None):
        layernorm_output = self.input_layernorm(hidden_states)
        attention_output = self.attention(layernorm_output, attention_mask, layer_past=layer_past)
        if self.get_key_value:
            attention_output, presents = attention_output
        layernorm_input = hidden_states + attention_output
        output = layernorm_input + self.mlp(self.post_attention_layernorm(layernorm_input))
        if self.get_key_value:
            output = [output, presents]
        return output


class GPT2Model(nn.Module):
    """pos_emb = 'rotary': no learned position embedding, position_ids unused."""

    def __init__(self, neox_args, get_key_value=True):
        super().__init__()
        self.word_embeddings = nn.Embedding(neox_args.padded_vocab_size, neox_args.hidden_size)
        self.layers = nn.ModuleList([
            ParallelTransformerLayer(neox_args, gpt2_attention_mask_func, i + 1,
                                     rotary=neox_args.pos_emb == 'rotary', get_key_value=get_key_value)
            for i in range(neox_args.num_layers)])
        self.final_layernorm = nn.LayerNorm(neox_args.hidden_size, eps=1e-5)

    def forward(self, model_inputs):
        input_ids, position_ids, attention_mask, layer_past = model_inputs
        # [b, s, h] -> [s, b, h]
        hidden_states = self.word_embeddings(input_ids).transpose(0, 1).contiguous()
        presents = []
        for i, layer in enumerate(self.layers):
            past = layer_past[i] if layer_past.numel() > 0 else torch.Tensor()
            hidden_states, present = layer(hidden_states, attention_mask, layer_past=past)
            presents.append(present)
        hidden_states = self.final_layernorm(hidden_states)
        logits = F.linear(hidden_states, self.word_embeddings.weight).transpose(0, 1).contiguous()
        return logits, torch.stack(presents)


# ---------------------------------------------------------------- megatron/text_generation_utils.py

def get_batch(neox_args, context_tokens):
    tokens = context_tokens.contiguous()
    attention_mask, _, position_ids = get_ltor_masks_and_position_ids(
        tokens, neox_args.tokenizer.eod, neox_args.reset_position_ids,
        neox_args.reset_attention_mask, neox_args.eod_mask_loss)
    return tokens, attention_mask, position_ids


def pad_batch(context_tokens: List[List[int]], pad_id: int, pad_len: int):
    context_lengths = []
    for tokens in context_tokens:
        context_length = len(tokens)
        if context_length < pad_len:
            tokens.extend([pad_id] * (pad_len - context_length))
        context_lengths.append(context_length)
    return context_tokens, context_lengths


def switch(val1, val2, boolean):
    boolean = boolean.type_as(val1)
    return (1 - boolean) * val1 + boolean * val2


def forward_model(neox_args, model, model_inputs):
    return model(model_inputs)


def stream_tokens(neox_args, model, context_tokens, eos_token_id=None, maximum_tokens=None):
    model.eval()
    context_tokens, context_lengths = pad_batch(context_tokens, pad_id=neox_args.tokenizer.eod,
                                                pad_len=neox_args.seq_length)
    context_tokens = torch.LongTensor(context_tokens)
    token_generation_start_index = torch.LongTensor(context_lengths)
    tokens, attention_mask, position_ids = get_batch(neox_args, context_tokens)

    eos_token_id = eos_token_id or neox_args.tokenizer.eod
    maximum_tokens = maximum_tokens or (neox_args.seq_length - token_generation_start_index.max().item() - 1)
    batch_size = context_tokens.size(0)
    token_index_to_generate = token_generation_start_index.min().item()
    first_token_index_to_generate = token_index_to_generate
    last_token_index_to_generate = min(neox_args.seq_length - 1, token_index_to_generate + maximum_tokens - 1)

    with torch.no_grad():
        state_is_done = torch.zeros([batch_size]).byte()
        layer_past = torch.Tensor()
        token_generation_end_index = torch.ones([batch_size]).long() * (-1)

        while token_index_to_generate <= last_token_index_to_generate:
            if token_index_to_generate == first_token_index_to_generate:
                tokens_to_use = tokens[:, :token_index_to_generate]
                positions_to_use = position_ids[:, :token_index_to_generate]
            else:
                tokens_to_use = tokens[:, token_index_to_generate - 1].view(batch_size, -1)
                positions_to_use = position_ids[:, token_index_to_generate - 1].view(batch_size, -1)
            model_inputs = (tokens_to_use, positions_to_use, attention_mask, layer_past)
            logits, layer_past = forward_model(neox_args, model, model_inputs)
            generated_token_logits = logits[:, -1].view(batch_size, -1).contiguous()

            generated_tokens = torch.argmax(generated_token_logits, dim=-1).view(-1)

            state_started = token_generation_start_index <= token_index_to_generate
            state_done = (generated_tokens == eos_token_id).byte() & state_started.byte()
            state_is_done = state_is_done | state_done
            token_generation_end_index[(state_started.byte() & ~state_is_done).bool()] = token_index_to_generate
            context_tokens[:, token_index_to_generate] = switch(
                context_tokens[:, token_index_to_generate].view(-1), generated_tokens, state_started)
            token_index_to_generate += 1
            yield context_tokens, token_generation_start_index, token_generation_end_index, state_is_done.bool()
            if torch.all(state_is_done):
                break


def main():
    torch.manual_seed(0)
    neox_args = SimpleNamespace(
        hidden_size=64, num_attention_heads=4, num_layers=2, padded_vocab_size=96,
        rotary_pct=1, rotary_emb_base=10000, pos_emb='rotary', attention_dropout=0.0,
        seq_length=20, reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        tokenizer=SimpleNamespace(eod=0),
    )
    model = GPT2Model(neox_args, get_key_value=True)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)

    prompts = [[11, 23, 5, 42, 17, 8, 31, 60, 9, 14],
               [7, 33, 51, 2, 19, 44, 28]]
    out = None
    for out in stream_tokens(neox_args, model, [list(p) for p in prompts], eos_token_id=95):
        pass
    context_tokens, start, end, _ = out
    for b in range(len(prompts)):
        print(f"row {b}: prompt {prompts[b]} -> generated "
              f"{context_tokens[b, start[b].item():end[b].item() + 1].tolist()}")


if __name__ == "__main__":
    main()
