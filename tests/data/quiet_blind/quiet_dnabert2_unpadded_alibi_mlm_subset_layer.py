"""DNABERT-2 (MosaicBERT backbone) masked-LM forward on a right-padded batch of DNA token ids.

Port, shrunk to tiny sizes, of zhihan1996/DNABERT-2-117M bert_layers.py (the Hub remote code that
MAGICS-LAB/DNABERT_2 loads with trust_remote_code; same text as millanp95/reproduce_dnabert_2
@bb6b89eae0e11d80e6049ce1e951068a20c84c74 bert_layers.py, plus bert_padding.py):

* BertEncoder.forward builds `extended_attention_mask = (1 - mask[:, None, None, :]) * -10000`,
  adds the symmetric ALiBi tensor `slopes * -|i - j|` sliced to the batch length, and unpads the
  hidden states (`unpad_input`) so that the MLP never sees a padded token.
* BertUnpadSelfAttention re-pads qkv (`pad_input`), runs either the Triton flash kernel that takes
  an additive bias (stand-in below, plain torch, same semantics) or the pytorch path
  (matmul + bias + softmax), and unpads again with `unpad_input_only(attention, attn_mask == 1)`.
* With labels, BertForMaskedLM passes `masked_tokens_mask = labels > 0`; BertModel ORs in the first
  column (CLS) and the encoder's last layer only computes the rows in that subset (`subset_idx`),
  while its keys still cover every real token.

Check: each sequence alone, unpadded, through a dense reference (per-query loop over every key,
ALiBi only, no mask); masked-token logits and the CLS rows must match.
"""
import math
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


# ---------------------------------------------------------------- bert_padding.py (shrunk)
def index_first_axis(x, indices):
    return x[indices]


def index_put_first_axis(values, indices, first_axis_dim):
    out = torch.zeros((first_axis_dim, *values.shape[1:]), dtype=values.dtype, device=values.device)
    out[indices] = values
    return out


def unpad_input(hidden_states, attention_mask):
    seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = int(seqlens_in_batch.max().item())
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen_in_batch


def unpad_input_only(hidden_states, attention_mask):
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    return index_first_axis(hidden_states.reshape(-1, *hidden_states.shape[2:]), indices)


def pad_input(hidden_states, indices, batch, seqlen):
    output = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return output.reshape(batch, seqlen, *hidden_states.shape[1:])


# ---------------------------------------------------------------- flash_attn_triton stand-in
def flash_attn_qkvpacked_func(qkv, bias=None, causal=False, softmax_scale=None):
    """Plain-torch stand-in for flash_attn_triton.flash_attn_qkvpacked_func.

    qkv: (batch, seqlen, 3, nheads, headdim); bias: broadcastable to (batch, nheads, seqlen, seqlen),
    added to the scaled scores before the softmax. Returns (batch, seqlen, nheads, headdim)."""
    q, k, v = qkv.unbind(dim=2)
    scale = softmax_scale or 1.0 / math.sqrt(q.shape[-1])
    scores = torch.einsum('bthd,bshd->bhts', q, k * scale)
    if bias is not None:
        scores = scores + bias
    if causal:
        s = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float('-inf'))
    attn = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return torch.einsum('bhts,bshd->bthd', attn, v)


class Cfg:
    vocab_size = 40
    hidden_size = 32
    num_attention_heads = 4
    num_hidden_layers = 2
    intermediate_size = 48
    hidden_dropout_prob = 0.0
    attention_probs_dropout_prob = 0.0
    layer_norm_eps = 1e-12
    type_vocab_size = 2
    pad_token_id = 3
    alibi_starting_size = 8          # smaller than the batch length: the tensor gets rebuilt
    max_position_embeddings = 64


USE_TRITON = True   # toggled below to run the pytorch path as well


class BertEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids, token_type_ids):
        embeddings = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.LayerNorm(embeddings))   # no position embeddings: ALiBi


class BertUnpadSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)
        self.p_dropout = config.attention_probs_dropout_prob
        self.Wqkv = nn.Linear(self.all_head_size, 3 * config.hidden_size)

    def forward(self, hidden_states, cu_seqlens, max_seqlen_in_batch, indices, attn_mask, bias):
        qkv = self.Wqkv(hidden_states)
        qkv = pad_input(qkv, indices, cu_seqlens.shape[0] - 1, max_seqlen_in_batch)  # b s (3 h d)
        b, s = qkv.shape[:2]
        qkv = qkv.view(b, s, 3, self.num_attention_heads, self.attention_head_size)
        if self.p_dropout or not USE_TRITON:
            q = qkv[:, :, 0, :, :].permute(0, 2, 1, 3)  # b h s d
            k = qkv[:, :, 1, :, :].permute(0, 2, 3, 1)  # b h d s
            v = qkv[:, :, 2, :, :].permute(0, 2, 1, 3)  # b h s d
            attention_scores = torch.matmul(q, k) / math.sqrt(self.attention_head_size)
            attention_scores = attention_scores + bias
            attention_probs = nn.functional.softmax(attention_scores, dim=-1)
            attention_probs = self.dropout(attention_probs)
            attention = torch.matmul(attention_probs, v).permute(0, 2, 1, 3)  # b s h d
        else:
            attention = flash_attn_qkvpacked_func(qkv, bias)
        # attn_mask is 1 for attend and 0 for don't
        attention = unpad_input_only(attention, torch.squeeze(attn_mask) == 1)
        return attention.reshape(attention.shape[0], -1)


class BertSelfOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dropout(self.dense(hidden_states)) + input_tensor)


class BertUnpadAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self = BertUnpadSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, input_tensor, cu_seqlens, max_s, subset_idx=None, indices=None, attn_mask=None, bias=None):
        self_output = self.self(input_tensor, cu_seqlens, max_s, indices, attn_mask, bias)
        if subset_idx is not None:
            return self.output(index_first_axis(self_output, subset_idx),
                               index_first_axis(input_tensor, subset_idx))
        return self.output(self_output, input_tensor)


class BertGatedLinearUnitMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.gated_layers = nn.Linear(config.hidden_size, config.intermediate_size * 2, bias=False)
        self.act = nn.GELU(approximate='none')
        self.wo = nn.Linear(config.intermediate_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states):
        residual_connection = hidden_states
        hidden_states = self.gated_layers(hidden_states)
        gated = hidden_states[:, :self.config.intermediate_size]
        non_gated = hidden_states[:, self.config.intermediate_size:]
        hidden_states = self.dropout(self.act(gated) * non_gated)
        hidden_states = self.wo(hidden_states)
        return self.layernorm(hidden_states + residual_connection)


class BertLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = BertUnpadAttention(config)
        self.mlp = BertGatedLinearUnitMLP(config)

    def forward(self, hidden_states, cu_seqlens, seqlen, subset_idx=None, indices=None, attn_mask=None, bias=None):
        attention_output = self.attention(hidden_states, cu_seqlens, seqlen, subset_idx, indices, attn_mask, bias)
        return self.mlp(attention_output)


def _get_alibi_head_slopes(n_heads):
    def get_slopes_power_of_2(n_heads):
        start = (2 ** (-2 ** -(math.log2(n_heads) - 3)))
        ratio = start
        return [start * ratio ** i for i in range(n_heads)]

    if math.log2(n_heads).is_integer():
        return get_slopes_power_of_2(n_heads)
    closest_power_of_2 = 2 ** math.floor(math.log2(n_heads))
    slopes_a = get_slopes_power_of_2(closest_power_of_2)
    slopes_b = _get_alibi_head_slopes(2 * closest_power_of_2)
    slopes_b = slopes_b[0::2][:n_heads - closest_power_of_2]
    return slopes_a + slopes_b


class BertEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        layer = BertLayer(config)
        self.layer = nn.ModuleList([copy.deepcopy(layer) for _ in range(config.num_hidden_layers)])
        self.num_attention_heads = config.num_attention_heads
        self._current_alibi_size = int(config.alibi_starting_size)
        self.rebuild_alibi_tensor(size=config.alibi_starting_size)

    def rebuild_alibi_tensor(self, size, device=None):
        n_heads = self.num_attention_heads
        context_position = torch.arange(size, device=device)[:, None]
        memory_position = torch.arange(size, device=device)[None, :]
        relative_position = torch.abs(memory_position - context_position)
        relative_position = relative_position.unsqueeze(0).expand(n_heads, -1, -1)
        slopes = torch.Tensor(_get_alibi_head_slopes(n_heads)).to(device)
        alibi = slopes.unsqueeze(1).unsqueeze(1) * -relative_position
        alibi = alibi.unsqueeze(0)
        assert alibi.shape == torch.Size([1, n_heads, size, size])
        self._current_alibi_size = size
        self.alibi = alibi

    def forward(self, hidden_states, attention_mask, output_all_encoded_layers=True, subset_mask=None):
        extended_attention_mask = attention_mask.unsqueeze(1).unsqueeze(2)
        extended_attention_mask = extended_attention_mask.to(dtype=next(self.parameters()).dtype)
        extended_attention_mask = (1.0 - extended_attention_mask) * -10000.0

        attention_mask_bool = attention_mask.bool()
        batch, seqlen = hidden_states.shape[:2]
        hidden_states, indices, cu_seqlens, _ = unpad_input(hidden_states, attention_mask_bool)

        if self._current_alibi_size < seqlen:
            self.rebuild_alibi_tensor(size=seqlen, device=hidden_states.device)
        alibi_bias = self.alibi[:, :, :seqlen, :seqlen]
        attn_bias = extended_attention_mask[:, :, :seqlen, :seqlen]
        alibi_attn_mask = attn_bias + alibi_bias

        all_encoder_layers = []
        if subset_mask is None:
            for layer_module in self.layer:
                hidden_states = layer_module(hidden_states, cu_seqlens, seqlen, None, indices,
                                             attn_mask=attention_mask, bias=alibi_attn_mask)
                if output_all_encoded_layers:
                    all_encoder_layers.append(hidden_states)
            hidden_states = pad_input(hidden_states, indices, batch, seqlen)
        else:
            for i in range(len(self.layer) - 1):
                hidden_states = self.layer[i](hidden_states, cu_seqlens, seqlen, None, indices,
                                              attn_mask=attention_mask, bias=alibi_attn_mask)
                if output_all_encoded_layers:
                    all_encoder_layers.append(hidden_states)
            subset_idx = torch.nonzero(subset_mask[attention_mask_bool], as_tuple=False).flatten()
            hidden_states = self.layer[-1](hidden_states, cu_seqlens, seqlen, subset_idx=subset_idx,
                                           indices=indices, attn_mask=attention_mask, bias=alibi_attn_mask)
        if not output_all_encoded_layers:
            all_encoder_layers.append(hidden_states)
        return all_encoder_layers


class BertModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)

    def forward(self, input_ids, attention_mask=None, masked_tokens_mask=None):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        token_type_ids = torch.zeros_like(input_ids)
        embedding_output = self.embeddings(input_ids, token_type_ids)
        if masked_tokens_mask is None:
            subset_mask = None
        else:
            first_col_mask = torch.zeros_like(masked_tokens_mask)
            first_col_mask[:, 0] = True
            subset_mask = masked_tokens_mask | first_col_mask
        encoder_outputs = self.encoder(embedding_output, attention_mask,
                                       output_all_encoded_layers=False, subset_mask=subset_mask)
        if masked_tokens_mask is None:
            return encoder_outputs[-1], None
        attention_mask_bool = attention_mask.bool()
        subset_idx = subset_mask[attention_mask_bool]
        sequence_output = encoder_outputs[-1][masked_tokens_mask[attention_mask_bool][subset_idx]]
        cls_output = encoder_outputs[-1][first_col_mask[attention_mask_bool][subset_idx]]
        return sequence_output, cls_output


class BertForMaskedLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.bert = BertModel(config)
        self.transform = nn.Sequential(nn.Linear(config.hidden_size, config.hidden_size), nn.GELU(),
                                       nn.LayerNorm(config.hidden_size, eps=1e-12))
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)
        self.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def forward(self, input_ids, attention_mask, labels):
        masked_tokens_mask = labels > 0
        sequence_output, cls_output = self.bert(input_ids, attention_mask, masked_tokens_mask)
        prediction_scores = self.decoder(self.transform(sequence_output))
        masked_token_idx = torch.nonzero(labels.flatten() > 0, as_tuple=False).flatten()
        loss = F.cross_entropy(prediction_scores, labels.flatten()[masked_token_idx])
        batch, seqlen = input_ids.shape[:2]
        full = index_put_first_axis(prediction_scores, masked_token_idx, batch * seqlen)
        return loss, full.view(batch, seqlen, -1), cls_output


# ---------------------------------------------------------------- independent reference
def reference_single(model, ids):
    """One unpadded sequence; dense per-query loop, ALiBi only (no mask needed)."""
    enc = model.bert.encoder
    x = model.bert.embeddings(ids[None], torch.zeros_like(ids)[None])[0]   # (L, D)
    L = x.shape[0]
    H = enc.num_attention_heads
    slopes = torch.tensor(_get_alibi_head_slopes(H))
    for layer in enc.layer:
        att = layer.attention.self
        hd = att.attention_head_size
        qkv = att.Wqkv(x).view(L, 3, H, hd)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        out = torch.zeros(L, H, hd)
        for i in range(L):
            for h in range(H):
                s = torch.stack([q[i, h] @ k[j, h] / math.sqrt(hd) - slopes[h] * abs(i - j) for j in range(L)])
                p = torch.softmax(s, dim=0)
                out[i, h] = (p[:, None] * v[:, h]).sum(0)
        a = layer.attention.output(out.reshape(L, -1), x)
        x = layer.mlp(a)
    logits = model.decoder(model.transform(x))
    return logits, x[0]


def main():
    cfg = Cfg()
    model = BertForMaskedLM(cfg).eval()
    pad = cfg.pad_token_id
    lengths = [12, 7, 10, 5]
    B, S = len(lengths), max(lengths)
    g = torch.Generator().manual_seed(1)
    input_ids = torch.full((B, S), pad, dtype=torch.long)
    attention_mask = torch.zeros(B, S, dtype=torch.long)
    labels = torch.full((B, S), -100, dtype=torch.long)
    for b, n in enumerate(lengths):
        toks = torch.randint(5, cfg.vocab_size, (n,), generator=g)
        toks[0], toks[-1] = 1, 2            # [CLS] ... [SEP]
        input_ids[b, :n] = toks
        attention_mask[b, :n] = 1           # tokenizer pads on the right
        for j in range(1, n - 1):
            if (b + j) % 3 == 0:            # MLM: replace with [MASK]=4, label = original id
                labels[b, j] = toks[j]
                input_ids[b, j] = 4

    global USE_TRITON
    results = {}
    with torch.no_grad():
        for use_triton in (True, False):
            USE_TRITON = use_triton
            model.bert.encoder.rebuild_alibi_tensor(cfg.alibi_starting_size)
            results[use_triton] = model(input_ids, attention_mask, labels)

        ok = True
        for use_triton, (loss, logits, cls_out) in results.items():
            ref_losses = []
            for b, n in enumerate(lengths):
                ref_logits, ref_cls = reference_single(model, input_ids[b, :n])
                m = labels[b, :n] > 0
                ok &= torch.allclose(logits[b, :n][m], ref_logits[m], atol=1e-4)
                ok &= torch.allclose(cls_out[b], ref_cls, atol=1e-4)
                ref_losses.append(F.cross_entropy(ref_logits[m], labels[b, :n][m], reduction='sum'))
            ref_loss = torch.stack(ref_losses).sum() / (labels > 0).sum()
            ok &= torch.allclose(loss, ref_loss, atol=1e-4)
            print(f"{'triton-standin' if use_triton else 'pytorch'} path: loss={loss.item():.5f} ref={ref_loss.item():.5f}")
    print("matches per-sequence unpadded reference:", bool(ok))
    assert ok


if __name__ == "__main__":
    main()
