# NeMo's attention encoder-decoder (Canary / MultiTaskAED) greedy decoding:
# nemo/collections/asr/modules/transformer/transformer_generators.py GreedySequenceGenerator._forward,
# before: NVIDIA/NeMo @8cfedd7203 (the loop hands `i` to `_one_step_forward` as `pos`);
# after:  NVIDIA-NeMo/Speech @21d5bb86623200933840c5ba91020f0459a8ed95 (`i += tgt_len - 1` on the cached steps;
#         read there, the PR that brought it in was not identified).
# The decoder is fed a multi-token task prompt (<|startoftranscript|><|en|><|transcribe|><|en|><|pnc|>...) at step 0,
# then one token per step with the earlier tokens' hidden states cached in decoder_mems_list. The step counter `i` was
# used as the new token's start position, so the first generated token was embedded at position 1 (already taken by the
# second prompt token) while the cache held the prompt at 0..tgt_len-1. The fix starts the cached steps at tgt_len.
import math
import sys
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.functional import gelu

FIXED = "--fixed" in sys.argv

NEG_INF = -10000.0


def form_attention_mask(input_mask, diagonal=None):
    if input_mask is None:
        return None
    attn_shape = (1, input_mask.shape[1], input_mask.shape[1])
    attn_mask = input_mask.to(dtype=bool).unsqueeze(1)
    if diagonal is not None:
        future_mask = torch.tril(torch.ones(attn_shape, dtype=torch.bool, device=input_mask.device), diagonal)
        attn_mask = attn_mask & future_mask
    attention_mask = (1 - attn_mask.to(torch.float)) * NEG_INF
    return attention_mask.unsqueeze(1)


def mask_padded_tokens(tokens, pad_id):
    mask = tokens != pad_id
    return mask


def transformer_weights_init(module, std_init_range=0.02, xavier=True):
    if isinstance(module, nn.Linear):
        if xavier:
            nn.init.xavier_uniform_(module.weight)
        else:
            nn.init.normal_(module.weight, mean=0.0, std=std_init_range)
        if module.bias is not None:
            nn.init.constant_(module.bias, 0.0)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=std_init_range)
    elif isinstance(module, nn.LayerNorm):
        nn.init.constant_(module.weight, 1.0)
        nn.init.constant_(module.bias, 0.0)


class FixedPositionalEncoding(nn.Module):
    def __init__(self, hidden_size, max_sequence_length=512):
        super().__init__()
        self._hidden_size = hidden_size
        self._max_sequence_length = max_sequence_length
        self._build_pos_enc(hidden_size=self._hidden_size, max_sequence_length=self._max_sequence_length)

    def _build_pos_enc(self, hidden_size, max_sequence_length, device=None):
        pos_enc = torch.zeros(max_sequence_length, hidden_size, device=device)
        position = torch.arange(0.0, max_sequence_length).unsqueeze(1)
        coef = -math.log(10000.0) / hidden_size
        div_term = torch.exp(coef * torch.arange(0.0, hidden_size, 2))
        pos_enc[:, 0::2] = torch.sin(position * div_term)
        pos_enc[:, 1::2] = torch.cos(position * div_term)
        pos_enc.div_(math.sqrt(hidden_size))
        self.register_buffer('pos_enc', pos_enc)

    def forward(self, position_ids):
        embeddings = torch.embedding(self.pos_enc, position_ids)
        return embeddings


class TransformerEmbedding(nn.Module):
    def __init__(
        self,
        vocab_size,
        hidden_size,
        max_sequence_length=512,
        num_token_types=2,
        embedding_dropout=0.0,
        learn_positional_encodings=False,
    ):
        super().__init__()
        self.max_sequence_length = max_sequence_length
        self.learn_positional_encodings = learn_positional_encodings
        self.token_embedding = nn.Embedding(vocab_size, hidden_size, padding_idx=0)
        if learn_positional_encodings:
            self.position_embedding = nn.Embedding(max_sequence_length, hidden_size)
        else:
            self.position_embedding = FixedPositionalEncoding(hidden_size, max_sequence_length)
        if num_token_types > 0:
            self.token_type_embedding = nn.Embedding(num_token_types, hidden_size)
        self.layer_norm = nn.LayerNorm(hidden_size, eps=1e-5)
        self.dropout = nn.Dropout(embedding_dropout)

    def forward(self, input_ids, token_type_ids=None, start_pos=0):
        seq_length = input_ids.size(1)
        position_ids = torch.arange(
            start=start_pos, end=start_pos + seq_length, dtype=torch.long, device=input_ids.device
        )
        position_ids = position_ids.unsqueeze(0).repeat(input_ids.size(0), 1)

        token_embeddings = self.token_embedding(input_ids)
        position_embeddings = self.position_embedding(position_ids)
        embeddings = token_embeddings + position_embeddings

        if token_type_ids is not None:
            token_type_embeddings = self.token_type_embedding(token_type_ids)
            embeddings = embeddings + token_type_embeddings

        embeddings = self.layer_norm(embeddings)
        embeddings = self.dropout(embeddings)
        return embeddings


class MultiHeadAttention(nn.Module):
    def __init__(self, hidden_size, num_attention_heads, attn_score_dropout=0.0, attn_layer_dropout=0.0):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.attn_head_size = int(hidden_size / num_attention_heads)
        self.attn_scale = math.sqrt(math.sqrt(self.attn_head_size))

        self.query_net = nn.Linear(hidden_size, hidden_size)
        self.key_net = nn.Linear(hidden_size, hidden_size)
        self.value_net = nn.Linear(hidden_size, hidden_size)
        self.out_projection = nn.Linear(hidden_size, hidden_size)

        self.attn_dropout = nn.Dropout(attn_score_dropout)
        self.layer_dropout = nn.Dropout(attn_layer_dropout)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attn_head_size)
        x = x.view(*new_x_shape)
        return x.permute(0, 2, 1, 3)

    def forward(self, queries, keys, values, attention_mask):
        query = self.query_net(queries)
        key = self.key_net(keys)
        value = self.value_net(values)
        query = self.transpose_for_scores(query) / self.attn_scale
        key = self.transpose_for_scores(key) / self.attn_scale
        value = self.transpose_for_scores(value)

        attention_scores = torch.matmul(query, key.transpose(-1, -2))
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask.to(attention_scores.dtype)
        attention_probs = torch.softmax(attention_scores, dim=-1)
        attention_probs = self.attn_dropout(attention_probs)

        context = torch.matmul(attention_probs, value)
        context_hidden_size = context.size()[-1] * self.num_attention_heads
        context = context.permute(0, 2, 1, 3).contiguous()
        new_context_shape = context.size()[:-2] + (context_hidden_size,)
        context = context.view(*new_context_shape)

        output_states = self.out_projection(context)
        output_states = self.layer_dropout(output_states)
        return output_states


class PositionWiseFF(nn.Module):
    def __init__(self, hidden_size, inner_size, ffn_dropout=0.0, hidden_act="relu"):
        super().__init__()
        self.dense_in = nn.Linear(hidden_size, inner_size)
        self.dense_out = nn.Linear(inner_size, hidden_size)
        self.layer_dropout = nn.Dropout(ffn_dropout)
        ACT2FN = {"gelu": gelu, "relu": torch.relu}
        self.act_fn = ACT2FN[hidden_act]

    def forward(self, hidden_states):
        output_states = self.dense_in(hidden_states)
        output_states = self.act_fn(output_states)
        output_states = self.dense_out(output_states)
        output_states = self.layer_dropout(output_states)
        return output_states


class TransformerDecoderBlock(nn.Module):
    def __init__(self, hidden_size, inner_size, num_attention_heads=1, attn_score_dropout=0.0,
                 attn_layer_dropout=0.0, ffn_dropout=0.0, hidden_act="relu", pre_ln=False):
        super().__init__()
        self.pre_ln = pre_ln
        self.layer_norm_1 = nn.LayerNorm(hidden_size, eps=1e-5)
        self.first_sub_layer = MultiHeadAttention(hidden_size, num_attention_heads, attn_score_dropout, attn_layer_dropout)
        self.layer_norm_2 = nn.LayerNorm(hidden_size, eps=1e-5)
        self.second_sub_layer = MultiHeadAttention(hidden_size, num_attention_heads, attn_score_dropout, attn_layer_dropout)
        self.layer_norm_3 = nn.LayerNorm(hidden_size, eps=1e-5)
        self.third_sub_layer = PositionWiseFF(hidden_size, inner_size, ffn_dropout, hidden_act)

    def forward_preln(self, decoder_query, decoder_mask, decoder_keys, encoder_states, encoder_mask):
        residual = decoder_query
        decoder_query = self.layer_norm_1(decoder_query)
        decoder_keys = self.layer_norm_1(decoder_keys)
        self_attn_output = self.first_sub_layer(decoder_query, decoder_keys, decoder_keys, decoder_mask)
        self_attn_output += residual

        residual = self_attn_output
        self_attn_output = self.layer_norm_2(self_attn_output)
        enc_dec_attn_output = self.second_sub_layer(self_attn_output, encoder_states, encoder_states, encoder_mask)
        enc_dec_attn_output += residual

        residual = enc_dec_attn_output
        enc_dec_attn_output = self.layer_norm_3(enc_dec_attn_output)
        output_states = self.third_sub_layer(enc_dec_attn_output)
        output_states += residual
        return output_states

    def forward_postln(self, decoder_query, decoder_mask, decoder_keys, encoder_states, encoder_mask):
        self_attn_output = self.first_sub_layer(decoder_query, decoder_keys, decoder_keys, decoder_mask)
        self_attn_output += decoder_query
        self_attn_output = self.layer_norm_1(self_attn_output)

        enc_dec_attn_output = self.second_sub_layer(self_attn_output, encoder_states, encoder_states, encoder_mask)
        enc_dec_attn_output += self_attn_output
        enc_dec_attn_output = self.layer_norm_2(enc_dec_attn_output)

        output_states = self.third_sub_layer(enc_dec_attn_output)
        output_states += enc_dec_attn_output
        return self.layer_norm_3(output_states)

    def forward(self, decoder_query, decoder_mask, decoder_keys, encoder_states, encoder_mask):
        if self.pre_ln:
            return self.forward_preln(decoder_query, decoder_mask, decoder_keys, encoder_states, encoder_mask)
        else:
            return self.forward_postln(decoder_query, decoder_mask, decoder_keys, encoder_states, encoder_mask)


class TransformerDecoder(nn.Module):
    def __init__(self, num_layers, hidden_size, inner_size, num_attention_heads=1, attn_score_dropout=0.0,
                 attn_layer_dropout=0.0, ffn_dropout=0.0, hidden_act="relu", pre_ln=False,
                 pre_ln_final_layer_norm=True):
        super().__init__()
        if pre_ln and pre_ln_final_layer_norm:
            self.final_layer_norm = nn.LayerNorm(hidden_size, eps=1e-5)
        else:
            self.final_layer_norm = None
        self.d_model = hidden_size
        self.layers = nn.ModuleList(
            [
                TransformerDecoderBlock(hidden_size, inner_size, num_attention_heads, attn_score_dropout,
                                        attn_layer_dropout, ffn_dropout, hidden_act, pre_ln)
                for _ in range(num_layers)
            ]
        )
        self.diagonal = 0

    def _get_memory_states(self, decoder_states, decoder_mems_list=None, i=0):
        if decoder_mems_list is not None:
            inp1 = torch.transpose(decoder_mems_list[i], 1, 2)  # Putting seq_len to last dim to handle export cases
            inp2 = torch.transpose(decoder_states, 1, 2)
            memory_states = torch.cat((inp1, inp2), dim=2)
            memory_states = torch.transpose(memory_states, 1, 2)  # Transposing back
        else:
            memory_states = decoder_states
        return memory_states

    def forward(self, decoder_states, decoder_mask, encoder_states, encoder_mask, decoder_mems_list=None,
                return_mems=False, return_mems_as_list=True):
        decoder_attn_mask = form_attention_mask(decoder_mask, diagonal=self.diagonal)
        encoder_attn_mask = form_attention_mask(encoder_mask)
        memory_states = self._get_memory_states(decoder_states, decoder_mems_list, 0)
        if return_mems:
            cached_mems_list = [memory_states]

        for i, layer in enumerate(self.layers):
            decoder_states = layer(decoder_states, decoder_attn_mask, memory_states, encoder_states, encoder_attn_mask)
            memory_states = self._get_memory_states(decoder_states, decoder_mems_list, i + 1)
            if return_mems:
                cached_mems_list.append(memory_states)

        if self.final_layer_norm is not None:
            decoder_states = self.final_layer_norm(decoder_states)
            memory_states = self._get_memory_states(decoder_states, decoder_mems_list, i + 2)
            if return_mems:
                cached_mems_list.append(memory_states)

        if return_mems:
            return cached_mems_list
        else:
            return memory_states


class MultiLayerPerceptron(nn.Module):
    def __init__(self, hidden_size, num_classes, num_layers=1, activation="relu", log_softmax=True):
        super().__init__()
        self.layers = 0
        for _ in range(num_layers - 1):
            layer = nn.Linear(hidden_size, hidden_size)
            setattr(self, f'layer{self.layers}', layer)
            setattr(self, f'layer{self.layers + 1}', getattr(torch, activation))
            self.layers += 2
        layer = nn.Linear(hidden_size, num_classes)
        setattr(self, f'layer{self.layers}', layer)
        self.layers += 1
        self.log_softmax = log_softmax

    def forward(self, hidden_states):
        output_states = hidden_states[:]
        for i in range(self.layers):
            output_states = getattr(self, f'layer{i}')(output_states)
        if self.log_softmax:
            output_states = torch.log_softmax(output_states, dim=-1)
        return output_states


class TokenClassifier(nn.Module):
    def __init__(self, hidden_size, num_classes, num_layers=1, activation="relu", log_softmax=True):
        super().__init__()
        self.mlp = MultiLayerPerceptron(hidden_size, num_classes, num_layers, activation, log_softmax)

    @property
    def log_softmax(self):
        return self.mlp.log_softmax

    @contextmanager
    def with_log_softmax_enabled(self, value: bool):
        prev = self.mlp.log_softmax
        self.mlp.log_softmax = value
        yield self
        self.mlp.log_softmax = prev

    def forward(self, hidden_states):
        return self.mlp(hidden_states)


class GreedySequenceGenerator:
    def __init__(self, embedding, decoder, classifier, pad=0, bos=1, eos=2, max_sequence_length=512,
                 max_delta_length=20, batch_size=1, n_samples=1, temperature=None):
        super().__init__()
        self.embedding = embedding
        self.decoder = decoder
        self.classifier = classifier
        self.pad, self.bos, self.eos = pad, bos, eos
        self.max_seq_length = max_sequence_length
        self.max_delta_len = max_delta_length
        self.batch_size = batch_size
        self.n_samples = n_samples
        self.temperature = temperature

    def _one_step_forward(
        self,
        decoder_input_ids=None,
        encoder_hidden_states=None,
        encoder_input_mask=None,
        decoder_mems_list=None,
        pos=0,
        return_scores: bool = True,
    ):
        decoder_hidden_states = self.embedding.forward(decoder_input_ids, start_pos=pos)
        decoder_input_mask = mask_padded_tokens(decoder_input_ids, self.pad).float()

        if encoder_hidden_states is not None:
            decoder_mems_list = self.decoder.forward(
                decoder_hidden_states,
                decoder_input_mask,
                encoder_hidden_states,
                encoder_input_mask,
                decoder_mems_list,
                return_mems=True,
            )
        else:
            decoder_mems_list = self.decoder.forward(
                decoder_hidden_states, decoder_input_mask, decoder_mems_list, return_mems=True
            )
        with self.classifier.with_log_softmax_enabled(return_scores) as clf:
            logits = clf.forward(hidden_states=decoder_mems_list[-1][:, -1:])
        return logits, decoder_mems_list

    def _prepare_for_search(self, decoder_input_ids=None, encoder_hidden_states=None):
        decoder_parameter = next(self.decoder.parameters())
        batch_size = self.batch_size

        if encoder_hidden_states is not None:
            batch_size, src_len, _ = encoder_hidden_states.size()
            if self.max_delta_len >= 0:
                max_seq_length = min(self.max_seq_length, src_len + self.max_delta_len)
            else:
                max_seq_length = self.max_seq_length
        else:
            max_seq_length = self.max_seq_length

        if decoder_input_ids is not None:
            tgt = decoder_input_ids
            batch_size, tgt_len = decoder_input_ids.size()
        else:
            tgt = torch.zeros(batch_size, 1).long().fill_(self.bos).to(decoder_parameter.device)
            tgt_len = 1
        max_generation_length = max_seq_length - tgt_len

        return tgt, batch_size, max_generation_length

    def _forward(self, decoder_input_ids=None, encoder_hidden_states=None, encoder_input_mask=None,
                 return_beam_scores=False):
        assert not return_beam_scores
        tgt, batch_size, max_generation_length = self._prepare_for_search(decoder_input_ids, encoder_hidden_states)
        tgt_len = tgt.size(-1)

        decoder_parameter = next(self.decoder.parameters())
        pad_profile = torch.zeros(batch_size).long().to(decoder_parameter.device)

        step_logprobs = []
        decoder_mems_list = None
        for i in range(max_generation_length):

            if i == 0:
                input_ids = tgt
            else:
                if FIXED:
                    i += tgt_len - 1
                input_ids = tgt[:, -1:]

            logits, decoder_mems_list = self._one_step_forward(
                input_ids,
                encoder_hidden_states,
                encoder_input_mask,
                decoder_mems_list,
                i,
                return_scores=return_beam_scores,
            )
            step_logprobs.append(torch.log_softmax(logits[:, -1], dim=-1))

            if self.temperature is None:  # Greedy decoding
                next_tokens = torch.argmax(logits[:, -1], dim=-1)

            next_tokens = self.pad * pad_profile + next_tokens * (1 - pad_profile)
            pad_profile = torch.max(pad_profile, (next_tokens == self.eos).long())
            tgt = torch.cat((tgt, next_tokens.unsqueeze(1)), dim=-1)

            if pad_profile.sum() == batch_size:
                break

        return tgt, torch.stack(step_logprobs, dim=1)

    def __call__(self, decoder_input_ids=None, encoder_hidden_states=None, encoder_input_mask=None,
                 return_beam_scores=False):
        with torch.inference_mode():
            return self._forward(decoder_input_ids, encoder_hidden_states, encoder_input_mask, return_beam_scores)


def main():
    torch.manual_seed(0)
    vocab_size, hidden, n_layers, n_heads = 48, 64, 2, 4
    pad, bos, eos = 0, 1, 2
    # Canary-style task prompt: <|startoftranscript|> <|en|> <|transcribe|> <|en|> <|pnc|> (ids 3..7 here)
    prompt = torch.tensor([[bos, 3, 4, 3, 5, 6, 7], [bos, 3, 4, 3, 5, 6, 7]])

    embedding = TransformerEmbedding(vocab_size, hidden, max_sequence_length=64, num_token_types=0)
    decoder = TransformerDecoder(n_layers, hidden, 4 * hidden, n_heads, pre_ln=True)
    classifier = TokenClassifier(hidden, vocab_size, num_layers=1, log_softmax=True)
    for module in (embedding, decoder, classifier):
        module.apply(transformer_weights_init)
        module.eval()

    # encoder output of two utterances of 9 and 6 frames (right padded), as the Conformer encoder hands it over
    enc_lens = torch.tensor([9, 6])
    encoder_hidden_states = torch.randn(2, 9, hidden)
    encoder_input_mask = (torch.arange(9)[None, :] < enc_lens[:, None]).float()

    generator = GreedySequenceGenerator(
        embedding=embedding,
        decoder=decoder,
        classifier=classifier,
        pad=pad,
        bos=bos,
        eos=eos,
        max_sequence_length=64,
        max_delta_length=3,
    )
    tgt, step_logprobs = generator(
        decoder_input_ids=prompt,
        encoder_hidden_states=encoder_hidden_states,
        encoder_input_mask=encoder_input_mask,
    )
    hyps = tgt[:, prompt.shape[1]:]
    print("fixed" if FIXED else "buggy")
    print("hypotheses (prompt stripped):", hyps.tolist())
    print("step log-prob of the chosen token:",
          [[round(float(v), 4) for v in row] for row in step_logprobs.max(dim=-1).values])


if __name__ == "__main__":
    main()
