# huggingface/transformers#4499: "[T5] Fix Cross Attention position bias"
# T5Stack.forward shares the first block's position biases with the later blocks. In T5 the encoder padding mask is
# folded into that bias (T5Attention adds `mask` to `position_bias` only when it computes it). With output_attentions
# on, the block's outputs are (hidden, present, self weights, self bias, cross weights, cross bias) and T5Stack took
# index 4 (the cross-attention *weights*) as encoder_decoder_position_bias: every later block's cross-attention added
# softmax probabilities instead of bias + mask, so it attended to padded source tokens. The fix takes index 5.
# Torch port of src/transformers/modeling_t5.py around the fix (T5Attention, T5Block, T5Stack), config from T5Config.
import copy
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn
from transformers import T5Config

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class T5LayerNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x / torch.sqrt(variance + self.variance_epsilon)
        return self.weight * x


class T5DenseReluDense(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wi = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states):
        return self.wo(self.dropout(F.relu(self.wi(hidden_states))))


class T5LayerFF(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.DenseReluDense = T5DenseReluDense(config)
        self.layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states):
        return hidden_states + self.dropout(self.DenseReluDense(self.layer_norm(hidden_states)))


class T5Attention(nn.Module):
    def __init__(self, config, has_relative_attention_bias=False):
        super().__init__()
        self.is_decoder = config.is_decoder
        self.has_relative_attention_bias = has_relative_attention_bias
        self.relative_attention_num_buckets = config.relative_attention_num_buckets
        self.d_model, self.d_kv, self.n_heads = config.d_model, config.d_kv, config.num_heads
        self.dropout = config.dropout_rate
        self.inner_dim = self.n_heads * self.d_kv
        self.q = nn.Linear(self.d_model, self.inner_dim, bias=False)
        self.k = nn.Linear(self.d_model, self.inner_dim, bias=False)
        self.v = nn.Linear(self.d_model, self.inner_dim, bias=False)
        self.o = nn.Linear(self.inner_dim, self.d_model, bias=False)
        if self.has_relative_attention_bias:
            self.relative_attention_bias = nn.Embedding(self.relative_attention_num_buckets, self.n_heads)

    @staticmethod
    def _relative_position_bucket(relative_position, bidirectional=True, num_buckets=32, max_distance=128):
        ret = 0
        n = -relative_position
        if bidirectional:
            num_buckets //= 2
            ret += (n < 0).to(torch.long) * num_buckets
            n = torch.abs(n)
        else:
            n = torch.max(n, torch.zeros_like(n))
        max_exact = num_buckets // 2
        is_small = n < max_exact
        val_if_large = max_exact + (
            torch.log(n.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
        ).to(torch.long)
        val_if_large = torch.min(val_if_large, torch.full_like(val_if_large, num_buckets - 1))
        ret += torch.where(is_small, n, val_if_large)
        return ret

    def compute_bias(self, qlen, klen):
        context_position = torch.arange(qlen, dtype=torch.long)[:, None]
        memory_position = torch.arange(klen, dtype=torch.long)[None, :]
        relative_position = memory_position - context_position
        rp_bucket = self._relative_position_bucket(relative_position, bidirectional=not self.is_decoder,
                                                   num_buckets=self.relative_attention_num_buckets)
        values = self.relative_attention_bias(rp_bucket)  # (qlen, klen, num_heads)
        return values.permute([2, 0, 1]).unsqueeze(0)  # (1, num_heads, qlen, klen)

    def forward(self, input, mask=None, kv=None, position_bias=None, past_key_value_state=None, head_mask=None,
                query_length=None, use_cache=False, output_attentions=False):
        bs, qlen, dim = input.size()
        if past_key_value_state is not None:
            real_qlen = qlen + past_key_value_state[0].shape[2] if query_length is None else query_length
        else:
            real_qlen = qlen
        klen = real_qlen if kv is None else kv.size(1)

        def shape(x):
            return x.view(bs, -1, self.n_heads, self.d_kv).transpose(1, 2)

        def unshape(x):
            return x.transpose(1, 2).contiguous().view(bs, -1, self.inner_dim)

        q = shape(self.q(input))
        if kv is None:
            k = shape(self.k(input))
            v = shape(self.v(input))
        elif past_key_value_state is None:
            k = v = kv
            k = shape(self.k(k))
            v = shape(self.v(v))

        if past_key_value_state is not None:
            if kv is None:
                k_, v_ = past_key_value_state
                k = torch.cat([k_, k], dim=2)
                v = torch.cat([v_, v], dim=2)
            else:
                k, v = past_key_value_state

        if self.is_decoder and use_cache is True:
            present_key_value_state = ((k, v),)
        else:
            present_key_value_state = (None,)

        scores = torch.einsum("bnqd,bnkd->bnqk", q, k)  # (bs, n_heads, qlen, klen)

        if position_bias is None:
            if not self.has_relative_attention_bias:
                raise ValueError("No position_bias provided and no weights to compute position_bias")
            position_bias = self.compute_bias(real_qlen, klen)
            if past_key_value_state is not None:
                position_bias = position_bias[:, :, -1:, :]
            if mask is not None:
                position_bias = position_bias + mask  # (bs, n_heads, qlen, klen)

        scores += position_bias
        weights = F.softmax(scores.float(), dim=-1).type_as(scores)
        self.last_weights = weights.detach()
        weights = F.dropout(weights, p=self.dropout, training=self.training)
        if head_mask is not None:
            weights = weights * head_mask
        context = self.o(unshape(torch.matmul(weights, v)))

        outputs = (context,) + present_key_value_state
        if output_attentions:
            outputs = outputs + (weights,)
        if self.has_relative_attention_bias:
            outputs = outputs + (position_bias,)
        return outputs


class T5LayerSelfAttention(nn.Module):
    def __init__(self, config, has_relative_attention_bias=False):
        super().__init__()
        self.SelfAttention = T5Attention(config, has_relative_attention_bias=has_relative_attention_bias)
        self.layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states, attention_mask=None, position_bias=None, head_mask=None,
                past_key_value_state=None, use_cache=False, output_attentions=False):
        attention_output = self.SelfAttention(self.layer_norm(hidden_states), mask=attention_mask,
                                              position_bias=position_bias, head_mask=head_mask,
                                              past_key_value_state=past_key_value_state, use_cache=use_cache,
                                              output_attentions=output_attentions)
        layer_output = hidden_states + self.dropout(attention_output[0])
        return (layer_output,) + attention_output[1:]


class T5LayerCrossAttention(nn.Module):
    def __init__(self, config, has_relative_attention_bias=False):
        super().__init__()
        self.EncDecAttention = T5Attention(config, has_relative_attention_bias=has_relative_attention_bias)
        self.layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states, kv, attention_mask=None, position_bias=None, head_mask=None,
                past_key_value_state=None, use_cache=False, query_length=None, output_attentions=False):
        attention_output = self.EncDecAttention(self.layer_norm(hidden_states), mask=attention_mask, kv=kv,
                                                position_bias=position_bias, head_mask=head_mask,
                                                past_key_value_state=past_key_value_state, use_cache=use_cache,
                                                query_length=query_length, output_attentions=output_attentions)
        layer_output = hidden_states + self.dropout(attention_output[0])
        return (layer_output,) + attention_output[1:]


class T5Block(nn.Module):
    def __init__(self, config, has_relative_attention_bias=False):
        super().__init__()
        self.is_decoder = config.is_decoder
        self.layer = nn.ModuleList()
        self.layer.append(T5LayerSelfAttention(config, has_relative_attention_bias=has_relative_attention_bias))
        if self.is_decoder:
            self.layer.append(T5LayerCrossAttention(config, has_relative_attention_bias=has_relative_attention_bias))
        self.layer.append(T5LayerFF(config))

    def forward(self, hidden_states, attention_mask=None, position_bias=None, encoder_hidden_states=None,
                encoder_attention_mask=None, encoder_decoder_position_bias=None, head_mask=None,
                past_key_value_state=None, use_cache=False, output_attentions=False):
        if past_key_value_state is not None:
            self_attn_past_key_value_state = past_key_value_state[:2]
            cross_attn_past_key_value_state = past_key_value_state[2:]
        else:
            self_attn_past_key_value_state, cross_attn_past_key_value_state = None, None

        self_attention_outputs = self.layer[0](hidden_states, attention_mask=attention_mask,
                                               position_bias=position_bias, head_mask=head_mask,
                                               past_key_value_state=self_attn_past_key_value_state,
                                               use_cache=use_cache, output_attentions=output_attentions)
        hidden_states, present_key_value_state = self_attention_outputs[:2]
        attention_outputs = self_attention_outputs[2:]

        if self.is_decoder and encoder_hidden_states is not None:
            query_length = present_key_value_state[0].shape[2] if present_key_value_state is not None else None
            cross_attention_outputs = self.layer[1](hidden_states, kv=encoder_hidden_states,
                                                    attention_mask=encoder_attention_mask,
                                                    position_bias=encoder_decoder_position_bias, head_mask=head_mask,
                                                    past_key_value_state=cross_attn_past_key_value_state,
                                                    query_length=query_length, use_cache=use_cache,
                                                    output_attentions=output_attentions)
            hidden_states = cross_attention_outputs[0]
            if present_key_value_state is not None:
                present_key_value_state = present_key_value_state + cross_attention_outputs[1]
            attention_outputs = attention_outputs + cross_attention_outputs[2:]

        hidden_states = self.layer[-1](hidden_states)
        # hidden-states, present_key_value_states, (self-attention weights), (self-attention position bias),
        # (cross-attention weights), (cross-attention position bias)
        return (hidden_states,) + (present_key_value_state,) + attention_outputs


class T5Stack(nn.Module):
    def __init__(self, config, embed_tokens=None):
        super().__init__()
        self.output_attentions = config.output_attentions
        self.embed_tokens = embed_tokens
        self.is_decoder = config.is_decoder
        self.block = nn.ModuleList(
            [T5Block(config, has_relative_attention_bias=bool(i == 0)) for i in range(config.num_layers)])
        self.final_layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def get_extended_attention_mask(self, attention_mask, input_shape):
        if self.is_decoder:
            batch_size, seq_length = input_shape
            seq_ids = torch.arange(seq_length)
            causal_mask = seq_ids[None, None, :].repeat(batch_size, seq_length, 1) <= seq_ids[None, :, None]
            causal_mask = causal_mask.to(attention_mask.dtype)
            extended_attention_mask = causal_mask[:, None, :, :] * attention_mask[:, None, None, :]
        else:
            extended_attention_mask = attention_mask[:, None, None, :]
        return (1.0 - extended_attention_mask.float()) * -10000.0

    @staticmethod
    def invert_attention_mask(encoder_attention_mask):
        encoder_extended_attention_mask = encoder_attention_mask[:, None, None, :].float()
        return (1.0 - encoder_extended_attention_mask) * -1e9

    def forward(self, input_ids=None, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                past_key_value_states=None, use_cache=False):
        input_shape = input_ids.size()
        inputs_embeds = self.embed_tokens(input_ids)
        batch_size, seq_length = input_shape
        mask_seq_length = past_key_value_states[0][0].shape[2] + seq_length if past_key_value_states is not None \
            else seq_length
        if attention_mask is None:
            attention_mask = torch.ones(batch_size, mask_seq_length)
        if past_key_value_states is None:
            past_key_value_states = [None] * len(self.block)

        extended_attention_mask = self.get_extended_attention_mask(attention_mask, input_shape)
        if past_key_value_states[0] is not None:
            extended_attention_mask = extended_attention_mask[:, :, -1:, :]
        if self.is_decoder and encoder_attention_mask is not None:
            encoder_extended_attention_mask = self.invert_attention_mask(encoder_attention_mask)
        else:
            encoder_extended_attention_mask = None

        present_key_value_states = ()
        all_attentions = ()
        position_bias = None
        encoder_decoder_position_bias = None
        hidden_states = self.dropout(inputs_embeds)

        for i, (layer_module, past_key_value_state) in enumerate(zip(self.block, past_key_value_states)):
            layer_outputs = layer_module(hidden_states, attention_mask=extended_attention_mask,
                                         position_bias=position_bias, encoder_hidden_states=encoder_hidden_states,
                                         encoder_attention_mask=encoder_extended_attention_mask,
                                         encoder_decoder_position_bias=encoder_decoder_position_bias,
                                         past_key_value_state=past_key_value_state, use_cache=use_cache,
                                         output_attentions=self.output_attentions)
            hidden_states, present_key_value_state = layer_outputs[:2]
            if i == 0:
                # We share the position biases between the layers - the first layer store them
                position_bias = layer_outputs[3 if self.output_attentions else 2]
                if self.is_decoder and encoder_hidden_states is not None:
                    if FIXED:
                        encoder_decoder_position_bias = layer_outputs[5 if self.output_attentions else 3]
                    else:
                        encoder_decoder_position_bias = layer_outputs[4 if self.output_attentions else 3]
            present_key_value_states = present_key_value_states + (present_key_value_state,)
            if self.output_attentions:
                all_attentions = all_attentions + (layer_outputs[2],)

        hidden_states = self.dropout(self.final_layer_norm(hidden_states))
        outputs = (hidden_states,)
        if use_cache is True:
            outputs = outputs + (present_key_value_states,)
        if self.output_attentions:
            outputs = outputs + (all_attentions,)
        return outputs


class T5ForConditionalGeneration(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model_dim = config.d_model
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        encoder_config = copy.deepcopy(config)
        self.encoder = T5Stack(encoder_config, self.shared)
        decoder_config = copy.deepcopy(config)
        decoder_config.is_decoder = True
        self.decoder = T5Stack(decoder_config, self.shared)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, input_ids=None, attention_mask=None, encoder_outputs=None, decoder_input_ids=None,
                decoder_attention_mask=None, decoder_past_key_value_states=None, use_cache=False, lm_labels=None):
        if encoder_outputs is None:
            encoder_outputs = self.encoder(input_ids=input_ids, attention_mask=attention_mask)
        hidden_states = encoder_outputs[0]
        if decoder_past_key_value_states is not None:
            decoder_input_ids = decoder_input_ids[:, -1:]
        decoder_outputs = self.decoder(input_ids=decoder_input_ids, attention_mask=decoder_attention_mask,
                                       past_key_value_states=decoder_past_key_value_states,
                                       encoder_hidden_states=hidden_states, encoder_attention_mask=attention_mask,
                                       use_cache=use_cache)
        sequence_output = decoder_outputs[0] * (self.model_dim ** -0.5)
        lm_logits = self.lm_head(sequence_output)
        decoder_outputs = (lm_logits,) + decoder_outputs[1:]
        if lm_labels is not None:
            loss = F.cross_entropy(lm_logits.view(-1, lm_logits.size(-1)), lm_labels.view(-1), ignore_index=-100)
            decoder_outputs = (loss,) + decoder_outputs
        return decoder_outputs + encoder_outputs


# attention maps wanted for inspection -> output_attentions=True in the config (transformers 2.x style)
config = T5Config(vocab_size=40, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.1,
                  output_attentions=True, pad_token_id=0)
model = T5ForConditionalGeneration(config)

# "translate English to German: ..." batch, right-padded with pad_token_id=0, attention_mask from the tokenizer
input_ids = torch.tensor([[11, 12, 13, 14, 15, 16, 1], [21, 22, 23, 1, 0, 0, 0]])
attention_mask = (input_ids != 0).long()
lm_labels = torch.tensor([[31, 32, 33, 1], [34, 35, 1, -100]])
decoder_input_ids = torch.cat([torch.zeros(2, 1, dtype=torch.long), lm_labels[:, :-1].clamp(min=0)], 1)
decoder_attention_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])

optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model.train()
outputs = model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
                decoder_attention_mask=decoder_attention_mask, lm_labels=lm_labels)
outputs[0].backward()
optimizer.step()
optimizer.zero_grad()
print("train loss %.4f" % outputs[0].item())

# greedy decoding with the cache, as generate() drives it
model.eval()
with torch.no_grad():
    encoder_outputs = model.encoder(input_ids=input_ids, attention_mask=attention_mask)
    ys, past = torch.zeros(2, 1, dtype=torch.long), None
    for step in range(4):
        out = model(encoder_outputs=encoder_outputs, attention_mask=attention_mask, decoder_input_ids=ys,
                    decoder_past_key_value_states=past, use_cache=True)
        past = out[1]
        ys = torch.cat([ys, out[0][:, -1].argmax(-1, keepdim=True)], 1)
        w = model.decoder.block[1].layer[1].EncDecAttention.last_weights  # block 1 cross-attention
        print("step %d: block-1 cross-attention weight on the short source's padding: %.4f"
              % (step, w[1, :, -1, 4:].sum(-1).mean().item()))
    print("greedy:", ys.tolist())
