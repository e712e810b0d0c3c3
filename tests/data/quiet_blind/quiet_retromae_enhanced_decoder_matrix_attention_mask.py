"""RetroMAE (staoxiao/RetroMAE) retrieval-oriented pre-training, shrunk.

Ported from staoxiao/RetroMAE @ee375876a5e571617e37dd43450decc7865e2a07:
  src/pretrain/modeling.py        RetroMAEForPretraining.forward / mlm_loss
  src/pretrain/enhancedDecoder.py BertSelfAttention / BertAttention / BertLayerForDecoder
                                  (query, key and value passed separately)
  src/pretrain/data.py            RetroMAECollator.__call__
  src/pretrain/utils.py           tensorize_batch (right padding, 1-D and 2-D)
The backbone is transformers' BertForMaskedLM built from a tiny BertConfig (eager attention).
RetroMAE ran on transformers 4.x, whose ModuleUtilsMixin.get_extended_attention_mask and
DataCollatorForWholeWordMask (_whole_word_mask, torch_mask_tokens) are no longer in the
installed release; they are written below as 4.x had them. The tokenizer is a word-piece
stand-in over a fixed vocabulary (no download).

The encoder reads the masked text under its (B, L) padding mask and gives a sentence
vector (its last layer's [CLS]). The one-layer "enhanced decoder" reads the whole
unmasked text: its queries are the sentence vector plus each position's embedding, its
keys / values are the sentence vector at slot 0 and the token embeddings after it. The
collator gives every position i its own row of a (L, L) matrix mask: a whole-word sample
of the text is hidden, and i itself is hidden too, so row i sees the sentence vector and
the rest of the text but never its own token. tensorize_batch pads those matrices with 0
(pad keys hidden; pad query rows all hidden, label -100). get_extended_attention_mask
turns the (B, L, L) matrix into a (B, 1, L, L) additive bias.

The check: after two AdamW steps, the encoder's states and the decoder's output at every
real position match each text run alone, unpadded, the decoder position by position on
exactly the keys its row lets it see with no mask at all; the loss matches the per-text
sums.
"""
import random
from copy import deepcopy
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional, Tuple

import math
import torch
from torch import nn
import transformers
from transformers import BertConfig
from transformers.modeling_outputs import MaskedLMOutput
from transformers.models.bert.modeling_bert import BertIntermediate, BertOutput, BertSelfOutput
from transformers.pytorch_utils import apply_chunking_to_forward

random.seed(0)
torch.manual_seed(0)


# ---------------------------------------------------------------- transformers 4.x pieces
class BertForMaskedLM(transformers.BertForMaskedLM):
    """ModuleUtilsMixin.get_extended_attention_mask as transformers 4.x wrote it."""

    def get_extended_attention_mask(self, attention_mask, input_shape, device=None, dtype=None):
        if dtype is None:
            dtype = self.dtype
        if attention_mask.dim() == 3:
            extended_attention_mask = attention_mask[:, None, :, :]
        elif attention_mask.dim() == 2:
            extended_attention_mask = attention_mask[:, None, None, :]
        else:
            raise ValueError(
                f"Wrong shape for input_ids (shape {input_shape}) or attention_mask (shape {attention_mask.shape})"
            )
        extended_attention_mask = extended_attention_mask.to(dtype=dtype)  # fp16 compatibility
        extended_attention_mask = (1.0 - extended_attention_mask) * torch.finfo(dtype).min
        return extended_attention_mask


class WordPieceStandIn:
    """The few tokenizer calls the collator makes, over a fixed word-piece vocabulary."""

    def __init__(self, vocab):
        self.vocab = {t: i for i, t in enumerate(vocab)}
        self.ids_to_tokens = {i: t for t, i in self.vocab.items()}
        self._pad_token = "[PAD]"
        self.mask_token = "[MASK]"
        self.pad_token_id = self.vocab["[PAD]"]
        self.cls_token_id = self.vocab["[CLS]"]
        self.sep_token_id = self.vocab["[SEP]"]

    def __len__(self):
        return len(self.vocab)

    def num_special_tokens_to_add(self, pair=False):
        return 2

    def build_inputs_with_special_tokens(self, token_ids_0):
        return [self.cls_token_id] + list(token_ids_0) + [self.sep_token_id]

    def _convert_id_to_token(self, index):
        return self.ids_to_tokens[index]

    def convert_tokens_to_ids(self, token):
        return self.vocab[token]

    def get_special_tokens_mask(self, token_ids_0, already_has_special_tokens=False):
        return [1 if t in (self.cls_token_id, self.sep_token_id) else 0 for t in token_ids_0]

    def tokenize_to_ids(self, words):
        ids = []
        for w in words:
            ids.extend(self.vocab[p] for p in w.split("+"))
        return ids


@dataclass
class DataCollatorForWholeWordMask:
    """transformers 4.x DataCollatorForWholeWordMask: _whole_word_mask and torch_mask_tokens."""
    tokenizer: WordPieceStandIn
    mlm_probability: float = 0.15

    def _whole_word_mask(self, input_tokens, max_predictions=512):
        cand_indexes = []
        for i, token in enumerate(input_tokens):
            if token == "[CLS]" or token == "[SEP]":
                continue
            if len(cand_indexes) >= 1 and token.startswith("##"):
                cand_indexes[-1].append(i)
            else:
                cand_indexes.append([i])
        random.shuffle(cand_indexes)
        num_to_predict = min(max_predictions, max(1, int(round(len(input_tokens) * self.mlm_probability))))
        masked_lms = []
        covered_indexes = set()
        for index_set in cand_indexes:
            if len(masked_lms) >= num_to_predict:
                break
            if len(masked_lms) + len(index_set) > num_to_predict:
                continue
            is_any_index_covered = False
            for index in index_set:
                if index in covered_indexes:
                    is_any_index_covered = True
                    break
            if is_any_index_covered:
                continue
            for index in index_set:
                covered_indexes.add(index)
                masked_lms.append(index)
        if len(covered_indexes) != len(masked_lms):
            raise ValueError("Length of covered_indexes is not equal to length of masked_lms.")
        mask_labels = [1 if i in covered_indexes else 0 for i in range(len(input_tokens))]
        return mask_labels

    def torch_mask_tokens(self, inputs, mask_labels):
        labels = inputs.clone()
        probability_matrix = mask_labels
        special_tokens_mask = [
            self.tokenizer.get_special_tokens_mask(val, already_has_special_tokens=True) for val in labels.tolist()
        ]
        probability_matrix.masked_fill_(torch.tensor(special_tokens_mask, dtype=torch.bool), value=0.0)
        if self.tokenizer._pad_token is not None:
            padding_mask = labels.eq(self.tokenizer.pad_token_id)
            probability_matrix.masked_fill_(padding_mask, value=0.0)
        masked_indices = probability_matrix.bool()
        labels[~masked_indices] = -100
        indices_replaced = torch.bernoulli(torch.full(labels.shape, 0.8)).bool() & masked_indices
        inputs[indices_replaced] = self.tokenizer.convert_tokens_to_ids(self.tokenizer.mask_token)
        indices_random = torch.bernoulli(torch.full(labels.shape, 0.5)).bool() & masked_indices & ~indices_replaced
        random_words = torch.randint(len(self.tokenizer), labels.shape, dtype=torch.long)
        inputs[indices_random] = random_words[indices_random]
        return inputs, labels


# ---------------------------------------------------------------- src/pretrain/utils.py
def tensorize_batch(sequences, padding_value, align_right=False) -> torch.Tensor:
    if len(sequences[0].size()) == 1:
        max_len_1 = max([s.size(0) for s in sequences])
        out_dims = (len(sequences), max_len_1)
        out_tensor = sequences[0].new_full(out_dims, padding_value)
        for i, tensor in enumerate(sequences):
            length_1 = tensor.size(0)
            if align_right:
                out_tensor[i, -length_1:] = tensor
            else:
                out_tensor[i, :length_1] = tensor
        return out_tensor
    elif len(sequences[0].size()) == 2:
        max_len_1 = max([s.size(0) for s in sequences])
        max_len_2 = max([s.size(1) for s in sequences])
        out_dims = (len(sequences), max_len_1, max_len_2)
        out_tensor = sequences[0].new_full(out_dims, padding_value)
        for i, tensor in enumerate(sequences):
            length_1 = tensor.size(0)
            length_2 = tensor.size(1)
            if align_right:
                out_tensor[i, -length_1:, :length_2] = tensor
            else:
                out_tensor[i, :length_1, :length_2] = tensor
        return out_tensor
    else:
        raise


# ---------------------------------------------------------------- src/pretrain/data.py
@dataclass
class RetroMAECollator(DataCollatorForWholeWordMask):
    max_seq_length: int = 512
    encoder_mlm_probability: float = 0.15
    decoder_mlm_probability: float = 0.15

    def __call__(self, examples):
        input_ids_batch = []
        attention_mask_batch = []
        encoder_mlm_mask_batch = []
        decoder_labels_batch = []
        decoder_matrix_attention_mask_batch = []

        tgt_len = self.max_seq_length - self.tokenizer.num_special_tokens_to_add(False)

        for e in examples:
            e_trunc = self.tokenizer.build_inputs_with_special_tokens(e['token_ids'][:tgt_len])
            tokens = [self.tokenizer._convert_id_to_token(tid) for tid in e_trunc]

            self.mlm_probability = self.encoder_mlm_probability
            text_encoder_mlm_mask = self._whole_word_mask(tokens)

            self.mlm_probability = self.decoder_mlm_probability
            mask_set = []
            for _ in range(min(len(tokens), 256)):
                mask_set.append(self._whole_word_mask(tokens))

            text_matrix_attention_mask = []
            for i in range(len(tokens)):
                idx = random.randint(0, min(len(tokens), 256) - 1)
                text_decoder_mlm_mask = deepcopy(mask_set[idx])
                text_decoder_mlm_mask[i] = 1
                text_matrix_attention_mask.append(text_decoder_mlm_mask)

            input_ids_batch.append(torch.tensor(e_trunc))
            attention_mask_batch.append(torch.tensor([1] * len(e_trunc)))
            e_trunc[0] = -100
            e_trunc[-1] = -100
            decoder_labels_batch.append(torch.tensor(e_trunc))

            encoder_mlm_mask_batch.append(torch.tensor(text_encoder_mlm_mask))
            decoder_matrix_attention_mask_batch.append(1 - torch.tensor(text_matrix_attention_mask))

        input_ids_batch = tensorize_batch(input_ids_batch, self.tokenizer.pad_token_id)
        attention_mask_batch = tensorize_batch(attention_mask_batch, 0)
        origin_input_ids_batch = input_ids_batch.clone()
        encoder_mlm_mask_batch = tensorize_batch(encoder_mlm_mask_batch, 0)
        encoder_input_ids_batch, encoder_labels_batch = self.torch_mask_tokens(input_ids_batch, encoder_mlm_mask_batch)
        decoder_labels_batch = tensorize_batch(decoder_labels_batch, -100)
        matrix_attention_mask_batch = tensorize_batch(decoder_matrix_attention_mask_batch, 0)

        batch = {
            "encoder_input_ids": encoder_input_ids_batch,
            "encoder_attention_mask": attention_mask_batch,
            "encoder_labels": encoder_labels_batch,
            "decoder_input_ids": origin_input_ids_batch,
            "decoder_attention_mask": matrix_attention_mask_batch,  # [B,L,L]
            "decoder_labels": decoder_labels_batch,
        }

        return batch


# ---------------------------------------------------------------- src/pretrain/enhancedDecoder.py
class BertSelfAttention(nn.Module):
    def __init__(self, config, position_embedding_type=None):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = int(config.hidden_size / config.num_attention_heads)
        self.all_head_size = self.num_attention_heads * self.attention_head_size

        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)

        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)
        self.position_embedding_type = position_embedding_type or getattr(
            config, "position_embedding_type", "absolute"
        )
        self.is_decoder = config.is_decoder

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        x = x.view(new_x_shape)
        return x.permute(0, 2, 1, 3)

    def forward(
            self,
            query,
            key,
            value,
            attention_mask: Optional[torch.FloatTensor] = None,
            head_mask: Optional[torch.FloatTensor] = None,
            encoder_hidden_states: Optional[torch.FloatTensor] = None,
            encoder_attention_mask: Optional[torch.FloatTensor] = None,
            past_key_value: Optional[Tuple[Tuple[torch.FloatTensor]]] = None,
            output_attentions: Optional[bool] = False,
    ) -> Tuple[torch.Tensor]:
        mixed_query_layer = self.query(query)

        key_layer = self.transpose_for_scores(self.key(key))
        value_layer = self.transpose_for_scores(self.value(value))

        query_layer = self.transpose_for_scores(mixed_query_layer)

        # Take the dot product between "query" and "key" to get the raw attention scores.
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))

        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            # Apply the attention mask is (precomputed for all layers in BertModel forward() function)
            attention_scores = attention_scores + attention_mask

        # Normalize the attention scores to probabilities.
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)

        attention_probs = self.dropout(attention_probs)

        # Mask heads if we want to
        if head_mask is not None:
            attention_probs = attention_probs * head_mask

        context_layer = torch.matmul(attention_probs, value_layer)

        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.all_head_size,)
        context_layer = context_layer.view(new_context_layer_shape)

        outputs = (context_layer, attention_probs) if output_attentions else (context_layer,)
        return outputs


class BertAttention(nn.Module):
    def __init__(self, config, position_embedding_type=None):
        super().__init__()
        self.self = BertSelfAttention(config, position_embedding_type=position_embedding_type)
        self.output = BertSelfOutput(config)

    def forward(
            self,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: Optional[torch.FloatTensor] = None,
            head_mask: Optional[torch.FloatTensor] = None,
            encoder_hidden_states: Optional[torch.FloatTensor] = None,
            encoder_attention_mask: Optional[torch.FloatTensor] = None,
            past_key_value: Optional[Tuple[Tuple[torch.FloatTensor]]] = None,
            output_attentions: Optional[bool] = False,
    ) -> Tuple[torch.Tensor]:
        self_outputs = self.self(
            query, key, value,
            attention_mask,
            head_mask,
            encoder_hidden_states,
            encoder_attention_mask,
            past_key_value,
            output_attentions,
        )
        attention_output = self.output(self_outputs[0], query)
        outputs = (attention_output,) + self_outputs[1:]  # add attentions if we output them
        return outputs


class BertLayerForDecoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.chunk_size_feed_forward = config.chunk_size_feed_forward
        self.seq_len_dim = 1
        self.attention = BertAttention(config)
        self.is_decoder = config.is_decoder
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(
            self,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: Optional[torch.FloatTensor] = None,
            head_mask: Optional[torch.FloatTensor] = None,
            encoder_hidden_states: Optional[torch.FloatTensor] = None,
            encoder_attention_mask: Optional[torch.FloatTensor] = None,
            past_key_value: Optional[Tuple[Tuple[torch.FloatTensor]]] = None,
            output_attentions: Optional[bool] = False,
    ) -> Tuple[torch.Tensor]:
        self_attn_past_key_value = past_key_value[:2] if past_key_value is not None else None
        self_attention_outputs = self.attention(
            query, key, value,
            attention_mask,
            head_mask,
            output_attentions=output_attentions,
            past_key_value=self_attn_past_key_value,
        )
        attention_output = self_attention_outputs[0]
        outputs = self_attention_outputs[1:]  # add self attentions if we output attention weights

        layer_output = apply_chunking_to_forward(
            self.feed_forward_chunk, self.chunk_size_feed_forward, self.seq_len_dim, attention_output
        )
        outputs = (layer_output,) + outputs
        return outputs

    def feed_forward_chunk(self, attention_output):
        intermediate_output = self.intermediate(attention_output)
        layer_output = self.output(intermediate_output, attention_output)
        return layer_output


# ---------------------------------------------------------------- src/pretrain/modeling.py
class RetroMAEForPretraining(nn.Module):
    def __init__(
            self,
            bert: BertForMaskedLM,
            model_args,
    ):
        super(RetroMAEForPretraining, self).__init__()
        self.lm = bert

        self.decoder_embeddings = self.lm.bert.embeddings
        self.c_head = BertLayerForDecoder(bert.config)
        self.c_head.apply(self.lm._init_weights)

        self.cross_entropy = nn.CrossEntropyLoss()

        self.model_args = model_args

    def forward(self,
                encoder_input_ids, encoder_attention_mask, encoder_labels,
                decoder_input_ids, decoder_attention_mask, decoder_labels):
        lm_out: MaskedLMOutput = self.lm(
            encoder_input_ids, encoder_attention_mask,
            labels=encoder_labels,
            output_hidden_states=True,
            return_dict=True
        )
        cls_hiddens = lm_out.hidden_states[-1][:, :1]  # B 1 D

        decoder_embedding_output = self.decoder_embeddings(input_ids=decoder_input_ids)
        hiddens = torch.cat([cls_hiddens, decoder_embedding_output[:, 1:]], dim=1)

        decoder_position_ids = self.lm.bert.embeddings.position_ids[:, :decoder_input_ids.size(1)]
        decoder_position_embeddings = self.lm.bert.embeddings.position_embeddings(decoder_position_ids)  # B L D
        query = decoder_position_embeddings + cls_hiddens

        matrix_attention_mask = self.lm.get_extended_attention_mask(
            decoder_attention_mask,
            decoder_attention_mask.shape,
            decoder_attention_mask.device
        )

        hiddens = self.c_head(query=query,
                              key=hiddens,
                              value=hiddens,
                              attention_mask=matrix_attention_mask)[0]
        pred_scores, loss = self.mlm_loss(hiddens, decoder_labels)

        return (loss + lm_out.loss,)

    def mlm_loss(self, hiddens, labels):
        pred_scores = self.lm.cls(hiddens)
        masked_lm_loss = self.cross_entropy(
            pred_scores.view(-1, self.lm.config.vocab_size),
            labels.view(-1)
        )
        return pred_scores, masked_lm_loss


# ---------------------------------------------------------------- a tiny run
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
         "dense", "retrieval", "pre", "##train", "##ing", "the", "encoder", "decoder", "sentence",
         "vector", "passage", "query", "search", "index", "en", "##hanced", "mask", "##ed", "auto",
         "token", "##s", "of", "a", "for", "with", "bottle", "##neck", "text", "corpus", "model", "reads"]

TEXTS = [
    ["the", "en+##hanced", "decoder", "reads", "the", "sentence", "vector"],
    ["dense", "retrieval", "pre+##train+##ing", "with", "a", "bottle+##neck", "for", "the", "passage",
     "encoder", "of", "a", "search", "index"],
    ["query", "token+##s"],
    ["mask+##ed", "auto", "encoder", "for", "text", "corpus", "model", "pre+##train+##ing", "with",
     "the", "sentence", "vector"],
]


def main():
    tok = WordPieceStandIn(VOCAB)
    examples = [{"token_ids": tok.tokenize_to_ids(t)} for t in TEXTS]

    config = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, pad_token_id=tok.pad_token_id,
                        attn_implementation="eager")
    bert = BertForMaskedLM(config)
    model = RetroMAEForPretraining(bert, SimpleNamespace())
    collator = RetroMAECollator(tokenizer=tok, max_seq_length=16,
                                encoder_mlm_probability=0.3, decoder_mlm_probability=0.5)

    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for _ in range(2):
        batch = collator(examples)
        loss = model(**batch)[0]
        optim.zero_grad()
        loss.backward()
        optim.step()
        print("train loss", round(loss.item(), 4))

    # ---- the check: the padded batch against each text alone, unpadded, no mask
    model.eval()
    batch = collator(examples)
    captured = {}
    h1 = model.lm.register_forward_hook(lambda m, a, o: captured.__setitem__("lm", o))
    h2 = model.c_head.register_forward_hook(lambda m, a, o: captured.__setitem__("dec", o[0]))
    with torch.no_grad():
        loss = model(**batch)[0]
    h1.remove()
    h2.remove()
    enc_last = captured["lm"].hidden_states[-1]
    dec_out = captured["dec"]

    lengths = batch["encoder_attention_mask"].sum(-1).tolist()
    assert batch["decoder_attention_mask"].shape == (len(TEXTS), max(lengths), max(lengths))
    V = config.vocab_size
    enc_sum, enc_n, dec_sum, dec_n = 0.0, 0, 0.0, 0
    worst_enc, worst_dec = 0.0, 0.0
    with torch.no_grad():
        for b, n in enumerate(lengths):
            ids = batch["encoder_input_ids"][b:b + 1, :n]
            out = model.lm.bert(ids)  # no mask: the text alone
            enc_alone = out.last_hidden_state[0]
            worst_enc = max(worst_enc, (enc_alone - enc_last[b, :n]).abs().max().item())

            logits = model.lm.cls(enc_alone)
            lab = batch["encoder_labels"][b, :n]
            enc_sum += nn.functional.cross_entropy(logits, lab, ignore_index=-100, reduction="sum").item()
            enc_n += int((lab != -100).sum())

            cls_alone = enc_alone[:1]  # 1 D
            emb = model.decoder_embeddings(input_ids=batch["decoder_input_ids"][b:b + 1, :n])[0]
            keys = torch.cat([cls_alone, emb[1:]], dim=0)  # n D
            pos = model.lm.bert.embeddings.position_embeddings(torch.arange(n))
            queries = pos + cls_alone
            row_mask = batch["decoder_attention_mask"][b]
            for i in range(n):
                seen = [j for j in range(n) if row_mask[i, j].item() == 1]
                assert i not in seen and all(j < n for j in range(row_mask.shape[1]) if row_mask[i, j] == 1)
                if i > 0:
                    assert 0 in seen  # every token's row sees the sentence vector
                kv = keys[seen].unsqueeze(0)
                y = model.c_head(query=queries[i:i + 1].unsqueeze(0), key=kv, value=kv)[0][0, 0]
                worst_dec = max(worst_dec, (y - dec_out[b, i]).abs().max().item())
                lab_i = batch["decoder_labels"][b, i].item()
                if lab_i != -100:
                    dec_sum += nn.functional.cross_entropy(model.lm.cls(y).view(1, V), torch.tensor([lab_i]),
                                                           reduction="sum").item()
                    dec_n += 1

    ref_loss = dec_sum / dec_n + enc_sum / enc_n
    print("lengths", lengths, "| encoder max diff %.2e | decoder max diff %.2e" % (worst_enc, worst_dec))
    print("loss %.6f reference %.6f" % (loss.item(), ref_loss))
    assert worst_enc < 1e-5 and worst_dec < 1e-5
    assert abs(loss.item() - ref_loss) < 1e-4
    print("ok")


if __name__ == "__main__":
    main()
