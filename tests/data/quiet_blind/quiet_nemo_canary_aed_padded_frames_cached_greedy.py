# Correct program (quiet batch quiet-r79b).
#
# Ported from NVIDIA/NeMo @8cfedd7203462cb251a914e700e5605444277561 (the attention-encoder-decoder speech
# recognizer behind Canary):
#   nemo/collections/asr/models/aed_multitask_models.py   lens_to_mask, EncDecMultiTaskModel.forward / training_step
#   nemo/collections/common/parts/transformer_utils.py      form_attention_mask, NEG_INF, mask_padded_tokens
#   nemo/collections/asr/modules/transformer/transformer_modules.py   FixedPositionalEncoding, TransformerEmbedding,
#                                                                       MultiHeadAttention, PositionWiseFF
#   nemo/collections/asr/modules/transformer/transformer_encoders.py  TransformerEncoderBlock / TransformerEncoder
#   nemo/collections/asr/modules/transformer/transformer_decoders.py  TransformerDecoderBlock / TransformerDecoder
#   nemo/collections/asr/modules/transformer/transformer.py           TransformerDecoderNM.forward
#   nemo/collections/asr/modules/transformer/transformer_generators.py GreedySequenceGenerator
# Trimmed: the Conformer acoustic encoder is a per-frame projection here (its output lengths are the frame lengths),
# adapters, typecheck, export paths and confidence are left out; the loss is NeMo's masked NLL without smoothing.
#
# A batch of right-padded acoustic frames gets `enc_mask = lens_to_mask(encoded_len, T)`, which the transformer
# encoder and the decoder's cross-attention turn into an additive (B, 1, 1, T) bias with form_attention_mask.
# Teacher forcing right-pads the prompted transcripts and builds `dec_mask = lens_to_mask(transcript_length, L)`;
# the decoder turns it into padding & tril (diagonal=0). Greedy decoding (GreedySequenceGenerator) caches each
# layer's states in decoder_mems_list and feeds one token a step with its own (B, 1) mask (from a batch of <bos>,
# so the generator's `pos=i` is each token's own index).
#
# Self-check: every utterance run alone (no padding, enc_mask all ones) gives the same log-probs at its real
# decoder positions and the same greedy tokens, and the batch loss equals a double loop over utterance x position;
# the cached greedy steps equal a full recompute of the decoder over the prefix.
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

NEG_INF = -10000.0


def lens_to_mask(lens, max_length):
    batch_size = lens.shape[0]
    arange = torch.arange(max_length, device=lens.device)
    mask = arange.expand(batch_size, max_length) < lens.unsqueeze(1)
    return mask


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


class FixedPositionalEncoding(nn.Module):
    def __init__(self, hidden_size, max_sequence_length=512):
        super().__init__()
        pos_enc = torch.zeros(max_sequence_length, hidden_size)
        position = torch.arange(0.0, max_sequence_length).unsqueeze(1)
        coef = -math.log(10000.0) / hidden_size
        div_term = torch.exp(coef * torch.arange(0.0, hidden_size, 2))
        pos_enc[:, 0::2] = torch.sin(position * div_term)
        pos_enc[:, 1::2] = torch.cos(position * div_term)
        pos_enc.div_(math.sqrt(hidden_size))
        self.register_buffer('pos_enc', pos_enc)

    def forward(self, position_ids):
        return torch.embedding(self.pos_enc, position_ids)


class TransformerEmbedding(nn.Module):
    def __init__(self, vocab_size, hidden_size, max_sequence_length=512, embedding_dropout=0.0):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, hidden_size, padding_idx=0)
        self.position_embedding = FixedPositionalEncoding(hidden_size, max_sequence_length)
        self.layer_norm = nn.LayerNorm(hidden_size, eps=1e-5)
        self.dropout = nn.Dropout(embedding_dropout)

    def forward(self, input_ids, token_type_ids=None, start_pos=0):
        seq_length = input_ids.size(1)
        position_ids = torch.arange(start=start_pos, end=start_pos + seq_length, dtype=torch.long,
                                    device=input_ids.device)
        position_ids = position_ids.unsqueeze(0).repeat(input_ids.size(0), 1)
        embeddings = self.token_embedding(input_ids) + self.position_embedding(position_ids)
        embeddings = self.layer_norm(embeddings)
        return self.dropout(embeddings)


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
        context = context.view(*(context.size()[:-2] + (context_hidden_size,)))
        output_states = self.out_projection(context)
        return self.layer_dropout(output_states)


class PositionWiseFF(nn.Module):
    def __init__(self, hidden_size, inner_size, ffn_dropout=0.0, hidden_act="relu"):
        super().__init__()
        self.dense_in = nn.Linear(hidden_size, inner_size)
        self.dense_out = nn.Linear(inner_size, hidden_size)
        self.layer_dropout = nn.Dropout(ffn_dropout)
        self.act_fn = torch.relu

    def forward(self, hidden_states):
        output_states = self.dense_in(hidden_states)
        output_states = self.act_fn(output_states)
        output_states = self.dense_out(output_states)
        return self.layer_dropout(output_states)


class TransformerEncoderBlock(nn.Module):
    def __init__(self, hidden_size, inner_size, num_attention_heads=1, pre_ln=True):
        super().__init__()
        self.pre_ln = pre_ln
        self.layer_norm_1 = nn.LayerNorm(hidden_size, eps=1e-5)
        self.first_sub_layer = MultiHeadAttention(hidden_size, num_attention_heads)
        self.layer_norm_2 = nn.LayerNorm(hidden_size, eps=1e-5)
        self.second_sub_layer = PositionWiseFF(hidden_size, inner_size)

    def forward(self, encoder_query, encoder_mask, encoder_keys):
        residual = encoder_query
        encoder_query = self.layer_norm_1(encoder_query)
        encoder_keys = self.layer_norm_1(encoder_keys)
        self_attn_output = self.first_sub_layer(encoder_query, encoder_keys, encoder_keys, encoder_mask)
        self_attn_output += residual
        residual = self_attn_output
        self_attn_output = self.layer_norm_2(self_attn_output)
        output_states = self.second_sub_layer(self_attn_output)
        output_states += residual
        return output_states


class TransformerEncoder(nn.Module):
    def __init__(self, num_layers, hidden_size, inner_size, num_attention_heads=1, mask_future=False,
                 pre_ln=True, pre_ln_final_layer_norm=True):
        super().__init__()
        layer = TransformerEncoderBlock(hidden_size, inner_size, num_attention_heads, pre_ln)
        self.layers = nn.ModuleList([copy.deepcopy(layer) for _ in range(num_layers)])
        self.final_layer_norm = nn.LayerNorm(hidden_size, eps=1e-5) if pre_ln and pre_ln_final_layer_norm else None
        self.diag = 0 if mask_future else None

    def forward(self, encoder_states, encoder_mask, encoder_mems_list=None, return_mems=False):
        encoder_attn_mask = form_attention_mask(encoder_mask, self.diag)
        memory_states = encoder_states
        for i, layer in enumerate(self.layers):
            encoder_states = layer(encoder_states, encoder_attn_mask, memory_states)
            memory_states = encoder_states
        if self.final_layer_norm is not None:
            encoder_states = self.final_layer_norm(encoder_states)
        return encoder_states


class TransformerDecoderBlock(nn.Module):
    def __init__(self, hidden_size, inner_size, num_attention_heads=1, pre_ln=True):
        super().__init__()
        self.pre_ln = pre_ln
        self.layer_norm_1 = nn.LayerNorm(hidden_size, eps=1e-5)
        self.first_sub_layer = MultiHeadAttention(hidden_size, num_attention_heads)
        self.layer_norm_2 = nn.LayerNorm(hidden_size, eps=1e-5)
        self.second_sub_layer = MultiHeadAttention(hidden_size, num_attention_heads)
        self.layer_norm_3 = nn.LayerNorm(hidden_size, eps=1e-5)
        self.third_sub_layer = PositionWiseFF(hidden_size, inner_size)

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

    def forward(self, decoder_query, decoder_mask, decoder_keys, encoder_states, encoder_mask):
        return self.forward_preln(decoder_query, decoder_mask, decoder_keys, encoder_states, encoder_mask)


class TransformerDecoder(nn.Module):
    def __init__(self, num_layers, hidden_size, inner_size, num_attention_heads=1, pre_ln=True,
                 pre_ln_final_layer_norm=True):
        super().__init__()
        layer = TransformerDecoderBlock(hidden_size, inner_size, num_attention_heads, pre_ln)
        self.layers = nn.ModuleList([copy.deepcopy(layer) for _ in range(num_layers)])
        self.diagonal = 0
        self.final_layer_norm = nn.LayerNorm(hidden_size, eps=1e-5) if pre_ln and pre_ln_final_layer_norm else None

    def _get_memory_states(self, decoder_states, decoder_mems_list=None, i=0):
        if decoder_mems_list is not None:
            inp1 = torch.transpose(decoder_mems_list[i], 1, 2)
            inp2 = torch.transpose(decoder_states, 1, 2)
            memory_states = torch.cat((inp1, inp2), dim=2)
            memory_states = torch.transpose(memory_states, 1, 2)
        else:
            memory_states = decoder_states
        return memory_states

    def forward(self, decoder_states, decoder_mask, encoder_states, encoder_mask, decoder_mems_list=None,
                return_mems=False):
        decoder_attn_mask = form_attention_mask(decoder_mask, diagonal=self.diagonal)
        encoder_attn_mask = form_attention_mask(encoder_mask)
        memory_states = self._get_memory_states(decoder_states, decoder_mems_list, 0)
        cached_mems_list = [memory_states]
        for i, layer in enumerate(self.layers):
            decoder_states = layer(decoder_states, decoder_attn_mask, memory_states, encoder_states, encoder_attn_mask)
            memory_states = self._get_memory_states(decoder_states, decoder_mems_list, i + 1)
            cached_mems_list.append(memory_states)
        if self.final_layer_norm is not None:
            decoder_states = self.final_layer_norm(decoder_states)
            memory_states = self._get_memory_states(decoder_states, decoder_mems_list, i + 2)
            cached_mems_list.append(memory_states)
        if return_mems:
            return cached_mems_list
        return memory_states


class TransformerDecoderNM(nn.Module):
    def __init__(self, vocab_size, hidden_size, num_layers, inner_size, num_attention_heads, max_sequence_length=64):
        super().__init__()
        self._embedding = TransformerEmbedding(vocab_size, hidden_size, max_sequence_length)
        self._decoder = TransformerDecoder(num_layers, hidden_size, inner_size, num_attention_heads)

    @property
    def embedding(self):
        return self._embedding

    @property
    def decoder(self):
        return self._decoder

    def forward(self, input_ids, decoder_mask, encoder_embeddings, encoder_mask):
        decoder_embeddings = self._embedding(input_ids=input_ids, start_pos=0)
        return self._decoder(decoder_states=decoder_embeddings, decoder_mask=decoder_mask,
                             encoder_states=encoder_embeddings, encoder_mask=encoder_mask)


class TokenClassifier(nn.Module):
    def __init__(self, hidden_size, num_classes, log_softmax=True):
        super().__init__()
        self.layer0 = nn.Linear(hidden_size, num_classes)
        self.log_softmax = log_softmax

    def forward(self, hidden_states):
        logits = self.layer0(hidden_states)
        return torch.log_softmax(logits, dim=-1) if self.log_softmax else logits


class GreedySequenceGenerator:
    def __init__(self, embedding, decoder, classifier, pad=0, bos=1, eos=2, max_sequence_length=512,
                 max_delta_length=20, batch_size=1):
        self.embedding = embedding
        self.decoder = decoder
        self.classifier = classifier
        self.pad, self.bos, self.eos = pad, bos, eos
        self.max_seq_length = max_sequence_length
        self.max_delta_len = max_delta_length
        self.batch_size = batch_size

    def _one_step_forward(self, decoder_input_ids=None, encoder_hidden_states=None, encoder_input_mask=None,
                          decoder_mems_list=None, pos=0):
        decoder_hidden_states = self.embedding.forward(decoder_input_ids, start_pos=pos)
        decoder_input_mask = mask_padded_tokens(decoder_input_ids, self.pad).float()
        decoder_mems_list = self.decoder.forward(decoder_hidden_states, decoder_input_mask, encoder_hidden_states,
                                                 encoder_input_mask, decoder_mems_list, return_mems=True)
        logits = self.classifier.forward(hidden_states=decoder_mems_list[-1][:, -1:])
        return logits, decoder_mems_list

    def _prepare_for_search(self, decoder_input_ids=None, encoder_hidden_states=None):
        batch_size, src_len, _ = encoder_hidden_states.size()
        if self.max_delta_len >= 0:
            max_seq_length = min(self.max_seq_length, src_len + self.max_delta_len)
        else:
            max_seq_length = self.max_seq_length
        tgt = decoder_input_ids
        batch_size, tgt_len = decoder_input_ids.size()
        return tgt, batch_size, max_seq_length - tgt_len

    def _forward(self, decoder_input_ids=None, encoder_hidden_states=None, encoder_input_mask=None):
        tgt, batch_size, max_generation_length = self._prepare_for_search(decoder_input_ids, encoder_hidden_states)
        pad_profile = torch.zeros(batch_size).long()
        decoder_mems_list = None
        step_logits = []
        for i in range(max_generation_length):
            if i == 0:
                input_ids = tgt
            else:
                input_ids = tgt[:, -1:]
            logits, decoder_mems_list = self._one_step_forward(input_ids, encoder_hidden_states, encoder_input_mask,
                                                               decoder_mems_list, i)
            step_logits.append(logits[:, -1])
            next_tokens = torch.argmax(logits[:, -1], dim=-1)
            next_tokens = self.pad * pad_profile + next_tokens * (1 - pad_profile)
            pad_profile = torch.max(pad_profile, (next_tokens == self.eos).long())
            tgt = torch.cat((tgt, next_tokens.unsqueeze(1)), dim=-1)
            if pad_profile.sum() == batch_size:
                break
        return tgt, torch.stack(step_logits, 1)

    def __call__(self, decoder_input_ids=None, encoder_hidden_states=None, encoder_input_mask=None):
        with torch.inference_mode():
            return self._forward(decoder_input_ids, encoder_hidden_states, encoder_input_mask)


class EncDecMultiTaskModel(nn.Module):
    """The AED recognizer trimmed: per-frame `encoder`, encoder_decoder_proj, transf_encoder, transf_decoder."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.encoder = nn.Linear(cfg['feat_in'], cfg['enc_hidden'])
        self.encoder_decoder_proj = nn.Linear(cfg['enc_hidden'], cfg['hidden_size'])
        self.transf_encoder = TransformerEncoder(cfg['transf_encoder_layers'], cfg['hidden_size'], cfg['inner_size'],
                                                 cfg['num_attention_heads'], mask_future=False)
        self.transf_decoder = TransformerDecoderNM(cfg['vocab_size'], cfg['hidden_size'], cfg['transf_decoder_layers'],
                                                   cfg['inner_size'], cfg['num_attention_heads'])
        self.log_softmax = TokenClassifier(cfg['hidden_size'], cfg['vocab_size'])
        self.log_softmax.layer0.weight = self.transf_decoder.embedding.token_embedding.weight
        self.decoding = GreedySequenceGenerator(self.transf_decoder.embedding, self.transf_decoder.decoder,
                                                self.log_softmax, pad=cfg['pad'], bos=cfg['bos'], eos=cfg['eos'],
                                                max_sequence_length=cfg['max_seq'], max_delta_length=-1)

    def forward(self, processed_signal, processed_signal_length, transcript=None, transcript_length=None):
        encoded = self.encoder(processed_signal.transpose(1, 2)).transpose(1, 2)  # (B, D, T) like Conformer's output
        encoded_len = processed_signal_length
        enc_states = encoded.permute(0, 2, 1)
        enc_states = self.encoder_decoder_proj(enc_states)
        enc_mask = lens_to_mask(encoded_len, enc_states.shape[1]).to(enc_states.dtype)
        enc_states = self.transf_encoder(encoder_states=enc_states, encoder_mask=enc_mask)
        transf_log_probs = None
        if transcript is not None:
            dec_mask = lens_to_mask(transcript_length, transcript.shape[1]).to(transcript.dtype)
            dec_states = self.transf_decoder(input_ids=transcript, decoder_mask=dec_mask,
                                             encoder_embeddings=enc_states, encoder_mask=enc_mask)
            transf_log_probs = self.log_softmax(hidden_states=dec_states)
        return transf_log_probs, encoded_len, enc_states, enc_mask


def masked_nll(log_probs, labels, output_mask):
    nll = -log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    output_mask = output_mask.to(nll.dtype)
    return (nll * output_mask).sum() / output_mask.sum()


def main():
    torch.manual_seed(0)
    cfg = dict(feat_in=12, enc_hidden=24, hidden_size=32, inner_size=64, num_attention_heads=4,
               transf_encoder_layers=2, transf_decoder_layers=2, vocab_size=40, pad=0, bos=1, eos=2, max_seq=9)
    model = EncDecMultiTaskModel(cfg).eval()
    PAD, BOS, EOS, LANG = 0, 1, 2, 3

    # --- a right-padded batch of feature sequences (B, F, T) and prompted transcripts ------------------------
    frame_lens = [11, 6, 8]
    T = max(frame_lens)
    feats = [torch.randn(cfg['feat_in'], n) for n in frame_lens]
    signal = torch.zeros(len(feats), cfg['feat_in'], T)
    for b, f in enumerate(feats):
        signal[b, :, : f.shape[1]] = f
    signal_len = torch.tensor(frame_lens)

    texts = [[5, 9, 17, 22, 8], [30, 6], [11, 12, 13, 14]]
    prompted = [[BOS, LANG] + t + [EOS] for t in texts]  # prompted_transcript
    prompted_lens = torch.tensor([len(p) for p in prompted])
    L = int(prompted_lens.max())
    prompted_transcript = torch.full((len(texts), L), PAD, dtype=torch.long)
    for b, p in enumerate(prompted):
        prompted_transcript[b, : len(p)] = torch.tensor(p)
    # batch.get_decoder_inputs_outputs(): inputs drop the last column, labels drop the first
    input_ids, labels = prompted_transcript[:, :-1], prompted_transcript[:, 1:]
    input_ids_lens = prompted_lens - 1

    with torch.no_grad():
        log_probs, encoded_len, enc_states, enc_mask = model(signal, signal_len, transcript=input_ids,
                                                             transcript_length=input_ids_lens)
        loss_mask = lens_to_mask(input_ids_lens, L - 1)
        batch_loss = masked_nll(log_probs, labels, loss_mask)

        # --- reference: each utterance alone, no padding anywhere --------------------------------------------
        nll_sum, n_tok = 0.0, 0
        for b in range(len(texts)):
            n = frame_lens[b]
            m = int(input_ids_lens[b])
            lp_b, _, enc_b, _ = model(signal[b:b + 1, :, :n], signal_len[b:b + 1], transcript=input_ids[b:b + 1, :m],
                                      transcript_length=input_ids_lens[b:b + 1])
            torch.testing.assert_close(enc_states[b, :n], enc_b[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(log_probs[b, :m], lp_b[0], atol=1e-5, rtol=1e-5)
            for t in range(m):
                nll_sum += -float(lp_b[0, t, labels[b, t]])
                n_tok += 1
        torch.testing.assert_close(batch_loss, torch.tensor(nll_sum / n_tok), atol=1e-5, rtol=1e-5)

    # --- greedy decoding from a batch of <bos> (the generator's pos = step index), cached, batch vs alone -------
    prompt = torch.tensor([[BOS]] * len(texts))
    tgt, step_logits = model.decoding(decoder_input_ids=prompt, encoder_hidden_states=enc_states,
                                      encoder_input_mask=enc_mask)
    for b in range(len(texts)):
        n = frame_lens[b]
        with torch.no_grad():
            _, _, enc_b, mask_b = model(signal[b:b + 1, :, :n], signal_len[b:b + 1])
        tgt_b, logits_b = model.decoding(decoder_input_ids=prompt[b:b + 1], encoder_hidden_states=enc_b,
                                         encoder_input_mask=mask_b)
        row = tgt[b, : tgt_b.shape[1]]
        assert torch.equal(row, tgt_b[0]), (b, row, tgt_b)
        # after this row's own stop, the batch only writes pad
        assert bool((tgt[b, tgt_b.shape[1]:] == PAD).all())
        k = logits_b.shape[1]
        torch.testing.assert_close(step_logits[b, :k], logits_b[0], atol=1e-4, rtol=1e-4)

        # cached steps equal a full recompute of the decoder over each prefix of the generated row
        with torch.no_grad():
            for s in range(k):
                prefix = tgt_b[:, : 1 + s]
                full = model.transf_decoder(input_ids=prefix, decoder_mask=torch.ones_like(prefix),
                                            encoder_embeddings=enc_b, encoder_mask=mask_b)
                full_lp = model.log_softmax(hidden_states=full)[:, -1]
                torch.testing.assert_close(full_lp[0], logits_b[0, s], atol=1e-4, rtol=1e-4)

    print("ok: padded batch = each utterance alone (log-probs, loss, greedy tokens, cached steps)")


if __name__ == "__main__":
    main()
