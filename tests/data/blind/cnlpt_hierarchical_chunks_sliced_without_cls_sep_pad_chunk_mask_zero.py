# Machine-Learning-for-Medical-Language/cnlp_transformers#72 ("HierarchicalModel is broken"), fixed by commit 7060a3a
# ("fix implementation of input chunking logic for hierarchical transformer", src/cnlpt/cnlp_data.py).
# The hierarchical document classifier chunks each max_length-padded document (cnlp_convert_features_to_hierarchical),
# encodes every chunk with a BERT-style encoder, takes each chunk's first token, and runs a document-level transformer
# over the chunk vectors. Before the fix the document was cut into raw chunk_len slices of the padded sequence (no
# [CLS]/[SEP] per chunk, slices of the trailing padding kept as chunks with an all-zero mask), and the empty pad chunks
# added up to num_chunks got an all-zero attention mask ([0]*chunk_len) under their [CLS] [SEP] ids.
# Fix: each chunk is [CLS] + up to chunk_len-2 real tokens + [SEP] (mask 1 on both), chunking stops at [SEP]/[PAD], and
# the pad chunks' mask is create_pad_chunk(1, 1, 0) = [1, 1, 0, ...].
import copy
import sys
from dataclasses import astuple, dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import BertConfig, BertModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---- src/cnlpt/cnlp_data.py ----
@dataclass(frozen=True)
class InputFeatures:
    input_ids: List[int]
    attention_mask: Optional[List[int]] = None
    token_type_ids: Optional[List[int]] = None
    event_tokens: Optional[List[int]] = None
    label: Optional[list] = None


@dataclass(frozen=True)
class HierarchicalInputFeatures:
    input_ids: List[List[int]]
    attention_mask: Optional[List[List[int]]] = None
    token_type_ids: Optional[List[List[int]]] = None
    event_tokens: Optional[List[List[int]]] = None
    label: Optional[list] = None


def cnlp_convert_features_to_hierarchical(
        features: InputFeatures,
        chunk_len: int,
        num_chunks: int,
        cls_id: int,
        sep_id: int,
        pad_id: int,
        insert_empty_chunk_at_beginning: bool = False,
) -> HierarchicalInputFeatures:
    # Get feature variables
    input_ids_, attention_mask_, token_type_ids_, event_tokens_, label_ = astuple(features)

    assert len(input_ids_) == len(attention_mask_) == len(event_tokens_)

    # Split the sample's tokens into several chunk lists.
    chunks = []
    if attention_mask_ is not None:
        chunks_attention_mask = []
    else:
        chunks_attention_mask = None
    if token_type_ids_ is not None:
        chunks_token_type_ids = []
    else:
        chunks_token_type_ids = None
    if event_tokens_ is not None:
        chunks_event_tokens = []
    else:
        chunks_event_tokens = None

    def pad_chunk(chunk, pad_type=pad_id):
        return chunk + [pad_type] * (chunk_len - len(chunk))

    if FIXED:
        def format_chunk(chunk, cls_type=cls_id, sep_type=sep_id, pad_type=pad_id, pad=True):
            formatted_chunk = [cls_type] + chunk + [sep_type]
            if pad:
                return pad_chunk(formatted_chunk, pad_type=pad_type)
            else:
                return formatted_chunk

        start = 1

        while True:
            if start >= len(input_ids_) or input_ids_[start] in {pad_id, sep_id}:
                # we have moved past the end of the sequence or have reached
                #  either the SEP token or a PAD token.
                break

            # end right before where the SEP token will go
            end = min(
                start + chunk_len - 2,
                len(input_ids_)
            )

            # if we are ending on a PAD token or the SEP token, end before the SEP token
            if input_ids_[end-1] in {pad_id, sep_id} and sep_id in input_ids_[start:end]:
                end = input_ids_.index(sep_id, start, end)

            chunks.append(format_chunk(input_ids_[start:end]))
            if chunks_attention_mask is not None:
                chunks_attention_mask.append(format_chunk(attention_mask_[start:end], cls_type=1, sep_type=1))
            if chunks_token_type_ids is not None:
                chunks_token_type_ids.append(format_chunk(token_type_ids_[start:end], cls_type=0, sep_type=0))
            if chunks_event_tokens is not None:
                chunks_event_tokens.append(format_chunk(event_tokens_[start:end], cls_type=1, sep_type=1))

            start = end

        def create_pad_chunk(cls_type=cls_id, sep_type=sep_id, pad_type=pad_id):
            return pad_chunk([cls_type] + [sep_type], pad_type=pad_type)
    else:
        for i in range(0, len(input_ids_), chunk_len):
            chunks.append(pad_chunk(input_ids_[i : i + chunk_len]))
            if chunks_attention_mask is not None:
                chunks_attention_mask.append(pad_chunk(attention_mask_[i : i + chunk_len]))
            if chunks_token_type_ids is not None:
                chunks_token_type_ids.append(pad_chunk(token_type_ids_[i : i + chunk_len]))
            if chunks_event_tokens is not None:
                chunks_event_tokens.append(pad_chunk(event_tokens_[i : i + chunk_len]))

        def create_pad_chunk(cls_type=cls_id, sep_type=sep_id, pad_type=pad_id):
            return pad_chunk([cls_type] + [sep_type])

    # Insert an empty chunk at the beginning.
    if insert_empty_chunk_at_beginning:
        chunks.insert(0, create_pad_chunk())
        if chunks_attention_mask is not None:
            chunks_attention_mask.insert(0, create_pad_chunk(1, 1, 0))
        if chunks_token_type_ids is not None:
            chunks_token_type_ids.insert(0, create_pad_chunk(0, 0, 0))
        if chunks_event_tokens is not None:
            chunks_event_tokens.insert(0, create_pad_chunk(1, 1, 0))

    # Truncate the chunks and add attention masks
    chunks = chunks[:num_chunks]
    if chunks_attention_mask is not None:
        chunks_attention_mask = chunks_attention_mask[:num_chunks]
    if chunks_token_type_ids is not None:
        chunks_token_type_ids = chunks_token_type_ids[:num_chunks]
    if chunks_event_tokens is not None:
        chunks_event_tokens = chunks_event_tokens[:num_chunks]

    # Add empty lists to list of chunks, if the number of chunks less than max number.
    while len(chunks) < num_chunks:
        chunks.append(create_pad_chunk())
        if FIXED:
            if chunks_attention_mask is not None:
                chunks_attention_mask.append(create_pad_chunk(1, 1, 0))
            if chunks_token_type_ids is not None:
                chunks_token_type_ids.append(create_pad_chunk(0, 0, 0))
            if chunks_event_tokens is not None:
                chunks_event_tokens.append(create_pad_chunk(1, 1, 0))
        else:
            if chunks_attention_mask is not None:
                chunks_attention_mask.append([0]*chunk_len)
            if chunks_token_type_ids is not None:
                chunks_token_type_ids.append([0]*chunk_len)
            if chunks_event_tokens is not None:
                chunks_event_tokens.append([0]*chunk_len)

    return HierarchicalInputFeatures(chunks, chunks_attention_mask, chunks_token_type_ids, chunks_event_tokens, label_)


def encode_like_tokenizer(word_ids, max_length, cls_id, sep_id, pad_id):
    # tokenizer(..., max_length=max_length, padding="max_length", truncation=True), BERT-style ids,
    # then event_tokens = [1] * len(input_ids) when the text has no event markers
    ids = [cls_id] + word_ids[: max_length - 2] + [sep_id]
    mask = [1] * len(ids)
    ids = ids + [pad_id] * (max_length - len(ids))
    mask = mask + [0] * (max_length - len(mask))
    return InputFeatures(ids, mask, [0] * max_length, [1] * max_length, [0])


# ---- src/cnlpt/HierarchicalTransformer.py ----
class MultiHeadAttention(nn.Module):
    def __init__(self, n_head, d_model, d_k, d_v, dropout=0.1):
        super().__init__()
        self.n_head = n_head
        self.d_k = d_k
        self.d_v = d_v
        self.w_qs = nn.Linear(d_model, n_head * d_k, bias=False)
        self.w_ks = nn.Linear(d_model, n_head * d_k, bias=False)
        self.w_vs = nn.Linear(d_model, n_head * d_v, bias=False)
        self.fc = nn.Linear(n_head * d_v, d_model, bias=False)
        self.attention = ScaledDotProductAttention(temperature=d_k**0.5)
        self.dropout = nn.Dropout(dropout)
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-6)

    def forward(self, q, k, v, mask=None):
        d_k, d_v, n_head = self.d_k, self.d_v, self.n_head
        sz_b, len_q, len_k, len_v = q.size(0), q.size(1), k.size(1), v.size(1)
        residual = q
        q = self.layer_norm(q)
        q = self.w_qs(q).view(sz_b, len_q, n_head, d_k)
        k = self.w_ks(k).view(sz_b, len_k, n_head, d_k)
        v = self.w_vs(v).view(sz_b, len_v, n_head, d_v)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if mask is not None:
            mask = mask.unsqueeze(1)  # For head axis broadcasting.
        output, attn = self.attention(q, k, v, mask=mask)
        output = output.transpose(1, 2).contiguous().view(sz_b, len_q, -1)
        output = self.dropout(self.fc(output))
        output += residual
        return output, attn


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_in, d_hid, dropout=0.1):
        super().__init__()
        self.w_1 = nn.Linear(d_in, d_hid)
        self.w_2 = nn.Linear(d_hid, d_in)
        self.layer_norm = nn.LayerNorm(d_in, eps=1e-6)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        residual = x
        x = self.layer_norm(x)
        output = self.w_2(F.relu(self.w_1(x)))
        output = self.dropout(output)
        output += residual
        return output


class ScaledDotProductAttention(nn.Module):
    def __init__(self, temperature, attn_dropout=0.1):
        super().__init__()
        self.temperature = temperature
        self.dropout = nn.Dropout(attn_dropout)

    def forward(self, q, k, v, mask=None):
        attn = torch.matmul(q / self.temperature, k.transpose(2, 3))
        if mask is not None:
            attn = attn.masked_fill(mask == 0, -1e9)
        attn = self.dropout(F.softmax(attn, dim=-1))
        output = torch.matmul(attn, v)
        return output, attn


class EncoderLayer(nn.Module):
    def __init__(self, d_model, d_inner, n_head, d_k, d_v, dropout=0.1):
        super(EncoderLayer, self).__init__()
        self.slf_attn = MultiHeadAttention(n_head, d_model, d_k, d_v, dropout=dropout)
        self.pos_ffn = PositionwiseFeedForward(d_model, d_inner, dropout=dropout)

    def forward(self, enc_input, slf_attn_mask=None):
        enc_output, enc_slf_attn = self.slf_attn(enc_input, enc_input, enc_input, mask=slf_attn_mask)
        enc_output = self.pos_ffn(enc_output)
        return enc_output, enc_slf_attn


class HierarchicalTransformerConfig(object):
    def __init__(self, n_layers, d_model, d_inner, n_head, d_k, d_v, dropout=0.1):
        self.n_layers = n_layers
        self.d_model = d_model
        self.d_inner = d_inner
        self.n_head = n_head
        self.d_k = d_k
        self.d_v = d_v
        self.dropout = dropout


# ---- src/cnlpt/CnlpModelForClassification.py (classification branch) ----
class RepresentationProjectionLayer(nn.Module):
    def __init__(self, config, layer=10):
        super().__init__()
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.layer_to_use = layer

    def forward(self, features, event_tokens, **kwargs):
        # take <s> token (equiv. to [CLS])
        x = features[self.layer_to_use][..., 0, :]
        x = self.dropout(x)
        x = self.dense(x)
        x = torch.tanh(x)
        return x


class HierarchicalModel(nn.Module):
    def __init__(self, encoder_config, transformer_head_config, num_labels_list, layer=-1):
        super().__init__()
        self.encoder = BertModel(encoder_config, add_pooling_layer=False)
        self.num_labels = num_labels_list
        self.feature_extractors = nn.ModuleList(
            [RepresentationProjectionLayer(encoder_config, layer=layer) for _ in num_labels_list])
        self.classifiers = nn.ModuleList(
            [nn.Linear(encoder_config.hidden_size, n) for n in num_labels_list])
        transformer_layer = EncoderLayer(
            d_model=transformer_head_config.d_model,
            d_inner=transformer_head_config.d_inner,
            n_head=transformer_head_config.n_head,
            d_k=transformer_head_config.d_k,
            d_v=transformer_head_config.d_v,
            dropout=transformer_head_config.dropout,
        )
        self.transformer = nn.ModuleList(
            [copy.deepcopy(transformer_layer) for _ in range(transformer_head_config.n_layers)])

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                head_mask=None, inputs_embeds=None, labels=None, output_attentions=None,
                output_hidden_states=None, event_tokens=None):
        if input_ids is not None:
            batch_size, num_chunks, chunk_len = input_ids.shape
            flat_shape = (batch_size * num_chunks, chunk_len)
        else:  # inputs_embeds is not None
            batch_size, num_chunks, chunk_len, embed_dim = inputs_embeds.shape
            flat_shape = (batch_size * num_chunks, chunk_len, embed_dim)

        outputs = self.encoder(
            input_ids.reshape(flat_shape[:3]) if input_ids is not None else None,
            attention_mask=attention_mask.reshape(flat_shape[:3]) if attention_mask is not None else None,
            token_type_ids=token_type_ids.reshape(flat_shape[:3]) if token_type_ids is not None else None,
            position_ids=position_ids.reshape(flat_shape[:3]) if position_ids is not None else None,
            inputs_embeds=inputs_embeds.reshape(flat_shape) if inputs_embeds is not None else None,
            output_attentions=output_attentions,
            output_hidden_states=True,
            return_dict=True,
        )

        logits = []
        for task_ind, task_num_labels in enumerate(self.num_labels):
            # (B * n_chunk, hidden_size)
            chunks_reps = self.feature_extractors[task_ind](outputs.hidden_states, event_tokens)
            # (B, n_chunk, hidden_size)
            chunks_reps = chunks_reps.reshape(batch_size, num_chunks, chunks_reps.shape[-1])

            # Use pre-trained model's position embedding
            position_ids = torch.arange(num_chunks, dtype=torch.long, device=chunks_reps.device)  # (n_chunk)
            position_ids = position_ids.unsqueeze(0).expand_as(chunks_reps[:, :, 0])  # (B, n_chunk)
            position_embeddings = self.encoder.embeddings.position_embeddings(position_ids)
            chunks_reps = chunks_reps + position_embeddings

            # document encoding (B, n_chunk, hidden_size)
            for layer_module in self.transformer:
                chunks_reps, _ = layer_module(chunks_reps)

            # extract first Documents as rep. (B, hidden_size)
            doc_rep = chunks_reps[:, 0, :]
            task_logits = self.classifiers[task_ind](doc_rep)
            logits.append(task_logits)
        return logits


def main():
    pad_id, cls_id, sep_id = 0, 2, 3
    max_seq_length, chunk_len, num_chunks = 24, 8, 4

    encoder_config = BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, pad_token_id=pad_id, attn_implementation="eager",
    )
    head_config = HierarchicalTransformerConfig(n_layers=2, d_model=32, d_inner=64, n_head=2, d_k=16, d_v=16)
    model = HierarchicalModel(encoder_config, head_config, num_labels_list=[3]).eval()

    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(5, 64, (n,), generator=g).tolist() for n in (10, 17)]
    features = []
    for words in docs:
        feature = encode_like_tokenizer(words, max_seq_length, cls_id, sep_id, pad_id)
        features.append(cnlp_convert_features_to_hierarchical(
            feature, chunk_len=chunk_len, num_chunks=num_chunks, cls_id=cls_id, sep_id=sep_id, pad_id=pad_id))

    batch = {
        "input_ids": torch.tensor([f.input_ids for f in features]),
        "attention_mask": torch.tensor([f.attention_mask for f in features]),
        "token_type_ids": torch.tensor([f.token_type_ids for f in features]),
        "event_tokens": torch.tensor([f.event_tokens for f in features]),
    }
    with torch.no_grad():
        logits = model(**batch)[0]
    print("chunk input_ids[0]:", batch["input_ids"][0].tolist())
    print("chunk attention_mask[0]:", batch["attention_mask"][0].tolist())
    print("logits:", logits)
    print("predictions:", logits.argmax(-1).tolist())


if __name__ == "__main__":
    main()
