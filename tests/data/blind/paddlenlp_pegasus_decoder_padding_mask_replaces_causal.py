# PaddlePaddle/PaddleNLP#4638 ("Fix pegasus decoder attention mask", commit 116114a1), fixing what #4616
# (commit 52edce76) left: paddlenlp/transformers/pegasus/modeling.py, ported to torch.
# #4616 taught PegasusModel.forward to turn a 2D decoder_attention_mask from the tokenizer into an additive
# [batch, 1, 1, tgt_len] padding mask ((1 - mask) * -1e4). PegasusDecoder.forward only built its causal
# triu(-inf) mask when decoder_attention_mask was None, so once a padding mask was given it went to the
# decoder's self-attention alone: teacher-forced decoder positions attended to every later target token.
# #4638 always builds the causal mask and adds the given decoder_attention_mask to it.
# Paddle's nn.Transformer{Encoder,Decoder}{,Layer} and nn.MultiHeadAttention (normalize_before=True,
# attn_mask added to the scores after _convert_attention_mask) are ported below as a small torch shim.
import math
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

    def _split(self, x, proj):
        b, t, _ = x.shape
        return proj(x).reshape(b, t, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, query, key=None, value=None, attn_mask=None):
        key = query if key is None else key
        value = query if value is None else value
        q = self._split(query, self.q_proj)
        k = self._split(key, self.k_proj)
        v = self._split(value, self.v_proj)
        product = torch.matmul(q * (self.head_dim**-0.5), k.transpose(-1, -2))
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


class TransformerDecoderLayer(nn.Module):
    def __init__(self, d_model, nhead, dim_feedforward, dropout=0.1, activation="relu", attn_dropout=None,
                 act_dropout=None, normalize_before=False):
        super().__init__()
        attn_dropout = dropout if attn_dropout is None else attn_dropout
        act_dropout = dropout if act_dropout is None else act_dropout
        self.normalize_before = normalize_before
        self.self_attn = MultiHeadAttention(d_model, nhead, dropout=attn_dropout)
        self.cross_attn = MultiHeadAttention(d_model, nhead, dropout=attn_dropout)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.dropout = nn.Dropout(act_dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.norm3 = nn.LayerNorm(d_model)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.dropout3 = nn.Dropout(dropout)
        self.activation = getattr(F, activation)

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None):
        tgt_mask = _convert_attention_mask(tgt_mask, tgt.dtype)
        memory_mask = _convert_attention_mask(memory_mask, memory.dtype)
        residual = tgt
        if self.normalize_before:
            tgt = self.norm1(tgt)
        tgt = self.self_attn(tgt, tgt, tgt, tgt_mask)
        tgt = residual + self.dropout1(tgt)
        if not self.normalize_before:
            tgt = self.norm1(tgt)
        residual = tgt
        if self.normalize_before:
            tgt = self.norm2(tgt)
        tgt = self.cross_attn(tgt, memory, memory, memory_mask)
        tgt = residual + self.dropout2(tgt)
        if not self.normalize_before:
            tgt = self.norm2(tgt)
        residual = tgt
        if self.normalize_before:
            tgt = self.norm3(tgt)
        tgt = self.linear2(self.dropout(self.activation(self.linear1(tgt))))
        tgt = residual + self.dropout3(tgt)
        if not self.normalize_before:
            tgt = self.norm3(tgt)
        return tgt


class TransformerDecoder(nn.Module):
    def __init__(self, decoder_layer_fn, num_layers):
        super().__init__()
        self.layers = nn.ModuleList([decoder_layer_fn() for _ in range(num_layers)])

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None):
        tgt_mask = _convert_attention_mask(tgt_mask, tgt.dtype)
        memory_mask = _convert_attention_mask(memory_mask, memory.dtype)
        output = tgt
        for mod in self.layers:
            output = mod(output, memory, tgt_mask=tgt_mask, memory_mask=memory_mask)
        return output


# ---- paddlenlp/transformers/pegasus/modeling.py ----------------------------------------------------------
def shift_tokens_right(input_ids, pad_token_id, decoder_start_token_id):
    shifted_input_ids = torch.zeros_like(input_ids)
    shifted_input_ids[:, 1:] = input_ids[:, :-1].clone()
    shifted_input_ids[:, 0] = decoder_start_token_id
    if pad_token_id is None:
        raise ValueError("self.model.config.pad_token_id has to be defined.")
    shifted_input_ids = torch.where(shifted_input_ids == -100, pad_token_id, shifted_input_ids)
    return shifted_input_ids


class PegasusSinusoidalPositionalEmbedding(nn.Embedding):
    def __init__(self, num_embeddings, embedding_dim):
        super().__init__(num_embeddings, embedding_dim)
        self.weight = self._init_weight(self.weight)

    @staticmethod
    def _init_weight(out):
        n_pos, dim = out.shape
        position_enc = np.array(
            [[pos / np.power(10000, 2 * (j // 2) / dim) for j in range(dim)] for pos in range(n_pos)]
        )
        out.requires_grad = False
        sentinel = dim // 2 if dim % 2 == 0 else (dim // 2) + 1
        out[:, 0:sentinel] = torch.tensor(np.sin(position_enc[:, 0::2]), dtype=out.dtype)
        out[:, sentinel:] = torch.tensor(np.cos(position_enc[:, 1::2]), dtype=out.dtype)
        return nn.Parameter(out.detach(), requires_grad=False)

    @torch.no_grad()
    def forward(self, input_ids_shape, past_key_values_length=0):
        bsz, seq_len = input_ids_shape[:2]
        positions = torch.arange(past_key_values_length, past_key_values_length + seq_len, dtype=torch.int64)
        return nn.Embedding.forward(self, positions)


class PegasusEncoder(nn.Module):
    def __init__(self, embed_tokens, vocab_size, pad_token_id=1, d_model=768, num_encoder_layers=6,
                 encoder_attention_heads=12, encoder_ffn_dim=3072, dropout=0.1, activation_function="relu",
                 attention_dropout=0.1, activation_dropout=0.1, max_position_embeddings=1024,
                 scale_embedding=True, init_std=0.02):
        super().__init__()
        self.init_std = init_std
        self.pad_token_id = pad_token_id
        self.embed_scale = math.sqrt(d_model) if scale_embedding else 1.0
        self.embed_tokens = embed_tokens if embed_tokens is not None else nn.Embedding(vocab_size, d_model)
        self.encoder_embed_positions = PegasusSinusoidalPositionalEmbedding(max_position_embeddings, d_model)
        self.encoder_dropout = nn.Dropout(dropout)
        self.encoder_layernorm = nn.LayerNorm(d_model)
        self.encoder = TransformerEncoder(
            lambda: TransformerEncoderLayer(
                d_model=d_model,
                nhead=encoder_attention_heads,
                dim_feedforward=encoder_ffn_dim,
                dropout=dropout,
                activation=activation_function,
                attn_dropout=attention_dropout,
                act_dropout=activation_dropout,
                normalize_before=True,
            ),
            num_encoder_layers,
        )

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        if input_ids is None:
            raise ValueError("Input_ids cannot be None.")
        inputs_embeds = self.embed_tokens(input_ids) * self.embed_scale
        inputs_embed_pos = self.encoder_embed_positions(input_ids.shape)
        hidden_states = inputs_embeds + inputs_embed_pos
        encoder_input = self.encoder_dropout(hidden_states)

        if attention_mask is None:
            attention_mask = (input_ids == self.pad_token_id).to(torch.get_default_dtype())[:, None, None, :] * -1e4
        # For 2D attention_mask from tokenizer
        elif attention_mask.ndim == 2:
            attention_mask = attention_mask[:, None, None, :].to(torch.get_default_dtype())
            attention_mask = (1.0 - attention_mask) * -1e4
        attention_mask = attention_mask.detach()

        encoder_output = self.encoder(encoder_input, src_mask=attention_mask)
        encoder_output = self.encoder_layernorm(encoder_output)
        return encoder_output


class PegasusDecoder(nn.Module):
    def __init__(self, embed_tokens, vocab_size, pad_token_id=1, d_model=768, num_decoder_layers=6,
                 decoder_attention_heads=12, decoder_ffn_dim=3072, dropout=0.1, activation_function="relu",
                 attention_dropout=0.1, activation_dropout=0.1, max_position_embeddings=1024,
                 scale_embedding=True, init_std=0.02):
        super().__init__()
        self.init_std = init_std
        self.embed_scale = math.sqrt(d_model) if scale_embedding else 1.0
        self.embed_tokens = embed_tokens if embed_tokens is not None else nn.Embedding(vocab_size, d_model)
        self.decoder_embed_positions = PegasusSinusoidalPositionalEmbedding(max_position_embeddings, d_model)
        self.decoder_dropout = nn.Dropout(dropout)
        self.decoder_layernorm = nn.LayerNorm(d_model)
        self.decoder = TransformerDecoder(
            lambda: TransformerDecoderLayer(
                d_model=d_model,
                nhead=decoder_attention_heads,
                dim_feedforward=decoder_ffn_dim,
                dropout=dropout,
                activation=activation_function,
                attn_dropout=attention_dropout,
                act_dropout=activation_dropout,
                normalize_before=True,
            ),
            num_decoder_layers,
        )

    def forward(self, decoder_input_ids=None, decoder_attention_mask=None, encoder_output=None, memory_mask=None,
                cache=None, x=None, mix_ratio=0):
        if FIXED:
            decoder_length = decoder_input_ids.shape[-1]
            casual_mask = torch.triu(
                torch.full((decoder_length, decoder_length), -np.inf, dtype=torch.get_default_dtype()), 1
            )
            if decoder_attention_mask is not None:
                decoder_attention_mask = decoder_attention_mask + casual_mask
            else:
                decoder_attention_mask = casual_mask
        else:
            if decoder_attention_mask is None:
                decoder_length = decoder_input_ids.shape[-1]
                decoder_attention_mask = torch.triu(
                    torch.full((decoder_length, decoder_length), -np.inf, dtype=torch.get_default_dtype()), 1
                )

        if x is None:
            decoder_inputs_embeds = self.embed_tokens(decoder_input_ids) * self.embed_scale
        else:
            decoder_inputs_embeds = self.embed_tokens(
                decoder_input_ids
            ) * self.embed_scale * mix_ratio + self.embed_scale * x * (1 - mix_ratio)

        past_key_values_length = 0
        decoder_inputs_embed_pos = self.decoder_embed_positions(decoder_input_ids.shape, past_key_values_length)
        hidden_states = decoder_inputs_embeds + decoder_inputs_embed_pos
        decoder_input = self.decoder_dropout(hidden_states)

        decoder_output = self.decoder(
            tgt=decoder_input,
            memory=encoder_output,
            tgt_mask=decoder_attention_mask,
            memory_mask=memory_mask,
        )
        new_cache = None
        decoder_output = self.decoder_layernorm(decoder_output)
        return decoder_output, new_cache


class PegasusModel(nn.Module):
    def __init__(self, vocab_size, bos_token_id=0, pad_token_id=0, eos_token_id=1, forced_eos_token_id=1,
                 decoder_start_token_id=0, d_model=1024, num_encoder_layers=16, num_decoder_layers=16,
                 encoder_attention_heads=16, decoder_attention_heads=16, encoder_ffn_dim=4096,
                 decoder_ffn_dim=4096, dropout=0.1, activation_function="relu", attention_dropout=0.1,
                 activation_dropout=0.1, max_position_embeddings=1024, scale_embedding=True, init_std=0.02):
        super().__init__()
        self.config = dict(vocab_size=vocab_size, d_model=d_model, decoder_start_token_id=decoder_start_token_id)
        self.init_std = init_std
        self.pad_token_id = pad_token_id
        self.decoder_start_token_id = decoder_start_token_id
        self.shared = nn.Embedding(vocab_size, d_model)
        self.encoder = PegasusEncoder(
            self.shared, vocab_size, pad_token_id, d_model, num_encoder_layers, encoder_attention_heads,
            encoder_ffn_dim, dropout, activation_function, attention_dropout, activation_dropout,
            max_position_embeddings, scale_embedding, init_std,
        )
        self.decoder = PegasusDecoder(
            self.shared, vocab_size, pad_token_id, d_model, num_decoder_layers, decoder_attention_heads,
            decoder_ffn_dim, dropout, activation_function, attention_dropout, activation_dropout,
            max_position_embeddings, scale_embedding, init_std,
        )

    def forward(self, input_ids, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
                encoder_output=None, use_cache=False, cache=None):
        if input_ids is None and encoder_output is None:
            raise ValueError("You have to specify either input_ids or encoder_output")
        if decoder_input_ids is None:
            assert input_ids is not None, "input_ids should be " "specified when generating decoder_input_ids"
            decoder_input_ids = shift_tokens_right(input_ids, self.pad_token_id, self.decoder_start_token_id)
        if attention_mask is None:
            assert input_ids is not None, "input_ids should be " "specified when generating attention_mask"
            attention_mask = (input_ids == self.pad_token_id).to(torch.get_default_dtype())[:, None, None, :] * -1e4
        # For 2D attention_mask from tokenizer
        elif attention_mask.ndim == 2:
            attention_mask = attention_mask[:, None, None, :].to(torch.get_default_dtype())
            attention_mask = (1.0 - attention_mask) * -1e4
            attention_mask = attention_mask.detach()
        if encoder_output is None:
            encoder_output = self.encoder(input_ids, attention_mask)
        if decoder_attention_mask is not None and decoder_attention_mask.ndim == 2:
            decoder_attention_mask = decoder_attention_mask[:, None, None, :].to(torch.get_default_dtype())
            decoder_attention_mask = (1.0 - decoder_attention_mask) * -1e4
            decoder_attention_mask = decoder_attention_mask.detach()

        cache = None
        decoder_output, new_cache = self.decoder(
            decoder_input_ids, decoder_attention_mask, encoder_output, attention_mask, cache
        )
        return decoder_output, new_cache, encoder_output, attention_mask


class PegasusForConditionalGeneration(nn.Module):
    def __init__(self, pegasus):
        super().__init__()
        self.pegasus = pegasus
        self.lm_head_weight = nn.Parameter(
            torch.randn(self.pegasus.config["vocab_size"], self.pegasus.config["d_model"]) * pegasus.init_std
        )
        self.register_buffer("final_logits_bias", torch.zeros((1, self.pegasus.config["vocab_size"])))
        self.use_SSTIA = False
        self.mix_ratio = 0

    def forward(self, input_ids, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
                encoder_output=None, use_cache=False, cache=None, labels=None):
        output, new_cache, encoder_output, attention_mask = self.pegasus(
            input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, encoder_output, use_cache, cache
        )
        lm_logits = torch.matmul(output, self.lm_head_weight.t()) + self.final_logits_bias
        masked_lm_loss = None
        if labels is not None:
            loss_fct = nn.CrossEntropyLoss()
            masked_lm_loss = loss_fct(
                lm_logits.reshape((-1, self.pegasus.config["vocab_size"])), labels.reshape((-1,))
            )
        return lm_logits, new_cache, masked_lm_loss

    def prepare_decoder_input_ids_from_labels(self, labels):
        return shift_tokens_right(labels, self.pegasus.pad_token_id, self.pegasus.config["decoder_start_token_id"])


def main():
    torch.manual_seed(0)
    pad_token_id = 0
    pegasus = PegasusModel(
        vocab_size=64, pad_token_id=pad_token_id, eos_token_id=1, decoder_start_token_id=0, d_model=32,
        num_encoder_layers=2, num_decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        max_position_embeddings=64,
    )
    model = PegasusForConditionalGeneration(pegasus)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad and p.ndim == 2:
                p.normal_(0.0, 0.2)
    model.train()

    # A summarization batch as the tokenizer returns it: sources and targets right-padded with pad_token_id,
    # each with its 0/1 attention_mask; the targets end with eos (1).
    sources = [[12, 7, 33, 9, 21, 5, 1], [40, 18, 6, 1]]
    targets = [[25, 14, 8, 30, 1], [11, 27, 1]]
    src_len = max(map(len, sources))
    tgt_len = max(map(len, targets))
    input_ids = torch.tensor([s + [pad_token_id] * (src_len - len(s)) for s in sources])
    attention_mask = torch.tensor([[1] * len(s) + [0] * (src_len - len(s)) for s in sources])
    labels = torch.tensor([t + [pad_token_id] * (tgt_len - len(t)) for t in targets])
    decoder_attention_mask = torch.tensor([[1] * len(t) + [0] * (tgt_len - len(t)) for t in targets])
    decoder_input_ids = model.prepare_decoder_input_ids_from_labels(labels)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lm_logits, _, loss = model(
        input_ids,
        attention_mask=attention_mask,
        decoder_input_ids=decoder_input_ids,
        decoder_attention_mask=decoder_attention_mask,
        labels=labels,
    )
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()

    print("decoder_input_ids", decoder_input_ids.tolist())
    print("loss", round(loss.item(), 6))
    print("first-position argmax", lm_logits[:, 0].argmax(-1).tolist())
    print("first-position logits[0, :4]", [round(v, 4) for v in lm_logits[0, 0, :4].tolist()])


if __name__ == "__main__":
    main()
