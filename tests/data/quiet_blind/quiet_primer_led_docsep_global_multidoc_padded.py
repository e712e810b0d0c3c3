"""Correct program: PRIMER's multi-document summariser (allenai/PRIMER, the non-HF path) on a
RIGHT-padded batch of clusters of documents joined by <doc-sep>: <s> and every <doc-sep> get
global attention, the encoder is a Longformer-Encoder-Decoder (BART whose encoder self-attention
is allenai/longformer's LongformerSelfAttention, sliding_chunks), decoded with a padded target.

Citation: allenai/PRIMER script/primer_main.py @5acb5aa61a29b892efd7fdbe77b0a9fcdc618b0c
      PRIMERSummarizerLN._prepare_input: attention_mask = 1, 0 on pad ids, 2 on <s> (column 0)
      and on <doc-sep> (join_method 'concat_start_wdoc_global'), then pad_to_window_size with
      attention_window[0]; forward: decoder_input_ids = output_ids[:, :-1],
      decoder_attention_mask = decoder_input_ids != pad; shared_step: labels = output_ids[:, 1:],
      CrossEntropyLoss(ignore_index=pad_token_id); compute_rouge_batch: generate with the
      prepared attention_mask.
  allenai/longformer longformer/longformer_encoder_decoder.py @caefee668e39cacdece7dd603a0bebf24df6d8ca
      LongformerSelfAttentionForBart: the encoder's key_padding_mask (BartEncoder of the fork
      pinned in requirements.txt, ibeltagy/transformers@longformer_encoder_decoder, hands
      `1 - attention_mask`: pad 1, local 0, global -1; recalled, the fork is not in the index;
      scripts/summarization.py builds the same 0 / 1 / 2 mask) is passed as
      key_padding_mask.unsqueeze(1).unsqueeze(1) * -1 -> -ve no attention, 0 local, +ve global;
      longformer/longformer.py @06187c8e and longformer/sliding_chunks.py @24303206 as in
      quiet_allenai_longformer_sliding_chunks_global_question_padded.py (copied below).
  The decoder is BART's: a causal -inf triangle plus the decoder key padding mask for
  self-attention, and cross-attention over the encoder memory with the source padding as key
  padding mask (here through nn.MultiheadAttention, as BART's Attention computes it).

Checks (float64 weights; the Longformer softmax is float32, so tolerances are 1e-5):
  1. encoder output of the padded batch at real tokens == a dense double-loop reference on each
     cluster alone, unpadded (|i - j| <= w or j global with local projections; global rows
     attend every real token with global projections);
  2. teacher-forced logits at real target positions == each (cluster, summary) pair alone,
     unpadded, no padding masks; the PRIMER loss == a double loop of per-token cross entropy;
  3. a greedy loop on the padded batch with the prepared masks == a greedy loop per cluster alone.
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



# ---- longformer/longformer_encoder_decoder.py ------------------------------------------------
class LongformerSelfAttentionForBart(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        self.embed_dim = config.d_model
        self.longformer_self_attn = LongformerSelfAttention(config, layer_id=layer_id)
        self.output = nn.Linear(self.embed_dim, self.embed_dim)

    def forward(self, query, key, key_padding_mask=None, layer_state=None, attn_mask=None,
                need_weights=False, output_attentions=False):
        tgt_len, bsz, embed_dim = query.size()
        assert embed_dim == self.embed_dim
        assert attn_mask is None
        outputs = self.longformer_self_attn(
            query.transpose(0, 1),  # LongformerSelfAttention expects (bsz, seqlen, embd_dim)
            attention_mask=key_padding_mask.unsqueeze(dim=1).unsqueeze(dim=1) * -1,
        )
        attn_output = self.output(outputs[0].transpose(0, 1))
        return (attn_output, None)


# ---- a trimmed BART (post-LN, learned positions) around it -----------------------------------
class EncoderLayer(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        d = config.d_model
        self.self_attn = LongformerSelfAttentionForBart(config, layer_id)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, config.encoder_ffn_dim)
        self.fc2 = nn.Linear(config.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x, encoder_padding_mask):  # x: (T, B, E)
        residual = x
        x, _ = self.self_attn(query=x, key=x, key_padding_mask=encoder_padding_mask)
        x = self.self_attn_layer_norm(residual + x)
        residual = x
        x = self.fc2(F.gelu(self.fc1(x)))
        return self.final_layer_norm(residual + x)


class DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        d = config.d_model
        self.self_attn = nn.MultiheadAttention(d, config.decoder_attention_heads, batch_first=True)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn = nn.MultiheadAttention(d, config.decoder_attention_heads, batch_first=True)
        self.encoder_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, config.decoder_ffn_dim)
        self.fc2 = nn.Linear(config.decoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x, memory, encoder_padding_mask, decoder_padding_mask, causal_mask):
        a, _ = self.self_attn(x, x, x, attn_mask=causal_mask, key_padding_mask=decoder_padding_mask,
                              need_weights=False)
        x = self.self_attn_layer_norm(x + a)
        a, _ = self.encoder_attn(x, memory, memory, key_padding_mask=encoder_padding_mask, need_weights=False)
        x = self.encoder_attn_layer_norm(x + a)
        return self.final_layer_norm(x + self.fc2(F.gelu(self.fc1(x))))


def fill_with_neg_inf(t):
    return t.float().fill_(float("-inf")).type_as(t)


class LongformerEncoderDecoderForConditionalGeneration(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        d = config.d_model
        self.shared = nn.Embedding(config.vocab_size, d, padding_idx=config.pad_token_id)
        self.enc_pos = nn.Embedding(config.max_encoder_position_embeddings, d)
        self.dec_pos = nn.Embedding(config.max_decoder_position_embeddings, d)
        self.enc_ln = nn.LayerNorm(d)
        self.dec_ln = nn.LayerNorm(d)
        self.encoder_layers = nn.ModuleList([EncoderLayer(config, i) for i in range(config.encoder_layers)])
        self.decoder_layers = nn.ModuleList([DecoderLayer(config) for _ in range(config.decoder_layers)])

    def encode(self, input_ids, attention_mask):
        x = self.enc_ln(self.shared(input_ids) + self.enc_pos(torch.arange(input_ids.size(1))))
        # the Longformer fork of BartEncoder: pad 1, local 0, global -1
        encoder_padding_mask = 1 - attention_mask
        x = x.transpose(0, 1)
        for layer in self.encoder_layers:
            x = layer(x, encoder_padding_mask)
        return x.transpose(0, 1)

    def decode(self, decoder_input_ids, memory, attention_mask, decoder_attention_mask):
        T = decoder_input_ids.size(1)
        x = self.dec_ln(self.shared(decoder_input_ids) + self.dec_pos(torch.arange(T)))
        causal_mask = torch.triu(fill_with_neg_inf(torch.zeros(T, T)), 1)
        encoder_padding_mask = attention_mask.eq(0)
        decoder_padding_mask = None if decoder_attention_mask is None else ~decoder_attention_mask.bool()
        for layer in self.decoder_layers:
            x = layer(x, memory, encoder_padding_mask, decoder_padding_mask, causal_mask)
        return F.linear(x, self.shared.weight)

    def forward(self, input_ids, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
                use_cache=False):
        memory = self.encode(input_ids, attention_mask)
        return (self.decode(decoder_input_ids, memory, attention_mask, decoder_attention_mask), memory)


config = SimpleNamespace(
    vocab_size=60, d_model=32, encoder_attention_heads=4, decoder_attention_heads=4,
    num_attention_heads=4, hidden_size=32, encoder_ffn_dim=64, decoder_ffn_dim=64,
    encoder_layers=2, decoder_layers=2, max_encoder_position_embeddings=64,
    max_decoder_position_embeddings=32, attention_window=[3, 3], attention_dilation=[1, 1],
    attention_mode='sliding_chunks', attention_probs_dropout_prob=0.0,
    pad_token_id=1, bos_token_id=0, eos_token_id=2,
)
DOCSEP = 3
model = LongformerEncoderDecoderForConditionalGeneration(config).eval()


# ---- script/primer_main.py (PRIMERSummarizerLN, trimmed) -------------------------------------
class PRIMERSummarizerLN:
    def __init__(self, model, args):
        self.model = model
        self.args = args
        self.pad_token_id = model.config.pad_token_id
        self.docsep_token_id = DOCSEP

    def _prepare_input(self, input_ids):
        attention_mask = torch.ones(
            input_ids.shape, dtype=torch.long, device=input_ids.device
        )
        attention_mask[input_ids == self.pad_token_id] = 0
        if isinstance(self.model, LongformerEncoderDecoderForConditionalGeneration):
            # global attention on one token for all model params to be used,
            # which is important for gradient checkpointing to work
            attention_mask[:, 0] = 2

            if self.args.join_method == "concat_start_wdoc_global":
                attention_mask[input_ids == self.docsep_token_id] = 2

            if self.args.attention_mode == "sliding_chunks":
                half_padding_mod = self.model.config.attention_window[0]
            else:
                raise NotImplementedError

            input_ids, attention_mask = pad_to_window_size(
                input_ids,
                attention_mask,
                half_padding_mod,
                self.pad_token_id,
            )
        return input_ids, attention_mask

    def forward(self, input_ids, output_ids):
        input_ids, attention_mask = self._prepare_input(input_ids)
        decoder_input_ids = output_ids[:, :-1]
        decoder_attention_mask = decoder_input_ids != self.pad_token_id
        outputs = self.model(
            input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
            use_cache=False,
        )
        lm_logits = outputs[0]
        assert lm_logits.shape[-1] == self.model.config.vocab_size
        return lm_logits

    def shared_step(self, input_ids, output_ids):
        lm_logits = self.forward(input_ids, output_ids)
        labels = output_ids[:, 1:].clone()
        ce_loss_fct = torch.nn.CrossEntropyLoss(ignore_index=self.pad_token_id)
        loss = ce_loss_fct(lm_logits.view(-1, lm_logits.shape[-1]), labels.view(-1))
        return loss, lm_logits

    def greedy(self, input_ids, max_len):
        # model.generate(input_ids, attention_mask=attention_mask, num_beams=1), no cache
        input_ids, attention_mask = self._prepare_input(input_ids)
        memory = self.model.encode(input_ids, attention_mask)
        out = torch.full((input_ids.size(0), 1), config.bos_token_id, dtype=torch.long)
        done = torch.zeros(input_ids.size(0), dtype=torch.bool)
        for _ in range(max_len):
            logits = self.model.decode(out, memory, attention_mask, out != self.pad_token_id)
            nxt = logits[:, -1].argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, self.pad_token_id), nxt)
            out = torch.cat([out, nxt[:, None]], dim=1)
            done |= nxt == config.eos_token_id
            if done.all():
                break
        return out


args = SimpleNamespace(join_method="concat_start_wdoc_global", attention_mode="sliding_chunks")
summarizer = PRIMERSummarizerLN(model, args)
PAD, BOS, EOS = config.pad_token_id, config.bos_token_id, config.eos_token_id

# clusters of documents: <s> doc <doc-sep> doc <doc-sep> ... </s> (dataloader.py's concatenation)
clusters = [[7, 5, 6], [4, 3], [9], [3, 6, 2, 4]]
sources = []
for docs in clusters:
    ids = [BOS]
    for n in docs:
        ids += torch.randint(4, config.vocab_size, (n,)).tolist() + [DOCSEP]
    sources.append(torch.tensor(ids + [EOS]))
summaries = [torch.tensor([BOS] + torch.randint(4, config.vocab_size, (n,)).tolist() + [EOS]) for n in [5, 2, 4, 3]]


def pad_sequence(seqs):
    return torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=PAD)


input_ids = pad_sequence(sources)
output_ids = pad_sequence(summaries)

with torch.no_grad():
    loss, lm_logits = summarizer.shared_step(input_ids, output_ids)
    prepared_ids, prepared_mask = summarizer._prepare_input(input_ids)
    memory = model.encode(prepared_ids, prepared_mask)


# ---- reference: each cluster alone, unpadded, dense double loops -----------------------------
def ref_self_attention(attn, h, is_global):
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
                s = torch.stack([qg[i, hh] @ kg[j, hh] for j in range(L)])
                out[i, hh] = torch.softmax(s, 0) @ vg[:, hh]
            else:
                keys = [j for j in range(L) if abs(i - j) <= w or is_global[j]]
                s = torch.stack([q[i, hh] @ k[j, hh] for j in keys])
                out[i, hh] = torch.softmax(s, 0) @ v[keys, hh]
    return out.reshape(L, D)


def ref_mha(mha, x, mem, causal):
    # nn.MultiheadAttention's packed weights, one sequence, a double loop over queries and keys
    E = x.size(-1)
    H = mha.num_heads
    hd = E // H
    Wq, Wk, Wv = mha.in_proj_weight.split(E)
    bq, bk, bv = mha.in_proj_bias.split(E)
    q = (x @ Wq.T + bq).view(-1, H, hd)
    k = (mem @ Wk.T + bk).view(-1, H, hd)
    v = (mem @ Wv.T + bv).view(-1, H, hd)
    out = torch.zeros(x.size(0), H, hd)
    for i in range(x.size(0)):
        keys = list(range(i + 1)) if causal else list(range(mem.size(0)))
        for hh in range(H):
            s = torch.stack([q[i, hh] @ k[j, hh] / math.sqrt(hd) for j in keys])
            out[i, hh] = torch.softmax(s, 0) @ v[keys, hh]
    return mha.out_proj(out.reshape(-1, E))


def ref_encode(ids):
    is_global = (ids == DOCSEP)
    is_global[0] = True
    h = model.enc_ln(model.shared(ids) + model.enc_pos(torch.arange(len(ids))))
    for layer in model.encoder_layers:
        a = layer.self_attn.output(ref_self_attention(layer.self_attn.longformer_self_attn, h, is_global))
        h = layer.self_attn_layer_norm(h + a)
        h = layer.final_layer_norm(h + layer.fc2(F.gelu(layer.fc1(h))))
    return h


def ref_decode(dec_ids, mem):
    x = model.dec_ln(model.shared(dec_ids) + model.dec_pos(torch.arange(len(dec_ids))))
    for layer in model.decoder_layers:
        x = layer.self_attn_layer_norm(x + ref_mha(layer.self_attn, x, x, causal=True))
        x = layer.encoder_attn_layer_norm(x + ref_mha(layer.encoder_attn, x, mem, causal=False))
        x = layer.final_layer_norm(x + layer.fc2(F.gelu(layer.fc1(x))))
    return F.linear(x, model.shared.weight)


with torch.no_grad():
    total, count = 0.0, 0
    for b, (src, tgt) in enumerate(zip(sources, summaries)):
        mem = ref_encode(src)
        torch.testing.assert_close(memory[b, : len(src)], mem, rtol=1e-5, atol=1e-5)
        logits = ref_decode(tgt[:-1], mem)
        n = len(tgt) - 1
        torch.testing.assert_close(lm_logits[b, :n], logits, rtol=1e-5, atol=1e-5)
        for t in range(n):
            total += F.cross_entropy(logits[t][None], tgt[t + 1][None]).item()
            count += 1
    torch.testing.assert_close(loss.item(), total / count, rtol=1e-5, atol=1e-5)

    max_len = 6
    gen = summarizer.greedy(input_ids, max_len)
    for b, src in enumerate(sources):
        mem = ref_encode(src)
        ids = torch.tensor([BOS])
        for _ in range(max_len):
            nxt = ref_decode(ids, mem)[-1].argmax()
            ids = torch.cat([ids, nxt.view(1)])
            if nxt.item() == EOS:
                break
        row = gen[b]
        assert torch.equal(row[: len(ids)], ids), (b, row.tolist(), ids.tolist())
        assert (row[len(ids):] == PAD).all(), (b, row.tolist())

print("ok: PRIMER padded clusters match per-cluster dense references (encoder, logits, loss, greedy)")
sys.exit(0)
