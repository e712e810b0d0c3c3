# Correct program (quiet batch quiet-zx).
# Ported from microsoft/MPNet @8b3055e50c0d24fa808e15e36e4565a70588f283 (its fairseq fork, the fine-tuning path):
#   pretraining/fairseq/modules/transformer_sentence_encoder.py (TransformerSentenceEncoder: padding_mask =
#     tokens.eq(padding_idx), None when there is no pad; pad embeddings zeroed; compute_position_bias builds one
#     (bsz * heads, qlen, klen) T5-style bucketed bias from arange positions; relative_position_bucket with
#     num_buckets=32, max_distance=128, bidirectional halves),
#   pretraining/fairseq/modules/rel_multihead_attention.py (RelativePositionMultiheadAttention.forward: key padding
#     masked_fill with -inf on the (bsz, heads, tgt, src) view, then positions_bias added, then softmax),
#   pretraining/fairseq/modules/transformer_sentence_encoder_layer.py (post-norm layer),
#   pretraining/fairseq/modules/learned_positional_embedding.py (make_positions from the padding),
#   pretraining/fairseq/models/roberta/model.py (RobertaEncoder builds the encoder with num_segments=0,
#     encoder_normalize_before=True, apply_bert_init; RobertaClassificationHead on features[:, 0, :]).
# fairseq's own helpers (utils.make_positions, utils.softmax, LayerNorm, data_utils.collate_tokens with
# left_pad=False as RightPadDataset uses it for sentence prediction) are written out; the incremental-state, bias_kv
# and zero_attn branches are left out. Sizes are tiny and weights random; the relative bias table is redrawn with a
# larger spread so that it matters.
# Self-check: (1) a double loop over (query, key) recomputes every bucket from the T5 formula and checks every entry
# of compute_position_bias, in its (batch * heads) row order; (2) every sentence alone, unpadded (so padding_mask is
# None), through the same encoder: real-token features and classification logits of the padded batch must match.
import math
import sys
from argparse import Namespace

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


# --- fairseq/utils.py, data_utils.collate_tokens ---
def make_positions(tensor, padding_idx):
    mask = tensor.ne(padding_idx).int()
    return (torch.cumsum(mask, dim=1).type_as(mask) * mask).long() + padding_idx


def collate_tokens(values, pad_idx, left_pad=False):
    size = max(v.size(0) for v in values)
    res = values[0].new(len(values), size).fill_(pad_idx)
    for i, v in enumerate(values):
        dst = res[i][size - len(v):] if left_pad else res[i][:len(v)]
        dst.copy_(v)
    return res


# --- fairseq/modules/learned_positional_embedding.py ---
class LearnedPositionalEmbedding(nn.Embedding):
    def forward(self, input, positions=None):
        if positions is None:
            positions = make_positions(input.data, self.padding_idx)
        return super().forward(positions)


# --- fairseq/modules/rel_multihead_attention.py ---
class RelativePositionMultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0., bias=True, self_attention=False):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.self_attention = self_attention
        self.in_proj_weight = nn.Parameter(torch.Tensor(3 * embed_dim, embed_dim))
        self.in_proj_bias = nn.Parameter(torch.Tensor(3 * embed_dim))
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        nn.init.xavier_uniform_(self.in_proj_weight)
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.constant_(self.in_proj_bias, 0.)
        nn.init.constant_(self.out_proj.bias, 0.)

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                positions_bias=None):
        tgt_len, bsz, embed_dim = query.size()
        q, k, v = F.linear(query, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        q *= self.scaling

        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        src_len = k.size(1)

        if key_padding_mask is not None:
            assert key_padding_mask.size(0) == bsz
            assert key_padding_mask.size(1) == src_len

        attn_weights = torch.bmm(q, k.transpose(1, 2))
        assert list(attn_weights.size()) == [bsz * self.num_heads, tgt_len, src_len]

        if attn_mask is not None:
            attn_weights += attn_mask.unsqueeze(0)

        if key_padding_mask is not None:
            # don't attend to padding symbols
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            attn_weights = attn_weights.masked_fill(
                key_padding_mask.unsqueeze(1).unsqueeze(2),
                float('-inf'),
            )
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)

        if positions_bias is not None:
            attn_weights += positions_bias

        attn_weights = F.softmax(attn_weights.float(), dim=-1).type_as(attn_weights)
        attn_weights = F.dropout(attn_weights, p=self.dropout, training=self.training)

        attn = torch.bmm(attn_weights, v)
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        attn = self.out_proj(attn)
        return attn, None


# --- fairseq/modules/transformer_sentence_encoder_layer.py ---
class TransformerSentenceEncoderLayer(nn.Module):
    def __init__(self, embedding_dim, ffn_embedding_dim, num_attention_heads, dropout, attention_dropout,
                 activation_dropout, activation_fn='gelu', normalize_before=False):
        super().__init__()
        self.dropout = dropout
        self.activation_dropout = activation_dropout
        self.activation_fn = F.gelu if activation_fn == 'gelu' else F.relu
        self.self_attn = RelativePositionMultiheadAttention(embedding_dim, num_attention_heads,
                                                            dropout=attention_dropout, self_attention=True)
        self.self_attn_layer_norm = nn.LayerNorm(embedding_dim)
        self.fc1 = nn.Linear(embedding_dim, ffn_embedding_dim)
        self.fc2 = nn.Linear(ffn_embedding_dim, embedding_dim)
        self.final_layer_norm = nn.LayerNorm(embedding_dim)
        self.normalize_before = normalize_before

    def forward(self, x, self_attn_mask=None, self_attn_padding_mask=None, positions_bias=None):
        residual = x
        x = self.maybe_layer_norm(self.self_attn_layer_norm, x, before=True)
        x, attn = self.self_attn(query=x, key=x, value=x, key_padding_mask=self_attn_padding_mask,
                                 need_weights=False, attn_mask=self_attn_mask, positions_bias=positions_bias)
        x = F.dropout(x, p=self.dropout, training=self.training)
        x = residual + x
        x = self.maybe_layer_norm(self.self_attn_layer_norm, x, after=True)

        residual = x
        x = self.maybe_layer_norm(self.final_layer_norm, x, before=True)
        x = self.activation_fn(self.fc1(x))
        x = F.dropout(x, p=self.activation_dropout, training=self.training)
        x = self.fc2(x)
        x = F.dropout(x, p=self.dropout, training=self.training)
        x = residual + x
        x = self.maybe_layer_norm(self.final_layer_norm, x, after=True)
        return x, attn

    def maybe_layer_norm(self, layer_norm, x, before=False, after=False):
        assert before ^ after
        if after ^ self.normalize_before:
            return layer_norm(x)
        else:
            return x


# --- fairseq/modules/transformer_sentence_encoder.py ---
def init_bert_params(module):
    if isinstance(module, nn.Linear):
        module.weight.data.normal_(mean=0.0, std=0.02)
        if module.bias is not None:
            module.bias.data.zero_()
    if isinstance(module, nn.Embedding):
        module.weight.data.normal_(mean=0.0, std=0.02)
        if module.padding_idx:
            module.weight.data[module.padding_idx].zero_()
    if isinstance(module, RelativePositionMultiheadAttention):
        module.in_proj_weight.data.normal_(mean=0.0, std=0.02)


class TransformerSentenceEncoder(nn.Module):
    def __init__(self, padding_idx, vocab_size, num_encoder_layers=6, embedding_dim=768, ffn_embedding_dim=3072,
                 num_attention_heads=8, dropout=0.1, attention_dropout=0.1, activation_dropout=0.1, max_seq_len=256,
                 encoder_normalize_before=False, apply_bert_init=False, activation_fn="relu",
                 has_relative_attention_bias=True, relative_attention_num_buckets=32, normalize_before=False):
        super().__init__()
        self.padding_idx = padding_idx
        self.dropout = dropout
        self.embed_tokens = nn.Embedding(vocab_size, embedding_dim, self.padding_idx)
        self.embed_scale = None
        self.segment_embeddings = None  # num_segments=0
        self.embed_positions = LearnedPositionalEmbedding(max_seq_len + padding_idx + 1, embedding_dim, padding_idx)
        if has_relative_attention_bias:
            self.relative_attention_num_buckets = relative_attention_num_buckets
            self.relative_attention_bias = nn.Embedding(
                self.relative_attention_num_buckets, num_attention_heads, padding_idx=None)
        else:
            self.relative_attention_bias = None
        self.layers = nn.ModuleList([
            TransformerSentenceEncoderLayer(embedding_dim, ffn_embedding_dim, num_attention_heads, dropout,
                                            attention_dropout, activation_dropout, activation_fn, normalize_before)
            for _ in range(num_encoder_layers)
        ])
        self.emb_layer_norm = nn.LayerNorm(embedding_dim) if encoder_normalize_before else None
        self.normalize_before = normalize_before
        if apply_bert_init:
            self.apply(init_bert_params)

    def forward(self, tokens, segment_labels=None, last_state_only=False, positions=None):
        # compute padding mask. This is needed for multi-head attention
        padding_mask = tokens.eq(self.padding_idx)
        if not padding_mask.any():
            padding_mask = None

        x = self.embed_tokens(tokens)
        if self.embed_scale is not None:
            x *= self.embed_scale
        if self.embed_positions is not None:
            x += self.embed_positions(tokens, positions=positions)
        if self.emb_layer_norm is not None and not self.normalize_before:
            x = self.emb_layer_norm(x)
        x = F.dropout(x, p=self.dropout, training=self.training)

        # account for padding while computing the representation
        if padding_mask is not None:
            x *= 1 - padding_mask.unsqueeze(-1).type_as(x)

        # B x T x C -> T x B x C
        x = x.transpose(0, 1)

        positions_bias = None
        if self.relative_attention_bias:
            positions_bias = self.compute_position_bias(x, self.relative_attention_num_buckets)

        inner_states = []
        if not last_state_only:
            inner_states.append(x)
        for layer in self.layers:
            x, _ = layer(x, self_attn_padding_mask=padding_mask, positions_bias=positions_bias)
            if not last_state_only:
                inner_states.append(x)

        if self.emb_layer_norm is not None and self.normalize_before:
            x = self.emb_layer_norm(x)

        # T x B x C -> B x T x C
        x = x.transpose(0, 1)
        sentence_rep = x[:, 0, :]
        if last_state_only:
            inner_states = [x]
        return inner_states, sentence_rep

    def compute_position_bias(self, x, num_buckets):
        bsz, qlen, klen = x.size(1), x.size(0), x.size(0)
        context_position = torch.arange(qlen, dtype=torch.long)[:, None]
        memory_position = torch.arange(klen, dtype=torch.long)[None, :]

        relative_position = memory_position - context_position

        rp_bucket = self.relative_position_bucket(relative_position, num_buckets=num_buckets)
        rp_bucket = rp_bucket.to(x.device)
        values = self.relative_attention_bias(rp_bucket)
        values = values.permute([2, 0, 1]).unsqueeze(0)
        values = values.expand((bsz, -1, qlen, klen)).contiguous()
        values = values.view(-1, qlen, klen)
        return values

    @staticmethod
    def relative_position_bucket(relative_position, num_buckets=32, max_distance=128):
        ret = 0
        n = -relative_position

        num_buckets //= 2
        ret += (n < 0).to(torch.long) * num_buckets
        n = torch.abs(n)

        max_exact = num_buckets // 2
        is_small = n < max_exact

        val_if_large = max_exact + (
            torch.log(n.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
        ).to(torch.long)

        val_if_large = torch.min(val_if_large, torch.full_like(val_if_large, num_buckets - 1))
        ret += torch.where(is_small, n, val_if_large)
        return ret


# --- fairseq/models/roberta/model.py ---
class RobertaClassificationHead(nn.Module):
    def __init__(self, input_dim, inner_dim, num_classes, pooler_dropout):
        super().__init__()
        self.dense = nn.Linear(input_dim, inner_dim)
        self.activation_fn = torch.tanh
        self.dropout = nn.Dropout(p=pooler_dropout)
        self.out_proj = nn.Linear(inner_dim, num_classes)

    def forward(self, features, **kwargs):
        x = features[:, 0, :]  # take <s> token (equiv. to [CLS])
        x = self.dropout(x)
        x = self.dense(x)
        x = self.activation_fn(x)
        x = self.dropout(x)
        x = self.out_proj(x)
        return x


def reference_bucket(i, j, num_buckets=32, max_distance=128):
    # T5's bidirectional bucket for query position i, key position j, one pair at a time
    n = i - j
    half = num_buckets // 2
    base = half if n < 0 else 0
    n = abs(n)
    max_exact = half // 2
    if n < max_exact:
        return base + n
    large = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact) * (half - max_exact))
    return base + min(large, half - 1)


def main():
    args = Namespace(encoder_layers=2, encoder_embed_dim=32, encoder_ffn_embed_dim=64, encoder_attention_heads=4,
                     activation_fn="gelu", dropout=0.1, attention_dropout=0.1, activation_dropout=0.0,
                     pooler_dropout=0.0, max_positions=64, use_relative_positions=True, normalize_before=False)
    bos, pad, eos, vocab_size = 0, 1, 2, 50
    sentence_encoder = TransformerSentenceEncoder(
        padding_idx=pad, vocab_size=vocab_size, num_encoder_layers=args.encoder_layers,
        embedding_dim=args.encoder_embed_dim, ffn_embedding_dim=args.encoder_ffn_embed_dim,
        num_attention_heads=args.encoder_attention_heads, dropout=args.dropout,
        attention_dropout=args.attention_dropout, activation_dropout=args.activation_dropout,
        max_seq_len=args.max_positions, encoder_normalize_before=True, apply_bert_init=True,
        activation_fn=args.activation_fn, has_relative_attention_bias=args.use_relative_positions,
        normalize_before=args.normalize_before).eval()
    head = RobertaClassificationHead(args.encoder_embed_dim, args.encoder_embed_dim, 3, args.pooler_dropout).eval()
    with torch.no_grad():
        sentence_encoder.relative_attention_bias.weight.normal_(0.0, 2.0)
        for layer in sentence_encoder.layers:
            layer.self_attn.in_proj_weight.normal_(0.0, 0.3)

    lengths = [22, 6, 13, 3]
    sentences = [torch.cat([torch.tensor([bos]), torch.randint(4, vocab_size, (n - 2,)), torch.tensor([eos])])
                 for n in lengths]
    src_tokens = collate_tokens(sentences, pad, left_pad=False)
    assert src_tokens.eq(pad).any() and not src_tokens[0].eq(pad).any()

    with torch.no_grad():
        # (1) the bias tensor, entry by entry, against the bucket formula in a double loop
        B, T, H = src_tokens.size(0), src_tokens.size(1), args.encoder_attention_heads
        bias = sentence_encoder.compute_position_bias(torch.zeros(T, B, 1), 32)
        table = sentence_encoder.relative_attention_bias.weight
        for b in range(B):
            for h in range(H):
                for i in range(T):
                    for j in range(T):
                        assert bias[b * H + h, i, j] == table[reference_bucket(i, j), h], (b, h, i, j)

        # (2) the padded batch against every sentence alone
        inner_states, _ = sentence_encoder(src_tokens, last_state_only=True)
        features = inner_states[-1]
        logits = head(features)
        for i, sent in enumerate(sentences):
            ref_states, _ = sentence_encoder(sent[None], last_state_only=True)
            ref_features = ref_states[-1][0]
            n = len(sent)
            diff = (features[i, :n] - ref_features).abs().max()
            assert torch.allclose(features[i, :n], ref_features, atol=1e-5), (i, diff)
            ref_logits = head(ref_features[None])[0]
            assert torch.allclose(logits[i], ref_logits, atol=1e-5), (i, logits[i], ref_logits)
    print(f"bucketed relative bias ({B * H} x {T} x {T}) == double-loop T5 buckets; padded-batch features and "
          f"logits == unpadded per-sentence runs (lengths {lengths})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
