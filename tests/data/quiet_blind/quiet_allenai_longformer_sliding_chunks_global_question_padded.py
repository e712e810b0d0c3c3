"""Correct program: the original Longformer self-attention (allenai/longformer, attention_mode
'sliding_chunks') in a tiny RoBERTa-shaped encoder, on a RIGHT-padded batch of
question + document inputs whose <s> and question tokens get global attention.

Citation: allenai/longformer
  longformer/longformer.py @06187c8e27ad810564e838bba678bba8d168b132
      LongformerSelfAttention.forward: the extended mask (RobertaModel's (1 - m) * -10000 of the
      0 / 1 / 2 mask) is read as -ve = no attention (key_padding_mask), 0 = local, +ve = global
      (extra_attention_mask); remove_from_windowed_attention_mask turns padding and global keys
      into a -10000 diagonal mask (sliding_chunks_matmul_qk(ones, float_mask)); global keys are
      gathered per row into max_num_extra_indices_per_batch slots (unused slots -10000) and
      concatenated in front of the window scores; padded query rows are zeroed after the
      softmax; global queries are recomputed with query_global / key_global / value_global
      over every key, padding filled with -10000.
  longformer/sliding_chunks.py @24303206c0d3d1a3e6ee348f7b5707ab5b6d1954
      sliding_chunks_matmul_qk / sliding_chunks_matmul_pv / _chunk / _skew / _skew2 and
      pad_to_window_size (pads ids with pad_token_id and the mask with 0 to a multiple of 2w).
  longformer/diagonaled_mm_tvm.py: mask_invalid_locations (w, dilation 1, not autoregressive).
  The README's usage: attention_mask 1 = local, 2 = global (the question tokens for TriviaQA),
  0 = padding, then pad_to_window_size, then model(input_ids, attention_mask=attention_mask).

Checks (float64 weights; the project's softmax is float32, so tolerances are 1e-5):
  1. hidden states of the padded batch at real tokens == a dense double-loop reference run on
     each row alone, unpadded: token i attends j when |i - j| <= w or j is global (local
     projections), a global token attends every real token (global projections);
  2. the <s> classifier logits of the padded batch == the same reference's, per row.
"""
import math
import sys
from functools import lru_cache
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)


# ---- longformer/diagonaled_mm_tvm.py (mask_invalid_locations) ------------------------------
def _get_invalid_locations_mask_fixed_dilation(seq_len: int, w: int, d: int):
    diagonals_list = []
    for j in range(-d * w, d, d):
        diagonal_mask = torch.zeros(seq_len, device='cpu', dtype=torch.uint8)
        diagonal_mask[:-j] = 1
        diagonals_list.append(diagonal_mask)
    return torch.stack(diagonals_list, dim=-1)


@lru_cache()
def _get_invalid_locations_mask(w: int, d: int, autoregressive: bool, device: str):
    affected_seq_len = w * d
    mask = _get_invalid_locations_mask_fixed_dilation(affected_seq_len, w, d)
    mask = mask[None, :, None, :]
    ending_mask = None if autoregressive else mask.flip(dims=(1, 3)).bool().to(device)
    return affected_seq_len, mask.bool().to(device), ending_mask


def mask_invalid_locations(input_tensor: torch.Tensor, w: int, d: int, autoregressive: bool) -> torch.Tensor:
    affected_seq_len, beginning_mask, ending_mask = _get_invalid_locations_mask(w, d, autoregressive, input_tensor.device)
    seq_len = input_tensor.size(1)
    beginning_input = input_tensor[:, :affected_seq_len, :, :w+1]
    beginning_mask = beginning_mask[:, :seq_len].expand(beginning_input.size())
    beginning_input.masked_fill_(beginning_mask, -float('inf'))
    if not autoregressive:
        ending_input = input_tensor[:, -affected_seq_len:, :, -(w+1):]
        ending_mask = ending_mask[:, -seq_len:].expand(ending_input.size())
        ending_input.masked_fill_(ending_mask, -float('inf'))


# ---- longformer/sliding_chunks.py ----------------------------------------------------------
def _skew(x, direction, padding_value):
    '''Convert diagonals into columns (or columns into diagonals depending on `direction`'''
    x_padded = F.pad(x, direction, value=padding_value)
    x_padded = x_padded.view(*x_padded.size()[:-2], x_padded.size(-1), x_padded.size(-2))
    return x_padded


def _skew2(x, padding_value):
    '''shift every row 1 step to right converting columns into diagonals'''
    B, C, M, L = x.size()
    x = F.pad(x, (0, M + 1), value=padding_value)  # B x C x M x (L+M+1)
    x = x.view(B, C, -1)  # B x C x ML+MM+M
    x = x[:, :, :-M]  # B x C x ML+MM
    x = x.view(B, C, M, M + L)  # B x C, M x L+M
    x = x[:, :, :, :-1]
    return x


def _chunk(x, w):
    '''convert into overlapping chunkings. Chunk size = 2w, overlap size = w'''
    x = x.view(x.size(0), x.size(1) // (w * 2), w * 2, x.size(2))
    chunk_size = list(x.size())
    chunk_size[1] = chunk_size[1] * 2 - 1
    chunk_stride = list(x.stride())
    chunk_stride[1] = chunk_stride[1] // 2
    return x.as_strided(size=chunk_size, stride=chunk_stride)


def sliding_chunks_matmul_qk(q: torch.Tensor, k: torch.Tensor, w: int, padding_value: float):
    bsz, seqlen, num_heads, head_dim = q.size()
    assert seqlen % (w * 2) == 0
    assert q.size() == k.size()
    chunks_count = seqlen // w - 1
    q = q.transpose(1, 2).reshape(bsz * num_heads, seqlen, head_dim)
    k = k.transpose(1, 2).reshape(bsz * num_heads, seqlen, head_dim)
    chunk_q = _chunk(q, w)
    chunk_k = _chunk(k, w)
    chunk_attn = torch.einsum('bcxd,bcyd->bcxy', (chunk_q, chunk_k))  # multiply
    diagonal_chunk_attn = _skew(chunk_attn, direction=(0, 0, 0, 1), padding_value=padding_value)
    diagonal_attn = diagonal_chunk_attn.new_empty((bsz * num_heads, chunks_count + 1, w, w * 2 + 1))
    diagonal_attn[:, :-1, :, w:] = diagonal_chunk_attn[:, :, :w, :w + 1]
    diagonal_attn[:, -1, :, w:] = diagonal_chunk_attn[:, -1, w:, :w + 1]
    diagonal_attn[:, 1:, :, :w] = diagonal_chunk_attn[:, :, - (w + 1):-1, w + 1:]
    diagonal_attn[:, 0, 1:w, 1:w] = diagonal_chunk_attn[:, 0, :w - 1, 1 - w:]
    diagonal_attn = diagonal_attn.view(bsz, num_heads, seqlen, 2 * w + 1).transpose(2, 1)
    mask_invalid_locations(diagonal_attn, w, 1, False)
    return diagonal_attn


def sliding_chunks_matmul_pv(prob: torch.Tensor, v: torch.Tensor, w: int):
    bsz, seqlen, num_heads, head_dim = v.size()
    assert seqlen % (w * 2) == 0
    assert prob.size()[:3] == v.size()[:3]
    assert prob.size(3) == 2 * w + 1
    chunks_count = seqlen // w - 1
    chunk_prob = prob.transpose(1, 2).reshape(bsz * num_heads, seqlen // w, w, 2 * w + 1)
    v = v.transpose(1, 2).reshape(bsz * num_heads, seqlen, head_dim)
    padded_v = F.pad(v, (0, 0, w, w), value=-1)
    chunk_v_size = (bsz * num_heads, chunks_count + 1, 3 * w, head_dim)
    chunk_v_stride = padded_v.stride()
    chunk_v_stride = chunk_v_stride[0], w * chunk_v_stride[1], chunk_v_stride[1], chunk_v_stride[2]
    chunk_v = padded_v.as_strided(size=chunk_v_size, stride=chunk_v_stride)
    skewed_prob = _skew2(chunk_prob, padding_value=0)
    context = torch.einsum('bcwd,bcdh->bcwh', (skewed_prob, chunk_v))
    return context.view(bsz, num_heads, seqlen, head_dim).transpose(1, 2)


def pad_to_window_size(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       one_sided_window_size: int, pad_token_id: int):
    w = 2 * one_sided_window_size
    seqlen = input_ids.size(1)
    padding_len = (w - seqlen % w) % w
    input_ids = F.pad(input_ids, (0, padding_len), value=pad_token_id)
    attention_mask = F.pad(attention_mask, (0, padding_len), value=False)  # no attention on the padding tokens
    return input_ids, attention_mask


# ---- longformer/longformer.py: LongformerSelfAttention (sliding_chunks branch) -------------
class LongformerSelfAttention(nn.Module):
    def __init__(self, config, layer_id):
        super(LongformerSelfAttention, self).__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = int(config.hidden_size / config.num_attention_heads)
        self.embed_dim = config.hidden_size
        self.query = nn.Linear(config.hidden_size, self.embed_dim)
        self.key = nn.Linear(config.hidden_size, self.embed_dim)
        self.value = nn.Linear(config.hidden_size, self.embed_dim)
        self.query_global = nn.Linear(config.hidden_size, self.embed_dim)
        self.key_global = nn.Linear(config.hidden_size, self.embed_dim)
        self.value_global = nn.Linear(config.hidden_size, self.embed_dim)
        self.dropout = config.attention_probs_dropout_prob
        self.layer_id = layer_id
        self.attention_window = config.attention_window[self.layer_id]
        self.attention_dilation = config.attention_dilation[self.layer_id]
        self.attention_mode = config.attention_mode
        assert self.attention_mode == 'sliding_chunks'

    def forward(self, hidden_states, attention_mask=None):
        '''
        The `attention_mask` is changed in `BertModel.forward` from 0, 1, 2 to
            -ve: no attention
              0: local attention
            +ve: global attention
        '''
        if attention_mask is not None:
            attention_mask = attention_mask.squeeze(dim=2).squeeze(dim=1)
            key_padding_mask = attention_mask < 0
            extra_attention_mask = attention_mask > 0
            remove_from_windowed_attention_mask = attention_mask != 0

            num_extra_indices_per_batch = extra_attention_mask.long().sum(dim=1)
            max_num_extra_indices_per_batch = num_extra_indices_per_batch.max()
            if max_num_extra_indices_per_batch <= 0:
                extra_attention_mask = None
            else:
                extra_attention_mask_nonzeros = extra_attention_mask.nonzero(as_tuple=True)
                zero_to_max_range = torch.arange(0, max_num_extra_indices_per_batch,
                                                 device=num_extra_indices_per_batch.device)
                selection_padding_mask = zero_to_max_range < num_extra_indices_per_batch.unsqueeze(dim=-1)
                selection_padding_mask_nonzeros = selection_padding_mask.nonzero(as_tuple=True)
                selection_padding_mask_zeros = (selection_padding_mask == 0).nonzero(as_tuple=True)
        else:
            remove_from_windowed_attention_mask = None
            extra_attention_mask = None
            key_padding_mask = None
        hidden_states = hidden_states.transpose(0, 1)
        seq_len, bsz, embed_dim = hidden_states.size()
        assert embed_dim == self.embed_dim
        q = self.query(hidden_states)
        k = self.key(hidden_states)
        v = self.value(hidden_states)
        q /= math.sqrt(self.head_dim)

        q = q.view(seq_len, bsz, self.num_heads, self.head_dim).transpose(0, 1)
        k = k.view(seq_len, bsz, self.num_heads, self.head_dim).transpose(0, 1)
        attn_weights = sliding_chunks_matmul_qk(q, k, self.attention_window, padding_value=0)

        if remove_from_windowed_attention_mask is not None:
            remove_from_windowed_attention_mask = remove_from_windowed_attention_mask.unsqueeze(dim=-1).unsqueeze(dim=-1)
            float_mask = remove_from_windowed_attention_mask.type_as(q).masked_fill(remove_from_windowed_attention_mask, -10000.0)
            repeat_size = 1 if isinstance(self.attention_dilation, int) else len(self.attention_dilation)
            float_mask = float_mask.repeat(1, 1, repeat_size, 1)
            ones = float_mask.new_ones(size=float_mask.size())  # tensor of ones
            d_mask = sliding_chunks_matmul_qk(ones, float_mask, self.attention_window, padding_value=0)
            attn_weights += d_mask

        if extra_attention_mask is not None:
            selected_k = k.new_zeros(bsz, max_num_extra_indices_per_batch, self.num_heads, self.head_dim)
            selected_k[selection_padding_mask_nonzeros] = k[extra_attention_mask_nonzeros]
            selected_attn_weights = torch.einsum('blhd,bshd->blhs', (q, selected_k))
            selected_attn_weights[selection_padding_mask_zeros[0], :, :, selection_padding_mask_zeros[1]] = -10000
            attn_weights = torch.cat((selected_attn_weights, attn_weights), dim=-1)

        attn_weights_float = F.softmax(attn_weights, dim=-1, dtype=torch.float32)  # use fp32 for numerical stability
        if key_padding_mask is not None:
            # softmax sometimes inserts NaN if all positions are masked, replace them with 0
            attn_weights_float = torch.masked_fill(attn_weights_float, key_padding_mask.unsqueeze(-1).unsqueeze(-1), 0.0)

        attn_weights = attn_weights_float.type_as(attn_weights)
        attn_probs = F.dropout(attn_weights_float.type_as(attn_weights), p=self.dropout, training=self.training)
        v = v.view(seq_len, bsz, self.num_heads, self.head_dim).transpose(0, 1)
        attn = 0
        if extra_attention_mask is not None:
            selected_attn_probs = attn_probs.narrow(-1, 0, max_num_extra_indices_per_batch)
            selected_v = v.new_zeros(bsz, max_num_extra_indices_per_batch, self.num_heads, self.head_dim)
            selected_v[selection_padding_mask_nonzeros] = v[extra_attention_mask_nonzeros]
            attn = torch.matmul(selected_attn_probs.transpose(1, 2), selected_v.transpose(1, 2).type_as(selected_attn_probs)).transpose(1, 2)
            attn_probs = attn_probs.narrow(-1, max_num_extra_indices_per_batch, attn_probs.size(-1) - max_num_extra_indices_per_batch).contiguous()

        attn += sliding_chunks_matmul_pv(attn_probs, v, self.attention_window)

        attn = attn.type_as(hidden_states)
        assert list(attn.size()) == [bsz, seq_len, self.num_heads, self.head_dim]
        attn = attn.transpose(0, 1).reshape(seq_len, bsz, embed_dim).contiguous()

        if extra_attention_mask is not None:
            selected_hidden_states = hidden_states.new_zeros(max_num_extra_indices_per_batch, bsz, embed_dim)
            selected_hidden_states[selection_padding_mask_nonzeros[::-1]] = hidden_states[extra_attention_mask_nonzeros[::-1]]

            q = self.query_global(selected_hidden_states)
            k = self.key_global(hidden_states)
            v = self.value_global(hidden_states)
            q /= math.sqrt(self.head_dim)

            q = q.contiguous().view(max_num_extra_indices_per_batch, bsz * self.num_heads, self.head_dim).transpose(0, 1)
            k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
            v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
            attn_weights = torch.bmm(q, k.transpose(1, 2))
            assert list(attn_weights.size()) == [bsz * self.num_heads, max_num_extra_indices_per_batch, seq_len]

            attn_weights = attn_weights.view(bsz, self.num_heads, max_num_extra_indices_per_batch, seq_len)
            attn_weights[selection_padding_mask_zeros[0], :, selection_padding_mask_zeros[1], :] = -10000.0
            if key_padding_mask is not None:
                attn_weights = attn_weights.masked_fill(
                    key_padding_mask.unsqueeze(1).unsqueeze(2),
                    -10000.0,
                )
            attn_weights = attn_weights.view(bsz * self.num_heads, max_num_extra_indices_per_batch, seq_len)
            attn_weights_float = F.softmax(attn_weights, dim=-1, dtype=torch.float32)  # use fp32 for numerical stability
            attn_probs = F.dropout(attn_weights_float.type_as(attn_weights), p=self.dropout, training=self.training)
            selected_attn = torch.bmm(attn_probs, v)
            assert list(selected_attn.size()) == [bsz * self.num_heads, max_num_extra_indices_per_batch, self.head_dim]

            selected_attn_4d = selected_attn.view(bsz, self.num_heads, max_num_extra_indices_per_batch, self.head_dim)
            nonzero_selected_attn = selected_attn_4d[selection_padding_mask_nonzeros[0], :, selection_padding_mask_nonzeros[1]]
            attn[extra_attention_mask_nonzeros[::-1]] = nonzero_selected_attn.view(len(selection_padding_mask_nonzeros[0]), -1).type_as(hidden_states)

        context_layer = attn.transpose(0, 1)
        return (context_layer,)


# ---- the RoBERTa shell around it (trimmed BertLayer / BertModel) -----------------------------
class Layer(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        self.self_attn = LongformerSelfAttention(config, layer_id)
        self.attn_out = nn.Linear(config.hidden_size, config.hidden_size)
        self.ln1 = nn.LayerNorm(config.hidden_size)
        self.ff1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.ff2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.ln2 = nn.LayerNorm(config.hidden_size)

    def forward(self, h, extended_attention_mask):
        a = self.self_attn(h, extended_attention_mask)[0]
        h = self.ln1(h + self.attn_out(a))
        return self.ln2(h + self.ff2(F.gelu(self.ff1(h))))


class Longformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.emb_ln = nn.LayerNorm(config.hidden_size)
        self.layer = nn.ModuleList([Layer(config, i) for i in range(config.num_hidden_layers)])
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, input_ids, attention_mask):
        positions = torch.arange(input_ids.size(1))[None].expand_as(input_ids)
        h = self.emb_ln(self.word_embeddings(input_ids) + self.position_embeddings(positions))
        # BertModel.get_extended_attention_mask: 0 -> -10000 (no attention), 1 -> 0 (local), 2 -> +10000 (global)
        extended_attention_mask = attention_mask[:, None, None, :].to(h.dtype)
        extended_attention_mask = (1.0 - extended_attention_mask) * -10000.0
        for layer in self.layer:
            h = layer(h, extended_attention_mask)
        return h, self.classifier(h[:, 0])


config = SimpleNamespace(
    vocab_size=50, hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=2,
    max_position_embeddings=64, attention_window=[2, 4], attention_dilation=[1, 1],
    attention_mode='sliding_chunks', attention_probs_dropout_prob=0.0, pad_token_id=1, num_labels=3,
)
model = Longformer(config).eval()
BOS, EOS, PAD = 0, 2, config.pad_token_id

# TriviaQA-style: <s> question </s></s> document </s>; <s> and question tokens global
questions = [4, 2, 3, 5]
documents = [22, 9, 15, 4]
rows, globals_ = [], []
for nq, nd in zip(questions, documents):
    q = torch.randint(3, config.vocab_size, (nq,))
    d = torch.randint(3, config.vocab_size, (nd,))
    ids = torch.cat([torch.tensor([BOS]), q, torch.tensor([EOS, EOS]), d, torch.tensor([EOS])])
    g = torch.zeros(len(ids), dtype=torch.bool)
    g[: nq + 1] = True
    rows.append(ids)
    globals_.append(g)

width = max(len(r) for r in rows)
input_ids = torch.full((len(rows), width), PAD, dtype=torch.long)
attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
for i, (r, g) in enumerate(zip(rows, globals_)):
    input_ids[i, : len(r)] = r
    attention_mask[i, : len(r)] = 1
    attention_mask[i, : len(r)][g] = 2
input_ids, attention_mask = pad_to_window_size(input_ids, attention_mask, max(config.attention_window), PAD)
# every layer's window must divide the padded length by 2w as well
assert all(input_ids.size(1) % (2 * w) == 0 for w in config.attention_window), input_ids.size(1)

with torch.no_grad():
    hidden, logits = model(input_ids, attention_mask)


# ---- reference: one row alone, unpadded, a dense double loop ---------------------------------
def ref_attention(attn, h, is_global):
    L, D = h.shape
    H, hd = attn.num_heads, attn.head_dim
    w = attn.attention_window
    q = (attn.query(h) / math.sqrt(hd)).view(L, H, hd)
    k = attn.key(h).view(L, H, hd)
    v = attn.value(h).view(L, H, hd)
    qg = (attn.query_global(h) / math.sqrt(hd)).view(L, H, hd)
    kg = attn.key_global(h).view(L, H, hd)
    vg = attn.value_global(h).view(L, H, hd)
    out = torch.zeros(L, H, hd)
    for i in range(L):
        for hh in range(H):
            if is_global[i]:
                keys = list(range(L))
                s = torch.stack([qg[i, hh] @ kg[j, hh] for j in keys])
                p = torch.softmax(s, dim=0)
                out[i, hh] = sum(p[n] * vg[j, hh] for n, j in enumerate(keys))
            else:
                keys = [j for j in range(L) if abs(i - j) <= w or is_global[j]]
                s = torch.stack([q[i, hh] @ k[j, hh] for j in keys])
                p = torch.softmax(s, dim=0)
                out[i, hh] = sum(p[n] * v[j, hh] for n, j in enumerate(keys))
    return out.reshape(L, D)


def ref_forward(ids, is_global):
    positions = torch.arange(len(ids))
    h = model.emb_ln(model.word_embeddings(ids) + model.position_embeddings(positions))
    for layer in model.layer:
        a = ref_attention(layer.self_attn, h, is_global)
        h = layer.ln1(h + layer.attn_out(a))
        h = layer.ln2(h + layer.ff2(F.gelu(layer.ff1(h))))
    return h, model.classifier(h[0])


with torch.no_grad():
    for i, (r, g) in enumerate(zip(rows, globals_)):
        h_ref, logit_ref = ref_forward(r, g)
        torch.testing.assert_close(hidden[i, : len(r)], h_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits[i], logit_ref, rtol=1e-5, atol=1e-5)

print("ok: sliding_chunks Longformer on a padded batch matches a per-row dense double loop")
sys.exit(0)
