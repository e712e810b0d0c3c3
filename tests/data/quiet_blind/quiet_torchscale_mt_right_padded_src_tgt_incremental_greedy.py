# Correct program (quiet batch quiet-r160a).
#
# Ported from microsoft/torchscale @4d1e0e82e5adf86dd424f1463192635b73fc8efc (the MT path's last change
# da3d79c4f7e2b645d00a5fb61264ccd4377bf8cd):
#   torchscale/architecture/config.py       EncoderDecoderConfig (the fields used here)
#   torchscale/component/multihead_attention.py  MultiheadAttention.forward / attention_ops (heads folded into the
#                                           batch, (b h) t s; attn_mask added, key_padding_mask masked_fill -inf,
#                                           incremental_state["prev_key"/"prev_value"] laid (bsz, h, len, d))
#   torchscale/component/feedforward_network.py  FeedForwardNetwork
#   torchscale/architecture/encoder.py      EncoderLayer, Encoder.forward (pad rows zeroed, encoder_padding_mask)
#   torchscale/architecture/decoder.py      DecoderLayer, Decoder.forward_embedding / forward (triu -inf mask on a
#                                           full pass, none on an incremental step, is_first_step, tokens[:, -1:])
#   examples/fairseq/models/machine_translation.py  TranslationModel.forward, MTEncoder (src_tokens.eq(pad),
#                                           reorder_encoder_out)
#   examples/fairseq/models/language_modeling.py    LMDecoder (= MTDecoder: prev_output_tokens.eq(pad),
#                                           reorder_incremental_state_scripting)
# and the fairseq pieces those examples run on (facebookresearch/fairseq main): data/dictionary.py ids,
# data/data_utils.py collate_tokens, data/language_pair_dataset.py collate (sorted by source length, prev_output_tokens
# with eos moved to the front), utils.make_positions, modules/sinusoidal_positional_embedding.py (incremental branch),
# criterions/cross_entropy.py (nll sum, ignore_index=pad), sequence_generator.py _generate with beam 1 (pad never
# chosen, eos barred before min_len and forced at max_len, finished sentences dropped from the batch with the
# decoder's cache and the encoder output reordered).
# Trimmed: no MoE / multiway / xpos / flash / rel-pos, dropout 0, subln and deepnorm off, pre-LN; einops' four
# rearrange patterns written out as views (einops is not installed).
#
# A translation batch with fairseq's left_pad_source=False and left_pad_target=False (pad 1, eos 2): the encoder masks
# its pad keys with src_tokens.eq(pad), the decoder's cross-attention takes the same mask, its self-attention takes the
# triu(-inf) mask plus prev_output_tokens.eq(pad). Greedy decoding keeps each layer's keys/values in incremental_state
# and shrinks the batch as sentences finish.
#
# Self-check against a hand-written per-sentence reference (one head at a time, no padding, no cache): the batch's
# log-probs at every real target position, the summed NLL, the gradients of the batch loss (vs. per-sentence unpadded
# losses), and after a few training steps each sentence's greedy tokens and step log-probs.
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def rearrange(t, pattern, h=None):
    # the four einops patterns torchscale's MultiheadAttention uses (einops is not installed here)
    if pattern == 'b l (h d) -> (b h) l d':
        b, l, hd = t.shape
        return t.view(b, l, h, hd // h).transpose(1, 2).reshape(b * h, l, hd // h)
    if pattern == '(b h) l d -> b l (h d)':
        bh, l, d = t.shape
        return t.view(bh // h, h, l, d).transpose(1, 2).reshape(bh // h, l, h * d)
    if pattern == '(b h) t s -> b h t s':
        bh, tq, s = t.shape
        return t.view(bh // h, h, tq, s)
    if pattern == 'b h t s -> (b h) t s':
        b, hh, tq, s = t.shape
        return t.reshape(b * hh, tq, s)
    raise ValueError(pattern)

torch.manual_seed(0)
torch.set_num_threads(1)

BOS, PAD, EOS, UNK = 0, 1, 2, 3  # fairseq Dictionary
VOCAB = 24


class EncoderDecoderConfig(object):
    def __init__(self, **kwargs):
        self.encoder_embed_dim = kwargs.pop("encoder_embed_dim", 768)
        self.encoder_attention_heads = kwargs.pop("encoder_attention_heads", 12)
        self.encoder_ffn_embed_dim = kwargs.pop("encoder_ffn_embed_dim", 3072)
        self.encoder_layers = kwargs.pop("encoder_layers", 12)
        self.encoder_normalize_before = kwargs.pop("encoder_normalize_before", True)
        self.normalize_output = kwargs.pop("normalize_output", True)
        self.decoder_embed_dim = kwargs.pop("decoder_embed_dim", 768)
        self.decoder_attention_heads = kwargs.pop("decoder_attention_heads", 12)
        self.decoder_ffn_embed_dim = kwargs.pop("decoder_ffn_embed_dim", 3072)
        self.decoder_layers = kwargs.pop("decoder_layers", 12)
        self.decoder_normalize_before = kwargs.pop("decoder_normalize_before", True)
        self.activation_fn = kwargs.pop("activation_fn", "gelu")
        self.dropout = kwargs.pop("dropout", 0.0)
        self.attention_dropout = kwargs.pop("attention_dropout", 0.0)
        self.activation_dropout = kwargs.pop("activation_dropout", 0.0)
        self.no_scale_embedding = kwargs.pop("no_scale_embedding", True)
        self.layernorm_embedding = kwargs.pop("layernorm_embedding", False)
        self.rel_pos_buckets = kwargs.pop("rel_pos_buckets", 0)
        self.max_rel_pos = kwargs.pop("max_rel_pos", 0)
        self.share_all_embeddings = kwargs.pop("share_all_embeddings", False)
        self.share_decoder_input_output_embed = kwargs.pop("share_decoder_input_output_embed", False)
        self.max_source_positions = kwargs.pop("max_source_positions", 1024)
        self.max_target_positions = kwargs.pop("max_target_positions", 1024)
        self.layernorm_eps = kwargs.pop("layernorm_eps", 1e-5)
        self.vocab_size = kwargs.pop("vocab_size", -1)
        self.flash_attention = kwargs.pop("flash_attention", False)


# ---------------------------------------------------------------- fairseq pieces
def make_positions(tensor, padding_idx):
    mask = tensor.ne(padding_idx).int()
    return (torch.cumsum(mask, dim=1).type_as(mask) * mask).long() + padding_idx


class SinusoidalPositionalEmbedding(nn.Module):
    def __init__(self, embedding_dim, padding_idx, init_size=1024):
        super().__init__()
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.register_buffer("weights", self.get_embedding(init_size, embedding_dim, padding_idx), persistent=False)

    @staticmethod
    def get_embedding(num_embeddings, embedding_dim, padding_idx=None):
        half_dim = embedding_dim // 2
        emb = math.log(10000) / (half_dim - 1)
        emb = torch.exp(torch.arange(half_dim, dtype=torch.float) * -emb)
        emb = torch.arange(num_embeddings, dtype=torch.float).unsqueeze(1) * emb.unsqueeze(0)
        emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=1).view(num_embeddings, -1)
        if padding_idx is not None:
            emb[padding_idx, :] = 0
        return emb

    def forward(self, input, incremental_state=None, timestep=None, positions=None):
        bsz, seq_len = input.shape
        if incremental_state is not None:
            # positions is the same for every token when decoding a single step
            pos = timestep.view(-1)[0] + 1 if timestep is not None else seq_len
            return self.weights[self.padding_idx + pos, :].expand(bsz, 1, -1)
        positions = make_positions(input, self.padding_idx)
        return self.weights.index_select(0, positions.view(-1)).view(bsz, seq_len, -1).detach()


def PositionalEmbedding(num_embeddings, embedding_dim, padding_idx):
    return SinusoidalPositionalEmbedding(embedding_dim, padding_idx, init_size=num_embeddings + padding_idx + 1)


def Embedding(num_embeddings, embedding_dim, padding_idx):
    m = nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx)
    nn.init.normal_(m.weight, mean=0, std=embedding_dim**-0.5)
    nn.init.constant_(m.weight[padding_idx], 0)
    return m


def collate_tokens(values, pad_idx, eos_idx=None, left_pad=False, move_eos_to_beginning=False):
    size = max(v.size(0) for v in values)
    res = values[0].new(len(values), size).fill_(pad_idx)

    def copy_tensor(src, dst):
        assert dst.numel() == src.numel()
        if move_eos_to_beginning:
            dst[0] = eos_idx
            dst[1:] = src[:-1]
        else:
            dst.copy_(src)

    for i, v in enumerate(values):
        copy_tensor(v, res[i][size - len(v):] if left_pad else res[i][: len(v)])
    return res


def collate(samples, pad_idx, eos_idx, left_pad_source=False, left_pad_target=False):
    def merge(key, left_pad, move_eos_to_beginning=False):
        return collate_tokens([s[key] for s in samples], pad_idx, eos_idx, left_pad, move_eos_to_beginning)

    id = torch.LongTensor([s["id"] for s in samples])
    src_tokens = merge("source", left_pad=left_pad_source)
    src_lengths = torch.LongTensor([s["source"].ne(pad_idx).long().sum() for s in samples])
    src_lengths, sort_order = src_lengths.sort(descending=True)
    id = id.index_select(0, sort_order)
    src_tokens = src_tokens.index_select(0, sort_order)

    target = merge("target", left_pad=left_pad_target).index_select(0, sort_order)
    prev_output_tokens = merge("target", left_pad=left_pad_target, move_eos_to_beginning=True)
    prev_output_tokens = prev_output_tokens.index_select(0, sort_order)
    ntokens = target.ne(pad_idx).long().sum().item()
    return {
        "id": id,
        "nsentences": len(samples),
        "ntokens": ntokens,
        "net_input": {"src_tokens": src_tokens, "src_lengths": src_lengths, "prev_output_tokens": prev_output_tokens},
        "target": target,
    }


# ---------------------------------------------------------------- torchscale
class MultiheadAttention(nn.Module):
    def __init__(self, args, embed_dim, num_heads, dropout=0.0, self_attention=False,
                 encoder_decoder_attention=False, subln=False):
        super().__init__()
        self.args = args
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.dropout = dropout
        self.self_attention = self_attention
        self.encoder_decoder_attention = encoder_decoder_attention
        assert self.self_attention ^ self.encoder_decoder_attention
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.dropout_module = torch.nn.Dropout(dropout)

    def attention_ops(self, q, k, v, key_padding_mask=None, attn_mask=None, rel_pos=None, is_causal=False):
        q *= self.scaling
        attn_weights = torch.bmm(q, k.transpose(1, 2))

        if attn_mask is not None:
            attn_weights = torch.nan_to_num(attn_weights)
            attn_mask = attn_mask.unsqueeze(0)
            attn_weights += attn_mask

        if key_padding_mask is not None:
            attn_weights = rearrange(attn_weights, '(b h) t s -> b h t s', h=self.num_heads)
            attn_weights = attn_weights.masked_fill(
                key_padding_mask.unsqueeze(1).unsqueeze(2).to(torch.bool),
                float("-inf"),
            )
            attn_weights = rearrange(attn_weights, 'b h t s -> (b h) t s')

        if rel_pos is not None:
            rel_pos = rel_pos.view(attn_weights.size())
            attn_weights = attn_weights + rel_pos

        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).type_as(attn_weights)
        attn_probs = self.dropout_module(attn_weights)

        attn = torch.bmm(attn_probs, v)
        attn = rearrange(attn, '(b h) l d -> b l (h d)', h=self.num_heads)
        return attn, attn_weights

    def forward(self, query, key, value, incremental_state=None, key_padding_mask=None, attn_mask=None,
                rel_pos=None, is_first_step=False, is_causal=False):
        bsz, tgt_len, embed_dim = query.size()
        src_len = tgt_len
        assert embed_dim == self.embed_dim

        key_bsz, src_len, _ = key.size()
        assert key_bsz == bsz

        q = self.q_proj(query)
        k = self.k_proj(key)
        v = self.v_proj(value)

        q = rearrange(q, 'b l (h d) -> (b h) l d', h=self.num_heads)
        k = rearrange(k, 'b l (h d) -> (b h) l d', h=self.num_heads)
        v = rearrange(v, 'b l (h d) -> (b h) l d', h=self.num_heads)

        if incremental_state is not None:
            if "prev_key" in incremental_state:
                prev_key = incremental_state["prev_key"].view(bsz * self.num_heads, -1, self.head_dim)
                prev_value = incremental_state["prev_value"].view(bsz * self.num_heads, -1, self.head_dim)
                k = torch.cat([prev_key, k], dim=1)
                v = torch.cat([prev_value, v], dim=1)
            incremental_state["prev_key"] = k.view(bsz, self.num_heads, -1, self.head_dim)
            incremental_state["prev_value"] = v.view(bsz, self.num_heads, -1, self.head_dim)
            src_len = k.size(1)

        attn, attn_weights = self.attention_ops(q, k, v, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                                                rel_pos=rel_pos, is_causal=is_causal)
        attn = self.out_proj(attn)
        return attn, attn_weights


class FeedForwardNetwork(nn.Module):
    def __init__(self, embed_dim, ffn_dim, activation_fn, dropout, activation_dropout, layernorm_eps, subln=False):
        super().__init__()
        self.embed_dim = embed_dim
        self.activation_fn = F.gelu
        self.activation_dropout_module = torch.nn.Dropout(activation_dropout)
        self.dropout_module = torch.nn.Dropout(dropout)
        self.fc1 = nn.Linear(self.embed_dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, self.embed_dim)

    def forward(self, x):
        x_shape = x.shape
        x = x.reshape(-1, x.size(-1))
        x = self.fc1(x)
        x = self.activation_fn(x.float()).type_as(x)
        x = self.activation_dropout_module(x)
        x = self.fc2(x)
        x = x.view(x_shape)
        x = self.dropout_module(x)
        return x


class EncoderLayer(nn.Module):
    def __init__(self, args, depth, is_encoder_decoder=False):
        super().__init__()
        self.args = args
        self.embed_dim = args.encoder_embed_dim
        self.self_attn = MultiheadAttention(args, self.embed_dim, args.encoder_attention_heads,
                                            dropout=args.attention_dropout, self_attention=True)
        self.self_attn_layer_norm = nn.LayerNorm(self.embed_dim, eps=args.layernorm_eps)
        self.dropout_module = torch.nn.Dropout(args.dropout)
        self.normalize_before = args.encoder_normalize_before
        self.ffn = FeedForwardNetwork(self.embed_dim, args.encoder_ffn_embed_dim, args.activation_fn, args.dropout,
                                      args.activation_dropout, args.layernorm_eps)
        self.final_layer_norm = nn.LayerNorm(self.embed_dim, eps=args.layernorm_eps)
        self.alpha = 1.0

    def residual_connection(self, x, residual):
        return residual * self.alpha + x

    def forward(self, x, encoder_padding_mask, attn_mask=None, rel_pos=None, incremental_state=None):
        if attn_mask is not None:
            attn_mask = attn_mask.masked_fill(attn_mask.to(torch.bool), -1e8)

        residual = x
        if self.normalize_before:
            x = self.self_attn_layer_norm(x)
        x, _ = self.self_attn(query=x, key=x, value=x, key_padding_mask=encoder_padding_mask, attn_mask=attn_mask,
                              rel_pos=rel_pos, incremental_state=incremental_state)
        x = self.dropout_module(x)
        x = self.residual_connection(x, residual)
        if not self.normalize_before:
            x = self.self_attn_layer_norm(x)

        residual = x
        if self.normalize_before:
            x = self.final_layer_norm(x)
        x = self.ffn(x)
        x = self.residual_connection(x, residual)
        if not self.normalize_before:
            x = self.final_layer_norm(x)
        return x, None


class Encoder(nn.Module):
    def __init__(self, args, embed_tokens=None, embed_positions=None, is_encoder_decoder=False, **kwargs):
        super().__init__()
        self.args = args
        self.dropout_module = torch.nn.Dropout(args.dropout)
        embed_dim = args.encoder_embed_dim
        self.embed_scale = 1.0 if args.no_scale_embedding else math.sqrt(embed_dim)
        self.embed_tokens = embed_tokens
        self.embed_positions = embed_positions
        self.layernorm_embedding = None
        self.layers = nn.ModuleList(
            [EncoderLayer(args, depth=i, is_encoder_decoder=is_encoder_decoder) for i in range(args.encoder_layers)])
        self.num_layers = len(self.layers)
        if args.encoder_normalize_before and args.normalize_output:
            self.layer_norm = nn.LayerNorm(embed_dim, eps=args.layernorm_eps)
        else:
            self.layer_norm = None
        self.relative_position = None

    def forward_embedding(self, src_tokens, token_embedding=None, positions=None):
        if token_embedding is None:
            token_embedding = self.embed_tokens(src_tokens)
        x = embed = self.embed_scale * token_embedding
        if self.embed_positions is not None:
            x = embed + self.embed_positions(src_tokens, positions=positions)
        x = self.dropout_module(x)
        return x, embed

    def forward(self, src_tokens, encoder_padding_mask=None, attn_mask=None, return_all_hiddens=False,
                token_embeddings=None, features_only=False, incremental_state=None, positions=None, **kwargs):
        if encoder_padding_mask is None:
            encoder_padding_mask = torch.zeros_like(src_tokens, device=src_tokens.device).bool()

        x, encoder_embedding = self.forward_embedding(src_tokens, token_embeddings, positions)
        x = x * (1 - encoder_padding_mask.unsqueeze(-1).type_as(x))

        encoder_states = []
        rel_pos_bias = None
        l_aux = []
        for idx, layer in enumerate(self.layers):
            x, l_aux_i = layer(
                x,
                encoder_padding_mask=encoder_padding_mask if incremental_state is None else None,
                attn_mask=attn_mask,
                rel_pos=rel_pos_bias,
                incremental_state=incremental_state[idx] if incremental_state is not None else None,
            )
            l_aux.append(l_aux_i)

        if self.layer_norm is not None:
            x = self.layer_norm(x)

        return {
            "encoder_out": x,
            "encoder_embedding": encoder_embedding,
            "encoder_padding_mask": encoder_padding_mask,
            "encoder_states": encoder_states,
            "l_aux": l_aux,
        }


class DecoderLayer(nn.Module):
    def __init__(self, args, depth, is_encoder_decoder=False):
        super().__init__()
        self.args = args
        self.embed_dim = args.decoder_embed_dim
        self.dropout_module = torch.nn.Dropout(args.dropout)
        self.self_attn = MultiheadAttention(args, self.embed_dim, args.decoder_attention_heads,
                                            dropout=args.attention_dropout, self_attention=True)
        self.normalize_before = args.decoder_normalize_before
        self.self_attn_layer_norm = nn.LayerNorm(self.embed_dim, eps=args.layernorm_eps)
        if not is_encoder_decoder:
            self.encoder_attn = None
            self.encoder_attn_layer_norm = None
        else:
            self.encoder_attn = MultiheadAttention(args, self.embed_dim, args.decoder_attention_heads,
                                                   dropout=args.attention_dropout, encoder_decoder_attention=True)
            self.encoder_attn_layer_norm = nn.LayerNorm(self.embed_dim, eps=args.layernorm_eps)
        self.ffn = FeedForwardNetwork(self.embed_dim, args.decoder_ffn_embed_dim, args.activation_fn, args.dropout,
                                      args.activation_dropout, args.layernorm_eps)
        self.final_layer_norm = nn.LayerNorm(self.embed_dim, eps=args.layernorm_eps)
        self.alpha = 1.0

    def residual_connection(self, x, residual):
        return residual * self.alpha + x

    def forward(self, x, encoder_out=None, encoder_padding_mask=None, incremental_state=None, self_attn_mask=None,
                self_attn_padding_mask=None, self_attn_rel_pos=None, cross_attn_rel_pos=None, is_first_step=False):
        residual = x
        if self.normalize_before:
            x = self.self_attn_layer_norm(x)

        x, attn = self.self_attn(
            query=x,
            key=x,
            value=x,
            key_padding_mask=self_attn_padding_mask,
            incremental_state=incremental_state,
            attn_mask=self_attn_mask,
            rel_pos=self_attn_rel_pos,
            is_first_step=is_first_step,
            is_causal=True,
        )
        x = self.dropout_module(x)
        x = self.residual_connection(x, residual)
        if not self.normalize_before:
            x = self.self_attn_layer_norm(x)

        if self.encoder_attn is not None and encoder_out is not None:
            residual = x
            if self.normalize_before:
                x = self.encoder_attn_layer_norm(x)
            x, attn = self.encoder_attn(
                query=x,
                key=encoder_out,
                value=encoder_out,
                key_padding_mask=encoder_padding_mask,
                incremental_state=None,
                rel_pos=cross_attn_rel_pos,
            )
            x = self.dropout_module(x)
            x = self.residual_connection(x, residual)
            if not self.normalize_before:
                x = self.encoder_attn_layer_norm(x)

        residual = x
        if self.normalize_before:
            x = self.final_layer_norm(x)
        x = self.ffn(x)
        x = self.residual_connection(x, residual)
        if not self.normalize_before:
            x = self.final_layer_norm(x)
        return x, attn, None, None


class Decoder(nn.Module):
    def __init__(self, args, embed_tokens=None, embed_positions=None, output_projection=None,
                 is_encoder_decoder=False, **kwargs):
        super().__init__()
        self.args = args
        self.dropout_module = torch.nn.Dropout(args.dropout)
        embed_dim = args.decoder_embed_dim
        self.embed_dim = embed_dim
        self.embed_scale = 1.0 if args.no_scale_embedding else math.sqrt(embed_dim)
        self.embed_tokens = embed_tokens
        self.embed_positions = embed_positions
        self.output_projection = output_projection
        self.layernorm_embedding = None
        self.layers = nn.ModuleList(
            [DecoderLayer(args, depth=i, is_encoder_decoder=is_encoder_decoder) for i in range(args.decoder_layers)])
        self.num_layers = len(self.layers)
        if args.decoder_normalize_before:
            self.layer_norm = nn.LayerNorm(embed_dim, eps=args.layernorm_eps)
        else:
            self.layer_norm = None
        self.self_attn_relative_position = None
        self.cross_attn_relative_position = None

    def forward_embedding(self, tokens, token_embedding=None, incremental_state=None):
        positions = None
        if self.embed_positions is not None:
            positions = self.embed_positions(tokens, incremental_state=incremental_state)

        if incremental_state is not None and not self.is_first_step(incremental_state):
            tokens = tokens[:, -1:]
            if positions is not None:
                positions = positions[:, -1:]

        if token_embedding is None:
            token_embedding = self.embed_tokens(tokens)

        x = embed = self.embed_scale * token_embedding

        if positions is not None:
            x += positions

        x = self.dropout_module(x)
        return x, embed

    def is_first_step(self, incremental_state):
        if incremental_state is None:
            return False
        return incremental_state.get("is_first_step", False)

    def forward(self, prev_output_tokens, self_attn_padding_mask=None, encoder_out=None, incremental_state=None,
                features_only=False, return_all_hiddens=False, token_embeddings=None, **kwargs):
        x, _ = self.forward_embedding(prev_output_tokens, token_embeddings, incremental_state)
        is_first_step = self.is_first_step(incremental_state)

        self_attn_rel_pos_bias = None
        cross_attn_rel_pos_bias = None

        inner_states = [x]
        l_aux = []

        for idx, layer in enumerate(self.layers):
            if incremental_state is None or is_first_step:
                if not self.args.flash_attention:
                    self_attn_mask = torch.triu(
                        torch.zeros([x.size(1), x.size(1)]).float().fill_(float("-inf")).type_as(x),
                        1,
                    )
                else:
                    self_attn_mask = None
                if is_first_step and incremental_state is not None:
                    if idx not in incremental_state:
                        incremental_state[idx] = {}
            else:
                self_attn_mask = None
                if idx not in incremental_state:
                    incremental_state[idx] = {}

            x, layer_attn, _, l_aux_i = layer(
                x,
                encoder_out["encoder_out"] if encoder_out is not None else None,
                encoder_out["encoder_padding_mask"] if encoder_out is not None else None,
                incremental_state[idx] if incremental_state is not None else None,
                self_attn_mask=self_attn_mask,
                self_attn_padding_mask=self_attn_padding_mask,
                self_attn_rel_pos=self_attn_rel_pos_bias,
                cross_attn_rel_pos=cross_attn_rel_pos_bias,
                is_first_step=is_first_step,
            )
            l_aux.append(l_aux_i)
            inner_states.append(x)

        if self.layer_norm is not None:
            x = self.layer_norm(x)

        if not features_only:
            x = self.output_layer(x)

        return x, {"inner_states": inner_states, "l_aux": l_aux, "attn": None}

    def output_layer(self, features):
        return self.output_projection(features)


class MTEncoder(Encoder):
    def __init__(self, args, embed_tokens, embed_positions, is_encoder_decoder=True, dictionary=None):
        super().__init__(args, embed_tokens, embed_positions, is_encoder_decoder=is_encoder_decoder)
        self.dictionary = dictionary

    def forward(self, src_tokens, **kwargs):
        self_attn_padding_mask = src_tokens.eq(self.dictionary.pad())
        return super().forward(src_tokens=src_tokens, encoder_padding_mask=self_attn_padding_mask, **kwargs)

    def reorder_encoder_out(self, encoder_out, new_order):
        new_encoder_out = encoder_out["encoder_out"].index_select(0, new_order)
        new_encoder_embedding = encoder_out["encoder_embedding"].index_select(0, new_order)
        new_encoder_padding_mask = encoder_out["encoder_padding_mask"].index_select(0, new_order)
        encoder_states = encoder_out["encoder_states"]
        if len(encoder_states) > 0:
            for idx, state in enumerate(encoder_states):
                encoder_states[idx] = state.index_select(0, new_order)
        return {
            "encoder_out": new_encoder_out,
            "encoder_padding_mask": new_encoder_padding_mask,
            "encoder_embedding": new_encoder_embedding,
            "encoder_states": encoder_states,
        }


class MTDecoder(Decoder):  # examples/fairseq/models/language_modeling.py LMDecoder
    def __init__(self, args, embed_tokens, embed_positions, output_projection, is_encoder_decoder=True,
                 dictionary=None):
        super().__init__(args, embed_tokens, embed_positions, output_projection, is_encoder_decoder)
        self.dictionary = dictionary

    def forward(self, src_tokens, **kwargs):
        self_attn_padding_mask = src_tokens.eq(self.dictionary.pad())
        return super().forward(src_tokens, self_attn_padding_mask, **kwargs)

    def reorder_incremental_state_scripting(self, incremental_state, new_order):
        for module in incremental_state:
            for key in incremental_state[module]:
                result = incremental_state[module][key].index_select(0, new_order)
                incremental_state[module][key] = result


class Dictionary:
    def pad(self):
        return PAD

    def eos(self):
        return EOS

    def __len__(self):
        return VOCAB


class TranslationModel(nn.Module):
    def __init__(self, args, encoder, decoder):
        super().__init__()
        self.args = args
        self.encoder = encoder
        self.decoder = decoder

    @classmethod
    def build_model(cls, args, src_dict, tgt_dict):
        encoder_embed_tokens = Embedding(len(src_dict), args.encoder_embed_dim, src_dict.pad())
        decoder_embed_tokens = Embedding(len(tgt_dict), args.decoder_embed_dim, tgt_dict.pad())
        encoder_embed_positions = PositionalEmbedding(args.max_source_positions, args.encoder_embed_dim,
                                                      src_dict.pad())
        decoder_embed_positions = PositionalEmbedding(args.max_target_positions, args.decoder_embed_dim,
                                                      tgt_dict.pad())
        output_projection = torch.nn.Linear(args.decoder_embed_dim, len(tgt_dict), bias=False)
        torch.nn.init.normal_(output_projection.weight, mean=0, std=args.decoder_embed_dim**-0.5)
        encoder = MTEncoder(args, encoder_embed_tokens, encoder_embed_positions, is_encoder_decoder=True,
                            dictionary=src_dict)
        decoder = MTDecoder(args, decoder_embed_tokens, decoder_embed_positions, output_projection,
                            is_encoder_decoder=True, dictionary=tgt_dict)
        return cls(args, encoder, decoder)

    def forward(self, src_tokens, src_lengths, prev_output_tokens, return_all_hiddens=False, features_only=False,
                **kwargs):
        encoder_out = self.encoder(src_tokens, return_all_hiddens=return_all_hiddens)
        decoder_out = self.decoder(prev_output_tokens, encoder_out=encoder_out, features_only=features_only,
                                   return_all_hiddens=return_all_hiddens)
        return decoder_out

    def get_normalized_probs(self, net_output, log_probs):
        logits = net_output[0].float()
        return F.log_softmax(logits, dim=-1) if log_probs else F.softmax(logits, dim=-1)


def cross_entropy_loss(model, sample):
    net_output = model(**sample["net_input"])
    lprobs = model.get_normalized_probs(net_output, log_probs=True)
    lprobs = lprobs.view(-1, lprobs.size(-1))
    target = sample["target"].view(-1)
    loss = F.nll_loss(lprobs, target, ignore_index=PAD, reduction="sum")
    return loss, net_output


@torch.no_grad()
def greedy_generate(model, src_tokens, max_len_b=9, min_len=1):
    """fairseq SequenceGenerator._generate with beam_size=1."""
    bsz = src_tokens.size(0)
    max_len = max_len_b
    encoder_out = model.encoder(src_tokens)
    incremental_state = {}

    tokens = src_tokens.new(bsz, max_len + 2).fill_(PAD)
    tokens[:, 0] = EOS
    scores = torch.zeros(bsz, max_len + 1)
    original_batch_idxs = torch.arange(bsz)
    finalized = [None] * bsz
    batch_idxs = None

    for step in range(max_len + 1):
        if batch_idxs is not None:
            model.decoder.reorder_incremental_state_scripting(incremental_state, batch_idxs)
            encoder_out = model.encoder.reorder_encoder_out(encoder_out, batch_idxs)
            original_batch_idxs = original_batch_idxs[batch_idxs]

        decoder_out = model.decoder(tokens[:, : step + 1], encoder_out=encoder_out,
                                    incremental_state=incremental_state)
        decoder_out_tuple = (decoder_out[0][:, -1:, :], decoder_out[1])
        lprobs = model.get_normalized_probs(decoder_out_tuple, log_probs=True)[:, -1, :]

        lprobs[lprobs != lprobs] = -math.inf
        lprobs[:, PAD] = -math.inf
        if step >= max_len:
            lprobs[:, :EOS] = -math.inf
            lprobs[:, EOS + 1:] = -math.inf
        if step < min_len:
            lprobs[:, EOS] = -math.inf

        cand_scores, cand_indices = lprobs.max(dim=-1)
        tokens[:, step + 1] = cand_indices
        scores[:, step] = cand_scores

        eos_mask = cand_indices.eq(EOS)
        for i in eos_mask.nonzero().view(-1).tolist():
            sent = original_batch_idxs[i].item()
            finalized[sent] = {"tokens": tokens[i, 1: step + 2].clone(), "positional_scores": scores[i, : step + 1].clone()}
        if eos_mask.all():
            break
        if eos_mask.any():
            batch_idxs = (~eos_mask).nonzero().view(-1)
            tokens = tokens[batch_idxs]
            scores = scores[batch_idxs]
        else:
            batch_idxs = None
    return finalized


# ---------------------------------------------------------------- hand-written reference (one sentence, no padding)
def ref_ln(x, ln):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + ln.eps) * ln.weight + ln.bias


def ref_attn(xq, xkv, att, causal):
    H, dh = att.num_heads, att.head_dim
    q = xq @ att.q_proj.weight.T + att.q_proj.bias
    k = xkv @ att.k_proj.weight.T + att.k_proj.bias
    v = xkv @ att.v_proj.weight.T + att.v_proj.bias
    out = []
    for h in range(H):
        sl = slice(h * dh, (h + 1) * dh)
        rows = []
        for i in range(xq.size(0)):
            n_keys = i + 1 if causal else xkv.size(0)
            s = (k[:n_keys, sl] @ q[i, sl]) / math.sqrt(dh)  # this query's keys only: no mask needed
            p = torch.exp(s - s.max())
            p = p / p.sum()
            rows.append(p @ v[:n_keys, sl])
        out.append(torch.stack(rows))
    o = torch.cat(out, dim=-1)
    return o @ att.out_proj.weight.T + att.out_proj.bias


def ref_ffn(x, ffn):
    return F.gelu(x @ ffn.fc1.weight.T + ffn.fc1.bias) @ ffn.fc2.weight.T + ffn.fc2.bias


def sinusoid(n_pos, dim):
    # positions 2, 3, ... (fairseq: padding_idx 1 + 1-based index)
    half = dim // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float) * -(math.log(10000) / (half - 1)))
    pos = torch.arange(2, n_pos + 2, dtype=torch.float).unsqueeze(1) * freq
    return torch.cat([torch.sin(pos), torch.cos(pos)], dim=1)


def ref_encode(model, src):
    enc = model.encoder
    x = math.sqrt(enc.embed_tokens.embedding_dim) * enc.embed_tokens.weight[src] + sinusoid(len(src), x_dim(enc))
    for layer in enc.layers:
        x = x + ref_attn(ref_ln(x, layer.self_attn_layer_norm), ref_ln(x, layer.self_attn_layer_norm),
                         layer.self_attn, causal=False)
        x = x + ref_ffn(ref_ln(x, layer.final_layer_norm), layer.ffn)
    return ref_ln(x, enc.layer_norm)


def x_dim(m):
    return m.embed_tokens.embedding_dim


def ref_decode_logprobs(model, memory, prev):
    dec = model.decoder
    x = math.sqrt(x_dim(dec)) * dec.embed_tokens.weight[prev] + sinusoid(len(prev), x_dim(dec))
    for layer in dec.layers:
        h = ref_ln(x, layer.self_attn_layer_norm)
        x = x + ref_attn(h, h, layer.self_attn, causal=True)
        x = x + ref_attn(ref_ln(x, layer.encoder_attn_layer_norm), memory, layer.encoder_attn, causal=False)
        x = x + ref_ffn(ref_ln(x, layer.final_layer_norm), layer.ffn)
    logits = ref_ln(x, dec.layer_norm) @ dec.output_projection.weight.T
    return torch.log_softmax(logits, dim=-1)


def ref_greedy(model, src, max_len=9, min_len=1):
    memory = ref_encode(model, src)
    prev = [EOS]
    out, sc = [], []
    for step in range(max_len + 1):
        lp = ref_decode_logprobs(model, memory, torch.tensor(prev))[-1].clone()
        lp[PAD] = -math.inf
        if step >= max_len:
            keep = lp[EOS].clone()
            lp[:] = -math.inf
            lp[EOS] = keep
        if step < min_len:
            lp[EOS] = -math.inf
        tok = int(lp.argmax())
        out.append(tok)
        sc.append(lp[tok])
        prev.append(tok)
        if tok == EOS:
            break
    return torch.tensor(out), torch.stack(sc)


def main():
    args = EncoderDecoderConfig(
        encoder_embed_dim=32, encoder_attention_heads=4, encoder_ffn_embed_dim=64, encoder_layers=2,
        decoder_embed_dim=32, decoder_attention_heads=4, decoder_ffn_embed_dim=64, decoder_layers=2,
        no_scale_embedding=False, vocab_size=VOCAB, max_source_positions=64, max_target_positions=64,
    )
    src_dict = tgt_dict = Dictionary()
    model = TranslationModel.build_model(args, src_dict, tgt_dict)

    # a toy task: the target is the source reversed, then eos
    g = torch.Generator().manual_seed(1)
    samples = []
    for i, n in enumerate([3, 7, 5, 2, 6]):
        body = torch.randint(4, VOCAB, (n,), generator=g)
        samples.append({"id": i, "source": torch.cat([body, torch.tensor([EOS])]),
                        "target": torch.cat([body.flip(0), torch.tensor([EOS])])})
    sample = collate(samples, PAD, EOS, left_pad_source=False, left_pad_target=False)
    net_input = sample["net_input"]
    assert net_input["src_tokens"][:, -1].eq(PAD).any() and sample["target"][:, -1].eq(PAD).any()

    # 1) the padded batch against the hand reference, sentence by sentence
    model.eval()
    loss, net_output = cross_entropy_loss(model, sample)
    lprobs = model.get_normalized_probs(net_output, log_probs=True)
    ref_loss = 0.0
    with torch.no_grad():
        for b, sid in enumerate(sample["id"].tolist()):
            src, tgt = samples[sid]["source"], samples[sid]["target"]
            prev = torch.cat([torch.tensor([EOS]), tgt[:-1]])
            ref = ref_decode_logprobs(model, ref_encode(model, src), prev)
            got = lprobs[b, : len(tgt)]
            assert torch.allclose(got, ref, atol=1e-4), (sid, (got - ref).abs().max())
            for t in range(len(tgt)):
                ref_loss -= ref[t, tgt[t]].item()
    assert abs(loss.item() - ref_loss) < 1e-3, (loss.item(), ref_loss)

    # 2) the batch loss's gradients against per-sentence unpadded losses
    model.zero_grad()
    loss.backward()
    g_batch = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    for s in samples:
        one = collate([s], PAD, EOS)
        l1, _ = cross_entropy_loss(model, one)
        l1.backward()
    for n, p in model.named_parameters():
        if n in g_batch:
            assert torch.allclose(g_batch[n], p.grad, atol=1e-4), n
    model.zero_grad()

    # 3) a few batched training steps
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = None
    for step in range(40):
        opt.zero_grad()
        loss, _ = cross_entropy_loss(model, sample)
        (loss / sample["ntokens"]).backward()
        opt.step()
        first = first if first is not None else loss.item()
    assert loss.item() < first

    # 4) cached greedy decoding of the padded batch against each sentence decoded alone by the reference
    model.eval()
    hyps = greedy_generate(model, net_input["src_tokens"])
    n_steps = 0
    for b, sid in enumerate(sample["id"].tolist()):
        ref_tokens, ref_scores = ref_greedy(model, samples[sid]["source"])
        got = hyps[b]
        assert torch.equal(got["tokens"], ref_tokens), (sid, got["tokens"], ref_tokens)
        assert torch.allclose(got["positional_scores"], ref_scores, atol=1e-4), sid
        n_steps += len(ref_tokens)
    print(f"ok: batch log-probs, loss {ref_loss:.4f}, grads and {n_steps} greedy steps match the reference; "
          f"final train loss {loss.item():.3f} (from {first:.3f})")


if __name__ == "__main__":
    main()
