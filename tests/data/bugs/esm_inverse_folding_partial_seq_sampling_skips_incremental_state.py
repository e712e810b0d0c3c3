# ESM-IF1 GVP-Transformer (facebookresearch/esm PR #438, commit 1670483 "Fix sampling error with partial_seq"), gvp_transformer.py.
# Bug: sample() `continue`s past positions fixed by partial_seq, so the token before each never enters the decoder's incremental
# self-attention key/value cache and later designed positions attend without it. (GVP encoder replaced by a tiny stand-in.)
import math
import sys
import uuid
from typing import Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

FIXED = "--fixed" in sys.argv


class Args:
    encoder_embed_dim = 32
    decoder_embed_dim = 32
    decoder_ffn_embed_dim = 64
    decoder_attention_heads = 4
    decoder_layers = 2
    dropout = 0.1
    attention_dropout = 0.1


class Alphabet:
    def __init__(self):
        self.all_toks = ["<cath>", "<af2>", "<pad>", "<eos>", "<unk>"] + list("LAGVSERTIDPKQNFYMHWC") + ["<mask>"]
        self.tok_to_idx = {t: i for i, t in enumerate(self.all_toks)}
        self.padding_idx = self.tok_to_idx["<pad>"]

    def __len__(self):
        return len(self.all_toks)

    def get_idx(self, tok):
        return self.tok_to_idx.get(tok, self.tok_to_idx["<unk>"])

    def get_tok(self, ind):
        return self.all_toks[ind]


# ---------------------------------------------------------------- esm/modules.py
class SinusoidalPositionalEmbedding(nn.Module):
    def __init__(self, embed_dim, padding_idx, learned=False):
        super().__init__()
        self.embed_dim = embed_dim
        self.padding_idx = padding_idx
        self.register_buffer("_float_tensor", torch.FloatTensor(1))
        self.weights = None

    def forward(self, x):
        bsz, seq_len = x.shape
        max_pos = self.padding_idx + 1 + seq_len
        if self.weights is None or max_pos > self.weights.size(0):
            self.weights = self.get_embedding(max_pos)
        self.weights = self.weights.type_as(self._float_tensor)
        positions = self.make_positions(x)
        return self.weights.index_select(0, positions.view(-1)).view(bsz, seq_len, -1).detach()

    def make_positions(self, x):
        mask = x.ne(self.padding_idx)
        range_buf = torch.arange(x.size(1), device=x.device).expand_as(x) + self.padding_idx + 1
        positions = range_buf.expand_as(x)
        return positions * mask.long() + self.padding_idx * (1 - mask.long())

    def get_embedding(self, num_embeddings):
        half_dim = self.embed_dim // 2
        emb = math.log(10000) / (half_dim - 1)
        emb = torch.exp(torch.arange(half_dim, dtype=torch.float) * -emb)
        emb = torch.arange(num_embeddings, dtype=torch.float).unsqueeze(1) * emb.unsqueeze(0)
        emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=1).view(num_embeddings, -1)
        if self.padding_idx is not None:
            emb[self.padding_idx, :] = 0
        return emb


# ---------------------------------------------------------------- esm/multihead_attention.py (fairseq)
class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, kdim=None, vdim=None, dropout=0.0, bias=True,
                 self_attention=False, encoder_decoder_attention=False):
        super().__init__()
        self._incremental_state_id = str(uuid.uuid4())
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.self_attention = self_attention
        self.encoder_decoder_attention = encoder_decoder_attention
        self.k_proj = nn.Linear(self.kdim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(self.vdim, embed_dim, bias=bias)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        nn.init.xavier_uniform_(self.k_proj.weight, gain=1 / math.sqrt(2))
        nn.init.xavier_uniform_(self.v_proj.weight, gain=1 / math.sqrt(2))
        nn.init.xavier_uniform_(self.q_proj.weight, gain=1 / math.sqrt(2))
        nn.init.xavier_uniform_(self.out_proj.weight)

    def _key(self, key):
        return "{}.{}".format(self._incremental_state_id, key)

    def _get_input_buffer(self, incremental_state):
        if incremental_state is None or self._key("attn_state") not in incremental_state:
            return {}
        return incremental_state[self._key("attn_state")]

    def _set_input_buffer(self, incremental_state, buffer):
        incremental_state[self._key("attn_state")] = buffer
        return incremental_state

    def forward(self, query, key, value, key_padding_mask=None, incremental_state=None, need_weights=True,
                static_kv=False, attn_mask=None, need_head_weights=False):
        tgt_len, bsz, embed_dim = query.size()
        if incremental_state is not None:
            saved_state = self._get_input_buffer(incremental_state)
            if saved_state is not None and "prev_key" in saved_state:
                if static_kv:
                    key = value = None
        else:
            saved_state = None

        if self.self_attention:
            q = self.q_proj(query)
            k = self.k_proj(query)
            v = self.v_proj(query)
        else:  # encoder-decoder attention
            q = self.q_proj(query)
            if key is None:
                k = v = None
            else:
                k = self.k_proj(key)
                v = self.v_proj(key)
        q = q * self.scaling

        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        if k is not None:
            k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        if v is not None:
            v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)

        if saved_state is not None:
            # saved states are stored with shape (bsz, num_heads, seq_len, head_dim)
            if "prev_key" in saved_state:
                prev_key = saved_state["prev_key"].view(bsz * self.num_heads, -1, self.head_dim)
                k = prev_key if static_kv else torch.cat([prev_key, k], dim=1)
            if "prev_value" in saved_state:
                prev_value = saved_state["prev_value"].view(bsz * self.num_heads, -1, self.head_dim)
                v = prev_value if static_kv else torch.cat([prev_value, v], dim=1)
            if "prev_key_padding_mask" in saved_state and saved_state["prev_key_padding_mask"] is not None:
                if static_kv:
                    key_padding_mask = saved_state["prev_key_padding_mask"]
            saved_state["prev_key"] = k.view(bsz, self.num_heads, -1, self.head_dim)
            saved_state["prev_value"] = v.view(bsz, self.num_heads, -1, self.head_dim)
            saved_state["prev_key_padding_mask"] = key_padding_mask
            incremental_state = self._set_input_buffer(incremental_state, saved_state)

        src_len = k.size(1)
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        if attn_mask is not None:
            attn_mask = attn_mask.unsqueeze(0)
            attn_weights += attn_mask
        if key_padding_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            attn_weights = attn_weights.masked_fill(
                key_padding_mask.unsqueeze(1).unsqueeze(2).to(torch.bool), float("-inf"))
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_weights_float = F.softmax(attn_weights, dim=-1, dtype=torch.float32)
        attn_weights = attn_weights_float.type_as(attn_weights)
        attn_probs = F.dropout(attn_weights_float.type_as(attn_weights), p=self.dropout, training=self.training)
        attn = torch.bmm(attn_probs, v)
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        attn = self.out_proj(attn)
        return attn, None


# ---------------------------------------------------------------- esm/inverse_folding/transformer_layer.py
class TransformerDecoderLayer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.embed_dim = args.decoder_embed_dim
        self.dropout_module = nn.Dropout(args.dropout)
        self.self_attn = MultiheadAttention(self.embed_dim, args.decoder_attention_heads,
                                            dropout=args.attention_dropout, self_attention=True)
        self.activation_fn = F.relu
        self.self_attn_layer_norm = nn.LayerNorm(self.embed_dim)
        self.encoder_attn = MultiheadAttention(self.embed_dim, args.decoder_attention_heads,
                                               kdim=args.encoder_embed_dim, vdim=args.encoder_embed_dim,
                                               dropout=args.attention_dropout, encoder_decoder_attention=True)
        self.encoder_attn_layer_norm = nn.LayerNorm(self.embed_dim)
        self.fc1 = nn.Linear(self.embed_dim, args.decoder_ffn_embed_dim)
        self.fc2 = nn.Linear(args.decoder_ffn_embed_dim, self.embed_dim)
        self.final_layer_norm = nn.LayerNorm(self.embed_dim)

    def forward(self, x, encoder_out=None, encoder_padding_mask=None, incremental_state=None,
                self_attn_mask=None, self_attn_padding_mask=None, need_attn=False, need_head_weights=False):
        residual = x
        x = self.self_attn_layer_norm(x)
        y = x
        x, attn = self.self_attn(query=x, key=y, value=y, key_padding_mask=self_attn_padding_mask,
                                 incremental_state=incremental_state, need_weights=False, attn_mask=self_attn_mask)
        x = self.dropout_module(x)
        x = residual + x
        if self.encoder_attn is not None and encoder_out is not None:
            residual = x
            x = self.encoder_attn_layer_norm(x)
            x, attn = self.encoder_attn(query=x, key=encoder_out, value=encoder_out,
                                        key_padding_mask=encoder_padding_mask, incremental_state=incremental_state,
                                        static_kv=True)
            x = self.dropout_module(x)
            x = residual + x
        residual = x
        x = self.final_layer_norm(x)
        x = self.activation_fn(self.fc1(x))
        x = self.fc2(x)
        x = self.dropout_module(x)
        x = residual + x
        return x, attn, None


# ---------------------------------------------------------------- esm/inverse_folding/transformer_decoder.py
def fill_with_neg_inf(t):
    return t.float().fill_(float("-inf")).type_as(t)


class TransformerDecoder(nn.Module):
    def __init__(self, args, dictionary, embed_tokens):
        super().__init__()
        self.args = args
        self.dictionary = dictionary
        self._future_mask = torch.empty(0)
        self.dropout_module = nn.Dropout(args.dropout)
        embed_dim = args.decoder_embed_dim
        self.embed_dim = embed_dim
        self.padding_idx = embed_tokens.padding_idx
        self.embed_tokens = embed_tokens
        self.embed_scale = math.sqrt(embed_dim)
        self.project_in_dim = None
        self.embed_positions = SinusoidalPositionalEmbedding(embed_dim, self.padding_idx)
        self.layers = nn.ModuleList([TransformerDecoderLayer(args) for _ in range(args.decoder_layers)])
        self.num_layers = len(self.layers)
        self.layer_norm = nn.LayerNorm(embed_dim)
        self.output_projection = nn.Linear(args.decoder_embed_dim, len(dictionary), bias=False)
        nn.init.normal_(self.output_projection.weight, mean=0, std=args.decoder_embed_dim ** -0.5)

    def forward(self, prev_output_tokens, encoder_out=None, incremental_state=None, features_only=False,
                return_all_hiddens=False):
        x, extra = self.extract_features(prev_output_tokens, encoder_out=encoder_out,
                                         incremental_state=incremental_state)
        if not features_only:
            x = self.output_layer(x)
        x = x.transpose(1, 2)  # B x T x C -> B x C x T
        return x, extra

    def extract_features(self, prev_output_tokens, encoder_out, incremental_state=None):
        bs, slen = prev_output_tokens.size()
        enc = None
        padding_mask = None
        if encoder_out is not None and len(encoder_out["encoder_out"]) > 0:
            enc = encoder_out["encoder_out"][0]
        if encoder_out is not None and len(encoder_out["encoder_padding_mask"]) > 0:
            padding_mask = encoder_out["encoder_padding_mask"][0]

        positions = self.embed_positions(prev_output_tokens)
        if incremental_state is not None:
            prev_output_tokens = prev_output_tokens[:, -1:]
            positions = positions[:, -1:]

        x = self.embed_scale * self.embed_tokens(prev_output_tokens)
        x += positions
        x = self.dropout_module(x)
        x = x.transpose(0, 1)  # B x T x C -> T x B x C

        self_attn_padding_mask = None
        if prev_output_tokens.eq(self.padding_idx).any():
            self_attn_padding_mask = prev_output_tokens.eq(self.padding_idx)

        inner_states = [x]
        for idx, layer in enumerate(self.layers):
            if incremental_state is None:
                self_attn_mask = self.buffered_future_mask(x)
            else:
                self_attn_mask = None
            x, layer_attn, _ = layer(x, enc, padding_mask, incremental_state, self_attn_mask=self_attn_mask,
                                     self_attn_padding_mask=self_attn_padding_mask, need_attn=False,
                                     need_head_weights=False)
            inner_states.append(x)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        x = x.transpose(0, 1)  # T x B x C -> B x T x C
        return x, {"inner_states": inner_states}

    def output_layer(self, features):
        return self.output_projection(features)

    def buffered_future_mask(self, tensor):
        dim = tensor.size(0)
        if (self._future_mask.size(0) == 0 or (not self._future_mask.device == tensor.device)
                or self._future_mask.size(0) < dim):
            self._future_mask = torch.triu(fill_with_neg_inf(torch.zeros([dim, dim])), 1)
        self._future_mask = self._future_mask.to(tensor)
        return self._future_mask[:dim, :dim]


# ---------------------------------------------------------------- stand-in for GVPTransformerEncoder
class TinyStructureEncoder(nn.Module):
    """Returns the fairseq encoder_out dict GVPTransformerEncoder returns (T x B x C features + padding mask)."""

    def __init__(self, args):
        super().__init__()
        self.proj = nn.Linear(9, args.encoder_embed_dim)
        self.norm = nn.LayerNorm(args.encoder_embed_dim)

    def forward(self, coords, padding_mask, confidence, return_all_hiddens=False):
        x = self.norm(self.proj(coords.flatten(-2)))  # B x L x C
        return {"encoder_out": [x.transpose(0, 1)], "encoder_padding_mask": [padding_mask]}


# ---------------------------------------------------------------- esm/inverse_folding/gvp_transformer.py
class GVPTransformerModel(nn.Module):
    def __init__(self, args, alphabet):
        super().__init__()
        decoder_embed_tokens = self.build_embedding(args, alphabet, args.decoder_embed_dim)
        self.args = args
        self.encoder = TinyStructureEncoder(args)
        self.decoder = TransformerDecoder(args, alphabet, decoder_embed_tokens)
        self.step_probs = {}  # instrumentation for this reproduction: probs used at each sampled position

    @classmethod
    def build_embedding(cls, args, dictionary, embed_dim):
        num_embeddings = len(dictionary)
        padding_idx = dictionary.padding_idx
        emb = nn.Embedding(num_embeddings, embed_dim, padding_idx)
        nn.init.normal_(emb.weight, mean=0, std=embed_dim ** -0.5)
        nn.init.constant_(emb.weight[padding_idx], 0)
        return emb

    def sample(self, coords, partial_seq=None, temperature=1.0, confidence=None):
        L = len(coords)
        # Convert to batch format (CoordBatchConverter: <cath>-style BOS/EOS padding around the coords)
        batch_coords = F.pad(coords, (0, 0, 0, 0, 1, 1), value=0.0)[None]
        padding_mask = torch.zeros(1, L + 2, dtype=torch.bool)

        # Start with prepend token
        mask_idx = self.decoder.dictionary.get_idx('<mask>')
        sampled_tokens = torch.full((1, 1 + L), mask_idx, dtype=int)
        sampled_tokens[0, 0] = self.decoder.dictionary.get_idx('<cath>')
        if partial_seq is not None:
            for i, c in enumerate(partial_seq):
                sampled_tokens[0, i + 1] = self.decoder.dictionary.get_idx(c)

        # Save incremental states for faster sampling
        incremental_state = dict()

        # Run encoder only once
        encoder_out = self.encoder(batch_coords, padding_mask, confidence)

        # Decode one token at a time
        for i in range(1, L + 1):
            if not FIXED:
                if sampled_tokens[0, i] != mask_idx:
                    continue
            logits, _ = self.decoder(
                sampled_tokens[:, :i],
                encoder_out,
                incremental_state=incremental_state,
            )
            logits = logits[0].transpose(0, 1)
            logits /= temperature
            probs = F.softmax(logits, dim=-1)
            if FIXED:
                if sampled_tokens[0, i] == mask_idx:
                    self.step_probs[i] = probs[0].clone()
                    sampled_tokens[:, i] = torch.multinomial(probs, 1).squeeze(-1)
            else:
                self.step_probs[i] = probs[0].clone()
                sampled_tokens[:, i] = torch.multinomial(probs, 1).squeeze(-1)
        sampled_seq = sampled_tokens[0, 1:]
        self.last_tokens = sampled_tokens
        return ''.join([self.decoder.dictionary.get_tok(a) for a in sampled_seq])


def main():
    torch.manual_seed(0)
    alphabet = Alphabet()
    model = GVPTransformerModel(Args(), alphabet).eval()
    L = 20
    coords = torch.randn(L, 3, 3)
    # partial sequence: a fixed motif interleaved with positions to design
    known = list("MKTAYIAKQRQISFVKSHFS")
    partial_seq = [c if (i % 3 != 2) else '<mask>' for i, c in enumerate(known)]
    with torch.no_grad():
        seq = model.sample(coords, partial_seq=partial_seq, temperature=1.0)
        # reference: one teacher-forced decoder pass (causal future mask, no incremental state) over the
        # final sequence; the distribution at every designed position must match what sampling used.
        batch_coords = F.pad(coords, (0, 0, 0, 0, 1, 1), value=0.0)[None]
        enc = model.encoder(batch_coords, torch.zeros(1, L + 2, dtype=torch.bool), None)
        logits, _ = model.decoder(model.last_tokens[:, :L], enc)
        ref = F.softmax(logits[0].transpose(0, 1), dim=-1)  # [L, V]; row j predicts token j+1
    diff = max((model.step_probs[i] - ref[i - 1]).abs().max().item() for i in model.step_probs)
    print("sampled:", seq)
    print(f"max |p_incremental - p_full| over designed positions: {diff:.6e}")


if __name__ == "__main__":
    main()
