# Citation: huggingface/transformers @00661e38a9e1393472adae9ac71f777b74ccdcde:
#   examples/flax/language-modeling/run_t5_mlm_flax.py (compute_input_and_target_lengths, shift_tokens_right,
#   FlaxDataCollatorForT5MLM.random_spans_noise_mask / create_sentinel_ids / filter_input_ids / __call__, group_texts)
#   and src/transformers/models/t5/modeling_t5.py (T5Attention._relative_position_bucket / compute_bias / forward,
#   T5LayerSelfAttention, T5LayerCrossAttention, T5Block, T5Stack, T5ForConditionalGeneration), ported to torch by hand.
# T5 span-corruption pre-training: texts are concatenated and cut into chunks of expanded_inputs_length; the
# collator picks random noise spans per row, replaces each span in the inputs by a sentinel id (counting up from
# tokenizer.vocab_size) and keeps only the spans, each after its sentinel, in the labels; both get an </s>.
# group_texts drops the short remainder "if the model supported [padding] instead of this drop": here the remainder
# chunk is kept, corrupted at its own length and right-padded (inputs with pad 0 and attention_mask 0, labels with
# -100 and decoder_attention_mask 0), which the torch T5 supports. decoder_input_ids are the labels shifted right
# behind decoder_start_token_id (= pad, 0).
# The model is T5 v1.1-shaped: the first block of each stack owns the relative-position-bucket embedding
# (bidirectional in the encoder, one-sided in the decoder); the stack adds its extended mask (0 / finfo.min) to that
# bias once and hands the sum to every later block. The decoder's extended mask is causal x decoder_attention_mask,
# and cross-attention gets the inverted encoder attention_mask added to a zero bias.
# jax.ops.segment_sum in _random_segmentation is written as np.bincount; the tokenizer is a stand-in with
# vocab_size / eos_token_id / pad_token_id.
# Self-check: every row run alone with its padding stripped gives the same encoder states, the same logits at its
# real target positions and the same loss; a greedy fill-in of the sentinels matches per row too, and one
# teacher-forced pass over the generated tokens reproduces every greedy step's logits.
import copy
import math

import numpy as np
import torch
from torch import nn
from torch.nn import CrossEntropyLoss

from transformers.models.t5.configuration_t5 import T5Config

torch.manual_seed(0)
np.random.seed(0)


# ----------------------------------------------------------------------------- data (run_t5_mlm_flax.py)

def compute_input_and_target_lengths(inputs_length, noise_density, mean_noise_span_length):
    def _tokens_length_to_inputs_length_targets_length(tokens_length):
        num_noise_tokens = int(round(tokens_length * noise_density))
        num_nonnoise_tokens = tokens_length - num_noise_tokens
        num_noise_spans = int(round(num_noise_tokens / mean_noise_span_length))
        # inputs contain all nonnoise tokens, sentinels for all noise spans
        # and one EOS token.
        _input_length = num_nonnoise_tokens + num_noise_spans + 1
        _output_length = num_noise_tokens + num_noise_spans + 1
        return _input_length, _output_length

    tokens_length = inputs_length

    while _tokens_length_to_inputs_length_targets_length(tokens_length + 1)[0] <= inputs_length:
        tokens_length += 1

    inputs_length, targets_length = _tokens_length_to_inputs_length_targets_length(tokens_length)

    # minor hack to get the targets length to be equal to inputs length
    # which is more likely to have been set to a nice round number.
    if noise_density == 0.5 and targets_length > inputs_length:
        tokens_length -= 1
        targets_length -= 1
    return tokens_length, targets_length


def shift_tokens_right(input_ids: np.ndarray, pad_token_id: int, decoder_start_token_id: int) -> np.ndarray:
    shifted_input_ids = np.zeros_like(input_ids)
    shifted_input_ids[:, 1:] = input_ids[:, :-1]
    shifted_input_ids[:, 0] = decoder_start_token_id

    shifted_input_ids = np.where(shifted_input_ids == -100, pad_token_id, shifted_input_ids)
    return shifted_input_ids


class WordTokenizer:
    """Stand-in for the T5 sentencepiece tokenizer: ids 0 = <pad>, 1 = </s>, 2 = <unk>, words from 3."""

    pad_token_id = 0
    eos_token_id = 1

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size

    def __call__(self, texts):
        ids = []
        for text in texts:
            ids.append([3 + (sum(ord(c) for c in w) % (self.vocab_size - 3)) for w in text.split()] + [self.eos_token_id])
        return {"input_ids": ids}


class DataCollatorForT5MLM:
    def __init__(self, tokenizer, noise_density, mean_noise_span_length, input_length, target_length,
                 pad_token_id, decoder_start_token_id):
        self.tokenizer = tokenizer
        self.noise_density = noise_density
        self.mean_noise_span_length = mean_noise_span_length
        self.input_length = input_length
        self.target_length = target_length
        self.pad_token_id = pad_token_id
        self.decoder_start_token_id = decoder_start_token_id

    def __call__(self, examples):
        rows_input_ids, rows_labels = [], []
        for example in examples:
            input_ids = np.asarray(example["input_ids"], dtype=np.int64)[None, :]
            expandend_input_length = input_ids.shape[1]

            mask_indices = np.asarray([self.random_spans_noise_mask(expandend_input_length)])
            labels_mask = ~mask_indices

            input_ids_sentinel = self.create_sentinel_ids(mask_indices.astype(np.int8))
            labels_sentinel = self.create_sentinel_ids(labels_mask.astype(np.int8))

            rows_input_ids.append(self.filter_input_ids(input_ids, input_ids_sentinel)[0])
            rows_labels.append(self.filter_input_ids(input_ids, labels_sentinel)[0])

        # full chunks come out at exactly input_length / target_length; the remainder chunk is right-padded
        batch_size = len(examples)
        input_ids = np.full((batch_size, self.input_length), self.pad_token_id, dtype=np.int64)
        attention_mask = np.zeros((batch_size, self.input_length), dtype=np.int64)
        labels = np.full((batch_size, self.target_length), -100, dtype=np.int64)
        decoder_attention_mask = np.zeros((batch_size, self.target_length), dtype=np.int64)
        for i, (inp, lab) in enumerate(zip(rows_input_ids, rows_labels)):
            if len(inp) > self.input_length or len(lab) > self.target_length:
                raise ValueError(f"row {i} is longer than input_length / target_length: {len(inp)}, {len(lab)}")
            input_ids[i, : len(inp)] = inp
            attention_mask[i, : len(inp)] = 1
            labels[i, : len(lab)] = lab
            decoder_attention_mask[i, : len(lab)] = 1

        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        batch["decoder_input_ids"] = shift_tokens_right(labels, self.pad_token_id, self.decoder_start_token_id)
        batch["decoder_attention_mask"] = decoder_attention_mask
        return {k: torch.from_numpy(v) for k, v in batch.items()}

    def create_sentinel_ids(self, mask_indices):
        start_indices = mask_indices - np.roll(mask_indices, 1, axis=-1) * mask_indices
        start_indices[:, 0] = mask_indices[:, 0]

        sentinel_ids = np.where(start_indices != 0, np.cumsum(start_indices, axis=-1), start_indices)
        sentinel_ids = np.where(sentinel_ids != 0, (sentinel_ids + self.tokenizer.vocab_size - 1), 0)
        sentinel_ids -= mask_indices - start_indices

        return sentinel_ids

    def filter_input_ids(self, input_ids, sentinel_ids):
        batch_size = input_ids.shape[0]

        input_ids_full = np.where(sentinel_ids != 0, sentinel_ids, input_ids)
        input_ids = input_ids_full[input_ids_full > 0].reshape((batch_size, -1))
        input_ids = np.concatenate(
            [input_ids, np.full((batch_size, 1), self.tokenizer.eos_token_id, dtype=np.int64)], axis=-1
        )
        return input_ids

    def random_spans_noise_mask(self, length):
        orig_length = length

        num_noise_tokens = int(np.round(length * self.noise_density))
        num_noise_tokens = min(max(num_noise_tokens, 1), length - 1)
        num_noise_spans = int(np.round(num_noise_tokens / self.mean_noise_span_length))

        num_noise_spans = max(num_noise_spans, 1)
        num_nonnoise_tokens = length - num_noise_tokens

        def _random_segmentation(num_items, num_segments):
            mask_indices = np.arange(num_items - 1) < (num_segments - 1)
            np.random.shuffle(mask_indices)
            first_in_segment = np.pad(mask_indices, [[1, 0]])
            segment_id = np.cumsum(first_in_segment)
            segment_length = np.bincount(segment_id, minlength=num_segments)
            return segment_length

        noise_span_lengths = _random_segmentation(num_noise_tokens, num_noise_spans)
        nonnoise_span_lengths = _random_segmentation(num_nonnoise_tokens, num_noise_spans)

        interleaved_span_lengths = np.reshape(
            np.stack([nonnoise_span_lengths, noise_span_lengths], axis=1), [num_noise_spans * 2]
        )
        span_starts = np.cumsum(interleaved_span_lengths)[:-1]
        span_start_indicator = np.zeros((length,), dtype=np.int8)
        span_start_indicator[span_starts] = True
        span_num = np.cumsum(span_start_indicator)
        is_noise = np.equal(span_num % 2, 1)

        return is_noise[:orig_length]


def group_texts(examples, expanded_inputs_length):
    concatenated_examples = {k: sum(examples[k], []) for k in examples.keys()}
    total_length = len(concatenated_examples[list(examples.keys())[0]])
    # the remainder is kept (and padded by the collator) instead of dropped
    result = {
        k: [t[i : i + expanded_inputs_length] for i in range(0, total_length, expanded_inputs_length)]
        for k, t in concatenated_examples.items()
    }
    return result


# ----------------------------------------------------------------------------- model (modeling_t5.py)

class T5LayerNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class T5DenseGatedActDense(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wi_0 = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wi_1 = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)
        self.dropout = nn.Dropout(config.dropout_rate)
        self.act = nn.GELU(approximate="tanh")

    def forward(self, hidden_states):
        hidden_gelu = self.act(self.wi_0(hidden_states))
        hidden_linear = self.wi_1(hidden_states)
        hidden_states = self.dropout(hidden_gelu * hidden_linear)
        return self.wo(hidden_states)


class T5LayerFF(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.DenseReluDense = T5DenseGatedActDense(config)
        self.layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states):
        forwarded_states = self.layer_norm(hidden_states)
        forwarded_states = self.DenseReluDense(forwarded_states)
        return hidden_states + self.dropout(forwarded_states)


class T5Attention(nn.Module):
    def __init__(self, config: T5Config, has_relative_attention_bias=False):
        super().__init__()
        self.is_decoder = config.is_decoder
        self.has_relative_attention_bias = has_relative_attention_bias
        self.relative_attention_num_buckets = config.relative_attention_num_buckets
        self.relative_attention_max_distance = config.relative_attention_max_distance
        self.d_model = config.d_model
        self.key_value_proj_dim = config.d_kv
        self.n_heads = config.num_heads
        self.dropout = config.dropout_rate
        self.inner_dim = self.n_heads * self.key_value_proj_dim

        self.q = nn.Linear(self.d_model, self.inner_dim, bias=False)
        self.k = nn.Linear(self.d_model, self.inner_dim, bias=False)
        self.v = nn.Linear(self.d_model, self.inner_dim, bias=False)
        self.o = nn.Linear(self.inner_dim, self.d_model, bias=False)

        if self.has_relative_attention_bias:
            self.relative_attention_bias = nn.Embedding(self.relative_attention_num_buckets, self.n_heads)

    @staticmethod
    def _relative_position_bucket(relative_position, bidirectional=True, num_buckets=32, max_distance=128):
        relative_buckets = 0
        if bidirectional:
            num_buckets //= 2
            relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
            relative_position = torch.abs(relative_position)
        else:
            relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
        # now relative_position is in the range [0, inf)

        max_exact = num_buckets // 2
        is_small = relative_position < max_exact

        relative_position_if_large = max_exact + (
            torch.log(relative_position.float() / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).to(torch.long)
        relative_position_if_large = torch.min(
            relative_position_if_large, torch.full_like(relative_position_if_large, num_buckets - 1)
        )

        relative_buckets += torch.where(is_small, relative_position, relative_position_if_large)
        return relative_buckets

    def compute_bias(self, query_length, key_length, device=None):
        context_position = torch.arange(query_length, dtype=torch.long, device=device)[:, None]
        memory_position = torch.arange(key_length, dtype=torch.long, device=device)[None, :]
        relative_position = memory_position - context_position  # shape (query_length, key_length)
        relative_position_bucket = self._relative_position_bucket(
            relative_position,
            bidirectional=(not self.is_decoder),
            num_buckets=self.relative_attention_num_buckets,
            max_distance=self.relative_attention_max_distance,
        )
        values = self.relative_attention_bias(relative_position_bucket)  # (query_length, key_length, n_heads)
        values = values.permute([2, 0, 1]).unsqueeze(0)  # (1, n_heads, query_length, key_length)
        return values

    def forward(self, hidden_states, mask=None, key_value_states=None, position_bias=None):
        batch_size, seq_length = hidden_states.shape[:2]
        real_seq_length = seq_length
        key_length = real_seq_length if key_value_states is None else key_value_states.shape[1]

        def shape(states):
            return states.view(batch_size, -1, self.n_heads, self.key_value_proj_dim).transpose(1, 2)

        def unshape(states):
            return states.transpose(1, 2).contiguous().view(batch_size, -1, self.inner_dim)

        query_states = shape(self.q(hidden_states))
        source = hidden_states if key_value_states is None else key_value_states
        key_states = shape(self.k(source))
        value_states = shape(self.v(source))

        # T5 does not scale the scores
        scores = torch.matmul(query_states, key_states.transpose(3, 2))

        if position_bias is None:
            if not self.has_relative_attention_bias:
                position_bias = torch.zeros(
                    (1, self.n_heads, real_seq_length, key_length), device=scores.device, dtype=scores.dtype
                )
            else:
                position_bias = self.compute_bias(real_seq_length, key_length, device=scores.device)

            if mask is not None:
                position_bias = position_bias + mask  # (batch_size, n_heads, seq_length, key_length)

        scores += position_bias
        attn_weights = nn.functional.softmax(scores.float(), dim=-1).type_as(scores)
        attn_weights = nn.functional.dropout(attn_weights, p=self.dropout, training=self.training)

        attn_output = unshape(torch.matmul(attn_weights, value_states))
        attn_output = self.o(attn_output)
        return attn_output, position_bias


class T5LayerSelfAttention(nn.Module):
    def __init__(self, config, has_relative_attention_bias=False):
        super().__init__()
        self.SelfAttention = T5Attention(config, has_relative_attention_bias=has_relative_attention_bias)
        self.layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states, attention_mask=None, position_bias=None):
        normed_hidden_states = self.layer_norm(hidden_states)
        attention_output = self.SelfAttention(normed_hidden_states, mask=attention_mask, position_bias=position_bias)
        hidden_states = hidden_states + self.dropout(attention_output[0])
        return (hidden_states,) + attention_output[1:]


class T5LayerCrossAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.EncDecAttention = T5Attention(config, has_relative_attention_bias=False)
        self.layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states, key_value_states, attention_mask=None, position_bias=None):
        normed_hidden_states = self.layer_norm(hidden_states)
        attention_output = self.EncDecAttention(
            normed_hidden_states, mask=attention_mask, key_value_states=key_value_states, position_bias=position_bias
        )
        layer_output = hidden_states + self.dropout(attention_output[0])
        return (layer_output,) + attention_output[1:]


class T5Block(nn.Module):
    def __init__(self, config, has_relative_attention_bias=False):
        super().__init__()
        self.is_decoder = config.is_decoder
        self.layer = nn.ModuleList()
        self.layer.append(T5LayerSelfAttention(config, has_relative_attention_bias=has_relative_attention_bias))
        if self.is_decoder:
            self.layer.append(T5LayerCrossAttention(config))
        self.layer.append(T5LayerFF(config))

    def forward(self, hidden_states, attention_mask=None, position_bias=None, encoder_hidden_states=None,
                encoder_attention_mask=None, encoder_decoder_position_bias=None):
        self_attention_outputs = self.layer[0](hidden_states, attention_mask=attention_mask, position_bias=position_bias)
        hidden_states = self_attention_outputs[0]
        attention_outputs = self_attention_outputs[1:]

        if self.is_decoder and encoder_hidden_states is not None:
            cross_attention_outputs = self.layer[1](
                hidden_states,
                key_value_states=encoder_hidden_states,
                attention_mask=encoder_attention_mask,
                position_bias=encoder_decoder_position_bias,
            )
            hidden_states = cross_attention_outputs[0]
            attention_outputs = attention_outputs + cross_attention_outputs[1:]

        hidden_states = self.layer[-1](hidden_states)
        return (hidden_states,) + attention_outputs


class T5Stack(nn.Module):
    def __init__(self, config, embed_tokens):
        super().__init__()
        self.config = config
        self.embed_tokens = embed_tokens
        self.is_decoder = config.is_decoder
        self.block = nn.ModuleList(
            [T5Block(config, has_relative_attention_bias=bool(i == 0)) for i in range(config.num_layers)]
        )
        self.final_layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def get_extended_attention_mask(self, attention_mask, input_shape, dtype):
        if attention_mask.dim() == 3:
            extended_attention_mask = attention_mask[:, None, :, :]
        elif attention_mask.dim() == 2:
            if self.is_decoder:
                batch_size, seq_length = input_shape
                seq_ids = torch.arange(seq_length, device=attention_mask.device)
                causal_mask = seq_ids[None, None, :].repeat(batch_size, seq_length, 1) <= seq_ids[None, :, None]
                causal_mask = causal_mask.to(attention_mask.dtype)
                extended_attention_mask = causal_mask[:, None, :, :] * attention_mask[:, None, None, :]
            else:
                extended_attention_mask = attention_mask[:, None, None, :]
        else:
            raise ValueError(f"Wrong shape for input_ids (shape {input_shape}) or attention_mask")
        extended_attention_mask = extended_attention_mask.to(dtype=dtype)
        return (1.0 - extended_attention_mask) * torch.finfo(dtype).min

    @staticmethod
    def invert_attention_mask(encoder_attention_mask, dtype):
        encoder_extended_attention_mask = encoder_attention_mask[:, None, None, :].to(dtype=dtype)
        return (1.0 - encoder_extended_attention_mask) * torch.finfo(dtype).min

    def forward(self, input_ids, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None):
        input_shape = input_ids.size()
        inputs_embeds = self.embed_tokens(input_ids)
        batch_size, seq_length = input_shape

        if attention_mask is None:
            attention_mask = torch.ones(batch_size, seq_length, device=inputs_embeds.device)
        if self.is_decoder and encoder_attention_mask is None and encoder_hidden_states is not None:
            encoder_seq_length = encoder_hidden_states.shape[1]
            encoder_attention_mask = torch.ones(batch_size, encoder_seq_length, device=inputs_embeds.device,
                                                dtype=torch.long)

        extended_attention_mask = self.get_extended_attention_mask(attention_mask, input_shape, inputs_embeds.dtype)

        if self.is_decoder and encoder_hidden_states is not None:
            encoder_extended_attention_mask = self.invert_attention_mask(encoder_attention_mask, inputs_embeds.dtype)
        else:
            encoder_extended_attention_mask = None

        position_bias = None
        encoder_decoder_position_bias = None

        hidden_states = self.dropout(inputs_embeds)
        for layer_module in self.block:
            layer_outputs = layer_module(
                hidden_states,
                attention_mask=extended_attention_mask,
                position_bias=position_bias,
                encoder_hidden_states=encoder_hidden_states,
                encoder_attention_mask=encoder_extended_attention_mask,
                encoder_decoder_position_bias=encoder_decoder_position_bias,
            )
            hidden_states = layer_outputs[0]
            # the first layer's position bias (with the mask added) is shared by the layers after it
            position_bias = layer_outputs[1]
            if self.is_decoder and encoder_hidden_states is not None:
                encoder_decoder_position_bias = layer_outputs[2]

        hidden_states = self.final_layer_norm(hidden_states)
        return self.dropout(hidden_states)


class T5ForConditionalGeneration(nn.Module):
    def __init__(self, config: T5Config):
        super().__init__()
        self.config = config
        self.model_dim = config.d_model
        self.shared = nn.Embedding(config.vocab_size, config.d_model)

        encoder_config = copy.deepcopy(config)
        encoder_config.is_decoder = False
        encoder_config.use_cache = False
        self.encoder = T5Stack(encoder_config, self.shared)

        decoder_config = copy.deepcopy(config)
        decoder_config.is_decoder = True
        decoder_config.num_layers = config.num_decoder_layers
        self.decoder = T5Stack(decoder_config, self.shared)

        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
                labels=None, encoder_outputs=None):
        if encoder_outputs is None:
            encoder_outputs = self.encoder(input_ids=input_ids, attention_mask=attention_mask)
        hidden_states = encoder_outputs

        decoder_outputs = self.decoder(
            input_ids=decoder_input_ids,
            attention_mask=decoder_attention_mask,
            encoder_hidden_states=hidden_states,
            encoder_attention_mask=attention_mask,
        )
        lm_logits = self.lm_head(decoder_outputs)

        loss = None
        if labels is not None:
            loss_fct = CrossEntropyLoss(ignore_index=-100)
            loss = loss_fct(lm_logits.view(-1, lm_logits.size(-1)), labels.view(-1))
        return loss, lm_logits, encoder_outputs


@torch.no_grad()
def greedy_fill(model, input_ids, attention_mask, max_new_tokens, decoder_start_token_id, eos_token_id, pad_token_id):
    """Greedy decoding that re-runs the decoder over the whole prefix, reusing the encoder outputs."""
    encoder_outputs = model.encoder(input_ids=input_ids, attention_mask=attention_mask)
    batch_size = input_ids.shape[0]
    decoder_input_ids = torch.full((batch_size, 1), decoder_start_token_id, dtype=torch.long)
    finished = torch.zeros(batch_size, dtype=torch.bool)
    step_logits = []
    for _ in range(max_new_tokens):
        _, logits, _ = model(attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
                             encoder_outputs=encoder_outputs)
        next_logits = logits[:, -1, :]
        step_logits.append(next_logits)
        next_tokens = next_logits.argmax(-1)
        next_tokens = torch.where(finished, torch.full_like(next_tokens, pad_token_id), next_tokens)
        decoder_input_ids = torch.cat([decoder_input_ids, next_tokens[:, None]], dim=-1)
        finished |= next_tokens == eos_token_id
    return decoder_input_ids, torch.stack(step_logits, dim=1)


def main():
    tokenizer = WordTokenizer(vocab_size=50)
    config = T5Config(
        vocab_size=64,  # room for the sentinels counted up from tokenizer.vocab_size
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        feed_forward_proj="gated-gelu",
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )

    max_seq_length = 24
    noise_density, mean_noise_span_length = 0.15, 2.0
    expanded_inputs_length, targets_length = compute_input_and_target_lengths(
        inputs_length=max_seq_length, noise_density=noise_density, mean_noise_span_length=mean_noise_span_length
    )

    texts = [
        "the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat",
        "a tiny model learns to fill in the missing spans of text from the corrupted input",
        "sentinel tokens mark where each span was cut out of the sequence",
        "the relative position buckets are shared by every layer of the stack after the first one",
        "padding keeps the remainder",
    ]
    tokenized = tokenizer(texts)
    grouped = group_texts(tokenized, expanded_inputs_length)
    chunks = [{"input_ids": ids} for ids in grouped["input_ids"]]
    # several full chunks and a short remainder: the remainder row is padded
    assert len(chunks[-1]["input_ids"]) < expanded_inputs_length

    collator = DataCollatorForT5MLM(
        tokenizer=tokenizer,
        noise_density=noise_density,
        mean_noise_span_length=mean_noise_span_length,
        input_length=max_seq_length,
        target_length=targets_length,
        pad_token_id=config.pad_token_id,
        decoder_start_token_id=config.decoder_start_token_id,
    )
    batch = collator(chunks)
    assert int(batch["attention_mask"][-1].sum()) < max_seq_length
    assert int(batch["decoder_attention_mask"][-1].sum()) < targets_length

    model = T5ForConditionalGeneration(config)
    # a few span-corruption training steps on the padded batch
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(5):
        loss, _, _ = model(**batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()

    with torch.no_grad():
        loss, logits, encoder_outputs = model(**batch)

        total_nll = 0.0
        total_tokens = 0
        for i in range(batch["input_ids"].shape[0]):
            n_in = int(batch["attention_mask"][i].sum())
            n_tgt = int(batch["decoder_attention_mask"][i].sum())
            ref_loss, ref_logits, ref_enc = model(
                input_ids=batch["input_ids"][i : i + 1, :n_in],
                decoder_input_ids=batch["decoder_input_ids"][i : i + 1, :n_tgt],
                labels=batch["labels"][i : i + 1, :n_tgt],
            )
            torch.testing.assert_close(encoder_outputs[i, :n_in], ref_enc[0], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(logits[i, :n_tgt], ref_logits[0], atol=1e-5, rtol=1e-4)
            total_nll += float(ref_loss) * n_tgt
            total_tokens += n_tgt
        torch.testing.assert_close(float(loss), total_nll / total_tokens, atol=1e-5, rtol=1e-5)

        generated, step_logits = greedy_fill(
            model, batch["input_ids"], batch["attention_mask"], max_new_tokens=targets_length,
            decoder_start_token_id=config.decoder_start_token_id, eos_token_id=config.eos_token_id,
            pad_token_id=config.pad_token_id,
        )
        # one teacher-forced pass over the generated prefix gives each step's logits (the decoder is causal)
        _, forced_logits, _ = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                    decoder_input_ids=generated[:, :-1])
        for i in range(batch["input_ids"].shape[0]):
            n_in = int(batch["attention_mask"][i].sum())
            ref_generated, ref_step_logits = greedy_fill(
                model, batch["input_ids"][i : i + 1, :n_in], None, max_new_tokens=targets_length,
                decoder_start_token_id=config.decoder_start_token_id, eos_token_id=config.eos_token_id,
                pad_token_id=config.pad_token_id,
            )
            eos_at = (ref_generated[0] == config.eos_token_id).nonzero()
            n_steps = int(eos_at[0]) if len(eos_at) else targets_length
            assert torch.equal(generated[i, : n_steps + 1], ref_generated[0, : n_steps + 1])
            torch.testing.assert_close(step_logits[i, :n_steps], ref_step_logits[0, :n_steps], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(forced_logits[i, :n_steps], step_logits[i, :n_steps], atol=1e-5, rtol=1e-4)

    print(f"span-corruption batch {tuple(batch['input_ids'].shape)} -> labels {tuple(batch['labels'].shape)}, "
          f"loss {float(loss):.4f}; every row matches its unpadded run")


if __name__ == "__main__":
    main()
