# PaddlePaddle/PaddleNLP#4494 ("Fix generating attention_mask of ernie-m"): paddlenlp/transformers/ernie_m/modeling.py,
# ported to torch (bug read at commit 050867cd).
# When no attention_mask is given (ErnieMTokenizer returns input_ids only; the docstring examples and the token
# classification / UIE-M pipelines call model(input_ids)), ErnieMModel.forward builds the additive
# [batch, 1, 1, seq_len] key mask itself from `input_ids == 0`. ERNIE-M's pad token is id 1 (pad_token_id=1 in
# both pretrained configs, kept as self.pad_token_id), so the right-padded keys of a batch were never masked and
# every real token of a short row attended to its [PAD] tail.
# The fix builds the mask from `input_ids == self.pad_token_id`.
# Paddle's nn.TransformerEncoder{,Layer} / nn.MultiHeadAttention (attn_mask added to the scores) are ported below
# as a small torch shim.
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


# ---- paddle.nn.layer.transformer, ported to torch --------------------------------------------------------
def _convert_attention_mask(attn_mask, dtype):
    if attn_mask is not None and attn_mask.dtype != dtype:
        if attn_mask.dtype == torch.bool or not attn_mask.dtype.is_floating_point:
            attn_mask = (attn_mask.to(dtype) - 1.0) * 1e9
        else:
            attn_mask = attn_mask.to(dtype)
    return attn_mask


class MultiHeadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.0):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def _prepare_qkv(self, x, proj):
        b, t, _ = x.shape
        return proj(x).reshape(b, t, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, query, key=None, value=None, attn_mask=None):
        key = query if key is None else key
        value = query if value is None else value
        q = self._prepare_qkv(query, self.q_proj)
        k = self._prepare_qkv(key, self.k_proj)
        v = self._prepare_qkv(value, self.v_proj)
        product = torch.matmul(q * (self.head_dim ** -0.5), k.transpose(-1, -2))
        if attn_mask is not None:
            attn_mask = _convert_attention_mask(attn_mask, product.dtype)
            product = product + attn_mask
        weights = F.softmax(product, dim=-1)
        if self.dropout:
            weights = F.dropout(weights, self.dropout, training=self.training)
        out = torch.matmul(weights, v)
        out = out.transpose(1, 2).reshape(query.shape[0], query.shape[1], self.embed_dim)
        return self.out_proj(out)


class TransformerEncoderLayer(nn.Module):
    def __init__(self, d_model, nhead, dim_feedforward, dropout=0.1, activation="relu", attn_dropout=None,
                 act_dropout=None, normalize_before=False):
        super().__init__()
        attn_dropout = dropout if attn_dropout is None else attn_dropout
        act_dropout = dropout if act_dropout is None else act_dropout
        self.normalize_before = normalize_before
        self.self_attn = MultiHeadAttention(d_model, nhead, dropout=attn_dropout)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.dropout = nn.Dropout(act_dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.activation = getattr(F, activation)

    def forward(self, src, src_mask=None):
        src_mask = _convert_attention_mask(src_mask, src.dtype)
        residual = src
        if self.normalize_before:
            src = self.norm1(src)
        src = self.self_attn(src, src, src, src_mask)
        src = residual + self.dropout1(src)
        if not self.normalize_before:
            src = self.norm1(src)
        residual = src
        if self.normalize_before:
            src = self.norm2(src)
        src = self.linear2(self.dropout(self.activation(self.linear1(src))))
        src = residual + self.dropout2(src)
        if not self.normalize_before:
            src = self.norm2(src)
        return src


class TransformerEncoder(nn.Module):
    def __init__(self, encoder_layer_fn, num_layers):
        super().__init__()
        self.layers = nn.ModuleList([encoder_layer_fn() for _ in range(num_layers)])

    def forward(self, src, src_mask=None):
        src_mask = _convert_attention_mask(src_mask, src.dtype)
        output = src
        for mod in self.layers:
            output = mod(output, src_mask=src_mask)
        return output


# ---- paddlenlp/transformers/ernie_m/modeling.py ----------------------------------------------------------
class ErnieMEmbeddings(nn.Module):
    r"""
    Include embeddings from word, position.
    """

    def __init__(self, vocab_size, hidden_size=768, hidden_dropout_prob=0.1, max_position_embeddings=514):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, hidden_size)
        self.position_embeddings = nn.Embedding(max_position_embeddings, hidden_size)
        self.layer_norm = nn.LayerNorm(hidden_size)
        self.dropout = nn.Dropout(hidden_dropout_prob)
        self.register_buffer("position_ids", torch.arange(max_position_embeddings, dtype=torch.int64).expand(1, -1))

    def forward(self, input_ids=None, position_ids=None, inputs_embeds=None, past_key_values_length=0):
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        if position_ids is None:
            seq_length = inputs_embeds.shape[1]
            # a paddle slice is a copy; clone so the += below leaves the buffer as it is
            position_ids = self.position_ids[:, past_key_values_length:seq_length + past_key_values_length].clone()
        position_ids += 2
        position_embeddings = self.position_embeddings(position_ids)
        embeddings = inputs_embeds + position_embeddings
        embeddings = self.layer_norm(embeddings)
        embeddings = self.dropout(embeddings)
        return embeddings


class ErnieMPooler(nn.Module):
    def __init__(self, hidden_size):
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden_states):
        first_token_tensor = hidden_states[:, 0]
        pooled_output = self.dense(first_token_tensor)
        pooled_output = self.activation(pooled_output)
        return pooled_output


class ErnieMPretrainedModel(nn.Module):
    def init_weights(self, layer):
        if isinstance(layer, (nn.Linear, nn.Embedding)):
            std = self.initializer_range if hasattr(self, "initializer_range") else \
                self.ernie_m.config["initializer_range"]
            with torch.no_grad():
                layer.weight.normal_(mean=0.0, std=std)


class ErnieMModel(ErnieMPretrainedModel):
    def __init__(self, vocab_size, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 hidden_act="gelu", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                 max_position_embeddings=514, initializer_range=0.02, pad_token_id=1):
        super().__init__()
        self.config = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                           num_attention_heads=num_attention_heads, hidden_act=hidden_act,
                           hidden_dropout_prob=hidden_dropout_prob,
                           attention_probs_dropout_prob=attention_probs_dropout_prob,
                           max_position_embeddings=max_position_embeddings, initializer_range=initializer_range,
                           pad_token_id=pad_token_id)
        self.pad_token_id = pad_token_id
        self.initializer_range = initializer_range
        self.embeddings = ErnieMEmbeddings(vocab_size, hidden_size, hidden_dropout_prob, max_position_embeddings)
        self.encoder = TransformerEncoder(
            lambda: TransformerEncoderLayer(hidden_size, num_attention_heads, dim_feedforward=4 * hidden_size,
                                            dropout=hidden_dropout_prob, activation=hidden_act,
                                            attn_dropout=attention_probs_dropout_prob, act_dropout=0,
                                            normalize_before=False),
            num_hidden_layers)
        self.pooler = ErnieMPooler(hidden_size)
        self.apply(self.init_weights)

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, inputs_embeds=None,
                past_key_values=None):
        past_key_values_length = 0
        if past_key_values is not None:
            past_key_values_length = past_key_values[0][0].shape[2]

        if attention_mask is None:
            if FIXED:
                attention_mask = ((input_ids == self.pad_token_id).to(self.pooler.dense.weight.dtype)
                                  * -1e4).unsqueeze(1).unsqueeze(2)
            else:
                attention_mask = ((input_ids == 0).to(self.pooler.dense.weight.dtype)
                                  * -1e4).unsqueeze(1).unsqueeze(2)
            if past_key_values is not None:
                batch_size = past_key_values[0][0].shape[0]
                past_mask = torch.zeros([batch_size, 1, 1, past_key_values_length], dtype=attention_mask.dtype)
                attention_mask = torch.cat([past_mask, attention_mask], dim=-1)
        # For 2D attention_mask from tokenizer
        elif attention_mask.ndim == 2:
            attention_mask = attention_mask.unsqueeze(1).unsqueeze(2).to(torch.get_default_dtype())
            attention_mask = (1.0 - attention_mask) * -1e4

        embedding_output = self.embeddings(input_ids=input_ids, position_ids=position_ids,
                                           inputs_embeds=inputs_embeds,
                                           past_key_values_length=past_key_values_length)
        sequence_output = self.encoder(embedding_output, attention_mask)
        pooled_output = self.pooler(sequence_output)
        return sequence_output, pooled_output


class ErnieMForTokenClassification(ErnieMPretrainedModel):
    def __init__(self, ernie_m, num_classes=2, dropout=None):
        super().__init__()
        self.num_classes = num_classes
        self.ernie_m = ernie_m
        self.dropout = nn.Dropout(dropout if dropout is not None else self.ernie_m.config["hidden_dropout_prob"])
        self.classifier = nn.Linear(self.ernie_m.config["hidden_size"], num_classes)
        self.apply(self.init_weights)

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, labels=None):
        outputs = self.ernie_m(input_ids, position_ids=position_ids, attention_mask=attention_mask)
        sequence_output = self.dropout(outputs[0])
        logits = self.classifier(sequence_output)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.reshape((-1, self.num_classes)), labels.reshape((-1,)), ignore_index=-100)
        return (logits,) if loss is None else (loss, logits)


def main():
    torch.manual_seed(0)
    np.random.seed(0)
    pad_token_id = 1
    ernie_m = ErnieMModel(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          hidden_act="gelu", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                          max_position_embeddings=40, initializer_range=0.2, pad_token_id=pad_token_id)
    model = ErnieMForTokenClassification(ernie_m, num_classes=5)
    model.eval()

    # what ErnieMTokenizer hands a batched NER step: input_ids only, right-padded with [PAD] = 1
    sentences = [
        [5, 23, 47, 11, 62, 38, 19, 71, 44, 6],
        [5, 30, 57, 14, 6],
    ]
    labels_raw = [
        [-100, 1, 2, 0, 0, 3, 4, 0, 1, -100],
        [-100, 2, 0, 3, -100],
    ]
    max_len = max(len(s) for s in sentences)
    input_ids = torch.full((len(sentences), max_len), pad_token_id, dtype=torch.int64)
    labels = torch.full((len(sentences), max_len), -100, dtype=torch.int64)
    for i, (s, lab) in enumerate(zip(sentences, labels_raw)):
        input_ids[i, :len(s)] = torch.tensor(s)
        labels[i, :len(lab)] = torch.tensor(lab)

    with torch.no_grad():
        loss, logits = model(input_ids, labels=labels)
    preds = logits.argmax(-1)
    print("loss", round(loss.item(), 6))
    for i, s in enumerate(sentences):
        print("row", i, "preds", preds[i, :len(s)].tolist(),
              "logits[1:4]", [round(v, 4) for v in logits[i, 1:4, 0].tolist()])


if __name__ == "__main__":
    main()
